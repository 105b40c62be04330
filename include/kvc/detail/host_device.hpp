#pragma once
// KVC_HOST_DEVICE: marks a function that runs on the host and, under nvcc, in CUDA device code;
// and the arithmetic that must round the same in both (detail::mul_rn, add_rn).

#if !defined(KVC_HOST_DEVICE)
#if defined(__CUDACC__)
#define KVC_HOST_DEVICE __host__ __device__
#else
#define KVC_HOST_DEVICE
#endif
#endif

namespace kvc::detail {

// a * b and a + b, each rounded on its own: device code must not fuse them into an FMA (nvcc does
// by default), or the device would round differently from the host, whose compilers kvc is tested
// with do not fuse.
KVC_HOST_DEVICE inline float mul_rn(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVC_HOST_DEVICE inline float add_rn(float a, float b) noexcept {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

}  // namespace kvc::detail
