#pragma once
// The CUDA umbrella header: everything in <kvc/kvc.hpp> plus device storage (kvc::CudaStorage,
// kvc::DeviceTensorView, kvc::DeviceStateView, kvc::DeviceTensor, kvc::to_device, kvc::to_host), the engine of kvc::OffloadToHost, and attention
// on the device (scaled_dot_product_attention over device views, paged_attention over a
// PagedCache<CudaStorage<T>>, row codes included, and their encoders to_row_codes / to_kv_codes).
// Compile the including file with nvcc (-std=c++20); see docs/cuda.md.

#if !defined(__CUDACC__)
#error "kvc/cuda.hpp holds CUDA kernels: compile this file with nvcc as CUDA, or include kvc/kvc.hpp for host-only code"
#else  // nothing more for a host compiler, so that the #error is its only error

#include <kvc/kvc.hpp>
#include <kvc/policies/storage/cuda.cuh>
#include <kvc/policies/offload/host_engine.cuh>  // kvc::OffloadToHost's engine for CudaStorage
#include <kvc/detail/cuda_attention.cuh>         // attention and paged attention on the device
#include <kvc/detail/cuda_row_codes.cuh>         // to_row_codes / to_kv_codes on the device

#endif  // __CUDACC__
