// kvc::concepts::LayerPolicy (concepts/kvc/concepts/layer_policy.hpp): the shipped policies and a
// minimal archetype model it; one near-miss per named requirement does not. Compile-only.
#include <kvc/concepts/layer_policy.hpp>
#include <kvc/policies/layers.hpp>

#include <tuple>
#include <type_traits>

#include <boost/mp11/list.hpp>

// A named namespace (not an anonymous one): clang warns about unused static members of
// internal-linkage archetypes.
namespace kvc_test_layer_policy {

using kvc::concepts::has_layer_class_to_replicate;
using kvc::concepts::has_layers_list;
using kvc::concepts::LayerPolicy;

// ---- shipped policies ------------------------------------------------------------------------
static_assert(LayerPolicy<kvc::Layers<kvc::DynamicLayer>>);
static_assert(LayerPolicy<kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer>>);
static_assert(LayerPolicy<kvc::Layers<kvc::StaticLayer, kvc::StaticSlidingWindowLayer>>);
static_assert(LayerPolicy<kvc::Replicate<kvc::DynamicLayer>>);
static_assert(LayerPolicy<kvc::Replicate<kvc::StaticLayer>>);
// An empty list is a LayerPolicy; kvc::Cache rejects it with its own message.
static_assert(LayerPolicy<kvc::Layers<>>);

// ---- minimal archetypes: exactly one member type ----------------------------------------------
struct prebuilt_archetype {
  using layers = boost::mp11::mp_list<kvc::DynamicLayer>;
};
struct replicated_archetype {
  using layer_class_to_replicate = kvc::DynamicLayer;
};
static_assert(has_layers_list<prebuilt_archetype> && !has_layer_class_to_replicate<prebuilt_archetype>);
static_assert(LayerPolicy<prebuilt_archetype>);
static_assert(has_layer_class_to_replicate<replicated_archetype> && !has_layers_list<replicated_archetype>);
static_assert(LayerPolicy<replicated_archetype>);
// Any Mp11 list works, std::tuple included.
struct tuple_layers {
  using layers = std::tuple<kvc::DynamicLayer, kvc::StaticLayer>;
};
static_assert(LayerPolicy<tuple_layers>);

// ---- near-misses -----------------------------------------------------------------------------
// has_layers_list: `layers` is one layer kind, not a list of them.
struct layers_not_a_list {
  using layers = kvc::DynamicLayer;
};
static_assert(!has_layers_list<layers_not_a_list>);
static_assert(!LayerPolicy<layers_not_a_list>);

// has_layers_list: `layers` is a value, not a type.
struct layers_is_a_value {
  static constexpr int layers = 2;
};
static_assert(!has_layers_list<layers_is_a_value>);
static_assert(!LayerPolicy<layers_is_a_value>);

// has_layer_class_to_replicate: misspelt member (transformers' argument is layer_class_to_replicate).
struct misspelt_replicate {
  using layer_to_replicate = kvc::DynamicLayer;
};
static_assert(!has_layer_class_to_replicate<misspelt_replicate>);
static_assert(!LayerPolicy<misspelt_replicate>);

// Exactly one: both members is not a LayerPolicy, although each part holds.
struct both_members {
  using layers = boost::mp11::mp_list<kvc::DynamicLayer>;
  using layer_class_to_replicate = kvc::DynamicLayer;
};
static_assert(has_layers_list<both_members> && has_layer_class_to_replicate<both_members>);
static_assert(!LayerPolicy<both_members>);

// Neither member, and types that are not classes at all.
static_assert(!LayerPolicy<kvc::DynamicLayer>);
static_assert(!LayerPolicy<int>);
static_assert(!LayerPolicy<void>);

// ---- detail::layer_kinds: the kinds a policy names, empty for a malformed one -------------------
static_assert(std::is_same_v<kvc::detail::layer_kinds<kvc::Layers<kvc::DynamicLayer, kvc::StaticLayer>>,
                             boost::mp11::mp_list<kvc::DynamicLayer, kvc::StaticLayer>>);
static_assert(
    std::is_same_v<kvc::detail::layer_kinds<kvc::Replicate<kvc::StaticLayer>>, boost::mp11::mp_list<kvc::StaticLayer>>);
static_assert(std::is_same_v<kvc::detail::layer_kinds<both_members>, boost::mp11::mp_list<>>);
static_assert(std::is_same_v<kvc::detail::layer_kinds<int>, boost::mp11::mp_list<>>);

}  // namespace kvc_test_layer_policy
