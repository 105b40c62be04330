#pragma once
// kvc::ModelConfig (the fields of a transformers config.json that caches need) and the mapping
// from a config's layer types to layer kinds (transformers' get_layer_types_and_kwargs and
// DYNAMIC/STATIC_LAYER_TYPE_MAPPING, §1.12 and §3.2). Loading from JSON arrives with issue #4.

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <kvc/errors.hpp>
#include <kvc/policies/layers.hpp>

namespace kvc {

// Per-layer values that override the model-wide ones (transformers' per_layer_config).
struct LayerOverride {
  std::optional<std::int64_t> sliding_window;
  std::optional<std::int64_t> num_attention_heads;
  std::optional<std::int64_t> num_key_value_heads;
  std::optional<std::int64_t> head_dim;
};

struct ModelConfig {
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_attention_heads = 0;
  std::optional<std::int64_t> num_key_value_heads;  // defaults to num_attention_heads
  std::optional<std::int64_t> head_dim;             // defaults to hidden_size / num_attention_heads
  std::int64_t hidden_size = 0;
  std::optional<std::int64_t> sliding_window;
  std::optional<std::int64_t> attention_chunk_size;
  std::optional<std::vector<std::string>> layer_types;
  std::int64_t num_kv_shared_layers = 0;
  std::map<std::int64_t, LayerOverride> per_layer_config;

  std::int64_t layer_num_attention_heads(std::int64_t layer) const {
    return override_or(layer, &LayerOverride::num_attention_heads, num_attention_heads);
  }
  std::int64_t layer_num_key_value_heads(std::int64_t layer) const {
    const auto it = per_layer_config.find(layer);
    if (it != per_layer_config.end() && it->second.num_key_value_heads) return *it->second.num_key_value_heads;
    if (it != per_layer_config.end() && it->second.num_attention_heads && !num_key_value_heads)
      return *it->second.num_attention_heads;
    return num_key_value_heads.value_or(num_attention_heads);
  }
  std::int64_t layer_head_dim(std::int64_t layer) const {
    const auto it = per_layer_config.find(layer);
    if (it != per_layer_config.end() && it->second.head_dim) return *it->second.head_dim;
    if (head_dim) return *head_dim;
    const std::int64_t heads = layer_num_attention_heads(layer);
    if (heads < 1 || hidden_size < 1)
      throw ValueError("ModelConfig: head_dim is not set and cannot be derived from hidden_size " +
                       std::to_string(hidden_size) + " and num_attention_heads " + std::to_string(heads));
    return hidden_size / heads;
  }

 private:
  std::int64_t override_or(std::int64_t layer, std::optional<std::int64_t> LayerOverride::*field,
                           std::int64_t fallback) const {
    const auto it = per_layer_config.find(layer);
    return it != per_layer_config.end() && (it->second.*field) ? *(it->second.*field) : fallback;
  }
};

// One layer of a config: its type string and the window it uses (sliding and chunked layers).
struct LayerSpec {
  std::string type;
  std::optional<std::int64_t> sliding_window;
};

// The layer types kvc builds caches for so far, in transformers' mapping order.
inline constexpr std::array<std::string_view, 3> known_layer_types{"full_attention", "sliding_attention",
                                                                   "chunked_attention"};

// transformers' get_layer_types_and_kwargs, with each layer's own window: sliding layers use
// sliding_window, chunked layers attention_chunk_size (transformers lets the chunk size overwrite
// the window of every layer when both kinds are present, §5 item 33), and per_layer_config wins.
inline std::vector<LayerSpec> layer_specs(const ModelConfig& config) {
  if (config.num_hidden_layers < 0)
    throw ValueError("ModelConfig: num_hidden_layers must be 0 or more, got " + std::to_string(config.num_hidden_layers));
  std::vector<std::string> types;
  if (config.layer_types) {
    types = *config.layer_types;
  } else {
    const char* type = config.sliding_window         ? "sliding_attention"
                       : config.attention_chunk_size ? "chunked_attention"
                                                     : "full_attention";
    types.assign(static_cast<std::size_t>(config.num_hidden_layers), type);
  }
  if (config.num_kv_shared_layers > 0)
    types.resize(types.size() - std::min(types.size(), static_cast<std::size_t>(config.num_kv_shared_layers)));

  std::vector<LayerSpec> specs;
  specs.reserve(types.size());
  for (std::size_t i = 0; i < types.size(); ++i) {
    LayerSpec spec{types[i], std::nullopt};
    if (types[i] == "sliding_attention") spec.sliding_window = config.sliding_window;
    if (types[i] == "chunked_attention") spec.sliding_window = config.attention_chunk_size;
    const auto it = config.per_layer_config.find(static_cast<std::int64_t>(i));
    if (it != config.per_layer_config.end() && it->second.sliding_window) {
      spec.sliding_window = it->second.sliding_window;
      // transformers' per-layer window turns a full-attention layer into a sliding one (test 4.2-7).
      if (spec.type == "full_attention") spec.type = "sliding_attention";
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

namespace detail {
[[noreturn]] inline void throw_unknown_layer_type(const std::string& type) {
  throw KeyError("'" + type + "' is not a known layer type. Known layer types: " + py_str_tuple(known_layer_types));
}
inline std::int64_t window_of(const LayerSpec& spec, std::size_t layer) {
  if (!spec.sliding_window)
    throw ValueError("layer " + std::to_string(layer) + " is '" + spec.type +
                     "' but the config sets no " +
                     (spec.type == "chunked_attention" ? "attention_chunk_size" : "sliding_window"));
  return *spec.sliding_window;
}
}  // namespace detail

using DynamicLayerKind = std::variant<DynamicLayer, DynamicSlidingWindowLayer>;
using StaticLayerKind = std::variant<StaticLayer, StaticSlidingWindowLayer>;

// DYNAMIC_LAYER_TYPE_MAPPING: an unknown type is a KeyError naming it and the known ones.
inline std::vector<DynamicLayerKind> dynamic_layer_kinds(const ModelConfig& config) {
  std::vector<DynamicLayerKind> out;
  const auto specs = layer_specs(config);
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const auto& spec = specs[i];
    if (spec.type == "full_attention")
      out.emplace_back(DynamicLayer{});
    else if (spec.type == "sliding_attention" || spec.type == "chunked_attention")
      out.emplace_back(DynamicSlidingWindowLayer{detail::window_of(spec, i)});
    else
      detail::throw_unknown_layer_type(spec.type);
  }
  return out;
}

// STATIC_LAYER_TYPE_MAPPING, every layer built with `max_cache_len`.
inline std::vector<StaticLayerKind> static_layer_kinds(const ModelConfig& config, std::int64_t max_cache_len) {
  if (max_cache_len < 1)
    throw ValueError("StaticCache: max_cache_len must be a positive integer, got " + std::to_string(max_cache_len));
  std::vector<StaticLayerKind> out;
  const auto specs = layer_specs(config);
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const auto& spec = specs[i];
    if (spec.type == "full_attention")
      out.emplace_back(StaticLayer{max_cache_len});
    else if (spec.type == "sliding_attention" || spec.type == "chunked_attention")
      out.emplace_back(StaticSlidingWindowLayer{max_cache_len, detail::window_of(spec, i)});
    else
      detail::throw_unknown_layer_type(spec.type);
  }
  return out;
}

}  // namespace kvc
