// kvc_bench_decode: decode attention over kvc caches, the per-step decode time of each cache, and
// the K/V memory each cache holds per token. Model shape: 8 query heads, 2 KV heads (GQA), batch 1,
// head_dim 128 (attention also 64); one thread (Eigen uses threads only with OpenMP, which this
// build does not enable: the context lines `eigen_threads` and `openmp` of the output say so).
//
//   attention/<T>/D:<d>/S:<s>  one decode step's attention (1 query token) with
//                              kvc::scaled_dot_product_attention over the views of a DynamicCache<T>
//                              filled with s tokens. The benchmark cycles over as many layers as
//                              make a working set of >= kColdBytes (far above the last-level cache),
//                              so every step reads its K/V from memory, as a model's decode step
//                              does. bytes_per_second = K and V bytes read (2 * 2 * s * d * sizeof(T)).
//   memcpy/bulk/MiB:64         this machine's copy bandwidth (bytes copied per second), the reference
//                              the attention bandwidth is a fraction of; read/MiB:64: a plain
//                              read-only pass (sum of floats), an upper bound for any read.
//   step/<cache>/S:<s>         one decode step through 4 layers at position ~s: for each layer
//                              kvc::attend (get_mask_sizes, update with one token, attention over the
//                              returned views). Every kRestoreEvery steps the cache goes back to
//                              position s, untimed (crop, set_write_position, a snapshot copy, or
//                              nothing for a sliding cache past its window: a steady state).
//   memory/<cache>/<T>/tokens:n  a 4-layer cache after a 128-token prompt and single-token decode
//                              steps up to n tokens: counters bytes_per_token = cache.bytes() / n,
//                              ideal_bytes_per_token (K and V of every layer, nothing else) and their
//                              ratio. Not a timing (one iteration).
//
// After the google-benchmark output, a summary prints the tables of docs/benchmarks.md. Times are
// the benchmark thread's CPU time (google benchmark's default), as in kvc_bench_append.
// `--benchmark_min_time` defaults to 0.1 s; pass your own to override it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <unistd.h>

#include <benchmark/benchmark.h>

#include "instantiations.hpp"
#include "bench_common.hpp"

namespace {

using kvc_bench::bf16;

constexpr std::int64_t kQueryHeads = 8;
constexpr std::int64_t kKVHeads = 2;
constexpr std::int64_t kColdBytes = std::int64_t{160} << 20;  // attention working set: > 3x a 48 MiB L3
constexpr std::int64_t kStepLayers = 4;
constexpr std::int64_t kStepHeadDim = 128;
constexpr std::int64_t kWindow = 512;               // sliding window of the sliding caches
constexpr std::int64_t kStaticMaxLen = 8192 + 256;  // StaticCache max_cache_len: S + warm-up + restore period
constexpr std::int64_t kRestoreEvery = 64;
constexpr std::int64_t kPrompt = 128;  // memory/*: prompt before the decode steps

template <class T>
const char* type_name() {
  return std::is_same_v<T, float> ? "float" : "bf16";
}

// ---- inputs ----------------------------------------------------------------------------------

template <class T>
kvc::HostTensor<T> random_tensor(std::int64_t heads, std::int64_t seq, std::int64_t d, std::uint32_t seed) {
  kvc::HostTensor<T> t(1, heads, seq, d);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] = static_cast<T>(dist(gen));
  return t;
}

// ---- memcpy / read references ------------------------------------------------------------------

void BM_Read(benchmark::State& state) {
  const std::int64_t n = state.range(0) << 20;
  const Eigen::ArrayXf src = Eigen::ArrayXf::Constant(n / static_cast<std::int64_t>(sizeof(float)), 1.f);
  for (auto _ : state) {
    float sum = src.sum();
    benchmark::DoNotOptimize(sum);
  }
  state.SetBytesProcessed(state.iterations() * n);
}

// ---- (b) decode attention over a filled cache -----------------------------------------------------

template <class T>
void BM_Attention(benchmark::State& state) {
  const std::int64_t d = state.range(0), s = state.range(1);
  const std::int64_t layer_bytes = 2 * kKVHeads * s * d * static_cast<std::int64_t>(sizeof(T));
  const std::int64_t layers = std::max<std::int64_t>(1, (kColdBytes + layer_bytes - 1) / layer_bytes);
  kvc::DynamicCache<T> cache;
  {
    const auto k = random_tensor<T>(kKVHeads, s, d, 1), v = random_tensor<T>(kKVHeads, s, d, 2);
    for (std::int64_t l = 0; l < layers; ++l) cache.update(k, v, l);  // capacity == s: no slack
  }
  std::vector<kvc::KV<kvc::TensorView<T>>> views;
  for (std::int64_t l = 0; l < layers; ++l) views.push_back(cache.stored(l));
  const auto q = random_tensor<T>(kQueryHeads, 1, d, 3);
  // The query is the newest token, position s - 1: it sees all s keys.
  const kvc::AttentionMask mask{s, 0, s - 1, std::nullopt, true};
  std::size_t l = 0;
  for (auto _ : state) {
    auto out = kvc::scaled_dot_product_attention(q, views[l].keys, views[l].values, mask);
    benchmark::DoNotOptimize(out.data());
    if (++l == views.size()) l = 0;
  }
  state.SetBytesProcessed(state.iterations() * layer_bytes);
  state.counters["kv_MiB"] = static_cast<double>(layer_bytes) / (1 << 20);
  state.counters["layers"] = static_cast<double>(layers);
}

// ---- (c) per-step decode time: append + attention through 4 layers ----------------------------------

kvc::ModelConfig step_config(std::optional<std::vector<std::string>> layer_types, bool sliding) {
  kvc::ModelConfig c;
  c.num_hidden_layers = kStepLayers;
  c.num_attention_heads = kQueryHeads;
  c.num_key_value_heads = kKVHeads;
  c.head_dim = kStepHeadDim;
  c.hidden_size = kQueryHeads * kStepHeadDim;
  if (sliding) c.sliding_window = kWindow;
  c.layer_types = std::move(layer_types);
  return c;
}

template <class T>
struct StepInputs {
  std::vector<kvc::HostTensor<T>> q, k, v;
  StepInputs() {
    for (std::int64_t l = 0; l < kStepLayers; ++l) {
      const auto seed = static_cast<std::uint32_t>(3 * l);
      q.push_back(random_tensor<T>(kQueryHeads, 1, kStepHeadDim, seed));
      k.push_back(random_tensor<T>(kKVHeads, 1, kStepHeadDim, seed + 1));
      v.push_back(random_tensor<T>(kKVHeads, 1, kStepHeadDim, seed + 2));
    }
  }
};

template <class T, class C>
void attend_step(C& cache, const StepInputs<T>& in) {
  for (std::int64_t l = 0; l < kStepLayers; ++l) {
    const auto i = static_cast<std::size_t>(l);
    auto out = kvc::attend(cache, l, in.q[i], in.k[i], in.v[i]);
    benchmark::DoNotOptimize(out.data());
  }
}

template <class T, class C>
void append_step(C& cache, const StepInputs<T>& in) {
  for (std::int64_t l = 0; l < kStepLayers; ++l) {
    auto kv = cache.update(in.k[static_cast<std::size_t>(l)], in.v[static_cast<std::size_t>(l)], l);
    benchmark::DoNotOptimize(kv.keys.ptr);
  }
}

// A prompt of s tokens: one [1, 2, s, 128] update per layer (no attention: only the cache matters).
template <class T, class C>
void prefill(C& cache, std::int64_t s) {
  if (s == 0) return;
  const auto k = random_tensor<T>(kKVHeads, s, kStepHeadDim, 1000);
  const auto v = random_tensor<T>(kKVHeads, s, kStepHeadDim, 1001);
  for (std::int64_t l = 0; l < kStepLayers; ++l) cache.update(k, v, l);
}

const std::vector<std::string> kHybridTypes{"sliding_attention", "full_attention", "sliding_attention",
                                            "full_attention"};

// Each kind: a name, how to build the cache, and how to go back to position s after n steps.
template <class T>
struct DynamicKind {
  static constexpr const char* name = "DynamicCache";
  static constexpr bool sliding = false;
  using cache_type = kvc::DynamicCache<T>;
  static cache_type make() { return {}; }
  static void restore(cache_type& c, std::int64_t, std::int64_t n, const std::optional<cache_type>&) { c.crop(-n); }
};

template <class T>
struct SlidingKind {  // make_dynamic_cache, every layer sliding (Mistral-style)
  static constexpr const char* name = "make_dynamic_cache(sliding,w=512)";
  static constexpr bool sliding = true;
  using cache_type = kvc::ConfiguredDynamicCache<T>;
  static cache_type make() { return kvc::make_dynamic_cache<T>(step_config(std::nullopt, true)); }
  static void restore(cache_type& c, std::int64_t s, std::int64_t n, const std::optional<cache_type>&) {
    if (s + n < kWindow) c.crop(-n);  // else: a full window is a steady state (and crop would throw)
  }
};

template <class T>
struct HybridKind {  // make_dynamic_cache, sliding and full layers alternating (Gemma-2-style)
  static constexpr const char* name = "make_dynamic_cache(hybrid,w=512)";
  static constexpr bool sliding = false;
  using cache_type = kvc::ConfiguredDynamicCache<T>;
  static cache_type make() { return kvc::make_dynamic_cache<T>(step_config(kHybridTypes, true)); }
  static void restore(cache_type& c, std::int64_t s, std::int64_t n, const std::optional<cache_type>& snapshot) {
    if (s + n < kWindow)
      c.crop(-n);
    else
      c = *snapshot;  // the sliding layers cannot crop past their window: copy the state at s back
  }
};

template <class T>
struct StaticKind {
  static constexpr const char* name = "StaticCache";
  static constexpr bool sliding = false;
  using cache_type = kvc::StaticCache<T>;
  static cache_type make() { return {step_config(std::nullopt, false), kStaticMaxLen}; }
  static void restore(cache_type& c, std::int64_t s, std::int64_t, const std::optional<cache_type>&) {
    c.set_write_position(s);
  }
};

template <class T>
struct StaticSlidingKind {
  static constexpr const char* name = "StaticCache(sliding,w=512)";
  static constexpr bool sliding = true;
  using cache_type = kvc::StaticCache<T>;
  static cache_type make() { return {step_config(std::nullopt, true), kStaticMaxLen}; }
  static void restore(cache_type& c, std::int64_t s, std::int64_t, const std::optional<cache_type>&) {
    if (s >= kWindow) return;  // full window: steady state
    c.reset();                 // no write position on sliding layers: zero and prefill again
    prefill<T>(c, s);
  }
};

template <class Kind>
void BM_Step(benchmark::State& state) {
  using C = typename Kind::cache_type;
  const std::int64_t s = state.range(0);
  const StepInputs<float> in;
  C cache = Kind::make();
  // Position s with a settled capacity: a prompt of s - 1 tokens and one decode step (a dynamic
  // layer doubles its capacity on it, so the timed steps do not pay a reallocation).
  prefill<float>(cache, s - 1);
  attend_step(cache, in);
  std::optional<C> snapshot;
  if (std::is_same_v<Kind, HybridKind<float>> && s + kRestoreEvery >= kWindow) snapshot.emplace(cache);
  // Untimed warm-up; a sliding cache past its window also walks once through its 2W-slot buffer.
  const std::int64_t warm = Kind::sliding && s >= kWindow ? 2 * kWindow + kRestoreEvery : kRestoreEvery;
  for (std::int64_t i = 0; i < warm; ++i) append_step(cache, in);
  Kind::restore(cache, s, warm, snapshot);

  std::int64_t since_restore = 0;
  for (auto _ : state) {
    attend_step(cache, in);
    if (++since_restore == kRestoreEvery) {
      state.PauseTiming();
      Kind::restore(cache, s, since_restore, snapshot);
      since_restore = 0;
      state.ResumeTiming();
    }
  }
  state.counters["cache_MiB"] = static_cast<double>(cache.bytes()) / (1 << 20);
}

// ---- (d) K/V bytes per token --------------------------------------------------------------------

template <class Kind, class T>
void BM_Memory(benchmark::State& state) {
  const std::int64_t n = state.range(0);
  const StepInputs<T> in;
  std::int64_t bytes = 0;
  for (auto _ : state) {
    auto cache = Kind::make();
    prefill<T>(cache, std::min(n, kPrompt));
    for (std::int64_t t = kPrompt; t < n; ++t) append_step(cache, in);
    bytes = cache.bytes();
  }
  const double ideal =
      static_cast<double>(kStepLayers * 2 * kKVHeads * kStepHeadDim * static_cast<std::int64_t>(sizeof(T)));
  const double per_token = static_cast<double>(bytes) / static_cast<double>(n);
  state.counters["bytes_per_token"] = per_token;
  state.counters["ideal_bytes_per_token"] = ideal;
  state.counters["vs_ideal"] = per_token / ideal;
}

// ---- summary ------------------------------------------------------------------------------------

// The console output, plus every result kept by name for the summary.
class SummaryReporter : public kvc_bench::ResultsReporter {
 public:
  void print_summary(const std::vector<std::string>& caches, const std::vector<std::int64_t>& attn_s,
                     const std::vector<std::int64_t>& step_s, const std::vector<std::int64_t>& mem_n) const {
    const kvc_bench::Result* memcpy_bulk = find("memcpy/bulk/MiB:64");
    const kvc_bench::Result* read = find("read/MiB:64");
    auto gbs = [](const kvc_bench::Result* r) { return r ? r->bytes_per_second / 1e9 : NAN; };
    const double mc = gbs(memcpy_bulk), rd = gbs(read);
    std::printf("\n==== kvc decode summary: %lld query heads, %lld KV heads, batch 1, one thread (Eigen SIMD: %s)\n",
                static_cast<long long>(kQueryHeads), static_cast<long long>(kKVHeads),
                Eigen::SimdInstructionSetsInUse());
    std::printf("memcpy 64 MiB: %.2f GB/s copied | read-only 64 MiB: %.2f GB/s\n", mc, rd);

    std::printf("\n-- decode attention (1 query token; K/V from memory: working set >= %lld MiB)\n",
                static_cast<long long>(kColdBytes >> 20));
    std::printf("%-6s %4s %6s %8s %8s %7s %8s %6s\n", "type", "D", "S", "us", "KV MiB", "GB/s", "/memcpy", "/read");
    for (const char* t : {"float", "bf16"})
      for (const std::int64_t d : {128, 64})
        for (const std::int64_t s : attn_s) {
          const kvc_bench::Result* r =
              find(std::string("attention/") + t + "/D:" + std::to_string(d) + "/S:" + std::to_string(s));
          if (!r) continue;
          const double g = gbs(r);
          std::printf("%-6s %4lld %6lld %8.1f %8.1f %7.2f %8.2f %6.2f\n", t, static_cast<long long>(d),
                      static_cast<long long>(s), 1e6 * r->seconds, r->counters.at("kv_MiB"), g, g / mc, g / rd);
        }

    std::printf("\n-- decode step: kvc::attend through %lld layers (append + attention), float, D=%lld; us per step\n",
                static_cast<long long>(kStepLayers), static_cast<long long>(kStepHeadDim));
    std::printf("%-34s", "cache");
    for (const std::int64_t s : step_s) std::printf(" %9s", ("S=" + std::to_string(s)).c_str());
    std::printf(" %9s\n", "8k/4k");
    for (const std::string& c : caches) {
      std::printf("%-34s", c.c_str());
      for (const std::int64_t s : step_s) {
        const kvc_bench::Result* r = find("step/" + c + "/S:" + std::to_string(s));
        std::printf(" %9.1f", r ? 1e6 * r->seconds : NAN);
      }
      const kvc_bench::Result* r8 = find("step/" + c + "/S:8192");
      const kvc_bench::Result* r4 = find("step/" + c + "/S:4096");
      std::printf(" %9.2f\n", r8 && r4 ? r8->seconds / r4->seconds : NAN);
    }

    std::printf(
        "\n-- K/V bytes per token (%lld layers; ideal = K and V only: %d B float, %d B bf16) after a %lld-token "
        "prompt and 1-token steps\n",
        static_cast<long long>(kStepLayers), static_cast<int>(kStepLayers * 2 * kKVHeads * kStepHeadDim * 4),
        static_cast<int>(kStepLayers * 2 * kKVHeads * kStepHeadDim * 2), static_cast<long long>(kPrompt));
    std::printf("%-34s %-6s", "cache", "type");
    for (const std::int64_t n : mem_n) std::printf(" %7s", ("n=" + std::to_string(n)).c_str());
    std::printf("\n");
    for (const char* t : {"float", "bf16"})
      for (const std::string& c : caches) {
        std::printf("%-34s %-6s", c.c_str(), t);
        for (const std::int64_t n : mem_n) {
          const kvc_bench::Result* r = find("memory/" + c + "/" + t + "/tokens:" + std::to_string(n));
          std::printf(" %7.0f", r ? r->counters.at("bytes_per_token") : NAN);
        }
        std::printf("\n");
      }

    const kvc_bench::Result* a8k = find("attention/float/D:128/S:8192");
    const double frac = gbs(a8k) / mc;
    std::printf("\n-- target: decode attention over an 8k-token float cache (D=128) >= 0.50 of memcpy: %.2f  %s\n",
                frac, !(frac >= 0.5) ? "MISSED" : "met");
    std::printf("(CPU times; the append targets are in kvc_bench_append's summary)\n");
  }
};

template <class T>
void register_attention(const std::vector<std::int64_t>& sizes) {
  for (const std::int64_t d : {128, 64})
    for (const std::int64_t s : sizes)
      benchmark::RegisterBenchmark((std::string("attention/") + type_name<T>()).c_str(), BM_Attention<T>)
          ->ArgNames({"D", "S"})
          ->Args({d, s})
          ->Unit(benchmark::kMicrosecond);
}

template <template <class> class Kind>
void register_cache(std::vector<std::string>& names, const std::vector<std::int64_t>& step_s,
                    const std::vector<std::int64_t>& mem_n) {
  const std::string name = Kind<float>::name;
  names.push_back(name);
  auto* step = benchmark::RegisterBenchmark(("step/" + name).c_str(), BM_Step<Kind<float>>);
  step->ArgName("S")->Unit(benchmark::kMicrosecond);
  for (const std::int64_t s : step_s) step->Arg(s);
  auto* mf = benchmark::RegisterBenchmark(("memory/" + name + "/float").c_str(), BM_Memory<Kind<float>, float>);
  auto* mb = benchmark::RegisterBenchmark(("memory/" + name + "/bf16").c_str(), BM_Memory<Kind<bf16>, bf16>);
  for (auto* m : {mf, mb}) {
    m->ArgName("tokens")->Iterations(1)->Unit(benchmark::kMillisecond);
    for (const std::int64_t n : mem_n) m->Arg(n);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args(argv, argv + argc);
  std::string min_time = "--benchmark_min_time=0.1";
  if (std::none_of(args.begin(), args.end(),
                   [](const char* a) { return std::string_view(a).starts_with("--benchmark_min_time"); }))
    args.insert(args.begin() + 1, min_time.data());
  int n = static_cast<int>(args.size());

#ifdef _OPENMP
  benchmark::AddCustomContext("openmp", "yes");
#else
  benchmark::AddCustomContext("openmp", "no");
#endif
  benchmark::AddCustomContext("eigen_threads", std::to_string(Eigen::nbThreads()));
  benchmark::AddCustomContext("eigen_simd", Eigen::SimdInstructionSetsInUse());

  const std::vector<std::int64_t> attn_s{1024, 4096, 8192, 32768};
  const std::vector<std::int64_t> step_s{64, 256, 1024, 4096, 8192};
  const std::vector<std::int64_t> mem_n{256, 512, 513, 1024, 1025, 2048, 2049, 4096, 4097, 8192};

  benchmark::RegisterBenchmark("memcpy/bulk", kvc_bench::memcpy_bulk)
      ->ArgName("MiB")
      ->Arg(64)
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("read", BM_Read)->ArgName("MiB")->Arg(64)->Unit(benchmark::kMicrosecond);
  register_attention<float>(attn_s);
  register_attention<bf16>(attn_s);
  std::vector<std::string> caches;
  register_cache<DynamicKind>(caches, step_s, mem_n);
  register_cache<SlidingKind>(caches, step_s, mem_n);
  register_cache<HybridKind>(caches, step_s, mem_n);
  register_cache<StaticKind>(caches, step_s, mem_n);
  register_cache<StaticSlidingKind>(caches, step_s, mem_n);

  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  SummaryReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.print_summary(caches, attn_s, step_s, mem_n);
  benchmark::Shutdown();
  return 0;
}
