#pragma once
// kvc::QuantizedCache<T>(backend, config, QuantizedOptions{...}): transformers' QuantizedCache
// (src/transformers/cache_utils.py at a597f974): one QuantizedLayer per layer of a full-attention
// model, with the quanto or HQQ codec (docs/quantized.md).

#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <kvc/cache.hpp>
#include <kvc/config.hpp>
#include <kvc/errors.hpp>
#include <kvc/policies/layers/quantized.hpp>

namespace kvc {

// kvc::QuantizedOptions, transformers' QuantizedCache keyword arguments with its defaults, is
// QuantizedLayer<void> (<kvc/policies/layers/quantized.hpp>): the layer kinds' options, no codec.

namespace detail {

// The checks of transformers' QuantizedCache.__init__, in its order (backend, layer types, then the
// layer's own checks), and one layer kind per layer of the config.
template <class KindVariant>
std::vector<KindVariant> quantized_layer_kinds(std::string_view backend, const ModelConfig& config,
                                               const QuantizedOptions& opts) {
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
  // The layer's own checks (the function its constructor runs), run here too so that a config
  // without layers still reports them.
  auto layers = [&]<class Codec>(Codec) {
    const QuantizedLayer<Codec> kind = with_codec<Codec>(opts);
    validate_quantized_options(kind);
    return std::vector<KindVariant>(specs.size(), kind);
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
      : base(detail::quantized_layer_kinds<typename base::kind_variant>(backend, config, opts)) {}
};

}  // namespace kvc
