#pragma once
// Caches described at run time by JSON, for code that reads its cache layout from a file:
//
//   {"layers": [{"type": "DynamicLayer"}, {"type": "StaticSlidingWindowLayer", "max_cache_len": 64,
//               "sliding_window": 16}], "dtype": "bfloat16"}
//   {"layer_class_to_replicate": {"type": "DynamicSlidingWindowLayer", "sliding_window": 4096}}
//   {"layers": ["DynamicLayer", {"type": "QuantoQuantizedLayer", "nbits": 2}, "DynamicLayer"]}
//
// The quantized kinds (QuantoQuantizedLayer, HQQQuantizedLayer) take QuantizedOptions' fields, each
// optional with its default: a format per layer, the first and last layers in full precision, ...
// A description naming both `layers` and `layer_class_to_replicate`, or neither, throws
// kvc::ValueError with exactly the text kvc::Cache's static_assert prints for the same mistake
// (transformers' Cache.__init__ texts). A layer entry may also be a bare kind name when the kind
// takes no parameter ("DynamicLayer"). `dtype` is "float" (default), "double", "half" or "bfloat16".
// Not included by <kvc/kvc.hpp>: it instantiates a cache type per kind and element type.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json.hpp>

#include <kvc/any_cache.hpp>
#include <kvc/cache.hpp>
#include <kvc/detail/json.hpp>
#include <kvc/element_types.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/policies/layers/quantized.hpp>

namespace kvc {

// The layer policy a description with `layers` builds: every host layer kind, the quantized ones
// included.
using AnyHostLayers = Layers<DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer,
                             QuantoQuantizedLayer, HQQQuantizedLayer>;

// The ValueError message for a description with both `layers` and `layer_class_to_replicate`
// (transformers' Cache.__init__ text).
inline constexpr std::string_view both_layer_sources_message =
    "You can construct a Cache either from a list `layers` of all the predefined `CacheLayer`, or from a "
    "`layer_class_to_replicate`, in which case the Cache will append a new layer corresponding to "
    "`layer_class_to_replicate` for each new call to `update` with an idx not already in the Cache.";
// The ValueError message for a description with neither (transformers' text).
inline constexpr std::string_view no_layer_source_message =
    "You should provide exactly one of `layers` or `layer_class_to_replicate` to initialize a Cache.";

namespace detail {

using any_kind = std::variant<DynamicLayer, DynamicSlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer,
                              QuantoQuantizedLayer, HQQQuantizedLayer>;

// The limits of the layer kinds themselves (kvc::max_extent slots or tokens, kvc::max_layers layers).
inline constexpr std::int64_t max_described_size = max_extent;
inline constexpr std::size_t max_described_layers = static_cast<std::size_t>(max_layers);

// The size `field` of a described layer, from `lowest` to max_described_size; `absent` is what a
// layer without the field gets (none: the field is required).
inline std::int64_t described_size(const nlohmann::json& entry, const char* field, const std::string& where,
                                   std::int64_t lowest = 1, std::optional<std::int64_t> absent = std::nullopt) {
  const auto it = entry.find(field);
  if (it == entry.end()) {
    if (absent) return *absent;
    throw ValueError("cache description: " + where + " needs `" + field + "`");
  }
  if (!it->is_number_integer())
    throw ValueError("cache description: " + where + " `" + field + "` must be an integer, got " + json_excerpt(*it));
  const std::optional<std::int64_t> v = json_integer(*it);
  if (!v || *v < lowest || *v > max_described_size)  // the value as written: 18446744073709551615 is not -1
    throw ValueError("cache description: " + where + " `" + field + "` must be between " + std::to_string(lowest) +
                     " and " + std::to_string(max_described_size) + ", got " + json_excerpt(*it));
  return *v;
}

// The boolean `field` of a described layer; `absent` when the layer has none.
inline bool described_flag(const nlohmann::json& entry, const char* field, const std::string& where, bool absent) {
  const auto it = entry.find(field);
  if (it == entry.end()) return absent;
  if (!it->is_boolean())
    throw ValueError("cache description: " + where + " `" + field + "` must be true or false, got " +
                     json_excerpt(*it));
  return it->get<bool>();
}

// A quantized layer kind: QuantizedOptions' fields, each optional with its default, checked as the
// layer's constructor checks them (the codec's messages).
template <class Codec>
QuantizedLayer<Codec> described_quantized(const nlohmann::json& object, const std::string& where) {
  QuantizedLayer<Codec> k;
  k.nbits = described_size(object, "nbits", where, 1, k.nbits);
  k.axis_key = described_size(object, "axis_key", where, -1, k.axis_key);
  k.axis_value = described_size(object, "axis_value", where, -1, k.axis_value);
  k.q_group_size = described_size(object, "q_group_size", where, 1, k.q_group_size);
  k.residual_length = described_size(object, "residual_length", where, 1, k.residual_length);
  k.append_only = described_flag(object, "append_only", where, k.append_only);
  k.rotate_keys = described_flag(object, "rotate_keys", where, k.rotate_keys);
  k.rotate_values = described_flag(object, "rotate_values", where, k.rotate_values);
  k.value_nbits = described_size(object, "value_nbits", where, 0, k.value_nbits);
  validate_quantized_options(k);
  return k;
}

inline any_kind described_kind(const nlohmann::json& entry, const std::string& where) {
  if (!entry.is_string() && !entry.is_object())
    throw ValueError("cache description: " + where + " must be a kind name or an object, got " + json_excerpt(entry));
  const nlohmann::json object = entry.is_string() ? nlohmann::json{{"type", entry}} : entry;
  const auto type = object.find("type");
  if (type == object.end() || !type->is_string())
    throw ValueError("cache description: " + where + " needs a string `type`");
  const auto name = type->get<std::string>();
  if (name == "DynamicLayer") return DynamicLayer{};
  if (name == "DynamicSlidingWindowLayer")
    return DynamicSlidingWindowLayer{described_size(object, "sliding_window", where),
                                     described_size(object, "rollback_slack", where, 0, 0)};
  if (name == "StaticLayer") return StaticLayer{described_size(object, "max_cache_len", where)};
  if (name == "StaticSlidingWindowLayer")
    return StaticSlidingWindowLayer{described_size(object, "max_cache_len", where),
                                    described_size(object, "sliding_window", where)};
  if (name == "QuantoQuantizedLayer") return described_quantized<QuantoCodec>(object, where);
  if (name == "HQQQuantizedLayer") return described_quantized<HqqCodec>(object, where);
  static constexpr std::array<std::string_view, 6> known{"DynamicLayer",         "DynamicSlidingWindowLayer",
                                                         "StaticLayer",          "StaticSlidingWindowLayer",
                                                         "QuantoQuantizedLayer", "HQQQuantizedLayer"};
  throw KeyError("'" + name + "' is not a known layer kind. Known layer kinds: " + py_str_tuple(known));
}

template <class T>
AnyCache described_cache(const nlohmann::json& doc) {
  const bool has_layers = doc.contains("layers"), has_replicate = doc.contains("layer_class_to_replicate");
  if (has_layers && has_replicate) throw ValueError(std::string(both_layer_sources_message));
  if (!has_layers && !has_replicate) throw ValueError(std::string(no_layer_source_message));
  if (has_replicate) {
    const any_kind kind = described_kind(doc["layer_class_to_replicate"], "`layer_class_to_replicate`");
    return std::visit(
        [](const auto& k) { return AnyCache(Cache<Replicate<std::decay_t<decltype(k)>>, HostStorage<T>>(k)); }, kind);
  }
  const auto& list = doc["layers"];
  if (!list.is_array()) throw ValueError("cache description: `layers` must be an array, got " + json_excerpt(list));
  if (list.size() > max_described_layers)
    throw ValueError("cache description: `layers` holds " + std::to_string(list.size()) + " entries, more than " +
                     std::to_string(max_described_layers));
  using C = Cache<AnyHostLayers, HostStorage<T>>;
  std::vector<typename C::kind_variant> kinds;
  kinds.reserve(list.size());
  for (std::size_t i = 0; i < list.size(); ++i)
    std::visit([&](const auto& k) { kinds.emplace_back(k); },
               described_kind(list[i], "`layers[" + std::to_string(i) + "]`"));
  return AnyCache(C(kinds));
}

}  // namespace detail

}  // namespace kvc

#include <kvc/detail/runtime_instantiations.hpp>  // described_cache<T> is compiled in kvc::runtime

namespace kvc {

// Builds the cache a JSON description names (see the header comment).
inline AnyCache cache_from_description(std::string_view json_text) {
  nlohmann::json doc;
  try {
    doc = detail::parse_json<nlohmann::json>(json_text, "cache description");
  } catch (const nlohmann::json::exception& e) {  // parse_error, and out_of_range for huge numbers
    throw ValueError(std::string("cache description: malformed JSON: ") + e.what());
  }
  if (!doc.is_object()) throw ValueError("cache description: expected a JSON object, got " + detail::json_excerpt(doc));
  std::string dtype = "float";
  if (const auto it = doc.find("dtype"); it != doc.end()) {
    if (!it->is_string())
      throw ValueError("cache description: `dtype` must be a string, got " + detail::json_excerpt(*it));
    dtype = it->get<std::string>();
  }
  AnyCache cache;
  if (!detail::with_element_type(dtype,
                                 [&]<class T>(std::type_identity<T>) { cache = detail::described_cache<T>(doc); }))
    throw ValueError("cache description: `dtype` must be one of " + detail::py_str_tuple(element_type_names) +
                     ", got '" + dtype + "'");
  return cache;
}

}  // namespace kvc
