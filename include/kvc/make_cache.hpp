#pragma once
// Runtime-built caches: transformers' cache_implementation string → cache table and generate()'s
// _prepare_cache_for_generation rules (generation/utils.py), returning a kvc::AnyCache.
//
// "paged" builds a kvc::PagedBatchCache: the paged cache of continuous batching behind the method
// set of a dynamic cache, one request per batch row (<kvc/paged/paged_batch_cache.hpp>).

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <kvc/any_cache.hpp>
#include <kvc/caches.hpp>
#include <kvc/config.hpp>
#include <kvc/detail/json.hpp>
#include <kvc/encoder_decoder_cache.hpp>
#include <kvc/errors.hpp>
#include <kvc/export.hpp>
#include <kvc/generation.hpp>
#include <kvc/limits.hpp>
#include <kvc/paged/continuous_batching_config.hpp>
#include <kvc/paged/paged_batch_cache.hpp>
#include <kvc/policies/offload/file.hpp>
#include <kvc/quantized_cache.hpp>
#include <kvc/warnings.hpp>

namespace kvc {

namespace detail {
template <std::size_t N>
constexpr bool contains(const std::array<std::string_view, N>& list, std::string_view s) {
  return std::find(list.begin(), list.end(), s) != list.end();
}

// The blocks a dense batch of `rows` rows of `tokens` tokens takes in the paged cache of
// `model_config`: per row, ceil(tokens / block_size) blocks in each full-attention group and at
// most the sliding ring's ceil(sliding_window / block_size) in each sliding group.
inline std::int64_t paged_dense_blocks(const ModelConfig& model_config, std::int64_t block_size, std::int64_t rows,
                                       std::int64_t tokens) {
  const paged::LayerGroups groups = paged::group_paged_layers(model_config);
  const std::int64_t per_group = (std::max<std::int64_t>(tokens, 1) + block_size - 1) / block_size;
  std::int64_t per_row = 0;
  for (const std::string& type : groups.types) {
    std::int64_t n = per_group;
    if (type == "sliding_attention" && model_config.sliding_window && *model_config.sliding_window > 0)
      n = std::min(n, (*model_config.sliding_window + block_size - 1) / block_size);
    per_row += n;
  }
  // rows and per_row are each at most max_batch / max_extent-bounded: check the product.
  if (per_row > 0 && rows > max_extent / per_row)
    throw ValueError("make_cache: a paged cache for " + std::to_string(rows) + " rows of " + std::to_string(tokens) +
                     " tokens needs more than " + std::to_string(max_extent) + " blocks");
  return rows * per_row;
}

inline constexpr std::string_view quantized_unsupported_message =
    "This model does not support the quantized cache. If you want your model to support quantized cache, please "
    "open an issue and tag @zucchini-nlp.";

// transformers' QuantizedCache(backend=cache_config.pop("backend", "quanto"), **cache_config), read
// without changing the caller's cache_config (docs/differences.md item 19), and kvc's own options
// value_nbits (an integer), append_only, rotate_keys and rotate_values (booleans), skip_layers (a
// list of layer indices kept in full precision) and layer_nbits (one entry per layer: its nbits,
// or null for full precision): kvc::QuantizedPerLayer. An unknown key is the TypeError Python raises for an unexpected keyword
// argument.
template <class T>
AnyCache quantized_from_cache_config(const nlohmann::ordered_json& cache_config, const ModelConfig& model_config) {
  if (!cache_config.is_null() && !cache_config.is_object())
    throw ValueError("make_cache: `cache_config` must be an object, got " + json_excerpt(cache_config));
  std::string backend = "quanto";
  QuantizedOptions opts;
  QuantizedPerLayer per_layer;
  // A list of integers (and nulls, where `nulls`), each as json_integer reads it.
  const auto integers = [](const std::string& key, const nlohmann::ordered_json& value, bool nulls) {
    std::vector<std::optional<std::int64_t>> out;
    const char* what = nulls ? " must be a list of integers or nulls, got " : " must be a list of integers, got ";
    if (!value.is_array()) throw ValueError("make_cache: `cache_config." + key + "`" + what + json_excerpt(value));
    for (const auto& x : value) {
      if (nulls && x.is_null()) {
        out.emplace_back();
        continue;
      }
      const std::optional<std::int64_t> v = json_integer(x);
      if (!v) throw ValueError("make_cache: `cache_config." + key + "`" + what + json_excerpt(value));
      out.emplace_back(*v);
    }
    return out;
  };
  if (cache_config.is_object()) {
    for (const auto& [key, value] : cache_config.items()) {
      std::int64_t* field = key == "nbits"             ? &opts.nbits
                            : key == "value_nbits"     ? &opts.value_nbits
                            : key == "axis_key"        ? &opts.axis_key
                            : key == "axis_value"      ? &opts.axis_value
                            : key == "q_group_size"    ? &opts.q_group_size
                            : key == "residual_length" ? &opts.residual_length
                                                       : nullptr;
      bool* flag = key == "append_only"     ? &opts.append_only
                   : key == "rotate_keys"   ? &opts.rotate_keys
                   : key == "rotate_values" ? &opts.rotate_values
                                            : nullptr;
      if (key == "backend") {
        if (!value.is_string())
          throw ValueError("make_cache: `cache_config.backend` must be a string, got " + json_excerpt(value));
        backend = value.template get<std::string>();
      } else if (key == "config") {
        continue;  // generate() sets it to the model's text config; kvc takes model_config
      } else if (key == "skip_layers") {
        for (const auto& i : integers(key, value, false)) per_layer.skip_layers.push_back(*i);
      } else if (key == "layer_nbits") {
        per_layer.layer_nbits = integers(key, value, true);
      } else if (field) {
        const std::optional<std::int64_t> v = json_integer(value);
        if (!v)
          throw ValueError("make_cache: `cache_config." + key + "` must be an integer" +
                           (value.is_number_integer() ? " that fits in 64 bits" : "") + ", got " + json_excerpt(value));
        *field = *v;
      } else if (flag) {
        if (!value.is_boolean())
          throw ValueError("make_cache: `cache_config." + key + "` must be true or false, got " + json_excerpt(value));
        *flag = value.template get<bool>();
      } else {
        throw TypeError("QuantizedCache.__init__() got an unexpected keyword argument '" + key + "'");
      }
    }
  }
  if (per_layer.skip_layers.empty() && per_layer.layer_nbits.empty())
    return AnyCache(QuantizedCache<T>(backend, model_config, opts));
  return AnyCache(PerLayerQuantizedCache<T>(backend, model_config, opts, per_layer));
}

inline std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}
}  // namespace detail

// How generate() sizes a cache (the arguments of _prepare_cache_for_generation).
struct CacheRequest {
  // The number of input sequences (before beams and returned sequences multiply it).
  std::int64_t batch_size = 1;
  // The longest sequence the cache must hold; -1: generation_config.max_length - 1.
  std::int64_t max_cache_length = -1;
  // Encoder-decoder models with a static cache: the encoder output's length, which sizes the
  // static cross-attention cache (transformers' encoder_outputs[0].shape[1]).
  std::int64_t encoder_length = -1;
};

// The cache `generation_config.cache_implementation` names, for `model_config`:
//   "offloaded" → the same dynamic cache with kvc::OffloadToFile<false> (layers not in use live in
//     a spill file, docs/offload.md); "offloaded_static" and the deprecated offloaded names → a
//     StaticCache with kvc::OffloadToFile<true> (sliding layers stay in memory);
//   "quantized" → QuantizedCache<T>(cache_config's backend, default "quanto", and options), or
//     PerLayerQuantizedCache<T> when cache_config has skip_layers or layer_nbits;
//   None, "dynamic", "hybrid"  → make_dynamic_cache<T>(config) (transformers turns "hybrid" into None;
//     a max_cache_len then warns that it is ignored)
//   "static" and the deprecated static names → StaticCache<T>(config, max(max_cache_length,
//     max_cache_len)); eagerly initialized for batch × max(num_beams, num_return_sequences) when
//     prefill_chunk_size is set. The deprecated names warn once.
//   "paged" → PagedBatchCache<HostStorage<T>>(config, continuous_batching_config), one request per
//     batch row; when num_blocks is unset, as many blocks as batch × max(num_beams,
//     num_return_sequences) rows of max(max_cache_length, max_length) tokens take (a dense batch
//     never needs more). An encoder-decoder model is a ValueError.
template <class T = float>
AnyCache make_cache(const GenerationConfig& generation_config, const ModelConfig& model_config,
                    const CacheRequest& request, const ContinuousBatchingConfig& continuous_batching_config);

// make_cache with the default ContinuousBatchingConfig (used for "paged"); throws as make_cache.
template <class T = float>
AnyCache make_cache(const GenerationConfig& generation_config, const ModelConfig& model_config,
                    const CacheRequest& request = {}) {
  return make_cache<T>(generation_config, model_config, request, ContinuousBatchingConfig{});
}

template <class T>
AnyCache make_cache(const GenerationConfig& generation_config, const ModelConfig& model_config,
                    const CacheRequest& request, const ContinuousBatchingConfig& continuous_batching_config) {
  // generate() turns "hybrid" into None before validating, so a max_cache_len next to it gets the
  // "ignored" warning, as it does with None.
  GenerationConfig checked = generation_config;
  if (checked.cache_implementation == "hybrid") checked.cache_implementation.reset();
  checked.validate(false);  // an unknown name is a ValueError with transformers' text
  const std::string impl = generation_config.cache_implementation.value_or("dynamic");
  if (impl == "dynamic" || impl == "hybrid") return AnyCache(make_dynamic_cache<T>(model_config));
  // transformers' DynamicCache(config, offloading=True): offload_only_non_sliding defaults to False.
  if (impl == "offloaded") return AnyCache(make_dynamic_cache<T, HostStorage<T>, OffloadToFile<false>>(model_config));
  if (impl == "paged") {
    if (model_config.is_encoder_decoder)
      throw ValueError(
          "make_cache: cache_implementation 'paged' (continuous batching) is for decoder-only models; an "
          "encoder-decoder model needs another cache_implementation");
    ContinuousBatchingConfig cb = continuous_batching_config;
    if (!cb.num_blocks && cb.block_size >= PagedCache<HostStorage<T>>::min_block_size) {  // else: its message
      detail::check_size("make_cache: CacheRequest::batch_size", request.batch_size, 1, max_batch);
      const std::int64_t rows =
          request.batch_size * std::max(generation_config.num_beams, generation_config.num_return_sequences);
      const std::int64_t tokens = std::max(request.max_cache_length, generation_config.max_length);
      cb.num_blocks = detail::paged_dense_blocks(model_config, cb.block_size, rows, tokens);
    }
    return AnyCache(PagedBatchCache<HostStorage<T>>(model_config, cb));
  }
  if (impl == "quantized") {
    if (model_config.is_encoder_decoder) throw ValueError(std::string(detail::quantized_unsupported_message));
    return detail::quantized_from_cache_config<T>(generation_config.cache_config, model_config);
  }
  // A static name (validate() accepted it and it is none of the above).
  if (detail::contains(DEPRECATED_STATIC_CACHE_IMPLEMENTATIONS, impl))
    warn_once("Using `cache_implementation='" + impl +
              "' is deprecated and will be removed in v5.13. Please only use one of " +
              detail::py_str_tuple(STATIC_CACHE_IMPLEMENTATIONS) +
              ", and the layer structure will be inferred automatically.");
  std::int64_t max_len = request.max_cache_length >= 0 ? request.max_cache_length : generation_config.max_length - 1;
  if (generation_config.max_cache_len) max_len = std::max(max_len, *generation_config.max_cache_len);
  if (max_len < 1)
    throw ValueError("make_cache: a static cache needs a positive max_cache_len, got " + std::to_string(max_len) +
                     " (from max_length " + std::to_string(generation_config.max_length) + " and max_cache_len)");
  auto finish = [&](auto cache) {
    if (generation_config.prefill_chunk_size) {
      // Both factors at most max_batch (validate() bounds the beams): the product cannot overflow,
      // and early_initialization checks it against max_batch.
      detail::check_size("make_cache: CacheRequest::batch_size", request.batch_size, 1, max_batch);
      const std::int64_t batch =
          request.batch_size * std::max(generation_config.num_beams, generation_config.num_return_sequences);
      const HeadShapes shapes = get_head_shapes(model_config);
      cache.early_initialization(batch, shapes.num_heads, shapes.head_dim);
    }
    return AnyCache(std::move(cache));
  };
  // transformers' StaticCache(..., offloading=True): offload_only_non_sliding defaults to True.
  if (impl.find("offloaded") != std::string::npos)
    return finish(StaticCache<T, HostStorage<T>, OffloadToFile<true>>(model_config, max_len));
  return finish(StaticCache<T>(model_config, max_len));
}

// The cache generate() builds for an encoder-decoder model (_prepare_cache_for_generation's
// encoder-decoder step and _prepare_static_cache):
// make_cache's self-attention cache paired with a cross-attention cache, a StaticCache of
// `request.encoder_length` slots for the static names (offloaded like the self cache), else the
// config's dynamic cache (offloaded for "offloaded").
using AnyEncoderDecoderCache = EncoderDecoderCache<AnyCache, AnyCache>;

// Builds the self-attention and cross-attention pair described above. ValueError for a static
// name without a positive request.encoder_length; otherwise throws what make_cache throws.
template <class T = float>
AnyEncoderDecoderCache make_encoder_decoder_cache(const GenerationConfig& generation_config,
                                                  const ModelConfig& model_config, const CacheRequest& request = {}) {
  AnyCache self = make_cache<T>(generation_config, model_config, request);
  const std::string impl = generation_config.cache_implementation.value_or("dynamic");
  const bool offloaded = impl.find("offloaded") != std::string::npos;
  if (detail::contains(ALL_STATIC_CACHE_IMPLEMENTATIONS, impl) && impl != "hybrid") {
    if (request.encoder_length < 1)
      throw ValueError(
          "make_encoder_decoder_cache: a static cross-attention cache needs the encoder output's length "
          "(CacheRequest::encoder_length), got " +
          std::to_string(request.encoder_length));
    if (offloaded)
      return {std::move(self),
              AnyCache(StaticCache<T, HostStorage<T>, OffloadToFile<true>>(model_config, request.encoder_length))};
    return {std::move(self), AnyCache(StaticCache<T>(model_config, request.encoder_length))};
  }
  if (offloaded)
    return {std::move(self), AnyCache(make_dynamic_cache<T, HostStorage<T>, OffloadToFile<false>>(model_config))};
  return {std::move(self), AnyCache(make_dynamic_cache<T>(model_config))};
}

namespace detail {
enum class generation_cache { use_callers, none, build };

// The rules of _prepare_cache_for_generation before anything is built (its first four steps).
inline generation_cache generation_cache_rule(const GenerationConfig& generation_config, std::string_view model_type,
                                              bool has_callers_cache) {
  const std::string name = lower(model_type);
  const std::string cache_name = name.find("mamba") != std::string::npos ? "cache_params" : "past_key_values";
  if (has_callers_cache) {
    if (generation_config.cache_implementation)
      throw ValueError("Passing both `cache_implementation` (used to initialize certain caches) and `" + cache_name +
                       "` (a Cache object) is unsupported. Please use only one of the two.");
    return generation_cache::use_callers;
  }
  if (!generation_config.use_cache.value_or(true)) return generation_cache::none;
  static constexpr std::array<std::string_view, 5> no_cache_models{"reformer", "minimax", "xlnet", "rwkv", "xlstm"};
  const bool supports_cache = name.find("minimaxm2") != std::string::npos ||
                              name.find("minimaxm3") != std::string::npos ||
                              std::none_of(no_cache_models.begin(), no_cache_models.end(),
                                           [&](std::string_view n) { return name.find(n) != std::string::npos; });
  if (!supports_cache) {
    if (generation_config.cache_implementation)
      warn_once("This model does not support `Cache` instances. `cache_implementation` (set to " +
                *generation_config.cache_implementation + ") will be ignored.");
    return generation_cache::none;
  }
  return generation_cache::build;
}
}  // namespace detail

// What generate() does before its loop (_prepare_cache_for_generation):
//  - a cache the caller passes is used as is, unless a cache_implementation is set too (ValueError);
//  - use_cache false: no cache (std::nullopt);
//  - a model type that does not support Cache objects (reformer, minimax except minimaxm2/m3,
//    xlnet, rwkv, xlstm): no cache, with a warning when a cache_implementation was asked for;
//  - otherwise make_cache, and activate_past_recording() for an assistant model.
// `model_type` is the model's type or class name ("mamba" in it names the argument
// `cache_params` in messages, as transformers does). An encoder-decoder model needs
// prepare_encoder_decoder_cache_for_generation (ValueError here).
template <class T = float>
std::optional<AnyCache> prepare_cache_for_generation(const GenerationConfig& generation_config,
                                                     const ModelConfig& model_config, std::string_view model_type,
                                                     AnyCache user_cache = {}, const CacheRequest& request = {}) {
  switch (detail::generation_cache_rule(generation_config, model_type, user_cache.has_value())) {
    case detail::generation_cache::use_callers:
      return user_cache;
    case detail::generation_cache::none:
      return std::nullopt;
    case detail::generation_cache::build:
      break;
  }
  if (model_config.is_encoder_decoder)
    throw ValueError("prepare_cache_for_generation: '" + std::string(model_type) +
                     "' is an encoder-decoder model; use prepare_encoder_decoder_cache_for_generation, which pairs the "
                     "self-attention cache with a cross-attention cache");
  AnyCache cache = make_cache<T>(generation_config, model_config, request);
  if (generation_config.is_assistant.value_or(false)) cache.activate_past_recording();
  return cache;
}

// The same rules for an encoder-decoder model: the caller's EncoderDecoderCache (if its
// self-attention cache holds one), none, or make_encoder_decoder_cache.
template <class T = float>
std::optional<AnyEncoderDecoderCache> prepare_encoder_decoder_cache_for_generation(
    const GenerationConfig& generation_config, const ModelConfig& model_config, std::string_view model_type,
    AnyEncoderDecoderCache user_cache = {}, const CacheRequest& request = {}) {
  switch (detail::generation_cache_rule(generation_config, model_type, user_cache.self_attention_cache().has_value())) {
    case detail::generation_cache::use_callers:
      return user_cache;
    case detail::generation_cache::none:
      return std::nullopt;
    case detail::generation_cache::build:
      break;
  }
  AnyEncoderDecoderCache cache = make_encoder_decoder_cache<T>(generation_config, model_config, request);
  if (generation_config.is_assistant.value_or(false)) cache.activate_past_recording();
  return cache;
}

// transformers' users once passed the legacy format (a tuple of per-layer (keys, values)); generate()
// refuses it with this message.
template <class T>
[[noreturn]] void prepare_cache_for_generation(const GenerationConfig&, const ModelConfig&, std::string_view,
                                               const std::vector<std::pair<HostTensor<T>, HostTensor<T>>>&) {
  throw ValueError("Passing a tuple of `past_key_values` is not supported anymore. Please use a `Cache` instance.");
}

}  // namespace kvc
