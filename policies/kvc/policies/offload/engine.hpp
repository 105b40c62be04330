#pragma once
// The one offload protocol of kvc: detail::offload_engine::core<Tier> decides *when* a layer
// leaves fast memory, comes back, or is prefetched; a tier decides *how* its bytes move. Two tiers
// use it: the spill file of kvc::OffloadToFile (offload/file.hpp: a descriptor, pread/pwrite,
// regions of the file, a prefetch thread) and the pinned host memory of kvc::OffloadToHost
// (offload/host_engine.cuh: pinned blocks, an offload stream, events, a pool of device buffers).
// docs/offload.md describes both.
//
// The protocol, for `update(k, v, i)` (transformers' Cache.update with offloading=True):
//   before_update(i)  1. commit the layer p offloaded by the previous update: the tier stores it
//                        (or finishes storing it) and empties its buffers. Deferred until now
//                        because the views update(p) returned point into p's buffers and stay
//                        valid until the next call on the cache;
//                     2. make layer i resident: take the prefetched copy if it is i's, else read
//                        it back now;
//                     3. prefetch offload::prefetch_target(i + 1).
//   after_update(i)   if offload::should_offload(i): i becomes the pending layer, and the tier may
//                     start copying it out (the pinned tier queues its device->host copy here).
//                     noexcept: on any error the layer simply stays resident.
//   before_access(i)  (crop, reorder_cache, batch ops, reset, stored, const queries, ...) make
//                     layer i, or every layer for -1, resident, cancelling a pending offload of it.
//
// Errors: everything that can fail in before_update/before_access happens before the cache
// changes (a failed store leaves the layer resident, a failed read leaves it offloaded); a failed
// prefetch is dropped, and the read when the layer is needed reports the error.
//
// A tier provides (Ctx is what its hooks need from the storage, e.g. the compute stream):
//   struct slot                            the tier's place for one offloaded layer
//   static constexpr const char* name      the policy, for messages ("kvc::OffloadToFile")
//   counters& totals()                     the process-wide counters of this tier (below)
//   void begin_store(record&, const layer_pieces&, Ctx)     at after_update (may do nothing)
//   void store(Cache&, i, record&, const layer_pieces&, Ctx)   write the layer, then empty its
//                                          buffers (throws before emptying anything)
//   held_layer stage(Cache&, i, const record&)   empty buffers of the layer's types and sizes
//   void read(i, const record&, held_layer&, Ctx)   fill them (synchronously, as the caller sees it)
//   bool start_read(const record&, held_layer&&, Ctx) noexcept   start a prefetch into them
//   read_result finish_read(Ctx)           wait for the prefetch; held_layer take_read()
//   void cancel_read() noexcept            drop the prefetch
//   void give_back(held_layer&) noexcept   buffers no longer needed
//   void prepare_copy_of(const Tier& from)  a deep copy starts: take from's settings, wait for
//                                          its copies in flight
//   void copy_slot(const Tier& from, const record& src, record& dst, i)   copy one layer's bytes
//   void end_of_update() noexcept; void shutdown() noexcept   (no copy in flight after shutdown)
// start_read owns the buffers it is given: when it returns false it has given them back.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <iterator>
#include <memory>
#include <utility>
#include <vector>

#include <kvc/errors.hpp>
#include <kvc/policies/offload/buffers.hpp>
#include <kvc/policies/offload/selection.hpp>

namespace kvc::detail::offload_engine {

using offload_buffers::held_layer;
using offload_buffers::layer_pieces;

// Events counted process-wide for each tier; each policy publishes them under its own names
// (OffloadFileStats, OffloadHostStats).
struct counters {
  std::atomic<std::int64_t> stores{0};          // layers moved to the tier (committed)
  std::atomic<std::int64_t> bytes_stored{0};    //
  std::atomic<std::int64_t> stores_dropped{0};  // pending offloads cancelled before their commit
  std::atomic<std::int64_t> prefetches{0};      // prefetches started
  std::atomic<std::int64_t> prefetch_hits{0};   // layers made resident from a prefetch
  std::atomic<std::int64_t> prefetch_waits{0};  // ... of which the caller had to wait for
  std::atomic<std::int64_t> prefetches_dropped{0};
  std::atomic<std::int64_t> sync_reads{0};   // layers read back when needed (no prefetch of them)
  std::atomic<std::int64_t> bytes_read{0};   // counted by the tier (at the read, or its start)
  std::atomic<std::int64_t> away_layers{0};  // layers in the tier now
  std::atomic<std::int64_t> away_bytes{0};   // bytes of those layers now
  std::atomic<std::int64_t> allocations{0};  // buffers a tier allocated to read into (pool misses)
  std::atomic<std::int64_t> pool_reuses{0};  // buffers taken from a tier's pool

  // Zeroes the event counters; away_layers and away_bytes describe the present and are kept.
  void reset_events() noexcept {
    for (auto* a : {&stores, &bytes_stored, &stores_dropped, &prefetches, &prefetch_hits, &prefetch_waits,
                    &prefetches_dropped, &sync_reads, &bytes_read, &allocations, &pool_reuses})
      a->store(0);
  }
};

// What the engine knows of one layer.
template <class Slot>
struct record {
  bool away = false;                // its bytes are in the tier and its buffers are empty
  std::int64_t bytes = 0;           // of its buffers, one after the other
  std::vector<std::int64_t> sizes;  // bytes of each buffer, in for_each_buffer order
  Slot slot;                        // where the tier keeps it
};

enum class read_result { failed, ready, waited };

template <class Tier>
class core {
 public:
  using record_type = record<typename Tier::slot>;

  explicit core(bool only_non_sliding) : only_non_sliding_(only_non_sliding) {}
  core(const core&) = delete;
  core& operator=(const core&) = delete;
  ~core() {
    if (job_layer_ >= 0) tier_.cancel_read();
    tier_.shutdown();  // no copy in flight from here on
    auto& t = tier_.totals();
    for (const record_type& r : records_)
      if (r.away) {
        t.away_layers -= 1;
        t.away_bytes -= r.bytes;
      }
  }

  // A deep copy: the offloaded layers' bytes are copied into the copy's own tier. The copy has no
  // pending offload (that layer is resident, so the Cache copies it) and no prefetch.
  std::unique_ptr<core> clone() const {
    auto out = std::make_unique<core>(only_non_sliding_);
    out->tier_.prepare_copy_of(tier_);
    out->flags_ = flags_;
    out->records_.resize(records_.size());
    for (std::size_t i = 0; i < records_.size(); ++i) {
      const record_type& src = records_[i];
      if (!src.away) continue;
      record_type& dst = out->records_[i];
      out->tier_.copy_slot(tier_, src, dst, static_cast<std::int64_t>(i));
      dst.sizes = src.sizes;
      dst.bytes = src.bytes;
      dst.away = true;  // counted one by one, so that a failed copy uncounts only those
      out->tier_.totals().away_layers += 1;
      out->tier_.totals().away_bytes += src.bytes;
    }
    return out;
  }

  // ---- the hooks --------------------------------------------------------------------------------

  template <class Cache, class Ctx>
  void before_update(Cache& cache, std::int64_t idx, Ctx ctx) {
    refresh_flags(cache);
    const std::int64_t target = offload::prefetch_target(idx + 1, flags_, only_non_sliding_);
    if (pending_ == idx)
      drop_pending();  // updated again before anything else: it just stays resident
    else
      commit_pending(cache, ctx);
    make_resident(cache, idx, ctx);
    if (target != idx) start_prefetch(cache, target, ctx);
    tier_.end_of_update();
  }

  template <class Cache, class Ctx>
  void after_update(Cache& cache, std::int64_t idx, Ctx ctx) noexcept {
    try {
      refresh_flags(cache);
      if (offload::should_offload(idx, flags_, only_non_sliding_)) begin_offload(cache, idx, ctx);
    } catch (...) {
      pending_ = -1;  // not offloading is always correct: the layer stays resident
    }
  }

  template <class Cache, class Ctx>
  void before_access(Cache& cache, std::int64_t idx, Ctx ctx) {
    if (idx < 0) {
      drop_pending();  // every layer ends up resident, the pending one included
      const std::int64_t n = std::min<std::int64_t>(std::ssize(records_), cache.size());
      for (std::int64_t i = 0; i < n; ++i) make_resident(cache, i, ctx);
      drop_prefetch();
      return;
    }
    if (pending_ == idx) drop_pending();
    make_resident(cache, idx, ctx);
  }

  // ---- observability ----------------------------------------------------------------------------

  bool is_away(std::int64_t i) const noexcept {
    return i >= 0 && i < std::ssize(records_) && records_[static_cast<std::size_t>(i)].away;
  }
  std::int64_t away_layers() const noexcept {
    return std::count_if(records_.begin(), records_.end(), [](const record_type& r) { return r.away; });
  }
  std::int64_t away_bytes() const noexcept {
    std::int64_t n = 0;
    for (const record_type& r : records_) n += r.away ? r.bytes : 0;
    return n;
  }
  std::int64_t pending() const noexcept { return pending_; }
  std::int64_t prefetching() const noexcept { return job_layer_; }
  const std::vector<record_type>& records() const noexcept { return records_; }
  const Tier& tier() const noexcept { return tier_; }

 private:
  template <class Cache>
  void refresh_flags(Cache& cache) {
    if (flags_.size() == cache.size() && std::ssize(records_) >= cache.size()) return;
    offload::layer_flags f{cache.is_linear(), cache.is_sliding()};
    if (std::ssize(records_) < cache.size()) records_.resize(static_cast<std::size_t>(cache.size()));
    flags_ = std::move(f);
  }

  void drop_pending() noexcept {
    if (std::exchange(pending_, -1) >= 0) tier_.totals().stores_dropped += 1;
  }

  // ---- storing ------------------------------------------------------------------------------------

  template <class Cache, class Ctx>
  void begin_offload(Cache& cache, std::int64_t p, Ctx ctx) {
    pending_ = -1;
    if (p < 0 || p >= std::ssize(records_)) return;
    record_type& r = records_[static_cast<std::size_t>(p)];
    if (r.away) return;
    layer_pieces pieces = offload_buffers::pieces_of(cache, p);
    if (pieces.total == 0) return;  // nothing to move (an uninitialized layer, or no buffers at all)
    tier_.begin_store(r, pieces, ctx);
    r.sizes = std::move(pieces.sizes);
    r.bytes = pieces.total;
    pending_ = p;
  }

  // The previous update's layer leaves fast memory. On an error it stays resident.
  template <class Cache, class Ctx>
  void commit_pending(Cache& cache, Ctx ctx) {
    const std::int64_t p = std::exchange(pending_, -1);
    if (p < 0 || p >= cache.size() || p >= std::ssize(records_)) return;
    record_type& r = records_[static_cast<std::size_t>(p)];
    if (r.away) return;
    const layer_pieces pieces = offload_buffers::pieces_of(cache, p);
    if (pieces.total == 0 || pieces.sizes != r.sizes) {  // not the buffers begin_store saw
      tier_.totals().stores_dropped += 1;
      return;
    }
    tier_.store(cache, p, r, pieces, ctx);
    // Committed: the layer's buffers are empty.
    r.away = true;
    auto& t = tier_.totals();
    t.stores += 1;
    t.bytes_stored += r.bytes;
    t.away_layers += 1;
    t.away_bytes += r.bytes;
  }

  // ---- reading back -----------------------------------------------------------------------------

  template <class Cache>
  bool install(Cache& cache, std::int64_t i, held_layer& staged) {
    if (!offload_buffers::install_held(cache, i, staged)) return false;
    record_type& r = records_[static_cast<std::size_t>(i)];
    r.away = false;
    tier_.totals().away_layers -= 1;
    tier_.totals().away_bytes -= r.bytes;
    return true;
  }

  template <class Cache, class Ctx>
  void make_resident(Cache& cache, std::int64_t i, Ctx ctx) {
    if (!is_away(i)) return;
    auto& t = tier_.totals();
    if (job_layer_ == i) {
      job_layer_ = -1;
      read_result got = read_result::failed;
      try {
        got = tier_.finish_read(ctx);
      } catch (...) {
        tier_.cancel_read();
        t.prefetches_dropped += 1;
        throw;
      }
      held_layer staged = tier_.take_read();
      if (got != read_result::failed && install(cache, i, staged)) {
        t.prefetch_hits += 1;
        if (got == read_result::waited) t.prefetch_waits += 1;
        return;
      }
      tier_.give_back(staged);
      t.prefetches_dropped += 1;  // read it synchronously instead, which reports the error
    }
    const record_type& r = records_[static_cast<std::size_t>(i)];
    held_layer staged = tier_.stage(cache, i, r);
    try {
      tier_.read(i, r, staged, ctx);
    } catch (...) {
      tier_.give_back(staged);
      throw;
    }
    const std::int64_t bytes = r.bytes;
    if (!install(cache, i, staged)) {
      tier_.give_back(staged);
      throw RuntimeError(std::string(Tier::name) +
                         ": internal error: a layer's buffers changed while it was offloaded");
    }
    t.sync_reads += 1;
    t.bytes_read += bytes;
  }

  // ---- prefetching ------------------------------------------------------------------------------

  // Never throws: a prefetch is only an optimisation.
  template <class Cache, class Ctx>
  void start_prefetch(Cache& cache, std::int64_t target, Ctx ctx) noexcept {
    if (!is_away(target) || job_layer_ == target) return;
    drop_prefetch();  // at most one layer staged at a time
    try {
      const record_type& r = records_[static_cast<std::size_t>(target)];
      if (!tier_.start_read(r, tier_.stage(cache, target, r), ctx)) {
        tier_.totals().prefetches_dropped += 1;
        return;
      }
      job_layer_ = target;
      tier_.totals().prefetches += 1;
    } catch (...) {
      tier_.totals().prefetches_dropped += 1;
    }
  }

  void drop_prefetch() noexcept {
    if (job_layer_ < 0) return;
    tier_.cancel_read();
    job_layer_ = -1;
    tier_.totals().prefetches_dropped += 1;
  }

  bool only_non_sliding_;
  offload::layer_flags flags_;
  Tier tier_;  // declared before records_, so the slots are destroyed while the tier still exists
  std::vector<record_type> records_;
  std::int64_t pending_ = -1;    // offloaded by the last update, committed at the next call
  std::int64_t job_layer_ = -1;  // the layer being prefetched
};

}  // namespace kvc::detail::offload_engine
