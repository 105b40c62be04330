#pragma once
// The one table of a config's layer types: each row names a `layer_types` string, the layer kind
// transformers' DYNAMIC_LAYER_TYPE_MAPPING builds for it, the one STATIC_LAYER_TYPE_MAPPING builds
// (cache_utils.py), and which config field gives its window. Everything else is derived from it:
// the known names (in transformers' order, as its KeyError lists them), the layer policies of
// make_dynamic_cache's cache and StaticCache (each kind once, in the order of first appearance),
// their kind variants, and the string → kind mapping. Adding a layer type is one row (and, for a
// new kind, one case in detail::build_kind).

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <boost/mp11/algorithm.hpp>
#include <boost/mp11/list.hpp>

#include <kvc/detail/fixed_name.hpp>
#include <kvc/errors.hpp>
#include <kvc/policies/layers/kinds.hpp>

namespace kvc {

// One layer of a config: its type string and the window it uses (sliding and chunked layers).
struct LayerSpec {
  // The layer type string, as in a config's layer_types ("full_attention", ...).
  std::string type;
  // The layer's window (sliding window or attention chunk), if it uses one.
  std::optional<std::int64_t> sliding_window;
  std::int64_t number_of_states = 1;  // linear-attention layers and hybrids
};

// The config field a layer type takes its window from.
enum class window_field { none, sliding_window, attention_chunk_size };

// One row of the layer-type table: a layer_types string, the layer kinds the dynamic and static
// mappings build for it, and the config field its window comes from.
template <detail::fixed_name Name, class Dynamic, class Static, window_field Window = window_field::none>
struct layer_type_row {
  // The layer_types string.
  static constexpr std::string_view name = Name.view();
  // The layer kind DYNAMIC_LAYER_TYPE_MAPPING builds.
  using dynamic_kind = Dynamic;
  // The layer kind STATIC_LAYER_TYPE_MAPPING builds.
  using static_kind = Static;
  // The config field the layer's window comes from (none: no window).
  static constexpr window_field window = Window;
};

// DYNAMIC/STATIC_LAYER_TYPE_MAPPING, in transformers' order.
using layer_type_table = boost::mp11::mp_list<
    layer_type_row<"full_attention", DynamicLayer, StaticLayer>,
    layer_type_row<"sliding_attention", DynamicSlidingWindowLayer, StaticSlidingWindowLayer,
                   window_field::sliding_window>,
    layer_type_row<"chunked_attention", DynamicSlidingWindowLayer, StaticSlidingWindowLayer,
                   window_field::attention_chunk_size>,
    layer_type_row<"conv", LinearAttentionLayer, LinearAttentionLayer>,
    layer_type_row<"linear_attention", LinearAttentionLayer, LinearAttentionLayer>,
    layer_type_row<"hybrid", LinearAttentionAndFullAttentionLayer, LinearAttentionAndStaticFullAttentionLayer>,
    layer_type_row<"hybrid_sliding", LinearAttentionAndSlidingWindowAttentionLayer,
                   LinearAttentionAndStaticSlidingWindowAttentionLayer, window_field::sliding_window>,
    layer_type_row<"deepseek_sparse_attention", DynamicIndexedLayer, StaticIndexedLayer>,
    // Not attention layers: an empty linear-attention layer, so that length and mask queries skip them.
    layer_type_row<"moe", LinearAttentionLayer, LinearAttentionLayer>,
    layer_type_row<"mlp", LinearAttentionLayer, LinearAttentionLayer>>;

namespace detail {
template <class Row>
using dynamic_kind_of = typename Row::dynamic_kind;
template <class Row>
using static_kind_of = typename Row::static_kind;
}  // namespace detail

// The layer types of DYNAMIC/STATIC_LAYER_TYPE_MAPPING, in transformers' order.
inline constexpr auto known_layer_types = detail::row_names(layer_type_table{});

// Every kind each mapping builds, once each, in the order the table first names them.
using dynamic_layer_kind_list =
    boost::mp11::mp_unique<boost::mp11::mp_transform<detail::dynamic_kind_of, layer_type_table>>;
// Every kind the static mapping builds, once each, in the order the table first names them.
using static_layer_kind_list =
    boost::mp11::mp_unique<boost::mp11::mp_transform<detail::static_kind_of, layer_type_table>>;
// One layer's kind from the dynamic mapping (a std::variant of dynamic_layer_kind_list), as
// dynamic_layer_kinds returns them.
using DynamicLayerKind = boost::mp11::mp_rename<dynamic_layer_kind_list, std::variant>;
// One layer's kind from the static mapping (a std::variant of static_layer_kind_list), as
// static_layer_kinds returns them.
using StaticLayerKind = boost::mp11::mp_rename<static_layer_kind_list, std::variant>;
// The layer policies of make_dynamic_cache's cache and of StaticCache.
using ConfiguredDynamicLayers = boost::mp11::mp_rename<dynamic_layer_kind_list, Layers>;
// The layer policy of StaticCache.
using StaticCacheLayers = boost::mp11::mp_rename<static_layer_kind_list, Layers>;

namespace detail {
[[noreturn]] inline void throw_unknown_layer_type(const std::string& type) {
  throw KeyError("'" + type + "' is not a known layer type. Known layer types: " + py_str_tuple(known_layer_types));
}

// The window field of a layer type (none for a type the table does not name).
inline window_field window_field_of(std::string_view type) {
  window_field out = window_field::none;
  boost::mp11::mp_for_each<layer_type_table>([&](auto row) {
    if (decltype(row)::name == type) out = decltype(row)::window;
  });
  return out;
}

inline std::int64_t window_of(const LayerSpec& spec, std::size_t layer) {
  if (!spec.sliding_window)
    throw ValueError(
        "layer " + std::to_string(layer) + " is '" + spec.type + "' but the config sets no " +
        (window_field_of(spec.type) == window_field::attention_chunk_size ? "attention_chunk_size" : "sliding_window"));
  return *spec.sliding_window;
}

// The kind of layer `layer` (spec) for a cache whose static layers hold `max_cache_len` slots.
template <class Kind>
Kind build_kind(const LayerSpec& spec, std::size_t layer, std::int64_t max_cache_len) {
  if constexpr (std::is_same_v<Kind, DynamicLayer> || std::is_same_v<Kind, DynamicIndexedLayer>)
    return Kind{};
  else if constexpr (std::is_same_v<Kind, StaticLayer> || std::is_same_v<Kind, StaticIndexedLayer>)
    return Kind{max_cache_len};
  else if constexpr (std::is_same_v<Kind, DynamicSlidingWindowLayer>)
    return Kind{window_of(spec, layer)};
  else if constexpr (std::is_same_v<Kind, StaticSlidingWindowLayer>)
    return Kind{max_cache_len, window_of(spec, layer)};
  else if constexpr (std::is_same_v<Kind, LinearAttentionLayer>)
    return Kind{spec.number_of_states};
  else  // a LinearAttentionHybrid: its attention part, then its states
    return Kind{build_kind<decltype(Kind::attention)>(spec, layer, max_cache_len), spec.number_of_states};
}

// One mapping over a config's layers (Static picks the static kinds); an unknown type is a
// KeyError naming it and the known ones.
template <class Variant, bool Static>
std::vector<Variant> kinds_of_specs(const std::vector<LayerSpec>& specs, std::int64_t max_cache_len) {
  std::vector<Variant> out;
  out.reserve(specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    bool found = false;
    boost::mp11::mp_for_each<layer_type_table>([&](auto row) {
      using R = decltype(row);
      if (found || R::name != specs[i].type) return;
      using Kind = std::conditional_t<Static, typename R::static_kind, typename R::dynamic_kind>;
      out.emplace_back(build_kind<Kind>(specs[i], i, max_cache_len));
      found = true;
    });
    if (!found) throw_unknown_layer_type(specs[i].type);
  }
  return out;
}
}  // namespace detail

}  // namespace kvc
