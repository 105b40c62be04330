#pragma once
// Every element type kvc stores, to and from float, in host code and in CUDA device code: float,
// double, Eigen::half and Eigen::bfloat16 (static_cast), __half and __nv_bfloat16 under nvcc
// (their conversion functions), and both 8-bit float formats (float8<Format>: Format::decode, the
// scalar reference that float8::widen's SSE2 and AVX2 forms are tested against bit for bit, and
// Format::encode). Conversions from float round to nearest even.
//
//   detail::to_float(x), detail::from_float<T>(f), or detail::float_conversion<T> itself.

#include <kvc/detail/host_device.hpp>
#include <kvc/float8.hpp>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace kvc::detail {

// static_cast, except where a specialization below says otherwise.
template <class T>
struct float_conversion {
  KVC_HOST_DEVICE static float to_float(T x) noexcept { return static_cast<float>(x); }
  KVC_HOST_DEVICE static T from_float(float x) noexcept { return static_cast<T>(x); }
};
template <class T>
KVC_HOST_DEVICE float to_float(T x) noexcept {
  return float_conversion<T>::to_float(x);
}
template <class T>
KVC_HOST_DEVICE T from_float(float x) noexcept {
  return float_conversion<T>::from_float(x);
}

// __half and __nv_bfloat16 through their conversion functions, which stay where PyTorch extension
// builds (__CUDA_NO_HALF_CONVERSIONS__, __CUDA_NO_BFLOAT16_CONVERSIONS__) remove the implicit
// conversions. They are here, next to the primary template, so that every translation unit that
// can name the CUDA types sees them.
#if defined(__CUDACC__)
template <>
struct float_conversion<__half> {
  __host__ __device__ static float to_float(__half x) noexcept { return __half2float(x); }
  __host__ __device__ static __half from_float(float x) noexcept { return __float2half_rn(x); }
};
template <>
struct float_conversion<__nv_bfloat16> {
  __host__ __device__ static float to_float(__nv_bfloat16 x) noexcept { return __bfloat162float(x); }
  __host__ __device__ static __nv_bfloat16 from_float(float x) noexcept { return __float2bfloat16_rn(x); }
};
#endif

// fp8 codes: decoded exactly, encoded rounding to nearest even and saturating (as the float8
// constructor), in host and device code alike.
template <class Format>
struct float_conversion<float8<Format>> {
  KVC_HOST_DEVICE static float to_float(float8<Format> x) noexcept { return Format::decode(x.bits); }
  KVC_HOST_DEVICE static float8<Format> from_float(float x) noexcept {
    return float8<Format>::from_bits(Format::encode(x, fp8_overflow::saturate));
  }
};

}  // namespace kvc::detail
