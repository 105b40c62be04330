// static_assert examples of kvc's concepts, quoted by docs/concepts/*.md. Compile-only: CTest
// builds this file (tests/CMakeLists.txt, kvc_docs_examples); every assert holds.
#include <kvc/kvc.hpp>

#include <cstdint>

#include <boost/mp11/list.hpp>

namespace kvc_docs_static_assert_examples {

// [snippet:layer_policy_check]
// A layer policy names exactly one of `layers` (pre-built) or `layer_class_to_replicate`.
static_assert(kvc::concepts::LayerPolicy<kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer>>);
static_assert(kvc::concepts::LayerPolicy<kvc::Replicate<kvc::DynamicLayer>>);

struct BothMembers {  // kvc::Cache<BothMembers> fails with transformers' message
  using layers = boost::mp11::mp_list<kvc::DynamicLayer>;
  using layer_class_to_replicate = kvc::DynamicLayer;
};
static_assert(!kvc::concepts::LayerPolicy<BothMembers>);
static_assert(!kvc::concepts::LayerPolicy<kvc::DynamicLayer>);  // a layer kind is not a policy
// [/snippet]

// [snippet:storage_policy_check]
// HostStorage<T> is a storage policy for any T; it supports the six element types.
static_assert(kvc::concepts::StoragePolicy<kvc::HostStorage<Eigen::bfloat16>>);
static_assert(kvc::concepts::supports_its_element_type<kvc::HostStorage<Eigen::half>>);

static_assert(kvc::concepts::StoragePolicy<kvc::HostStorage<int>>);
static_assert(!kvc::concepts::supports_its_element_type<kvc::HostStorage<int>>);

// The element type alone is not a storage policy: write HostStorage<float>, not float.
static_assert(!kvc::concepts::StoragePolicy<float>);
// [/snippet]

// [snippet:cache_layer_check]
// A layer kind models CacheLayer for a storage policy through its state<S>.
using Host = kvc::HostStorage<float>;
static_assert(kvc::concepts::CacheLayer<kvc::DynamicLayer, Host>);
static_assert(kvc::concepts::CacheLayer<kvc::StaticSlidingWindowLayer, Host>);
static_assert(!kvc::concepts::CacheLayer<int, Host>);

// Optional capabilities are detected on the state: only dynamic layers can be cropped,
// only StaticLayer has a write position.
using Dynamic = kvc::DynamicLayer::state<Host>;
using Static = kvc::StaticLayer::state<Host>;
static_assert(kvc::concepts::supports_crop<Dynamic> && !kvc::concepts::supports_crop<Static>);
static_assert(kvc::concepts::supports_write_position<Static> && !kvc::concepts::supports_write_position<Dynamic>);
// [/snippet]

// [snippet:offload_policy_check]
// An offload policy is checked against the storage it would move.
static_assert(kvc::concepts::OffloadPolicy<kvc::NoOffload, Host>);
static_assert(kvc::concepts::serves_storage<kvc::NoOffload, Host>);

struct DeviceOnly {
  template <class S>
  static constexpr bool serves = S::space == kvc::memory_space::device;
  template <class S>
  struct engine {
    template <class Cache>
    void before_update(Cache&, std::int64_t) {}
    template <class Cache>
    void after_update(Cache&, std::int64_t) {}
  };
};
static_assert(kvc::concepts::OffloadPolicy<DeviceOnly, Host>);    // well-formed...
static_assert(!kvc::concepts::serves_storage<DeviceOnly, Host>);  // ...but not for host storage
// [/snippet]

// [snippet:valid_cache_config_check]
// ValidCacheConfig is what kvc::Cache<L, S, O> requires; checking it never instantiates the Cache.
static_assert(kvc::concepts::ValidCacheConfig<kvc::Replicate<kvc::DynamicLayer>, Host, kvc::NoOffload>);
static_assert(!kvc::concepts::ValidCacheConfig<kvc::Layers<>, Host, kvc::NoOffload>);
static_assert(!kvc::concepts::ValidCacheConfig<kvc::Replicate<kvc::DynamicLayer>, Host, DeviceOnly>);
// [/snippet]

}  // namespace kvc_docs_static_assert_examples
