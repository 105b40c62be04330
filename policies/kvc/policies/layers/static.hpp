#pragma once
// StaticLayer's state (a buffer of max_cache_len slots written at a counter), and what the static
// kinds share. Semantics: transformers' StaticLayer (src/transformers/cache_utils.py at
// a597f974); differences: docs/differences.md. StaticSlidingWindowLayer: static_sliding.hpp.

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

namespace kvc {

namespace detail {
// A layer kind's size option: positive and at most kvc::max_extent.
inline void check_positive(std::int64_t value, const char* what, const char* kind) {
  check_size(join_message({kind, ": ", what}), value, 1, max_extent);
}
}  // namespace detail

// StaticLayer's layer over storage S (transformers' StaticLayer): zeroed K/V buffers of
// max_cache_len slots, allocated once, which every update writes at the layer's counter.
template <class S>
class StaticLayer::state {
 public:
  // The layer kind this state belongs to.
  using kind_type = StaticLayer;
  // The view type `update` and `stored` return (S::view_type).
  using view = typename S::view_type;
  // False: attention sees every slot.
  static constexpr bool is_sliding = false;
  // True: the buffers are allocated once and never move (transformers' is_compileable).
  static constexpr bool is_compileable = true;
  // True: lazy_initialization may allocate the buffers before the first update.
  static constexpr bool supports_early_init = true;
  // False: the Cache's batch_repeat_interleave and batch_select_indices do not apply to the layer.
  static constexpr bool supports_batch_ops = false;
  // The kind's name, as transformers names the class (saved states record it).
  static constexpr std::string_view name = "StaticLayer";

  // An empty layer of max_cache_len slots, allocated later. Throws kvc::ValueError unless
  // 1 <= max_cache_len <= kvc::max_extent.
  explicit state(const StaticLayer& kind) : max_cache_len_(kind.max_cache_len) {
    detail::check_positive(max_cache_len_, "max_cache_len", "StaticLayer");
  }

  // Returns the number of slots, max_cache_len.
  std::int64_t max_cache_len() const noexcept { return max_cache_len_; }
  // Whether the buffers are allocated (by lazy_initialization or the first update).
  bool is_initialized() const noexcept { return initialized_; }
  // Returns the layer's batch, heads and K/V head_dims (all 0 before it has a shape).
  LayerShape shape() const noexcept { return store_.shape(); }
  // Returns the bytes of K/V buffer the layer holds.
  std::int64_t bytes() const noexcept { return store_.bytes(); }

  // Allocates the zeroed buffers; nothing is allocated after this.
  void lazy_initialization(LayerShape shape) {
    store_ = detail::kv_store<S>(shape, max_cache_len_, true);
    position_ = 0;
    initialized_ = true;
  }

  // Writes k and v ([batch, heads, q, head_dim]) at the counter, advances it by q, and returns the
  // whole buffers (zeros in unwritten slots). Throws kvc::IndexError, changing nothing, when the q
  // tokens do not fit in the slots left.
  KV<view> update(const view& k, const view& v) {
    const std::int64_t q = k.extent(2);
    if (q > max_cache_len_ - position_)  // position_ <= max_cache_len_: no overflow
      throw IndexError("index " + std::to_string(max_cache_len_) + " is out of bounds for dimension 2 with size " +
                       std::to_string(max_cache_len_) + ": StaticLayer with max_cache_len " +
                       std::to_string(max_cache_len_) + " holds " + std::to_string(position_) +
                       " tokens and cannot take " + std::to_string(q) + " more");
    if (!initialized_) {
      detail::kv_store<S> fresh(detail::shape_of(k, v), max_cache_len_, true);
      store_ = std::move(fresh);
      initialized_ = true;
    }
    store_.write(position_, k, v);
    position_ += q;
    return store_.kv(0, max_cache_len_);
  }

  // Sets where the next update writes (the export path: cache_position[0], issue #4).
  void set_write_position(std::int64_t position) {
    if (position < 0 || position > max_cache_len_)
      throw IndexError("set_write_position: position " + std::to_string(position) +
                       " is out of range for a StaticLayer with max_cache_len " + std::to_string(max_cache_len_));
    position_ = position;
  }

  // Returns the counter: the tokens written since the last reset (or set_write_position).
  std::int64_t get_seq_length() const noexcept { return position_; }
  // Returns (kv_length, kv_offset) for any query: (max_cache_len, 0).
  std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t) const noexcept { return {max_cache_len_, 0}; }
  // Returns max_cache_len.
  std::int64_t get_max_length() const noexcept { return max_cache_len_; }

  // Zeroes the buffers in place and rewinds the counter; keeps the allocation.
  void reset() {
    if (initialized_) store_.zero();
    position_ = 0;
  }

  // The buffers the layer owns, for offload engines (docs/policies/offload.md).
  template <class F>
  void for_each_buffer(F&& f) {
    store_.for_each_buffer(f);
  }

  // Returns the whole buffers, K and V (empty views before they are allocated).
  KV<view> stored() const noexcept { return store_.kv(0, initialized_ ? max_cache_len_ : 0); }

  // Returns a copy whose batch entry i is entry batch_indices[i] of this layer (the Cache checks
  // the indices; reorder_cache uses it).
  state gathered(std::span<const std::int64_t> batch_indices) const {
    state out(*this, 0);
    if (initialized_) out.store_ = store_.gathered(batch_indices);
    return out;
  }

  // Saved state (docs/state.md): every slot, as the layer returns them all.
  StaticLayer kind() const noexcept { return {max_cache_len_}; }
  // Writes the layer into a saved state, or reads it back (kvc::save, kvc::load); loading throws
  // kvc::StateError when max_cache_len differs or the saved counter is out of range.
  template <class A>
  void transfer(A& ar) {
    ar.param("max_cache_len", max_cache_len_);
    ar.value(initialized_);
    ar.value(position_);
    ar.check(position_ >= 0 && position_ <= max_cache_len_, "the write position");
    const std::int64_t n = initialized_ ? max_cache_len_ : 0;
    ar.kv(store_, 0, n, n);
  }

 private:
  state(const state& o, int) : max_cache_len_(o.max_cache_len_), position_(o.position_), initialized_(o.initialized_) {}

  std::int64_t max_cache_len_;
  detail::kv_store<S> store_;
  std::int64_t position_ = 0;
  bool initialized_ = false;
};

}  // namespace kvc
