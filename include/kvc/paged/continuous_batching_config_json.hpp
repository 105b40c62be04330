#pragma once
// kvc::continuous_batching_config_from_json / _from_file: a ContinuousBatchingConfig from the JSON
// object of transformers' dataclass fields (what `dataclasses.asdict(config)` gives), on its own
// or as the "continuous_batching_config" entry of a generation config. Fields kvc does not model
// (CUDA graphs, padding intervals, compile configs, seeds, TP options) are skipped; a JSON null is
// `None` (an unset optional, or the default of a field that cannot be unset). A value of the wrong
// type is a ValueError naming the field; sizes are bounded by kvc's limits (<kvc/limits.hpp>).

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include <kvc/detail/json.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/paged/continuous_batching_config.hpp>

namespace kvc {
namespace detail::cb_json {

using json = nlohmann::json;

[[noreturn]] inline void fail(std::string_view field, std::string_view what, const json& v) {
  throw ValueError(join_message({"ContinuousBatchingConfig: `", field, "` must be ", what, ", got ", json_excerpt(v)}));
}

inline void read_count(const json& o, std::string_view key, std::optional<std::int64_t>& out, std::int64_t minimum) {
  const auto it = o.find(key);
  if (it == o.end()) return;
  if (it->is_null()) {
    out.reset();
    return;
  }
  const std::optional<std::int64_t> i = it->is_boolean() ? std::nullopt : json_integer(*it);
  if (!i) fail(key, "an integer", *it);
  check_size(join_message({"ContinuousBatchingConfig: `", key, "`"}), *i, minimum, max_extent);
  out = *i;
}
inline void read_count(const json& o, std::string_view key, std::int64_t& out, std::int64_t minimum) {
  std::optional<std::int64_t> v = out;
  read_count(o, key, v, minimum);
  if (v) out = *v;
}
inline void read_number(const json& o, std::string_view key, std::optional<double>& out, double lo, double hi) {
  const auto it = o.find(key);
  if (it == o.end()) return;
  if (it->is_null()) {
    out.reset();
    return;
  }
  if (!it->is_number()) fail(key, "a number", *it);
  const double d = it->get<double>();
  if (!std::isfinite(d) || d < lo || d > hi)
    fail(key, "a number between " + detail::py_float_repr(lo) + " and " + detail::py_float_repr(hi), *it);
  out = d;
}
inline void read_number(const json& o, std::string_view key, double& out, double lo, double hi) {
  std::optional<double> v = out;
  read_number(o, key, v, lo, hi);
  if (v) out = *v;
}
inline void read_bool(const json& o, std::string_view key, std::optional<bool>& out) {
  const auto it = o.find(key);
  if (it == o.end()) return;
  if (it->is_null()) {
    out.reset();
    return;
  }
  if (!it->is_boolean()) fail(key, "true or false", *it);
  out = it->get<bool>();
}
inline void read_bool(const json& o, std::string_view key, bool& out) {
  std::optional<bool> v = out;
  read_bool(o, key, v);
  if (v) out = *v;
}

inline ContinuousBatchingConfig from(const json& doc) {
  const json* o = &doc;
  if (!o->is_object()) fail("(the document)", "a JSON object", *o);
  if (const auto it = o->find("continuous_batching_config"); it != o->end() && it->is_object()) o = &*it;
  ContinuousBatchingConfig c;
  read_count(*o, "block_size", c.block_size, 1);
  read_count(*o, "num_blocks", c.num_blocks, 1);
  read_count(*o, "max_batch_tokens", c.max_batch_tokens, 1);
  read_number(*o, "max_memory_percent", c.max_memory_percent, 0.0, 1.0);
  read_count(*o, "max_blocks_per_request", c.max_blocks_per_request, 0);
  read_bool(*o, "allow_block_sharing", c.allow_block_sharing);
  read_count(*o, "max_requests_per_batch", c.max_requests_per_batch, 1);
  read_bool(*o, "use_async_batching", c.use_async_batching);
  if (const auto it = o->find("scheduler_type"); it != o->end() && !it->is_null()) {
    if (!it->is_string()) fail("scheduler_type", "a string", *it);
    c.scheduler_type = it->get<std::string>();
  }
  read_number(*o, "safety_margin", c.safety_margin, 0.0, 1.0);
  read_bool(*o, "return_logprobs", c.return_logprobs);
  read_number(*o, "cpu_offload_space", c.cpu_offload_space, 0.0, 1e9);
  read_number(*o, "cpu_offload_space_safety_threshold", c.cpu_offload_space_safety_threshold, 0.0, 1.0);
  read_count(*o, "max_queue_size", c.max_queue_size, 0);
  return c;
}

}  // namespace detail::cb_json

// Reads a ContinuousBatchingConfig from JSON text: transformers' fields, alone or as a generation
// config's "continuous_batching_config" entry. kvc::ValueError for malformed JSON or a bad field.
inline ContinuousBatchingConfig continuous_batching_config_from_json(std::string_view text) {
  nlohmann::json doc;
  try {
    doc = detail::parse_json<nlohmann::json>(text, "ContinuousBatchingConfig");
  } catch (const nlohmann::json::exception& e) {
    throw ValueError(std::string("ContinuousBatchingConfig: malformed JSON: ") + e.what());
  }
  return detail::cb_json::from(doc);
}

// The same from a JSON file; kvc::RuntimeError when the file cannot be read.
inline ContinuousBatchingConfig continuous_batching_config_from_file(const std::filesystem::path& path) {
  return continuous_batching_config_from_json(detail::read_json_file(path, "ContinuousBatchingConfig"));
}

}  // namespace kvc
