#pragma once
// Static-cache export, mirroring transformers' TorchExportableModuleWithStaticCache
// (transformers' integrations/executorch.py): a StaticCache whose layers are all
// full StaticLayers (sliding layers replaced, so one exported program serves any position up to
// max_cache_len), allocated up front with the model's per-layer head shapes, a step function that
// sets every layer's write position from cache_position[0], and the buffer list an exporter
// registers (key_cache_{i}, value_cache_{i}).

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <kvc/cache.hpp>
#include <kvc/config.hpp>
#include <kvc/element_types.hpp>
#include <kvc/detail/json.hpp>
#include <kvc/errors.hpp>
#include <kvc/generation.hpp>

namespace kvc {

// One buffer an exporter registers: name, address, shape and dtype (torch's names).
struct ExportedBuffer {
  // The name the exporter registers: key_cache_{i} or value_cache_{i}.
  std::string name;
  // The address of the buffer's first element.
  const void* data = nullptr;
  // The buffer's shape, [batch_size, heads, max_cache_len, head_dim].
  std::array<std::int64_t, 4> shape{};
  // torch's dtype name of the elements ("float32", "bfloat16", ...).
  std::string_view dtype;
};

namespace detail {
// An argument, else cache_config[key], else the ValueError executorch raises.
inline std::int64_t export_size(std::optional<std::int64_t> argument, const GenerationConfig& g, const char* key) {
  if (argument) return *argument;
  if (g.cache_config.is_object()) {
    const auto it = g.cache_config.find(key);
    if (it != g.cache_config.end() && !it->is_null()) {
      const std::optional<std::int64_t> v = json_integer(*it);
      if (!v)
        throw ValueError(std::string("cache_config: `") + key + "` must be an integer" +
                         (it->is_number_integer() ? " that fits in 64 bits" : "") + ", got " + json_excerpt(*it));
      return *v;
    }
  }
  throw ValueError(std::string(key) + " must be provided, either as an argument or in cache_config.");
}
}  // namespace detail

// A static cache prepared for export (transformers' TorchExportableModuleWithStaticCache): every
// layer a full StaticLayer allocated up front, a per-step write position, and the buffer list.
template <class T = float>
class StaticCacheExport {
 public:
  // The exported cache: full StaticLayers on the host.
  using cache_type = Cache<Layers<StaticLayer>, HostStorage<T>>;

  // `generation_config` is the model's (std::nullopt: the model has none).
  StaticCacheExport(const ModelConfig& config, const std::optional<GenerationConfig>& generation_config,
                    std::optional<std::int64_t> batch_size = std::nullopt,
                    std::optional<std::int64_t> max_cache_len = std::nullopt)
      : cache_(make(config, generation_config, batch_size, max_cache_len)) {}

  // The cache the exported model updates.
  cache_type& cache() noexcept { return cache_; }
  // The cache (read-only).
  const cache_type& cache() const noexcept { return cache_; }
  // The batch size the buffers are allocated for.
  std::int64_t batch_size() const noexcept { return batch_size_; }
  // The number of token slots each layer holds.
  std::int64_t max_cache_len() const noexcept { return max_cache_len_; }

  // Call before each forward: every layer writes next at cache_position[0] (what the exported
  // module does with `layer.cumulative_length.copy_(cache_position[0])`).
  void begin_step(std::span<const std::int64_t> cache_position) {
    if (cache_position.empty()) throw ValueError("begin_step: cache_position must hold at least one position");
    cache_.set_write_position(cache_position.front());
  }
  // begin_step for a braced list of positions: ValueError when it is empty, IndexError for a
  // negative first position or one past max_cache_len.
  void begin_step(std::initializer_list<std::int64_t> cache_position) {
    begin_step(std::span(cache_position.begin(), cache_position.size()));
  }

  // key_cache_{i} and value_cache_{i} for every layer, in layer order.
  std::vector<ExportedBuffer> buffers() const {
    std::vector<ExportedBuffer> out;
    for (std::int64_t i = 0; i < cache_.size(); ++i) {
      const auto kv = cache_.stored(i);
      out.push_back({"key_cache_" + std::to_string(i), kv.keys.data(), kv.keys.extents, detail::torch_dtype<T>()});
      out.push_back(
          {"value_cache_" + std::to_string(i), kv.values.data(), kv.values.extents, detail::torch_dtype<T>()});
    }
    return out;
  }

 private:
  cache_type make(const ModelConfig& config, const std::optional<GenerationConfig>& g,
                  std::optional<std::int64_t> batch_size, std::optional<std::int64_t> max_cache_len) {
    if (!g)
      throw AssertionError(
          "The model must have a generation config to be exported with static caching. Please set "
          "`generation_config` in `model`.");
    if (!g->use_cache.value_or(true))
      throw AssertionError(
          "The model must have caching enabled to be exported with static caching. Please set "
          "`generation_config.use_cache=True`.");
    if (g->cache_implementation != "static")
      throw AssertionError(
          "The model must use a 'static' caching implementation to be exported with static caching. Please set "
          "`generation_config.cache_implementation='static'`.");
    batch_size_ = detail::export_size(batch_size, *g, "batch_size");
    max_cache_len_ = detail::export_size(max_cache_len, *g, "max_cache_len");
    // The static layer mapping first (unknown types are a KeyError), then every layer becomes a
    // full StaticLayer.
    const auto kinds = static_layer_kinds(config, max_cache_len_);
    std::vector<typename cache_type::kind_variant> layers(kinds.size(), StaticLayer{max_cache_len_});
    cache_type cache(layers);
    const HeadShapes shapes = get_head_shapes(config);
    cache.early_initialization(batch_size_, shapes.num_heads, shapes.head_dim);
    return cache;
  }

  std::int64_t batch_size_ = 0;
  std::int64_t max_cache_len_ = 0;
  cache_type cache_;
};

}  // namespace kvc
