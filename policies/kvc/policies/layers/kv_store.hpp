#pragma once
// detail::kv_store<S>: the K and V buffers of one layer, laid out [batch, heads, capacity, head_dim]
// so that every (batch, head) block is one contiguous [capacity, head_dim] matrix
// (docs/kv_layout.md). Layer kinds keep a region [from, from + len) of the capacity axis; the
// store copies blocks only through the storage policy's kernels. QuantizedLayer's dequantized
// workspace is a kv_store too, whose blocks the codecs also write directly (key_blocks(),
// value_blocks()).

#include <algorithm>
#include <cstdint>
#include <span>
#include <utility>

#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/tensor.hpp>

namespace kvc::detail {

template <class S>
class kv_store {
 public:
  using T = typename S::element_type;
  using buffer = typename S::buffer_type;
  using view = typename S::view_type;

  kv_store() = default;
  kv_store(LayerShape shape, std::int64_t capacity, bool zeroed)
      : shape_(shape),
        cap_(capacity),
        k_(checked_elements({shape.batch, shape.heads, capacity, shape.key_head_dim}, sizeof(T))),
        v_(checked_elements({shape.batch, shape.heads, capacity, shape.value_head_dim}, sizeof(T))) {
    if (zeroed) zero();
  }
  // Copies are deep; a copy assignment that throws leaves *this as it was (copy and swap: member by
  // member, a failed copy of V would leave the new K, or a failed K the new capacity).
  kv_store(const kv_store&) = default;
  kv_store(kv_store&&) noexcept = default;
  kv_store& operator=(const kv_store& other) {
    if (this != &other) {
      kv_store copy(other);
      *this = std::move(copy);
    }
    return *this;
  }
  kv_store& operator=(kv_store&&) noexcept = default;

  const LayerShape& shape() const noexcept { return shape_; }
  std::int64_t capacity() const noexcept { return cap_; }
  std::int64_t bytes() const noexcept {
    return static_cast<std::int64_t>(sizeof(T)) * (std::int64_t{k_.size()} + std::int64_t{v_.size()});
  }

  view keys(std::int64_t from, std::int64_t len) const noexcept { return region(k_, shape_.key_head_dim, from, len); }
  view values(std::int64_t from, std::int64_t len) const noexcept {
    return region(v_, shape_.value_head_dim, from, len);
  }
  KV<view> kv(std::int64_t from, std::int64_t len) const noexcept { return {keys(from, len), values(from, len)}; }

  // K's or V's elements, writable, for code that fills the blocks itself (a codec's decode): the
  // block of (batch b, head h) starts at data + b * stride_b + h * stride_h, and slot t of it
  // head_dim * t further.
  struct blocks {
    T* data;
    std::int64_t stride_b;
    std::int64_t stride_h;
  };
  blocks key_blocks() noexcept { return blocks_of(k_, shape_.key_head_dim); }
  blocks value_blocks() noexcept { return blocks_of(v_, shape_.value_head_dim); }

  // Calls f(buffer&) for the K and then the V buffer (offload engines move them between tiers).
  template <class F>
  void for_each_buffer(F&& f) {
    f(k_);
    f(v_);
  }

  // Copies the q = k.extent(2) tokens of k and v to slots [pos, pos + q) of every block.
  // Precondition: the caller checked the shapes, and pos + q <= capacity.
  void write(std::int64_t pos, const view& k, const view& v) {
    write_one(k_.data(), shape_.key_head_dim, pos, k);
    write_one(v_.data(), shape_.value_head_dim, pos, v);
  }

  // Moves slots [from, from + len) to [to, to + len) in every block; the ranges must not overlap.
  void move_within(std::int64_t from, std::int64_t len, std::int64_t to) {
    move_one(k_.data(), shape_.key_head_dim, from, len, to);
    move_one(v_.data(), shape_.value_head_dim, from, len, to);
  }

  void zero() {
    S::zero_2d(k_.data(), 0, k_.size(), k_.size() > 0 ? 1 : 0);
    S::zero_2d(v_.data(), 0, v_.size(), v_.size() > 0 ? 1 : 0);
  }

  // A new store of `capacity` slots holding slots [from, from + len) of this one at [0, len).
  kv_store relocated(std::int64_t capacity, std::int64_t from, std::int64_t len) const {
    kv_store out(shape_, capacity, false);
    const std::int64_t rows = shape_.batch * shape_.heads;
    S::copy_2d(out.k_.data(), capacity * shape_.key_head_dim, k_.data() + from * shape_.key_head_dim,
               cap_ * shape_.key_head_dim, len * shape_.key_head_dim, rows);
    S::copy_2d(out.v_.data(), capacity * shape_.value_head_dim, v_.data() + from * shape_.value_head_dim,
               cap_ * shape_.value_head_dim, len * shape_.value_head_dim, rows);
    return out;
  }

  // A new store whose batch entry i is this store's batch entry indices[i] (indices checked by the
  // caller): all of it, or only its slots [0, len) (the other slots of the new store are then
  // uninitialized).
  kv_store gathered(std::span<const std::int64_t> indices) const { return gathered(indices, cap_); }
  kv_store gathered(std::span<const std::int64_t> indices, std::int64_t len) const {
    LayerShape s = shape_;
    s.batch = static_cast<std::int64_t>(indices.size());
    kv_store out(s, cap_, false);
    for (std::size_t i = 0; i < indices.size(); ++i) {
      const auto to = static_cast<std::int64_t>(i);
      gather_one(out.k_.data(), k_.data(), shape_.key_head_dim, to, indices[i], len);
      gather_one(out.v_.data(), v_.data(), shape_.value_head_dim, to, indices[i], len);
    }
    return out;
  }

  // Appends k, v after the region [from, from + len). When the buffer has no room after the region,
  // the region first moves to the front (if that does not overlap it) or into a new buffer of at
  // least `grow_capacity` slots. Returns where the region starts afterwards. Only the allocation
  // can throw, and it happens before anything changes (strong guarantee).
  std::int64_t append_after(std::int64_t from, std::int64_t len, const view& k, const view& v,
                            std::int64_t grow_capacity) {
    const std::int64_t q = k.extent(2);
    if (from + len + q <= cap_) {
      write(from + len, k, v);
      return from;
    }
    if (from >= len && len + q <= cap_) {
      move_within(from, len, 0);
      write(len, k, v);
      return 0;
    }
    kv_store fresh = relocated(std::max(grow_capacity, len + q), from, len);
    fresh.write(len, k, v);  // before the swap: k and v stay readable even if they alias this store
    *this = std::move(fresh);
    return 0;
  }

 private:
  view region(const buffer& b, std::int64_t d, std::int64_t from, std::int64_t len) const noexcept {
    return S::make_view(b.data() ? b.data() + from * d : nullptr, {shape_.batch, shape_.heads, len, d},
                        {shape_.heads * cap_ * d, cap_ * d, d, 1});
  }

  void write_one(T* dst, std::int64_t d, std::int64_t pos, const view& src) {
    const std::int64_t q = src.extent(2);
    if (q == 0) return;
    for (std::int64_t b = 0; b < shape_.batch; ++b)
      S::copy_2d(dst + (b * shape_.heads * cap_ + pos) * d, cap_ * d, src.data() + b * src.stride(0), src.stride(1),
                 q * d, shape_.heads);
  }

  blocks blocks_of(buffer& b, std::int64_t d) noexcept { return {b.data(), shape_.heads * cap_ * d, cap_ * d}; }

  // Slots [0, len) of every head of batch entry `from` of src to batch entry `to` of dst (both
  // stores of this capacity and head count). When len == capacity, the rows are contiguous and the
  // storage copies the entry as one block.
  void gather_one(T* dst, const T* src, std::int64_t d, std::int64_t to, std::int64_t from, std::int64_t len) const {
    if (shape_.heads == 0) return;
    const std::int64_t entry = shape_.heads * cap_ * d;
    S::copy_2d(dst + to * entry, cap_ * d, src + from * entry, cap_ * d, len * d, shape_.heads);
  }

  void move_one(T* p, std::int64_t d, std::int64_t from, std::int64_t len, std::int64_t to) {
    if (len <= 0 || from == to) return;
    S::copy_2d(p + to * d, cap_ * d, p + from * d, cap_ * d, len * d, shape_.batch * shape_.heads);
  }

  LayerShape shape_{};
  std::int64_t cap_ = 0;
  buffer k_;
  buffer v_;
};

// The shape a layer takes from its first update.
template <class View>
LayerShape shape_of(const View& k, const View& v) noexcept {
  return {k.extent(0), k.extent(1), k.extent(3), v.extent(3)};
}

}  // namespace kvc::detail
