#pragma once
// Reads the shape of a transformers config.json into an examples::DecoderConfig (the demo's
// model; weights stay random). A small stand-in until kvc::ModelConfig::from_file (issue #4):
//   - a nested `text_config` (multimodal configs) takes precedence: a field is read from it when
//     it has the key, else from the top level; a null value counts as absent;
//   - num_hidden_layers, hidden_size, num_attention_heads, vocab_size, intermediate_size are
//     required; num_key_value_heads defaults to num_attention_heads, head_dim to
//     hidden_size / num_attention_heads, rms_norm_eps to 1e-6, rope_theta to 10000 (or
//     rope_parameters.rope_theta);
//   - without `layer_types`: no sliding layers when sliding_window is null or use_sliding_window
//     is false (Qwen2/3); else Gemma 2 alternates sliding and full, Gemma 3 has
//     sliding_window_pattern - 1 sliding layers per full one (default 6), and every other model
//     slides in every layer (Mistral, Phi-3).
// Errors are examples::ConfigError, one line each.
#include "decoder.hpp"

#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

namespace examples {

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline DecoderConfig decoder_config_from_json(const std::string& text) {
  using nlohmann::json;
  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    throw ConfigError(std::string("malformed JSON: ") + e.what());
  }
  if (!root.is_object()) throw ConfigError("the config is not a JSON object");
  const json* text_config = nullptr;
  if (auto it = root.find("text_config"); it != root.end() && it->is_object()) text_config = &*it;

  auto find = [&](const char* name) -> const json* {
    for (const json* scope : std::array<const json*, 2>{text_config, &root}) {
      if (!scope) continue;
      if (auto it = scope->find(name); it != scope->end()) return it->is_null() ? nullptr : &*it;
    }
    return nullptr;
  };
  auto integer = [&](const char* name) -> std::optional<std::int64_t> {
    const json* v = find(name);
    if (!v) return std::nullopt;
    if (!v->is_number_integer()) throw ConfigError(std::string("'") + name + "' must be an integer, got " + v->dump());
    return v->get<std::int64_t>();
  };
  auto required = [&](const char* name) {
    const auto v = integer(name);
    if (!v) throw ConfigError(std::string("the config has no '") + name + "'");
    return *v;
  };
  auto number = [&](const char* name, double fallback) {
    const json* v = find(name);
    if (!v) return fallback;
    if (!v->is_number()) throw ConfigError(std::string("'") + name + "' must be a number, got " + v->dump());
    return v->get<double>();
  };

  DecoderConfig c;
  c.num_hidden_layers = required("num_hidden_layers");
  c.hidden_size = required("hidden_size");
  c.num_attention_heads = required("num_attention_heads");
  c.vocab_size = required("vocab_size");
  c.intermediate_size = required("intermediate_size");
  c.num_key_value_heads = integer("num_key_value_heads").value_or(c.num_attention_heads);
  if (c.num_attention_heads < 1) throw ConfigError("'num_attention_heads' must be positive");
  c.head_dim = integer("head_dim").value_or(c.hidden_size / c.num_attention_heads);
  c.rms_norm_eps = number("rms_norm_eps", 1e-6);
  c.rope_theta = number("rope_theta", 10000.0);
  if (const json* rope = find("rope_parameters"); rope && rope->is_object() && !find("rope_theta"))
    if (auto it = rope->find("rope_theta"); it != rope->end() && it->is_number()) c.rope_theta = it->get<double>();
  if (const json* tie = find("tie_word_embeddings")) {
    if (!tie->is_boolean()) throw ConfigError("'tie_word_embeddings' must be true or false, got " + tie->dump());
    c.tie_word_embeddings = tie->get<bool>();
  }
  c.sliding_window = integer("sliding_window");

  c.layer_types.clear();
  if (const json* types = find("layer_types")) {
    if (!types->is_array()) throw ConfigError("'layer_types' must be a list of strings, got " + types->dump());
    for (const json& t : *types) {
      if (!t.is_string()) throw ConfigError("'layer_types' must be a list of strings, got " + t.dump());
      c.layer_types.push_back(t.get<std::string>());
    }
  } else {
    const json* use = find("use_sliding_window");
    if (use && !use->is_boolean()) throw ConfigError("'use_sliding_window' must be true or false, got " + use->dump());
    if (use && !use->get<bool>()) c.sliding_window.reset();
    const json* type = find("model_type");
    const std::string model_type = type && type->is_string() ? type->get<std::string>() : "";
    std::int64_t pattern = 1;  // a full layer every `pattern` layers; 1: none
    if (model_type == "gemma2") pattern = 2;
    if (model_type.rfind("gemma3", 0) == 0) pattern = integer("sliding_window_pattern").value_or(6);
    if (pattern < 1) throw ConfigError("'sliding_window_pattern' must be positive");
    for (std::int64_t i = 0; i < std::max<std::int64_t>(c.num_hidden_layers, 0); ++i) {
      const bool sliding = c.sliding_window && (pattern == 1 || (i + 1) % pattern != 0);
      c.layer_types.emplace_back(sliding ? "sliding_attention" : "full_attention");
    }
  }
  bool any_sliding = false;
  for (const auto& t : c.layer_types) any_sliding = any_sliding || t == "sliding_attention";
  if (!any_sliding) c.sliding_window.reset();

  try {
    c.validate();
  } catch (const std::invalid_argument& e) {
    throw ConfigError(e.what());
  }
  return c;
}

inline DecoderConfig decoder_config_from_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw ConfigError("cannot read '" + path + "': it is a directory");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("cannot read '" + path + "'");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw ConfigError("cannot read '" + path + "'");
  try {
    return decoder_config_from_json(text.str());
  } catch (const ConfigError& e) {
    throw ConfigError(path + ": " + e.what());
  }
}

}  // namespace examples
