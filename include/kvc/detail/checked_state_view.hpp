#pragma once
// detail::checked_state_view<S>(x, who): the view of a linear-attention state (or indexer keys)
// handed to a cache, with its sizes checked: what kvc::Cache and kvc::PagedCache both take.

#include <cstdint>
#include <string>

#include <kvc/concepts/linear_layer.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/tensor_view.hpp>

namespace kvc::detail {

// S's state view of x; fails to compile for an input S does not take as a state, and throws
// kvc::ValueError ("<who>: a state of shape ...") for a negative dimension, one above kvc's limit
// or a product of dimensions that overflows.
template <class S, class X>
typename S::state_view_type checked_state_view(const X& x, const char* who) {
  static_assert(concepts::has_state_views<S>, "kvc::Cache: this StoragePolicy has no linear-attention states");
  static_assert(S::template accepts_state_input<X>,
                "kvc::Cache: linear-attention states and indexer keys must be a dense Eigen::Tensor<T, N, "
                "Eigen::RowMajor> (N = 1..4), a TensorMap of one or a kvc::StateView, with the cache's element type");
  const auto view = S::state_input_view(x);
  std::int64_t n = 1;
  for (int r = 0; r < view.rank; ++r)
    if (view.extent(r) < 0 || view.extent(r) > max_extent || !mul_fits(n, view.extent(r), n))
      throw ValueError(std::string(who) + ": a state of shape " + shape_string(view) +
                       " has a negative dimension, one above kvc's limit of " + std::to_string(max_extent) +
                       ", or a product of dimensions that overflows");
  return view;
}

}  // namespace kvc::detail
