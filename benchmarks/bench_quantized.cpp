// kvc_bench_quantized: the quantized cache (docs/quantized.md), measured side by side with a plain
// DynamicCache<float> of the same shape in the same run.
//
//   recon/<codec>/nbits:N/axis:A/<data>   relative RMS error of the dequantized history, for
//        [1, 8, 1024, 128] float K (gaussian, or gaussian with 4 of the 128 channels x20:
//        "outliers"), q_group_size 64: prefill, one decode step, compare the 1024 returned history
//        tokens with the inputs. Counter rel_rms. Timed: the two updates (mostly the quantization).
//   decode/<cache>     kLayers x [1, 8, 1, 128] float decode steps from a 512-token prefill, exactly
//        kSteps steps (so 2 quantizations with residual_length 128). Counters: steps_per_s,
//        out_GB/s (bytes of the dequantized K/V views returned per second), vs_dynamic (this
//        cache's step rate / DynamicCache's, printed in the summary).
//   memory/<codec>/nbits:N   Eigen::half K/V, [1, 8, 4096, 128] per layer, int-N group 64: a
//        4032-token prefill then 64 decode steps (the residual holds 64 tokens, half of
//        residual_length). Counters, as fractions of fp16 bytes: quantized = (codes + scales +
//        offsets) / fp16 bytes of the 4032 quantized tokens; held = (quantized + the residual's
//        allocated buffer) / fp16 bytes of all 4096 tokens; total = held + the dequantized
//        workspace the returned views point into, / the same.
//   attend/<cache>   a decode step with attention at 4096 tokens, Eigen::half, one layer of
//        [1, 8, S, 128] K/V and 32 query heads: a 4032-token prefill, then 64 steps of kvc::attend
//        (DynamicCache<half>; quanto int4 through update, transformers' path) or
//        kvc::attend_quantized (quanto int4 from the codes, no workspace; the same with
//        rotate_keys and rotate_values, "fused+rotated"; both also over 128 steps, a whole residual
//        cycle with its flush, "/128steps"; KIVI int2,
//        kvc::kivi_options()), or kvc::attend_fp8 (DynamicCache<float8_e4m3> / <float8_e5m2>, per-head
//        scales calibrated on the prefill). Counters: steps_per_s, held (the cache's bytes after the
//        steps, as a fraction of fp16 K/V of 4096 tokens).
//
// All times are the benchmark thread's CPU time.

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

#include <kvc/attention.hpp>
#include <kvc/caches.hpp>
#include <kvc/fp8_attention.hpp>
#include <kvc/quantized_attention.hpp>
#include <kvc/quantized_cache.hpp>

#include "bench_common.hpp"

namespace {

constexpr std::int64_t kHeads = 8;
constexpr std::int64_t kHeadDim = 128;
constexpr std::int64_t kLayers = 4;
constexpr std::int64_t kPrefill = 512;
constexpr std::int64_t kSteps = 256;

template <class T>
kvc::HostTensor<T> make_input(std::int64_t seq, std::uint32_t seed, std::int64_t outlier_channels = 0) {
  kvc::HostTensor<T> t(1, kHeads, seq, kHeadDim);
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (std::int64_t i = 0; i < t.size(); ++i)
    t.data()[i] = T(dist(gen) * (i % kHeadDim < outlier_channels ? 20.f : 1.f));
  return t;
}

kvc::ModelConfig config(std::int64_t layers) {
  kvc::ModelConfig c;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 32;
  c.num_key_value_heads = kHeads;
  c.head_dim = kHeadDim;
  c.hidden_size = 32 * kHeadDim;
  return c;
}

const char* backend_of(bool hqq) { return hqq ? "hqq" : "quanto"; }

// ---- reconstruction ------------------------------------------------------------------------------

void BM_Recon(benchmark::State& state, bool hqq, std::int64_t nbits, std::int64_t axis, bool outliers) {
  const auto k = make_input<float>(1024, 1, outliers ? 4 : 0);
  const auto tok = make_input<float>(1, 2, outliers ? 4 : 0);
  double err = 0;
  for (auto _ : state) {
    kvc::QuantizedCache<float> cache(backend_of(hqq), config(1), {nbits, axis, axis, 64, 128});
    cache.update(k, k, 0);
    const auto kv = cache.update(tok, tok, 0);
    double num = 0, den = 0;
    for (std::int64_t h = 0; h < kHeads; ++h)
      for (std::int64_t s = 0; s < 1024; ++s)
        for (std::int64_t d = 0; d < kHeadDim; ++d) {
          const double w = k(0, h, s, d), e = kv.keys(0, h, s, d) - w;
          num += e * e;
          den += w * w;
        }
    err = std::sqrt(num / den);
  }
  state.counters["rel_rms"] = err;
}

// ---- decode throughput ---------------------------------------------------------------------------

template <class Cache>
void decode_run(benchmark::State& state, Cache make()) {
  std::vector<kvc::HostTensor<float>> keys, values;
  for (std::int64_t l = 0; l < kLayers; ++l) {
    keys.push_back(make_input<float>(1, static_cast<std::uint32_t>(10 + 2 * l)));
    values.push_back(make_input<float>(1, static_cast<std::uint32_t>(11 + 2 * l)));
  }
  const auto prefill = make_input<float>(kPrefill, 3);
  double out_bytes = 0;
  for (auto _ : state) {
    state.PauseTiming();
    Cache cache = make();
    for (std::int64_t l = 0; l < kLayers; ++l) cache.update(prefill, prefill, l);
    state.ResumeTiming();
    for (std::int64_t step = 0; step < kSteps; ++step)
      for (std::int64_t l = 0; l < kLayers; ++l) {
        const auto kv = cache.update(keys[static_cast<std::size_t>(l)], values[static_cast<std::size_t>(l)], l);
        benchmark::DoNotOptimize(kv.keys.ptr);
        out_bytes += static_cast<double>(2 * kv.keys.size()) * sizeof(float);
      }
  }
  state.counters["steps_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * kSteps), benchmark::Counter::kIsRate);
  state.counters["out_GB/s"] = benchmark::Counter(out_bytes / 1e9, benchmark::Counter::kIsRate);
}

kvc::DynamicCache<float> make_dynamic() { return {}; }
template <bool Hqq, std::int64_t Nbits, std::int64_t Axis>
kvc::QuantizedCache<float> make_quantized() {
  return {backend_of(Hqq), config(kLayers), {Nbits, Axis, Axis, 64, 128}};
}

// ---- decode with attention at 4k tokens ----------------------------------------------------------

enum class AttendMode { dynamic, quantized_update, quantized_fused, quantized_rotated, kivi_fused, fp8_e4m3, fp8_e5m2 };

void BM_Attend(benchmark::State& state, AttendMode mode, std::int64_t steps) {
  using H = Eigen::half;
  constexpr std::int64_t prefill_len = 4032, query_heads = 32;
  const auto prefill = make_input<H>(prefill_len, 6);
  const auto tok = make_input<H>(1, 7);
  kvc::HostTensor<H> queries(1, query_heads, 1, kHeadDim);
  queries.setConstant(H(0.01f));
  const kvc::HostTensor<H> prefill_queries = make_input<H>(prefill_len, 8);  // 8 heads: reused below
  const auto view = [](const kvc::HostTensor<H>& t) { return kvc::HostStorage<H>::input_view(t); };
  // fp8: per-head scales calibrated on the prefill (its largest magnitude per head -> 448 / 57344).
  const kvc::Fp8Scales e4m3 =
      kvc::fp8_scales_for<kvc::float8_e4m3>(view(prefill), view(prefill), kvc::Fp8ScaleGranularity::per_head);
  const kvc::Fp8Scales e5m2 =
      kvc::fp8_scales_for<kvc::float8_e5m2>(view(prefill), view(prefill), kvc::Fp8ScaleGranularity::per_head);
  std::int64_t held = 0;
  for (auto _ : state) {
    state.PauseTiming();
    kvc::DynamicCache<H> dynamic;
    kvc::DynamicCache<kvc::float8_e4m3> fp8;
    kvc::DynamicCache<kvc::float8_e5m2> fp8_e5;
    const bool rotated = mode == AttendMode::quantized_rotated;
    kvc::QuantizedCache<H> quantized("quanto", config(1),
                                     mode == AttendMode::kivi_fused
                                         ? kvc::kivi_options(2)
                                         : kvc::QuantizedOptions{4, 0, 0, 64, 128, false, rotated, rotated});
    switch (mode) {
      case AttendMode::dynamic:
        dynamic.update(prefill, prefill, 0);
        break;
      case AttendMode::quantized_update:
        quantized.update(prefill, prefill, 0);
        break;
      case AttendMode::fp8_e4m3:
        (void)kvc::attend_fp8(fp8, 0, view(prefill_queries), view(prefill), view(prefill), e4m3);
        break;
      case AttendMode::fp8_e5m2:
        (void)kvc::attend_fp8(fp8_e5, 0, view(prefill_queries), view(prefill), view(prefill), e5m2);
        break;
      default:
        (void)kvc::attend_quantized(quantized, 0, view(prefill_queries), view(prefill), view(prefill));
    }
    state.ResumeTiming();
    for (std::int64_t i = 0; i < steps; ++i) {
      switch (mode) {
        case AttendMode::dynamic:
          benchmark::DoNotOptimize(kvc::attend(dynamic, 0, queries, tok, tok).data());
          break;
        case AttendMode::quantized_update:
          benchmark::DoNotOptimize(kvc::attend(quantized, 0, queries, tok, tok).data());
          break;
        case AttendMode::fp8_e4m3:
          benchmark::DoNotOptimize(kvc::attend_fp8(fp8, 0, view(queries), view(tok), view(tok), e4m3).data());
          break;
        case AttendMode::fp8_e5m2:
          benchmark::DoNotOptimize(kvc::attend_fp8(fp8_e5, 0, view(queries), view(tok), view(tok), e5m2).data());
          break;
        default:
          benchmark::DoNotOptimize(kvc::attend_quantized(quantized, 0, view(queries), view(tok), view(tok)).data());
      }
    }
    held = mode == AttendMode::dynamic    ? dynamic.bytes()
           : mode == AttendMode::fp8_e4m3 ? fp8.bytes()
           : mode == AttendMode::fp8_e5m2 ? fp8_e5.bytes()
                                          : quantized.bytes();
  }
  state.counters["steps_per_s"] =
      benchmark::Counter(static_cast<double>(state.iterations() * steps), benchmark::Counter::kIsRate);
  state.counters["held"] = static_cast<double>(held) / (4096.0 * 2 * kHeads * kHeadDim * 2);
}

// ---- memory ----------------------------------------------------------------------------------------

void BM_Memory(benchmark::State& state, bool hqq, std::int64_t nbits) {
  using H = Eigen::half;
  const auto prefill = make_input<H>(4032, 4);
  const auto tok = make_input<H>(1, 5);
  std::int64_t q = 0, r = 0, w = 0, qt = 0;
  for (auto _ : state) {
    kvc::QuantizedCache<H> cache(backend_of(hqq), config(1), {nbits, hqq ? 1 : 0, hqq ? 1 : 0, 64, 128});
    cache.update(prefill, prefill, 0);
    for (int i = 0; i < 64; ++i) cache.update(tok, tok, 0);
    cache.visit_layer(0, [&](const auto& l) {
      q = l.quantized_bytes();
      qt = l.quantized_tokens();
      r = l.residual_bytes();
      w = l.workspace_bytes();
    });
  }
  const double fp16_token = 2.0 * kHeads * kHeadDim * 2;  // K and V of one token, 2 bytes each
  const double fp16 = 4096 * fp16_token;
  state.counters["quantized"] = static_cast<double>(q) / (static_cast<double>(qt) * fp16_token);
  state.counters["held"] = static_cast<double>(q + r) / fp16;
  state.counters["total"] = static_cast<double>(q + r + w) / fp16;
}

struct Codec {
  bool hqq;
  std::int64_t nbits, axis;
};

std::string codec_name(const Codec& c) {
  std::string s = c.hqq ? "hqq" : "quanto";
  s.append("/nbits:");
  s.append(std::to_string(c.nbits));
  s.append("/axis:");
  s.append(std::to_string(c.axis));
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<Codec> codecs{{false, 2, 0}, {false, 2, -1}, {false, 4, 0}, {false, 4, -1}, {true, 2, 1},
                                  {true, 2, 0},  {true, 4, 1},   {true, 4, 0},  {true, 8, 1},   {true, 8, 0}};
  for (const Codec& c : codecs)
    for (const bool outliers : {false, true}) {
      std::string name = "recon/" + codec_name(c);
      name.append(outliers ? "/outliers" : "/gaussian");
      benchmark::RegisterBenchmark(name.c_str(), BM_Recon, c.hqq, c.nbits, c.axis, outliers)
          ->Iterations(1)
          ->Unit(benchmark::kMillisecond);
    }

  benchmark::RegisterBenchmark("decode/DynamicCache<float>", decode_run<kvc::DynamicCache<float>>, make_dynamic)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("decode/quanto/nbits:4/axis:0", decode_run<kvc::QuantizedCache<float>>,
                               make_quantized<false, 4, 0>)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("decode/quanto/nbits:2/axis:-1", decode_run<kvc::QuantizedCache<float>>,
                               make_quantized<false, 2, -1>)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("decode/hqq/nbits:4/axis:1", decode_run<kvc::QuantizedCache<float>>,
                               make_quantized<true, 4, 1>)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("decode/hqq/nbits:8/axis:0", decode_run<kvc::QuantizedCache<float>>,
                               make_quantized<true, 8, 0>)
      ->Unit(benchmark::kMillisecond);

  benchmark::RegisterBenchmark("attend/DynamicCache<half>", BM_Attend, AttendMode::dynamic, 64)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("attend/quanto/nbits:4/update", BM_Attend, AttendMode::quantized_update, 64)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("attend/quanto/nbits:4/fused", BM_Attend, AttendMode::quantized_fused, 64)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("attend/quanto/nbits:4/fused+rotated", BM_Attend, AttendMode::quantized_rotated, 64)
      ->Unit(benchmark::kMillisecond);
  // A whole residual cycle: 128 steps, one of them quantizing the whole sequence again.
  benchmark::RegisterBenchmark("attend/quanto/nbits:4/fused/128steps", BM_Attend, AttendMode::quantized_fused, 128)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("attend/quanto/nbits:4/fused+rotated/128steps", BM_Attend, AttendMode::quantized_rotated,
                               128)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("attend/kivi/nbits:2/fused", BM_Attend, AttendMode::kivi_fused, 64)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("attend/fp8/e4m3", BM_Attend, AttendMode::fp8_e4m3, 64)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("attend/fp8/e5m2", BM_Attend, AttendMode::fp8_e5m2, 64)->Unit(benchmark::kMillisecond);

  for (const Codec& c :
       {Codec{false, 2, 0}, Codec{false, 4, 0}, Codec{true, 2, 1}, Codec{true, 4, 1}, Codec{true, 8, 1}}) {
    std::string name = c.hqq ? "memory/hqq/nbits:" : "memory/quanto/nbits:";
    name.append(std::to_string(c.nbits));
    benchmark::RegisterBenchmark(name.c_str(), BM_Memory, c.hqq, c.nbits)->Iterations(1)->Unit(benchmark::kMillisecond);
  }

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  kvc_bench::ResultsReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);

  // Side-by-side summary.
  std::printf("\n==== kvc quantized summary (K/V [1, %lld heads, S, %lld], group 64, residual_length 128)\n",
              static_cast<long long>(kHeads), static_cast<long long>(kHeadDim));
  std::printf("%-26s %12s %12s\n", "recon (rel RMS)", "gaussian", "outliers");
  for (const Codec& c : codecs) {
    const auto* g = reporter.find("recon/" + codec_name(c) + "/gaussian");
    const auto* o = reporter.find("recon/" + codec_name(c) + "/outliers");
    std::printf("%-26s %12.4f %12.4f\n", codec_name(c).c_str(), g ? g->counters.at("rel_rms") : NAN,
                o ? o->counters.at("rel_rms") : NAN);
  }
  const auto* dyn = reporter.find("decode/DynamicCache<float>");
  std::printf("\n%-30s %12s %12s %12s\n", "decode (float, 4 layers)", "steps/s", "out GB/s", "vs Dynamic");
  for (const char* n : {"decode/DynamicCache<float>", "decode/quanto/nbits:4/axis:0", "decode/quanto/nbits:2/axis:-1",
                        "decode/hqq/nbits:4/axis:1", "decode/hqq/nbits:8/axis:0"}) {
    const auto* r = reporter.find(n);
    if (!r) continue;
    const double sps = r->counters.at("steps_per_s");
    std::printf("%-30s %12.1f %12.2f %12.3f\n", n, sps, r->counters.at("out_GB/s"),
                dyn ? sps / dyn->counters.at("steps_per_s") : NAN);
  }
  const auto* dyn_attend = reporter.find("attend/DynamicCache<half>");
  std::printf("\n%-30s %12s %12s %10s   (Eigen::half, 4096 tokens, 8 KV / 32 query heads x 128)\n",
              "decode step with attention", "steps/s", "vs Dynamic", "held");
  for (const char* n :
       {"attend/DynamicCache<half>", "attend/quanto/nbits:4/update", "attend/quanto/nbits:4/fused",
        "attend/quanto/nbits:4/fused+rotated", "attend/kivi/nbits:2/fused", "attend/fp8/e4m3", "attend/fp8/e5m2"}) {
    const auto* r = reporter.find(n);
    if (!r) continue;
    const double sps = r->counters.at("steps_per_s");
    std::printf("%-30s %12.1f %12.3f %10.3f\n", n, sps, dyn_attend ? sps / dyn_attend->counters.at("steps_per_s") : NAN,
                r->counters.at("held"));
  }
  for (const char* steps : {"", "/128steps"}) {
    const auto* fused = reporter.find(std::string("attend/quanto/nbits:4/fused") + steps);
    const auto* rotated = reporter.find(std::string("attend/quanto/nbits:4/fused+rotated") + steps);
    if (fused && rotated)
      std::printf("rotation (keys and values) over %s steps: %+.1f%% time per fused int4 decode step\n",
                  *steps ? "128 (a flush included)" : "64",
                  100.0 * (fused->counters.at("steps_per_s") / rotated->counters.at("steps_per_s") - 1.0));
  }
  std::printf("\n%-22s %10s %10s %10s   (fraction of fp16 bytes, 4096 tokens)\n", "memory (Eigen::half)", "quantized",
              "held", "total");
  std::printf(
      "quantized: per quantized token; held: + residual buffer; total: + dequantized workspace (per token held)\n");
  for (const char* n : {"memory/quanto/nbits:2", "memory/quanto/nbits:4", "memory/hqq/nbits:2", "memory/hqq/nbits:4",
                        "memory/hqq/nbits:8"}) {
    const auto* r = reporter.find(n);
    if (!r) continue;
    std::printf("%-22s %10.4f %10.4f %10.4f\n", n, r->counters.at("quantized"), r->counters.at("held"),
                r->counters.at("total"));
  }
  benchmark::Shutdown();
  return 0;
}
