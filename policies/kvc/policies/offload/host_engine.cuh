#pragma once
// The engine of kvc::OffloadToHost<OnlyNonSliding> for kvc::CudaStorage<T, Stream>: layers that
// are not in use move from device memory to pinned host memory, and the next offloadable layer is
// copied back on a prefetch stream while the current one is updated (transformers'
// Cache.update with offloading=True on a GPU). Included by <kvc/cuda.hpp>; needs nvcc (CUDA
// headers).
// <kvc/policies/offload/pinned_host.hpp> declares the policy for host compilers; this file defines the
// engine as a partial specialization of detail::offload_to_host_engine. docs/offload.md
// ("OffloadToHost") describes the protocol and its costs.
//
// Two streams: the compute stream is the storage's (CudaStorage<T, Stream>::stream(), where every
// layer operation and, by contract, the caller's attention on the returned views are queued); the
// offload stream is the engine's own (non-blocking, created at the first offload, destroyed with
// the engine). Every hand-over between them is a recorded event and cudaStreamWaitEvent, never a
// host synchronisation on the hot path.
//
// The offload engine's protocol (<kvc/policies/offload/engine.hpp>, shared with OffloadToFile), as
// this tier carries it out, for `update(k, v, i)`:
//   before_update(i)  1. commit the layer p offloaded by the previous update: its device->host copy
//                        was queued at after_update(p); now the offload stream waits for the
//                        compute stream (which still reads p through the views update(p)
//                        returned, until this call), and p's device buffers go to a small pool
//                        of device buffers (not cudaFree, which would synchronise the device);
//                     2. make layer i resident: take the prefetched buffers (the compute stream
//                        waits on the prefetch's event: wait_stream), or copy it back now;
//                     3. prefetch offload::prefetch_target(i + 1): buffers from the pool (else
//                        cudaMalloc), host->device copies on the offload stream, an event.
//   after_update(i)   if offload::should_offload(i): an event on the compute stream after the
//                     update, the offload stream waits on it and copies layer i to its pinned host
//                     block. Layer i stays resident (its views stay valid) until the next call.
//   before_access(i)  (crop, reorder_cache, batch ops, reset, stored, ...) make layer i, or every
//                     layer for -1, resident; the compute stream waits for the copies.
//
// Errors: every CUDA call goes through detail::cuda_check (kvc::RuntimeError naming the
// operation). before_update changes the cache only after everything that can fail has succeeded
// (strong guarantee: on an error the layer stays where it was and the cache is unchanged); a failed
// prefetch is dropped (the layer is copied back when it is needed, which reports the error);
// after_update is noexcept and on an error simply does not offload (always correct).
//
// Memory: device memory holds the layer in use, the pending one (offloaded by the previous call,
// until the next), the prefetched one, the layers never offloaded (linear; sliding ones with
// OnlyNonSliding) and a pool of at most two layers' worth of freed buffers, reused by prefetches of
// the same sizes so that a decode step does no cudaMalloc/cudaFree. Pinned host memory holds one
// block per offloaded layer (kept and reused while the layer is resident again; it grows with the
// layer).

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <cuda_runtime.h>

#include <kvc/detail/cuda_runtime.cuh>
#include <kvc/errors.hpp>
#include <kvc/policies/offload/pinned_host.hpp>
#include <kvc/policies/offload/buffers.hpp>
#include <kvc/policies/offload/engine.hpp>
#include <kvc/policies/offload/selection.hpp>
#include <kvc/policies/storage/cuda.cuh>

namespace kvc {

// Counters summed over every OffloadToHost engine of the process (tests and benchmarks read them).
struct OffloadHostStats {
  std::int64_t offloads = 0;  // layers moved to pinned host memory (committed)
  std::int64_t bytes_offloaded = 0;
  std::int64_t offloads_dropped = 0;  // device->host copies queued but not committed (the layer
                                      // was updated or accessed again first)
  std::int64_t prefetches = 0;        // host->device copies started on the offload stream
  std::int64_t prefetch_hits = 0;     // layers made resident from a prefetch
  std::int64_t prefetches_dropped = 0;
  std::int64_t sync_loads = 0;  // layers copied back when needed (no prefetch of them)
  std::int64_t bytes_loaded = 0;
  std::int64_t device_allocations = 0;  // buffers cudaMalloc'ed by the engine (pool misses)
  std::int64_t pool_reuses = 0;         // buffers taken from the pool
  std::int64_t offloaded_layers = 0;    // layers in pinned host memory now
  std::int64_t offloaded_bytes = 0;     // bytes of those layers now
};

namespace detail::pinned {

// The counters of every OffloadToHost engine of the process.
inline offload_engine::counters& totals() noexcept {
  static offload_engine::counters c;
  return c;
}

// ---- RAII handles ---------------------------------------------------------------------------------

// Page-locked host memory (cudaHostAlloc), freed with cudaFreeHost. Move-only.
class host_block {
 public:
  host_block() noexcept = default;
  explicit host_block(std::size_t n) {
    if (n == 0) return;
    void* p = nullptr;
    cuda_check(cudaHostAlloc(&p, n, cudaHostAllocDefault), "cudaHostAlloc of pinned host memory in kvc::OffloadToHost");
    p_ = static_cast<std::byte*>(p);
    n_ = n;
  }
  host_block(host_block&& o) noexcept : p_(std::exchange(o.p_, nullptr)), n_(std::exchange(o.n_, 0)) {}
  host_block& operator=(host_block&& o) noexcept {
    host_block tmp(std::move(o));
    std::swap(p_, tmp.p_);
    std::swap(n_, tmp.n_);
    return *this;
  }
  host_block(const host_block&) = delete;
  host_block& operator=(const host_block&) = delete;
  ~host_block() {
    if (p_) (void)cudaFreeHost(p_);  // a destructor cannot report; the next checked call does
  }
  std::byte* data() const noexcept { return p_; }
  std::size_t size() const noexcept { return n_; }

 private:
  std::byte* p_ = nullptr;
  std::size_t n_ = 0;
};

// A non-blocking stream, created on first use, destroyed with the handle. Move-only.
class stream_handle {
 public:
  stream_handle() noexcept = default;
  stream_handle(stream_handle&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  stream_handle& operator=(stream_handle&&) = delete;
  ~stream_handle() {
    if (s_) (void)cudaStreamDestroy(s_);
  }
  cudaStream_t get() {
    if (!s_)
      cuda_check(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking),
                 "cudaStreamCreateWithFlags (the prefetch stream of kvc::OffloadToHost)");
    return s_;
  }
  cudaStream_t peek() const noexcept { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

// An event without timing, created on first use. Move-only.
class event_handle {
 public:
  event_handle() noexcept = default;
  event_handle(event_handle&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  event_handle& operator=(event_handle&&) = delete;
  ~event_handle() {
    if (e_) (void)cudaEventDestroy(e_);
  }
  // `after` waits for everything queued on `before` so far.
  void order(cudaStream_t before, cudaStream_t after, const char* what) {
    if (!e_)
      cuda_check(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming),
                 "cudaEventCreateWithFlags in kvc::OffloadToHost");
    cuda_check(cudaEventRecord(e_, before), what);
    cuda_check(cudaStreamWaitEvent(after, e_, 0), what);
  }
  void record(cudaStream_t on, const char* what) {
    if (!e_)
      cuda_check(cudaEventCreateWithFlags(&e_, cudaEventDisableTiming),
                 "cudaEventCreateWithFlags in kvc::OffloadToHost");
    cuda_check(cudaEventRecord(e_, on), what);
  }
  void wait(cudaStream_t on, const char* what) const { cuda_check(cudaStreamWaitEvent(on, e_, 0), what); }

 private:
  cudaEvent_t e_ = nullptr;
};

// ---- the tier ------------------------------------------------------------------------------------

using offload_buffers::buffer_bytes;
using offload_buffers::for_each_buffer_of;
using offload_buffers::held_base;
using offload_buffers::held_buffer;
using offload_buffers::held_layer;
using offload_buffers::type_tag;

// The pinned-host tier of the offload engine (offload/engine.hpp): one pinned block per offloaded
// layer, copies on the engine's own stream, ordered against the compute stream by events, and a
// pool of device buffers (of the types and sizes of offloaded layers) reused by prefetches.
class tier {
 public:
  struct slot {
    host_block host;  // pinned; the layer's buffers one after the other (kept while resident again)
  };
  using record = offload_engine::record<slot>;
  struct context {
    cudaStream_t compute;  // the storage's stream (CudaStorage<T, Stream>::stream())
  };
  static constexpr const char* name = "kvc::OffloadToHost";

  tier() = default;
  tier(const tier&) = delete;
  tier& operator=(const tier&) = delete;

  static offload_engine::counters& totals() noexcept { return pinned::totals(); }

  // ---- storing ------------------------------------------------------------------------------------

  // Queues the copy of layer p to its pinned block on the offload stream, after the update queued
  // on the compute stream. The layer stays resident; store() frees it at the next call.
  void begin_store(record& r, const offload_buffers::layer_pieces& pieces, context ctx) {
    const cudaStream_t s = stream_.get();
    if (r.slot.host.size() < static_cast<std::size_t>(pieces.total)) {
      host_block grown(static_cast<std::size_t>(pieces.total));
      // The old block may still be read by a copy in flight (a prefetch of this layer).
      cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize (growing a pinned block of kvc::OffloadToHost)");
      r.slot.host = std::move(grown);
    }
    ev_offload_.order(ctx.compute, s, "cudaEventRecord/cudaStreamWaitEvent (offloading a layer after its update)");
    std::size_t at = 0;
    for (const auto& [ptr, n] : pieces.pieces) {
      if (n > 0)
        cuda_check(cudaMemcpyAsync(r.slot.host.data() + at, ptr, n, cudaMemcpyDeviceToHost, s),
                   "cudaMemcpyAsync (device to pinned host, offloading a layer)");
      at += n;
    }
    max_layer_bytes_ = std::max(max_layer_bytes_, pieces.total);
  }

  // The layer leaves device memory: its buffers go to the pool once the offload stream has waited
  // for the compute stream (the caller's reads of its views come before this call).
  template <class Cache>
  void store(Cache& cache, std::int64_t p, record&, const offload_buffers::layer_pieces&, context ctx) {
    held_layer out;
    for_each_buffer_of(cache, p, [&](auto& b) {
      using B = std::remove_reference_t<decltype(b)>;
      out.push_back(b.size() > 0 ? std::make_unique<held_buffer<B>>() : nullptr);
    });
    pool_.reserve(pool_.size() + out.size());
    ev_release_.order(ctx.compute, stream_.get(), "cudaEventRecord/cudaStreamWaitEvent (releasing an offloaded layer)");
    // Committed: nothing below throws.
    std::size_t k = 0;
    for_each_buffer_of(cache, p, [&](auto& b) {
      using B = std::remove_reference_t<decltype(b)>;
      if (auto& h = out[k++]) {
        auto& held = static_cast<held_buffer<B>&>(*h);
        std::swap(held.buf, b);
        held.refresh();
        pool_.push_back(std::move(h));
      }
    });
  }

  // ---- reading back -------------------------------------------------------------------------------

  // Device buffers of the right types and sizes for offloaded layer i: from the pool, else new.
  template <class Cache>
  held_layer stage(Cache& cache, std::int64_t i, const record& r) {
    return offload_buffers::stage_layer(
        cache, i, r.sizes, [&]<class B>(std::type_identity<B>, std::int64_t n) -> std::unique_ptr<held_base> {
          const auto it = std::find_if(pool_.begin(), pool_.end(),
                                       [&](const auto& h) { return h->tag == &type_tag<B> && h->count == n; });
          if (it != pool_.end()) {
            std::unique_ptr<held_base> h = std::move(*it);
            pool_.erase(it);
            totals().pool_reuses += 1;
            return h;
          }
          totals().allocations += 1;
          return std::make_unique<held_buffer<B>>(n);
        });
  }

  // Copies layer i back now: the copies on the offload stream, the compute stream waits for them.
  void read(std::int64_t, const record& r, held_layer& staged, context ctx) {
    const cudaStream_t s = stream_.get();
    load(r, staged, s);
    ev_load_.order(s, ctx.compute, "cudaEventRecord/cudaStreamWaitEvent (the compute stream waiting for a load)");
  }

  // Starts copying a layer back on the offload stream, with an event at its end.
  bool start_read(const record& r, held_layer&& staged, context) noexcept {
    try {
      const cudaStream_t s = stream_.get();
      load(r, staged, s);
      ev_prefetch_.record(s, "cudaEventRecord (the end of a prefetch)");
    } catch (...) {
      give_back(staged);
      return false;
    }
    job_ = std::move(staged);
    totals().bytes_read += r.bytes;
    return true;
  }
  // The compute stream waits for the prefetch (no host synchronisation).
  offload_engine::read_result finish_read(context ctx) {
    ev_prefetch_.wait(ctx.compute, "cudaStreamWaitEvent (the compute stream waiting for a prefetch)");
    return offload_engine::read_result::ready;
  }
  held_layer take_read() noexcept { return std::move(job_); }
  void cancel_read() noexcept { give_back(job_); }

  // Returns held buffers to the pool (only the offload stream writes them, in stream order).
  void give_back(held_layer& held) noexcept {
    for (auto& h : held) {
      if (!h) continue;
      try {
        pool_.push_back(std::move(h));
      } catch (...) {
        h.reset();  // no room in the pool's vector: free it instead
      }
    }
    held.clear();
  }

  // Keeps the pool within two layers' worth of bytes, freeing the oldest buffers first. cudaFree
  // synchronises the device, so this only happens when layer sizes change.
  void end_of_update() noexcept {
    std::int64_t total = pool_bytes();
    const std::int64_t limit = 2 * max_layer_bytes_;
    std::size_t drop = 0;
    while (drop < pool_.size() && total > limit) total -= static_cast<std::int64_t>(pool_[drop++]->size);
    if (drop > 0) pool_.erase(pool_.begin(), pool_.begin() + static_cast<std::ptrdiff_t>(drop));
  }

  // Copies in flight read or write the pinned blocks and the held buffers: let them finish.
  void shutdown() noexcept {
    if (cudaStream_t s = stream_.peek()) (void)cudaStreamSynchronize(s);
  }

  // ---- deep copies ----------------------------------------------------------------------------------

  void prepare_copy_of(const tier& from) {
    if (cudaStream_t s = from.stream_.peek())
      cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize (copying a cache with kvc::OffloadToHost)");
    max_layer_bytes_ = from.max_layer_bytes_;
  }
  void copy_slot(const tier&, const record& src, record& dst, std::int64_t) {
    dst.slot.host = host_block(static_cast<std::size_t>(src.bytes));
    std::memcpy(dst.slot.host.data(), src.slot.host.data(), static_cast<std::size_t>(src.bytes));
  }

  // ---- observability ------------------------------------------------------------------------------

  std::int64_t pool_bytes() const noexcept {
    std::int64_t n = 0;
    for (const auto& h : pool_) n += static_cast<std::int64_t>(h->size);
    return n;
  }
  cudaStream_t offload_stream() const noexcept { return stream_.peek(); }

 private:
  // Queues the host->device copies of a layer into `staged` on stream s.
  static void load(const record& r, const held_layer& staged, cudaStream_t s) {
    std::size_t at = 0;
    for (const auto& h : staged) {
      if (!h) continue;
      cuda_check(cudaMemcpyAsync(h->bytes, r.slot.host.data() + at, h->size, cudaMemcpyHostToDevice, s),
                 "cudaMemcpyAsync (pinned host to device, bringing back an offloaded layer)");
      at += h->size;
    }
  }

  std::int64_t max_layer_bytes_ = 0;
  // Destroyed in reverse order: the pool and the job's buffers first, then the events and the
  // stream (the engine's shutdown() has waited for the stream before).
  stream_handle stream_;
  event_handle ev_offload_, ev_release_, ev_prefetch_, ev_load_;
  held_layer job_;  // the prefetched layer's buffers
  std::vector<std::unique_ptr<held_base>> pool_;
};

// The per-cache state of an OffloadToHost engine.
using core = offload_engine::core<tier>;

}  // namespace detail::pinned

// The process-wide counters of every OffloadToHost engine; reset_offload_host_stats() zeroes the
// event counters (offloaded_layers and offloaded_bytes describe the present and are kept).
inline OffloadHostStats offload_host_stats() noexcept {
  const auto& c = detail::pinned::totals();
  return {c.stores.load(),        c.bytes_stored.load(),       c.stores_dropped.load(), c.prefetches.load(),
          c.prefetch_hits.load(), c.prefetches_dropped.load(), c.sync_reads.load(),     c.bytes_read.load(),
          c.allocations.load(),   c.pool_reuses.load(),        c.away_layers.load(),    c.away_bytes.load()};
}
inline void reset_offload_host_stats() noexcept { detail::pinned::totals().reset_events(); }

// Bytes of device buffers layer `layer_idx` holds now (0 while it is offloaded).
template <class Cache>
std::int64_t layer_device_bytes(Cache& cache, std::int64_t layer_idx) {
  std::int64_t n = 0;
  detail::pinned::for_each_buffer_of(cache, layer_idx,
                                     [&](auto& b) { n += static_cast<std::int64_t>(detail::pinned::buffer_bytes(b)); });
  return n;
}

namespace detail {

// OffloadToHost's engine for device storage. Copying it (hence the Cache) copies the offloaded
// layers into new pinned blocks (after waiting for the offload stream); moving it moves the
// stream, the events and the blocks (a pointer). Its destructor waits for the offload stream, then
// frees the pinned blocks, the held device buffers, the events and the stream.
template <bool OnlyNonSliding, class T, class Stream>
struct offload_to_host_engine<OnlyNonSliding, CudaStorage<T, Stream>> {
  template <class Cache>
  void before_update(Cache& cache, std::int64_t layer_idx) {
    core_.get(OnlyNonSliding).before_update(cache, layer_idx, streams());
  }
  template <class Cache>
  void after_update(Cache& cache, std::int64_t layer_idx) noexcept {
    if (core_) core_->after_update(cache, layer_idx, streams());
  }
  template <class Cache>
  void before_access(Cache& cache, std::int64_t layer_idx) {
    if (core_) core_->before_access(cache, layer_idx, streams());
  }

  // Observability (tests, benchmarks).
  bool is_offloaded(std::int64_t layer_idx) const noexcept { return core_ && core_->is_away(layer_idx); }
  std::int64_t offloaded_layers() const noexcept { return core_ ? core_->away_layers() : 0; }
  std::int64_t pinned_bytes() const noexcept {
    std::int64_t n = 0;
    if (core_)
      for (const auto& r : core_->records()) n += static_cast<std::int64_t>(r.slot.host.size());
    return n;
  }
  std::int64_t pool_bytes() const noexcept { return core_ ? core_->tier().pool_bytes() : 0; }

 private:
  static pinned::tier::context streams() { return pinned::tier::context{CudaStorage<T, Stream>::stream()}; }
  offload_buffers::cloned_core<pinned::core> core_;
};

}  // namespace detail
}  // namespace kvc
