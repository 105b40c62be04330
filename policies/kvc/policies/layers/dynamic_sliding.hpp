#pragma once
// DynamicSlidingWindowLayer's state: keeps the last sliding_window - 1 tokens. Semantics:
// transformers' DynamicSlidingWindowLayer (src/transformers/cache_utils.py at a597f974); what kvc
// does differently: docs/differences.md.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/policies/layers/dynamic.hpp>
#include <kvc/policies/layers/kinds.hpp>
#include <kvc/policies/layers/kv_store.hpp>
#include <kvc/warnings.hpp>

namespace kvc {

// DynamicSlidingWindowLayer's layer over storage S (transformers' DynamicSlidingWindowLayer):
// keeps the last sliding_window - 1 tokens (and rollback_slack more) in a buffer of about twice
// that, or every token once activate_past_recording was called.
template <class S>
class DynamicSlidingWindowLayer::state {
 public:
  // The layer kind this state belongs to.
  using kind_type = DynamicSlidingWindowLayer;
  // The view type `update` and `stored` return (S::view_type).
  using view = typename S::view_type;
  // True: attention sees only the window.
  static constexpr bool is_sliding = true;
  // False: the buffer moves as it grows (transformers' is_compileable).
  static constexpr bool is_compileable = false;
  // True: lazy_initialization may give the layer its shape before the first update.
  static constexpr bool supports_early_init = true;
  // True: the Cache's batch_repeat_interleave and batch_select_indices apply to the layer.
  static constexpr bool supports_batch_ops = true;
  // The kind's name, as transformers names the class (saved states record it).
  static constexpr std::string_view name = "DynamicSlidingWindowLayer";

  // An empty layer with the kind's window and slack. Throws kvc::ValueError unless
  // 1 <= sliding_window <= kvc::max_extent and 0 <= rollback_slack <= kvc::max_extent.
  explicit state(const DynamicSlidingWindowLayer& kind) : window_(kind.sliding_window), slack_(kind.rollback_slack) {
    detail::check_size("DynamicSlidingWindowLayer: sliding_window", window_, 1, max_extent);
    detail::check_size("DynamicSlidingWindowLayer: rollback_slack", slack_, 0, max_extent);
  }

  // Returns the window W.
  std::int64_t sliding_window() const noexcept { return window_; }
  // Returns the slack R: how many tokens the layer keeps past its window.
  std::int64_t rollback_slack() const noexcept { return slack_; }
  // Whether activate_past_recording was called (the layer then keeps every token).
  bool records_past() const noexcept { return record_past_; }
  // Whether the layer has a shape (from lazy_initialization or its first update).
  bool is_initialized() const noexcept { return initialized_; }
  // Returns the layer's batch, heads and K/V head_dims (all 0 before it has a shape).
  LayerShape shape() const noexcept { return store_.shape(); }
  // Returns the bytes of K/V buffer the layer holds (its whole capacity, not only its tokens).
  std::int64_t bytes() const noexcept { return store_.bytes(); }

  // Records the shape and allocates nothing (an empty buffer).
  void lazy_initialization(LayerShape shape) {
    store_ = detail::kv_store<S>(shape, 0, false);
    start_ = len_ = 0;
    initialized_ = true;
  }

  // Makes the layer keep every token from now on, so that `crop` can roll back past the window.
  void activate_past_recording() noexcept { record_past_ = true; }

  // Appends k and v ([batch, heads, q, head_dim]) and returns what attention reads: up to W - 1
  // earlier tokens and the new ones, get_mask_sizes(q).first in all. When the buffer cannot grow
  // (kvc::MemoryError, or kvc::ValueError past the allocation limit) the layer is left as it was.
  KV<view> update(const view& k, const view& v) {
    const std::int64_t q = k.extent(2);
    const std::int64_t kv_length = get_mask_sizes(q).first;
    // Room to slide: about twice what the layer keeps (and never under 16 slots), so that the kept
    // tokens move to the front of the buffer at most once per window of appends. Reached by
    // doubling from what the first update needs (its first token does not take twice the window);
    // a layer that records its past keeps everything, and doubles.
    const std::int64_t needed = len_ + q;
    const std::int64_t grow =
        record_past_
            ? std::max(2 * needed, detail::min_dynamic_capacity)
            : std::max(needed, std::min(std::max({2 * needed, 2 * store_.capacity(), detail::min_dynamic_capacity}),
                                        std::max(2 * (window_ + slack_), detail::min_dynamic_capacity)));
    std::int64_t base = 0;
    if (!initialized_) {
      detail::kv_store<S> fresh(detail::shape_of(k, v), grow, false);
      fresh.write(0, k, v);
      store_ = std::move(fresh);
      initialized_ = true;
    } else {
      base = store_.append_after(start_, len_, k, v, grow);
    }
    // Commit: [base, base + total) holds the previously stored tokens followed by the new ones.
    const std::int64_t total = len_ + q;
    const std::int64_t returned = std::min(kv_length, total);  // exactly what get_mask_sizes advertised
    cumulative_ += q;
    const std::int64_t keep = record_past_ ? total : std::min(total, window_ - 1 + slack_);
    start_ = base + total - keep;
    len_ = keep;
    return store_.kv(base + total - returned, returned);
  }

  // Tokens seen (not the number stored).
  std::int64_t get_seq_length() const noexcept { return cumulative_; }
  // Returns (kv_length, kv_offset) for a query of q tokens: up to W - 1 tokens seen plus q, and
  // the number of tokens that have left the window.
  std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t q) const noexcept {
    const bool full = cumulative_ >= window_;
    return {full ? window_ - 1 + q : cumulative_ + q, std::max<std::int64_t>(cumulative_ - window_ + 1, 0)};
  }
  // Returns the window W.
  std::int64_t get_max_length() const noexcept { return window_; }

  // How many of its last tokens the layer can drop exactly (docs/rollback.md): every token while it
  // has dropped none (kvc::unbounded_rollback, recording its past keeps them all), else the tokens
  // it holds past the window: up to rollback_slack (0 for transformers' layer).
  std::int64_t rollback_depth() const noexcept {
    return len_ == cumulative_ ? unbounded_rollback : len_ - (window_ - 1);
  }

  // Checks that crop(tokens_to_remove) can run, changing nothing. Once W tokens were seen, throws
  // kvc::RuntimeError unless activate_past_recording was called or the layer has a slack, unless
  // tokens_to_remove <= 0, and when it would remove more than rollback_depth() tokens; before that,
  // a positive count gives the deprecation warning here.
  void check_crop(std::int64_t tokens_to_remove) const {
    if (!initialized_) return;
    if (cumulative_ < window_) {
      if (tokens_to_remove > 0) warn_once(positive_crop_deprecation);  // before any layer changes
      return;
    }
    if (!record_past_ && slack_ == 0)
      throw RuntimeError(
          "`crop` was called, but the current layer does not track past states, and the sliding window size was "
          "already reached. Call `activate_past_recording` before `crop` to be able to rollback the cache.");
    if (tokens_to_remove > 0)
      throw RuntimeError(
          "Once the sliding window size has been reached, `DynamicSlidingWindowLayer` can only be cropped by "
          "passing a negative int, to specify how many tokens to remove");
    detail::check_rollback(name, detail::crop_count(tokens_to_remove, cumulative_), rollback_depth(),
                           "the tokens it keeps past its window: rollback_slack, or every token while recording");
  }

  // Negative: removes the last -tokens_to_remove tokens; positive (deprecated, before the window is
  // full): keeps the first tokens_to_remove. Throws kvc::RuntimeError as check_crop does.
  void crop(std::int64_t tokens_to_remove) {
    check_crop(tokens_to_remove);
    if (!initialized_) return;
    if (cumulative_ < window_) {
      len_ -= detail::dynamic_crop_count(tokens_to_remove, len_);
      cumulative_ = len_;
      return;
    }
    // Past the window: removes the last n tokens; recording then keeps the window - 1 tokens before
    // them (as transformers), a slack keeps what it holds (n <= rollback_depth(), so at least W - 1).
    const std::int64_t n = detail::crop_count(tokens_to_remove, cumulative_);  // tokens_to_remove <= 0 here
    const std::int64_t stop = std::max<std::int64_t>(len_ - n, 0);
    const std::int64_t first = record_past_ ? std::max<std::int64_t>(stop - (window_ - 1), 0) : 0;
    start_ += first;
    len_ = stop - first;
    cumulative_ -= n;
  }

  // Drops the tokens and the buffer: the next update starts from nothing (the window and past
  // recording stay).
  void reset() noexcept {
    store_ = detail::kv_store<S>();
    start_ = len_ = cumulative_ = 0;
    initialized_ = false;
  }

  // The buffers the layer owns, for offload engines (docs/policies/offload.md).
  template <class F>
  void for_each_buffer(F&& f) {
    store_.for_each_buffer(f);
  }

  // Returns the tokens held, K and V: the last W - 1 (the slack's tokens are not shown: they come
  // back into view only through a crop), or every token while recording the past.
  KV<view> stored() const noexcept {
    const std::int64_t shown = record_past_ ? len_ : std::min(len_, window_ - 1);
    return store_.kv(start_ + len_ - shown, shown);
  }

  // Returns a copy whose batch entry i is entry batch_indices[i] of this layer (the Cache checks
  // the indices).
  state gathered(std::span<const std::int64_t> batch_indices) const {
    state out(*this, 0);
    if (initialized_) out.store_ = store_.gathered(batch_indices);
    return out;
  }

  // Saved state (docs/state.md); a loaded layer holds its tokens at the front of its buffer.
  DynamicSlidingWindowLayer kind() const noexcept { return {window_, slack_}; }
  // Writes the layer into a saved state, or reads it back (kvc::save, kvc::load); loading throws
  // kvc::StateError when the window differs or the saved counters are inconsistent.
  template <class A>
  void transfer(A& ar) {
    ar.param("sliding_window", window_);
    ar.param("rollback_slack", slack_);
    ar.value(initialized_);
    ar.value(record_past_);
    ar.value(len_);
    ar.value(cumulative_);
    ar.check(len_ >= 0 && len_ <= cumulative_ && cumulative_ <= max_extent && (initialized_ || cumulative_ == 0),
             "the token counts");
    ar.check(record_past_ || len_ <= window_ - 1 + slack_, "more tokens than the window keeps");
    ar.kv(store_, start_, len_, len_);
    if constexpr (A::loading) start_ = 0;
  }

 private:
  state(const state& o, int)
      : window_(o.window_),
        slack_(o.slack_),
        start_(o.start_),
        len_(o.len_),
        cumulative_(o.cumulative_),
        record_past_(o.record_past_),
        initialized_(o.initialized_) {}

  std::int64_t window_;
  std::int64_t slack_;
  detail::kv_store<S> store_;
  std::int64_t start_ = 0;  // the stored tokens are slots [start_, start_ + len_)
  std::int64_t len_ = 0;
  std::int64_t cumulative_ = 0;  // tokens seen
  bool record_past_ = false;
  bool initialized_ = false;
};

// SpeculativeSlidingWindowLayer<R>'s layer over storage S: a DynamicSlidingWindowLayer state whose
// rollback_slack is at least R.
template <std::int64_t R>
template <class S>
class SpeculativeSlidingWindowLayer<R>::state : public DynamicSlidingWindowLayer::state<S> {
  using base = DynamicSlidingWindowLayer::state<S>;

 public:
  // The layer kind this state belongs to.
  using kind_type = SpeculativeSlidingWindowLayer<R>;

  // An empty layer with the kind's window and a slack of max(R, rollback_slack). Throws
  // kvc::ValueError as DynamicSlidingWindowLayer does.
  explicit state(const SpeculativeSlidingWindowLayer& kind) : base(with_slack(kind)) {}

  // Returns a copy whose batch entry i is entry batch_indices[i] of this layer.
  state gathered(std::span<const std::int64_t> batch_indices) const { return state(base::gathered(batch_indices)); }
  // The kind with this layer's window and slack (saved states).
  SpeculativeSlidingWindowLayer kind() const noexcept { return {base::kind()}; }

 private:
  explicit state(base&& b) : base(std::move(b)) {}
  static DynamicSlidingWindowLayer with_slack(const SpeculativeSlidingWindowLayer& kind) noexcept {
    return {kind.sliding_window, std::max(kind.rollback_slack, R)};
  }
};

}  // namespace kvc
