#pragma once
// How kvc's host attention runs: on which threads (an executor) and in which scratch memory (a
// workspace). docs/attention.md, "Threads and workspace".
//
// Executors model kvc::concepts::Executor: concurrency() and parallel_for(n, body), body(item,
// worker). kvc::SerialExecutor runs the items in order on the calling thread (the default);
// kvc::OpenMPExecutor runs them on OpenMP's thread team (defined when the program is built with
// OpenMP); any other type with the two calls (the caller's own thread pool) works the same way.
// kvc::ExecutorRef refers to any of them without owning it, so that options structs and
// non-template code can hold one.
//
// kvc::AttentionWorkspace is the scratch attention computes in: one area per worker and one the
// workers share. It grows to the largest call it has served and is then reused, so a step of a
// size already seen allocates nothing and touches no fresh page.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <kvc/concepts/executor.hpp>

namespace kvc {

// Runs every item on the calling thread, in order.
struct SerialExecutor {
  // Returns 1: the calling thread is the one worker.
  static constexpr int concurrency() noexcept { return 1; }
  // Calls body(i, 0) for every i in [0, n), in order, on the calling thread.
  template <class Body>
  void parallel_for(std::int64_t n, Body&& body) const {
    for (std::int64_t i = 0; i < n; ++i) body(i, 0);
  }
};

#if defined(_OPENMP)
// Runs the items on OpenMP's thread team: `threads` threads (0: omp_get_max_threads()), items
// handed out one at a time. OpenMP keeps its threads between calls; a call made from inside a
// parallel region runs on the calling thread alone.
struct OpenMPExecutor {
  // The number of threads to use; 0: omp_get_max_threads().
  int threads = 0;
  // The number of workers: `threads`, or omp_get_max_threads() when it is 0 (at least 1).
  int concurrency() const noexcept { return threads > 0 ? threads : std::max(1, omp_get_max_threads()); }
  // Calls body(i, worker) for every i in [0, n) on the team (worker: OpenMP's thread number), on
  // the calling thread alone when one worker suffices or inside a parallel region.
  template <class Body>
  void parallel_for(std::int64_t n, Body&& body) const {
    const int team = static_cast<int>(std::min<std::int64_t>(concurrency(), std::max<std::int64_t>(n, 1)));
    if (team <= 1 || omp_in_parallel()) {
      for (std::int64_t i = 0; i < n; ++i) body(i, 0);
      return;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
    for (std::int64_t i = 0; i < n; ++i) body(i, omp_get_thread_num());
  }
};
#endif

// A non-owning reference to an executor (the executor must outlive it). Default: serial.
class ExecutorRef {
 public:
  // A reference to no executor: parallel_for runs the items serially.
  ExecutorRef() noexcept = default;
  // Refers to `executor` (which must outlive the reference); records its concurrency, at least 1.
  template <concepts::Executor E>
    requires(!std::is_same_v<std::remove_cvref_t<E>, ExecutorRef>)
  ExecutorRef(const E& executor) noexcept  // NOLINT(google-explicit-constructor): a reference
      : executor_(&executor), concurrency_(std::max(1, static_cast<int>(executor.concurrency()))), run_(&run<E>) {}

  // The referred executor's number of workers (1 for the default, serial one).
  int concurrency() const noexcept { return concurrency_; }

  // body(item, worker) for every item in [0, n); body must not throw.
  template <class Body>
  void parallel_for(std::int64_t n, Body&& body) const {
    if (run_ == nullptr || concurrency_ == 1 || n <= 1) {
      for (std::int64_t i = 0; i < n; ++i) body(i, 0);
      return;
    }
    using B = std::remove_reference_t<Body>;
    run_(
        executor_, n, [](void* b, std::int64_t i, int w) { (*static_cast<B*>(b))(i, w); },
        const_cast<void*>(static_cast<const void*>(std::addressof(body))));
  }

 private:
  using body_fn = void (*)(void*, std::int64_t, int);
  template <class E>
  static void run(const void* executor, std::int64_t n, body_fn body, void* state) {
    static_cast<const E*>(executor)->parallel_for(n, [body, state](std::int64_t i, int w) { body(state, i, w); });
  }

  const void* executor_ = nullptr;
  int concurrency_ = 1;
  void (*run_)(const void*, std::int64_t, body_fn, void*) = nullptr;
};

// Scratch memory for attention calls, owned by the caller (one per thread that calls attention).
// Every area starts at a multiple of `alignment` bytes: vectorized sums over the scratch then
// group their terms the same way whatever address the allocator returned, so a call's results do
// not depend on where its workspace lies (nor on which worker's area an item runs in).
class AttentionWorkspace {
 public:
  // The alignment, in bytes, of every area's start.
  static constexpr std::size_t alignment = 64;

  // An empty workspace: the first reserve allocates.
  AttentionWorkspace() = default;
  AttentionWorkspace(const AttentionWorkspace&) = delete;
  AttentionWorkspace& operator=(const AttentionWorkspace&) = delete;
  // Takes over the other workspace's areas.
  AttentionWorkspace(AttentionWorkspace&&) noexcept = default;
  // Takes over the other workspace's areas, freeing its own; returns *this.
  AttentionWorkspace& operator=(AttentionWorkspace&&) noexcept = default;

  // The bytes it holds.
  std::size_t bytes() const noexcept {
    std::size_t n = shared_.size;
    for (const area& a : workers_) n += a.size;
    return n;
  }
  // Gives every byte back.
  void release() noexcept {
    workers_.clear();
    workers_.shrink_to_fit();
    shared_ = {};
  }

  // Room for `workers` areas of `per_worker` bytes and a shared area of `shared` bytes: allocates
  // only the areas that are too small, and on std::bad_alloc keeps what it had (attention calls it
  // before they compute; a caller may call it ahead to have the first step allocate nothing).
  void reserve(int workers, std::size_t per_worker, std::size_t shared) {
    const auto w = static_cast<std::size_t>(std::max(workers, 1));
    const bool grow_shared = shared_.size < shared;
    std::size_t grow_workers = 0;
    for (std::size_t i = 0; i < w; ++i) grow_workers += i >= workers_.size() || workers_[i].size < per_worker;
    if (!grow_shared && grow_workers == 0) return;
    std::vector<area> next;
    next.reserve(std::max(w, workers_.size()));
    for (std::size_t i = 0; i < std::max(w, workers_.size()); ++i)
      next.push_back(i < w && (i >= workers_.size() || workers_[i].size < per_worker) ? area::of(per_worker) : area{});
    // The shared area grows at least twofold: steps whose needs creep up (more requests, more
    // key splits) reallocate it a few times, not at every step.
    area next_shared = grow_shared ? area::of(std::max(shared, 2 * shared_.size)) : area{};
    // Nothing below throws.
    for (std::size_t i = 0; i < workers_.size(); ++i)
      if (next[i].size == 0) next[i] = std::move(workers_[i]);
    workers_ = std::move(next);
    if (grow_shared) shared_ = std::move(next_shared);
  }
  // The start of worker `w`'s area (w below the workers reserved: not checked); nullptr when empty.
  std::byte* worker(int w) noexcept { return workers_[static_cast<std::size_t>(w)].data.get(); }
  // The start of the area the workers share; nullptr when none was reserved.
  std::byte* shared() noexcept { return shared_.data.get(); }

 private:
  struct aligned_delete {
    void operator()(std::byte* p) const noexcept { ::operator delete[](p, std::align_val_t{alignment}); }
  };
  struct area {
    std::unique_ptr<std::byte[], aligned_delete> data;
    std::size_t size = 0;
    static area of(std::size_t n) {
      return {std::unique_ptr<std::byte[], aligned_delete>(
                  n > 0 ? static_cast<std::byte*>(::operator new[](n, std::align_val_t{alignment})) : nullptr),
              n};
    }
  };
  std::vector<area> workers_;
  area shared_;
};

// How one attention call runs: its executor and workspace (none: a workspace of the call's own,
// allocated and freed by it).
struct AttentionContext {
  // The threads the call runs on (default: the calling thread).
  ExecutorRef executor{};
  // The scratch memory the call computes in; nullptr: the call allocates its own.
  AttentionWorkspace* workspace = nullptr;
};

}  // namespace kvc
