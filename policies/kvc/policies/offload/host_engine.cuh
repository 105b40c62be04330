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
// The protocol, for `update(k, v, i)`:
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

struct counters {
  std::atomic<std::int64_t> offloads{0}, bytes_offloaded{0}, offloads_dropped{0}, prefetches{0}, prefetch_hits{0},
      prefetches_dropped{0}, sync_loads{0}, bytes_loaded{0}, device_allocations{0}, pool_reuses{0}, offloaded_layers{0},
      offloaded_bytes{0};
};
inline counters& totals() {
  static counters c;
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

// ---- type-erased device buffers ------------------------------------------------------------------

// A device buffer of a layer's buffer type B, held by the engine (pool, prefetch): the tag checks
// that it goes back to a buffer of the same type, `count` that it has the same length
// (offload/buffers.hpp, shared with OffloadToFile).
using offload_buffers::buffer_bytes;
using offload_buffers::for_each_buffer_of;
using offload_buffers::has_buffers;
using offload_buffers::held_base;
using offload_buffers::held_buffer;
using offload_buffers::held_layer;
using offload_buffers::type_tag;

// ---- the per-cache state ---------------------------------------------------------------------------

class core {
 public:
  explicit core(bool only_non_sliding) : only_non_sliding_(only_non_sliding) {}
  core(const core&) = delete;
  core& operator=(const core&) = delete;
  ~core() {
    // Copies in flight read or write the pinned blocks and the held buffers: let them finish.
    if (cudaStream_t s = stream_.peek()) (void)cudaStreamSynchronize(s);
    auto& t = totals();
    for (const record& r : records_)
      if (r.offloaded) {
        t.offloaded_layers -= 1;
        t.offloaded_bytes -= r.bytes;
      }
    job_.clear();
    pool_.clear();
    records_.clear();
  }

  // A deep copy: offloaded layers' bytes are copied into new pinned blocks. The copy has no
  // pending offload (that layer is resident, and so copied by the Cache) and no prefetch.
  std::unique_ptr<core> clone() const {
    if (cudaStream_t s = stream_.peek())
      cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize (copying a cache with kvc::OffloadToHost)");
    auto out = std::make_unique<core>(only_non_sliding_);
    out->flags_ = flags_;
    out->max_layer_bytes_ = max_layer_bytes_;
    out->records_.resize(records_.size());
    for (std::size_t i = 0; i < records_.size(); ++i) {
      const record& src = records_[i];
      record& dst = out->records_[i];
      if (!src.offloaded) continue;
      dst.host = host_block(static_cast<std::size_t>(src.bytes));
      std::memcpy(dst.host.data(), src.host.data(), static_cast<std::size_t>(src.bytes));
      dst.sizes = src.sizes;
      dst.bytes = src.bytes;
    }
    // Committed only now, so that a failure above leaves the counters right.
    for (record& r : out->records_)
      if (r.bytes > 0 && r.host.size() > 0) {
        r.offloaded = true;
        totals().offloaded_layers += 1;
        totals().offloaded_bytes += r.bytes;
      }
    return out;
  }

  // ---- the hooks ----------------------------------------------------------------------------

  template <class Cache>
  void before_update(Cache& cache, std::int64_t idx, cudaStream_t compute) {
    refresh_flags(cache);
    const std::int64_t target = offload::prefetch_target(idx + 1, flags_, only_non_sliding_);
    if (pending_ == idx) {
      pending_ = -1;  // updated again before anything else: it just stays resident
      totals().offloads_dropped += 1;
    } else {
      commit_pending(cache, compute);
    }
    make_resident(cache, idx, compute);
    if (target != idx) start_prefetch(cache, target);
    trim_pool();
  }

  template <class Cache>
  void after_update(Cache& cache, std::int64_t idx, cudaStream_t compute) noexcept {
    try {
      refresh_flags(cache);
      if (offload::should_offload(idx, flags_, only_non_sliding_)) start_offload(cache, idx, compute);
    } catch (...) {
      pending_ = -1;  // not offloading is always correct: the layer stays resident
    }
  }

  template <class Cache>
  void before_access(Cache& cache, std::int64_t idx, cudaStream_t compute) {
    if (idx < 0) {
      drop_pending();  // every layer ends up resident, the pending one included
      const std::int64_t n = std::min<std::int64_t>(std::ssize(records_), cache.size());
      for (std::int64_t i = 0; i < n; ++i) make_resident(cache, i, compute);
      drop_prefetch();
      return;
    }
    if (pending_ == idx) drop_pending();
    make_resident(cache, idx, compute);
  }

  // ---- observability --------------------------------------------------------------------------

  bool is_offloaded(std::int64_t i) const noexcept {
    return i >= 0 && i < std::ssize(records_) && records_[static_cast<std::size_t>(i)].offloaded;
  }
  std::int64_t offloaded_layers() const noexcept {
    return std::count_if(records_.begin(), records_.end(), [](const record& r) { return r.offloaded; });
  }
  std::int64_t pending() const noexcept { return pending_; }
  std::int64_t prefetching() const noexcept { return job_layer_; }
  std::int64_t pinned_bytes() const noexcept {
    std::int64_t n = 0;
    for (const record& r : records_) n += static_cast<std::int64_t>(r.host.size());
    return n;
  }
  std::int64_t pool_bytes() const noexcept {
    std::int64_t n = 0;
    for (const auto& h : pool_) n += static_cast<std::int64_t>(h->size);
    return n;
  }
  cudaStream_t offload_stream() const noexcept { return stream_.peek(); }

 private:
  struct record {
    bool offloaded = false;
    host_block host;                  // pinned; the layer's buffers one after the other
    std::int64_t bytes = 0;           // of the layer's buffers
    std::vector<std::int64_t> sizes;  // bytes of each buffer, in for_each_buffer order
  };

  template <class Cache>
  void refresh_flags(Cache& cache) {
    if (flags_.size() == cache.size() && std::ssize(records_) >= cache.size()) return;
    offload::layer_flags f{cache.is_linear(), cache.is_sliding()};
    if (std::ssize(records_) < cache.size()) records_.resize(static_cast<std::size_t>(cache.size()));
    flags_ = std::move(f);
  }

  void drop_pending() noexcept {
    if (std::exchange(pending_, -1) >= 0) totals().offloads_dropped += 1;
  }

  // ---- offloading -------------------------------------------------------------------------------

  // Queues the copy of layer p to its pinned block on the offload stream, after the update queued
  // on the compute stream. The layer stays resident; commit_pending frees it at the next call.
  template <class Cache>
  void start_offload(Cache& cache, std::int64_t p, cudaStream_t compute) {
    pending_ = -1;
    if (p < 0 || p >= std::ssize(records_)) return;
    record& r = records_[static_cast<std::size_t>(p)];
    if (r.offloaded) return;
    auto [pieces, sizes, total] = offload_buffers::pieces_of(cache, p);
    if (total == 0) return;  // nothing to move (an uninitialized layer, or no buffers at all)
    const cudaStream_t s = stream_.get();
    if (r.host.size() < static_cast<std::size_t>(total)) {
      host_block grown(static_cast<std::size_t>(total));
      // The old block may still be read by a copy in flight (a prefetch of this layer).
      cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize (growing a pinned block of kvc::OffloadToHost)");
      r.host = std::move(grown);
    }
    ev_offload_.order(compute, s, "cudaEventRecord/cudaStreamWaitEvent (offloading a layer after its update)");
    std::size_t at = 0;
    for (const auto& [ptr, n] : pieces) {
      if (n > 0)
        cuda_check(cudaMemcpyAsync(r.host.data() + at, ptr, n, cudaMemcpyDeviceToHost, s),
                   "cudaMemcpyAsync (device to pinned host, offloading a layer)");
      at += n;
    }
    r.sizes = std::move(sizes);
    r.bytes = total;
    max_layer_bytes_ = std::max(max_layer_bytes_, total);
    pending_ = p;
  }

  // The previous update's layer leaves device memory: its buffers go to the pool once the offload
  // stream has waited for the compute stream (the caller's reads of its views come before this call).
  template <class Cache>
  void commit_pending(Cache& cache, cudaStream_t compute) {
    const std::int64_t p = std::exchange(pending_, -1);
    if (p < 0 || p >= cache.size() || p >= std::ssize(records_)) return;
    record& r = records_[static_cast<std::size_t>(p)];
    if (r.offloaded) return;
    // The buffers must still be those that were copied.
    held_layer out;
    std::size_t k = 0;
    bool same = true;
    for_each_buffer_of(cache, p, [&](auto& b) {
      using B = std::remove_reference_t<decltype(b)>;
      if (k >= r.sizes.size() || static_cast<std::int64_t>(buffer_bytes(b)) != r.sizes[k]) same = false;
      ++k;
      out.push_back(b.size() > 0 ? std::make_unique<held_buffer<B>>() : nullptr);
    });
    if (!same || k != r.sizes.size()) {
      totals().offloads_dropped += 1;
      return;
    }
    pool_.reserve(pool_.size() + out.size());
    ev_release_.order(compute, stream_.get(), "cudaEventRecord/cudaStreamWaitEvent (releasing an offloaded layer)");
    // Committed: nothing below throws.
    k = 0;
    for_each_buffer_of(cache, p, [&](auto& b) {
      using B = std::remove_reference_t<decltype(b)>;
      if (auto& h = out[k++]) {
        auto& held = static_cast<held_buffer<B>&>(*h);
        std::swap(held.buf, b);
        held.refresh();
        pool_.push_back(std::move(h));
      }
    });
    r.offloaded = true;
    auto& t = totals();
    t.offloads += 1;
    t.bytes_offloaded += r.bytes;
    t.offloaded_layers += 1;
    t.offloaded_bytes += r.bytes;
  }

  // ---- loading ------------------------------------------------------------------------------------

  // Device buffers of the right types and sizes for offloaded layer i: from the pool, else new.
  template <class Cache>
  held_layer stage(Cache& cache, std::int64_t i) {
    const record& r = records_[static_cast<std::size_t>(i)];
    held_layer out;
    out.reserve(r.sizes.size());
    std::size_t k = 0;
    for_each_buffer_of(cache, i, [&](auto& b) {
      using B = std::remove_reference_t<decltype(b)>;
      const std::int64_t bytes = k < r.sizes.size() ? r.sizes[k] : 0;
      ++k;
      if (bytes == 0) {
        out.emplace_back();
        return;
      }
      const std::int64_t n = bytes / static_cast<std::int64_t>(sizeof(*b.data()));
      const auto it = std::find_if(pool_.begin(), pool_.end(),
                                   [&](const auto& h) { return h->tag == &type_tag<B> && h->count == n; });
      if (it != pool_.end()) {
        out.push_back(std::move(*it));
        pool_.erase(it);
        totals().pool_reuses += 1;
      } else {
        out.push_back(std::make_unique<held_buffer<B>>(n));
        totals().device_allocations += 1;
      }
    });
    return out;
  }

  // Queues the host->device copies of layer i into `staged` on the offload stream.
  void load(std::int64_t i, const held_layer& staged, cudaStream_t s) {
    const record& r = records_[static_cast<std::size_t>(i)];
    std::size_t at = 0;
    for (const auto& h : staged) {
      if (!h) continue;
      cuda_check(cudaMemcpyAsync(h->bytes, r.host.data() + at, h->size, cudaMemcpyHostToDevice, s),
                 "cudaMemcpyAsync (pinned host to device, bringing back an offloaded layer)");
      at += h->size;
    }
  }

  // Moves staged buffers into layer i's (empty) buffers. False if they do not fit the layer.
  template <class Cache>
  bool install(Cache& cache, std::int64_t i, held_layer& staged) {
    if (!offload_buffers::install_held(cache, i, staged)) return false;
    record& r = records_[static_cast<std::size_t>(i)];
    r.offloaded = false;
    auto& t = totals();
    t.offloaded_layers -= 1;
    t.offloaded_bytes -= r.bytes;
    return true;
  }

  template <class Cache>
  void make_resident(Cache& cache, std::int64_t i, cudaStream_t compute) {
    if (!is_offloaded(i)) return;
    if (job_layer_ == i) {
      ev_prefetch_.wait(compute, "cudaStreamWaitEvent (the compute stream waiting for a prefetch)");
      if (install(cache, i, job_)) {
        job_layer_ = -1;
        job_.clear();
        totals().prefetch_hits += 1;
        return;
      }
      drop_prefetch();  // cannot happen; fall back to a synchronous load
    }
    const cudaStream_t s = stream_.get();
    held_layer staged = stage(cache, i);
    try {
      load(i, staged, s);
      ev_load_.order(s, compute, "cudaEventRecord/cudaStreamWaitEvent (the compute stream waiting for a load)");
    } catch (...) {
      give_back(staged);
      throw;
    }
    const std::int64_t bytes = records_[static_cast<std::size_t>(i)].bytes;
    if (!install(cache, i, staged))
      throw RuntimeError("kvc::OffloadToHost: internal error: a layer's buffers changed while it was offloaded");
    totals().sync_loads += 1;
    totals().bytes_loaded += bytes;
  }

  // ---- prefetching --------------------------------------------------------------------------------

  // Starts copying layer `target` back on the offload stream. Never throws: a prefetch is only an
  // optimisation, and the layer is loaded (reporting the error) when it is needed.
  template <class Cache>
  void start_prefetch(Cache& cache, std::int64_t target) noexcept {
    if (!is_offloaded(target) || job_layer_ == target) return;
    drop_prefetch();  // at most one layer staged at a time
    try {
      const cudaStream_t s = stream_.get();
      held_layer staged = stage(cache, target);
      try {
        load(target, staged, s);
        ev_prefetch_.record(s, "cudaEventRecord (the end of a prefetch)");
      } catch (...) {
        give_back(staged);
        throw;
      }
      job_ = std::move(staged);
      job_layer_ = target;
      totals().prefetches += 1;
      totals().bytes_loaded += records_[static_cast<std::size_t>(target)].bytes;
    } catch (...) {
      totals().prefetches_dropped += 1;
    }
  }

  void drop_prefetch() noexcept {
    if (job_layer_ < 0) return;
    give_back(job_);
    job_layer_ = -1;
    totals().prefetches_dropped += 1;
  }

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
  void trim_pool() noexcept {
    std::int64_t total = pool_bytes();
    const std::int64_t limit = 2 * max_layer_bytes_;
    std::size_t drop = 0;
    while (drop < pool_.size() && total > limit) total -= static_cast<std::int64_t>(pool_[drop++]->size);
    if (drop > 0) pool_.erase(pool_.begin(), pool_.begin() + static_cast<std::ptrdiff_t>(drop));
  }

  bool only_non_sliding_;
  offload::layer_flags flags_;
  std::vector<record> records_;
  std::int64_t pending_ = -1;  // offloaded by the last update, freed at the next call
  std::int64_t max_layer_bytes_ = 0;

  // The destructor synchronises the stream, then frees the blocks and buffers explicitly.
  stream_handle stream_;
  event_handle ev_offload_, ev_release_, ev_prefetch_, ev_load_;

  std::int64_t job_layer_ = -1;  // the layer being prefetched into job_
  held_layer job_;
  std::vector<std::unique_ptr<held_base>> pool_;
};

}  // namespace detail::pinned

// The process-wide counters of every OffloadToHost engine; reset_offload_host_stats() zeroes the
// event counters (offloaded_layers and offloaded_bytes describe the present and are kept).
inline OffloadHostStats offload_host_stats() noexcept {
  const auto& c = detail::pinned::totals();
  return {c.offloads.load(),    c.bytes_offloaded.load(),  c.offloads_dropped.load(),
          c.prefetches.load(),  c.prefetch_hits.load(),    c.prefetches_dropped.load(),
          c.sync_loads.load(),  c.bytes_loaded.load(),     c.device_allocations.load(),
          c.pool_reuses.load(), c.offloaded_layers.load(), c.offloaded_bytes.load()};
}
inline void reset_offload_host_stats() noexcept {
  auto& c = detail::pinned::totals();
  for (auto* a : {&c.offloads, &c.bytes_offloaded, &c.offloads_dropped, &c.prefetches, &c.prefetch_hits,
                  &c.prefetches_dropped, &c.sync_loads, &c.bytes_loaded, &c.device_allocations, &c.pool_reuses})
    a->store(0);
}

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
    core_.get(OnlyNonSliding).before_update(cache, layer_idx, CudaStorage<T, Stream>::stream());
  }
  template <class Cache>
  void after_update(Cache& cache, std::int64_t layer_idx) noexcept {
    if (core_) core_->after_update(cache, layer_idx, CudaStorage<T, Stream>::stream());
  }
  template <class Cache>
  void before_access(Cache& cache, std::int64_t layer_idx) {
    if (core_) core_->before_access(cache, layer_idx, CudaStorage<T, Stream>::stream());
  }

  // Observability (tests, benchmarks).
  bool is_offloaded(std::int64_t layer_idx) const noexcept { return core_ && core_->is_offloaded(layer_idx); }
  std::int64_t offloaded_layers() const noexcept { return core_ ? core_->offloaded_layers() : 0; }
  std::int64_t pinned_bytes() const noexcept { return core_ ? core_->pinned_bytes() : 0; }
  std::int64_t pool_bytes() const noexcept { return core_ ? core_->pool_bytes() : 0; }

 private:
  offload_buffers::cloned_core<pinned::core> core_;
};

}  // namespace detail
}  // namespace kvc
