#pragma once
// kvc::to_row_codes and kvc::to_kv_codes on a CUDA device (needs nvcc): a step's keys and values,
// in device memory, encoded as the rows of a paged pool of row codes (<kvc/row_codes.hpp>) by a
// kernel, with each format's own encode (host and device code: the host tests run it), so the
// device's rows are the host's, byte for byte. One thread encodes one (batch, head, token) row,
// widened to float in local memory first (head_dim up to 256). Work is queued on the legacy
// default stream, as the device attention's, and the result is a new DeviceTensor.

#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <cuda_runtime.h>

#include <kvc/detail/attention_rows.hpp>
#include <kvc/detail/cuda_runtime.cuh>
#include <kvc/detail/element_conversion.hpp>
#include <kvc/policies/storage/cuda.cuh>
#include <kvc/row_codes.hpp>

namespace kvc {
namespace detail {

// Row r of x ([b, h, s, d], any strides with contiguous rows) encoded as C into out + r * width
// (O: C, or a kv_codes pool that holds C on one side).
template <class C, class O, class T>
__global__ void row_codes_kernel(DeviceTensorView<T> x, float tensor_scale, O* __restrict__ out, std::int64_t width) {
  const std::int64_t S = x.extent(2), H = x.extent(1), d = x.extent(3), rows = x.extent(0) * H * S;
  for (std::int64_t r = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; r < rows;
       r += std::int64_t{gridDim.x} * blockDim.x) {
    const T* src = x.data() + (r / (H * S)) * x.stride(0) + (r / S % H) * x.stride(1) + (r % S) * x.stride(2);
    float row[max_device_head_dim];
    for (std::int64_t i = 0; i < d; ++i) row[i] = to_float(src[i]);
    C::encode(row, d, tensor_scale, reinterpret_cast<C*>(out + r * width));
  }
}

// Whether the encoder takes X: a device tensor_input of float, __half or __nv_bfloat16.
template <class X>
inline constexpr bool device_encodable =
    input_in<X, memory_space::device> && is_any_of<input_element_or_t<X, void>, float, __half, __nv_bfloat16>;

// x's rows as C codes in a new device tensor of O, [b, h, s, C::row_bytes(d)].
template <class C, class O, class T>
DeviceTensor<O> device_row_codes(const DeviceTensorView<T>& x, float tensor_scale, const char* who) {
  static_assert(!is_rotated_row_code<C>,
                "kvc::to_row_codes on a device: kvc::rotated rows are encoded on the host only (kvc::to_row_codes "
                "over host tensors)");
  if constexpr (C::tensor_scaled) check_nvfp4_tensor_scale(tensor_scale, who);
  const std::int64_t d = x.extent(3);
  if (d > max_device_head_dim)
    throw ValueError(std::string(who) + ": head_dim " + std::to_string(d) + " is above the device kernels' limit of " +
                     std::to_string(max_device_head_dim));
  if (x.stride(3) != 1) throw ValueError(std::string(who) + ": the rows must be contiguous");
  const std::int64_t w = C::row_bytes(d);
  DeviceTensor<O> out(x.extent(0), x.extent(1), x.extent(2), w);
  const std::int64_t rows = x.extent(0) * x.extent(1) * x.extent(2);
  if (rows == 0) return out;  // (rows of no values still get their scales written, as on the host)
  row_codes_kernel<C><<<quant_blocks(rows), 256>>>(x, tensor_scale, out.data(), w);
  cuda_check(cudaGetLastError(), "launching kvc's row-code kernel");
  return out;
}

}  // namespace detail

// to_row_codes (<kvc/row_codes.hpp>) over a step in device memory: x [batch, heads, seq, head_dim]
// (a DeviceTensor or DeviceTensorView of float, __half or __nv_bfloat16) as rows of C codes,
// [batch, heads, seq, C::row_bytes(head_dim)] in a new DeviceTensor, the same bytes the host's
// to_row_codes makes (NVFP4 with tensor scale 1). Not kvc::rotated rows (a compile error).
template <class C, class X>
  requires detail::input_in<X, memory_space::device>
DeviceTensor<C> to_row_codes(const X& input) {
  if constexpr (detail::encodable_row_format<C>() && detail::require_inputs<detail::device_encodable<X>, X>())
    return detail::device_row_codes<C, C>(input_view(input), 1.0f, "kvc::to_row_codes");
  else
    return {};
}
// The same as NVFP4 rows with the tensor scale `tensor_scale` (a ValueError unless positive and at
// most 2^116).
template <class C, class X>
  requires(C::tensor_scaled && detail::input_in<X, memory_space::device>)
DeviceTensor<C> to_row_codes(const X& input, float tensor_scale) {
  if constexpr (detail::require_inputs<detail::device_encodable<X>, X>())
    return detail::device_row_codes<C, C>(input_view(input), tensor_scale, "kvc::to_row_codes");
  else
    return {};
}

// to_kv_codes over a step in device memory: keys as K codes and values as V codes of a
// kvc::kv_codes<K, V> pool, each side's NVFP4 tensor scale from `scales`.
template <class P, class KT, class VT>
  requires detail::device_call<KT, VT>
KV<DeviceTensor<P>> to_kv_codes(const KT& keys, const VT& values, const Nvfp4TensorScales& scales = {}) {
  static_assert(detail::is_kv_codes<P>, "kvc::to_kv_codes: the pool type must be kvc::kv_codes<K, V>");
  constexpr bool encodable = detail::device_encodable<KT> && detail::device_encodable<VT>;
  if constexpr (detail::is_kv_codes<P> && detail::require_inputs<encodable, KT, VT>()) {
    using K = typename P::key_codes;
    using V = typename P::value_codes;
    DeviceTensor<P> k = detail::device_row_codes<K, P>(input_view(keys), scales.keys, "kvc::to_kv_codes: the keys");
    return {std::move(k),
            detail::device_row_codes<V, P>(input_view(values), scales.values, "kvc::to_kv_codes: the values")};
  } else {
    return {};
  }
}

}  // namespace kvc
