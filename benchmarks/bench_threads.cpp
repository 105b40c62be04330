// kvc_bench_threads: host attention on 1 and 2 threads (kvc::OpenMPExecutor) with a kept
// workspace, against Eigen's float matrix product in the same binary. Attention shape of
// kvc_bench_decode: 8 query heads over 2 KV heads, head_dim 128, batch 1, float.
//
//   decode/threads:t/S:s      one decode step's attention (1 query token over s keys), cycling over
//                             as many layers' K/V as make >= 160 MiB, so that every step reads its
//                             keys from memory. Counter minor_faults: page faults per step
//                             (getrusage), 0 once the workspace and output have their room.
//   prefill/threads:t/tokens:n  causal attention of n tokens over themselves (a prompt's prefill).
//                             Counter flops: floating-point operations per second, 4 * heads *
//                             head_dim * n (n + 1) / 2 per call (the two products over the visible
//                             keys).
//   decode_quantized/threads:t/S:s/kv_heads:h  one decode step of kvc::attend_quantized (int4 keys
//                             and values, QuantoQuantizedLayer's defaults; 8 query heads over h KV
//                             heads) over s to s + 128 tokens of context: the step's append
//                             included, the cache rebuilt (untimed) every 128 steps. Not in a tree
//                             without the executors.
//   gemm/threads:t            Eigen's float product of 1024 x 1024 matrices (Eigen::setNbThreads(t)):
//                             the FLOP/s the prefill is compared with.
//
// Times are wall-clock (UseRealTime): the threads' work counts. Compiled against a tree without
// <kvc/execution.hpp> (kvc before the executors) it measures that tree's serial attention at every
// thread count, for old-against-new runs.
#include <sys/resource.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include <benchmark/benchmark.h>

#include <kvc/kvc.hpp>

#if __has_include(<kvc/execution.hpp>)
#include <kvc/execution.hpp>
#include <kvc/quantized_attention.hpp>
#define KVC_BENCH_HAS_EXECUTORS 1
#endif

namespace {

constexpr std::int64_t kHeads = 8, kKVHeads = 2, kDim = 128;
constexpr std::int64_t kColdBytes = std::int64_t{160} << 20;

kvc::HostTensor<float> random_tensor(std::int64_t heads, std::int64_t seq, std::uint32_t seed) {
  kvc::HostTensor<float> t(1, heads, seq, kDim);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] = dist(gen);
  return t;
}

kvc::TensorView<float> view(const kvc::HostTensor<float>& t) { return kvc::HostStorage<float>::input_view(t); }

long minor_faults() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_minflt;
}

// Attention into `out` on `threads` threads (the old tree, or a build without OpenMP: serially).
struct runner {
#if defined(KVC_BENCH_HAS_EXECUTORS)
#if defined(_OPENMP)
  kvc::OpenMPExecutor executor;
  explicit runner(int threads) : executor{threads} {}
#else
  kvc::SerialExecutor executor;
  explicit runner(int) {}
#endif
  kvc::AttentionWorkspace workspace;
  void operator()(const kvc::HostTensor<float>& q, const kvc::HostTensor<float>& k, const kvc::HostTensor<float>& v,
                  const kvc::AttentionMask& mask, kvc::HostTensor<float>& out) {
    kvc::scaled_dot_product_attention(view(q), view(k), view(v), mask, out, {executor, &workspace});
  }
#else
  explicit runner(int) {}
  void operator()(const kvc::HostTensor<float>& q, const kvc::HostTensor<float>& k, const kvc::HostTensor<float>& v,
                  const kvc::AttentionMask& mask, kvc::HostTensor<float>& out) {
    out = kvc::scaled_dot_product_attention(view(q), view(k), view(v), mask);
  }
#endif
};

void BM_Decode(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const std::int64_t s = state.range(1);
  const std::int64_t layer_bytes = 2 * kKVHeads * s * kDim * static_cast<std::int64_t>(sizeof(float));
  const std::int64_t layers = std::max<std::int64_t>(1, (kColdBytes + layer_bytes - 1) / layer_bytes);
  std::vector<kvc::HostTensor<float>> keys, values;
  for (std::int64_t l = 0; l < layers; ++l) {
    keys.push_back(random_tensor(kKVHeads, s, static_cast<std::uint32_t>(2 * l)));
    values.push_back(random_tensor(kKVHeads, s, static_cast<std::uint32_t>(2 * l + 1)));
  }
  const auto q = random_tensor(kHeads, 1, 7);
  const kvc::AttentionMask mask{s, 0, s - 1};
  runner run(threads);
  kvc::HostTensor<float> out;
  for (std::int64_t l = 0; l < std::min<std::int64_t>(layers, 4); ++l) run(q, keys[l], values[l], mask, out);  // warm
  std::int64_t l = 0;
  const long faults = minor_faults();
  for (auto _ : state) {
    run(q, keys[static_cast<std::size_t>(l)], values[static_cast<std::size_t>(l)], mask, out);
    benchmark::DoNotOptimize(out.data());
    l = (l + 1) % layers;
  }
  state.counters["minor_faults"] =
      static_cast<double>(minor_faults() - faults) / static_cast<double>(std::max<std::int64_t>(state.iterations(), 1));
  state.SetBytesProcessed(state.iterations() * layer_bytes);
}

void BM_Prefill(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const std::int64_t n = state.range(1);
  const auto q = random_tensor(kHeads, n, 1), k = random_tensor(kKVHeads, n, 2), v = random_tensor(kKVHeads, n, 3);
  const kvc::AttentionMask mask{n, 0, 0};
  runner run(threads);
  kvc::HostTensor<float> out;
  run(q, k, v, mask, out);
  for (auto _ : state) {
    run(q, k, v, mask, out);
    benchmark::DoNotOptimize(out.data());
  }
  const double flops = 4.0 * kHeads * kDim * static_cast<double>(n) * static_cast<double>(n + 1) / 2;
  state.counters["flops"] = benchmark::Counter(flops, benchmark::Counter::kIsIterationInvariantRate);
}

#if defined(KVC_BENCH_HAS_EXECUTORS)
void BM_DecodeQuantized(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const std::int64_t s = state.range(1), kv_heads = state.range(2);
  using Cache = kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>, kvc::HostStorage<float>>;
  const auto prompt_q = random_tensor(kHeads, s, 1), prompt_k = random_tensor(kv_heads, s, 2),
             prompt_v = random_tensor(kv_heads, s, 3);
  const auto q = random_tensor(kHeads, 1, 4), k = random_tensor(kv_heads, 1, 5), v = random_tensor(kv_heads, 1, 6);
  runner run(threads);
  kvc::AttendOptions options;
  options.context = {run.executor, &run.workspace};
  kvc::HostTensor<float> out;
  std::optional<Cache> cache;
  const auto rebuild = [&] {
    cache.emplace(kvc::QuantoQuantizedLayer{});
    kvc::attend_quantized(*cache, 0, view(prompt_q), view(prompt_k), view(prompt_v), out, options);
  };
  rebuild();
  std::int64_t steps = 0;
  for (auto _ : state) {
    if (steps++ % 128 == 127) {
      state.PauseTiming();
      rebuild();
      state.ResumeTiming();
    }
    kvc::attend_quantized(*cache, 0, view(q), view(k), view(v), out, options);
    benchmark::DoNotOptimize(out.data());
  }
}
#endif

void BM_Gemm(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  Eigen::setNbThreads(threads);
  const std::int64_t n = 1024;
  const Eigen::MatrixXf a = Eigen::MatrixXf::Random(n, n), b = Eigen::MatrixXf::Random(n, n);
  Eigen::MatrixXf c(n, n);
  for (auto _ : state) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
  }
  Eigen::setNbThreads(0);
  state.counters["flops"] =
      benchmark::Counter(2.0 * static_cast<double>(n * n * n), benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

int main(int argc, char** argv) {
  for (const int t : {1, 2}) {
    auto* d = benchmark::RegisterBenchmark("decode", BM_Decode)->ArgNames({"threads", "S"});
    for (const std::int64_t s : {128, 512, 2048, 8192}) d->Args({t, s});
    d->UseRealTime()->Unit(benchmark::kMicrosecond);
#if defined(KVC_BENCH_HAS_EXECUTORS)
    auto* dq =
        benchmark::RegisterBenchmark("decode_quantized", BM_DecodeQuantized)->ArgNames({"threads", "S", "kv_heads"});
    for (const std::int64_t h : {1, 2})
      for (const std::int64_t s : {2048, 8192}) dq->Args({t, s, h});
    dq->UseRealTime()->Unit(benchmark::kMicrosecond);
#endif
    auto* p = benchmark::RegisterBenchmark("prefill", BM_Prefill)->ArgNames({"threads", "tokens"});
    for (const std::int64_t n : {512, 2048, 8192}) p->Args({t, n});
    p->UseRealTime()->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark("gemm", BM_Gemm)
        ->ArgName("threads")
        ->Arg(t)
        ->UseRealTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
