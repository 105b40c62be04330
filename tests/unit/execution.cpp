// Attention on any executor: the same bits on one thread, on a thread pool of the caller's, and
// on OpenMP's team, whatever the thread count; a call on one thread starts no other (built with
// OpenMP, Eigen's products would); and with a workspace, a steady-state step that allocates
// nothing (counted by the replacement operator new of failing_allocator.hpp, and for Eigen's own
// heap, which is malloc, by Eigen's run-time malloc check).

// Eigen's heap allocations are checked while forbidden (Eigen::internal::set_is_malloc_allowed):
// a failed check of any Eigen assertion is counted, not fatal, in this release-mode test.
#include <atomic>
namespace kvc_test {
inline std::atomic<long> eigen_assertion_failures{0};
}
#define EIGEN_RUNTIME_NO_MALLOC
#define eigen_assert(x) ((x) ? void(0) : void(kvc_test::eigen_assertion_failures.fetch_add(1)))

#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <string>
#include <memory>
#include <thread>
#include <vector>

#include <kvc/execution.hpp>
#include <kvc/fp8_attention.hpp>
#include <kvc/kvc.hpp>
#include <kvc/paged/paged_attention.hpp>
#include <kvc/quantized_attention.hpp>

#include "../support/failing_allocator.hpp"
#include "../support/kvc_test.hpp"
#include "../support/sanitized.hpp"

namespace {

// The caller's own pool, as a user would write one: threads - 1 workers that live as long as the
// pool and the calling thread as worker 0; items handed out one at a time.
class ThreadPool {
 public:
  explicit ThreadPool(int threads) : size_(threads) {
    for (int w = 1; w < threads; ++w) workers_.emplace_back([this, w] { loop(w); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;
  ~ThreadPool() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int concurrency() const noexcept { return size_; }
  template <class Body>
  void parallel_for(std::int64_t n, Body&& body) const {
    {
      std::lock_guard lock(mutex_);
      fn_ = [](void* b, std::int64_t i, int w) { (*static_cast<std::remove_reference_t<Body>*>(b))(i, w); };
      body_ = const_cast<void*>(static_cast<const void*>(&body));
      count_ = n;
      next_ = 0;
      busy_ = size_ - 1;
      ++generation_;
    }
    wake_.notify_all();
    work(0);
    std::unique_lock lock(mutex_);
    done_.wait(lock, [&] { return busy_ == 0; });
  }

 private:
  void work(int w) const {
    for (std::int64_t i = next_.fetch_add(1); i < count_; i = next_.fetch_add(1)) fn_(body_, i, w);
  }
  void loop(int w) const {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work(w);
      std::lock_guard lock(mutex_);
      if (--busy_ == 0) done_.notify_one();
    }
  }

  int size_;
  std::vector<std::thread> workers_;
  mutable std::mutex mutex_;
  mutable std::condition_variable wake_, done_;
  mutable void (*fn_)(void*, std::int64_t, int) = nullptr;
  mutable void* body_ = nullptr;
  mutable std::int64_t count_ = 0;
  mutable std::atomic<std::int64_t> next_{0};
  mutable int busy_ = 0;
  mutable std::uint64_t generation_ = 0;
  bool stop_ = false;
};
static_assert(kvc::concepts::Executor<ThreadPool>);
static_assert(kvc::concepts::Executor<kvc::SerialExecutor>);
static_assert(kvc::concepts::Executor<kvc::ExecutorRef>);
static_assert(!kvc::concepts::Executor<int>);

template <class T>
bool same_bits(const kvc::HostTensor<T>& a, const kvc::HostTensor<T>& b) {
  return a.dimensions() == b.dimensions() && std::memcmp(a.data(), b.data(), sizeof(T) * a.size()) == 0;
}

template <class T>
kvc::TensorView<T> view(const kvc::HostTensor<T>& t) {
  return kvc::HostStorage<T>::input_view(t);
}

// fn(context) for the serial default and for pools of 1 to 4 threads (each with its workspace,
// used twice: the second call reuses it); every result must equal the first bit for bit. Under
// the sanitizers, pools of 2 and 4 threads and an OpenMP team of 3 (kvc_test::sanitized).
template <class Fn>
void on_every_executor(Fn&& fn) {
  const auto first = fn(kvc::AttentionContext{});
  for (int threads = kvc_test::sanitized ? 2 : 1; threads <= 4; threads += kvc_test::sanitized ? 2 : 1) {
    CAPTURE(threads);
    const ThreadPool pool(threads);
    kvc::AttentionWorkspace ws;
    CHECK(same_bits(fn(kvc::AttentionContext{pool, &ws}), first));
    CHECK(same_bits(fn(kvc::AttentionContext{pool, &ws}), first));
  }
  const kvc::SerialExecutor serial;
  CHECK(same_bits(fn(kvc::AttentionContext{serial, nullptr}), first));
#if defined(_OPENMP)
  for (int threads = kvc_test::sanitized ? 3 : 1; threads <= 3; ++threads) {
    const kvc::OpenMPExecutor omp{threads};
    kvc::AttentionWorkspace ws;
    CHECK(same_bits(fn(kvc::AttentionContext{omp, &ws}), first));
  }
#endif
}

template <class T>
double worst_difference(const kvc::HostTensor<T>& out, const std::vector<double>& want) {
  double worst = 0;
  for (std::int64_t i = 0; i < out.size(); ++i)
    worst = std::max(worst, std::abs(static_cast<double>(out.data()[i]) - want[static_cast<std::size_t>(i)]));
  return worst;
}

}  // namespace

#if defined(_OPENMP) && defined(__linux__)
namespace {
// The threads of this process (/proc/self/status).
int process_threads() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  return -1;
}
}  // namespace

// First in this file, and run alone by ctest (unit.execution.one_thread): no OpenMP team exists
// yet, so a team started by the call would show as threads that were not there before it.
TEST_CASE("attention on one thread starts no other thread, in a program built with OpenMP") {
  REQUIRE(omp_get_max_threads() >= 1);
  REQUIRE(process_threads() == 1);
  std::mt19937 rng(3);
  // A prefill large enough for Eigen to have run its products on several threads.
  const auto q = kvc_test::random_tensor<float>(1, 8, 300, 128, rng);
  const auto k = kvc_test::random_tensor<float>(1, 2, 300, 128, rng);
  const auto v = kvc_test::random_tensor<float>(1, 2, 300, 128, rng);
  const kvc::AttentionMask mask{300, 0, 0};
  (void)kvc::scaled_dot_product_attention(view(q), view(k), view(v), mask);
  const kvc::OpenMPExecutor one{1};
  (void)kvc::scaled_dot_product_attention(view(q), view(k), view(v), mask, kvc::AttentionContext{one, nullptr});
  CHECK(process_threads() == 1);
}
#endif

TEST_CASE("prefill attention with a workspace allocates nothing from Eigen's heap either") {
  // Sizes whose matrix products need packing buffers above Eigen's stack limit (128 KiB): Eigen's
  // own products would take them from the heap at every call.
  std::mt19937 rng(4);
  const auto q = kvc_test::random_tensor<float>(1, 8, 300, 128, rng);
  const auto k = kvc_test::random_tensor<float>(1, 2, 300, 128, rng);
  const auto v = kvc_test::random_tensor<float>(1, 2, 300, 128, rng);
  const kvc::AttentionMask mask{300, 0, 0};
  CHECK(kvc_test::eigen_assertion_failures.load() == 0);  // no Eigen assertion failed before here
  for (int threads : {1, 2}) {
    CAPTURE(threads);
    const ThreadPool pool(threads);
    kvc::AttentionWorkspace ws;
    kvc::HostTensor<float> out;
    kvc::scaled_dot_product_attention(view(q), view(k), view(v), mask, out, {pool, &ws});
    const kvc::HostTensor<float> first = out;
    const long failures = kvc_test::eigen_assertion_failures.load();
    Eigen::internal::set_is_malloc_allowed(false);
    const std::int64_t allocations = count_allocations([&] {
      kvc::scaled_dot_product_attention(view(q), view(k), view(v), mask, out, {pool, &ws});
    });
    Eigen::internal::set_is_malloc_allowed(true);
    CHECK(allocations == 0);
    CHECK(kvc_test::eigen_assertion_failures.load() == failures);
    CHECK(same_bits(out, first));
  }
  // The check can fail: a tensor's storage is Eigen's heap.
  const long failures = kvc_test::eigen_assertion_failures.load();
  Eigen::internal::set_is_malloc_allowed(false);
  { const kvc::HostTensor<float> t(1, 1, 1, 1); }
  Eigen::internal::set_is_malloc_allowed(true);
  CHECK(kvc_test::eigen_assertion_failures.load() > failures);
}

TEST_CASE_TEMPLATE("scaled_dot_product_attention: the same bits on every executor and thread count", T, float, double,
                   Eigen::bfloat16) {
  // Under the sanitizers, float and bfloat16: double takes float's paths with another type (the g++
  // build runs all three, natively and under valgrind).
  if (kvc_test::sanitized && std::is_same_v<T, double>) return;
  std::mt19937 rng(5);
  struct shape {
    std::int64_t B, Hq, Hkv, Q, S, window;
  };
  // Decode rows cut into key splits (S > 512), a prefill of three tiles, MQA, a sliding window,
  // prompts whose key blocks are packed once for all their tiles (plain and sliding).
  for (const shape s : {shape{2, 4, 2, 1, 1300, 0}, shape{1, 2, 1, 150, 190, 0}, shape{1, 6, 1, 2, 2100, 0},
                        shape{2, 4, 4, 70, 600, 33}, shape{1, 2, 2, 1, 4100, 0}, shape{1, 4, 2, 300, 300, 0},
                        shape{2, 3, 1, 270, 270, 70}}) {
    CAPTURE(s.S);
    CAPTURE(s.Q);
    const auto q = kvc_test::random_tensor<T>(s.B, s.Hq, s.Q, 16, rng);
    const auto k = kvc_test::random_tensor<T>(s.B, s.Hkv, s.S, 16, rng);
    const auto v = kvc_test::random_tensor<T>(s.B, s.Hkv, s.S, 16, rng);
    kvc::AttentionMask mask{s.S, 0, s.S - s.Q};
    if (s.window > 0) mask.sliding_window = s.window;
    std::vector<std::uint8_t> pad(static_cast<std::size_t>(s.B * s.S), 1);
    on_every_executor([&](const kvc::AttentionContext& context) {
      kvc::HostTensor<T> out;
      kvc::scaled_dot_product_attention(view(q), view(k), view(v), mask, out, context);
      return out;
    });
    // Against attention in double (random values are multiples of 1/8 up to 8: sharp softmaxes).
    const auto out = kvc::scaled_dot_product_attention(view(q), view(k), view(v), mask);
    CHECK(worst_difference(out, kvc_test::reference_attention(q, k, v, s.S - s.Q, 0, s.window)) <
          (std::is_same_v<T, Eigen::bfloat16> ? 0.07 : 1e-4));
    // With padding (every third key of batch row 0) too.
    for (std::int64_t j = 0; j < s.S; j += 3) pad[static_cast<std::size_t>(j)] = 0;
    mask.key_padding_mask = pad;
    on_every_executor([&](const kvc::AttentionContext& context) {
      return kvc::scaled_dot_product_attention(view(q), view(k), view(v), mask, context);
    });
  }
}

TEST_CASE("AttentionWorkspace: every area starts on a 64-byte boundary") {
  // Vectorized sums over the scratch peel a different head off an array at each alignment, and so
  // group (round) their terms differently: with AVX-512 a 16-byte aligned workspace made two
  // identical calls differ in the last bits. Aligned areas make the grouping a function of the
  // problem alone.
  kvc::AttentionWorkspace ws;
  std::vector<std::unique_ptr<char[]>> held;
  for (std::size_t i = 1; i <= 8; ++i) {
    held.push_back(std::make_unique<char[]>(i * 24 + 8));  // other addresses for the next areas
    ws.reserve(static_cast<int>(i), 100 * i + 4, 1000 * i + 4);
    for (int w = 0; w < static_cast<int>(i); ++w)
      CHECK(reinterpret_cast<std::uintptr_t>(ws.worker(w)) % kvc::AttentionWorkspace::alignment == 0);
    CHECK(reinterpret_cast<std::uintptr_t>(ws.shared()) % kvc::AttentionWorkspace::alignment == 0);
  }
  CHECK(kvc::AttentionWorkspace::alignment >= 64);
}

TEST_CASE("scaled_dot_product_attention: the same bits from call to call, wherever its workspace lies") {
  // Values of every magnitude (not multiples of 1/8), so that sums grouped differently round
  // differently; the allocations held in between move the workspaces to other addresses (which
  // matters where the build's vectors are wider than the allocator's alignment: AVX and up).
  std::mt19937 rng(11);
  std::normal_distribution<float> normal;
  struct shape {
    std::int64_t Hq, Hkv, Q, S;
  };
  for (const shape s : {shape{12, 2, 20, 20}, shape{12, 2, 65, 65}, shape{8, 2, 1, 700}, shape{4, 4, 3, 300}}) {
    CAPTURE(s.S);
    kvc::HostTensor<float> q(1, s.Hq, s.Q, 64), k(1, s.Hkv, s.S, 64), v(1, s.Hkv, s.S, 64);
    for (auto* t : {&q, &k, &v})
      for (std::int64_t i = 0; i < t->size(); ++i) t->data()[i] = normal(rng);
    const kvc::AttentionMask mask{s.S, 0, s.S - s.Q};
    const auto first = kvc::scaled_dot_product_attention(view(q), view(k), view(v), mask);
    std::vector<std::unique_ptr<char[]>> held;
    for (std::size_t i = 1; i <= 12; ++i) {
      held.push_back(std::make_unique<char[]>(i * 24 + 8));
      CHECK(same_bits(kvc::scaled_dot_product_attention(view(q), view(k), view(v), mask), first));
      kvc::AttentionWorkspace ws;
      const kvc::SerialExecutor serial;
      CHECK(same_bits(kvc::scaled_dot_product_attention(view(q), view(k), view(v), mask, {serial, &ws}), first));
    }
  }
}

TEST_CASE("attend_quantized and attend_fp8: the same bits on every executor") {
  std::mt19937 rng(6);
  kvc::ModelConfig c;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.hidden_size = 64;
  // A prompt past 512 keys: the decode step after it is cut into key splits.
  const auto prompt_k = kvc_test::random_tensor<float>(2, 2, 540, 16, rng);
  const auto prompt_v = kvc_test::random_tensor<float>(2, 2, 540, 16, rng);
  const auto prompt_q = kvc_test::random_tensor<float>(2, 4, 540, 16, rng);
  const auto q = kvc_test::random_tensor<float>(2, 4, 3, 16, rng);
  const auto k = kvc_test::random_tensor<float>(2, 2, 3, 16, rng);
  const auto v = kvc_test::random_tensor<float>(2, 2, 3, 16, rng);
  on_every_executor([&](const kvc::AttentionContext& context) {
    kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>, kvc::HostStorage<float>> cache(kvc::QuantoQuantizedLayer{});
    kvc::AttendOptions options;
    options.context = context;
    (void)kvc::attend_quantized(cache, 0, view(prompt_q), view(prompt_k), view(prompt_v), options);
    return kvc::attend_quantized(cache, 0, view(q), view(k), view(v), options);
  });
  on_every_executor([&](const kvc::AttentionContext& context) {
    auto cache = kvc::make_dynamic_cache<kvc::float8_e4m3>(c);
    kvc::AttendOptions options;
    options.context = context;
    (void)kvc::attend_fp8(cache, 0, view(prompt_q), view(prompt_k), view(prompt_v), kvc::Fp8Scales{}, options);
    return kvc::attend_fp8(cache, 0, view(q), view(k), view(v), kvc::Fp8Scales{}, options);
  });
}

namespace {

// A paged cache holding `pasts[r]` random tokens of request "r<r>" in every layer.
struct paged_setup {
  kvc::PagedCache<kvc::HostStorage<float>> cache;
  std::vector<std::string> ids;
  std::vector<std::int64_t> allocated;

  paged_setup(const std::vector<std::int64_t>& pasts, std::mt19937& rng)
      : cache(model(), config()), allocated(pasts.size(), 0) {
    for (std::size_t r = 0; r < pasts.size(); ++r) {
      ids.push_back("r" + std::to_string(r));
      if (pasts[r] > 0) store(r, 0, pasts[r], rng);
    }
  }
  static kvc::ModelConfig model() {
    kvc::ModelConfig c;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 16;
    c.hidden_size = 64;
    c.sliding_window = 700;
    c.layer_types = std::vector<std::string>{"full_attention", "sliding_attention"};
    return c;
  }
  static kvc::ContinuousBatchingConfig config() {
    kvc::ContinuousBatchingConfig cb;
    cb.block_size = 16;
    cb.num_blocks = 800;
    return cb;
  }
  // Room for request r's tokens up to `end`, and the step's write indices.
  kvc::PagedIndices room(std::size_t r, std::int64_t past, std::int64_t q) {
    const std::int64_t need = (past + q + 15) / 16 - allocated[r];
    if (need > 0) allocated[r] += cache.allocate_blocks(need, ids[r], allocated[r]).value();
    kvc::PagedIndices writes(static_cast<std::size_t>(cache.num_groups()));
    cache.extend_read_and_write_indices(ids[r], past, q, nullptr, writes);
    return writes;
  }
  void store(std::size_t r, std::int64_t past, std::int64_t q, std::mt19937& rng) {
    const kvc::PagedIndices none(static_cast<std::size_t>(cache.num_groups()));
    const kvc::PagedIndices writes = room(r, past, q);
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      const auto k = kvc_test::random_tensor<float>(1, 2, q, 16, rng);
      const auto v = kvc_test::random_tensor<float>(1, 2, q, 16, rng);
      cache.update(view(k), view(v), layer, none, writes);
    }
  }
};

}  // namespace

TEST_CASE("paged_attention: the same bits on every executor and thread count") {
  std::mt19937 rng(7);
  // A long decode (cut into splits), a prefill of three tiles, a short decode, a request at rest.
  const std::vector<std::int64_t> pasts = {1500, 0, 37, 20}, counts = {1, 150, 1, 0};
  paged_setup setup(pasts, rng);
  std::vector<std::int64_t> cu = {0};
  for (std::size_t r = 0; r < pasts.size(); ++r) {
    (void)setup.room(r, pasts[r], counts[r]);
    cu.push_back(cu.back() + counts[r]);
  }
  const kvc::PagedAttentionStep step{setup.ids, cu, pasts};
  const auto q = kvc_test::random_tensor<float>(1, 4, cu.back(), 16, rng);
  const auto k = kvc_test::random_tensor<float>(1, 2, cu.back(), 16, rng);
  const auto v = kvc_test::random_tensor<float>(1, 2, cu.back(), 16, rng);
  for (std::int64_t layer = 0; layer < 2; ++layer) {
    CAPTURE(layer);
    on_every_executor([&](const kvc::AttentionContext& context) {
      kvc::HostTensor<float> out;
      kvc::paged_attention(setup.cache, layer, step, view(q), view(k), view(v), out, context);
      return out;
    });
  }
}

namespace {

// A prefill chunk of 100 tokens and a decode step, then 40 decode steps and a chunk of 100 through
// `cache`: the allocations of the last part.
template <class Cache, class Executor>
std::int64_t steady_state_allocations(Cache& cache, const Executor& pool, std::mt19937& rng) {
  // [snippet:attention_context]
  kvc::AttentionWorkspace ws;  // one per calling thread, reused by every step
  kvc::AttendOptions options;
  options.context = {pool, &ws};  // pool: any kvc::concepts::Executor
  kvc::HostTensor<float> out;     // reused too: resized only when its size changes
  // [/snippet]
  const auto chunk = [&](std::int64_t n) {
    const auto q = kvc_test::random_tensor<float>(1, 4, n, 16, rng);
    const auto k = kvc_test::random_tensor<float>(1, 2, n, 16, rng);
    const auto v = kvc_test::random_tensor<float>(1, 2, n, 16, rng);
    return std::array{q, k, v};
  };
  const auto prefill = chunk(100), token = chunk(1);
  for (std::int64_t layer = 0; layer < 2; ++layer) {  // warm-up
    kvc::attend(cache, layer, view(prefill[0]), view(prefill[1]), view(prefill[2]), out, options);
    kvc::attend(cache, layer, view(token[0]), view(token[1]), view(token[2]), out, options);
  }
  return count_allocations([&] {
    for (int step = 0; step < 40; ++step)  // decode steps
      for (std::int64_t layer = 0; layer < 2; ++layer)
        kvc::attend(cache, layer, view(token[0]), view(token[1]), view(token[2]), out, options);
    for (std::int64_t layer = 0; layer < 2; ++layer)  // and a prefill chunk of a size seen
      kvc::attend(cache, layer, view(prefill[0]), view(prefill[1]), view(prefill[2]), out, options);
  });
}

}  // namespace

TEST_CASE("a steady-state step with a workspace allocates nothing, on one thread or a pool") {
  std::mt19937 rng(8);
  kvc::ModelConfig c = paged_setup::model();
  c.layer_types = std::nullopt;
  c.sliding_window = std::nullopt;
  for (int threads : {1, 2}) {
    CAPTURE(threads);
    const ThreadPool pool(threads);
    kvc::StaticCache<float> fixed(c, 1200);  // room for its tokens from the start
    CHECK(steady_state_allocations(fixed, pool, rng) == 0);
    kvc::DynamicCache<float> reserved;  // room made ahead
    reserved.reserve(1200);
    CHECK(steady_state_allocations(reserved, pool, rng) == 0);
    kvc::DynamicCache<float> growing;  // without it, appends reallocate now and then
    CHECK(steady_state_allocations(growing, pool, rng) > 0);
  }
}

TEST_CASE("attend_quantized: decode steps between quantizations allocate nothing with a workspace") {
  std::mt19937 rng(12);
  const auto tokens = [&](std::int64_t heads, std::int64_t n) {
    return kvc_test::random_tensor<float>(1, heads, n, 16, rng);
  };
  const auto prompt_q = tokens(4, 300), prompt_k = tokens(2, 300), prompt_v = tokens(2, 300);
  const auto q = tokens(4, 1), k = tokens(2, 1), v = tokens(2, 1);
  for (int threads : {1, 2}) {
    CAPTURE(threads);
    const ThreadPool pool(threads);
    // The residual (128 tokens by default) takes the steps; once it has held 128 (its room then
    // kept), the 40 counted steps fall between two quantizations.
    kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>, kvc::HostStorage<float>> cache(kvc::QuantoQuantizedLayer{});
    kvc::AttentionWorkspace ws;
    kvc::AttendOptions options;
    options.context = {pool, &ws};
    kvc::HostTensor<float> out;
    kvc::attend_quantized(cache, 0, view(prompt_q), view(prompt_k), view(prompt_v), out, options);
    for (int step = 0; step < 140; ++step) kvc::attend_quantized(cache, 0, view(q), view(k), view(v), out, options);
    CHECK(count_allocations([&] {
            for (int step = 0; step < 40; ++step)
              kvc::attend_quantized(cache, 0, view(q), view(k), view(v), out, options);
          }) == 0);
    // Without a kept workspace each call allocates its own scratch: the count can fail.
    options.context.workspace = nullptr;
    CHECK(count_allocations([&] { kvc::attend_quantized(cache, 0, view(q), view(k), view(v), out, options); }) > 0);
  }
}

TEST_CASE("a steady-state paged step with a workspace allocates nothing") {
  std::mt19937 rng(9);
  const std::vector<std::int64_t> pasts = {300, 40};
  paged_setup setup(pasts, rng);
  const ThreadPool pool(2);
  kvc::AttentionWorkspace ws;
  const auto q = kvc_test::random_tensor<float>(1, 4, 2, 16, rng);
  const auto k = kvc_test::random_tensor<float>(1, 2, 2, 16, rng);
  const auto v = kvc_test::random_tensor<float>(1, 2, 2, 16, rng);
  // Both requests decode one token a step; the blocks for 64 more tokens are allocated ahead.
  const kvc::PagedIndices none(static_cast<std::size_t>(setup.cache.num_groups()));
  for (std::size_t r = 0; r < 2; ++r) (void)setup.room(r, pasts[r], 64);
  std::vector<std::int64_t> past = pasts, cu = {0, 1, 2};
  kvc::PagedIndices writes(none.size());
  for (auto& w : writes) w.reserve(2);
  kvc::HostTensor<float> out;
  const auto step = [&] {
    for (auto& w : writes) w.clear();
    for (std::size_t r = 0; r < 2; ++r)
      setup.cache.extend_read_and_write_indices(setup.ids[r], past[r], 1, nullptr, writes);
    const kvc::PagedAttentionStep layout{setup.ids, cu, past};
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      kvc::paged_attention(setup.cache, layer, layout, view(q), view(k), view(v), out, {pool, &ws});
      setup.cache.update(view(k), view(v), layer, none, writes);
    }
    for (auto& p : past) ++p;
  };
  step();
  CHECK(count_allocations([&] {
          for (int i = 0; i < 40; ++i) step();
        }) == 0);
}
