#pragma once
// The ready-made caches: DynamicCache<T> (replicated DynamicLayer), make_dynamic_cache<T>(config)
// (pre-built from the config's layer types) and StaticCache<T>(config, max_cache_len).

#include <cstdint>
#include <initializer_list>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include <kvc/cache.hpp>
#include <kvc/config.hpp>
#include <kvc/detail/traits.hpp>
#include <kvc/layer_types.hpp>

namespace kvc {

// transformers' DynamicCache(): one DynamicLayer appended for every new layer index.
template <class T, class Storage = HostStorage<T>, class Offload = NoOffload>
class DynamicCache : public Cache<Replicate<DynamicLayer>, Storage, Offload> {
 public:
  using Cache<Replicate<DynamicLayer>, Storage, Offload>::Cache;
  // A cache with no layers yet: each layer index gets a DynamicLayer on its first update.
  DynamicCache() = default;
};

// The cache make_dynamic_cache builds: pre-built dynamic layers of every kind a config can name
// (ConfiguredDynamicLayers, from the table in <kvc/layer_types.hpp>).
// A class of its own (not an alias of the Cache) because it is transformers' DynamicCache(config=...):
// it prints as a DynamicCache, where a kvc::Cache<Layers<...>> prints as transformers' Cache.
template <class T, class Storage = HostStorage<T>, class Offload = NoOffload>
class ConfiguredDynamicCache : public Cache<ConfiguredDynamicLayers, Storage, Offload> {
 public:
  using Cache<ConfiguredDynamicLayers, Storage, Offload>::Cache;
  // The name the cache prints as: transformers' DynamicCache.
  static constexpr std::string_view class_name = "DynamicCache";
};

// StaticCache's layer policy is StaticCacheLayers: every kind STATIC_LAYER_TYPE_MAPPING names.

namespace detail {
template <class To, class From>
std::vector<To> widen_kinds(const std::vector<From>& kinds) {
  std::vector<To> out;
  out.reserve(kinds.size());
  for (const auto& k : kinds) std::visit([&](const auto& kind) { out.emplace_back(kind); }, k);
  return out;
}
}  // namespace detail

// transformers' DynamicCache(config=...): one layer per config layer type (full → DynamicLayer,
// sliding/chunked → DynamicSlidingWindowLayer with that layer's window; the linear-attention,
// hybrid and indexed types: dynamic_layer_kinds in <kvc/config.hpp>).
template <class T, class Storage = HostStorage<T>, class Offload = NoOffload>
ConfiguredDynamicCache<T, Storage, Offload> make_dynamic_cache(const ModelConfig& config) {
  using C = ConfiguredDynamicCache<T, Storage, Offload>;
  if constexpr (concepts::ValidCacheConfig<ConfiguredDynamicLayers, Storage, Offload>)
    return C(detail::widen_kinds<typename C::kind_variant>(dynamic_layer_kinds(config)));
  else
    return C();  // the misconfiguration is reported once, by C's static_asserts
}

// transformers' StaticCache(config, max_cache_len): full → StaticLayer(max_cache_len),
// sliding/chunked → StaticSlidingWindowLayer(max_cache_len, window); the linear-attention, hybrid
// and indexed types: static_layer_kinds in <kvc/config.hpp>.
template <class T, class Storage = HostStorage<T>, class Offload = NoOffload>
class StaticCache : public Cache<StaticCacheLayers, Storage, Offload> {
  using base = Cache<StaticCacheLayers, Storage, Offload>;

 public:
  // One static layer per config layer, each holding `max_cache_len` tokens. ValueError for a
  // max_cache_len below 1, a config out of range or a missing window; KeyError for an unknown type.
  StaticCache(const ModelConfig& config, std::int64_t max_cache_len)
      : base(detail::widen_kinds<typename base::kind_variant>(static_layer_kinds(config, max_cache_len))) {}

  // Its linear-attention kinds could be cropped, but its static attention layers cannot, and a
  // config always has one (transformers raises AttributeError from StaticLayer): rejected here at
  // compile time, as for a cache of static kinds only.
  static constexpr bool can_crop = false;
  // False: a StaticCache keeps a fixed batch, so the batch operations do not compile.
  static constexpr bool can_batch_ops = false;
  // Rejected at compile time: a StaticCache cannot be cropped.
  template <int = 0>
  void crop(std::int64_t) {
    static_assert(detail::always_false<Storage>,
                  "kvc::StaticCache::crop: a StaticCache cannot be cropped. Its static layers keep a fixed buffer; "
                  "use a dynamic cache to roll back");
  }
  // Rejected at compile time: a StaticCache keeps a fixed batch.
  template <int = 0>
  void batch_repeat_interleave(std::int64_t) {
    static_assert(detail::always_false<Storage>,
                  "kvc::StaticCache::batch_repeat_interleave: a StaticCache keeps a fixed batch; use a dynamic cache");
  }
  // Rejected at compile time: a StaticCache keeps a fixed batch.
  template <int = 0>
  void batch_select_indices(std::span<const std::int64_t>) {
    static_assert(detail::always_false<Storage>,
                  "kvc::StaticCache::batch_select_indices: a StaticCache keeps a fixed batch; use a dynamic cache");
  }
  // Rejected at compile time (the braced-list form): a StaticCache keeps a fixed batch.
  template <int = 0>
  void batch_select_indices(std::initializer_list<std::int64_t>) {
    static_assert(detail::always_false<Storage>,
                  "kvc::StaticCache::batch_select_indices: a StaticCache keeps a fixed batch; use a dynamic cache");
  }
};

}  // namespace kvc
