// Compile-only checks of kvc's value types and cache configurations (STYLE.md section 7):
// views are trivially copyable, KV destructures, and kvc::concepts::ValidCacheConfig accepts the
// ready-made caches and rejects misuses without instantiating kvc::Cache (the primary template's
// static_asserts would stop this TU if it were instantiated).
#include <kvc/kvc.hpp>

#include <cstdint>
#include <type_traits>

#include <boost/mp11/algorithm.hpp>
#include <boost/mp11/list.hpp>

namespace kvc_test_views {

namespace mp = boost::mp11;
using kvc::concepts::ValidCacheConfig;
using element_types = mp::mp_list<float, double, Eigen::half, Eigen::bfloat16>;

// ---- views: non-owning, trivially copyable, passed by value -----------------------------------
template <class T>
using view_is_trivial = std::bool_constant<std::is_trivially_copyable_v<kvc::TensorView<T>> &&
                                           std::is_trivially_copyable_v<kvc::KV<kvc::TensorView<T>>>>;
static_assert(std::is_trivially_copyable_v<kvc::TensorView<float>>);
static_assert(mp::mp_all_of<element_types, view_is_trivial>::value);
static_assert(std::is_trivially_copyable_v<kvc::LayerShape>);
static_assert(std::is_same_v<kvc::HostStorage<Eigen::half>::view_type, kvc::TensorView<Eigen::half>>);

// ---- KV: `auto [k, v] = cache.update(...)` -----------------------------------------------------
constexpr bool kv_destructures() {
  constexpr float data[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  kvc::KV<kvc::TensorView<float>> kv{{data, {1, 1, 2, 2}, {4, 4, 2, 1}}, {data + 4, {1, 1, 1, 2}, {2, 2, 2, 1}}};
  auto [k, v] = kv;
  static_assert(std::is_same_v<decltype(k), kvc::TensorView<float>>);
  return k.size() == 4 && v.size() == 2 && k(0, 0, 1, 1) == 3 && v(0, 0, 0, 1) == 5;
}
static_assert(kv_destructures());
static_assert(std::is_same_v<kvc::DynamicCache<float>::kv_type, kvc::KV<kvc::TensorView<float>>>);

// ---- ValidCacheConfig: the ready-made caches ---------------------------------------------------
// The (LayerPolicy, StoragePolicy, OffloadPolicy) of a cache type, deduced through its kvc::Cache base.
template <class L, class S, class O>
mp::mp_list<L, S, O> config_of(const kvc::Cache<L, S, O>*);
template <class C>
using config_t = decltype(config_of(static_cast<C*>(nullptr)));
template <class L, class S, class O>
using valid = std::bool_constant<ValidCacheConfig<L, S, O>>;
template <class C>
using valid_cache = mp::mp_apply<valid, config_t<C>>;

template <class T>
using ready_made_valid =
    std::bool_constant<valid_cache<kvc::DynamicCache<T>>::value && valid_cache<kvc::ConfiguredDynamicCache<T>>::value &&
                       valid_cache<kvc::StaticCache<T>>::value>;
static_assert(mp::mp_all_of<element_types, ready_made_valid>::value);
static_assert(ValidCacheConfig<kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<float>, kvc::NoOffload>);
static_assert(std::is_same_v<config_t<kvc::StaticCache<Eigen::bfloat16>>,
                             mp::mp_list<kvc::StaticCacheLayers, kvc::HostStorage<Eigen::bfloat16>, kvc::NoOffload>>);
// A cache may mix static and dynamic layer kinds.
static_assert(
    ValidCacheConfig<kvc::Layers<kvc::DynamicLayer, kvc::StaticLayer>, kvc::HostStorage<double>, kvc::NoOffload>);

// ---- ValidCacheConfig: misuses, one per Cache static_assert (none instantiates kvc::Cache) ----------
struct both_members {
  using layers = mp::mp_list<kvc::DynamicLayer>;
  using layer_class_to_replicate = kvc::DynamicLayer;
};
struct engine_only {
  template <class S>
  struct engine {};
};
struct device_only {
  template <class S>
  static constexpr bool serves = S::space == kvc::memory_space::device;
  template <class S>
  struct engine {};
};
using replicated = kvc::Replicate<kvc::DynamicLayer>;
using host = kvc::HostStorage<float>;
static_assert(!ValidCacheConfig<both_members, host, kvc::NoOffload>);                         // both members
static_assert(!ValidCacheConfig<int, host, kvc::NoOffload>);                                  // neither member
static_assert(!ValidCacheConfig<kvc::Layers<>, host, kvc::NoOffload>);                        // empty list
static_assert(!ValidCacheConfig<replicated, float, kvc::NoOffload>);                          // not a storage
static_assert(!ValidCacheConfig<replicated, kvc::HostStorage<int>, kvc::NoOffload>);          // element type
static_assert(!ValidCacheConfig<replicated, host, engine_only>);                              // not an offload
static_assert(!ValidCacheConfig<replicated, host, device_only>);                              // cannot serve
static_assert(!ValidCacheConfig<kvc::Layers<kvc::DynamicLayer, int>, host, kvc::NoOffload>);  // not a layer
static_assert(!ValidCacheConfig<kvc::Replicate<int>, host, kvc::NoOffload>);                  // not a layer
// Naming the misconfigured type is fine too; only completing it fires the static_asserts.
static_assert(!std::is_same_v<kvc::DynamicCache<int>, kvc::DynamicCache<float>>);

}  // namespace kvc_test_views
