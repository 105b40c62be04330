#pragma once
// KVC_HOST_DEVICE: marks a function that runs on the host and, under nvcc, in CUDA device code.

#if !defined(KVC_HOST_DEVICE)
#if defined(__CUDACC__)
#define KVC_HOST_DEVICE __host__ __device__
#else
#define KVC_HOST_DEVICE
#endif
#endif
