#pragma once
// kvc::OffloadToHost<OnlyNonSliding>: layers in CUDA device memory that are not in use move to
// pinned host memory, and the next one comes back on a prefetch stream (transformers'
// Cache.update with offloading=True on a GPU). It serves device storage only; the engine lives
// with the CUDA storage in <kvc/policies/offload/host_engine.cuh> (nvcc), so that this header, which
// <kvc/kvc.hpp> includes, stays free of CUDA headers. Pairing it with HostStorage is a compile error with its own message
// (kvc::Cache, docs/errors.md): host layers are spilled with kvc::OffloadToFile instead.
//
// The choice of layers is the shared logic of <kvc/policies/offload/selection.hpp>.

#include <cstdint>

#include <kvc/policies/offload/selection.hpp>
#include <kvc/tensor.hpp>

namespace kvc {
namespace detail {
template <class>
inline constexpr bool offload_to_host_pending = false;

// The per-cache state of OffloadToHost<OnlyNonSliding> for storage S. This primary template is what
// a host compiler sees: default-constructible (so the concept check and kvc::Cache's own message
// for HostStorage come first), with hooks that refuse to compile. The engine for device storage is
// a partial specialization for kvc::CudaStorage<T, Stream> in
// <kvc/policies/offload/host_engine.cuh>, which <kvc/cuda.hpp> includes (nvcc only).
template <bool OnlyNonSliding, class S>
struct offload_to_host_engine {
  template <class Cache>
  void before_update(Cache&, std::int64_t) {
    static_assert(offload_to_host_pending<Cache>,
                  "kvc::OffloadToHost: the device-to-host engine is defined in <kvc/policies/offload/host_engine.cuh> "
                  "for kvc::CudaStorage. Include <kvc/cuda.hpp> (compiled by nvcc) before using the cache");
  }
  template <class Cache>
  void after_update(Cache&, std::int64_t) noexcept {}
  template <class Cache>
  void before_access(Cache&, std::int64_t) {}
};
}  // namespace detail

// OnlyNonSliding is transformers' offload_only_non_sliding: false is DynamicCache's default, true
// StaticCache's.
template <bool OnlyNonSliding = false>
struct OffloadToHost {
  // Whether sliding-window layers stay in device memory (transformers' offload_only_non_sliding).
  static constexpr bool only_non_sliding = OnlyNonSliding;
  // Read by kvc::Cache to tell "made for device storage" apart from "cannot serve it".
  static constexpr bool moves_device_to_host = true;

  // True for device storage only.
  template <class S>
  static constexpr bool serves = S::space == memory_space::device;

  // See detail::offload_to_host_engine above and host_engine.cuh (docs/offload.md, "OffloadToHost").
  template <class S>
  using engine = detail::offload_to_host_engine<OnlyNonSliding, S>;
};

}  // namespace kvc
