#pragma once
// Reads the shape of a transformers config.json into an examples::DecoderConfig (the demo's
// model; weights stay random):
//   - the attention layout (layers, their types and windows, heads, KV heads, head_dim) is what
//     kvc::ModelConfig::from_json derives, with each model_type's rules (docs/model_configs.md);
//   - the rest of the model is read here, from the nested `text_config` when it has the key
//     (multimodal configs), else from the top level, a null value counting as absent:
//     vocab_size defaults to 32000, intermediate_size to 4 * hidden_size, rms_norm_eps to 1e-6,
//     rope_theta to 10000 (or rope_parameters.rope_theta).
// The demo's model has one head shape and one window for all its layers, and only sliding and
// full attention layers. Errors are examples::ConfigError, one line each.
#include "decoder.hpp"

#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>

#include <kvc/config_json.hpp>
#include <kvc/detail/json.hpp>

namespace examples {

struct ConfigError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline DecoderConfig decoder_config_from_json(const std::string& text) {
  using nlohmann::json;
  json root;
  try {
    root = kvc::detail::parse_json<json>(text, "kvc_demo");  // kvc's parser: nesting depth bounded
  } catch (const json::exception& e) {
    throw ConfigError(std::string("malformed JSON: ") + e.what());
  } catch (const kvc::ValueError& e) {
    throw ConfigError(e.what());
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
    const std::optional<std::int64_t> i = kvc::detail::json_integer(*v);
    if (!i)
      throw ConfigError(std::string("'") + name + "' must be an integer of 64 bits, got " +
                        kvc::detail::json_excerpt(*v));
    return *i;
  };
  auto number = [&](const char* name, double fallback) {
    const json* v = find(name);
    if (!v) return fallback;
    if (!v->is_number())
      throw ConfigError(std::string("'") + name + "' must be a number, got " + kvc::detail::json_excerpt(*v));
    return v->get<double>();
  };

  kvc::ModelConfig layout;
  try {
    layout = kvc::ModelConfig::from_json(text);
  } catch (const std::exception& e) {
    throw ConfigError(e.what());
  }
  DecoderConfig c;
  std::vector<kvc::LayerSpec> specs;
  try {
    specs = kvc::layer_specs(layout);
    c.num_hidden_layers = static_cast<std::int64_t>(specs.size());
    c.hidden_size = layout.hidden_size;
    c.num_attention_heads = layout.num_attention_heads;
    c.num_key_value_heads = layout.layer_num_key_value_heads(0);
    c.head_dim = layout.layer_head_dim(0);
    for (std::int64_t i = 1; i < c.num_hidden_layers; ++i)
      if (layout.layer_num_key_value_heads(i) != c.num_key_value_heads || layout.layer_head_dim(i) != c.head_dim)
        throw ConfigError("layer " + std::to_string(i) +
                          " has its own head shape, which the demo's model does not support");
  } catch (const kvc::ValueError& e) {
    throw ConfigError(e.what());
  }
  // Multimodal files often leave these to the text model's class defaults; the demo's weights are
  // random anyway, so it takes a plain default instead of each class's.
  c.vocab_size = integer("vocab_size").value_or(32000);
  c.intermediate_size = integer("intermediate_size").value_or(4 * c.hidden_size);
  c.rms_norm_eps = number("rms_norm_eps", 1e-6);
  c.rope_theta = number("rope_theta", 10000.0);
  if (const json* rope = find("rope_parameters"); rope && rope->is_object() && !find("rope_theta"))
    if (auto it = rope->find("rope_theta"); it != rope->end() && it->is_number()) c.rope_theta = it->get<double>();
  if (const json* tie = find("tie_word_embeddings")) {
    if (!tie->is_boolean())
      throw ConfigError("'tie_word_embeddings' must be true or false, got " + kvc::detail::json_excerpt(*tie));
    c.tie_word_embeddings = tie->get<bool>();
  }
  c.layer_types.clear();
  c.sliding_window.reset();
  for (std::size_t i = 0; i < specs.size(); ++i) {
    c.layer_types.push_back(specs[i].type);
    if (specs[i].type != "sliding_attention") continue;
    if (c.sliding_window && specs[i].sliding_window != c.sliding_window)
      throw ConfigError("layer " + std::to_string(i) +
                        " has its own sliding window, which the demo's model does not support");
    c.sliding_window = specs[i].sliding_window;
  }

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
  std::string text;
  try {
    text = kvc::detail::read_json_file(path, "kvc_demo");  // a regular file of at most 16 MiB
  } catch (const std::exception& e) {
    throw ConfigError(e.what());
  }
  try {
    return decoder_config_from_json(text);
  } catch (const ConfigError& e) {
    throw ConfigError(path + ": " + e.what());
  }
}

}  // namespace examples
