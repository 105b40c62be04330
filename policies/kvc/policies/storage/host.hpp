#pragma once
// kvc::HostStorage<T>: K/V tensors in host memory, 64-byte aligned, for T in
// {float, double, Eigen::half, Eigen::bfloat16, float8_e4m3, float8_e5m2}. A storage policy owns allocation, copies and
// element kernels; layer kinds only call the static members below (docs/policies/storage.md).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <new>
#include <type_traits>
#include <utility>

#include <kvc/detail/traits.hpp>
#include <kvc/float8.hpp>
#include <kvc/limits.hpp>
#include <kvc/tensor.hpp>

namespace kvc {
namespace detail {

// An owning, 64-byte aligned array of T. Copies are deep; moves steal.
template <class T>
class host_buffer {
 public:
  static constexpr std::size_t alignment = 64;

  host_buffer() noexcept = default;
  // n elements (n >= 0, at most allocation_limit() bytes: ValueError otherwise, checked before
  // allocating); MemoryError when the system refuses them.
  explicit host_buffer(std::int64_t n) {
    const std::int64_t count = checked_elements({n}, sizeof(T));
    if (count > 0) ptr_ = static_cast<T*>(allocate_bytes(count * std::int64_t{sizeof(T)}, alignment));
    size_ = count;
  }
  host_buffer(const host_buffer& other) : host_buffer(other.size_) {
    if (size_ > 0) std::memcpy(ptr_, other.ptr_, sizeof(T) * static_cast<std::size_t>(size_));
  }
  host_buffer(host_buffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  // Copy and swap: a copy that throws leaves *this as it was. (Not one by-value operator= marked
  // noexcept: clang counts the parameter's copy as part of the noexcept call, so a class holding a
  // buffer got a noexcept copy assignment that terminated on std::bad_alloc.)
  host_buffer& operator=(const host_buffer& other) {
    if (this != &other) {
      host_buffer copy(other);
      swap(copy);
    }
    return *this;
  }
  host_buffer& operator=(host_buffer&& other) noexcept {
    host_buffer moved(std::move(other));
    swap(moved);
    return *this;
  }
  ~host_buffer() {
    if (ptr_) ::operator delete(ptr_, std::align_val_t{alignment});
  }
  void swap(host_buffer& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(size_, other.size_);
  }

  T* data() noexcept { return ptr_; }
  const T* data() const noexcept { return ptr_; }
  std::int64_t size() const noexcept { return size_; }

 private:
  T* ptr_ = nullptr;
  std::int64_t size_ = 0;
};

}  // namespace detail

// The storage policy for host memory: 64-byte aligned buffers of T, memcpy and memset kernels,
// and TensorView views (kvc::concepts::StoragePolicy, docs/policies/storage.md).
template <class T>
struct HostStorage {
  // The element type T.
  using element_type = T;
  // Host memory.
  static constexpr memory_space space = memory_space::host;
  // Checked by kvc::Cache with a readable message instead of here, so that naming
  // HostStorage<int> in a concept check stays SFINAE-friendly.
  // The 8-bit floats hold fp8 KV (<kvc/fp8_attention.hpp>): layers copy them as they are.
  // The row codes of <kvc/row_codes.hpp> are stored too, by paged pools (kvc::PagedCache) only:
  // they are not supported here, so that kvc::Cache refuses them.
  static constexpr bool element_supported =
      detail::is_any_of<T, float, double, Eigen::half, Eigen::bfloat16, float8_e4m3, float8_e5m2>;

  // The owning buffer: a 64-byte aligned array of T (copies are deep).
  using buffer_type = detail::host_buffer<T>;
  // The view `update` takes and returns: a `TensorView<T>`.
  using view_type = TensorView<T>;

  // `height` rows of `width` elements: row i goes from src + i*spitch to dst + i*dpitch
  // (cudaMemcpy2D's contract; the source and destination rows must not overlap).
  static void copy_2d(T* dst, std::int64_t dpitch, const T* src, std::int64_t spitch, std::int64_t width,
                      std::int64_t height) noexcept {
    if (width <= 0) return;
    const auto bytes = sizeof(T) * static_cast<std::size_t>(width);
    if (dpitch == width && spitch == width) {
      std::memcpy(dst, src, bytes * static_cast<std::size_t>(height));
      return;
    }
    for (std::int64_t i = 0; i < height; ++i) std::memcpy(dst + i * dpitch, src + i * spitch, bytes);
  }

  // Sets `height` rows of `width` elements (row pitch `dpitch`) to zero.
  static void zero_2d(T* dst, std::int64_t dpitch, std::int64_t width, std::int64_t height) noexcept {
    if (width <= 0) return;
    for (std::int64_t i = 0; i < height; ++i)
      std::memset(static_cast<void*>(dst + i * dpitch), 0, sizeof(T) * static_cast<std::size_t>(width));
  }

  // Paged writes: for every job and token t, its `heads` rows of `width` elements go to
  // job.dst + rows[job.first_row + t] * width + h * dst_head_pitch (one destination row per token,
  // [heads, rows, width] pools). Rows of one job repeat only where a paged cache sends tokens to
  // its write-trash row, which nothing reads; on a device those writes race harmlessly.
  static void scatter_rows(std::span<const detail::scatter_job<T>> jobs, std::span<const std::int64_t> rows,
                           std::int64_t heads, std::int64_t width, std::int64_t dst_head_pitch) noexcept {
    const auto bytes = sizeof(T) * static_cast<std::size_t>(width);
    for (const auto& job : jobs)
      for (std::int64_t t = 0; t < job.tokens; ++t) {
        T* dst = job.dst + rows[static_cast<std::size_t>(job.first_row + t)] * width;
        for (std::int64_t h = 0; h < heads; ++h)
          std::memcpy(dst + h * dst_head_pitch, job.src + t * job.src_token + h * job.src_head, bytes);
      }
  }

  // A view of data already in this storage's memory space.
  static view_type make_view(const T* ptr, std::array<std::int64_t, 4> extents,
                             std::array<std::int64_t, 4> strides) noexcept {
    return {ptr, extents, strides};
  }

  // What update() accepts: a kvc::tensor_input of T on the host (HostTensor<T>, an
  // Eigen::TensorMap of one, or a TensorView<T>), and its view.
  template <class X>
  static constexpr bool accepts_input = detail::input_of<X, T, memory_space::host>;

  // Returns the view of an accepted input x (kvc::input_view); copies nothing.
  template <class X>
  static view_type input_view(const X& x) {
    return kvc::input_view(x);
  }

  // Linear-attention states and indexer keys: dense tensors of rank 1..4 (detail::state_input).
  using state_view_type = StateView<T>;
  // Whether X is a linear-attention state or indexer keys of T on the host: an Eigen::Tensor of
  // rank 1..4 (row-major), a TensorMap of one, or a `StateView<T>`.
  template <class X>
  static constexpr bool accepts_state_input = [] {
    using traits = detail::state_input<std::remove_cvref_t<X>>;
    if constexpr (traits::valid)
      return std::is_same_v<typename traits::element_type, T> && traits::space == memory_space::host;
    else
      return false;
  }();
  // Returns the `StateView<T>` of an accepted state input x; copies nothing.
  template <class X>
  static state_view_type state_input_view(const X& x) {
    return detail::state_input<std::remove_cvref_t<X>>::view(x);
  }
  // Returns a state view of rank `rank` (0..4) and `extents` over data already in host memory.
  static state_view_type make_state_view(const T* ptr, int rank, std::array<std::int64_t, 4> extents) noexcept {
    return {ptr, rank, extents};
  }
};

}  // namespace kvc
