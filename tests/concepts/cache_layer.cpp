// kvc::concepts::CacheLayer<K, S> and the optional capabilities
// (concepts/kvc/concepts/cache_layer.hpp): the shipped layer kinds and a minimal archetype model
// it; one near-miss per named requirement does not. Compile-only.
#include <kvc/concepts/cache_layer.hpp>
#include <kvc/policies/layers.hpp>
#include <kvc/policies/storage/host.hpp>

#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>
#include <utility>

#include <boost/mp11/algorithm.hpp>
#include <boost/mp11/list.hpp>

// A named namespace (not an anonymous one): clang warns about unused static members of
// internal-linkage archetypes.
namespace kvc_test_cache_layer {

using namespace kvc::concepts;  // CacheLayer, its has_* parts and the supports_* capabilities
namespace mp = boost::mp11;

template <class K, class S>
using state_t = typename K::template state<S>;

// ---- shipped layer kinds, for every element type HostStorage supports -------------------------
using element_types = mp::mp_list<float, double, Eigen::half, Eigen::bfloat16>;
using layer_kinds =
    mp::mp_list<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer, kvc::StaticLayer, kvc::StaticSlidingWindowLayer>;
template <class K, class T>
using models = std::bool_constant<CacheLayer<K, kvc::HostStorage<T>>>;
static_assert(mp::mp_all_of<mp::mp_product<models, layer_kinds, element_types>, mp::mp_to_bool>::value);
static_assert(CacheLayer<kvc::DynamicLayer, kvc::HostStorage<float>>);
static_assert(CacheLayer<kvc::StaticSlidingWindowLayer, kvc::HostStorage<Eigen::bfloat16>>);

// Optional capabilities of the shipped states (what Cache::crop, batch_* and set_write_position
// look for).
using dyn = state_t<kvc::DynamicLayer, kvc::HostStorage<float>>;
using dyn_sliding = state_t<kvc::DynamicSlidingWindowLayer, kvc::HostStorage<float>>;
using fixed = state_t<kvc::StaticLayer, kvc::HostStorage<float>>;
using fixed_sliding = state_t<kvc::StaticSlidingWindowLayer, kvc::HostStorage<float>>;
static_assert(supports_crop<dyn> && supports_crop<dyn_sliding>);
static_assert(!supports_crop<fixed> && !supports_crop<fixed_sliding>);
static_assert(supports_batch_ops<dyn> && supports_batch_ops<dyn_sliding>);
static_assert(!supports_batch_ops<fixed> && !supports_batch_ops<fixed_sliding>);
static_assert(supports_write_position<fixed>);
static_assert(!supports_write_position<dyn> && !supports_write_position<dyn_sliding> &&
              !supports_write_position<fixed_sliding>);
static_assert(supports_past_recording<dyn_sliding> && !supports_past_recording<dyn>);

// ---- minimal archetype, and near-misses made from it by one defect each -------------------------
enum class defect { none, state_ctor, traits, update, length_queries, lifecycle, buffer_walk };

template <defect D = defect::none>
struct layer_archetype {
  template <class S>
  struct state {
    using view = typename S::view_type;
    static constexpr bool is_sliding = false;
    static constexpr bool is_compileable = false;
    static constexpr bool supports_early_init = false;
    // traits: a name that is a number, not a string.
    static constexpr std::conditional_t<D == defect::traits, int, std::string_view> name{};

    // state_ctor: no constructor from the layer kind.
    explicit state(const layer_archetype&)
      requires(D != defect::state_ctor);
    // update: returns a std::pair instead of kvc::KV.
    std::conditional_t<D == defect::update, std::pair<view, view>, kvc::KV<view>> update(const view& k, const view& v);
    std::int64_t get_seq_length() const;
    std::int64_t get_max_length() const;
    // length_queries: (kv_length, kv_offset) as ints instead of int64_t.
    std::conditional_t<D == defect::length_queries, std::pair<int, int>, std::pair<std::int64_t, std::int64_t>>
    get_mask_sizes(std::int64_t query_length) const;
    bool is_initialized() const;
    kvc::LayerShape shape() const;
    void lazy_initialization(kvc::LayerShape shape);
    void reset();
    kvc::KV<view> stored() const;
    // lifecycle: gathers in place instead of returning a copy.
    std::conditional_t<D == defect::lifecycle, void, state> gathered(std::span<const std::int64_t> batch) const;
    std::int64_t bytes() const;
    // buffer_walk: no for_each_buffer (an offloading cache would never move this layer).
    template <class F>
    void for_each_buffer(F&& f)
      requires(D != defect::buffer_walk);
  };
};

using host = kvc::HostStorage<float>;
using archetype = layer_archetype<>;
static_assert(has_layer_state<archetype, host> && has_layer_traits<state_t<archetype, host>> &&
              has_update<state_t<archetype, host>, host> && has_length_queries<state_t<archetype, host>> &&
              has_lifecycle<state_t<archetype, host>, host> && has_buffer_walk<state_t<archetype, host>>);
static_assert(CacheLayer<archetype, host>);
static_assert(CacheLayer<archetype, kvc::HostStorage<Eigen::half>>);
// The archetype has none of the optional capabilities, and needs none.
static_assert(!supports_crop<state_t<archetype, host>> && !supports_batch_ops<state_t<archetype, host>> &&
              !supports_write_position<state_t<archetype, host>> && !supports_past_recording<state_t<archetype, host>>);

// has_layer_state: no nested state<S> at all (a plain config struct).
struct no_state {
  std::int64_t sliding_window = 0;
};
static_assert(!has_layer_state<no_state, host>);
static_assert(!CacheLayer<no_state, host>);
static_assert(!CacheLayer<int, host>);

// has_layer_state: the state cannot be built from the kind.
using no_ctor = layer_archetype<defect::state_ctor>;
static_assert(!has_layer_state<no_ctor, host>);
static_assert(!CacheLayer<no_ctor, host>);

// has_layer_traits
using bad_traits = layer_archetype<defect::traits>;
static_assert(has_layer_state<bad_traits, host> && !has_layer_traits<state_t<bad_traits, host>>);
static_assert(!CacheLayer<bad_traits, host>);

// has_update
using bad_update = layer_archetype<defect::update>;
static_assert(!has_update<state_t<bad_update, host>, host>);
static_assert(!CacheLayer<bad_update, host>);

// has_length_queries
using bad_lengths = layer_archetype<defect::length_queries>;
static_assert(!has_length_queries<state_t<bad_lengths, host>>);
static_assert(!CacheLayer<bad_lengths, host>);

// has_lifecycle
using bad_lifecycle = layer_archetype<defect::lifecycle>;
static_assert(!has_lifecycle<state_t<bad_lifecycle, host>, host>);
static_assert(!CacheLayer<bad_lifecycle, host>);

// has_buffer_walk
using no_buffer_walk = layer_archetype<defect::buffer_walk>;
static_assert(has_lifecycle<state_t<no_buffer_walk, host>, host> && !has_buffer_walk<state_t<no_buffer_walk, host>>);
static_assert(!CacheLayer<no_buffer_walk, host>);

// supports_batch_ops needs the flag to be true, not only present (StaticLayer's is false).
static_assert(requires { fixed::supports_batch_ops; } && !supports_batch_ops<fixed>);

}  // namespace kvc_test_cache_layer
