#pragma once
// The views at kvc's boundary (Eigen/Core only): the views a cache returns and
// takes (non-owning, trivially copyable windows into a layer's storage: `TensorView<T>` and
// `StateView<T>` on the host, `DeviceTensorView<T>` and `DeviceStateView<T>` on a CUDA device, all
// aliases of `basic_tensor_view` / `basic_state_view`) and `KV<View>` (the pair that
// `Cache::update` returns). Tensor shapes are always [batch, heads, seq, head_dim]. The owning
// `HostTensor<T>` (an Eigen::Tensor) and the views' `to_tensor()` copies need the Eigen Tensor
// module: include <kvc/tensor.hpp> for them.

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>

#include <Eigen/Core>

#include <kvc/detail/host_device.hpp>

// Eigen::Tensor, declared as the Eigen Tensor module declares it (which adds the default
// arguments): the views name it as their copies' type without compiling the module.
namespace Eigen {
template <typename Scalar, int NumIndices, int Options, typename IndexType>
class Tensor;
}  // namespace Eigen

namespace kvc {

enum class memory_space { host, device };

// What callers own: a dense row-major [batch, heads, seq, head_dim] tensor (complete with
// <kvc/tensor.hpp>).
template <class T>
using HostTensor = Eigen::Tensor<T, 4, Eigen::RowMajor, Eigen::DenseIndex>;

// A tensor view of rank 4 and a dense state view, each one class template over the memory space
// its pointer lives in. The host and device names are aliases of them:
//   TensorView<T>       = basic_tensor_view<T, memory_space::host>
//   DeviceTensorView<T> = basic_tensor_view<T, memory_space::device>
//   StateView<T>        = basic_state_view<T, memory_space::host>
//   DeviceStateView<T>  = basic_state_view<T, memory_space::device>
// A host view and a device view of the same T are distinct types (Space differs), so overloads and
// partial specializations written for one never catch the other. Both are plain aggregates
// ({ptr, extents, strides} and {ptr, rank, extents}), trivially copyable, and can be passed by value
// to a CUDA kernel. Their shape accessors run on host and device; reading elements is where the
// spaces differ: a host view reads them from host code (and offers Eigen maps and owning copies), a
// device view only from device code, where it is compiled with nvcc (<kvc/cuda.hpp> adds its
// owning tensor and the copies between the spaces).

namespace detail {
// What basic_tensor_view::head(b, h) returns: a zero-copy Eigen map on the host, the first element
// of the block on the device.
template <class T, memory_space Space>
struct view_head_block {
  using type = const T*;
};
template <class T>
struct view_head_block<T, memory_space::host> {
  using type = Eigen::Map<const Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>, Eigen::Unaligned,
                          Eigen::OuterStride<>>;
};
}  // namespace detail

// A strided, read-only window of rank 4, [batch, heads, seq, head_dim]. The last dimension is
// always contiguous (stride 1) and each (batch, head) block's rows follow each other
// (stride(2) == extent(3)), so `head(b, h)` is one dense [seq, head_dim] matrix.
template <class T, memory_space Space>
struct basic_tensor_view {
  using element_type = T;
  static constexpr memory_space space = Space;
  // What head(b, h) returns: an Eigen::Map of the [seq, head_dim] block (host), or a pointer to its
  // first element (device).
  using head_matrix = typename detail::view_head_block<T, Space>::type;

  const T* ptr = nullptr;
  std::array<std::int64_t, 4> extents{};
  std::array<std::int64_t, 4> strides{};

  KVC_HOST_DEVICE constexpr const T* data() const noexcept { return ptr; }
  KVC_HOST_DEVICE constexpr std::int64_t extent(int r) const noexcept { return extents[static_cast<std::size_t>(r)]; }
  KVC_HOST_DEVICE constexpr std::int64_t stride(int r) const noexcept { return strides[static_cast<std::size_t>(r)]; }
  KVC_HOST_DEVICE constexpr std::int64_t size() const noexcept {
    return extents[0] * extents[1] * extents[2] * extents[3];
  }
  KVC_HOST_DEVICE constexpr bool empty() const noexcept { return size() == 0; }

  // ---- host views: elements are read in place, Eigen maps and owning copies ----------------------
  KVC_HOST_DEVICE constexpr const T& operator()(std::int64_t b, std::int64_t h, std::int64_t s,
                                                std::int64_t d) const noexcept
    requires(Space == memory_space::host)
  {
    return ptr[b * strides[0] + h * strides[1] + s * strides[2] + d];
  }

  // The [seq, head_dim] block of one (batch, head) pair, as a zero-copy Eigen map.
  head_matrix head(std::int64_t b, std::int64_t h) const
    requires(Space == memory_space::host)
  {
    return head_matrix(ptr + b * strides[0] + h * strides[1], extents[2], extents[3], Eigen::OuterStride<>(strides[2]));
  }

  // An owning copy.
  HostTensor<std::remove_const_t<T>> to_tensor() const
    requires(Space == memory_space::host)
  {
    HostTensor<std::remove_const_t<T>> out(extents[0], extents[1], extents[2], extents[3]);
    for (std::int64_t b = 0; b < extents[0]; ++b)
      for (std::int64_t h = 0; h < extents[1]; ++h)
        for (std::int64_t s = 0; s < extents[2]; ++s)
          for (std::int64_t d = 0; d < extents[3]; ++d) out(b, h, s, d) = (*this)(b, h, s, d);
    return out;
  }

  // ---- device views: elements are read by device code only (nvcc) --------------------------------
#if defined(__CUDACC__)
  __device__ const T& operator()(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d) const noexcept
    requires(Space == memory_space::device)
  {
    return ptr[b * strides[0] + h * strides[1] + s * strides[2] + d];
  }
  // The first element of the dense [seq, head_dim] block of one (batch, head) pair.
  __device__ const T* head(std::int64_t b, std::int64_t h) const noexcept
    requires(Space == memory_space::device)
  {
    return ptr + b * strides[0] + h * strides[1];
  }
#endif
};

// A dense, row-major, read-only window of rank 1 to 4 with no strides: the states of
// linear-attention layers (conv states [batch, channels, time], recurrent states of any shape)
// and the indexer keys of indexed layers ([batch, seq, index_head_dim]).
template <class T, memory_space Space>
struct basic_state_view {
  using element_type = T;
  static constexpr memory_space space = Space;

  const T* ptr = nullptr;
  int rank = 0;
  std::array<std::int64_t, 4> extents{};

  KVC_HOST_DEVICE constexpr const T* data() const noexcept { return ptr; }
  KVC_HOST_DEVICE constexpr std::int64_t extent(int r) const noexcept { return extents[static_cast<std::size_t>(r)]; }
  KVC_HOST_DEVICE constexpr std::int64_t size() const noexcept {
    std::int64_t n = rank > 0 ? 1 : 0;
    for (int r = 0; r < rank; ++r) n *= extents[static_cast<std::size_t>(r)];
    return n;
  }
  KVC_HOST_DEVICE constexpr bool empty() const noexcept { return size() == 0; }

  // ---- host views ---------------------------------------------------------------------------------
  // Element i of the flattened (row-major) tensor.
  KVC_HOST_DEVICE constexpr const T& operator[](std::int64_t i) const noexcept
    requires(Space == memory_space::host)
  {
    return ptr[i];
  }

  // An owning copy as an Eigen tensor of rank N == rank.
  template <int N>
  Eigen::Tensor<std::remove_const_t<T>, N, Eigen::RowMajor, Eigen::DenseIndex> to_tensor() const
    requires(Space == memory_space::host)
  {
    static_assert(N >= 1 && N <= 4, "kvc::StateView::to_tensor: rank must be 1 to 4");
    std::array<Eigen::DenseIndex, static_cast<std::size_t>(N)> dims;
    for (std::size_t r = 0; r < static_cast<std::size_t>(N); ++r) dims[r] = static_cast<int>(r) < rank ? extents[r] : 1;
    if (empty()) dims[0] = 0;  // an unset state: no element to read
    Eigen::Tensor<std::remove_const_t<T>, N, Eigen::RowMajor, Eigen::DenseIndex> out;
    out.resize(dims);
    for (std::int64_t i = 0; i < out.size(); ++i) out.data()[i] = ptr[i];
    return out;
  }

  // ---- device views: element i of the flattened tensor, from device code only (nvcc) -------------
#if defined(__CUDACC__)
  __device__ const T& operator[](std::int64_t i) const noexcept
    requires(Space == memory_space::device)
  {
    return ptr[i];
  }
#endif
};

// The host views: what HostStorage's caches return and take.
template <class T>
using TensorView = basic_tensor_view<T, memory_space::host>;
template <class T>
using StateView = basic_state_view<T, memory_space::host>;
// The device views: what CudaStorage's caches return and take (<kvc/policies/storage/cuda.cuh>).
template <class T>
using DeviceTensorView = basic_tensor_view<T, memory_space::device>;
template <class T>
using DeviceStateView = basic_state_view<T, memory_space::device>;

// The shape of a state view of either space, printed the way torch prints a shape.
template <class T, memory_space Space>
std::string shape_string(const basic_state_view<T, Space>& v) {
  std::string out;
  out.reserve(32);
  out.push_back('[');
  for (int i = 0; i < v.rank; ++i) {
    if (i) out.append(", ");
    out.append(std::to_string(v.extents[static_cast<std::size_t>(i)]));
  }
  out.push_back(']');
  return out;
}

// What a layer holds besides its length: fixed by the first update or by early_initialization.
// K and V may have different head dims (MLA-style attention).
struct LayerShape {
  std::int64_t batch = 0;
  std::int64_t heads = 0;
  std::int64_t key_head_dim = 0;
  std::int64_t value_head_dim = 0;
  friend constexpr bool operator==(const LayerShape&, const LayerShape&) = default;
};

// What `Cache::update` returns. `auto [k, v] = cache.update(...)` works.
template <class View>
struct KV {
  View keys;
  View values;
};

// The shape of a [batch, heads, seq, head_dim] tensor, printed the way torch prints a shape.
inline std::string shape_string(const std::array<std::int64_t, 4>& e) {
  // Appended piece by piece: a chain of operator+ trips GCC 12's -Wrestrict false positive at -O3.
  std::string out;
  out.reserve(48);
  out.push_back('[');
  for (std::size_t i = 0; i < e.size(); ++i) {
    if (i) out.append(", ");
    out.append(std::to_string(e[i]));
  }
  out.push_back(']');
  return out;
}

}  // namespace kvc
