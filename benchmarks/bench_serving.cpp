// kvc_bench_serving: continuous batching measured, for docs/continuous_batching.md and the plots
// docs/plots/serving_*.png (benchmarks/run.sh, tools/plot_benchmarks.sh).
//
//   kvc_bench_serving [--out DIR] [--max-requests N]
//
// 1. Throughput against the number of concurrent requests N (1 .. 256): the serving model of
//    examples/common/serving.hpp (105 MB of float weights) serves N requests through a paged cache
//    with room for all of them, against the same sequences run one after another, each through its
//    own DynamicCache (teacher-forced with the tokens the paged run sampled). Up to 32 requests the
//    baseline runs every sequence; above, it runs the first 32 and its time is scaled by the
//    generated tokens (one request at a time, its rate does not depend on N).
// 2. Peak KV bytes at each N: the paged cache's blocks in use at their peak, the bytes the active
//    requests' tokens needed then, one DynamicCache per request held together (each grown as a
//    prefill then one token per step), and a static cache per request sized for the longest one.
// 3. Prefix sharing against the fraction of requests that share a 256-token system prompt: 64
//    requests arriving 4 per step, with block sharing on and off (no model: writes only, the
//    scheduler and cache as they run): peak blocks in use and prompt tokens computed.
//
// 4. Throughput against the threads the program is given (1 .. the OpenMP default, at least 2) at
//    1, 8, 32 and 128 concurrent requests (built with OpenMP only).
//
// Writes DIR/serving_throughput.dat, serving_memory.dat, serving_prefix.dat and serving_threads.dat
// (gnuplot tables with a header of quoted column names) and prints them.
#include <algorithm>
#include <array>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "common/serving.hpp"

namespace {

using examples::ServingCache;
using examples::ServingScheduler;
using examples::ServingStorage;

constexpr std::uint64_t seed = 2024;

std::int64_t blocks_for(const std::vector<kvc::GenerationRequest>& requests, std::int64_t block_size) {
  std::int64_t need = 0;
  for (const auto& r : requests)
    need += r.num_return_sequences *
            ((static_cast<std::int64_t>(r.prompt.size()) + r.max_new_tokens + block_size - 1) / block_size);
  return need;
}

struct Point {
  std::int64_t requests = 0, generated = 0;
  double paged_tps = 0, dynamic_tps = 0;
  double peak_mib = 0, live_mib = 0, dynamic_mib = 0, static_mib = 0;
};

double mib(std::int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024.0); }

// Bytes of a DynamicCache grown the way one request grows it: the prompt, then one token a step.
std::int64_t dynamic_bytes(const examples::DecoderConfig& c, std::int64_t prompt, std::int64_t total) {
  kvc::DynamicCache<float> cache;
  const auto grow = [&](std::int64_t n) {
    kvc::HostTensor<float> kv(1, c.num_key_value_heads, n, c.head_dim);
    kv.setZero();
    for (std::int64_t l = 0; l < c.num_hidden_layers; ++l)
      (void)cache.update(ServingStorage::input_view(kv), ServingStorage::input_view(kv), l);
  };
  grow(prompt);
  for (std::int64_t t = prompt; t < total; ++t) grow(1);
  return cache.bytes();
}

// n requests served through a paged cache with room for all of them: the finished requests, the
// serving seconds and the cache's bytes per block and scheduler statistics.
struct Served {
  std::vector<kvc::RequestState> done;
  double seconds = 0;
  std::int64_t bytes_per_block = 0, block_size = 0;
  kvc::SchedulerStats stats;
};
Served serve_requests(const examples::Decoder<float>& model, std::int64_t n) {
  const examples::DecoderConfig& c = model.config();
  examples::WorkloadShape shape;
  shape.new_min = 32;
  shape.new_max = 96;
  shape.forked_requests = 0;
  const auto requests = examples::make_requests(n, seed, c.vocab_size, shape);
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 16;
  cb.num_blocks = blocks_for(requests, cb.block_size) + 1;
  cb.max_batch_tokens = 512;
  ServingCache cache(c.cache_config(), cb);
  ServingScheduler scheduler(cache, cb);
  for (const auto& r : requests) scheduler.add_request(r);
  Served out;
  out.seconds = examples::serve(model, cache, scheduler, seed, {}, [&] {
                  for (auto& st : scheduler.take_finished()) out.done.push_back(std::move(st));
                }).seconds;
  out.bytes_per_block = cache.bytes_per_block();
  out.block_size = cache.block_size();
  out.stats = scheduler.stats();
  return out;
}

std::int64_t generated_tokens(const std::vector<kvc::RequestState>& done) {
  std::int64_t n = 0;
  for (const auto& st : done) n += static_cast<std::int64_t>(st.generated().size());
  return n;
}

Point throughput_point(const examples::Decoder<float>& model, std::int64_t n) {
  const examples::DecoderConfig& c = model.config();
  const Served served = serve_requests(model, n);
  const std::vector<kvc::RequestState>& done = served.done;
  Point p;
  p.requests = n;
  std::int64_t longest = 0, dynamic_sum = 0;
  for (const auto& st : done) {
    p.generated += static_cast<std::int64_t>(st.generated().size());
    longest = std::max<std::int64_t>(longest, static_cast<std::int64_t>(st.tokens.size()));
    dynamic_sum += dynamic_bytes(c, st.prompt_length, static_cast<std::int64_t>(st.tokens.size()) - 1);
  }
  p.paged_tps = static_cast<double>(p.generated) / served.seconds;
  // The baseline: every sequence up to 32, else the first 32 scaled by generated tokens.
  std::vector<const kvc::RequestState*> run;
  std::int64_t run_generated = 0;
  for (const auto& st : done) {
    if (run.size() == 32) break;
    run.push_back(&st);
    run_generated += static_cast<std::int64_t>(st.generated().size());
  }
  const double seconds = examples::one_cache_per_request(model, run).first;
  p.dynamic_tps = static_cast<double>(run_generated) / seconds;
  const kvc::SchedulerStats& s = served.stats;
  p.peak_mib = mib(s.peak_blocks_in_use * served.bytes_per_block);
  p.live_mib = mib(s.live_rows_at_peak * served.bytes_per_block / served.block_size);
  p.dynamic_mib = mib(dynamic_sum);
  const std::int64_t token_bytes =
      2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * static_cast<std::int64_t>(sizeof(float));
  p.static_mib = mib(static_cast<std::int64_t>(done.size()) * longest * token_bytes);
  return p;
}

struct SharingPoint {
  double fraction = 0;
  std::int64_t peak_on = 0, peak_off = 0, computed_on = 0, computed_off = 0, hits = 0;
};

// 64 requests arriving 4 per step, served with writes only (the scheduler and cache do all their
// work; no model): peak blocks in use and tokens computed, returned as (peak, tokens, hits).
std::array<std::int64_t, 3> serve_without_model(const examples::DecoderConfig& c,
                                                const std::vector<kvc::GenerationRequest>& requests, bool sharing) {
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 16;
  cb.num_blocks = blocks_for(requests, cb.block_size) + 1;
  cb.max_batch_tokens = 2048;
  cb.allow_block_sharing = sharing;
  ServingCache cache(c.cache_config(), cb);
  ServingScheduler scheduler(cache, cb);
  std::size_t arrived = 0;
  for (;;) {
    for (int k = 0; k < 4 && arrived < requests.size(); ++k) scheduler.add_request(requests[arrived++]);
    auto batch = scheduler.schedule();
    if (!batch) {
      if (arrived == requests.size()) break;
      continue;
    }
    kvc::HostTensor<float> kv(1, c.num_key_value_heads, batch->num_tokens(), c.head_dim);
    kv.setZero();
    for (std::int64_t l = 0; l < c.num_hidden_layers; ++l)
      (void)cache.update(ServingStorage::input_view(kv), ServingStorage::input_view(kv), l, batch->read_index,
                         batch->write_index);
    std::vector<std::int64_t> next;
    for (std::size_t i = 0; i < batch->logits_indices.size(); ++i)
      next.push_back(static_cast<std::int64_t>((batch->logits_indices[i] * 7 + i) % 2048));
    scheduler.update(*batch, next);
    (void)scheduler.take_finished();
  }
  const kvc::SchedulerStats& s = scheduler.stats();
  return {s.peak_blocks_in_use, s.batch_tokens, s.prefix_hit_tokens};
}

SharingPoint sharing_point(const examples::DecoderConfig& c, double fraction) {
  examples::WorkloadShape shape;
  shape.shared_prefix = 256;
  shape.shared_fraction = fraction;
  shape.prompt_min = 16;
  shape.prompt_max = 32;
  shape.new_min = 16;
  shape.new_max = 32;
  shape.forked_requests = 0;
  const auto requests = examples::make_requests(64, seed, c.vocab_size, shape);
  SharingPoint p;
  p.fraction = fraction;
  const auto on = serve_without_model(c, requests, true), off = serve_without_model(c, requests, false);
  p.peak_on = on[0];
  p.computed_on = on[1];
  p.hits = on[2];
  p.peak_off = off[0];
  p.computed_off = off[1];
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out = ".";
  std::int64_t max_requests = 256;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string_view a = argv[i], v = argv[i + 1];
    if (a == "--out") {
      out = std::string(v);
    } else if (a == "--max-requests") {
      std::from_chars(v.data(), v.data() + v.size(), max_requests);
    } else {
      std::fprintf(stderr, "usage: kvc_bench_serving [--out DIR] [--max-requests N]\n");
      return 2;
    }
  }
  const examples::DecoderConfig config = examples::serving_model(false);
  const examples::Decoder<float> model(config, seed);

  std::ofstream tput(out + "/serving_throughput.dat"), mem(out + "/serving_memory.dat");
  tput << "\"concurrent requests\" \"paged (kvc::PagedCache + scheduler)\" \"one DynamicCache per request, in "
          "sequence\" \"ratio\"\n";
  mem << "\"concurrent requests\" \"paged: blocks in use at the peak\" \"the live tokens then\" \"one DynamicCache per "
         "request\" \"static caches at the longest request\"\n";
  std::printf("%9s %10s %12s %12s %7s %12s %10s %10s %12s %12s\n", "requests", "generated", "paged tok/s",
              "dynamic tok/s", "ratio", "paged MiB", "live MiB", "overhead", "dynamic MiB", "static MiB");
  for (std::int64_t n = 1; n <= max_requests; n *= 2) {
    const Point p = throughput_point(model, n);
    const double ratio = p.paged_tps / p.dynamic_tps;
    std::printf("%9lld %10lld %12.0f %12.0f %7.2f %12.2f %10.2f %10.3f %12.2f %12.2f\n",
                static_cast<long long>(p.requests), static_cast<long long>(p.generated), p.paged_tps, p.dynamic_tps,
                ratio, p.peak_mib, p.live_mib, p.peak_mib / p.live_mib, p.dynamic_mib, p.static_mib);
    std::fflush(stdout);
    tput << p.requests << ' ' << p.paged_tps << ' ' << p.dynamic_tps << ' ' << ratio << '\n';
    mem << p.requests << ' ' << p.peak_mib << ' ' << p.live_mib << ' ' << p.dynamic_mib << ' ' << p.static_mib << '\n';
  }

  // Throughput against the threads the program is given (OpenMP: the decoder's products and
  // norms, the attention, the sampling), the best of 3 runs each.
#if defined(_OPENMP)
  const int most_threads = std::max(omp_get_max_threads(), 2);
  const std::array<std::int64_t, 4> loads{1, 8, 32, 128};
  std::ofstream thr(out + "/serving_threads.dat");
  thr << "\"threads\"";
  for (const std::int64_t n : loads) thr << " \"" << n << (n == 1 ? " request" : " requests") << '"';
  thr << '\n';
  std::printf("\n%9s", "threads");
  for (const std::int64_t n : loads) std::printf(" %9lld req", static_cast<long long>(n));
  std::printf("   (generated tokens/s)\n");
  for (int threads = 1; threads <= most_threads; ++threads) {
    omp_set_num_threads(threads);
    thr << threads;
    std::printf("%9d", threads);
    for (const std::int64_t n : loads) {
      double best = 0;
      for (int rep = 0; rep < 3; ++rep) {
        const Served served = serve_requests(model, n);
        best = std::max(best, static_cast<double>(generated_tokens(served.done)) / served.seconds);
      }
      thr << ' ' << best;
      std::printf(" %13.0f", best);
      std::fflush(stdout);
    }
    thr << '\n';
    std::printf("\n");
  }
  omp_set_num_threads(most_threads);
#endif

  std::ofstream pre(out + "/serving_prefix.dat");
  pre << "\"shared fraction\" \"KV memory saved (peak blocks)\" \"prefill compute saved (tokens)\"\n";
  std::printf("\n%9s %10s %10s %14s %14s %12s\n", "shared", "peak on", "peak off", "computed on", "computed off",
              "hit tokens");
  for (const double f : {0.0, 0.25, 0.5, 0.75, 1.0}) {
    const SharingPoint p = sharing_point(config, f);
    std::printf("%9.2f %10lld %10lld %14lld %14lld %12lld\n", p.fraction, static_cast<long long>(p.peak_on),
                static_cast<long long>(p.peak_off), static_cast<long long>(p.computed_on),
                static_cast<long long>(p.computed_off), static_cast<long long>(p.hits));
    pre << p.fraction << ' ' << 1.0 - static_cast<double>(p.peak_on) / static_cast<double>(p.peak_off) << ' '
        << 1.0 - static_cast<double>(p.computed_on) / static_cast<double>(p.computed_off) << '\n';
  }
  return 0;
}
