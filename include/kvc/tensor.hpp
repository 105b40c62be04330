#pragma once
// Tensors at kvc's boundary: the views (<kvc/tensor_view.hpp>), the owning `HostTensor<T>` (an
// Eigen::Tensor, complete here with the Eigen Tensor module), and HostTensor and Eigen::TensorMap
// as kvc::tensor_input (<kvc/tensor_view.hpp>) and as linear-attention states (detail::state_input).

#include <array>
#include <cstdint>
#include <type_traits>

#include <unsupported/Eigen/CXX11/Tensor>

#include <kvc/tensor_view.hpp>

namespace kvc {

namespace detail {

// HostTensor<T> and Eigen::TensorMaps of one are kvc::tensor_input (<kvc/tensor_view.hpp>).
template <class T>
struct tensor_input<Eigen::Tensor<T, 4, Eigen::RowMajor>> {
  static constexpr bool valid = true;
  static constexpr bool is_view = false;  // (owns its memory)
  static constexpr memory_space space = memory_space::host;
  using element_type = T;
  static TensorView<T> view(const Eigen::Tensor<T, 4, Eigen::RowMajor>& t) {
    const std::array<std::int64_t, 4> e{t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)};
    return {t.data(), e, {e[1] * e[2] * e[3], e[2] * e[3], e[3], 1}};
  }
};

template <class T, int Options, template <class> class MakePointer>
struct tensor_input<Eigen::TensorMap<Eigen::Tensor<T, 4, Eigen::RowMajor>, Options, MakePointer>> {
  static constexpr bool valid = true;
  static constexpr bool is_view = true;
  static constexpr memory_space space = memory_space::host;
  using element_type = std::remove_const_t<T>;
  template <class M>
  static TensorView<element_type> view(const M& t) {
    const std::array<std::int64_t, 4> e{t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)};
    return {t.data(), e, {e[1] * e[2] * e[3], e[2] * e[3], e[3], 1}};
  }
};

template <class T, int Options, template <class> class MakePointer>
struct tensor_input<Eigen::TensorMap<const Eigen::Tensor<T, 4, Eigen::RowMajor>, Options, MakePointer>>
    : tensor_input<Eigen::TensorMap<Eigen::Tensor<T, 4, Eigen::RowMajor>, Options, MakePointer>> {};

// Turns what a caller may pass as a linear-attention state or as indexer keys into a StateView:
// an Eigen::Tensor<T, N, RowMajor> (N = 1..4), a TensorMap of one, or a StateView.
template <class X>
struct state_input {
  static constexpr bool valid = false;
};

template <class T, int N>
  requires(N >= 1 && N <= 4)
struct state_input<Eigen::Tensor<T, N, Eigen::RowMajor>> {
  static constexpr bool valid = true;
  static constexpr memory_space space = memory_space::host;
  using element_type = T;
  template <class M>
  static StateView<element_type> view(const M& t) {
    StateView<element_type> out{t.data(), N, {}};
    for (std::size_t r = 0; r < static_cast<std::size_t>(N); ++r)
      out.extents[r] = static_cast<std::int64_t>(t.dimensions()[r]);
    return out;
  }
};

template <class T, int N, int Options, template <class> class MakePointer>
  requires(N >= 1 && N <= 4)
struct state_input<Eigen::TensorMap<Eigen::Tensor<T, N, Eigen::RowMajor>, Options, MakePointer>>
    : state_input<Eigen::Tensor<std::remove_const_t<T>, N, Eigen::RowMajor>> {};

template <class T, int N, int Options, template <class> class MakePointer>
  requires(N >= 1 && N <= 4)
struct state_input<Eigen::TensorMap<const Eigen::Tensor<T, N, Eigen::RowMajor>, Options, MakePointer>>
    : state_input<Eigen::Tensor<std::remove_const_t<T>, N, Eigen::RowMajor>> {};

template <class T>
struct state_input<StateView<T>> {
  static constexpr bool valid = true;
  static constexpr memory_space space = memory_space::host;
  using element_type = std::remove_const_t<T>;
  static StateView<element_type> view(const StateView<T>& t) { return {t.ptr, t.rank, t.extents}; }
};

}  // namespace detail
}  // namespace kvc
