#pragma once
// DynamicLayer's state (grows without bound), and what the dynamic kinds share. Semantics:
// transformers' DynamicLayer (src/transformers/cache_utils.py at a597f974); what kvc does
// differently: docs/differences.md. DynamicSlidingWindowLayer: dynamic_sliding.hpp.

#include <algorithm>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/policies/layers/crop_plan.hpp>
#include <kvc/policies/layers/kinds.hpp>
#include <kvc/policies/layers/kv_store.hpp>
#include <kvc/warnings.hpp>

namespace kvc {

// The warning a `crop` with a positive count gives (transformers' deprecation message).
inline constexpr std::string_view positive_crop_deprecation =
    "Calling `crop` with a positive value is deprecated and will be removed in version 5.18. Please use a "
    "negative integer to remove that number of tokens from the cache instead.";

namespace detail {
inline std::int64_t dynamic_crop_count(std::int64_t tokens_to_remove, std::int64_t len) {
  if (tokens_to_remove > 0) warn_once(positive_crop_deprecation);
  return crop_count(tokens_to_remove, len);
}

inline constexpr std::int64_t min_dynamic_capacity = 16;

// The capacity a growing layer moves to when `needed` tokens no longer fit in `capacity`: a quarter
// more, so that the buffer never holds more than 1.25x what its tokens need once it is past its
// first allocation (doubling held up to 2x), while appends stay amortized O(new tokens): each
// token is copied at most 5 times over the buffer's growth, against 2 for doubling.
inline std::int64_t grown_capacity(std::int64_t capacity, std::int64_t needed) noexcept {
  return std::max({capacity + capacity / 4, needed, min_dynamic_capacity});
}
}  // namespace detail

// DynamicLayer's layer over storage S (transformers' DynamicLayer): holds every token seen, in
// K/V buffers that grow by a quarter when full, so that appends cost amortized O(new tokens).
template <class S>
class DynamicLayer::state {
 public:
  // The layer kind this state belongs to.
  using kind_type = DynamicLayer;
  // The view type `update` and `stored` return (S::view_type).
  using view = typename S::view_type;
  // False: the layer keeps every token.
  static constexpr bool is_sliding = false;
  // False: the buffers move as they grow (transformers' is_compileable).
  static constexpr bool is_compileable = false;
  // True: lazy_initialization may give the layer its shape before the first update.
  static constexpr bool supports_early_init = true;
  // True: the Cache's batch_repeat_interleave and batch_select_indices apply to the layer.
  static constexpr bool supports_batch_ops = true;
  // The kind's name, as transformers names the class (saved states record it).
  static constexpr std::string_view name = "DynamicLayer";

  // An empty layer without a shape (the kind has no options).
  explicit state(const DynamicLayer&) noexcept {}

  // Whether the layer has a shape (from lazy_initialization or its first update).
  bool is_initialized() const noexcept { return initialized_; }
  // Returns the layer's batch, heads and K/V head_dims (all 0 before it has a shape).
  LayerShape shape() const noexcept { return store_.shape(); }
  // Returns the bytes of K/V buffer the layer holds (its whole capacity, not only its tokens).
  std::int64_t bytes() const noexcept { return store_.bytes(); }

  // Records the shape and allocates nothing (transformers' 1-D empty tensor).
  void lazy_initialization(LayerShape shape) {
    store_ = detail::kv_store<S>(shape, 0, false);
    len_ = 0;
    initialized_ = true;
  }

  // Appends k and v ([batch, heads, q, head_dim]) and returns every token held, K and V. When the
  // buffer cannot grow (kvc::MemoryError, or kvc::ValueError past the allocation limit) the layer
  // is left as it was.
  KV<view> update(const view& k, const view& v) {
    const std::int64_t q = k.extent(2);
    const std::int64_t grow = std::max(detail::grown_capacity(store_.capacity(), len_ + q), reserved_);
    if (!initialized_) {
      detail::kv_store<S> fresh(detail::shape_of(k, v), grow, false);
      fresh.write(0, k, v);
      store_ = std::move(fresh);
      initialized_ = true;
    } else {
      store_.append_after(0, len_, k, v, grow);
    }
    len_ += q;
    return store_.kv(0, len_);
  }

  // Cache::reserve's two steps: the buffer with room for `tokens` tokens that the layer would move
  // to (empty when it has the room, or no shape yet), then the move (cannot fail). A layer without
  // a shape keeps the number for its first allocation.
  detail::kv_store<S> reserved(std::int64_t tokens) const {
    if (!initialized_ || store_.capacity() >= tokens) return {};
    return store_.relocated(tokens, 0, len_);
  }
  // Keeps `tokens` as the least capacity of later allocations and moves to `fresh` (from
  // reserved(tokens)) when it is larger than the present buffer. Cannot throw.
  void reserve(std::int64_t tokens, detail::kv_store<S>&& fresh) noexcept {
    reserved_ = std::max(reserved_, tokens);
    if (initialized_ && fresh.capacity() > store_.capacity()) store_ = std::move(fresh);
  }

  // Returns the number of tokens held.
  std::int64_t get_seq_length() const noexcept { return len_; }
  // Returns (kv_length, kv_offset) for a query of q tokens: (tokens held + q, 0).
  std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t q) const noexcept { return {len_ + q, 0}; }
  // Returns -1: the layer has no maximum length.
  std::int64_t get_max_length() const noexcept { return -1; }

  // The deprecation warning comes here, in the check every layer passes before any layer changes,
  // so that a warning handler that throws leaves the cache as it was (crop's own warn_once call
  // then finds the message already delivered).
  void check_crop(std::int64_t tokens_to_remove) const {
    if (initialized_ && tokens_to_remove > 0) warn_once(positive_crop_deprecation);
  }
  // Returns kvc::unbounded_rollback: the layer keeps every token, so crop(-n) is exact for every n
  // (docs/rollback.md).
  std::int64_t rollback_depth() const noexcept { return unbounded_rollback; }
  // Negative: removes the last -tokens_to_remove tokens (all of them, if there are fewer).
  // Positive (deprecated, with a warning): keeps the first tokens_to_remove tokens. Does nothing
  // on a layer without a shape.
  void crop(std::int64_t tokens_to_remove) {
    if (!initialized_) return;  // transformers raises TypeError here (docs/differences.md)
    len_ -= detail::dynamic_crop_count(tokens_to_remove, len_);
  }

  // Drops the states: the next update starts from nothing (transformers #48809).
  void reset() noexcept {
    store_ = detail::kv_store<S>();
    len_ = 0;
    initialized_ = false;
  }

  // The buffers the layer owns, for offload engines (docs/policies/offload.md).
  template <class F>
  void for_each_buffer(F&& f) {
    store_.for_each_buffer(f);
  }

  // Returns the tokens held, K and V (transformers' layer.keys / layer.values).
  KV<view> stored() const noexcept { return store_.kv(0, len_); }

  // Returns a copy whose batch entry i is entry batch_indices[i] of this layer (the Cache checks
  // the indices).
  state gathered(std::span<const std::int64_t> batch_indices) const {
    state out(*this, 0);
    if (initialized_) out.store_ = store_.gathered(batch_indices);
    return out;
  }

  // Saved state (docs/state.md): the kind's parameters, the counters and the tokens held. A loaded
  // layer holds them in a buffer of exactly that many slots.
  DynamicLayer kind() const noexcept { return {}; }
  // Writes the layer into a saved state, or reads it back (kvc::save, kvc::load); loading throws
  // kvc::StateError when the saved counters are inconsistent.
  template <class A>
  void transfer(A& ar) {
    ar.value(initialized_);
    ar.value(len_);
    ar.check(len_ >= 0 && len_ <= max_extent && (initialized_ || len_ == 0), "the token count");
    ar.kv(store_, 0, len_, len_);
  }

 private:
  state(const state& other, int) : len_(other.len_), reserved_(other.reserved_), initialized_(other.initialized_) {}

  detail::kv_store<S> store_;
  std::int64_t len_ = 0;
  std::int64_t reserved_ = 0;  // the least capacity reserve asked for (kept by reset)
  bool initialized_ = false;
};

}  // namespace kvc
