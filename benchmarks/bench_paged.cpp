// kvc_bench_paged: the paged cache's bookkeeping and its update, side by side with memcpy.
//
//   step_bookkeeping/256     one decode step of 256 requests (block size 16, 512 to 767 cached
//                            tokens each, 640 on average): a block for the requests that need
//                            one, the read and write indices of the whole batch; each step one
//                            request finishes and a new one is admitted (untimed: the refill).
//   scheduler_step/256       one decode step of the continuous-batching scheduler alone: schedule()
//                            and update() for 256 decoding requests (512 to 767 cached tokens at
//                            the start, block size 16, block sharing on: a block each 16 steps
//                            and its hash), no model. 512 steps per run.
//   update/bs/<n>/requests:<r>/past:<p>   one update of one layer for a decode batch of r
//                            requests with p cached tokens each (8 KV heads x head_dim 128, float):
//                            the new rows scattered, r x (p + 1) rows gathered. Bytes counted: what
//                            it gathers and writes (K and V). 32 x 512 at block sizes 16, 64, 256,
//                            and a small batch, 4 x 128 at block size 16.
//   attention/paged/requests:<r>/past:<p>   one decode step of kvc::paged_attention for r requests
//                            with p cached tokens each (block size 16, 8 KV heads x 128, 32 query
//                            heads, float), read through the block tables. Bytes counted: the K
//                            and V it reads.
//   attention/contiguous/requests:<r>/past:<p>   the same step through scaled_dot_product_attention
//                            on one contiguous [r, 8, p + 1, 128] K and V: kvc's own attention on
//                            the same bytes.
//   attention/pool:<type>/requests:<r>/past:<p>   one decode step of kvc::paged_attention for r
//                            requests with p cached tokens each (block size 16, 8 KV heads x 128,
//                            32 query heads, half queries) from pools of half, or of int8, int4 or
//                            NVFP4 row codes (<kvc/row_codes.hpp>) holding random values' codes,
//                            and of rotated int4 rows (kvc::rotated: the queries and the output
//                            rotated in the step), fp8 rows, fp8 keys with int4 values
//                            (kvc::kv_codes), int2 rows, and int8 keys with int2 values.
//   memcpy/<MiB>             one bulk memcpy of about the same bytes: the reference.
//
// After google benchmark's table, a summary prints update's bandwidth as a fraction of memcpy's,
// per block size (the goal for block_size >= 16 is 0.8), and the decode steps per second from
// row-code pools against half pools. CPU time throughout (the machines this
// runs on are shared). Command: <build>/benchmarks/kvc_bench_paged.

#include <cstdint>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include <benchmark/benchmark.h>

#include <kvc/attention.hpp>
#include <kvc/paged/paged_attention.hpp>
#include <kvc/paged/paged_cache.hpp>
#include <kvc/paged/scheduler.hpp>
#include <kvc/policies/storage/host.hpp>
#include <kvc/row_codes.hpp>

#include "bench_common.hpp"

namespace {

using Cache = kvc::PagedCache<kvc::HostStorage<float>>;

constexpr std::int64_t kHeads = 8, kDim = 128;

kvc::ModelConfig one_layer() {
  kvc::ModelConfig c;
  c.num_hidden_layers = 1;
  c.num_attention_heads = kHeads;
  c.num_key_value_heads = kHeads;
  c.head_dim = kDim;
  c.hidden_size = kHeads * kDim;
  return c;
}

kvc::ContinuousBatchingConfig blocks(std::int64_t block_size, std::int64_t num_blocks) {
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = block_size;
  cb.num_blocks = num_blocks;
  return cb;
}

// By id (each call looks the request up), or by key (the requests opened once, as the scheduler
// does).
template <bool ByKey>
void step_bookkeeping(benchmark::State& state) {
  // Request r starts with past0 + r % span cached tokens and is replaced by a fresh request of
  // past0 tokens once it has decoded `span` more (untimed): one replacement per step, and every
  // step reads between past0 and past0 + span tokens per request, however many steps run.
  const std::int64_t requests = state.range(0), bs = 16, past0 = 512, span = 256;
  Cache cache(one_layer(), blocks(bs, requests * ((past0 + span) / bs + 2)));
  std::vector<std::int64_t> past(static_cast<std::size_t>(requests)), allocated(past.size(), 0);
  using request = std::conditional_t<ByKey, kvc::paged::RequestKey, std::string>;
  std::vector<request> ids;
  std::int64_t next = 0;
  auto admit = [&](std::size_t r, std::int64_t tokens) {
    if constexpr (ByKey)
      ids[r] = cache.open_request("req_" + std::to_string(next++));
    else
      ids[r] = "req_" + std::to_string(next++);
    past[r] = tokens;
    allocated[r] = *cache.allocate_blocks((tokens + bs - 1) / bs, ids[r], 0);
  };
  ids.resize(past.size());
  for (std::int64_t r = 0; r < requests; ++r) admit(static_cast<std::size_t>(r), past0 + r % span);
  kvc::PagedIndices reads(1), writes(1);
  for (auto _ : state) {
    reads[0].clear();
    writes[0].clear();
    for (std::size_t r = 0; r < ids.size(); ++r) {
      const std::int64_t need = (past[r] + 1 + bs - 1) / bs - allocated[r];
      if (need > 0) allocated[r] += *cache.allocate_blocks(need, ids[r], allocated[r]);
      cache.extend_read_and_write_indices(ids[r], past[r], 1, &reads, writes);
      past[r] += 1;
    }
    benchmark::DoNotOptimize(reads[0].data());
    state.PauseTiming();
    for (std::size_t r = 0; r < ids.size(); ++r)
      if (past[r] >= past0 + span) {  // finished: a new request takes its place
        if constexpr (ByKey)
          cache.close_request(ids[r]);
        else
          cache.free_blocks(ids[r]);
        admit(r, past0);
      }
    state.ResumeTiming();
  }
  state.counters["requests"] = static_cast<double>(requests);
}

void scheduler_step(benchmark::State& state) {
  const std::int64_t requests = state.range(0), bs = 16, past0 = 512, span = 256, steps = 512;
  kvc::ModelConfig tiny;  // the pools do not matter here: one head of 4
  tiny.num_hidden_layers = 2;
  tiny.num_attention_heads = 1;
  tiny.num_key_value_heads = 1;
  tiny.head_dim = 4;
  tiny.hidden_size = 4;
  kvc::ContinuousBatchingConfig cb = blocks(bs, requests * ((past0 + span + steps) / bs + 2));
  cb.max_batch_tokens = 4096;
  Cache cache(tiny, cb);
  kvc::ContinuousBatchingScheduler<kvc::HostStorage<float>> scheduler(cache, cb);
  for (std::int64_t r = 0; r < requests; ++r) {
    kvc::GenerationRequest q;
    q.request_id = "req_" + std::to_string(r);
    for (std::int64_t t = 0; t < past0 + r % span; ++t) q.prompt.push_back((r * 7919 + t) % 30000);
    q.max_new_tokens = std::int64_t{1} << 30;
    scheduler.add_request(std::move(q));
  }
  std::vector<std::int64_t> next;
  const auto step = [&] {
    const std::optional<kvc::ScheduledBatch> b = scheduler.schedule();
    next.assign(b->logits_indices.size(), 1);
    scheduler.update(*b, next);
    return b->num_tokens();
  };
  while (step() != requests) {  // the prefills (untimed)
  }
  for (auto _ : state) benchmark::DoNotOptimize(step());
  state.counters["requests"] = static_cast<double>(requests);
}

void update(benchmark::State& state) {
  const std::int64_t bs = state.range(0), requests = state.range(1), past = state.range(2);
  Cache cache(one_layer(), blocks(bs, requests * (past / bs + 2)));
  kvc::PagedIndices reads(1), writes(1);
  for (std::int64_t r = 0; r < requests; ++r) {
    const std::string id = "req_" + std::to_string(r);
    cache.allocate_blocks((past + 1 + bs - 1) / bs, id, 0);
    cache.extend_read_and_write_indices(id, past, 1, &reads, writes);
  }
  kvc::HostTensor<float> k(1, kHeads, requests, kDim), v(1, kHeads, requests, kDim);
  k.setConstant(1.f);
  v.setConstant(2.f);
  const kvc::TensorView<float> kv{
      k.data(), {1, kHeads, requests, kDim}, {kHeads * requests * kDim, requests * kDim, kDim, 1}};
  const kvc::TensorView<float> vv{
      v.data(), {1, kHeads, requests, kDim}, {kHeads * requests * kDim, requests * kDim, kDim, 1}};
  for (auto _ : state) {
    const auto out = cache.update(kv, vv, 0, reads, writes);
    benchmark::DoNotOptimize(out.keys.data());
    benchmark::ClobberMemory();
  }
  const std::int64_t row_bytes = kHeads * kDim * static_cast<std::int64_t>(sizeof(float));
  const auto moved = 2 * (static_cast<std::int64_t>(reads[0].size()) + requests) * row_bytes;
  state.SetBytesProcessed(state.iterations() * moved);
  state.counters["MiB_per_step"] = static_cast<double>(moved) / (1 << 20);
}

constexpr std::int64_t kQueryHeads = 32;

// A decode step of `requests` requests with `past` cached tokens each, read from the pools.
void attention_paged(benchmark::State& state) {
  const std::int64_t requests = state.range(0), past = state.range(1), bs = 16;
  kvc::ModelConfig config = one_layer();
  config.num_attention_heads = kQueryHeads;
  Cache cache(config, blocks(bs, requests * (past / bs + 1)));
  std::vector<std::string> ids;
  std::vector<std::int64_t> cu = {0}, pasts;
  for (std::int64_t r = 0; r < requests; ++r) {
    ids.push_back("req_" + std::to_string(r));
    cache.allocate_blocks((past + 1 + bs - 1) / bs, ids.back(), 0);
    cu.push_back(r + 1);
    pasts.push_back(past);
  }
  kvc::HostTensor<float> q(1, kQueryHeads, requests, kDim), k(1, kHeads, requests, kDim);
  q.setConstant(0.01f);
  k.setConstant(1.f);
  const auto view = [](const kvc::HostTensor<float>& t) { return kvc::HostStorage<float>::input_view(t); };
  const kvc::PagedAttentionStep step{ids, cu, pasts};
  for (auto _ : state) {
    const auto out = kvc::paged_attention(cache, 0, step, view(q), view(k), view(k));
    benchmark::DoNotOptimize(out.data());
  }
  const std::int64_t bytes = 2 * requests * (past + 1) * kHeads * kDim * static_cast<std::int64_t>(sizeof(float));
  state.SetBytesProcessed(state.iterations() * bytes);
}

// The same step on contiguous K and V: kvc's dense attention on the same bytes.
void attention_contiguous(benchmark::State& state) {
  const std::int64_t requests = state.range(0), past = state.range(1);
  kvc::HostTensor<float> q(requests, kQueryHeads, 1, kDim), k(requests, kHeads, past + 1, kDim),
      v(requests, kHeads, past + 1, kDim);
  q.setConstant(0.01f);
  k.setConstant(1.f);
  v.setConstant(2.f);
  const auto view = [](const kvc::HostTensor<float>& t) { return kvc::HostStorage<float>::input_view(t); };
  const kvc::AttentionMask mask{past + 1, 0, past};
  for (auto _ : state) {
    const auto out = kvc::scaled_dot_product_attention(view(q), view(k), view(v), mask);
    benchmark::DoNotOptimize(out.data());
  }
  const std::int64_t bytes = 2 * requests * (past + 1) * kHeads * kDim * static_cast<std::int64_t>(sizeof(float));
  state.SetBytesProcessed(state.iterations() * bytes);
}

// The step's tokens, or a chunk of cached ones, in the pool's element type: half values, or the
// row codes of the same values.
template <class Pool>
kvc::KV<kvc::HostTensor<Pool>> pool_rows(const kvc::HostTensor<Eigen::half>& k, const kvc::HostTensor<Eigen::half>& v) {
  if constexpr (kvc::detail::is_kv_codes<Pool>)
    return kvc::to_kv_codes<Pool>(k, v);
  else if constexpr (kvc::is_row_code_v<Pool>)
    return {kvc::to_row_codes<Pool>(k), kvc::to_row_codes<Pool>(v)};
  else
    return {k, v};
}

// A decode step of `requests` requests with `past` cached tokens each (random values, written
// through update in chunks), from a pool of Pool, with half queries.
template <class Pool>
void attention_pool(benchmark::State& state) {
  const std::int64_t requests = state.range(0), past = state.range(1), bs = 16, chunk = 512;
  kvc::ModelConfig config = one_layer();
  config.num_attention_heads = kQueryHeads;
  kvc::PagedCache<kvc::HostStorage<Pool>> cache(config, blocks(bs, requests * (past / bs + 1)));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto random = [&](std::int64_t heads, std::int64_t tokens) {
    kvc::HostTensor<Eigen::half> t(1, heads, tokens, kDim);
    for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] = Eigen::half(normal(rng));
    return t;
  };
  const auto view = [](const auto& t) { return kvc::input_view(t); };
  std::vector<std::string> ids;
  std::vector<std::int64_t> cu = {0}, pasts;
  for (std::int64_t r = 0; r < requests; ++r) {
    ids.push_back("req_" + std::to_string(r));
    cache.allocate_blocks((past + 1 + bs - 1) / bs, ids.back(), 0);
    for (std::int64_t at = 0; at < past; at += chunk) {
      const std::int64_t n = std::min(chunk, past - at);
      kvc::PagedIndices writes(1);
      cache.extend_read_and_write_indices(ids.back(), at, n, nullptr, writes);
      const auto kv = pool_rows<Pool>(random(kHeads, n), random(kHeads, n));
      cache.update(view(kv.keys), view(kv.values), 0, kvc::PagedIndices(1), writes);
    }
    cu.push_back(r + 1);
    pasts.push_back(past);
  }
  const auto q = random(kQueryHeads, requests);
  const auto kv = pool_rows<Pool>(random(kHeads, requests), random(kHeads, requests));
  const auto &k = kv.keys, &v = kv.values;
  const kvc::PagedAttentionStep step{ids, cu, pasts};
  kvc::HostTensor<Eigen::half> out;
  for (auto _ : state) {
    if constexpr (kvc::is_row_code_v<Pool> && kvc::detail::takes_scale_lists<Pool>)  // NVFP4: tensor scales (1)
      kvc::paged_attention(cache, 0, step, view(q), view(k), view(v), kvc::Nvfp4TensorScales{}, out);
    else
      kvc::paged_attention(cache, 0, step, view(q), view(k), view(v), out);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetItemsProcessed(state.iterations());
}

}  // namespace

BENCHMARK(attention_paged)
    ->Name("attention/paged")
    ->ArgNames({"requests", "past"})
    ->Args({64, 2048})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(attention_contiguous)
    ->Name("attention/contiguous")
    ->ArgNames({"requests", "past"})
    ->Args({64, 2048})
    ->Unit(benchmark::kMillisecond);
namespace {

// The attention/pool rows: a decode step of 8 requests x 4096 tokens from a pool of each type,
// registered here, in this order.
template <class Pool>
void register_pool(const char* type) {
  benchmark::RegisterBenchmark((std::string("attention/pool:") + type).c_str(), attention_pool<Pool>)
      ->ArgNames({"requests", "past"})
      ->Args({8, 4096})
      ->Unit(benchmark::kMillisecond);
}
[[maybe_unused]] const bool pool_rows_registered = [] {
  register_pool<Eigen::half>("half");
  register_pool<kvc::int8_row>("int8_row");
  register_pool<kvc::int4_row>("int4_row");
  register_pool<kvc::nvfp4_row>("nvfp4_row");
  register_pool<kvc::rotated<kvc::int4_row>>("rotated_int4_row");
  register_pool<kvc::fp8_row<kvc::float8_e4m3>>("fp8_e4m3_row");
  register_pool<kvc::kv_codes<kvc::fp8_row<kvc::float8_e4m3>, kvc::int4_row>>("fp8_keys_int4_values");
  register_pool<kvc::int2_row>("int2_row");
  register_pool<kvc::kv_codes<kvc::int8_row, kvc::int2_row>>("int8_keys_int2_values");
  return true;
}();

}  // namespace
BENCHMARK(step_bookkeeping<false>)->Name("step_bookkeeping")->Arg(256)->Unit(benchmark::kMicrosecond);
BENCHMARK(step_bookkeeping<true>)->Name("step_bookkeeping_by_key")->Arg(256)->Unit(benchmark::kMicrosecond);
BENCHMARK(scheduler_step)->Name("scheduler_step")->Arg(256)->Iterations(512)->Unit(benchmark::kMicrosecond);
BENCHMARK(update)
    ->Name("update/bs")
    ->ArgNames({"", "requests", "past"})
    ->Args({16, 32, 512})
    ->Args({64, 32, 512})
    ->Args({256, 32, 512})
    ->Args({16, 4, 128})
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(kvc_bench::memcpy_bulk)->Name("memcpy")->Arg(64)->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  std::vector<char*> args(argv, argv + argc);
  std::string min_time = "--benchmark_min_time=0.2";
  bool has_min_time = false;
  for (int i = 1; i < argc; ++i)
    has_min_time = has_min_time || std::string(argv[i]).starts_with("--benchmark_min_time");
  if (!has_min_time) args.push_back(min_time.data());
  int n = static_cast<int>(args.size());
  benchmark::Initialize(&n, args.data());
  kvc_bench::ResultsReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  if (const kvc_bench::Result* half = reporter.find("attention/pool:half/requests:8/past:4096")) {
    std::printf("decode steps/s from row-code pools / half pools (8 requests x 4096 tokens, same run):\n");
    for (const char* type : {"int8_row", "int4_row", "nvfp4_row", "rotated_int4_row", "fp8_e4m3_row",
                             "fp8_keys_int4_values", "int2_row", "int8_keys_int2_values"})
      if (const kvc_bench::Result* r = reporter.find(std::string("attention/pool:") + type + "/requests:8/past:4096"))
        std::printf("  %-22s %.2f\n", type, half->seconds / r->seconds);
  }
  const kvc_bench::Result* copy = reporter.find("memcpy/64");
  if (!copy) return 0;
  std::printf("\nupdate bandwidth / memcpy bandwidth (same binary, same run):\n");
  for (const char* name :
       {"update/bs/16/requests:32/past:512", "update/bs/64/requests:32/past:512", "update/bs/256/requests:32/past:512"})
    if (const kvc_bench::Result* r = reporter.find(name))
      std::printf("  %-16s %.2f\n", name, r->bytes_per_second / copy->bytes_per_second);
  const kvc_bench::Result* paged = reporter.find("attention/paged/requests:64/past:2048");
  const kvc_bench::Result* dense = reporter.find("attention/contiguous/requests:64/past:2048");
  if (paged)
    std::printf("paged attention K/V reads / memcpy bandwidth: %.2f\n",
                paged->bytes_per_second / copy->bytes_per_second);
  if (paged && dense)
    std::printf("paged attention / contiguous attention (same bytes): %.2f\n",
                paged->bytes_per_second / dense->bytes_per_second);
  if (const kvc_bench::Result* r = reporter.find("step_bookkeeping/256"))
    std::printf("step bookkeeping: %.0f ns per request per decode step\n", r->seconds * 1e9 / 256);
  if (const kvc_bench::Result* r = reporter.find("scheduler_step/256/iterations:512"))
    std::printf("scheduler step: %.0f ns per request per decode step\n", r->seconds * 1e9 / 256);
  return 0;
}
