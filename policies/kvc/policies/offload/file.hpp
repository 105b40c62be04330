#pragma once
// kvc::OffloadToFile<OnlyNonSliding>: host layers that are not in use live in a spill file, and a
// background thread reads the next one back while the current one is updated (transformers'
// Cache.update with offloading=True, with a file as the slow tier instead of CPU memory).
// docs/offload.md describes the protocol, the error behaviour and the measured cost.
//
// When layers move is the offload engine's protocol (<kvc/policies/offload/engine.hpp>, shared with
// OffloadToHost); this file is its spill-file tier, how the bytes move: the layer offloaded by an
// update is written to the file at the start of the next call (before_update), its buffers freed,
// and read back by pread, on the prefetch thread for the layer prefetch_target names.
//
// Why the write is deferred: the views `update` returns point into the layer's buffers and must
// stay valid while attention reads them, and after_update must not throw (the layer has already
// changed). Writing at the start of the next call keeps the strong guarantee: an I/O error throws
// kvc::RuntimeError before that call changes anything; the layer simply stays in memory.
//
// Why pread/pwrite and not mmap: a memory-mapped spill file reports a full disk as SIGBUS on some
// later store, not as an error code, and its pages would still count as the process's memory until
// msync/munmap. pread/pwrite return errno at the call that failed, which becomes an exception.
//
// Threads: the prefetch thread only ever writes into buffers the engine owns (staged copies of the
// layer being prefetched); the layers themselves are changed on the caller's thread, inside the
// hooks. So moving or assigning a Cache while a prefetch is in flight is safe, and the engine's
// destructor joins the thread.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <unistd.h>

#include <kvc/errors.hpp>
#include <kvc/policies/offload/buffers.hpp>
#include <kvc/policies/offload/engine.hpp>
#include <kvc/policies/offload/selection.hpp>
#include <kvc/tensor.hpp>

namespace kvc {

// Where and how OffloadToFile engines create their spill files. Read when an engine opens its file
// (at its first offload), so a change affects engines that have not written anything yet.
struct OffloadFileOptions {
  std::string directory;         // empty: $KVC_OFFLOAD_DIR, else $TMPDIR, else /tmp
  bool drop_page_cache = false;  // after each spill: write the pages back and drop them from the
                                 // page cache, so that reads come from the device, not from RAM
};

// Counters summed over every OffloadToFile engine of the process (tests and benchmarks read them).
struct OffloadFileStats {
  std::int64_t spills = 0;  // layers written to a spill file
  // Bytes written to spill files.
  std::int64_t bytes_written = 0;
  std::int64_t sync_reads = 0;      // layers read back on the caller's thread (no prefetch ready)
  std::int64_t prefetches = 0;      // reads started on the prefetch thread
  std::int64_t prefetch_hits = 0;   // layers made resident from a prefetch
  std::int64_t prefetch_waits = 0;  // ... of which the caller had to wait for the thread
  // Prefetches cancelled, refused or failed (their layers were read back when needed instead).
  std::int64_t prefetches_dropped = 0;
  // Bytes read back from spill files.
  std::int64_t bytes_read = 0;
  std::int64_t spilled_layers = 0;  // layers in spill files now
  std::int64_t spilled_bytes = 0;   // bytes of those layers now
};

namespace detail::spill {

inline std::mutex& options_mutex() {
  static std::mutex m;
  return m;
}
inline OffloadFileOptions& options_storage() {
  static OffloadFileOptions o;
  return o;
}

// The counters of every OffloadToFile engine of the process.
inline offload_engine::counters& totals() noexcept {
  static offload_engine::counters c;
  return c;
}

// strerror_r comes in a GNU flavour (returns the text) and an XSI one (returns a status).
inline std::string strerror_text(char* text, char*) { return text; }
inline std::string strerror_text(int status, char* buf) {
  return status == 0 ? std::string(buf) : std::string("unknown error");
}
inline std::string error_text(int err) {
  if (err < 0) return "unexpected end of file";
  char buf[256] = {};
  return strerror_text(strerror_r(err, buf, sizeof buf), buf);
}

// Whether writing up to byte `end` of a file would pass the process's file size limit
// (RLIMIT_FSIZE, `ulimit -f`). The kernel answers such a write with SIGXFSZ, whose default action
// kills the process; kvc refuses the write first, with EFBIG, so that it becomes an exception.
inline bool beyond_file_size_limit(std::int64_t end) noexcept {
  rlimit limit{};
  if (::getrlimit(RLIMIT_FSIZE, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return false;
  return static_cast<std::uint64_t>(end) > static_cast<std::uint64_t>(limit.rlim_cur);
}

// Writes/reads exactly n bytes at `offset`; returns 0, an errno value, or -1 for end of file.
inline int pwrite_all(int fd, const std::byte* p, std::size_t n, std::int64_t offset) noexcept {
  if (beyond_file_size_limit(offset + static_cast<std::int64_t>(n))) return EFBIG;
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (w == 0) return ENOSPC;
    p += w;
    n -= static_cast<std::size_t>(w);
    offset += w;
  }
  return 0;
}
inline int pread_all(int fd, std::byte* p, std::size_t n, std::int64_t offset) noexcept {
  while (n > 0) {
    const ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) return -1;
    p += r;
    n -= static_cast<std::size_t>(r);
    offset += r;
  }
  return 0;
}

inline std::string spill_directory(const OffloadFileOptions& o) {
  if (!o.directory.empty()) return o.directory;
  for (const char* var : {"KVC_OFFLOAD_DIR", "TMPDIR"})
    if (const char* v = std::getenv(var); v && *v) return v;
  return "/tmp";
}

using offload_buffers::held_layer;

// The spill-file tier of the offload engine (offload/engine.hpp): one unlinked file per cache,
// first-fit regions of it per layer, and a thread that reads the prefetched layer.
class tier {
 public:
  struct slot {
    std::int64_t offset = -1;   // of the layer's region in the file
    std::int64_t capacity = 0;  // of that region
  };
  using record = offload_engine::record<slot>;
  struct context {};
  static constexpr const char* name = "kvc::OffloadToFile";

  tier() = default;
  tier(const tier&) = delete;
  tier& operator=(const tier&) = delete;
  ~tier() {
    stop_worker();
    if (fd_ >= 0) ::close(fd_);
  }

  static offload_engine::counters& totals() noexcept { return spill::totals(); }

  // ---- storing ------------------------------------------------------------------------------------

  void begin_store(record&, const offload_buffers::layer_pieces&, context) noexcept {}

  // Writes layer p to the file, then frees its buffers. On an error the layer stays resident.
  template <class Cache>
  void store(Cache& cache, std::int64_t p, record& r, const offload_buffers::layer_pieces& pieces, context) {
    open_file();
    const bool reuse = r.slot.offset >= 0 && r.slot.capacity >= pieces.total;
    const auto [offset, capacity] = reuse ? std::pair{r.slot.offset, r.slot.capacity} : allocate(pieces.total);
    std::int64_t at = offset;
    for (const auto& [ptr, n] : pieces.pieces) {
      if (const int err = pwrite_all(fd_, ptr, n, at)) {
        if (!reuse) release(offset, capacity);
        throw io_error("offloading layer ", p, pieces.total, "writing", err);
      }
      at += static_cast<std::int64_t>(n);
    }
    if (drop_page_cache_) drop_pages(offset, pieces.total);
    if (!reuse) release(std::exchange(r.slot.offset, offset), std::exchange(r.slot.capacity, capacity));
    offload_buffers::for_each_buffer_of(cache, p, [](auto& b) { b = std::remove_reference_t<decltype(b)>{}; });
  }

  // ---- reading back -------------------------------------------------------------------------------

  // Empty buffers of the right types and sizes for a spilled layer, to read it into.
  template <class Cache>
  held_layer stage(Cache& cache, std::int64_t i, const record& r) const {
    return offload_buffers::stage_layer(cache, i, r.sizes, []<class B>(std::type_identity<B>, std::int64_t n) {
      totals().allocations += 1;
      return std::unique_ptr<offload_buffers::held_base>(std::make_unique<offload_buffers::held_buffer<B>>(n));
    });
  }

  void read(std::int64_t i, const record& r, held_layer& staged, context) const {
    std::int64_t at = r.slot.offset;
    for (const auto& s : staged) {
      if (!s) continue;
      if (const int err = pread_all(fd_, s->bytes, s->size, at))
        throw io_error("reading back layer ", i, r.bytes, "reading", err,
                       ". The layer stays in the spill file and the cache is unchanged");
      at += static_cast<std::int64_t>(s->size);
    }
  }

  // Queues the read of a spilled layer on the prefetch thread (started at the first prefetch).
  bool start_read(const record& r, held_layer&& staged, context) noexcept {
    if (!worker_.joinable()) {
      try {
        worker_ = std::thread([this] { run(); });
      } catch (...) {
        return false;  // no thread: the layer will be read synchronously
      }
    }
    {
      std::lock_guard lock(m_);
      job_staged_ = std::move(staged);
      job_offset_ = r.slot.offset;
      job_bytes_ = r.bytes;
      job_error_ = 0;
      job_state_ = job_state::queued;
    }
    work_cv_.notify_one();
    return true;
  }
  offload_engine::read_result finish_read(context) {
    const bool waited = wait_job();
    if (job_error_ != 0) return offload_engine::read_result::failed;
    return waited ? offload_engine::read_result::waited : offload_engine::read_result::ready;
  }
  held_layer take_read() noexcept {
    std::lock_guard lock(m_);
    job_state_ = job_state::idle;
    return std::move(job_staged_);
  }
  void cancel_read() noexcept {
    wait_job();
    held_layer dropped = take_read();
  }
  void give_back(held_layer& held) noexcept { held.clear(); }
  void end_of_update() noexcept {}
  void shutdown() noexcept { stop_worker(); }

  // ---- deep copies ----------------------------------------------------------------------------------

  void prepare_copy_of(const tier&) noexcept {}  // the options are read when the copy's file opens

  // Copies a spilled layer's bytes from `from`'s file into a new region of this one.
  void copy_slot(const tier& from, const record& src, record& dst, std::int64_t i) {
    open_file();
    const auto [offset, capacity] = allocate(src.bytes);
    dst.slot = {offset, capacity};
    std::vector<std::byte> chunk(static_cast<std::size_t>(std::min<std::int64_t>(src.bytes, 4 << 20)));
    for (std::int64_t done = 0; done < src.bytes;) {
      const auto n = static_cast<std::size_t>(std::min<std::int64_t>(src.bytes - done, std::ssize(chunk)));
      if (const int err = pread_all(from.fd_, chunk.data(), n, src.slot.offset + done))
        throw io_error("copying layer ", i, src.bytes, "reading", err, ". The cache was not copied");
      if (const int err = pwrite_all(fd_, chunk.data(), n, offset + done))
        throw io_error("copying layer ", i, src.bytes, "writing", err, ". The cache was not copied");
      done += static_cast<std::int64_t>(n);
    }
  }

 private:
  enum class job_state { idle, queued, running, done };

  // ---- errors ---------------------------------------------------------------------------------

  RuntimeError io_error(const char* what, std::int64_t layer, std::int64_t bytes, const char* op, int err,
                        const char* outcome = ". The layer stays in memory and the cache is unchanged") const {
    std::string m = "kvc::OffloadToFile: ";
    m += what;
    m += std::to_string(layer);
    m += " (";
    m += std::to_string(bytes);
    m += " bytes) failed while ";
    m += op;
    m += " the spill file in '";
    m += dir_;
    m += "': ";
    m += error_text(err);
    m += outcome;
    return RuntimeError(m);
  }

  // ---- the file and its regions ---------------------------------------------------------------

  void open_file() {
    if (fd_ >= 0) return;
    OffloadFileOptions o;
    {
      std::lock_guard lock(options_mutex());
      o = options_storage();
    }
    std::string dir = spill_directory(o);
    std::string path = dir;
    path += "/kvc-spill-XXXXXX";
    const int fd = ::mkostemp(path.data(), O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      std::string m = "kvc::OffloadToFile: cannot create a spill file in '";
      m += dir;
      m += "': ";
      m += error_text(err);
      m += ". Point KVC_OFFLOAD_DIR (or kvc::set_offload_file_options) at a writable directory. The cache is "
           "unchanged";
      throw RuntimeError(m);
    }
    ::unlink(path.c_str());  // the file lives until the descriptor is closed, even after a crash
    fd_ = fd;
    dir_ = std::move(dir);
    drop_page_cache_ = o.drop_page_cache;
  }

  static constexpr std::int64_t region_alignment = 4096;

  // First fit among the freed regions, else at the end of the file.
  std::pair<std::int64_t, std::int64_t> allocate(std::int64_t bytes) {
    const std::int64_t want = (bytes + region_alignment - 1) / region_alignment * region_alignment;
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < want) continue;
      const auto [offset, size] = *it;
      free_.erase(it);
      if (size > want) free_.emplace(offset + want, size - want);
      return {offset, want};
    }
    const std::int64_t offset = end_;
    end_ += want;
    return {offset, want};
  }

  void release(std::int64_t offset, std::int64_t size) noexcept {
    if (offset < 0 || size <= 0) return;
#if defined(__linux__) && defined(FALLOC_FL_PUNCH_HOLE)
    (void)::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, size);  // give the disk back
#endif
    try {
      auto [it, ok] = free_.emplace(offset, size);
      if (!ok) return;
      if (auto next = std::next(it); next != free_.end() && it->first + it->second == next->first) {
        it->second += next->second;
        free_.erase(next);
      }
      if (it != free_.begin()) {
        auto prev = std::prev(it);
        if (prev->first + prev->second == it->first) {
          prev->second += it->second;
          free_.erase(it);
          it = prev;
        }
      }
      if (it->first + it->second == end_) {
        end_ = it->first;
        free_.erase(it);
      }
    } catch (...) {
      // Out of memory for the free list: the region is simply not reused.
    }
  }

  void drop_pages(std::int64_t offset, std::int64_t n) noexcept {
#if defined(__linux__)
    (void)::sync_file_range(fd_, offset, n,
                            SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
#else
    (void)::fdatasync(fd_);
#endif
#if defined(POSIX_FADV_DONTNEED)
    (void)::posix_fadvise(fd_, offset, n, POSIX_FADV_DONTNEED);
#endif
  }

  // ---- the prefetch thread ----------------------------------------------------------------

  // Waits for the job in flight, if any; true if it had not finished yet.
  bool wait_job() noexcept {
    std::unique_lock lock(m_);
    const bool waited = job_state_ != job_state::done;
    done_cv_.wait(lock, [&] { return job_state_ == job_state::done || job_state_ == job_state::idle; });
    return waited;
  }
  // The prefetch thread allocates nothing (an exception escaping it would end the process): it
  // reads into the staged buffers the caller's thread allocated. While the job runs, the caller's
  // thread does not touch job_staged_ (it waits for job_state::done first).
  void run() noexcept {
    std::unique_lock lock(m_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stop_ || job_state_ == job_state::queued; });
      if (stop_) return;
      job_state_ = job_state::running;
      const std::int64_t offset = job_offset_;
      const std::int64_t bytes = job_bytes_;
      lock.unlock();
      int err = 0;
      std::int64_t at = offset;
      for (const auto& s : job_staged_) {
        if (!s) continue;
        if ((err = pread_all(fd_, s->bytes, s->size, at)) != 0) break;
        at += static_cast<std::int64_t>(s->size);
      }
      if (err == 0) totals().bytes_read += bytes;
      lock.lock();
      job_error_ = err;
      job_state_ = job_state::done;
      done_cv_.notify_all();
    }
  }

  void stop_worker() noexcept {
    if (!worker_.joinable()) return;
    {
      std::lock_guard lock(m_);
      stop_ = true;
    }
    work_cv_.notify_one();
    worker_.join();
  }

  int fd_ = -1;
  std::string dir_;
  bool drop_page_cache_ = false;
  std::map<std::int64_t, std::int64_t> free_;  // offset -> size of freed regions
  std::int64_t end_ = 0;

  // The prefetch job, under m_ (the caller's thread does not touch job_staged_ while the job runs).
  std::thread worker_;
  std::mutex m_;
  std::condition_variable work_cv_, done_cv_;
  bool stop_ = false;
  job_state job_state_ = job_state::idle;
  held_layer job_staged_;
  std::int64_t job_offset_ = 0;
  std::int64_t job_bytes_ = 0;
  int job_error_ = 0;
};

// The per-cache state of an OffloadToFile engine.
using core = offload_engine::core<tier>;

}  // namespace detail::spill

// Sets where and how OffloadToFile engines create their spill files (process-wide).
inline void set_offload_file_options(OffloadFileOptions options) {
  std::lock_guard lock(detail::spill::options_mutex());
  detail::spill::options_storage() = std::move(options);
}
// Returns the options OffloadToFile engines create their spill files with (a copy).
inline OffloadFileOptions offload_file_options() {
  std::lock_guard lock(detail::spill::options_mutex());
  return detail::spill::options_storage();
}

// The process-wide counters of every OffloadToFile engine; reset_offload_file_stats() zeroes the
// event counters (spilled_layers and spilled_bytes describe the present and are kept).
inline OffloadFileStats offload_file_stats() noexcept {
  const auto& c = detail::spill::totals();
  return {c.stores.load(),        c.bytes_stored.load(),   c.sync_reads.load(),         c.prefetches.load(),
          c.prefetch_hits.load(), c.prefetch_waits.load(), c.prefetches_dropped.load(), c.bytes_read.load(),
          c.away_layers.load(),   c.away_bytes.load()};
}
// Zeroes the event counters of offload_file_stats(); spilled_layers and spilled_bytes are kept.
inline void reset_offload_file_stats() noexcept { detail::spill::totals().reset_events(); }

// Bytes of buffers layer `layer_idx` holds in memory now (0 while it is spilled).
template <class Cache>
std::int64_t layer_ram_bytes(Cache& cache, std::int64_t layer_idx) {
  std::int64_t n = 0;
  detail::offload_buffers::for_each_buffer_of(
      cache, layer_idx, [&](auto& b) { n += static_cast<std::int64_t>(detail::offload_buffers::buffer_bytes(b)); });
  return n;
}
// Bytes of buffers every layer holds in memory now.
template <class Cache>
std::int64_t ram_bytes(Cache& cache) {
  std::int64_t n = 0;
  for (std::int64_t i = 0; i < cache.size(); ++i) n += layer_ram_bytes(cache, i);
  return n;
}

// Host layers that are not in use live in a spill file; the next one is prefetched on a thread.
// OnlyNonSliding is transformers' offload_only_non_sliding: false is DynamicCache's default, true
// StaticCache's. Serves host storage only.
template <bool OnlyNonSliding = false>
struct OffloadToFile {
  // Whether sliding-window layers stay in memory (transformers' offload_only_non_sliding).
  static constexpr bool only_non_sliding = OnlyNonSliding;

  // True for host storage only.
  template <class S>
  static constexpr bool serves = S::space == memory_space::host;

  // Copying it (hence the Cache) copies the spilled layers into a new spill file; moving it moves
  // the file and the thread. Its destructor joins the thread and closes (so deletes) the file.
  template <class S>
  class engine {
   public:
    // Before update(layer_idx): spills the layer the previous update offloaded, reads layer
    // layer_idx back if it is spilled, and prefetches the next offloadable layer. Throws
    // kvc::RuntimeError on an I/O error and kvc::ValueError when no layer is offloadable; the
    // layers keep their tokens either way.
    template <class Cache>
    void before_update(Cache& cache, std::int64_t layer_idx) {
      core_.get(OnlyNonSliding).before_update(cache, layer_idx, context{});
    }
    // After update(layer_idx): marks the layer, if offloadable, to be spilled at the next call.
    // Cannot throw: on an error the layer stays in memory.
    template <class Cache>
    void after_update(Cache& cache, std::int64_t layer_idx) noexcept {
      if (core_) core_->after_update(cache, layer_idx, context{});
    }
    // Before a Cache method other than update reads or changes layer layer_idx (-1: every layer):
    // reads it back if it is spilled. Throws kvc::RuntimeError on an I/O error.
    template <class Cache>
    void before_access(Cache& cache, std::int64_t layer_idx) {
      if (core_) core_->before_access(cache, layer_idx, context{});
    }

    // Observability (tests, benchmarks).
    std::int64_t spilled_layers() const noexcept { return core_ ? core_->away_layers() : 0; }
    // Returns the bytes of this cache's layers in the spill file now.
    std::int64_t spilled_bytes() const noexcept { return core_ ? core_->away_bytes() : 0; }
    // Whether layer layer_idx is in the spill file now.
    bool is_spilled(std::int64_t layer_idx) const noexcept { return core_ && core_->is_away(layer_idx); }

   private:
    using context = detail::spill::tier::context;
    detail::offload_buffers::cloned_core<detail::spill::core> core_;
  };
};

}  // namespace kvc
