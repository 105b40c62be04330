#pragma once
// kvc::concepts::StoragePolicy: where and in what element type K/V tensors live.
//
// Required of a storage policy S (docs/concepts/storage_policy.md):
//   typename S::element_type                      the element type T
//   S::space                                      a kvc::memory_space (host or device)
//   S::element_supported                          bool: whether T is one the storage can hold
//   typename S::buffer_type                       owning array: buffer_type(n), data(), size()
//   typename S::view_type                         the non-owning view `update` returns
//   S::copy_2d(dst, dpitch, src, spitch, w, h)    strided block copy (cudaMemcpy2D contract)
//   S::zero_2d(dst, dpitch, w, h)                 strided block fill with zeros
//   S::make_view(ptr, extents, strides)           a view_type over the storage's memory
//   S::accepts_input<X>                           bool: whether `update` takes an X
//   S::input_view(x)                              the view_type of an accepted input x
// and of a paged storage policy (kvc::PagedCache's) also
//   S::scatter_rows(jobs, rows, heads, width, pitch)  the paged write: each job's token rows to
//                                                     their pool rows (detail::scatter_job)

#include <array>
#include <concepts>
#include <cstdint>
#include <span>

#include <kvc/detail/traits.hpp>
#include <kvc/tensor_view.hpp>

namespace kvc::concepts {

// S names its element type, `S::element_type`.
template <class S>
concept has_element_type = requires { typename S::element_type; };

// S::space converts to kvc::memory_space.
template <class S>
concept has_memory_space = requires {
  { S::space } -> std::convertible_to<memory_space>;
};

// S::element_supported converts to bool.
template <class S>
concept has_element_support_flag = requires {
  { S::element_supported } -> std::convertible_to<bool>;
};

// `S::buffer_type` is constructible from an element count and has data(), a pointer to the
// element type, and size().
template <class S>
concept has_buffer_type = has_element_type<S> && requires(typename S::buffer_type b, const typename S::buffer_type cb) {
  typename S::buffer_type;
  requires std::constructible_from<typename S::buffer_type, std::int64_t>;
  { b.data() } -> std::same_as<typename S::element_type*>;
  { cb.size() } -> std::convertible_to<std::int64_t>;
};

// S names its view type, `S::view_type`.
template <class S>
concept has_view_type = requires { typename S::view_type; };

// S has the kernels copy_2d(dst, dpitch, src, spitch, width, height) and
// zero_2d(dst, dpitch, width, height).
template <class S>
concept has_copy_kernels = has_element_type<S> && requires(typename S::element_type* dst,
                                                           const typename S::element_type* src, std::int64_t n) {
  S::copy_2d(dst, n, src, n, n, n);
  S::zero_2d(dst, n, n, n);
};

// S::make_view(ptr, extents, strides) returns an `S::view_type`.
template <class S>
concept has_make_view = has_element_type<S> && has_view_type<S> &&
                        requires(const typename S::element_type* p, std::array<std::int64_t, 4> a) {
                          { S::make_view(p, a, a) } -> std::same_as<typename S::view_type>;
                        };

// A plain (non-template) `accepts_input` is ruled out first (see has_plain_serves in offload_policy.hpp).
template <class S>
concept has_plain_accepts_input = requires { &S::accepts_input; };

// `S::template accepts_input<X>` converts to bool and S::input_view(x) returns an
// `S::view_type` (checked with X = `S::view_type`).
template <class S>
concept has_input_adapter =
    has_view_type<S> && !has_plain_accepts_input<S> && requires(const typename S::view_type& v) {
      { S::template accepts_input<typename S::view_type> } -> std::convertible_to<bool>;
      { S::input_view(v) } -> std::same_as<typename S::view_type>;
    };

// S is a storage policy: it meets every requirement listed at the top of this header.
template <class S>
concept StoragePolicy =
    has_element_type<S> && has_memory_space<S> && has_element_support_flag<S> && has_buffer_type<S> &&
    has_view_type<S> && has_copy_kernels<S> && has_make_view<S> && has_input_adapter<S>;

// The paged write `kvc::PagedCache` makes: `S::scatter_rows(jobs, rows, heads, width, dst_head_pitch)`.
template <class S>
concept has_scatter_rows =
    has_element_type<S> &&
    requires(std::span<const detail::scatter_job<typename S::element_type>> jobs, std::span<const std::int64_t> rows,
             std::int64_t n) { S::scatter_rows(jobs, rows, n, n, n); };

// What `kvc::PagedCache<S>` requires: a storage policy with the paged write.
template <class S>
concept PagedStoragePolicy = StoragePolicy<S> && has_scatter_rows<S>;

// True when S is a storage policy whose element type it supports.
template <class S>
concept supports_its_element_type = StoragePolicy<S> && static_cast<bool>(S::element_supported);

}  // namespace kvc::concepts
