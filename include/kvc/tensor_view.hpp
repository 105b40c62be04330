#pragma once
// The views at kvc's boundary (Eigen/Core only): the views a cache returns and
// takes (non-owning, trivially copyable windows into a layer's storage: `TensorView<T>` and
// `StateView<T>` on the host, `DeviceTensorView<T>` and `DeviceStateView<T>` on a CUDA device, all
// aliases of `basic_tensor_view` / `basic_state_view`) and `KV<View>` (the pair that
// `Cache::update` returns), and kvc::tensor_input: what every function that takes queries, keys or
// values accepts, with kvc::input_view. Tensor shapes are always [batch, heads, seq, head_dim]. The owning
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

// Where a view's memory lives: host memory, or a CUDA device's.
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
  // The element type (the view reads const T).
  using element_type = T;
  // The memory space the pointer lives in.
  static constexpr memory_space space = Space;
  // What head(b, h) returns: an Eigen::Map of the [seq, head_dim] block (host), or a pointer to its
  // first element (device).
  using head_matrix = typename detail::view_head_block<T, Space>::type;

  // The pointer to element (0, 0, 0, 0) (nullptr by default).
  const T* ptr = nullptr;
  // The sizes of [batch, heads, seq, head_dim].
  std::array<std::int64_t, 4> extents{};
  // The element strides of the four dimensions (strides[3] is always 1).
  std::array<std::int64_t, 4> strides{};

  // The pointer to element (0, 0, 0, 0).
  KVC_HOST_DEVICE constexpr const T* data() const noexcept { return ptr; }
  // The size of dimension `r` (0 to 3); not checked.
  KVC_HOST_DEVICE constexpr std::int64_t extent(int r) const noexcept { return extents[static_cast<std::size_t>(r)]; }
  // The stride, in elements, of dimension `r` (0 to 3); not checked.
  KVC_HOST_DEVICE constexpr std::int64_t stride(int r) const noexcept { return strides[static_cast<std::size_t>(r)]; }
  // The number of elements, the product of the four extents.
  KVC_HOST_DEVICE constexpr std::int64_t size() const noexcept {
    return extents[0] * extents[1] * extents[2] * extents[3];
  }
  // Whether the view has no element (some extent is 0).
  KVC_HOST_DEVICE constexpr bool empty() const noexcept { return size() == 0; }

  // ---- host views: elements are read in place, Eigen maps and owning copies ----------------------
  // Element (b, h, s, d), read in place; the indices are not checked.
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
  // Element (b, h, s, d), read from device code; the indices are not checked.
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
  // The element type (the view reads const T).
  using element_type = T;
  // The memory space the pointer lives in.
  static constexpr memory_space space = Space;

  // The pointer to the first element of the dense row-major data (nullptr by default).
  const T* ptr = nullptr;
  // The number of dimensions in use, 0 to 4 (0: an unset state).
  int rank = 0;
  // The sizes of the first `rank` dimensions; the rest are unused.
  std::array<std::int64_t, 4> extents{};

  // The pointer to the first element.
  KVC_HOST_DEVICE constexpr const T* data() const noexcept { return ptr; }
  // The size of dimension `r` (below rank); not checked.
  KVC_HOST_DEVICE constexpr std::int64_t extent(int r) const noexcept { return extents[static_cast<std::size_t>(r)]; }
  // The number of elements: the product of the first `rank` extents, 0 when rank is 0.
  KVC_HOST_DEVICE constexpr std::int64_t size() const noexcept {
    std::int64_t n = rank > 0 ? 1 : 0;
    for (int r = 0; r < rank; ++r) n *= extents[static_cast<std::size_t>(r)];
    return n;
  }
  // Whether the view has no element (rank 0 or some extent 0).
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
  // Element i of the flattened (row-major) tensor, read from device code; i is not checked.
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
// The host state view (linear-attention states, indexer keys).
template <class T>
using StateView = basic_state_view<T, memory_space::host>;
// The device views: what CudaStorage's caches return and take (<kvc/policies/storage/cuda.cuh>).
template <class T>
using DeviceTensorView = basic_tensor_view<T, memory_space::device>;
// The device state view (linear-attention states, indexer keys).
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
  // The batch size.
  std::int64_t batch = 0;
  // The number of key/value heads.
  std::int64_t heads = 0;
  // The head dimension of the keys.
  std::int64_t key_head_dim = 0;
  // The head dimension of the values (may differ from the keys').
  std::int64_t value_head_dim = 0;
  // Whether two shapes are equal in every field.
  friend constexpr bool operator==(const LayerShape&, const LayerShape&) = default;
};

// What `Cache::update` returns. `auto [k, v] = cache.update(...)` works.
template <class View>
struct KV {
  // The keys, [batch, heads, seq, key_head_dim].
  View keys;
  // The values, [batch, heads, seq, value_head_dim].
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

// ---- what kvc's functions take as queries, keys and values ----------------------------------------

namespace detail {

// Turns what a caller may pass as queries, keys or values into a view. Specialised here for the
// views, in <kvc/tensor.hpp> for HostTensor and Eigen::TensorMaps of one, and in <kvc/cuda.hpp> for
// DeviceTensor; `valid` is false for everything else.
template <class X>
struct tensor_input {
  static constexpr bool valid = false;
};

// A view of either space (DeviceTensor<T>, the device's owning tensor, is added by <kvc/cuda.hpp>).
template <class T, memory_space Space>
struct tensor_input<basic_tensor_view<T, Space>> {
  static constexpr bool valid = true;
  static constexpr bool is_view = true;  // (does not own its memory)
  static constexpr memory_space space = Space;
  using element_type = std::remove_const_t<T>;
  static basic_tensor_view<element_type, Space> view(const basic_tensor_view<T, Space>& t) {
    return {t.ptr, t.extents, t.strides};
  }
};

}  // namespace detail

// kvc::tensor_input: every kvc function that takes queries, keys or values takes any of these, the
// same way: on the host a HostTensor<T>, an Eigen::TensorMap of one (row-major, rank 4) or a
// TensorView<T>; on a CUDA device (<kvc/cuda.hpp>) a DeviceTensor<T> of rank 4 or a
// DeviceTensorView<T>. Other memory is passed as a view over it: TensorView<T>{data, extents,
// strides} (each [seq, head_dim] block contiguous: stride(3) == 1, stride(2) == extent(3)).
template <class X>
concept tensor_input = detail::tensor_input<std::remove_cvref_t<X>>::valid;

// The element type and the memory space of a tensor_input.
template <tensor_input X>
using input_element_t = typename detail::tensor_input<std::remove_cvref_t<X>>::element_type;
// The memory space a tensor_input's data lives in.
template <tensor_input X>
inline constexpr memory_space input_space_v = detail::tensor_input<std::remove_cvref_t<X>>::space;

// The view of a tensor_input: a TensorView<T> on the host, a DeviceTensorView<T> on a device. It
// copies nothing and is valid while `x`'s memory is.
template <tensor_input X>
auto input_view(const X& x) {
  return detail::tensor_input<std::remove_cvref_t<X>>::view(x);
}
// Not of a temporary tensor that owns its memory (a HostTensor, a DeviceTensor): the view would
// outlive it. (Views and maps of memory held elsewhere may be temporaries.)
template <tensor_input X>
  requires(!std::is_lvalue_reference_v<X> && !detail::tensor_input<std::remove_cvref_t<X>>::is_view)
void input_view(X&& x) = delete;

namespace detail {

// X is a tensor_input in Space (of any element type).
template <class X, memory_space Space>
inline constexpr bool input_in = [] {
  if constexpr (tensor_input<std::remove_cvref_t<X>>::valid)
    return input_space_v<X> == Space;
  else
    return false;
}();

// The element type of X if X is a tensor_input, else `Otherwise` (the return types of a call that
// check_inputs refuses).
template <class X, class Otherwise>
struct input_element_or {
  using type = Otherwise;
};
template <class X, class Otherwise>
  requires kvc::tensor_input<X>
struct input_element_or<X, Otherwise> {
  using type = input_element_t<X>;
};
template <class X, class Otherwise = float>
using input_element_or_t = typename input_element_or<X, Otherwise>::type;

// X is a tensor_input of T in Space.
template <class X, class T, memory_space Space>
inline constexpr bool input_of = input_in<X, Space> && std::is_same_v<input_element_or_t<X, void>, T>;

// The one diagnostic of every function that takes queries, keys or values: true when the inputs
// X... are accepted (Ok), else a failed static_assert (one error, whose context names the call and
// the inputs' types; one per set of input types, so that each misuse of a file is reported).
// Callers branch on it with `if constexpr`, so that nothing else fails after it.
template <bool Ok, class... X>
constexpr bool require_inputs() {
  static_assert(Ok,
                "kvc: queries, keys and values must be kvc::tensor_input of the element type and memory space "
                "the call expects: kvc::HostTensor<T>, an Eigen::TensorMap of one or kvc::TensorView<T> on the "
                "host (other memory: kvc::TensorView<T>{data, extents, strides} over contiguous [seq, head_dim] "
                "blocks; kvc::input_view(x) is the view of any input), kvc::DeviceTensor<T> or "
                "kvc::DeviceTensorView<T> on a CUDA device (kvc::to_device copies a HostTensor there)");
  return Ok;
}

// require_inputs for inputs X... that must each be a tensor_input of T in Space.
template <class T, memory_space Space, class... X>
constexpr bool check_inputs() {
  return require_inputs<(input_of<X, T, Space> && ...), T, X...>();
}

}  // namespace detail
}  // namespace kvc
