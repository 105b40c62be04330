#pragma once
// StaticSlidingWindowLayer's state: a window of min(sliding_window, max_cache_len) slots.
// Semantics: transformers' StaticSlidingWindowLayer (src/transformers/cache_utils.py at
// a597f974); differences: docs/differences.md.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/policies/layers/kinds.hpp>
#include <kvc/policies/layers/kv_store.hpp>
#include <kvc/policies/layers/static.hpp>

namespace kvc {

// StaticSlidingWindowLayer's layer over storage S (transformers' StaticSlidingWindowLayer): a
// window of W = min(sliding_window, max_cache_len) slots in zeroed K/V buffers of 2W slots,
// which slides forward instead of rolling.
template <class S>
class StaticSlidingWindowLayer::state {
 public:
  // The layer kind this state belongs to.
  using kind_type = StaticSlidingWindowLayer;
  // The view type `update` and `stored` return (S::view_type).
  using view = typename S::view_type;
  // True: attention sees only the window.
  static constexpr bool is_sliding = true;
  // True: the buffers are allocated once and never move (transformers' is_compileable).
  static constexpr bool is_compileable = true;
  // True: lazy_initialization may allocate the buffers before the first update.
  static constexpr bool supports_early_init = true;
  // False: the Cache's batch_repeat_interleave and batch_select_indices do not apply to the layer.
  static constexpr bool supports_batch_ops = false;
  // The kind's name, as transformers names the class (saved states record it).
  static constexpr std::string_view name = "StaticSlidingWindowLayer";

  // An empty layer with W = min(sliding_window, max_cache_len), allocated later. Throws
  // kvc::ValueError unless both options are between 1 and kvc::max_extent.
  explicit state(const StaticSlidingWindowLayer& kind) {
    detail::check_positive(kind.max_cache_len, "max_cache_len", "StaticSlidingWindowLayer");
    detail::check_positive(kind.sliding_window, "sliding_window", "StaticSlidingWindowLayer");
    window_ = std::min(kind.sliding_window, kind.max_cache_len);
  }

  // W, the effective max_cache_len.
  std::int64_t max_cache_len() const noexcept { return window_; }
  // Whether the buffers are allocated (by lazy_initialization or the first update).
  bool is_initialized() const noexcept { return initialized_; }
  // Returns the layer's batch, heads and K/V head_dims (all 0 before it has a shape).
  LayerShape shape() const noexcept { return store_.shape(); }
  // Returns the bytes of K/V buffer the layer holds.
  std::int64_t bytes() const noexcept { return store_.bytes(); }

  // Allocates the zeroed buffers of 2W slots and rewinds the counter.
  void lazy_initialization(LayerShape shape) {
    store_ = detail::kv_store<S>(shape, 2 * window_, true);
    start_ = cumulative_ = 0;
    initialized_ = true;
  }

  // The five paths of transformers' StaticSlidingWindowLayer.update with one counter:
  //  full, q == 1 and full, q > 1: return the last W - 1 tokens + the new ones;
  //  becoming full: return everything seen + the new ones; in each case the window becomes the
  //  last W of what is returned;  fits: write at the counter and return the whole window.
  KV<view> update(const view& k, const view& v) {
    const std::int64_t q = k.extent(2);
    const std::int64_t cur = cumulative_;
    if (!initialized_) {
      detail::kv_store<S> fresh(detail::shape_of(k, v), 2 * window_, true);
      store_ = std::move(fresh);
      initialized_ = true;
    }
    if (cur < window_ && cur + q <= window_) {  // fits (start_ is 0 until the window is full)
      store_.write(cur, k, v);
      cumulative_ += q;
      return store_.kv(0, window_);
    }
    const std::int64_t keep_from = cur >= window_ ? start_ + 1 : 0;
    const std::int64_t keep_len = cur >= window_ ? window_ - 1 : cur;
    const std::int64_t base = store_.append_after(keep_from, keep_len, k, v, keep_len + q + window_);
    const std::int64_t total = keep_len + q;
    start_ = base + total - window_;
    cumulative_ += q;
    return store_.kv(base, total);
  }

  // Returns the number of tokens seen (not the number held).
  std::int64_t get_seq_length() const noexcept { return cumulative_; }
  // Returns (kv_length, kv_offset) for a query of q tokens, as update(q tokens) returns them: W
  // while the tokens fit in the window, else the tokens kept plus q; the offset counts the tokens
  // that have left the window.
  std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t q) const noexcept {
    const std::int64_t offset = std::max<std::int64_t>(cumulative_ - window_ + 1, 0);
    if (cumulative_ >= window_) return {window_ + q - 1, offset};
    if (cumulative_ + q > window_) return {cumulative_ + q, offset};
    return {window_, offset};
  }
  // Returns the window W.
  std::int64_t get_max_length() const noexcept { return window_; }

  // Zeroes the buffers in place and rewinds the counter; keeps the allocation.
  void reset() {
    if (initialized_) store_.zero();
    start_ = cumulative_ = 0;
  }

  // The buffers the layer owns, for offload engines (docs/policies/offload.md).
  template <class F>
  void for_each_buffer(F&& f) {
    store_.for_each_buffer(f);
  }

  // Returns the window's W slots, K and V (empty views before the buffers are allocated).
  KV<view> stored() const noexcept { return store_.kv(start_, initialized_ ? window_ : 0); }

  // Returns a copy whose batch entry i is entry batch_indices[i] of this layer (the Cache checks
  // the indices; reorder_cache uses it).
  state gathered(std::span<const std::int64_t> batch_indices) const {
    state out(*this, 0);
    if (initialized_) out.store_ = store_.gathered(batch_indices);
    return out;
  }

  // Saved state (docs/state.md): the window's W slots; a loaded layer holds them at the front of
  // a buffer of 2W (start_ 0), which every later update treats as it treats the original.
  StaticSlidingWindowLayer kind() const noexcept { return {window_, window_}; }
  // Writes the layer into a saved state, or reads it back (kvc::save, kvc::load); loading throws
  // kvc::StateError when W differs or the saved counter is out of range.
  template <class A>
  void transfer(A& ar) {
    ar.param("window", window_);
    ar.value(initialized_);
    ar.value(cumulative_);
    ar.check(cumulative_ >= 0 && cumulative_ <= max_extent, "the token count");
    const std::int64_t n = initialized_ ? window_ : 0;
    ar.kv(store_, start_, n, 2 * n);
    if constexpr (A::loading) start_ = 0;
  }

 private:
  state(const state& o, int)
      : window_(o.window_), start_(o.start_), cumulative_(o.cumulative_), initialized_(o.initialized_) {}

  std::int64_t window_ = 0;
  detail::kv_store<S> store_;
  std::int64_t start_ = 0;  // the window is slots [start_, start_ + W)
  std::int64_t cumulative_ = 0;
  bool initialized_ = false;
};

}  // namespace kvc
