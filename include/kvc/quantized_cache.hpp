#pragma once
// kvc::QuantizedCache<T>(backend, config, QuantizedOptions{...}): transformers' QuantizedCache
// (src/transformers/cache_utils.py at a597f974): one QuantizedLayer per layer of a full-attention
// model, with the quanto or HQQ codec (docs/quantized.md); and kvc::PerLayerQuantizedCache<T>,
// the same with formats picked per layer (kvc::QuantizedPerLayer): layers kept in full precision
// (a DynamicLayer, as vLLM's kv_cache_dtype_skip_layers), and a bit width per layer.

#include <cassert>
#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <kvc/cache.hpp>
#include <kvc/config.hpp>
#include <kvc/errors.hpp>
#include <kvc/policies/layers/dynamic.hpp>
#include <kvc/policies/layers/quantized.hpp>

namespace kvc {

// kvc's per-layer choice of formats in a QuantizedCache (not in transformers): which layers keep
// their tokens in full precision, and each layer's bit width. Both refer to the layers of the
// config (after its shared layers); a layer named by skip_layers is full precision whatever
// layer_nbits says.
struct QuantizedPerLayer {
  // Layers kept in full precision (a DynamicLayer): indices, negative ones counted from the end
  // (-1 the last layer), as vLLM's kv_cache_dtype_skip_layers keeps the first and last layers in 16
  // bits. Each in [-layers, layers).
  std::vector<std::int64_t> skip_layers{};
  // Empty, or one entry per layer: its nbits, the keys' width (checked as QuantizedOptions::nbits
  // is; the values follow it unless the options set value_nbits), or nullopt for full precision.
  std::vector<std::optional<std::int64_t>> layer_nbits{};
};

// kvc::QuantizedOptions, transformers' QuantizedCache keyword arguments with its defaults, is
// QuantizedLayer<void> (<kvc/policies/layers/quantized.hpp>): the layer kinds' options, no codec.

namespace detail {

// The checks of transformers' QuantizedCache.__init__, in its order (backend, layer types, then the
// layer's own checks), and one layer kind per layer of the config.
template <class KindVariant>
std::vector<KindVariant> quantized_layer_kinds(std::string_view backend, const ModelConfig& config,
                                               const QuantizedOptions& opts, const QuantizedPerLayer& per_layer) {
  if (backend != QuantoCodec::backend && backend != HqqCodec::backend) {
    std::string msg = "Unknown quantization backend `";
    msg.append(backend);
    msg.push_back('`');
    throw ValueError(msg);
  }
  const std::vector<LayerSpec> specs = layer_specs(config);
  std::set<std::string> invalid;
  for (const auto& spec : specs)
    if (spec.type != "full_attention") invalid.insert(spec.type);
  if (!invalid.empty()) {
    std::string msg =
        "`QuantizedCache` is only supported for models with only full attention layers. We found the following "
        "invalid layer types: ";
    msg.append(py_str_set(invalid));
    throw ValueError(msg);
  }
  // The per-layer choice: its lists against the layer count (QuantizedCache, whose layers are all
  // quantized, passes none).
  if constexpr (!std::is_constructible_v<KindVariant, DynamicLayer>)
    assert(per_layer.skip_layers.empty() && per_layer.layer_nbits.empty());
  const auto n = static_cast<std::int64_t>(specs.size());
  std::vector<bool> full(specs.size(), false);
  for (const std::int64_t i : per_layer.skip_layers) {
    if (i < -n || i >= n)
      throw ValueError("QuantizedCache: skip_layers entry " + std::to_string(i) + " is out of range for " +
                       std::to_string(n) + " layers");
    full[static_cast<std::size_t>(i < 0 ? i + n : i)] = true;
  }
  if (!per_layer.layer_nbits.empty() && static_cast<std::int64_t>(per_layer.layer_nbits.size()) != n)
    throw ValueError("QuantizedCache: layer_nbits has " + std::to_string(per_layer.layer_nbits.size()) +
                     " entries for " + std::to_string(n) + " layers");
  // The layer's own checks (the function its constructor runs), run here too so that a config
  // without layers still reports them; then each layer's own nbits.
  auto layers = [&]<class Codec>(Codec) {
    const QuantizedLayer<Codec> kind = with_codec<Codec>(opts);
    validate_quantized_options(kind);
    std::vector<KindVariant> out;
    out.reserve(specs.size());
    for (std::size_t i = 0; i < specs.size(); ++i) {
      const std::optional<std::int64_t> bits =
          per_layer.layer_nbits.empty() ? std::optional<std::int64_t>(kind.nbits) : per_layer.layer_nbits[i];
      if constexpr (std::is_constructible_v<KindVariant, DynamicLayer>) {
        if (full[i] || !bits) {
          out.emplace_back(DynamicLayer{});
          continue;
        }
      }
      QuantizedLayer<Codec> own = kind;
      own.nbits = *bits;
      if (own.nbits != kind.nbits) validate_quantized_options(own);  // (kind's checked above)
      out.emplace_back(own);
    }
    return out;
  };
  return backend == QuantoCodec::backend ? layers(QuantoCodec{}) : layers(HqqCodec{});
}

}  // namespace detail

// One QuantizedLayer per layer of `config` (after its num_kv_shared_layers shared layers, like the
// other config-built caches), with backend "quanto" or "hqq" (exactly these spellings).
template <class T, class Storage = HostStorage<T>, class Offload = NoOffload>
class QuantizedCache : public Cache<Layers<QuantoQuantizedLayer, HQQQuantizedLayer>, Storage, Offload> {
  using base = Cache<Layers<QuantoQuantizedLayer, HQQQuantizedLayer>, Storage, Offload>;

 public:
  // The name the cache prints as: transformers' QuantizedCache.
  static constexpr std::string_view class_name = "QuantizedCache";
  // One QuantizedLayer of `backend`'s codec per layer of `config`, with the options `opts`.
  // ValueError for an unknown backend, a layer type other than full_attention or a bad option.
  QuantizedCache(std::string_view backend, const ModelConfig& config, QuantizedOptions opts = {})
      : base(detail::quantized_layer_kinds<typename base::kind_variant>(backend, config, opts, {})) {}
};

// QuantizedCache with formats picked per layer (kvc's, not transformers'): each layer of `config`
// a QuantizedLayer of `backend`'s codec with the options `opts`, except where `per_layer` keeps it
// in full precision (a DynamicLayer) or gives it its own nbits. make_cache builds one for
// "quantized" when cache_config has skip_layers or layer_nbits. kvc::attend_quantized reads each
// layer as it is stored: the quantized ones from their codes, the others through kvc::attend.
template <class T, class Storage = HostStorage<T>, class Offload = NoOffload>
class PerLayerQuantizedCache
    : public Cache<Layers<QuantoQuantizedLayer, HQQQuantizedLayer, DynamicLayer>, Storage, Offload> {
  using base = Cache<Layers<QuantoQuantizedLayer, HQQQuantizedLayer, DynamicLayer>, Storage, Offload>;

 public:
  // The name the cache prints as: transformers' QuantizedCache (whose layers it holds, some of
  // them in full precision).
  static constexpr std::string_view class_name = "QuantizedCache";
  // The layers QuantizedCache(backend, config, opts) would hold, with `per_layer`'s choices.
  // ValueError as QuantizedCache's, and for per-layer lists that do not fit the layers (a
  // skip_layers index outside [-layers, layers), a layer_nbits list of another length) or a
  // layer's nbits that its codec refuses.
  PerLayerQuantizedCache(std::string_view backend, const ModelConfig& config, QuantizedOptions opts,
                         const QuantizedPerLayer& per_layer)
      : base(detail::quantized_layer_kinds<typename base::kind_variant>(backend, config, opts, per_layer)) {}
};

}  // namespace kvc
