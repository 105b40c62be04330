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

template <class S>
class StaticLayer::state {
 public:
  using kind_type = StaticLayer;
  using view = typename S::view_type;
  static constexpr bool is_sliding = false;
  static constexpr bool is_compileable = true;
  static constexpr bool supports_early_init = true;
  static constexpr bool supports_batch_ops = false;
  static constexpr std::string_view name = "StaticLayer";

  explicit state(const StaticLayer& kind) : max_cache_len_(kind.max_cache_len) {
    detail::check_positive(max_cache_len_, "max_cache_len", "StaticLayer");
  }

  std::int64_t max_cache_len() const noexcept { return max_cache_len_; }
  bool is_initialized() const noexcept { return initialized_; }
  LayerShape shape() const noexcept { return store_.shape(); }
  std::int64_t bytes() const noexcept { return store_.bytes(); }

  // Allocates the zeroed buffers; nothing is allocated after this.
  void lazy_initialization(LayerShape shape) {
    store_ = detail::kv_store<S>(shape, max_cache_len_, true);
    position_ = 0;
    initialized_ = true;
  }

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

  std::int64_t get_seq_length() const noexcept { return position_; }
  std::pair<std::int64_t, std::int64_t> get_mask_sizes(std::int64_t) const noexcept { return {max_cache_len_, 0}; }
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

  KV<view> stored() const noexcept { return store_.kv(0, initialized_ ? max_cache_len_ : 0); }

  state gathered(std::span<const std::int64_t> batch_indices) const {
    state out(*this, 0);
    if (initialized_) out.store_ = store_.gathered(batch_indices);
    return out;
  }

  // Saved state (docs/state.md): every slot, as the layer returns them all.
  StaticLayer kind() const noexcept { return {max_cache_len_}; }
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
