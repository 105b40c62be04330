#pragma once
// kvc::GenerationConfig: the cache part of transformers' GenerationConfig
// (generation/configuration_utils.py), with the cache_implementation constant lists in
// transformers' order, `validate` with transformers' messages verbatim, and loading from a real
// `generation_config.json`. docs/generation.md documents every field and message.

#include <array>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <iterator>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include <kvc/detail/json.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/warnings.hpp>

namespace kvc {
namespace detail {

template <std::size_t N, std::size_t M>
constexpr std::array<std::string_view, N + M> concat_names(const std::array<std::string_view, N>& a,
                                                           const std::array<std::string_view, M>& b) {
  std::array<std::string_view, N + M> out{};
  for (std::size_t i = 0; i < N; ++i) out[i] = a[i];
  for (std::size_t i = 0; i < M; ++i) out[N + i] = b[i];
  return out;
}

template <std::size_t N>
constexpr bool contains_name(const std::array<std::string_view, N>& names, std::string_view name) {
  for (const auto& n : names)
    if (n == name) return true;
  return false;
}

}  // namespace detail

// ---- the constant lists (generation/configuration_utils.py, module level) -------------------
inline constexpr std::array<std::string_view, 2> STATIC_CACHE_IMPLEMENTATIONS{"static", "offloaded_static"};
// The cache_implementation values that pick a dynamic cache.
inline constexpr std::array<std::string_view, 3> DYNAMIC_CACHE_IMPLEMENTATIONS{"dynamic", "offloaded", "quantized"};
// "All the following are redundant and deprecated, but kept for BC" (transformers' comment).
inline constexpr std::array<std::string_view, 5> DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS{
    "sliding_window", "hybrid", "hybrid_chunked", "offloaded_hybrid", "offloaded_hybrid_chunked"};
// STATIC_CACHE_IMPLEMENTATIONS, then the deprecated static values.
inline constexpr auto ALL_STATIC_CACHE_IMPLEMENTATIONS =
    detail::concat_names(STATIC_CACHE_IMPLEMENTATIONS, DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS);
// Every cache_implementation value generate() knows ("paged" aside): static, deprecated, dynamic.
inline constexpr auto ALL_CACHE_IMPLEMENTATIONS =
    detail::concat_names(ALL_STATIC_CACHE_IMPLEMENTATIONS, DYNAMIC_CACHE_IMPLEMENTATIONS);

namespace detail {

// validate()'s local `valid_cache_implementations = ALL_CACHE_IMPLEMENTATIONS + ("paged",)`:
// "paged" re-routes generate() to continuous batching, so it is valid but not a cache.
inline constexpr auto valid_cache_implementations =
    concat_names(ALL_CACHE_IMPLEMENTATIONS, std::array<std::string_view, 1>{"paged"});

// ---- Python's repr/str of the values a generation_config.json can hold ----------------------

}  // namespace detail

// The cache-related fields of transformers' GenerationConfig, and the length/beam fields that
// generate() uses to size a cache. An unset optional is Python's None.
struct GenerationConfig {
  // None means the default, True (`_get_default_generation_params`).
  std::optional<bool> use_cache;
  // One of ALL_CACHE_IMPLEMENTATIONS or "paged"; None lets generate() pick (a dynamic cache).
  std::optional<std::string> cache_implementation;
  // null (Python's None) or an object, forwarded to the cache ("quantized": backend, nbits,
  // axis_key, axis_value, q_group_size, residual_length; kvc's value_nbits, append_only,
  // rotate_keys, rotate_values). ordered_json keeps the file's key
  // order, which Python's dict keeps too and which shows in validate()'s messages.
  nlohmann::ordered_json cache_config;
  std::optional<std::int64_t> max_cache_len;       // static caches only
  std::optional<std::int64_t> prefill_chunk_size;  // static caches are initialized eagerly when set
  // The largest total length, prompt included (default 20); max_new_tokens wins when set.
  std::int64_t max_length = 20;
  // The number of tokens to generate, the prompt not counted (None: max_length decides).
  std::optional<std::int64_t> max_new_tokens;
  // The number of beams of beam search (1: no beam search).
  std::int64_t num_beams = 1;
  // The number of sequences returned for each input.
  std::int64_t num_return_sequences = 1;
  std::optional<bool> is_assistant;  // generate() calls activate_past_recording() when true

  // Reads a generation_config.json document. Fields kvc does not model (bos/eos/pad ids,
  // do_sample, temperature, top_p, transformers_version, ...) are ignored; a null value means
  // unset. Wrong types, out-of-range sizes and malformed JSON throw ValueError. Like
  // transformers' constructor, it ends with validate() (not strict).
  static GenerationConfig from_json(std::string_view text);
  // The same from a generation_config.json file: RuntimeError when it cannot be read, ValueError
  // for a file above kvc's size limit, malformed JSON or a wrong field.
  static GenerationConfig from_file(const std::filesystem::path& path);

  // transformers' GenerationConfig.validate, restricted to the fields above (docs/generation.md):
  // ValueError for max_new_tokens <= 0 and an unknown cache_implementation, a warning_once for
  // max_cache_len without a static cache, and the `use_cache` minor issues, raised as one
  // ValueError when `strict`, otherwise summarized in one warning_once. kvc also rejects sizes
  // below their minimum (max_cache_len, prefill_chunk_size, num_beams, num_return_sequences
  // >= 1; max_length >= 0).
  void validate(bool strict = false) const;

  // Whether two configs hold equal values in every field.
  friend bool operator==(const GenerationConfig&, const GenerationConfig&) = default;
};

namespace detail {

inline std::string generation_field_error(std::string_view field, std::string_view expected,
                                          const nlohmann::ordered_json& got) {
  return "GenerationConfig: `" + std::string(field) + "` must be " + std::string(expected) + ", got " +
         json_excerpt(got);
}

inline const nlohmann::ordered_json* generation_field(const nlohmann::ordered_json& doc, std::string_view key) {
  const auto it = doc.find(key);
  if (it == doc.end() || it->is_null()) return nullptr;
  return &*it;
}

inline std::optional<bool> generation_bool(const nlohmann::ordered_json& doc, std::string_view key) {
  const auto* v = generation_field(doc, key);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) throw ValueError(generation_field_error(key, "a boolean or null", *v));
  return v->get<bool>();
}

inline std::optional<std::string> generation_string(const nlohmann::ordered_json& doc, std::string_view key) {
  const auto* v = generation_field(doc, key);
  if (!v) return std::nullopt;
  if (!v->is_string()) throw ValueError(generation_field_error(key, "a string or null", *v));
  return v->get<std::string>();
}

inline std::optional<std::int64_t> generation_int(const nlohmann::ordered_json& doc, std::string_view key) {
  const auto* v = generation_field(doc, key);
  if (!v) return std::nullopt;
  if (!v->is_number_integer()) throw ValueError(generation_field_error(key, "an integer or null", *v));
  const std::optional<std::int64_t> fits = json_integer(*v);
  if (!fits) throw ValueError(generation_field_error(key, "an integer that fits in 64 bits", *v));
  return *fits;
}

// A size between `minimum` and kvc's limit for it (max_extent for lengths, max_batch for beams).
inline void check_generation_size(std::string_view field, std::int64_t value, std::int64_t minimum,
                                  std::int64_t maximum = max_extent) {
  check_size(join_message({"GenerationConfig: `", field, "`"}), value, minimum, maximum);
}

inline GenerationConfig generation_config_from(const nlohmann::ordered_json& doc) {
  if (!doc.is_object())
    throw ValueError("GenerationConfig: a generation config must be a JSON object, got " + json_excerpt(doc));
  GenerationConfig c;
  c.use_cache = generation_bool(doc, "use_cache");
  c.cache_implementation = generation_string(doc, "cache_implementation");
  if (const auto* v = generation_field(doc, "cache_config")) {
    if (!v->is_object()) throw ValueError(generation_field_error("cache_config", "an object or null", *v));
    c.cache_config = *v;
  }
  c.max_cache_len = generation_int(doc, "max_cache_len");
  c.prefill_chunk_size = generation_int(doc, "prefill_chunk_size");
  c.max_length = generation_int(doc, "max_length").value_or(20);
  c.max_new_tokens = generation_int(doc, "max_new_tokens");
  c.num_beams = generation_int(doc, "num_beams").value_or(1);
  c.num_return_sequences = generation_int(doc, "num_return_sequences").value_or(1);
  c.is_assistant = generation_bool(doc, "is_assistant");
  c.validate();
  return c;
}

}  // namespace detail

inline GenerationConfig GenerationConfig::from_json(std::string_view text) {
  nlohmann::ordered_json doc;
  try {
    doc = detail::parse_json<nlohmann::ordered_json>(text, "GenerationConfig");
  } catch (const nlohmann::ordered_json::exception& e) {  // parse_error, and out_of_range for huge numbers
    throw ValueError(std::string("GenerationConfig: malformed JSON: ") + e.what());
  }
  return detail::generation_config_from(doc);
}

inline GenerationConfig GenerationConfig::from_file(const std::filesystem::path& path) {
  const std::string text = detail::read_json_file(path, "GenerationConfig");
  nlohmann::ordered_json doc;
  try {
    doc = detail::parse_json<nlohmann::ordered_json>(text, "GenerationConfig");
  } catch (const nlohmann::ordered_json::exception& e) {  // parse_error, and out_of_range for huge numbers
    // transformers' from_pretrained message (an OSError there), then the parser's detail.
    throw ValueError("It looks like the config file at '" + path.string() + "' is not a valid JSON file. " + e.what());
  }
  return detail::generation_config_from(doc);
}

inline void GenerationConfig::validate(bool strict) const {
  // 1.1 decoding attributes
  if (max_new_tokens.has_value() && *max_new_tokens <= 0)
    throw ValueError("`max_new_tokens` must be greater than 0, but is " + std::to_string(*max_new_tokens) + ".");
  // 1.2 cache attributes
  if (cache_implementation.has_value() &&
      !detail::contains_name(detail::valid_cache_implementations, *cache_implementation))
    throw ValueError("Invalid `cache_implementation` (" + *cache_implementation +
                     "). Choose one of: " + detail::py_str_tuple(detail::valid_cache_implementations));
  // kvc's own range checks (transformers fails later, or not at all).
  if (max_cache_len.has_value()) detail::check_generation_size("max_cache_len", *max_cache_len, 1);
  if (prefill_chunk_size.has_value()) detail::check_generation_size("prefill_chunk_size", *prefill_chunk_size, 1);
  if (max_new_tokens.has_value()) detail::check_generation_size("max_new_tokens", *max_new_tokens, 1);
  detail::check_generation_size("max_length", max_length, 0);
  detail::check_generation_size("num_beams", num_beams, 1, max_batch);
  detail::check_generation_size("num_return_sequences", num_return_sequences, 1, max_batch);

  const bool static_implementation = cache_implementation.has_value() &&
                                     detail::contains_name(ALL_STATIC_CACHE_IMPLEMENTATIONS, *cache_implementation);
  if (max_cache_len.has_value() && !static_implementation)
    warn_once("`max_cache_len` is only used with static caches (" + detail::py_str_tuple(STATIC_CACHE_IMPLEMENTATIONS) +
              "); it will be ignored with `cache_implementation=" +
              (cache_implementation.has_value() ? detail::py_str_repr(*cache_implementation) : std::string("None")) +
              "`.");

  // 2.5 cache-related arguments are ignored when use_cache is False (None means True).
  std::vector<std::pair<std::string, std::string>> minor_issues;  // in transformers' order
  if (use_cache.has_value() && !*use_cache) {
    const auto no_cache_warning = [](const std::string& cache_arg, const std::string& cache_arg_value) {
      return "You have not set `use_cache` to `True`, but " + cache_arg + " is set to " + cache_arg_value + "." +
             cache_arg + " will have no effect.";
    };
    if (cache_implementation.has_value())
      minor_issues.emplace_back("cache_implementation",
                                no_cache_warning("cache_implementation", *cache_implementation));
    if (!cache_config.is_null())
      minor_issues.emplace_back("cache_config", no_cache_warning("cache_config", detail::py_json_str(cache_config)));
  }
  if (minor_issues.empty()) return;

  std::string info_message;
  std::vector<std::string> attributes_with_issues;
  for (const auto& [attribute_name, issue_description] : minor_issues) {
    if (!info_message.empty()) info_message += '\n';
    info_message += "- `" + attribute_name + "`: " + issue_description;
    attributes_with_issues.push_back(attribute_name);
  }
  info_message +=
      "\nIf you're using a pretrained model, note that some of these attributes may be set through the model's "
      "`generation_config.json` file.";
  if (strict) throw ValueError("GenerationConfig is invalid: \n" + info_message);
  // transformers appends " Set `TRANSFORMERS_VERBOSITY=info` for more details." at its default
  // verbosity and logs info_message at info level. kvc has no verbosity: it leaves the sentence
  // out, and validate(true) gives the details (docs/generation.md).
  warn_once("The following generation flags are not valid and may be ignored: " +
            detail::py_str_list(attributes_with_issues) + ".");
}

}  // namespace kvc
