#pragma once
// ModelConfig::from_json / from_file: a real transformers config.json read the way its
// configuration class does (docs/model_configs.md). Included by <kvc/runtime.hpp>; kept out of
// <kvc/config.hpp> and <kvc/kvc.hpp> so that code which fills its ModelConfig in code does not
// compile a JSON library.

#include <array>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include <kvc/config.hpp>
#include <kvc/detail/json.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/warnings.hpp>

namespace kvc {

// ---- ModelConfig::from_json / from_file ------------------------------------------------------
// How each model_type turns into a layout is docs/model_configs.md; every rule below cites the
// transformers configuration class it follows (the v5 dataclass classes unless said otherwise).

namespace detail::model_json {

using json = nlohmann::json;

// Limits checked before anything is allocated from a size (a fuzz target reads arbitrary files):
// layer counts, head counts and list lengths (kvc::max_layers), then hidden sizes, head dims and
// windows (kvc::max_extent).
inline constexpr std::int64_t max_count = max_layers;
using kvc::max_extent;

[[noreturn]] inline void fail(const std::string& what) { throw ValueError("ModelConfig: " + what); }

inline std::string excerpt(const json& v) { return json_excerpt(v); }

// One JSON object read as a configuration: the top level, or the nested text config (then every
// field is named with its path, e.g. `text_config.num_hidden_layers`).
struct scope {
  const json* object = nullptr;
  std::string prefix;

  std::string name(std::string_view key) const { return "`" + prefix + std::string(key) + "`"; }
  // nullptr when the key is absent; a JSON null is returned as such.
  const json* raw(std::string_view key) const {
    const auto it = object->find(key);
    return it == object->end() ? nullptr : &*it;
  }
  // nullptr when the key is absent or null.
  const json* value(std::string_view key) const {
    const json* v = raw(key);
    return v && !v->is_null() ? v : nullptr;
  }
};

inline std::int64_t to_int(const json& v, const std::string& name, std::int64_t minimum, std::int64_t maximum) {
  if (!v.is_number_integer()) fail(name + " must be an integer, got " + excerpt(v));
  const std::optional<std::int64_t> fits = json_integer(v);
  if (!fits) fail(name + " is " + excerpt(v) + ", above kvc's limit of " + std::to_string(maximum));
  const std::int64_t i = *fits;
  if (i < minimum)
    fail(name + " must be " + (minimum == 0 ? std::string("0 or more") : std::string("a positive integer")) + ", got " +
         std::to_string(i));
  if (i > maximum) fail(name + " is " + std::to_string(i) + ", above kvc's limit of " + std::to_string(maximum));
  return i;
}

// Absent or null: nullopt. `minimum` is 0 for layer counts, 1 for everything else.
inline std::optional<std::int64_t> count(const scope& s, std::string_view key, std::int64_t minimum = 1) {
  const json* v = s.value(key);
  return v ? std::optional(to_int(*v, s.name(key), minimum, max_count)) : std::nullopt;
}
inline std::optional<std::int64_t> extent(const scope& s, std::string_view key, std::int64_t minimum = 1) {
  const json* v = s.value(key);
  return v ? std::optional(to_int(*v, s.name(key), minimum, max_extent)) : std::nullopt;
}
inline std::optional<bool> flag(const scope& s, std::string_view key) {
  const json* v = s.value(key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) fail(s.name(key) + " must be a boolean, got " + excerpt(*v));
  return v->get<bool>();
}
inline std::optional<std::string> string_field(const scope& s, std::string_view key) {
  const json* v = s.value(key);
  if (!v) return std::nullopt;
  if (!v->is_string()) fail(s.name(key) + " must be a string, got " + excerpt(*v));
  return v->get<std::string>();
}

// How a configuration class fills `layer_types` when the file has none.
enum class layer_rule {
  generic,      // none: get_layer_types_and_kwargs's rule applies later (layer_specs)
  qwen2,        // sliding from layer max_window_layers on, when sliding_window survives the gate
  qwen2_moe,    // sliding at even indices below max_window_layers, when use_sliding_window
  every_other,  // sliding at even indices, full at odd ones
  gemma3,       // sliding unless (i + 1) % sliding_window_pattern == 0
  qwen3_next,   // linear_attention unless (i + 1) % full_attention_interval == 0
  t5,           // decoder shape from num_decoder_layers / num_heads / d_kv / d_model
  whisper,      // decoder shape from decoder_layers / decoder_attention_heads / d_model
};
// What a configuration class does with sliding_window when use_sliding_window is false.
enum class window_gate { none, to_none, to_zero };

// One transformers configuration class: its defaults for the fields a cache needs (used when the
// key is absent) and its rules. head_dim nullopt: hidden_size / num_attention_heads.
// num_key_value_heads nullopt: num_attention_heads.
struct model_class {
  std::string_view model_type;
  std::int64_t num_hidden_layers;
  std::int64_t num_attention_heads;
  std::int64_t hidden_size;
  std::optional<std::int64_t> num_key_value_heads;
  std::optional<std::int64_t> head_dim;
  std::optional<std::int64_t> sliding_window;
  std::int64_t max_window_layers;
  layer_rule rule;
  window_gate gate;
};

inline constexpr std::int64_t no_field = -1;  // the class has no max_window_layers
inline constexpr std::optional<std::int64_t> unset = std::nullopt;

// clang-format off
inline constexpr std::array<model_class, 15> model_classes{{
  // LlamaConfig: head_dim / num_key_value_heads None -> hidden_size // heads / heads (__post_init__).
  {"llama",         32, 32, 4096, unset, unset, unset, no_field, layer_rule::generic,     window_gate::none},
  // MistralConfig: sliding_window defaults to 4096 (an explicit null keeps None); no layer_types.
  {"mistral",       32, 32, 4096, 8,     unset, 4096,  no_field, layer_rule::generic,     window_gate::none},
  // MixtralConfig: sliding_window defaults to None.
  {"mixtral",       32, 32, 4096, 8,     unset, unset, no_field, layer_rule::generic,     window_gate::none},
  // Phi3Config: sliding_window defaults to None; a set one slides every layer (generic rule).
  {"phi3",          32, 32, 3072, unset, unset, unset, no_field, layer_rule::generic,     window_gate::none},
  // Qwen2Config.__post_init__: sliding_window = sliding_window if use_sliding_window else None;
  // layer_types: sliding if sliding_window is not None and i >= max_window_layers.
  {"qwen2",         32, 32, 4096, 32,    unset, 4096,  28,   layer_rule::qwen2,       window_gate::to_none},
  // Qwen2VLTextConfig.__init__ (Qwen2VLConfig builds it from the flat top-level keys): as Qwen2.
  {"qwen2_vl_text", 80, 64, 8192, 8,     unset, 4096,  80,   layer_rule::qwen2,       window_gate::to_none},
  // Qwen2MoeConfig.__post_init__: sliding_window = ... if use_sliding_window else 0 (kvc: none);
  // sliding if (i + 1) % 2 and i < max_window_layers and use_sliding_window.
  {"qwen2_moe",     24, 16, 2048, 16,    unset, 4096,  28,   layer_rule::qwen2_moe,   window_gate::to_zero},
  // Qwen3Config.__post_init__: as Qwen2, head_dim defaults to 128.
  {"qwen3",         32, 32, 4096, 32,    128,   4096,  28,   layer_rule::qwen2,       window_gate::to_none},
  // Qwen3MoeConfig.__post_init__: sliding_window None unless use_sliding_window; no layer_types.
  {"qwen3_moe",     24, 32, 2048, 4,     unset, 4096,  no_field, layer_rule::generic,     window_gate::to_none},
  // Qwen3NextConfig.__post_init__: full_attention_interval (default 4), legacy names remapped.
  {"qwen3_next",    48, 16, 2048, 2,     256,   unset, no_field, layer_rule::qwen3_next,  window_gate::none},
  // Gemma2Config.__post_init__: sliding if bool((i + 1) % 2).
  {"gemma2",        26, 8,  2304, 4,     256,   4096,  no_field, layer_rule::every_other, window_gate::none},
  // Gemma3TextConfig.__post_init__: sliding_window_pattern (default 6) from the kwargs.
  {"gemma3_text",   26, 8,  2304, 4,     256,   4096,  no_field, layer_rule::gemma3,      window_gate::none},
  // GptOssConfig.__post_init__: sliding if bool((i + 1) % 2).
  {"gpt_oss",       36, 64, 2880, 8,     64,    128,   no_field, layer_rule::every_other, window_gate::none},
  // T5Config.__init__: num_layers 6, num_decoder_layers None -> num_layers, num_heads 8, d_model
  // 512, d_kv 64 (the decoder's head_dim).
  {"t5",            6,  8,  512,  unset, 64,    unset, no_field, layer_rule::t5,          window_gate::none},
  // WhisperConfig.__init__: decoder_layers 6, decoder_attention_heads 4, d_model 256.
  {"whisper",       6,  4,  256,  unset, unset, unset, no_field, layer_rule::whisper,     window_gate::none},
}};
// clang-format on

inline const model_class* find_model_class(std::string_view model_type) {
  const auto it = std::find_if(model_classes.begin(), model_classes.end(),
                               [&](const model_class& c) { return c.model_type == model_type; });
  return it == model_classes.end() ? nullptr : &*it;
}

// The text config's class when the nested config names no model_type (or there is no nested
// config): Gemma3Config -> Gemma3TextConfig, LlavaConfig -> LlamaConfig ("llama" default),
// Qwen2VLConfig -> Qwen2VLTextConfig.
inline std::string_view default_text_model_type(std::string_view model_type) {
  if (model_type == "gemma3") return "gemma3_text";
  if (model_type == "llava") return "llama";
  if (model_type == "qwen2_vl") return "qwen2_vl_text";
  return {};
}

inline void read_per_layer_config(const scope& s, std::int64_t layers, ModelConfig& c) {
  const json* plc = s.value("per_layer_config");
  if (!plc) return;
  const std::string name = s.name("per_layer_config");
  if (!plc->is_object()) fail(name + " must be an object, got " + excerpt(*plc));
  for (const auto& [key, overrides] : plc->items()) {
    // transformers accepts int or str keys; JSON keys are strings of decimal digits.
    const bool digits = !key.empty() && key.size() <= 7 &&
                        std::all_of(key.begin(), key.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
    if (!digits) fail(name + " key " + excerpt(json(key)) + " is not a layer index");
    const std::int64_t layer = std::stoll(key);
    if (layer >= layers)
      fail(name + " key " + excerpt(json(key)) + " is out of range for " + std::to_string(layers) + " layers");
    if (overrides.is_null()) continue;
    const scope o{&overrides, s.prefix + "per_layer_config." + key + "."};
    if (!overrides.is_object())
      fail(s.name("per_layer_config." + key) + " must be an object, got " + excerpt(overrides));
    LayerOverride& out = c.per_layer_config[layer];
    out.sliding_window = extent(o, "sliding_window");
    out.num_attention_heads = count(o, "num_attention_heads");
    out.num_key_value_heads = count(o, "num_key_value_heads");
    out.head_dim = extent(o, "head_dim");
  }
}

inline ModelConfig model_config_from(const json& root) {
  if (!root.is_object()) fail("a model config must be a JSON object, got " + excerpt(root));
  const scope top{&root, ""};
  const std::string top_type = string_field(top, "model_type").value_or("");

  // transformers' get_text_config(decoder=True): the one non-null sub-config among these names.
  std::vector<std::string> nested;
  for (const char* key : {"decoder", "generator", "text_config"}) {
    if (const json* v = top.value(key)) {
      if (!v->is_object()) fail(top.name(key) + " must be an object, got " + excerpt(*v));
      nested.emplace_back(key);
    }
  }
  if (nested.size() > 1)
    throw ValueError("Multiple valid text configs were found in the model config: " + py_str_list(nested) +
                     ". In this case, using `get_text_config()` would be ambiguous. Please specify the desired text "
                     "config directly, e.g. `text_config = config.sub_config_name`");

  const json defaults_only = json::object();  // a composite config without its text config
  scope s = top;
  std::string type = top_type;
  if (nested.size() == 1) {
    s = scope{&root.at(nested.front()), nested.front() + "."};
    type = string_field(s, "model_type").value_or(std::string(default_text_model_type(top_type)));
  } else if (top_type == "gemma3" || top_type == "llava") {
    // Gemma3Config / LlavaConfig: text_config None -> Gemma3TextConfig() / LlamaConfig() defaults.
    s = scope{&defaults_only, "text_config."};
    type = default_text_model_type(top_type);
  } else if (top_type == "qwen2_vl") {
    type = default_text_model_type(top_type);  // the flat keys are the text config's
  }

  const model_class* cls = find_model_class(type);
  const std::string unknown = type.empty() ? top_type : type;
  if (!cls && !unknown.empty())
    warn_once("ModelConfig: model_type '" + unknown +
              "' has no kvc rule (docs/model_configs.md): its layers follow the generic rule (layer_types, else "
              "sliding_window or attention_chunk_size for every layer) and absent fields get no class defaults");
  const layer_rule rule = cls ? cls->rule : layer_rule::generic;

  // The decoder's attention shape: which keys hold it.
  std::string_view layers_key = "num_hidden_layers", heads_key = "num_attention_heads", hidden_key = "hidden_size";
  if (rule == layer_rule::t5) {
    layers_key = s.value("num_decoder_layers") ? "num_decoder_layers" : "num_layers";
    heads_key = "num_heads";
    hidden_key = "d_model";
  } else if (rule == layer_rule::whisper) {
    layers_key = "decoder_layers";
    heads_key = "decoder_attention_heads";
    hidden_key = "d_model";
  } else if (!cls && nested.empty() && flag(top, "is_encoder_decoder").value_or(false)) {
    // get_text_config(decoder=True) on an encoder-decoder config: decoder_layers and
    // decoder_attention_heads become num_hidden_layers and num_attention_heads.
    if (s.value("decoder_layers")) layers_key = "decoder_layers";
    if (s.value("decoder_attention_heads")) heads_key = "decoder_attention_heads";
  }

  ModelConfig c;
  c.model_type = type;
  // PreTrainedConfig's is_encoder_decoder; T5Config and WhisperConfig default it to true.
  c.is_encoder_decoder =
      flag(top, "is_encoder_decoder").value_or(rule == layer_rule::t5 || rule == layer_rule::whisper);
  const auto layers = count(s, layers_key, 0);
  if (!layers && !cls) fail("the config has no " + s.name(layers_key));
  c.num_hidden_layers = layers.value_or(cls ? cls->num_hidden_layers : 0);
  c.num_attention_heads = count(s, heads_key).value_or(cls ? cls->num_attention_heads : 0);
  c.hidden_size = extent(s, hidden_key).value_or(cls ? cls->hidden_size : 0);
  const std::int64_t heads = c.num_attention_heads;
  const std::optional<std::int64_t> split =
      heads > 0 && c.hidden_size > 0 ? std::optional(c.hidden_size / heads) : std::nullopt;

  if (rule == layer_rule::t5 || rule == layer_rule::whisper) {
    // T5Attention / WhisperAttention: as many key/value heads as query heads; T5's head_dim is
    // d_kv, Whisper's d_model / decoder_attention_heads.
    c.num_key_value_heads = heads;
    c.head_dim = rule == layer_rule::t5 ? extent(s, "d_kv").value_or(*cls->head_dim) : split;
  } else {
    // An explicit null takes the class's `is None` branch: num_attention_heads, and
    // hidden_size // num_attention_heads; an absent key takes the class default first.
    const json* kv = s.raw("num_key_value_heads");
    if (kv && !kv->is_null())
      c.num_key_value_heads = to_int(*kv, s.name("num_key_value_heads"), 1, max_count);
    else if (!kv && cls && cls->num_key_value_heads)
      c.num_key_value_heads = cls->num_key_value_heads;
    else if (heads > 0)
      c.num_key_value_heads = heads;
    const json* hd = s.raw("head_dim");
    if (hd && !hd->is_null())
      c.head_dim = to_int(*hd, s.name("head_dim"), 1, max_extent);
    else if (!hd && cls && cls->head_dim)
      c.head_dim = cls->head_dim;
    else
      c.head_dim = split;
  }

  // sliding_window: absent -> the class default, null -> None (Mistral's "sliding_window": null).
  if (const json* sw = s.raw("sliding_window"))
    c.sliding_window =
        sw->is_null() ? std::nullopt : std::optional(to_int(*sw, s.name("sliding_window"), 0, max_extent));
  else if (cls)
    c.sliding_window = cls->sliding_window;
  const bool use_sliding_window = flag(s, "use_sliding_window").value_or(false);
  if (cls && cls->gate != window_gate::none && !use_sliding_window) c.sliding_window.reset();
  if (rule == layer_rule::gemma3 && c.sliding_window && flag(s, "use_bidirectional_attention").value_or(false))
    c.sliding_window = *c.sliding_window / 2 + 1;  // Gemma3TextConfig: "due to fa we set exclusive bounds"
  if (c.sliding_window && *c.sliding_window == 0) fail(s.name("sliding_window") + " must be a positive integer, got 0");
  c.attention_chunk_size = extent(s, "attention_chunk_size");
  c.num_kv_shared_layers = count(s, "num_kv_shared_layers", 0).value_or(0);
  c.number_of_conv_states = count(s, "number_of_conv_states", 1).value_or(1);

  const std::int64_t n = c.num_hidden_layers;
  if (const json* lt = s.value("layer_types")) {
    const std::string name = s.name("layer_types");
    if (!lt->is_array()) fail(name + " must be an array of strings, got " + excerpt(*lt));
    if (lt->size() > static_cast<std::size_t>(max_count))
      fail(name + " has " + std::to_string(lt->size()) + " entries, above kvc's limit of " + std::to_string(max_count));
    std::vector<std::string> types;
    types.reserve(lt->size());
    for (std::size_t i = 0; i < lt->size(); ++i) {
      const json& t = (*lt)[i];
      if (!t.is_string())
        fail("`" + s.prefix + "layer_types[" + std::to_string(i) + "]` must be a string, got " + excerpt(t));
      types.push_back(t.get<std::string>());
    }
    if (rule == layer_rule::qwen3_next)  // remap_legacy_layer_types
      for (auto& t : types) t = t == "mamba" ? "linear_attention" : t == "attention" ? "full_attention" : t;
    // PreTrainedConfig.validate_layer_type
    if (static_cast<std::int64_t>(types.size()) != n)
      fail(s.name(layers_key) + " (" + std::to_string(n) + ") must be equal to the number of " + name + " (" +
           std::to_string(types.size()) + ")");
    c.layer_types = std::move(types);
  } else if (rule != layer_rule::generic && rule != layer_rule::t5 && rule != layer_rule::whisper) {
    std::int64_t period = 2;
    if (rule == layer_rule::gemma3) period = count(s, "sliding_window_pattern").value_or(6);
    if (rule == layer_rule::qwen3_next) period = count(s, "full_attention_interval").value_or(4);
    const std::int64_t window_layers = rule == layer_rule::qwen2 || rule == layer_rule::qwen2_moe
                                           ? count(s, "max_window_layers", 0).value_or(cls->max_window_layers)
                                           : 0;
    std::vector<std::string> types;
    types.reserve(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) {
      bool sliding = false;
      switch (rule) {
        case layer_rule::qwen2:
          sliding = c.sliding_window && i >= window_layers;
          break;
        case layer_rule::qwen2_moe:
          sliding = (i + 1) % 2 != 0 && i < window_layers && use_sliding_window;
          break;
        default:
          sliding = (i + 1) % period != 0;
          break;
      }
      const char* other = rule == layer_rule::qwen3_next ? "linear_attention" : "sliding_attention";
      types.emplace_back(sliding ? other : "full_attention");
    }
    c.layer_types = std::move(types);
  }

  read_per_layer_config(s, n, c);
  return c;
}

}  // namespace detail::model_json

template <>
struct detail::include_kvc_runtime_hpp_to_read_json<ModelConfig> {
  static ModelConfig from_json(std::string_view text) {
    using json = nlohmann::json;
    json doc;
    try {
      doc = detail::parse_json<json>(text, "ModelConfig");
    } catch (const json::exception& e) {  // parse_error carries the position, out_of_range the number
      throw ValueError(std::string("ModelConfig: malformed JSON: ") + e.what());
    }
    return detail::model_json::model_config_from(doc);
  }

  static ModelConfig from_file(const std::filesystem::path& path) {
    using json = nlohmann::json;
    std::error_code ec;
    const std::filesystem::path file = std::filesystem::is_directory(path, ec) ? path / "config.json" : path;
    const std::string text = detail::read_json_file(file, "ModelConfig");
    json doc;
    try {
      doc = detail::parse_json<json>(text, "ModelConfig");
    } catch (const json::exception& e) {
      // transformers' from_pretrained message (an OSError there), then the parser's detail.
      throw ValueError("It looks like the config file at '" + file.string() + "' is not a valid JSON file. " +
                       e.what());
    }
    return detail::model_json::model_config_from(doc);
  }
};

}  // namespace kvc
