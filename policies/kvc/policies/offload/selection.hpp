#pragma once
// Which layers an offloading cache moves out of fast memory, and which one it prefetches next
// (transformers' Cache.prefetch / Cache.offload with offloading=True). Pure functions over
// the per-layer flags the cache reports (`is_linear()`, `is_sliding()`), shared by every offload
// policy (OffloadToFile, OffloadToHost) and tested on the host (tests/unit/offload_selection.cpp).
//
// A layer is offloadable unless it is a pure linear-attention layer, or it is a sliding layer and
// the policy offloads only non-sliding layers. Hybrids (a linear part and an attention part) are
// offloadable, both parts together; transformers moves only some of their parts (docs/offload.md).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <kvc/errors.hpp>

namespace kvc::offload {

// The flags of a cache's layers, as its `is_linear()` and `is_sliding()` return them.
struct layer_flags {
  // Per layer: whether it is a pure linear-attention layer.
  std::vector<bool> is_linear;
  // Per layer: whether it is a sliding-window layer.
  std::vector<bool> is_sliding;

  // Returns the number of layers (the length of is_linear).
  std::int64_t size() const noexcept { return static_cast<std::int64_t>(is_linear.size()); }
};

namespace detail {
inline void check_flags(const layer_flags& f, const char* function) {
  if (f.is_linear.size() != f.is_sliding.size()) {
    std::string m = "kvc::offload::";
    m += function;
    m += ": is_linear has ";
    m += std::to_string(f.is_linear.size());
    m += " entries but is_sliding has ";
    m += std::to_string(f.is_sliding.size());
    m += "; both must list every layer of the cache";
    throw ValueError(m);
  }
}
inline void check_layer_index(std::int64_t layer_idx, const char* function) {
  if (layer_idx < 0) {
    std::string m = "kvc::offload::";
    m += function;
    m += ": layer_idx ";
    m += std::to_string(layer_idx);
    m += " is negative";
    throw IndexError(m);
  }
}
}  // namespace detail

// Whether layer `i` may leave fast memory. False past the last layer.
inline bool offloadable(std::int64_t i, const layer_flags& f, bool only_non_sliding) {
  detail::check_flags(f, "offloadable");
  detail::check_layer_index(i, "offloadable");
  if (i >= f.size()) return false;
  const auto u = static_cast<std::size_t>(i);
  return !f.is_linear[u] && !(only_non_sliding && f.is_sliding[u]);
}

// Whether any layer may leave fast memory.
inline bool any_offloadable(const layer_flags& f, bool only_non_sliding) {
  detail::check_flags(f, "any_offloadable");
  for (std::int64_t i = 0; i < f.size(); ++i)
    if (offloadable(i, f, only_non_sliding)) return true;
  return false;
}

// The text of the error that prefetch_target throws when no layer is offloadable.
inline constexpr const char* no_offloadable_layer_message =
    "Offloading cannot pick a layer to prefetch: no layer can be offloaded, because every layer is a "
    "linear-attention layer or, with offload_only_non_sliding, a sliding-window layer. Offload sliding "
    "layers too, e.g. kvc::OffloadToFile<false>, or use kvc::NoOffload";

// The layer to prefetch while layer `layer_idx - 1` is updated: the first offloadable layer at
// `layer_idx` or after it, else (wrap-around) the first offloadable layer of the cache. Throws
// ValueError if no layer is offloadable (transformers fails there inside list.index).
inline std::int64_t prefetch_target(std::int64_t layer_idx, const layer_flags& f, bool only_non_sliding) {
  detail::check_flags(f, "prefetch_target");
  detail::check_layer_index(layer_idx, "prefetch_target");
  for (std::int64_t i = layer_idx; i < f.size(); ++i)
    if (offloadable(i, f, only_non_sliding)) return i;
  for (std::int64_t i = 0; i < f.size() && i < layer_idx; ++i)
    if (offloadable(i, f, only_non_sliding)) return i;
  throw ValueError(no_offloadable_layer_message);
}

// Whether layer `layer_idx` leaves fast memory after its update. transformers offloads every
// layer unless only_non_sliding is set and the layer is sliding; kvc also keeps pure
// linear-attention layers (they never go through `update`, and transformers never prefetches them).
inline bool should_offload(std::int64_t layer_idx, const layer_flags& f, bool only_non_sliding) {
  return offloadable(layer_idx, f, only_non_sliding);
}

}  // namespace kvc::offload
