#pragma once
// The layer kinds as tags: each kind's options and the declaration of its per-storage state,
// `template <class S> class state;`. The states are defined in the kind's own header
// (dynamic.hpp, static.hpp, linear.hpp, indexed.hpp); code that only names kinds (a config's
// layer-type table, the paged cache's layer groups) includes this header and compiles none of
// them. Layers<...> and Replicate<...> are the two layer policies (docs/policies/layers.md).

#include <cstdint>
#include <limits>

#include <boost/mp11/list.hpp>

namespace kvc {

// ---- attention kinds (dynamic.hpp, static.hpp) ----------------------------------------------

// Appends every update; returns everything it holds. transformers' default layer.
struct DynamicLayer {
  template <class S>
  class state;
};

// Keeps the last sliding_window - 1 tokens (the token decoded next fills the window's last slot),
// or every token once `activate_past_recording` was called, so that `crop` can roll back.
struct DynamicSlidingWindowLayer {
  // The window W: the layer keeps the last W - 1 tokens (1 <= W <= kvc::max_extent).
  std::int64_t sliding_window = 0;
  // kvc's option R: the layer keeps R tokens more than the window, so that crop(-n) with n <= R
  // stays exact once the window has slid (docs/rollback.md). Attention still sees the window only.
  // 0 (transformers' layer) to kvc::max_extent.
  std::int64_t rollback_slack = 0;

  template <class S>
  class state;
};

// A DynamicSlidingWindowLayer that keeps at least R tokens past its window (its rollback_slack is
// raised to R), with R in the type: a cache of such layers can promise at compile time that the
// last R tokens it was given can be taken back exactly (kvc::require_rollback, docs/rollback.md),
// as a speculative decoder verifying R draft tokens needs. Same options and state as
// DynamicSlidingWindowLayer; saved states name it DynamicSlidingWindowLayer.
template <std::int64_t R>
struct SpeculativeSlidingWindowLayer : DynamicSlidingWindowLayer {
  static_assert(R >= 0, "kvc::SpeculativeSlidingWindowLayer<R>: R counts tokens and cannot be negative");

  template <class S>
  class state;
};

// Preallocated [batch, heads, max_cache_len, head_dim] buffers; `update` writes at the layer's
// counter and returns the whole buffer (zeros in unwritten slots).
struct StaticLayer {
  // The number of token slots of the K/V buffers (1 <= max_cache_len <= kvc::max_extent).
  std::int64_t max_cache_len = 0;

  template <class S>
  class state;
};

// A window of W = min(sliding_window, max_cache_len) slots. The window lives in a buffer of 2W slots
// and slides forward, moving back only when it reaches the end, so a decode step costs O(1)
// amortized instead of transformers' roll of the whole window (docs/kv_layout.md).
struct StaticSlidingWindowLayer {
  // The model's maximum cache length; the window has min(sliding_window, max_cache_len) slots.
  std::int64_t max_cache_len = 0;
  // The model's sliding window; the window has min(sliding_window, max_cache_len) slots.
  std::int64_t sliding_window = 0;

  template <class S>
  class state;
};

// ---- indexed kinds (indexed.hpp): attention plus the indexer's keys --------------------------

// A DynamicLayer plus indexer keys that grow with every update_indexer
// (transformers' DynamicIndexedLayer).
struct DynamicIndexedLayer {
  template <class S>
  class state;
};

// A StaticLayer plus a static indexer buffer [batch, max_cache_len, index_head_dim] with its own
// counter (transformers' StaticIndexedLayer).
struct StaticIndexedLayer {
  // The number of token slots of the K/V buffers and of the indexer buffer (positive).
  std::int64_t max_cache_len = 0;

  template <class S>
  class state;
};

// ---- linear-attention kinds (linear.hpp) ---------------------------------------------------

// Conv and recurrent states only; the Cache reaches it through update_conv_state /
// update_recurrent_state (it has no K/V `update`).
struct LinearAttentionLayer {
  // How many (conv state, recurrent state) slots the layer holds (1 <= n <= kvc::max_layers).
  std::int64_t number_of_states = 1;
  // kvc's option R: each slot keeps a ring of its states from before its last R steps (a step: an
  // update_conv_state and the update_recurrent_state after it), so that crop(-n) can restore them
  // exactly (docs/rollback.md). 0 (transformers' layer) to kvc::max_layers.
  std::int64_t rollback_states = 0;

  template <class S>
  class state;
};

// A LinearAttentionLayer that keeps the states of at least its last R steps (its rollback_states
// is raised to R), with R in the type, so that a cache of such layers can promise R tokens of exact
// rollback at compile time (kvc::require_rollback) when its linear layers take one token per step
// (docs/rollback.md). Same options and state as LinearAttentionLayer; saved states name it
// LinearAttentionLayer.
template <std::int64_t R>
struct SpeculativeLinearAttentionLayer : LinearAttentionLayer {
  static_assert(R >= 0, "kvc::SpeculativeLinearAttentionLayer<R>: R counts steps and cannot be negative");

  template <class S>
  class state;
};

// A linear-attention part and an attention part (any K/V kind) in one layer, by composition:
// every operation acts on both parts, and the length queries come from the attention part.
template <class Attention>
struct LinearAttentionHybrid {
  // The attention part's kind and its options (DynamicLayer, StaticLayer, ...).
  Attention attention{};
  // How many (conv state, recurrent state) slots the linear part holds.
  std::int64_t number_of_states = 1;
  // The linear part's rollback_states (see LinearAttentionLayer).
  std::int64_t rollback_states = 0;

  template <class S>
  class state;
};

// transformers' LinearAttentionAndFullAttentionLayer: a linear part and a DynamicLayer.
using LinearAttentionAndFullAttentionLayer = LinearAttentionHybrid<DynamicLayer>;
// transformers' LinearAttentionAndSlidingWindowAttentionLayer: a linear part and a
// DynamicSlidingWindowLayer.
using LinearAttentionAndSlidingWindowAttentionLayer = LinearAttentionHybrid<DynamicSlidingWindowLayer>;
// transformers' LinearAttentionAndStaticFullAttentionLayer: a linear part and a StaticLayer.
using LinearAttentionAndStaticFullAttentionLayer = LinearAttentionHybrid<StaticLayer>;
// transformers' LinearAttentionAndStaticSlidingWindowAttentionLayer: a linear part and a
// StaticSlidingWindowLayer.
using LinearAttentionAndStaticSlidingWindowAttentionLayer = LinearAttentionHybrid<StaticSlidingWindowLayer>;

// ---- rollback: how far back a layer can be cropped exactly (docs/rollback.md) ------------------

// The rollback depth of a layer that can drop any number of its last tokens exactly: crop(-n)
// removes min(n, held) tokens and leaves what a layer that never saw them would hold.
inline constexpr std::int64_t unbounded_rollback = std::numeric_limits<std::int64_t>::max();

// How many of the tokens given since its last crop a layer of kind Kind can always drop exactly,
// whatever it holds: unbounded_rollback for the kinds that keep every token (DynamicLayer,
// DynamicIndexedLayer), R for SpeculativeSlidingWindowLayer<R> and for
// SpeculativeLinearAttentionLayer<R> (given one token per step), 0 for the others (their depth is
// known at run time: a layer's rollback_depth()). A cache's bound is the minimum over its kinds
// (kvc::Cache::rollback_bound, kvc::require_rollback).
template <class Kind>
inline constexpr std::int64_t rollback_bound_v = 0;
// A DynamicLayer keeps every token: any crop is exact.
template <>
inline constexpr std::int64_t rollback_bound_v<DynamicLayer> = unbounded_rollback;
// A DynamicIndexedLayer keeps every token and every indexer key: any crop is exact.
template <>
inline constexpr std::int64_t rollback_bound_v<DynamicIndexedLayer> = unbounded_rollback;
// A SpeculativeSlidingWindowLayer<R> keeps R tokens past its window.
template <std::int64_t R>
inline constexpr std::int64_t rollback_bound_v<SpeculativeSlidingWindowLayer<R>> = R;
// A SpeculativeLinearAttentionLayer<R> keeps the states of its last R steps: R tokens when each
// step takes one token (a longer step cannot be cropped part-way; crop throws).
template <std::int64_t R>
inline constexpr std::int64_t rollback_bound_v<SpeculativeLinearAttentionLayer<R>> = R;

// ---- the layer policies ----------------------------------------------------------------------

// Pre-built layers: the cache is constructed from a list of layers whose kinds are among Kinds.
template <class... Kinds>
struct Layers {
  // The layer kinds, as a Boost.Mp11 list (kvc::concepts::LayerPolicy).
  using layers = boost::mp11::mp_list<Kinds...>;
};

// Replicated layers: `update` with an index the cache does not have yet appends layers of Kind
// (copies of the prototype given at construction) until it does.
template <class Kind>
struct Replicate {
  // The kind of every layer the cache appends.
  using layer_class_to_replicate = Kind;
};

}  // namespace kvc
