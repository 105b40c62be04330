#pragma once
// kvc::OffloadToHost<OnlyNonSliding>: layers in CUDA device memory that are not in use move to
// pinned host memory, and the next one comes back on a prefetch stream (transformers'
// offloading=True on a GPU, §1.13). It serves device storage only; the engine is implemented with
// the CUDA storage (issue #6). Pairing it with HostStorage is a compile error with its own message
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
}  // namespace detail

// OnlyNonSliding is transformers' offload_only_non_sliding: false is DynamicCache's default, true
// StaticCache's.
template <bool OnlyNonSliding = false>
struct OffloadToHost {
  static constexpr bool only_non_sliding = OnlyNonSliding;
  // Read by kvc::Cache to tell "made for device storage" apart from "cannot serve it".
  static constexpr bool moves_device_to_host = true;

  template <class S>
  static constexpr bool serves = S::space == memory_space::device;

  // Default-constructible for every storage, so that the concept check and the Cache's own message
  // come first; its hooks only compile once the CUDA engine exists.
  template <class S>
  struct engine {
    template <class Cache>
    void before_update(Cache&, std::int64_t) {
      static_assert(detail::offload_to_host_pending<Cache>,
                    "kvc::OffloadToHost: the device-to-host engine comes with kvc::CudaStorage. Use kvc::NoOffload "
                    "until then");
    }
    template <class Cache>
    void after_update(Cache&, std::int64_t) noexcept {}
    template <class Cache>
    void before_access(Cache&, std::int64_t) {}
  };
};

}  // namespace kvc
