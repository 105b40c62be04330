#pragma once
// kvc::CudaStorage<T, Stream>: K/V tensors in CUDA device memory, for T in {float, __half,
// __nv_bfloat16}. Needs nvcc (header-only kernels). Like HostStorage it owns allocation, copies and
// element kernels, and layer kinds reach memory only through its static members, so every K/V and
// linear-attention layer kind works on the device unchanged (docs/cuda.md).
//
// What `update` returns is a kvc::DeviceTensorView<T>: a non-owning, trivially copyable view that
// carries a device pointer and can be passed by value to a kernel. Host data enters and leaves
// only through the explicit copies kvc::to_device and kvc::to_host below.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <kvc/detail/cuda_kernels.cuh>
#include <kvc/detail/cuda_runtime.cuh>
#include <kvc/detail/traits.hpp>
#include <kvc/errors.hpp>
#include <kvc/policies/quantization/cuda_codecs.cuh>
#include <kvc/policies/storage/host.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

// ---- views ---------------------------------------------------------------------------------------

// kvc::DeviceTensorView<T> and kvc::DeviceStateView<T> are defined in <kvc/tensor.hpp>, as the
// device-space aliases of the view templates that TensorView<T> and StateView<T> also name: the
// same fields and invariants, shape accessors on host and device, and elements (operator(),
// operator[], head) read by device code only. shape_string there prints a state view of either
// space.

// ---- an owning device tensor -----------------------------------------------------------------------

// A dense, row-major device tensor of rank 1 to 4 (rank 4: [batch, heads, seq, head_dim]), what
// kvc::to_device returns. RAII: cudaMalloc on construction, cudaFree on destruction; copies are
// deep (device to device, on the legacy default stream); moves steal. Its contents start
// uninitialized.
template <class T>
class DeviceTensor {
 public:
  using element_type = T;

  DeviceTensor() = default;
  DeviceTensor(std::int64_t batch, std::int64_t heads, std::int64_t seq, std::int64_t head_dim)
      : DeviceTensor(4, {batch, heads, seq, head_dim}) {}
  DeviceTensor(int rank, std::array<std::int64_t, 4> extents) : rank_(rank), extents_(extents) {
    if (rank < 1 || rank > 4) throw ValueError("kvc::DeviceTensor: rank must be 1 to 4, got " + std::to_string(rank));
    std::int64_t n = 1;
    for (int r = 0; r < rank; ++r) {
      if (extents[static_cast<std::size_t>(r)] < 0)
        throw ValueError("kvc::DeviceTensor: negative extent in " +
                         shape_string(DeviceStateView<T>{nullptr, rank, extents}));
      n = detail::checked_elements({n, extents[static_cast<std::size_t>(r)]}, sizeof(T));
    }
    for (int r = rank; r < 4; ++r) extents_[static_cast<std::size_t>(r)] = 0;
    data_ = buffer(n);
  }

  int rank() const noexcept { return rank_; }
  std::int64_t extent(int r) const noexcept { return extents_[static_cast<std::size_t>(r)]; }
  std::int64_t dimension(int r) const noexcept { return extent(r); }
  std::int64_t size() const noexcept { return data_.size(); }
  T* data() noexcept { return data_.data(); }
  const T* data() const noexcept { return data_.data(); }

  // The whole tensor as a [batch, heads, seq, head_dim] view (rank 4 only).
  DeviceTensorView<T> view() const {
    if (rank_ != 4)
      throw ValueError("kvc::DeviceTensor::view: a [batch, heads, seq, head_dim] view needs rank 4, got rank " +
                       std::to_string(rank_));
    const auto& e = extents_;
    return {data_.data(), e, {e[1] * e[2] * e[3], e[2] * e[3], e[3], 1}};
  }
  // The whole tensor as a dense state view (any rank).
  DeviceStateView<T> state_view() const noexcept { return {data_.data(), rank_, extents_}; }

 private:
  using buffer = detail::device_buffer<T, DefaultCudaStream>;
  buffer data_;
  int rank_ = 0;
  std::array<std::int64_t, 4> extents_{};
};

namespace detail {

// What CudaStorage takes as linear-attention states / indexer keys (keys and values: a
// kvc::tensor_input on the device, below).
template <class X>
struct device_input {
  static constexpr bool valid_state = false;
};
template <class T>
struct device_input<DeviceStateView<T>> {
  static constexpr bool valid_state = true;
  using element_type = std::remove_const_t<T>;
  static DeviceStateView<element_type> state_view(const DeviceStateView<T>& x) noexcept {
    return {x.ptr, x.rank, x.extents};
  }
};
template <class T>
struct device_input<DeviceTensor<T>> {
  static constexpr bool valid_state = true;
  using element_type = T;
  static DeviceStateView<T> state_view(const DeviceTensor<T>& x) noexcept { return x.state_view(); }
};

// A DeviceTensor is a kvc::tensor_input (the views of both spaces are, in <kvc/tensor_view.hpp>).
template <class T>
struct tensor_input<DeviceTensor<T>> {
  static constexpr bool valid = true;
  static constexpr bool is_view = false;
  static constexpr memory_space space = memory_space::device;
  using element_type = T;
  static DeviceTensorView<T> view(const DeviceTensor<T>& x) { return x.view(); }
};

}  // namespace detail

// ---- the storage policy ---------------------------------------------------------------------------

namespace detail {

// The paged-write kernel: blockIdx.y walks the jobs, the warps of the x blocks walk a job's
// (token, head) rows, and a warp copies one row, 16 bytes per lane where the row allows it.
template <class T>
__global__ void scatter_rows_kernel(const scatter_job<T>* __restrict__ jobs, std::int64_t njobs,
                                    const std::int64_t* __restrict__ rows, std::int64_t heads, std::int64_t width,
                                    std::int64_t dst_head_pitch) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t warps = std::int64_t{gridDim.x} * (blockDim.x / 32);
  for (std::int64_t j = blockIdx.y; j < njobs; j += gridDim.y) {
    const scatter_job<T> job = jobs[j];
    for (std::int64_t r = std::int64_t{blockIdx.x} * (blockDim.x / 32) + threadIdx.x / 32; r < job.tokens * heads;
         r += warps) {
      const std::int64_t t = r / heads, h = r % heads;
      T* dst = job.dst + rows[job.first_row + t] * width + h * dst_head_pitch;
      const T* src = job.src + t * job.src_token + h * job.src_head;
      const std::int64_t bytes = width * static_cast<std::int64_t>(sizeof(T));
      if (bytes % 16 == 0 && vector_aligned(dst) && vector_aligned(src)) {
        for (std::int64_t c = lane; c < bytes / 16; c += 32)
          reinterpret_cast<uint4*>(dst)[c] = reinterpret_cast<const uint4*>(src)[c];
      } else {
        for (std::int64_t c = lane; c < width; c += 32) dst[c] = src[c];
      }
    }
  }
}

template <class T>
void scatter_rows_bytes(std::span<const scatter_job<T>> jobs, std::span<const std::int64_t> rows, std::int64_t heads,
                        std::int64_t width, std::int64_t dst_head_pitch, cudaStream_t stream) {
  std::int64_t most = 0;
  for (const auto& job : jobs) most = std::max(most, job.tokens);
  if (jobs.empty() || most == 0 || heads == 0 || width == 0) return;
  const std::size_t job_bytes = sizeof(scatter_job<T>) * jobs.size(), row_offset = (job_bytes + 15) / 16 * 16;
  stream_scratch scratch(row_offset + sizeof(std::int64_t) * rows.size(), stream, "kvc's paged write list");
  auto* base = static_cast<unsigned char*>(scratch.get());
  cuda_check(cudaMemcpyAsync(base, jobs.data(), job_bytes, cudaMemcpyHostToDevice, stream),
             "cudaMemcpyAsync (host to device) of kvc's paged write list");
  cuda_check(cudaMemcpyAsync(base + row_offset, rows.data(), sizeof(std::int64_t) * rows.size(), cudaMemcpyHostToDevice,
                             stream),
             "cudaMemcpyAsync (host to device) of kvc's paged write rows");
  constexpr unsigned threads = 256;
  const dim3 grid(static_cast<unsigned>(std::min<std::int64_t>((most * heads + 7) / 8, 4096)),
                  static_cast<unsigned>(std::min<std::size_t>(jobs.size(), 65535)));
  scatter_rows_kernel<T><<<grid, threads, 0, stream>>>(
      reinterpret_cast<const scatter_job<T>*>(base), static_cast<std::int64_t>(jobs.size()),
      reinterpret_cast<const std::int64_t*>(base + row_offset), heads, width, dst_head_pitch);
  cuda_check(cudaGetLastError(), "launching kvc's paged write kernel");
}

}  // namespace detail

// Stream: where every operation of this storage is queued (a type with `static cudaStream_t get()`;
// the default is the legacy default stream, see DefaultCudaStream). All operations are asynchronous
// with respect to the host; views returned by `update` are ready for work queued afterwards on the
// same stream (or on any blocking stream, with the default).
template <class T, class Stream = DefaultCudaStream>
struct CudaStorage {
  using element_type = T;
  using stream_policy = Stream;
  static constexpr memory_space space = memory_space::device;
  // Checked by kvc::Cache with a readable message, as for HostStorage.
  static constexpr bool element_supported =
      detail::is_any_of<T, float, __half, __nv_bfloat16, float8_e4m3, float8_e5m2>;

  using buffer_type = detail::device_buffer<T, Stream>;
  using view_type = DeviceTensorView<T>;
  using state_view_type = DeviceStateView<T>;

  static cudaStream_t stream() noexcept { return Stream::get(); }

  // `height` rows of `width` elements: row i goes from src + i*spitch to dst + i*dpitch (both in
  // device memory; rows must not overlap). A 16-byte vectorised kernel when the pointers and
  // pitches allow it, cudaMemcpy2DAsync otherwise. Throws kvc::RuntimeError if CUDA refuses.
  static void copy_2d(T* dst, std::int64_t dpitch, const T* src, std::int64_t spitch, std::int64_t width,
                      std::int64_t height) {
    if (width <= 0 || height <= 0) return;
    detail::copy_rows_bytes(dst, bytes(dpitch), src, bytes(spitch), bytes(width), static_cast<std::size_t>(height),
                            stream());
  }

  // Sets `height` rows of `width` elements (row pitch `dpitch`) to zero.
  static void zero_2d(T* dst, std::int64_t dpitch, std::int64_t width, std::int64_t height) {
    if (width <= 0 || height <= 0) return;
    detail::zero_rows_bytes(dst, bytes(dpitch), bytes(width), static_cast<std::size_t>(height), stream());
  }

  // Paged writes (HostStorage::scatter_rows' contract): one kernel for every job, a warp per
  // (job, token, head) row; the job list and rows go to the device first, in stream order.
  static void scatter_rows(std::span<const detail::scatter_job<T>> jobs, std::span<const std::int64_t> rows,
                           std::int64_t heads, std::int64_t width, std::int64_t dst_head_pitch) {
    detail::scatter_rows_bytes(jobs, rows, heads, width, dst_head_pitch, stream());
  }

  static view_type make_view(const T* ptr, std::array<std::int64_t, 4> extents,
                             std::array<std::int64_t, 4> strides) noexcept {
    return {ptr, extents, strides};
  }

  // What update() accepts: a kvc::tensor_input of T on the device (a DeviceTensorView<T> or a
  // DeviceTensor<T> of rank 4), and its view. Host tensors are not accepted: copy them with
  // kvc::to_device first, so that every transfer is explicit.
  template <class X>
  static constexpr bool accepts_input = detail::input_of<X, T, memory_space::device>;
  template <class X>
  static view_type input_view(const X& x) {
    return kvc::input_view(x);
  }

  // Linear-attention states and indexer keys: a DeviceStateView<T> or a DeviceTensor<T>.
  template <class X>
  static constexpr bool accepts_state_input = [] {
    using traits = detail::device_input<std::remove_cvref_t<X>>;
    if constexpr (traits::valid_state)
      return std::is_same_v<typename traits::element_type, T>;
    else
      return false;
  }();
  template <class X>
  static state_view_type state_input_view(const X& x) {
    return detail::device_input<std::remove_cvref_t<X>>::state_view(x);
  }
  static state_view_type make_state_view(const T* ptr, int rank, std::array<std::int64_t, 4> extents) noexcept {
    return {ptr, rank, extents};
  }

 private:
  static std::size_t bytes(std::int64_t elements) noexcept { return sizeof(T) * static_cast<std::size_t>(elements); }
};

namespace detail {
// kvc::QuantizedLayer over device memory keeps its codes on the device and runs the codecs as
// kernels (<kvc/policies/quantization/cuda_codecs.cuh>).
template <class T, class Stream, class M>
struct quantized_tensor_for<CudaStorage<T, Stream>, M, void> {
  using type = device_quantized_tensor<M, Stream>;
};
}  // namespace detail

// ---- explicit transfers -------------------------------------------------------------------------

// A device copy of a host tensor of rank 1 to 4 (float, Eigen::half or Eigen::bfloat16, copied
// bitwise to float, __half or __nv_bfloat16). Queued on `stream` and waited for: the data is on the
// device when this returns.
template <class U, int N>
  requires(N >= 1 && N <= 4 && detail::element_map<U>::valid)
DeviceTensor<detail::device_element_t<U>> to_device(const Eigen::Tensor<U, N, Eigen::RowMajor>& host,
                                                    cudaStream_t stream = cudaStream_t{}) {
  using D = detail::device_element_t<U>;
  std::array<std::int64_t, 4> e{};
  for (int r = 0; r < N; ++r) e[static_cast<std::size_t>(r)] = host.dimension(r);
  DeviceTensor<D> out(N, e);
  if (out.size() > 0) {
    detail::cuda_check(cudaMemcpyAsync(out.data(), host.data(), sizeof(D) * static_cast<std::size_t>(out.size()),
                                       cudaMemcpyHostToDevice, stream),
                       "cudaMemcpyAsync (host to device) in kvc::to_device");
    detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize in kvc::to_device");
  }
  return out;
}

// A host copy of what a device view shows ([batch, heads, seq, head_dim], dense), element types
// mapped back bitwise (__half -> Eigen::half, __nv_bfloat16 -> Eigen::bfloat16). Queued on `stream`
// and waited for. With a non-blocking storage stream, synchronise it (or pass it) first.
template <class T>
HostTensor<detail::host_element_t<T>> to_host(const DeviceTensorView<T>& view, cudaStream_t stream = cudaStream_t{}) {
  using H = detail::host_element_t<T>;
  const auto& e = view.extents;
  HostTensor<H> out(e[0], e[1], e[2], e[3]);
  if (view.size() == 0) return out;
  constexpr std::size_t sz = sizeof(T);
  auto* dst = reinterpret_cast<unsigned char*>(out.data());
  const auto* src = reinterpret_cast<const unsigned char*>(view.data());
  const char* what = "cudaMemcpy2DAsync (device to host) in kvc::to_host";
  if (view.stride(3) == 1 && view.stride(2) == e[3]) {
    // one 2-D copy per batch entry: `heads` rows of seq * head_dim elements
    for (std::int64_t b = 0; b < e[0]; ++b)
      detail::cuda_check(
          cudaMemcpy2DAsync(dst + sz * static_cast<std::size_t>(b * e[1] * e[2] * e[3]),
                            sz * static_cast<std::size_t>(e[2] * e[3]),
                            src + sz * static_cast<std::size_t>(b * view.stride(0)),
                            sz * static_cast<std::size_t>(view.stride(1)), sz * static_cast<std::size_t>(e[2] * e[3]),
                            static_cast<std::size_t>(e[1]), cudaMemcpyDeviceToHost, stream),
          what);
  } else if (view.stride(3) == 1) {
    // one 2-D copy per (batch, head): `seq` rows of head_dim elements
    for (std::int64_t b = 0; b < e[0]; ++b)
      for (std::int64_t h = 0; h < e[1]; ++h)
        detail::cuda_check(
            cudaMemcpy2DAsync(dst + sz * static_cast<std::size_t>((b * e[1] + h) * e[2] * e[3]),
                              sz * static_cast<std::size_t>(e[3]),
                              src + sz * static_cast<std::size_t>(b * view.stride(0) + h * view.stride(1)),
                              sz * static_cast<std::size_t>(view.stride(2)), sz * static_cast<std::size_t>(e[3]),
                              static_cast<std::size_t>(e[2]), cudaMemcpyDeviceToHost, stream),
            what);
  } else {
    throw ValueError("kvc::to_host: the last dimension of the view must be contiguous, got stride " +
                     std::to_string(view.stride(3)));
  }
  detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize in kvc::to_host");
  return out;
}

// A host copy of a dense device state as an Eigen tensor of rank N (extents past the view's rank
// are 1), element types mapped back bitwise. Queued on `stream` and waited for.
template <int N, class T>
  requires(N >= 1 && N <= 4)
Eigen::Tensor<detail::host_element_t<T>, N, Eigen::RowMajor> to_host(const DeviceStateView<T>& view,
                                                                     cudaStream_t stream = cudaStream_t{}) {
  using H = detail::host_element_t<T>;
  Eigen::DSizes<Eigen::Index, N> dims;  // not std::array: under nvcc Eigen::array is its own type
  for (int r = 0; r < N; ++r)
    dims[r] = r < view.rank ? view.extents[static_cast<std::size_t>(r)] : (view.rank > 0 ? 1 : 0);
  Eigen::Tensor<H, N, Eigen::RowMajor> out(dims);
  if (out.size() != view.size())
    throw ValueError("kvc::to_host: a state of shape " + shape_string(view) + " does not fit a rank-" +
                     std::to_string(N) + " tensor");
  if (out.size() > 0) {
    detail::cuda_check(cudaMemcpyAsync(out.data(), view.data(), sizeof(T) * static_cast<std::size_t>(out.size()),
                                       cudaMemcpyDeviceToHost, stream),
                       "cudaMemcpyAsync (device to host) in kvc::to_host");
    detail::cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize in kvc::to_host");
  }
  return out;
}

}  // namespace kvc
