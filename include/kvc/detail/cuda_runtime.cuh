#pragma once
// CUDA runtime plumbing for kvc::CudaStorage (undocumented, kvc::detail): turning CUDA error codes
// into kvc::RuntimeError, the stream every storage operation is queued on, an owning device array,
// and the mapping between kvc's host element types and CUDA's.

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <Eigen/Core>

#include <kvc/detail/row_code_types.hpp>
#include <kvc/errors.hpp>
#include <kvc/float8.hpp>
#include <kvc/limits.hpp>

namespace kvc {

// The stream policy of kvc::CudaStorage: a type with `static cudaStream_t get()`. Every copy,
// fill, allocation-time copy and transfer of a storage is queued on that one stream, in call order.
// The default is the legacy default stream, which orders kvc's work with all the caller's work on
// blocking streams, so nothing needs an explicit synchronisation.
struct DefaultCudaStream {
  static cudaStream_t get() noexcept { return cudaStream_t{}; }
};

namespace detail {

// Throws kvc::RuntimeError("kvc: <operation> failed: <CUDA's error string> (<error name>)").
// It first clears the runtime's last error, which a failed call also sets: a caught error (an
// allocation that did not fit) would otherwise come back at the next launch check. A sticky
// error (a broken context) is not cleared by this and fails every later call anyway.
inline void cuda_check(cudaError_t status, const char* operation) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();
  std::string message = "kvc: ";
  message.append(operation);
  message.append(" failed: ");
  message.append(cudaGetErrorString(status));
  message.append(" (");
  message.append(cudaGetErrorName(status));
  message.push_back(')');
  throw RuntimeError(message);
}

// The number of CUDA devices, 0 when there is none or no usable driver (never throws).
inline int cuda_device_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no driver" status
    return 0;
  }
  return n;
}

// An owning array of n T in device memory (cudaMalloc, 256-byte aligned). Copies are deep
// (a device-to-device copy queued on Stream); moves steal. Destruction frees with cudaFree,
// which waits for the work already queued on the device.
template <class T, class Stream>
class device_buffer {
 public:
  device_buffer() noexcept = default;
  // n elements (at most allocation_limit() bytes: ValueError otherwise, checked before cudaMalloc).
  explicit device_buffer(std::int64_t n) : size_(checked_elements({n > 0 ? n : 0}, sizeof(T))) {
    if (size_ > 0) {
      void* p = nullptr;
      cuda_check(cudaMalloc(&p, bytes()), "cudaMalloc of a kvc device buffer");
      ptr_ = static_cast<T*>(p);
    }
  }
  device_buffer(const device_buffer& other) : device_buffer(other.size_) {
    if (size_ > 0) {
      try {
        cuda_check(cudaMemcpyAsync(ptr_, other.ptr_, bytes(), cudaMemcpyDeviceToDevice, Stream::get()),
                   "cudaMemcpyAsync (device to device) copying a kvc device buffer");
      } catch (...) {
        release();
        throw;
      }
    }
  }
  device_buffer(device_buffer&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), size_(std::exchange(other.size_, 0)) {}
  // Copy and swap (see host_buffer's copy assignment for why it is not one by-value operator=).
  device_buffer& operator=(const device_buffer& other) {
    if (this != &other) {
      device_buffer copy(other);
      swap(copy);
    }
    return *this;
  }
  device_buffer& operator=(device_buffer&& other) noexcept {
    device_buffer moved(std::move(other));
    swap(moved);
    return *this;
  }
  ~device_buffer() { release(); }

  void swap(device_buffer& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(size_, other.size_);
  }

  T* data() noexcept { return ptr_; }
  const T* data() const noexcept { return ptr_; }
  std::int64_t size() const noexcept { return size_; }
  std::size_t bytes() const noexcept { return sizeof(T) * static_cast<std::size_t>(size_); }

 private:
  void release() noexcept {
    // A destructor cannot report: a failing cudaFree means the context is already broken, and the
    // next checked call reports that (the last error is cleared so that it is not blamed on the
    // next launch instead).
    if (ptr_ && cudaFree(ptr_) != cudaSuccess) (void)cudaGetLastError();
    ptr_ = nullptr;
  }

  T* ptr_ = nullptr;
  std::int64_t size_ = 0;
};

// Host element type <-> device element type. The pairs have the same size and bit layout, so
// transfers copy bytes and never convert.
template <class T>
struct element_map {
  static constexpr bool valid = false;
};
template <>
struct element_map<float> {
  static constexpr bool valid = true;
  using host = float;
  using device = float;
};
template <>
struct element_map<__half> {
  static constexpr bool valid = true;
  using host = Eigen::half;
  using device = __half;
};
template <>
struct element_map<Eigen::half> : element_map<__half> {};
template <>
struct element_map<__nv_bfloat16> {
  static constexpr bool valid = true;
  using host = Eigen::bfloat16;
  using device = __nv_bfloat16;
};
template <>
struct element_map<Eigen::bfloat16> : element_map<__nv_bfloat16> {};

// fp8 codes are one byte on both sides: kvc's own float8 types, copied as they are.
template <class Format>
struct element_map<float8<Format>> {
  static constexpr bool valid = true;
  using host = float8<Format>;
  using device = float8<Format>;
};

// Row codes (kvc::int4_row, nvfp4_row, kv_codes pairs, ...: <kvc/row_codes.hpp>) are bytes on both
// sides too: a pool's rows of codes and scales, copied as they are.
template <class C>
  requires is_row_code_v<C>
struct element_map<C> {
  static constexpr bool valid = true;
  using host = C;
  using device = C;
};

template <class T>
using host_element_t = typename element_map<std::remove_const_t<T>>::host;
template <class T>
using device_element_t = typename element_map<std::remove_const_t<T>>::device;

static_assert(sizeof(Eigen::half) == sizeof(__half) && sizeof(Eigen::bfloat16) == sizeof(__nv_bfloat16),
              "kvc: Eigen's and CUDA's 16-bit floats must have the same size");

}  // namespace detail
}  // namespace kvc
