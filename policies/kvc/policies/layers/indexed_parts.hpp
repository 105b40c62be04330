#pragma once
// What the indexed layer kinds share: the dynamic and static indexer keys, and the state that
// composes a K/V layer's state with them (detail::indexed_state). The kinds' states are in
// dynamic_indexed.hpp and static_indexed.hpp; <kvc/policies/layers/indexed.hpp> has both, and
// says how the indexer keys are laid out.

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/policies/layers/attention_part.hpp>
#include <kvc/policies/layers/dynamic.hpp>
#include <kvc/policies/layers/kinds.hpp>
#include <kvc/policies/layers/static.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

namespace detail {

// The indexer keys of a DynamicIndexedLayer: [batch_, len_, dim_] dense at the front of data_,
// which has room for cap_ tokens per row. For batch > 1, spare_ has the same size and receives
// the rows whenever they have to move (see the header comment). Copies are deep.
template <class S>
class dynamic_indexer_keys {
 public:
  using T = typename S::element_type;
  using buffer = typename S::buffer_type;
  using state_view = typename S::state_view_type;

  bool initialized() const noexcept { return initialized_; }
  std::int64_t batch() const noexcept { return batch_; }
  std::int64_t length() const noexcept { return len_; }
  std::int64_t dim() const noexcept { return dim_; }
  std::int64_t capacity() const noexcept { return cap_; }
  std::int64_t bytes() const noexcept {
    return static_cast<std::int64_t>(sizeof(T)) * (std::int64_t{data_.size()} + std::int64_t{spare_.size()});
  }

  // Uninitialized: an empty view of rank 0 (transformers' None).
  state_view view() const noexcept {
    if (!initialized_) return S::make_state_view(nullptr, 0, {});
    return S::make_state_view(data_.data(), 3, {batch_, len_, dim_, 0});
  }

  // Appends x ([batch, q, dim], checked by the caller). Every allocation happens before anything
  // changes (strong guarantee).
  void append(const state_view& x) {
    const std::int64_t b = x.extent(0), q = x.extent(1), d = x.extent(2);
    if (!initialized_) {
      const std::int64_t cap = std::max(q, min_dynamic_capacity);
      buffer fresh(checked_elements({b, cap, d}, sizeof(T)));
      buffer spare(b > 1 ? checked_elements({b, cap, d}, sizeof(T)) : 0);
      S::copy_2d(fresh.data(), b * q * d, x.data(), b * q * d, b * q * d, 1);
      data_ = std::move(fresh);
      spare_ = std::move(spare);
      batch_ = b;
      dim_ = d;
      cap_ = cap;
      len_ = q;
      initialized_ = true;
      return;
    }
    const std::int64_t next = len_ + q;
    const std::int64_t grown = grown_capacity(cap_, next);
    if (batch_ == 1) {
      if (next > cap_) {
        buffer fresh(checked_elements({grown, dim_}, sizeof(T)));
        S::copy_2d(fresh.data(), len_ * dim_, data_.data(), len_ * dim_, len_ * dim_, 1);
        data_ = std::move(fresh);
        cap_ = grown;
      }
      S::copy_2d(data_.data() + len_ * dim_, q * dim_, x.data(), q * dim_, q * dim_, 1);
      len_ = next;
      return;
    }
    // batch > 1: the rows are re-spaced into the other buffer.
    if (next > cap_) {
      buffer fresh(checked_elements({batch_, grown, dim_}, sizeof(T)));
      buffer spare(checked_elements({batch_, grown, dim_}, sizeof(T)));
      respace(fresh.data(), next, x);
      data_ = std::move(fresh);
      spare_ = std::move(spare);
      cap_ = grown;
    } else {
      respace(spare_.data(), next, x);
      data_.swap(spare_);
    }
    len_ = next;
  }

  // Keeps the first `keep` tokens of every row (keep <= length()). Never allocates.
  void truncate(std::int64_t keep) {
    if (!initialized_ || keep >= len_) return;
    if (batch_ > 1) {
      S::copy_2d(spare_.data(), keep * dim_, data_.data(), len_ * dim_, keep * dim_, batch_);
      data_.swap(spare_);
    }
    len_ = keep;
  }

  // A copy whose batch row i is row indices[i] of this one (indices checked by the caller).
  dynamic_indexer_keys gathered(std::span<const std::int64_t> indices) const {
    dynamic_indexer_keys out;
    if (!initialized_) return out;
    const auto n = static_cast<std::int64_t>(indices.size());
    const std::int64_t row = len_ * dim_;
    out.data_ = buffer(checked_elements({n, row}, sizeof(T)));
    out.spare_ = buffer(n > 1 ? checked_elements({n, row}, sizeof(T)) : 0);
    for (std::int64_t i = 0; i < n; ++i)
      S::copy_2d(out.data_.data() + i * row, row, data_.data() + indices[static_cast<std::size_t>(i)] * row, row, row,
                 1);
    out.batch_ = n;
    out.dim_ = dim_;
    out.cap_ = len_;
    out.len_ = len_;
    out.initialized_ = true;
    return out;
  }

  template <class F>
  void for_each_buffer(F&& f) {
    f(data_);
    f(spare_);
  }

  // Saved state (docs/state.md): the [batch, length, dim] keys; a loaded buffer has no spare room.
  template <class A>
  void transfer(A& ar) {
    ar.value(initialized_);
    ar.value(batch_);
    ar.value(len_);
    ar.value(dim_);
    std::int64_t n = 0;
    if constexpr (A::loading) {
      ar.check(products_fit({batch_, len_, dim_}), "the indexer keys' extents");
      ar.check(initialized_ || (batch_ == 0 && len_ == 0 && dim_ == 0), "the indexer keys' extents");
    }
    if (initialized_) n = checked_elements({batch_, len_, dim_}, sizeof(T));
    ar.buffer(data_, n);
    if constexpr (A::loading) {
      spare_ = buffer(batch_ > 1 ? n : 0);
      cap_ = len_;
    }
  }

 private:
  // Writes the current rows followed by x's rows to dst, with rows of `next` tokens.
  void respace(T* dst, std::int64_t next, const state_view& x) const {
    const std::int64_t q = x.extent(1);
    S::copy_2d(dst, next * dim_, data_.data(), len_ * dim_, len_ * dim_, batch_);
    S::copy_2d(dst + len_ * dim_, next * dim_, x.data(), q * dim_, q * dim_, batch_);
  }

  buffer data_;
  buffer spare_;
  std::int64_t batch_ = 0;
  std::int64_t len_ = 0;
  std::int64_t dim_ = 0;
  std::int64_t cap_ = 0;
  bool initialized_ = false;
};

// The indexer keys of a StaticIndexedLayer: a zeroed [batch, slots, dim] buffer, allocated by
// the first write, written at its own counter.
template <class S>
class static_indexer_keys {
 public:
  using T = typename S::element_type;
  using buffer = typename S::buffer_type;
  using state_view = typename S::state_view_type;

  explicit static_indexer_keys(std::int64_t slots) noexcept : slots_(slots) {}

  bool initialized() const noexcept { return initialized_; }
  std::int64_t batch() const noexcept { return batch_; }
  std::int64_t dim() const noexcept { return dim_; }
  std::int64_t position() const noexcept { return pos_; }
  std::int64_t bytes() const noexcept { return static_cast<std::int64_t>(sizeof(T)) * data_.size(); }

  // The whole buffer (zeros in unwritten slots); uninitialized: an empty view of rank 0.
  state_view view() const noexcept {
    if (!initialized_) return S::make_state_view(nullptr, 0, {});
    return S::make_state_view(data_.data(), 3, {batch_, slots_, dim_, 0});
  }

  // Writes x ([batch, q, dim], checked by the caller, pos + q <= slots) at the counter.
  void write(const state_view& x) {
    const std::int64_t b = x.extent(0), q = x.extent(1), d = x.extent(2);
    if (!initialized_) {
      buffer fresh(checked_elements({b, slots_, d}, sizeof(T)));
      S::zero_2d(fresh.data(), 0, fresh.size(), fresh.size() > 0 ? 1 : 0);
      data_ = std::move(fresh);
      batch_ = b;
      dim_ = d;
      initialized_ = true;
    }
    S::copy_2d(data_.data() + pos_ * dim_, slots_ * dim_, x.data(), q * dim_, q * dim_, batch_);
    pos_ += q;
  }

  void set_position(std::int64_t position) noexcept { pos_ = position; }

  // Zeroes the buffer in place and rewinds; keeps the allocation.
  void reset() {
    if (data_.size() > 0) S::zero_2d(data_.data(), 0, data_.size(), 1);
    pos_ = 0;
  }

  static_indexer_keys gathered(std::span<const std::int64_t> indices) const {
    static_indexer_keys out(slots_);
    out.pos_ = pos_;
    if (!initialized_) return out;
    const auto n = static_cast<std::int64_t>(indices.size());
    const std::int64_t row = slots_ * dim_;
    out.data_ = buffer(checked_elements({n, row}, sizeof(T)));
    for (std::int64_t i = 0; i < n; ++i)
      S::copy_2d(out.data_.data() + i * row, row, data_.data() + indices[static_cast<std::size_t>(i)] * row, row, row,
                 1);
    out.batch_ = n;
    out.dim_ = dim_;
    out.initialized_ = true;
    return out;
  }

  template <class F>
  void for_each_buffer(F&& f) {
    f(data_);
  }

  // Saved state (docs/state.md): the counter and the whole [batch, slots, dim] buffer.
  template <class A>
  void transfer(A& ar) {
    ar.value(initialized_);
    ar.value(batch_);
    ar.value(dim_);
    ar.value(pos_);
    std::int64_t n = 0;
    if constexpr (A::loading) {
      ar.check(products_fit({batch_, slots_, dim_}), "the indexer keys' extents");
      ar.check(pos_ >= 0 && pos_ <= slots_ && (initialized_ || (batch_ == 0 && dim_ == 0)),
               "the indexer keys' counter");
    }
    if (initialized_) n = checked_elements({batch_, slots_, dim_}, sizeof(T));
    ar.buffer(data_, n);
  }

 private:
  buffer data_;
  std::int64_t slots_ = 0;
  std::int64_t batch_ = 0;
  std::int64_t dim_ = 0;
  std::int64_t pos_ = 0;
  bool initialized_ = false;
};

// The input checks both indexed kinds share (ValueError, naming both shapes). `attn` is the K/V
// part's state, `held` the indexer keys the layer holds (rank 0 when it holds none).
template <class Attention, class View>
void check_indexer_input(const Attention& attn, const View& held, const View& x) {
  if (x.rank != 3)
    throw ValueError(join_message(
        {"update_indexer: indexer keys must have shape [batch, seq, index_head_dim], got ", shape_string(x)}));
  if (x.extent(0) < 1 || x.extent(1) < 0 || x.extent(2) < 1)
    throw ValueError(join_message(
        {"update_indexer: indexer keys of shape ", shape_string(x), " must have a positive batch and index_head_dim"}));
  if (attn.is_initialized() && attn.shape().batch != x.extent(0))
    throw ValueError(join_message({"update_indexer: indexer keys of shape ", shape_string(x),
                                   " do not match the layer's keys of shape ", shape_string(attn.stored().keys.extents),
                                   ": the batch sizes differ"}));
  if (held.rank == 3 && (held.extent(0) != x.extent(0) || held.extent(2) != x.extent(2)))
    throw ValueError(join_message({"update_indexer: indexer keys of shape ", shape_string(x),
                                   " do not match the indexer keys the layer holds, of shape ", shape_string(held),
                                   ": batch and index_head_dim must stay the same"}));
}

// The K/V side of the same rule: keys whose batch differs from the indexer keys' are rejected.
template <class View, class KeysView>
void check_kv_batch(const View& held, const KeysView& k, std::string_view method) {
  if (held.rank == 3 && held.extent(0) != k.extent(0))
    throw ValueError(join_message({method, ": keys of shape ", shape_string(k.extents),
                                   " do not match the layer's indexer keys of shape ", shape_string(held),
                                   ": the batch sizes differ"}));
}
inline void check_shape_batch(std::int64_t held_rank, std::int64_t held_batch, const LayerShape& shape) {
  if (held_rank == 3 && held_batch != shape.batch)
    throw ValueError(
        join_message({"lazy_initialization: batch size ", std::to_string(shape.batch),
                      " does not match the layer's indexer keys, which have batch size ", std::to_string(held_batch)}));
}

// What both indexed layers share: a K/V part A (checked against the indexer keys' batch) and the
// indexer keys I (dynamic_indexer_keys or static_indexer_keys).
template <class S, class A, class I>
class indexed_state : public with_attention_part<A> {
 public:
  using view = typename S::view_type;
  using state_view = typename S::state_view_type;

  std::int64_t bytes() const noexcept { return this->attn_.bytes() + indexer_.bytes(); }
  void lazy_initialization(LayerShape shape) {
    check_shape_batch(indexer_keys().rank, indexer_.batch(), shape);
    this->attn_.lazy_initialization(shape);
  }
  KV<view> update(const view& k, const view& v) {
    check_kv_batch(indexer_keys(), k, "update");
    return this->attn_.update(k, v);
  }

  bool is_indexer_initialized() const noexcept { return indexer_.initialized(); }
  // What the layer holds; an empty view of rank 0 before the first update_indexer (transformers' None).
  state_view indexer_keys() const noexcept { return indexer_.view(); }

  // The batch of whatever the layer holds (K/V first), -1 when it holds nothing.
  std::int64_t batch() const noexcept {
    if (this->attn_.is_initialized()) return this->attn_.shape().batch;
    return indexer_.initialized() ? indexer_.batch() : -1;
  }

  // The buffers the layer owns, for offload engines (docs/policies/offload.md).
  template <class F>
  void for_each_buffer(F&& f) {
    this->attn_.for_each_buffer(f);
    indexer_.for_each_buffer(f);
  }

  // Saved state (docs/state.md): both parts.
  template <class Ar>
  void transfer(Ar& ar) {
    this->attn_.transfer(ar);
    indexer_.transfer(ar);
    ar.check(!this->attn_.is_initialized() || !indexer_.initialized() || indexer_.batch() == this->attn_.shape().batch,
             "the indexer keys' batch size differs from the keys'");
  }

 protected:
  indexed_state(A attn, I indexer) : with_attention_part<A>(std::move(attn)), indexer_(std::move(indexer)) {}

  // Gives `out` (a state of the same configuration) both parts gathered along the batch axis.
  void gather_into(indexed_state& out, std::span<const std::int64_t> batch_indices) const {
    out.attn_ = this->attn_.gathered(batch_indices);
    out.indexer_ = indexer_.gathered(batch_indices);
  }

  I indexer_;
};

}  // namespace detail

}  // namespace kvc
