#pragma once
// Attention on a CUDA device (needs nvcc): scaled_dot_product_attention over device views (the
// contiguous layers' K/V) and paged_attention over a PagedCache<CudaStorage<T>>'s pools, for
// float, __half and __nv_bfloat16 K/V, fp8 codes (kvc::float8_e4m3 / e5m2 with kvc::Fp8Scales)
// and pools of row codes (kvc::int8_row, int4_row, int2_row, nvfp4_row, fp8_row<F8>, kv_codes
// pairs: <kvc/row_codes.hpp>, each value read from its row's codes and scales), scores and
// softmax in float. docs/cuda.md ("Attention") describes them.
//
// One kernel serves decode and prefill: a warp per (query row, split of its keys), the row's dims
// spread over the lanes, an online softmax over the split's keys (<kvc/detail/attention_rows.hpp>,
// the same functions the host test path runs); the four warps of a block are query heads of one KV
// head, so they read the same key rows. Long contexts are split over the keys (split-KV) so that
// a decode step of a few rows still fills the device, and a second kernel merges each row's
// partials. Work is queued on the legacy default stream, like CudaStorage's default, and the
// result is a new DeviceTensor (as the host functions return a new HostTensor).

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>

#include <kvc/attention.hpp>
#include <kvc/detail/attention_rows.hpp>
#include <kvc/detail/cuda_kernels.cuh>
#include <kvc/detail/cuda_runtime.cuh>
#include <kvc/fp8_attention.hpp>
#include <kvc/paged/paged_attention.hpp>
#include <kvc/policies/storage/cuda.cuh>

namespace kvc {
namespace detail {

// The 32 lanes of a warp: a score is summed across them with shuffles.
struct warp_lanes {
  static constexpr int count = 32;
  int lane;
  KVC_HOST_DEVICE int index() const noexcept { return lane; }
  KVC_HOST_DEVICE static float sum(float x) noexcept {
#if defined(__CUDA_ARCH__)
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(0xFFFFFFFFu, x, offset);
#endif
    return x;
  }
};

inline constexpr int attention_warps = 4;  // warps (rows) per block

// Split s (blockIdx.y) of row blockIdx.x * 4 + warp (attention_row_split); partials hold
// `splits` partials of 2 + Dv floats per row.
template <int PerLane, class Problem>
__global__ void __launch_bounds__(attention_warps * 32)
    attention_rows_kernel(Problem p, std::int64_t chunk, std::int64_t splits, float* __restrict__ partials) {
  const std::int64_t i = std::int64_t{blockIdx.x} * attention_warps + threadIdx.x / 32;
  if (i >= p.rows()) return;  // the whole warp
  attention_row_split<PerLane>(p, i, blockIdx.y, chunk, splits,
                               splits > 1 ? partials + i * splits * (2 + p.Dv) : nullptr,
                               warp_lanes{static_cast<int>(threadIdx.x % 32)});
}

// A warp per row: its partials merged into the output row (attention_row_merge).
template <class Problem>
__global__ void __launch_bounds__(attention_warps * 32)
    attention_merge_kernel(Problem p, std::int64_t splits, const float* __restrict__ partials) {
  const std::int64_t i = std::int64_t{blockIdx.x} * attention_warps + threadIdx.x / 32;
  if (i >= p.rows()) return;
  attention_row_merge(p, i, splits, partials + i * splits * (2 + p.Dv), warp_lanes{static_cast<int>(threadIdx.x % 32)});
}

// Runs a problem whose widest row sees max_width keys: split-KV sized for the device, then the
// row kernel and (with more than one split) the merge.
template <class Problem>
void launch_attention_rows(const Problem& p, std::int64_t max_width, cudaStream_t stream) {
  const std::int64_t rows = p.rows();
  if (rows == 0) return;
  int device = 0, sms = 0;
  cuda_check(cudaGetDevice(&device), "cudaGetDevice in kvc's attention");
  cuda_check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute in kvc's attention");
  // About 16 warps per SM in flight: enough to hide memory latency.
  std::int64_t chunk = split_chunk(rows, max_width, std::int64_t{sms} * 16);
  chunk = std::max(chunk, (max_width + 65534) / 65535);  // gridDim.y <= 65535
  const std::int64_t splits = split_count(max_width, chunk);
  const dim3 grid(static_cast<unsigned>((rows + attention_warps - 1) / attention_warps), static_cast<unsigned>(splits));
  const dim3 block(attention_warps * 32);
  const std::size_t partial_bytes =
      splits > 1 ? sizeof(float) * static_cast<std::size_t>(checked_elements({rows, splits, 2 + p.Dv}, sizeof(float)))
                 : 0;
  stream_scratch partials(partial_bytes, stream, "kvc's attention partials");
  auto* part = static_cast<float*>(partials.get());
  if (std::max(p.D, p.Dv) <= 128)
    attention_rows_kernel<4><<<grid, block, 0, stream>>>(p, chunk, splits, part);
  else
    attention_rows_kernel<8><<<grid, block, 0, stream>>>(p, chunk, splits, part);
  cuda_check(cudaGetLastError(), "launching kvc's attention kernel");
  if (splits > 1) {
    attention_merge_kernel<<<grid.x, block, 0, stream>>>(p, splits, part);
    cuda_check(cudaGetLastError(), "launching kvc's attention merge kernel");
  }
}

// Host arrays copied into one stream-ordered device scratch (tables, offsets, masks, scales).
class device_upload {
 public:
  device_upload(std::size_t bytes, cudaStream_t stream)
      : scratch_(bytes, stream, "kvc's attention metadata"), stream_(stream) {}
  template <class U>
  const U* put(const U* host, std::size_t n) {
    if (n == 0) return nullptr;
    used_ = (used_ + alignof(std::int64_t) - 1) / alignof(std::int64_t) * alignof(std::int64_t);
    auto* dst = static_cast<unsigned char*>(scratch_.get()) + used_;
    cuda_check(cudaMemcpyAsync(dst, host, sizeof(U) * n, cudaMemcpyHostToDevice, stream_),
               "cudaMemcpyAsync (host to device) of kvc's attention metadata");
    used_ += sizeof(U) * n;
    return reinterpret_cast<const U*>(dst);
  }
  // One scale, or one per head, uploaded (none: unit scales).
  head_scales scales(const std::vector<float>* host) {
    if (!host) return {};
    return {put(host->data(), host->size()), host->size() > 1};
  }
  static std::size_t size_of(std::size_t bytes) { return (bytes + 7) / 8 * 8; }

 private:
  stream_scratch scratch_;
  cudaStream_t stream_;
  std::size_t used_ = 0;
};

inline void check_device_head_dim(std::int64_t d, const char* who) {
  if (d > max_device_head_dim)
    throw ValueError(std::string(who) + ": head_dim " + std::to_string(d) + " is above the device kernels' limit of " +
                     std::to_string(max_device_head_dim));
}

// Dense attention on the device with K/V of type KV and per-head scales (null: unit).
template <class T, class KV>
DeviceTensor<T> device_attention(const DeviceTensorView<T>& q, const DeviceTensorView<KV>& k,
                                 const DeviceTensorView<KV>& v, const AttentionMask& mask, std::optional<double> scale,
                                 const std::vector<float>* key_scales, const std::vector<float>* value_scales) {
  auto p = make_dense_problem(q, k, v, mask, scale, static_cast<T*>(nullptr), {}, {}, nullptr);  // every check
  check_device_head_dim(std::max(p.D, p.Dv), "kvc::scaled_dot_product_attention on a device");
  DeviceTensor<T> out(q.extent(0), q.extent(1), q.extent(2), v.extent(3));
  p.out = out.data();
  const cudaStream_t stream{};
  const std::size_t ks = key_scales ? key_scales->size() : 0, vs = value_scales ? value_scales->size() : 0;
  device_upload up(device_upload::size_of(mask.key_padding_mask.size()) + 8 * (ks + vs) + 64, stream);
  p.pad = up.put(mask.key_padding_mask.data(), mask.key_padding_mask.size());
  p.key_scales = up.scales(key_scales);
  p.value_scales = up.scales(value_scales);
  std::int64_t width = 0;  // the widest visible range: rows of one (batch, head) differ only by token
  for (std::int64_t t = 0; t < p.Q; ++t) {
    const auto r = p.row(t * p.group());  // reads no element: pointers and the mask's ints only
    width = std::max(width, r.hi - r.lo);
  }
  launch_attention_rows(p, width, stream);
  return out;
}

// Paged attention on the device with pools of KV and per-head scales (null: unit).
template <class KV, class Stream, class T>
DeviceTensor<T> device_paged_attention(const PagedCache<CudaStorage<KV, Stream>>& cache, std::int64_t layer_idx,
                                       const PagedAttentionStep& step, const DeviceTensorView<T>& q,
                                       const DeviceTensorView<KV>& k, const DeviceTensorView<KV>& v,
                                       std::optional<double> scale, const std::vector<float>* key_scales,
                                       const std::vector<float>* value_scales) {
  static_assert(!rotates_keys<KV> && !rotates_values<KV>,
                "kvc::paged_attention on a device: pools of kvc::rotated row codes are read on the host only; keep "
                "rotated pools in HostStorage");
  const paged_call call = check_paged_attention(cache, layer_idx, step, q, k, v);
  check_device_head_dim(call.D, "kvc::paged_attention on a device");
  std::int64_t width = 0;
  const std::vector<std::int64_t> tables = paged_tables(cache, call, step, width);
  std::int64_t widest = 0;  // the most keys a row sees: the last token of a request
  for (std::int64_t r = 0; r < call.R; ++r) {
    const auto i = static_cast<std::size_t>(r);
    const std::int64_t q_r = step.cu_seqlens_q[i + 1] - step.cu_seqlens_q[i];
    if (q_r > 0)
      widest = std::max(widest, call.window > 0 ? std::min(call.window, step.past[i] + q_r) : step.past[i] + q_r);
  }
  DeviceTensor<T> out(1, call.Hq, call.T, call.D);
  const cudaStream_t stream = Stream::get();
  const std::size_t ks = key_scales ? key_scales->size() : 0, vs = value_scales ? value_scales->size() : 0;
  device_upload up(8 * (tables.size() + 2 * step.past.size() + 1 + ks + vs) + 64, stream);
  const std::int64_t* cu = up.put(step.cu_seqlens_q.data(), step.cu_seqlens_q.size());
  const std::int64_t* past = up.put(step.past.data(), step.past.size());
  const std::int64_t* tab = up.put(tables.data(), tables.size());
  const head_scales kscales = up.scales(key_scales), vscales = up.scales(value_scales);
  const auto p = make_paged_problem(cache, call, q, k, v, out.data(), cu, past, tab, width, scale, kscales, vscales);
  launch_attention_rows(p, widest, stream);
  return out;
}

}  // namespace detail

// ---- public API ----------------------------------------------------------------------------------

// scaled_dot_product_attention (attention.hpp) on a CUDA device: queries [B, Hq, q, D], keys and
// values [B, Hkv, kv_length, D], each a DeviceTensor or DeviceTensorView of one element type T
// (kvc::tensor_input in device memory). The same checks and messages as the host function, and
// ValueError for a head_dim above 256. Returns [B, Hq, q, Dv] in device memory; the work is queued
// on the legacy default stream.
template <class Q, class K, class V>
  requires detail::device_call<Q, K, V>
DeviceTensor<input_element_t<K>> scaled_dot_product_attention(const Q& queries, const K& keys, const V& values,
                                                              const AttentionMask& mask,
                                                              std::optional<double> scale = std::nullopt) {
  using T = input_element_t<K>;
  if constexpr (detail::check_inputs<T, memory_space::device, Q, K, V>())
    return detail::device_attention<T, T>(input_view(queries), input_view(keys), input_view(values), mask, scale,
                                          nullptr, nullptr);
  else
    return {};
}

// The same over fp8 codes (a DynamicCache<F8, CudaStorage<F8>>'s views, or DeviceTensors of codes),
// with the scales the codes were made with (kvc::Fp8Scales: per tensor or per KV head; checked as
// attend_fp8 checks them). Queries in the model's type T, all three in device memory.
template <class Q, class K, class V>
  requires is_float8_v<detail::input_element_or_t<K, void>>
DeviceTensor<detail::input_element_or_t<Q>> scaled_dot_product_attention(const Q& queries, const K& keys,
                                                                         const V& values, const AttentionMask& mask,
                                                                         const Fp8Scales& scales,
                                                                         std::optional<double> scale = std::nullopt) {
  using T = detail::input_element_or_t<Q>;
  using F8 = input_element_t<K>;
  constexpr bool accepted = detail::input_of<Q, T, memory_space::device> && !is_float8_v<T> &&
                            detail::input_of<K, F8, memory_space::device> &&
                            detail::input_of<V, F8, memory_space::device>;
  if constexpr (detail::require_inputs<accepted, Q, K, V>()) {
    const DeviceTensorView<F8> k = input_view(keys), v = input_view(values);
    detail::check_fp8_scales(scales.keys, k.extent(1), "key");
    detail::check_fp8_scales(scales.values, v.extent(1), "value");
    detail::check_fp8_unrotated(scales.rotation, "kvc::scaled_dot_product_attention");
    return detail::device_attention<T, F8>(input_view(queries), k, v, mask, scale, &scales.keys, &scales.values);
  } else {
    return {};
  }
}

// paged_attention (paged/paged_attention.hpp) over a PagedCache in device memory: the same step,
// checks and result, computed on the device from the pools through the requests' block tables.
// Queries, keys and values: DeviceTensors or DeviceTensorViews of T.
template <class T, class Stream, class QT, class KT, class VT>
  requires(detail::device_call<QT, KT, VT> && !is_row_code_v<T>)
DeviceTensor<T> paged_attention(const PagedCache<CudaStorage<T, Stream>>& cache, std::int64_t layer_idx,
                                const PagedAttentionStep& step, const QT& queries, const KT& keys, const VT& values,
                                std::optional<double> scale = std::nullopt) {
  if constexpr (detail::check_inputs<T, memory_space::device, QT, KT, VT>())
    return detail::device_paged_attention(cache, layer_idx, step, input_view(queries), input_view(keys),
                                          input_view(values), scale, nullptr, nullptr);
  else
    return {};
}

// The same over fp8 pools (PagedCache<CudaStorage<float8_e4m3>> or <float8_e5m2>): queries of the
// model's type, keys and values the step's codes made with `scales`.
template <class F8, class Stream, class QT, class KT, class VT>
  requires is_float8_v<F8> && detail::device_call<QT, KT, VT>
DeviceTensor<input_element_t<QT>> paged_attention(const PagedCache<CudaStorage<F8, Stream>>& cache,
                                                  std::int64_t layer_idx, const PagedAttentionStep& step,
                                                  const QT& queries, const KT& keys, const VT& values,
                                                  const Fp8Scales& scales, std::optional<double> scale = std::nullopt) {
  using T = input_element_t<QT>;
  constexpr bool accepted = detail::input_of<QT, T, memory_space::device> && !is_float8_v<T> &&
                            detail::input_of<KT, F8, memory_space::device> &&
                            detail::input_of<VT, F8, memory_space::device>;
  if constexpr (detail::require_inputs<accepted, QT, KT, VT>()) {
    detail::check_fp8_scales(scales.keys, cache.num_key_value_heads(), "key");
    detail::check_fp8_scales(scales.values, cache.num_key_value_heads(), "value");
    detail::check_fp8_unrotated(scales.rotation, "kvc::paged_attention");
    return detail::device_paged_attention(cache, layer_idx, step, input_view(queries), input_view(keys),
                                          input_view(values), scale, &scales.keys, &scales.values);
  } else {
    return {};
  }
}

// The same over a pool of row codes in device memory (`PagedCache<CudaStorage<kvc::int4_row>>`,
// int8_row, int2_row, fp8_row<F8>, kvc::kv_codes pairs; not kvc::rotated ones, which stay on the
// host): queries of the model's type (float, __half or __nv_bfloat16); keys and values the step's
// rows of codes, [1, Hkv, T, cache.row_width()] and [..., cache.value_row_width()], as
// kvc::to_row_codes made them (copied with kvc::to_device). Each value is read from its row's codes
// and scales as the kernel reaches it; nothing is widened into a workspace. Returns
// [1, Hq, T, head_dim] in the queries' type.
template <class C, class Stream, class QT, class KT, class VT>
  requires(is_row_code_v<C> && detail::device_call<QT, KT, VT>)
DeviceTensor<detail::input_element_or_t<QT>> paged_attention(const PagedCache<CudaStorage<C, Stream>>& cache,
                                                             std::int64_t layer_idx, const PagedAttentionStep& step,
                                                             const QT& queries, const KT& keys, const VT& values,
                                                             std::optional<double> scale = std::nullopt) {
  static_assert(!detail::takes_scale_lists<C>,
                "kvc::paged_attention: an NVFP4 pool needs its tensor scales: pass kvc::Nvfp4TensorScales");
  if constexpr (!detail::takes_scale_lists<C>) {  // (nested: one misuse, one error)
    using T = detail::input_element_or_t<QT>;
    if constexpr (detail::check_paged_inputs<CudaStorage<C, Stream>, T, QT, KT, VT>())
      return detail::device_paged_attention(cache, layer_idx, step, input_view(queries), input_view(keys),
                                            input_view(values), scale, nullptr, nullptr);
  }
  return {};
}

// The same over a pool with an NVFP4 side (`PagedCache<CudaStorage<kvc::nvfp4_row>>`, or a
// kv_codes pair with one), with the tensor scales its rows were made with (a side that keeps its
// scales in its rows takes 1: ValueError otherwise, as on the host).
template <class C, class Stream, class QT, class KT, class VT>
  requires(is_row_code_v<C> && detail::device_call<QT, KT, VT>)
DeviceTensor<detail::input_element_or_t<QT>> paged_attention(const PagedCache<CudaStorage<C, Stream>>& cache,
                                                             std::int64_t layer_idx, const PagedAttentionStep& step,
                                                             const QT& queries, const KT& keys, const VT& values,
                                                             const Nvfp4TensorScales& scales,
                                                             std::optional<double> scale = std::nullopt) {
  static_assert(detail::takes_scale_lists<C>,
                "kvc::paged_attention: row codes other than NVFP4 keep their scales in the rows: call it without "
                "scales");
  if constexpr (detail::takes_scale_lists<C>) {
    using T = detail::input_element_or_t<QT>;
    if constexpr (detail::check_paged_inputs<CudaStorage<C, Stream>, T, QT, KT, VT>()) {
      const detail::row_code_scales<C, Nvfp4TensorScales> checked(scales, cache.num_key_value_heads());
      const std::vector<float> ks{checked.key_scale(0)}, vs{checked.value_scale(0)};  // one per tensor
      return detail::device_paged_attention(cache, layer_idx, step, input_view(queries), input_view(keys),
                                            input_view(values), scale, &ks, &vs);
    }
  }
  return {};
}

}  // namespace kvc
