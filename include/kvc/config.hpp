#pragma once
// kvc::ModelConfig (the fields of a transformers config.json that caches need) and the mapping
// from a config's layer types to layer kinds (transformers' get_layer_types_and_kwargs and
// DYNAMIC/STATIC_LAYER_TYPE_MAPPING in cache_utils.py; the table itself is <kvc/layer_types.hpp>),
// and get_head_shapes. ModelConfig::from_json / from_file, which
// read a real transformers config.json the way its configuration class does
// (docs/model_configs.md), are defined in <kvc/config_json.hpp> (part of <kvc/runtime.hpp>), so
// that a translation unit which fills its config in code does not parse a JSON library.

#include <algorithm>
#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/layer_types.hpp>
#include <kvc/warnings.hpp>

namespace kvc {

// Per-layer values that override the model-wide ones (transformers' per_layer_config).
struct LayerOverride {
  // The layer's window (a full-attention layer with one becomes a sliding layer).
  std::optional<std::int64_t> sliding_window;
  // The layer's number of query heads.
  std::optional<std::int64_t> num_attention_heads;
  // The layer's number of key/value heads.
  std::optional<std::int64_t> num_key_value_heads;
  // The layer's head dimension.
  std::optional<std::int64_t> head_dim;
};

namespace detail {
// What reads a config from JSON, defined by <kvc/config_json.hpp>.
template <class Config>
struct include_kvc_runtime_hpp_to_read_json;
}  // namespace detail

// The fields of a transformers config.json that caches need: layer count, heads, head_dim, windows
// and layer types. Filled in code or read by from_json / from_file.
struct ModelConfig {
  // The number of decoder layers.
  std::int64_t num_hidden_layers = 0;
  // The number of query heads per layer.
  std::int64_t num_attention_heads = 0;
  std::optional<std::int64_t> num_key_value_heads;  // defaults to num_attention_heads
  std::optional<std::int64_t> head_dim;             // defaults to hidden_size / num_attention_heads
  // The model width: head_dim defaults to hidden_size / num_attention_heads.
  std::int64_t hidden_size = 0;
  // The window of sliding layers; without layer_types, it makes every layer a sliding layer.
  std::optional<std::int64_t> sliding_window;
  // The chunk of chunked-attention layers; without layer_types and sliding_window, it makes every
  // layer a chunked one.
  std::optional<std::int64_t> attention_chunk_size;
  // Each layer's type ("full_attention", "sliding_attention", ...: known_layer_types); unset, every
  // layer is full, sliding or chunked as the fields above say.
  std::optional<std::vector<std::string>> layer_types;
  // The number of last layers that reuse earlier layers' keys and values and have no cache layer.
  std::int64_t num_kv_shared_layers = 0;
  // States per linear-attention layer (transformers reads getattr(config, "number_of_conv_states", 1)).
  std::int64_t number_of_conv_states = 1;
  // Per-layer overrides, by layer index (transformers' per_layer_config).
  std::map<std::int64_t, LayerOverride> per_layer_config;
  // The model_type of the (text) config the layout came from: transformers'
  // get_text_config(decoder=True).model_type ("gemma3_text" for a Gemma 3 multimodal file, "llama"
  // for LLaVA 1.5). Empty when the file names none.
  std::string model_type;
  // An encoder-decoder model (T5, Whisper, BART): generate() pairs its self-attention cache with a
  // cross-attention cache (kvc::EncoderDecoderCache).
  bool is_encoder_decoder = false;

  // A transformers config.json: the nested text config when there is one, the derivation of
  // layer_types and the class defaults of the model_type (docs/model_configs.md). Throws
  // ValueError naming the field for a wrong type, a negative or absurd size, or malformed JSON.
  // Needs <kvc/config_json.hpp> (or <kvc/runtime.hpp>); without it the call names
  // detail::include_kvc_runtime_hpp_to_read_json as an incomplete type.
  template <class Reader = detail::include_kvc_runtime_hpp_to_read_json<ModelConfig>>
  static ModelConfig from_json(std::string_view text) {
    return Reader::from_json(text);
  }
  // The same from a file, or from `<path>/config.json` when `path` is a directory (like
  // from_pretrained). RuntimeError when it cannot be opened.
  template <class Reader = detail::include_kvc_runtime_hpp_to_read_json<ModelConfig>>
  static ModelConfig from_file(const std::filesystem::path& path) {
    return Reader::from_file(path);
  }

  // The number of query heads of layer `layer`: its override, else num_attention_heads.
  std::int64_t layer_num_attention_heads(std::int64_t layer) const {
    return override_or(layer, &LayerOverride::num_attention_heads, num_attention_heads);
  }
  // The number of key/value heads of layer `layer`: its override, else its overridden query heads
  // (when num_key_value_heads is unset), else num_key_value_heads, else num_attention_heads.
  std::int64_t layer_num_key_value_heads(std::int64_t layer) const {
    const auto it = per_layer_config.find(layer);
    if (it != per_layer_config.end() && it->second.num_key_value_heads) return *it->second.num_key_value_heads;
    if (it != per_layer_config.end() && it->second.num_attention_heads && !num_key_value_heads)
      return *it->second.num_attention_heads;
    return num_key_value_heads.value_or(num_attention_heads);
  }
  // The head dimension of layer `layer`: its override, else head_dim, else hidden_size divided by
  // the layer's query heads; ValueError when it is not set and cannot be derived.
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

namespace detail {
// The ranges ModelConfig::from_json enforces, for a ModelConfig filled in code (every consumer
// reaches the config through layer_specs): ValueError naming the field.
inline void check_model_config(const ModelConfig& c) {
  check_size("ModelConfig: num_hidden_layers", c.num_hidden_layers, 0, max_layers);
  check_size("ModelConfig: num_attention_heads", c.num_attention_heads, 0, max_layers);
  if (c.num_key_value_heads) check_size("ModelConfig: num_key_value_heads", *c.num_key_value_heads, 1, max_layers);
  if (c.head_dim) check_size("ModelConfig: head_dim", *c.head_dim, 1, max_extent);
  check_size("ModelConfig: hidden_size", c.hidden_size, 0, max_extent);
  if (c.sliding_window) check_size("ModelConfig: sliding_window", *c.sliding_window, 1, max_extent);
  if (c.attention_chunk_size) check_size("ModelConfig: attention_chunk_size", *c.attention_chunk_size, 1, max_extent);
  if (c.layer_types)
    check_size("ModelConfig: the length of layer_types", static_cast<std::int64_t>(c.layer_types->size()), 0,
               max_layers);
  check_size("ModelConfig: num_kv_shared_layers", c.num_kv_shared_layers, 0, max_layers);
  check_size("ModelConfig: number_of_conv_states", c.number_of_conv_states, 1, max_layers);
  for (const auto& [layer, o] : c.per_layer_config) {
    const std::string at = "ModelConfig: per_layer_config[" + std::to_string(layer) + "]";
    check_size(at + " (a layer index)", layer, 0, max_layers - 1);
    if (o.sliding_window) check_size(at + ".sliding_window", *o.sliding_window, 1, max_extent);
    if (o.num_attention_heads) check_size(at + ".num_attention_heads", *o.num_attention_heads, 1, max_layers);
    if (o.num_key_value_heads) check_size(at + ".num_key_value_heads", *o.num_key_value_heads, 1, max_layers);
    if (o.head_dim) check_size(at + ".head_dim", *o.head_dim, 1, max_extent);
  }
}
}  // namespace detail

// transformers' get_layer_types_and_kwargs, with each layer's own window: sliding layers use
// sliding_window, chunked layers attention_chunk_size (transformers lets the chunk size overwrite
// the window of every layer when both kinds are present: docs/differences.md item 8), and
// per_layer_config wins.
// The config's fields are range-checked first (detail::check_model_config).
inline std::vector<LayerSpec> layer_specs(const ModelConfig& config) {
  detail::check_model_config(config);
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
    LayerSpec spec{types[i], std::nullopt, config.number_of_conv_states};
    const window_field window = detail::window_field_of(types[i]);
    if (window == window_field::sliding_window) spec.sliding_window = config.sliding_window;
    if (window == window_field::attention_chunk_size) spec.sliding_window = config.attention_chunk_size;
    const auto it = config.per_layer_config.find(static_cast<std::int64_t>(i));
    if (it != config.per_layer_config.end() && it->second.sliding_window) {
      spec.sliding_window = it->second.sliding_window;
      // transformers' per-layer window turns a full-attention layer into a sliding one (its test
      // test_dynamic_cache_uses_per_layer_sliding_windows).
      if (spec.type == "full_attention") spec.type = "sliding_attention";
    }
    specs.push_back(std::move(spec));
  }
  return specs;
}

// The per-layer KV head count and head dim of a config's cache layers (executorch's
// get_head_shapes): one entry per layer that holds a cache, i.e. after dropping the
// num_kv_shared_layers shared ones. transformers slices layer_types[:-0] when there are none,
// which gives an empty list (docs/differences.md item 20); kvc keeps every layer.
struct HeadShapes {
  // The key/value head count of each cache layer.
  std::vector<std::int64_t> num_heads;
  // The head dimension of each cache layer.
  std::vector<std::int64_t> head_dim;
};

// The HeadShapes of `config`'s cache layers. ValueError for a field out of range (as
// layer_specs) or a head_dim that cannot be derived.
inline HeadShapes get_head_shapes(const ModelConfig& config) {
  HeadShapes out;
  const auto specs = layer_specs(config);
  for (std::size_t i = 0; i < specs.size(); ++i) {
    out.num_heads.push_back(config.layer_num_key_value_heads(static_cast<std::int64_t>(i)));
    out.head_dim.push_back(config.layer_head_dim(static_cast<std::int64_t>(i)));
  }
  return out;
}

// DYNAMIC_LAYER_TYPE_MAPPING: an unknown type is a KeyError naming it and the known ones.
template <class Kind = DynamicLayerKind>
std::vector<Kind> dynamic_layer_kinds(const ModelConfig& config) {
  return detail::kinds_of_specs<Kind, false>(layer_specs(config), 0);
}

// STATIC_LAYER_TYPE_MAPPING, every layer built with `max_cache_len`.
template <class Kind = StaticLayerKind>
std::vector<Kind> static_layer_kinds(const ModelConfig& config, std::int64_t max_cache_len) {
  detail::check_size("StaticCache: max_cache_len", max_cache_len, 1, max_extent);
  return detail::kinds_of_specs<Kind, true>(layer_specs(config), max_cache_len);
}

}  // namespace kvc
