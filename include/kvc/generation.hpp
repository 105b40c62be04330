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
inline constexpr std::array<std::string_view, 3> DYNAMIC_CACHE_IMPLEMENTATIONS{"dynamic", "offloaded", "quantized"};
// "All the following are redundant and deprecated, but kept for BC" (transformers' comment).
inline constexpr std::array<std::string_view, 5> DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS{
    "sliding_window", "hybrid", "hybrid_chunked", "offloaded_hybrid", "offloaded_hybrid_chunked"};
inline constexpr auto ALL_STATIC_CACHE_IMPLEMENTATIONS =
    detail::concat_names(STATIC_CACHE_IMPLEMENTATIONS, DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS);
inline constexpr auto ALL_CACHE_IMPLEMENTATIONS =
    detail::concat_names(ALL_STATIC_CACHE_IMPLEMENTATIONS, DYNAMIC_CACHE_IMPLEMENTATIONS);

namespace detail {

// validate()'s local `valid_cache_implementations = ALL_CACHE_IMPLEMENTATIONS + ("paged",)`:
// "paged" re-routes generate() to continuous batching, so it is valid but not a cache.
inline constexpr auto valid_cache_implementations =
    concat_names(ALL_CACHE_IMPLEMENTATIONS, std::array<std::string_view, 1>{"paged"});

// ---- Python's repr/str of the values a generation_config.json can hold ----------------------

// repr(str): single quotes unless the text has a ' and no "; backslash, the quote, \t \n \r
// escaped; other C0/C1 controls, DEL and U+00AD as \xNN. Other printable UTF-8 passes through
// (Python also escapes the remaining non-printable code points, which kvc does not classify).
inline std::string py_str_repr(std::string_view s) {
  const bool single = s.find('\'') != std::string_view::npos;
  const bool dbl = s.find('"') != std::string_view::npos;
  const char quote = (single && !dbl) ? '"' : '\'';
  constexpr char hex[] = "0123456789abcdef";
  const auto hex_escape = [&](std::string& out, unsigned c) {
    out += "\\x";
    out += hex[(c >> 4) & 0xF];
    out += hex[c & 0xF];
  };
  std::string out(1, quote);
  for (std::size_t i = 0; i < s.size(); ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == static_cast<unsigned char>(quote) || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c < 0x20 || c == 0x7F) {
      hex_escape(out, c);
    } else if (c == 0xC2 && i + 1 < s.size()) {
      const auto next = static_cast<unsigned char>(s[i + 1]);
      if ((next >= 0x80 && next <= 0x9F) || next == 0xAD) {
        hex_escape(out, next);
        ++i;
      } else {
        out += static_cast<char>(c);
      }
    } else {
      out += static_cast<char>(c);
    }
  }
  out += quote;
  return out;
}

// repr(float): the shortest round-trip digits, fixed notation when -4 < exponent + 1 <= 16
// (with ".0" for whole numbers), otherwise d.ddde+XX.
inline std::string py_float_repr(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  char buf[64];
  const auto res = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific);
  std::string_view sci(buf, static_cast<std::size_t>(res.ptr - buf));  // "-1.25e+02", "0e+00"
  std::string out;
  if (!sci.empty() && sci.front() == '-') {
    out += '-';
    sci.remove_prefix(1);
  }
  const auto epos = sci.find('e');
  std::string digits;
  for (const char c : sci.substr(0, epos))
    if (c != '.') digits += c;
  const int exp = std::atoi(std::string(sci.substr(epos + 1)).c_str());
  const int decpt = exp + 1;
  const auto ndigits = static_cast<int>(digits.size());
  if (decpt <= -4 || decpt > 16) {
    out += digits[0];
    if (ndigits > 1) {
      out += '.';
      out.append(digits, 1);
    }
    out += exp < 0 ? "e-" : "e+";
    const int a = std::abs(exp);
    if (a < 10) out += '0';
    out += std::to_string(a);
  } else if (decpt <= 0) {
    out += "0.";
    out.append(static_cast<std::size_t>(-decpt), '0');
    out += digits;
  } else if (decpt >= ndigits) {
    out += digits;
    out.append(static_cast<std::size_t>(decpt - ndigits), '0');
    out += ".0";
  } else {
    out.append(digits, 0, static_cast<std::size_t>(decpt));
    out += '.';
    out.append(digits, static_cast<std::size_t>(decpt));
  }
  return out;
}

// repr() of the Python value json.load gives for `j`: None, True/False, ints, floats, 'str',
// [a, b] and {'k': v} (in the document's key order when J keeps it).
template <class J>
std::string py_json_repr(const J& j) {
  if (j.is_null()) return "None";
  if (j.is_boolean()) return j.template get<bool>() ? "True" : "False";
  if (j.is_number_unsigned()) return std::to_string(j.template get<std::uint64_t>());
  if (j.is_number_integer()) return std::to_string(j.template get<std::int64_t>());
  if (j.is_number_float()) return py_float_repr(j.template get<double>());
  if (j.is_string()) return py_str_repr(j.template get_ref<const typename J::string_t&>());
  std::string out;
  if (j.is_array()) {
    out = "[";
    bool first = true;
    for (const auto& e : j) {
      if (!first) out += ", ";
      first = false;
      out += py_json_repr(e);
    }
    return out + "]";
  }
  if (j.is_object()) {
    out = "{";
    bool first = true;
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (!first) out += ", ";
      first = false;
      out += py_str_repr(it.key());
      out += ": ";
      out += py_json_repr(it.value());
    }
    return out + "}";
  }
  return j.dump();  // binary / discarded: never produced by parsing
}

// str(): a string prints bare, everything else as its repr.
template <class J>
std::string py_json_str(const J& j) {
  if (j.is_string()) return j.template get<std::string>();
  return py_json_repr(j);
}

// repr(list of str): ['a', 'b'].
inline std::string py_str_list_repr(const std::vector<std::string>& values) {
  std::string out = "[";
  for (std::size_t i = 0; i < values.size(); ++i) {
    if (i) out += ", ";
    out += py_str_repr(values[i]);
  }
  return out + "]";
}

}  // namespace detail

// The cache-related fields of transformers' GenerationConfig, and the length/beam fields that
// generate() uses to size a cache. An unset optional is Python's None.
struct GenerationConfig {
  // None means the default, True (`_get_default_generation_params`).
  std::optional<bool> use_cache;
  // One of ALL_CACHE_IMPLEMENTATIONS or "paged"; None lets generate() pick (a dynamic cache).
  std::optional<std::string> cache_implementation;
  // null (Python's None) or an object, forwarded to the cache ("quantized": backend, nbits,
  // axis_key, axis_value, q_group_size, residual_length). ordered_json keeps the file's key
  // order, which Python's dict keeps too and which shows in validate()'s messages.
  nlohmann::ordered_json cache_config;
  std::optional<std::int64_t> max_cache_len;       // static caches only
  std::optional<std::int64_t> prefill_chunk_size;  // static caches are initialized eagerly when set
  std::int64_t max_length = 20;
  std::optional<std::int64_t> max_new_tokens;
  std::int64_t num_beams = 1;
  std::int64_t num_return_sequences = 1;
  std::optional<bool> is_assistant;  // generate() calls activate_past_recording() when true

  // Reads a generation_config.json document. Fields kvc does not model (bos/eos/pad ids,
  // do_sample, temperature, top_p, transformers_version, ...) are ignored; a null value means
  // unset. Wrong types, out-of-range sizes and malformed JSON throw ValueError. Like
  // transformers' constructor, it ends with validate() (not strict).
  static GenerationConfig from_json(std::string_view text);
  static GenerationConfig from_file(const std::filesystem::path& path);

  // transformers' GenerationConfig.validate, restricted to the fields above (docs/generation.md):
  // ValueError for max_new_tokens <= 0 and an unknown cache_implementation, a warning_once for
  // max_cache_len without a static cache, and the `use_cache` minor issues, raised as one
  // ValueError when `strict`, otherwise summarized in one warning_once. kvc also rejects sizes
  // below their minimum (max_cache_len, prefill_chunk_size, num_beams, num_return_sequences
  // >= 1; max_length >= 0).
  void validate(bool strict = false) const;

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
            detail::py_str_list_repr(attributes_with_issues) + ".");
}

}  // namespace kvc
