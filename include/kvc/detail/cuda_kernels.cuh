#pragma once
// The element kernels of kvc::CudaStorage (kvc::detail, needs nvcc): a strided block copy with
// 16-byte accesses and a strided fill with zeros, both queued asynchronously on a stream.
// Everything is in bytes: one kernel serves every element type.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include <cuda_runtime.h>

#include <kvc/detail/cuda_runtime.cuh>

namespace kvc::detail {

// `height` rows of `width` vectors of type V; row r goes from src + r*spitch to dst + r*dpitch
// (pitches in vectors). threadIdx.x walks a row, threadIdx.y picks rows, so that narrow rows (one
// decode token of one head) still fill whole warps.
template <class V>
__global__ void copy_rows_kernel(V* __restrict__ dst, std::int64_t dpitch, const V* __restrict__ src,
                                 std::int64_t spitch, std::int64_t width, std::int64_t height) {
  const std::int64_t row_step = std::int64_t{gridDim.y} * blockDim.y;
  const std::int64_t col_step = std::int64_t{gridDim.x} * blockDim.x;
  for (std::int64_t r = std::int64_t{blockIdx.y} * blockDim.y + threadIdx.y; r < height; r += row_step) {
    const V* s = src + r * spitch;
    V* d = dst + r * dpitch;
    for (std::int64_t c = std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x; c < width; c += col_step) d[c] = s[c];
  }
}

inline constexpr std::size_t vector_bytes = 16;

__host__ __device__ inline bool vector_aligned(const void* p) noexcept {
  return reinterpret_cast<std::uintptr_t>(p) % vector_bytes == 0;
}

// Launch shape for `height` rows of `width` vectors: 256 threads a block, as many of them along
// a row as the row has vectors (rounded up to a power of two; a warp may span several short rows,
// each a contiguous segment), capped grids with grid-stride loops beyond.
struct rows_launch {
  dim3 grid;
  dim3 block;
};
inline rows_launch launch_shape(std::int64_t width, std::int64_t height) noexcept {
  constexpr std::int64_t threads = 256;
  std::int64_t tx = 1;
  while (tx < threads && tx < width) tx *= 2;
  const std::int64_t ty = threads / tx;
  const std::int64_t gx = std::min<std::int64_t>((width + tx - 1) / tx, 4096);
  const std::int64_t gy = std::min<std::int64_t>((height + ty - 1) / ty, 65535);
  return {dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy)),
          dim3(static_cast<unsigned>(tx), static_cast<unsigned>(ty))};
}

// cudaMemcpy2D's contract in bytes: `height` rows of `width` bytes; rows must not overlap.
inline void copy_rows_bytes(void* dst, std::size_t dpitch, const void* src, std::size_t spitch, std::size_t width,
                            std::size_t height, cudaStream_t stream) {
  if (width == 0 || height == 0) return;
  if (height == 1) dpitch = spitch = width;  // the pitches of a single row do not matter
  if (dpitch == width && spitch == width) {  // one contiguous block
    width *= height;
    height = 1;
  }
  if (vector_aligned(dst) && vector_aligned(src) && width % vector_bytes == 0 && dpitch % vector_bytes == 0 &&
      spitch % vector_bytes == 0) {
    const auto w = static_cast<std::int64_t>(width / vector_bytes);
    const auto h = static_cast<std::int64_t>(height);
    const rows_launch shape = launch_shape(w, h);
    copy_rows_kernel<uint4><<<shape.grid, shape.block, 0, stream>>>(
        static_cast<uint4*>(dst), static_cast<std::int64_t>(dpitch / vector_bytes), static_cast<const uint4*>(src),
        static_cast<std::int64_t>(spitch / vector_bytes), w, h);
    cuda_check(cudaGetLastError(), "launching kvc's copy kernel");
    return;
  }
  cuda_check(cudaMemcpy2DAsync(dst, dpitch, src, spitch, width, height, cudaMemcpyDeviceToDevice, stream),
             "cudaMemcpy2DAsync (device to device)");
}

// `height` rows of `width` bytes, row pitch `dpitch`, set to zero.
inline void zero_rows_bytes(void* dst, std::size_t dpitch, std::size_t width, std::size_t height, cudaStream_t stream) {
  if (width == 0 || height == 0) return;
  if (height == 1 || dpitch == width) {
    cuda_check(cudaMemsetAsync(dst, 0, width * height, stream), "cudaMemsetAsync");
    return;
  }
  cuda_check(cudaMemset2DAsync(dst, dpitch, 0, width, height, stream), "cudaMemset2DAsync");
}

// Scratch device memory that lives in stream order on `stream` (cudaMallocAsync / cudaFreeAsync);
// where the device has no stream-ordered memory pools, plain cudaMalloc / cudaFree.
class stream_scratch {
 public:
  // `what` names the memory in errors ("cudaMallocAsync of <what> failed: ...").
  stream_scratch(std::size_t bytes, cudaStream_t stream, const char* what = "kvc's quantization scratch")
      : stream_(stream) {
    if (bytes == 0) return;
    const cudaError_t status = cudaMallocAsync(&ptr_, bytes, stream);
    if (status == cudaErrorNotSupported) {
      (void)cudaGetLastError();
      ordered_ = false;
      cuda_check(cudaMalloc(&ptr_, bytes), (std::string("cudaMalloc of ") + what).c_str());
      return;
    }
    cuda_check(status, (std::string("cudaMallocAsync of ") + what).c_str());
  }
  stream_scratch(const stream_scratch&) = delete;
  stream_scratch& operator=(const stream_scratch&) = delete;
  ~stream_scratch() {
    if (!ptr_) return;
    // A broken context reports at the next checked call; the last error is cleared so that it is
    // not blamed on the next launch.
    if ((ordered_ ? cudaFreeAsync(ptr_, stream_) : cudaFree(ptr_)) != cudaSuccess) (void)cudaGetLastError();
  }
  void* get() const noexcept { return ptr_; }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
  bool ordered_ = true;
};

}  // namespace kvc::detail
