// kvc_bench_append: one-token decode appends to 32 layers x 8 KV heads x head_dim 128 (float).
//
//   step/<cache>/S:<n>     one decode step (32 `update`s of [1, 8, 1, 128]) at sequence position ~S.
//                          The cache is pre-filled to S outside the timing; every kRestoreEvery steps
//                          the position goes back to S, untimed (crop(-n), set_write_position(S), or
//                          nothing for a sliding cache whose window is full: it is in a steady state,
//                          the same for every S >= the window).
//   decode1024/<cache>     1024 decode steps from an empty cache (its construction is not timed).
//   concat_*               the baseline: transformers' DynamicLayer, `torch.cat` on every step
//                          (allocate S + 1 tokens, copy the history and the new token, free the old).
//   memcpy/*               this machine's copy bandwidth: one bulk 64 MiB memcpy, and the append
//                          pattern itself (32 layers x {K, V} x 8 heads x 512 bytes into [heads,
//                          capacity, head_dim] buffers), with nothing else around it.
//
// After the google-benchmark output, a summary table prints per cache: the step time at S = 64
// and S = 1024 and their ratio (near 1: no O(S) copying), the append bandwidth as a fraction of
// the memcpy bandwidths, and the speed-up over the re-concatenation baseline. All times used are
// the benchmark thread's CPU time (google benchmark's default): the machines this runs on are
// often shared, and wall-clock time (the "Time" column) then mostly measures the neighbours.
// A `--benchmark_min_time` default of 0.1 s keeps the whole run under a minute on 2 cores (the
// baseline's 1024 steps take about 20 s of it); pass your own to override it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <map>
#include <memory>
#include <new>
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

using kvc_bench::Input;

constexpr std::int64_t kLayers = 32;
constexpr std::int64_t kHeads = 8;
constexpr std::int64_t kHeadDim = 128;
constexpr std::int64_t kTokenBytes =
    kHeads * kHeadDim * static_cast<std::int64_t>(sizeof(float));  // one K or V row set
constexpr std::int64_t kStepBytes = 2 * kLayers * kTokenBytes;     // appended per decode step: 256 KiB
constexpr std::int64_t kWindow = 256;                              // sliding window of the sliding caches
constexpr std::int64_t kStaticMaxLen = 2048;                       // StaticCache max_cache_len in the step benchmarks
constexpr std::int64_t kRestoreEvery = 64;                         // steps between two (untimed) returns to position S
constexpr std::int64_t kDecodeSteps = 1024;

// ---- inputs ----------------------------------------------------------------------------------

Input random_tensor(std::int64_t seq, std::uint32_t seed) {
  Input t(1, kHeads, seq, kHeadDim);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] = dist(gen);
  return t;
}

// One [1, 8, 1, 128] key and value per layer, as a model's layers would produce them.
struct StepInputs {
  std::vector<Input> keys, values;
  StepInputs() {
    for (std::int64_t l = 0; l < kLayers; ++l) {
      keys.push_back(random_tensor(1, static_cast<std::uint32_t>(2 * l)));
      values.push_back(random_tensor(1, static_cast<std::uint32_t>(2 * l + 1)));
    }
  }
};

const StepInputs& step_inputs() {
  static const StepInputs inputs;
  return inputs;
}

template <class C>
void decode_step(C& cache, const StepInputs& in) {
  for (std::int64_t l = 0; l < kLayers; ++l) {
    auto kv = cache.update(in.keys[static_cast<std::size_t>(l)], in.values[static_cast<std::size_t>(l)], l);
    benchmark::DoNotOptimize(kv.keys.ptr);
    benchmark::DoNotOptimize(kv.values.ptr);
  }
}

// A prompt of S tokens, one [1, 8, S, 128] update per layer.
template <class C>
void prefill(C& cache, std::int64_t s) {
  if (s == 0) return;
  const Input k = random_tensor(s, 1000);
  const Input v = random_tensor(s, 1001);
  for (std::int64_t l = 0; l < kLayers; ++l) cache.update(k, v, l);
}

// ---- the caches --------------------------------------------------------------------------------

kvc::ModelConfig model_config(bool sliding) {
  kvc::ModelConfig c;
  c.num_hidden_layers = kLayers;
  c.num_attention_heads = 32;
  c.num_key_value_heads = kHeads;
  c.head_dim = kHeadDim;
  c.hidden_size = 32 * kHeadDim;
  if (sliding) c.sliding_window = kWindow;
  return c;
}

struct DynamicKind {
  static constexpr const char* name = "DynamicCache";
  static constexpr bool sliding = false;
  static kvc::DynamicCache<float> make(std::int64_t) { return {}; }
  static void restore(kvc::DynamicCache<float>& c, std::int64_t, std::int64_t n) { c.crop(-n); }  // O(1)
};

struct DynamicSlidingKind {
  static constexpr const char* name = "DynamicSliding(w=256)";
  static constexpr bool sliding = true;
  static kvc_bench::ConfiguredDynamic make(std::int64_t) { return kvc::make_dynamic_cache<float>(model_config(true)); }
  static void restore(kvc_bench::ConfiguredDynamic& c, std::int64_t s, std::int64_t n) {
    if (s + n < kWindow) c.crop(-n);  // window not reached yet: O(1) crop
    // else: the window is full and each step evicts one token, a steady state; crop would throw
    // (it needs activate_past_recording, which keeps every token).
  }
};

struct StaticKind {
  static constexpr const char* name = "StaticCache";
  static constexpr bool sliding = false;
  static kvc::StaticCache<float> make(std::int64_t max_len) { return {model_config(false), max_len}; }
  static void restore(kvc::StaticCache<float>& c, std::int64_t s, std::int64_t) { c.set_write_position(s); }
};

struct StaticSlidingKind {
  static constexpr const char* name = "StaticSliding(w=256)";
  static constexpr bool sliding = true;
  static kvc::StaticCache<float> make(std::int64_t max_len) { return {model_config(true), max_len}; }
  static void restore(kvc::StaticCache<float>& c, std::int64_t s, std::int64_t) {
    if (s >= kWindow) return;  // full window: steady state
    c.reset();                 // no write position on sliding layers: zero and prefill again
    prefill(c, s);
  }
};

static_assert(kRestoreEvery + 64 < kWindow, "DynamicSlidingKind::restore crops below the window at S = 64");

// ---- per-step time at position S ----------------------------------------------------------------

template <class Kind>
void BM_Step(benchmark::State& state) {
  const std::int64_t s = state.range(0);
  const StepInputs& in = step_inputs();
  auto cache = Kind::make(kStaticMaxLen);
  prefill(cache, s);
  // Untimed warm-up: settles a dynamic cache's capacity and touches the pages the timed steps will
  // write (a sliding cache past its window walks through its whole buffer: one pass over it).
  const bool walks = Kind::sliding && s >= kWindow;
  const std::int64_t warm = walks ? std::max(kRestoreEvery, cache.bytes() / kStepBytes) : kRestoreEvery;
  for (std::int64_t i = 0; i < warm; ++i) decode_step(cache, in);
  Kind::restore(cache, s, kRestoreEvery);

  std::int64_t since_restore = 0;
  for (auto _ : state) {
    decode_step(cache, in);
    if (++since_restore == kRestoreEvery) {
      state.PauseTiming();
      Kind::restore(cache, s, since_restore);
      since_restore = 0;
      state.ResumeTiming();
    }
  }
  state.SetBytesProcessed(state.iterations() * kStepBytes);
  state.counters["cache_MiB"] = static_cast<double>(cache.bytes()) / (1 << 20);
}

// ---- 1024 decode steps from an empty cache --------------------------------------------------------

// This thread's CPU time in seconds: the machine may be shared, so all times here are CPU times
// (google benchmark's default; its "Time" column still shows the wall-clock time).
double thread_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

struct HalfTimes {
  double first = 0, second = 0;  // seconds spent in steps [0, 512) and [512, 1024)
};

void report_decode(benchmark::State& state, const HalfTimes& t) {
  const auto runs = static_cast<double>(state.iterations());
  const double half = static_cast<double>(kDecodeSteps / 2);
  state.counters["us/step_first512"] = 1e6 * t.first / runs / half;
  state.counters["us/step_last512"] = 1e6 * t.second / runs / half;
  state.counters["growth"] = t.second / t.first;
  state.SetBytesProcessed(state.iterations() * kDecodeSteps * kStepBytes);
}

template <class Kind>
void BM_Decode(benchmark::State& state) {
  const StepInputs& in = step_inputs();
  HalfTimes t;
  for (auto _ : state) {
    state.PauseTiming();
    std::optional<decltype(Kind::make(kDecodeSteps))> cache(Kind::make(kDecodeSteps));
    // Static caches allocate (and zero) their buffers here instead of in the first update;
    // dynamic caches only record the shape.
    cache->early_initialization(1, kHeads, kHeadDim);
    state.ResumeTiming();
    const double t0 = thread_seconds();
    for (std::int64_t i = 0; i < kDecodeSteps / 2; ++i) decode_step(*cache, in);
    const double t1 = thread_seconds();
    for (std::int64_t i = kDecodeSteps / 2; i < kDecodeSteps; ++i) decode_step(*cache, in);
    const double t2 = thread_seconds();
    t.first += t1 - t0;
    t.second += t2 - t1;
    state.PauseTiming();
    cache.reset();
    state.ResumeTiming();
  }
  report_decode(state, t);
}

// ---- baseline: re-concatenate the whole history every step (torch.cat) ---------------------------

struct aligned_free {
  void operator()(float* p) const noexcept { ::operator delete(p, std::align_val_t{64}); }
};
using buffer = std::unique_ptr<float, aligned_free>;
buffer alloc_floats(std::int64_t n) {  // uninitialized, like torch.empty
  return buffer(static_cast<float*>(::operator new(sizeof(float) * static_cast<std::size_t>(n), std::align_val_t{64})));
}

// torch.cat([past, new], dim=-2) for one [1, heads, s, d] past and one [1, heads, 1, d] token.
buffer concat(const float* past, std::int64_t s, const float* token) {
  buffer out = alloc_floats(kHeads * (s + 1) * kHeadDim);
  for (std::int64_t h = 0; h < kHeads; ++h) {
    float* dst = out.get() + h * (s + 1) * kHeadDim;
    if (s > 0) std::memcpy(dst, past + h * s * kHeadDim, sizeof(float) * static_cast<std::size_t>(s * kHeadDim));
    std::memcpy(dst + s * kHeadDim, token + h * kHeadDim, sizeof(float) * kHeadDim);
  }
  return out;
}

// The step at position S: every layer builds its S + 1 tensors from the S-token history. The
// previous step's result is freed when replaced, as the old tensor is in transformers.
void BM_ConcatStep(benchmark::State& state) {
  const std::int64_t s = state.range(0);
  const StepInputs& in = step_inputs();
  std::vector<buffer> hist_k, hist_v, out_k(kLayers), out_v(kLayers);
  const Input past = random_tensor(s, 1000);
  for (std::int64_t l = 0; l < kLayers; ++l) {
    hist_k.push_back(alloc_floats(kHeads * s * kHeadDim));
    hist_v.push_back(alloc_floats(kHeads * s * kHeadDim));
    std::memcpy(hist_k.back().get(), past.data(), sizeof(float) * static_cast<std::size_t>(past.size()));
    std::memcpy(hist_v.back().get(), past.data(), sizeof(float) * static_cast<std::size_t>(past.size()));
  }
  for (auto _ : state) {
    for (std::size_t l = 0; l < static_cast<std::size_t>(kLayers); ++l) {
      out_k[l] = concat(hist_k[l].get(), s, in.keys[l].data());
      out_v[l] = concat(hist_v[l].get(), s, in.values[l].data());
      benchmark::DoNotOptimize(out_k[l].get());
      benchmark::DoNotOptimize(out_v[l].get());
    }
  }
  state.SetBytesProcessed(state.iterations() * kStepBytes);
}

void BM_ConcatDecode(benchmark::State& state) {
  const StepInputs& in = step_inputs();
  HalfTimes t;
  for (auto _ : state) {
    std::vector<buffer> k(kLayers), v(kLayers);
    auto step = [&](std::int64_t s) {
      for (std::size_t l = 0; l < static_cast<std::size_t>(kLayers); ++l) {
        k[l] = concat(k[l].get(), s, in.keys[l].data());
        v[l] = concat(v[l].get(), s, in.values[l].data());
        benchmark::DoNotOptimize(k[l].get());
      }
    };
    const double t0 = thread_seconds();
    for (std::int64_t i = 0; i < kDecodeSteps / 2; ++i) step(i);
    const double t1 = thread_seconds();
    for (std::int64_t i = kDecodeSteps / 2; i < kDecodeSteps; ++i) step(i);
    const double t2 = thread_seconds();
    t.first += t1 - t0;
    t.second += t2 - t1;
    state.PauseTiming();
    k.clear();
    v.clear();
    state.ResumeTiming();
  }
  report_decode(state, t);
}

// ---- memcpy references ----------------------------------------------------------------------------

// The append pattern with nothing around it: each step copies 32 layers x {K, V} x 8 heads x
// 512 bytes to slot `pos` of [heads, capacity, head_dim] buffers; pos cycles over `cycle` slots
// (64: the step benchmarks' working set; = capacity: every step writes cold memory).
void BM_MemcpyScattered(benchmark::State& state) {
  const std::int64_t cycle = state.range(0);
  const std::int64_t capacity = state.range(1);
  // A size the compiler cannot see: glibc's memcpy, as the cache's copy_2d calls it (a constant
  // 512 would be expanded inline, e.g. to `rep movsq`, and measure something else).
  std::size_t row_bytes = sizeof(float) * kHeadDim;
  benchmark::DoNotOptimize(row_bytes);
  const StepInputs& in = step_inputs();
  std::vector<buffer> dst;
  for (std::int64_t i = 0; i < 2 * kLayers; ++i) {
    dst.push_back(alloc_floats(kHeads * capacity * kHeadDim));
    std::memset(dst.back().get(), 0, sizeof(float) * static_cast<std::size_t>(kHeads * capacity * kHeadDim));
  }
  std::int64_t pos = 0;
  for (auto _ : state) {
    for (std::size_t l = 0; l < static_cast<std::size_t>(kLayers); ++l) {
      for (std::size_t kv = 0; kv < 2; ++kv) {
        float* d = dst[2 * l + kv].get();
        const float* src = (kv == 0 ? in.keys[l] : in.values[l]).data();
        for (std::int64_t h = 0; h < kHeads; ++h)
          std::memcpy(d + (h * capacity + pos) * kHeadDim, src + h * kHeadDim, row_bytes);
      }
    }
    benchmark::ClobberMemory();
    if (++pos == cycle) pos = 0;
  }
  state.SetBytesProcessed(state.iterations() * kStepBytes);
}

// ---- summary ------------------------------------------------------------------------------------

// The console output, plus every result kept by name for the summary.
class SummaryReporter : public kvc_bench::ResultsReporter {
 public:
  void print_summary(const std::vector<std::string>& caches) const {
    const kvc_bench::Result* bulk = find("memcpy/bulk/MiB:64");
    const kvc_bench::Result* scat = find("memcpy/scattered/cycle:64/capacity:2048");
    const kvc_bench::Result* cold = find("memcpy/scattered/cycle:2048/capacity:2048");
    const kvc_bench::Result* base1024 = find("concat_step/S:1024");
    const kvc_bench::Result* base_dec = find("concat_decode1024");
    auto gbs = [](const kvc_bench::Result* r) { return r ? r->bytes_per_second / 1e9 : NAN; };
    std::printf(
        "\n==== kvc append summary: %lld layers x %lld KV heads x head_dim %lld, float; %lld KiB appended/step\n",
        static_cast<long long>(kLayers), static_cast<long long>(kHeads), static_cast<long long>(kHeadDim),
        static_cast<long long>(kStepBytes >> 10));
    std::printf(
        "memcpy: bulk 64 MiB %.2f GB/s | append pattern, 64-slot cycle %.2f GB/s | cold (2048 slots) %.2f GB/s\n",
        gbs(bulk), gbs(scat), gbs(cold));
    std::printf("%-22s %9s %9s %7s %8s %7s %7s %8s %9s %7s %8s\n", "cache", "S=64 us", "S=1024us", "1024/64", "GB/s@1k",
                "/patt", "/bulk", "concat/x", "run1024ms", "growth", "concat/x");
    auto row = [&](const std::string& label, const kvc_bench::Result* s64, const kvc_bench::Result* s1k,
                   const kvc_bench::Result* dec) {
      auto us = [](const kvc_bench::Result* r) { return r ? 1e6 * r->seconds : NAN; };
      auto ratio = [](const kvc_bench::Result* a, const kvc_bench::Result* b) {
        return a && b ? a->seconds / b->seconds : NAN;
      };
      const double bw = gbs(s1k);
      std::printf("%-22s %9.2f %9.2f %7.2f %8.2f %7.2f %7.2f %8.1f %9.1f %7.2f %8.1f\n", label.c_str(), us(s64),
                  us(s1k), ratio(s1k, s64), bw, bw / gbs(scat), bw / gbs(bulk), ratio(base1024, s1k),
                  dec ? 1e3 * dec->seconds : NAN, dec ? dec->counters.at("growth") : NAN, ratio(base_dec, dec));
    };
    for (const std::string& c : caches)
      row(c, find("step/" + c + "/S:64"), find("step/" + c + "/S:1024"), find("decode1024/" + c));
    row("concat baseline", find("concat_step/S:64"), base1024, base_dec);
    std::printf(
        "CPU times. columns: step time at S=64 and S=1024 and their ratio; append GB/s at S=1024 and as a fraction of the\n"
        "append-pattern memcpy and of bulk memcpy; baseline step time / this step time at S=1024; 1024 decode\n"
        "steps from empty: total ms, growth = time(steps 512..1023) / time(steps 0..511), baseline / this.\n");

    // Issue #3's targets, for DynamicCache (the cache they name) and, for the append one, every cache.
    const kvc_bench::Result* d64 = find("step/DynamicCache/S:64");
    const kvc_bench::Result* d1k = find("step/DynamicCache/S:1024");
    const double growth = d64 && d1k ? d1k->seconds / d64->seconds : NAN;
    std::printf("\n-- target: DynamicCache step time at S=1024 <= 1.2x S=64: %.2fx  %s\n", growth,
                growth <= 1.2 ? "met" : "MISSED");
    std::printf(
        "-- target: decode append >= 0.60 of memcpy bandwidth (at S=1024; of the append-pattern memcpy | of bulk memcpy):\n");
    for (const std::string& c : caches) {
      const double bw = gbs(find("step/" + c + "/S:1024"));
      std::printf("   %-22s %.2f %s | %.2f %s\n", c.c_str(), bw / gbs(scat), bw / gbs(scat) >= 0.6 ? "met" : "MISSED",
                  bw / gbs(bulk), bw / gbs(bulk) >= 0.6 ? "met" : "MISSED");
    }
  }
};

template <class Kind>
void register_cache(std::vector<std::string>& names) {
  names.emplace_back(Kind::name);
  benchmark::RegisterBenchmark((std::string("step/") + Kind::name).c_str(), BM_Step<Kind>)
      ->ArgName("S")
      ->Arg(64)
      ->Arg(256)
      ->Arg(1024)
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark((std::string("decode1024/") + Kind::name).c_str(), BM_Decode<Kind>)
      ->Unit(benchmark::kMillisecond);
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<char*> args(argv, argv + argc);
  std::string min_time = "--benchmark_min_time=0.1";
  if (std::none_of(args.begin(), args.end(),
                   [](const char* a) { return std::string_view(a).starts_with("--benchmark_min_time"); }))
    args.insert(args.begin() + 1, min_time.data());
  int n = static_cast<int>(args.size());

  benchmark::RegisterBenchmark("memcpy/bulk", kvc_bench::memcpy_bulk)
      ->ArgName("MiB")
      ->Arg(64)
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("memcpy/scattered", BM_MemcpyScattered)
      ->ArgNames({"cycle", "capacity"})
      ->Args({kRestoreEvery, kStaticMaxLen})
      ->Args({kStaticMaxLen, kStaticMaxLen})
      ->Unit(benchmark::kMicrosecond);
  std::vector<std::string> caches;
  register_cache<DynamicKind>(caches);
  register_cache<DynamicSlidingKind>(caches);
  register_cache<StaticKind>(caches);
  register_cache<StaticSlidingKind>(caches);
  benchmark::RegisterBenchmark("concat_step", BM_ConcatStep)
      ->ArgName("S")
      ->Arg(64)
      ->Arg(256)
      ->Arg(1024)  // S = 4096 takes seconds per step here
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("concat_decode1024", BM_ConcatDecode)->Unit(benchmark::kMillisecond);

  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 1;
  SummaryReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  reporter.print_summary(caches);
  benchmark::Shutdown();
  return 0;
}
