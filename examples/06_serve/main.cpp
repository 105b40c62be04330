// kvc_serve_demo: continuous batching on kvc. The seeded decoder of examples/common serves many
// requests at once through a kvc::PagedCache driven by kvc::ContinuousBatchingScheduler: prompts
// of different lengths, a shared system prefix on half of them, two requests with three sequences
// each (forks), and a cache small enough that requests are preempted (to the swap pool, or soft
// reset and prefilled again). Every step's logits of every sequence are checked against the same
// model recomputing that sequence alone without a cache (forward_no_cache). The same sequences then
// run one after another, each through its own kvc::DynamicCache, for the throughput and memory
// comparison.
//
//   kvc_serve_demo [--requests N] [--seed N] [--block-size N] [--blocks N] [--swap-blocks N]
//                  [--max-batch-tokens N] [--scheduler fifo|prefill_first] [--hybrid] [--linear]
//                  [--linear-full] [--snapshot-interval N] [--shared-prefix N] [--json]
//
// Exits 0 when every sequence passes, 1 when one fails, 2 for a bad option.
#include <kvc/kvc.hpp>
#include <kvc/paged/paged_attention.hpp>
#include <kvc/paged/scheduler.hpp>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "../common/decoder.hpp"
#include "../common/report.hpp"
#include "../common/serving.hpp"

namespace {

using examples::clock_type;
using examples::Decoder;
using examples::DecoderConfig;
using examples::fmt;
using examples::human_bytes;
using Storage = kvc::HostStorage<float>;

// Logits of float attention through the pools against the no-cache model: the order of the sums
// differs (online softmax over blocks); the largest measured difference is about 1e-5.
constexpr double tolerance = 1e-4;

const char* const usage =
    "usage: kvc_serve_demo [options]\n"
    "  Continuous batching of seeded requests through kvc's paged cache and scheduler, every step's\n"
    "  logits checked against the model recomputing each sequence alone without a cache.\n"
    "options:\n"
    "  --requests N          requests (default 32; two of them ask for 3 sequences)\n"
    "  --seed N              seed of the weights, the requests and the sampling (default 2024)\n"
    "  --block-size N        tokens per block (default 16)\n"
    "  --blocks N            blocks of the cache (default: half of what every sequence needs at its end)\n"
    "  --swap-blocks N       blocks of the swap pool for offloaded requests (default blocks / 8)\n"
    "  --max-batch-tokens N  tokens per forward (default 256)\n"
    "  --scheduler NAME      fifo or prefill_first (default fifo)\n"
    "  --hybrid              the demo model with sliding and full layers (no prefix sharing)\n"
    "  --linear              linear-attention, sliding and full layers (states in state slots)\n"
    "  --linear-full         linear-attention and full layers: prefix sharing through state snapshots\n"
    "  --snapshot-interval N tokens between state snapshots, a multiple of the block size\n"
    "                        (default: the block size with --linear-full, else 0: none)\n"
    "  --shared-prefix N     tokens of the system prefix half of the prompts start with (default 32)\n"
    "  --json                print one JSON object instead of the table\n"
    "exit status: 0 every sequence passes, 1 one fails, 2 bad option\n";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  std::int64_t requests = 32;
  std::uint64_t seed = 2024;
  std::int64_t block_size = 16;
  std::optional<std::int64_t> blocks, swap_blocks;
  std::int64_t max_batch_tokens = 256;
  std::string scheduler = "fifo";
  bool hybrid = false;
  bool linear = false;
  bool linear_full = false;
  std::optional<std::int64_t> snapshot_interval;
  std::int64_t shared_prefix = 32;
  bool json = false;
};

std::int64_t parse_count(std::string_view flag, std::string_view text, std::int64_t lo, std::int64_t hi) {
  std::int64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc{} || end != text.data() + text.size() || v < lo || v > hi)
    throw UsageError(std::string(flag) + " needs an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                     "], got '" + std::string(text) + "'");
  return v;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string_view a = argv[i];
    auto value = [&]() -> std::string_view {
      if (i + 1 >= argc) throw UsageError(std::string(a) + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") {
      std::fputs(usage, stdout);
      std::exit(0);
    } else if (a == "--requests") {
      o.requests = parse_count(a, value(), 3, 4096);
    } else if (a == "--seed") {
      o.seed = static_cast<std::uint64_t>(parse_count(a, value(), 0, std::int64_t{1} << 62));
    } else if (a == "--block-size") {
      o.block_size = parse_count(a, value(), 4, 1024);
    } else if (a == "--blocks") {
      o.blocks = parse_count(a, value(), 1, std::int64_t{1} << 24);
    } else if (a == "--swap-blocks") {
      o.swap_blocks = parse_count(a, value(), 0, std::int64_t{1} << 24);
    } else if (a == "--max-batch-tokens") {
      o.max_batch_tokens = parse_count(a, value(), 1, std::int64_t{1} << 20);
    } else if (a == "--scheduler") {
      o.scheduler = std::string(value());
      if (o.scheduler != "fifo" && o.scheduler != "prefill_first")
        throw UsageError("--scheduler needs fifo or prefill_first, got '" + o.scheduler + "'");
    } else if (a == "--hybrid") {
      o.hybrid = true;
    } else if (a == "--linear") {
      o.linear = true;
    } else if (a == "--linear-full") {
      o.linear_full = true;
    } else if (a == "--snapshot-interval") {
      o.snapshot_interval = parse_count(a, value(), 0, std::int64_t{1} << 20);
    } else if (a == "--shared-prefix") {
      o.shared_prefix = parse_count(a, value(), 0, std::int64_t{1} << 16);
    } else if (a == "--json") {
      o.json = true;
    } else {
      throw UsageError("unknown option '" + std::string(a) + "' (see --help)");
    }
  }
  return o;
}

// One sequence's record: the logits each of its generated tokens was sampled from.
struct Sequence {
  std::vector<std::vector<float>> logits;  // row i: the logits that gave generated token i
  kvc::RequestState state;
  double max_diff = 0;
  bool pass = false;
};

struct PagedRun {
  std::map<std::string, Sequence> sequences;
  double seconds = 0;
  std::int64_t steps = 0, tokens = 0;
  kvc::SchedulerStats stats;
  std::int64_t num_blocks = 0, swap_blocks = 0, bytes_per_block = 0, block_size = 0;
};

PagedRun serve(const Options& o, const Decoder<float>& model, const std::vector<kvc::GenerationRequest>& requests) {
  PagedRun run;
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = o.block_size;
  std::int64_t need = 0;  // blocks every sequence needs at its end
  for (const auto& r : requests)
    need += r.num_return_sequences *
            ((static_cast<std::int64_t>(r.prompt.size()) + r.max_new_tokens + o.block_size - 1) / o.block_size);
  cb.num_blocks = o.blocks.value_or(std::max<std::int64_t>(need / 2, 1));
  cb.max_batch_tokens = o.max_batch_tokens;
  cb.scheduler_type = o.scheduler;
  cb.state_snapshot_interval = o.snapshot_interval.value_or(o.linear_full ? o.block_size : 0);
  kvc::PagedCache<Storage> cache(model.config().cache_config(), cb);
  cache.reserve_swap_space(o.swap_blocks.value_or(*cb.num_blocks / 8));
  kvc::ContinuousBatchingScheduler<Storage> scheduler(cache, cb);
  for (const auto& r : requests) scheduler.add_request(r);

  std::int64_t expected = 0, done = 0;  // sequences
  for (const auto& r : requests) expected += r.num_return_sequences;
  examples::Progress progress(clock_type::now());
  const auto start = clock_type::now();
  const examples::ServeTotals totals = examples::serve(
      model, cache, scheduler, o.seed,
      [&](const kvc::ScheduledRequest& s, const examples::Logits& logits, Eigen::Index row, std::int64_t) {
        run.sequences[s.request_id].logits.emplace_back(logits.row(row).data(), logits.row(row).data() + logits.cols());
      },
      [&] {
        for (auto& st : scheduler.take_finished()) {
          run.sequences[st.request_id].state = std::move(st);
          ++done;
        }
        progress.update("serving: sequences", done, expected, "seqs", start);
      });
  progress.clear();
  run.seconds = totals.seconds;
  run.steps = totals.steps;
  run.tokens = totals.batch_tokens;
  run.stats = scheduler.stats();
  run.num_blocks = cache.num_blocks();
  run.swap_blocks = cache.swap_blocks();
  run.bytes_per_block = cache.bytes_per_block();
  run.block_size = cache.block_size();
  return run;
}

// Each sequence recomputed alone without a cache: its logits at every generated position.
void check(const Decoder<float>& model, PagedRun& run) {
  std::vector<Sequence*> all;
  for (auto& entry : run.sequences) all.push_back(&entry.second);
  examples::parallel_for(static_cast<std::int64_t>(all.size()), [&](std::int64_t i) {
    Sequence& s = *all[static_cast<std::size_t>(i)];
    const auto& st = s.state;
    const auto gen = static_cast<std::int64_t>(st.generated().size());
    if (st.status != kvc::RequestStatus::finished || gen == 0 || static_cast<std::int64_t>(s.logits.size()) != gen)
      return;
    // [snippet:exactness_check]
    // The sequence alone, no cache: row p holds the logits that predict its token p + 1.
    const std::vector<std::int32_t> tokens(st.tokens.begin(), st.tokens.end() - 1);
    const examples::Logits ref = model.forward_no_cache(tokens, true);
    double worst = 0;
    for (std::int64_t g = 0; g < gen; ++g) {
      const Eigen::Index row = st.prompt_length - 1 + g;
      for (Eigen::Index v = 0; v < ref.cols(); ++v)
        worst = std::max(worst, std::abs(static_cast<double>(ref(row, v)) -
                                         s.logits[static_cast<std::size_t>(g)][static_cast<std::size_t>(v)]));
    }
    s.max_diff = worst;
    s.pass = worst <= tolerance;
    // [/snippet]
  });
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    o = parse(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "kvc_serve_demo: %s\n", e.what());
    return 2;
  }
  try {
    const DecoderConfig config = examples::serving_model(o.hybrid, o.linear, o.linear_full);
    const Decoder<float> model(config, o.seed);
    examples::WorkloadShape shape;
    shape.shared_prefix = o.shared_prefix;
    const auto requests = examples::make_requests(o.requests, o.seed, config.vocab_size, shape);
    PagedRun run = serve(o, model, requests);
    check(model, run);
    std::vector<const kvc::RequestState*> finished;
    for (const auto& entry : run.sequences)
      if (entry.second.state.status == kvc::RequestStatus::finished) finished.push_back(&entry.second.state);
    const auto [dyn_seconds, dyn_peak] = examples::one_cache_per_request(model, finished);

    std::int64_t generated = 0, passed = 0, longest = 0;
    for (const auto& [id, s] : run.sequences) {
      generated += static_cast<std::int64_t>(s.state.generated().size());
      longest = std::max<std::int64_t>(longest, static_cast<std::int64_t>(s.state.tokens.size()));
      passed += s.pass ? 1 : 0;
    }
    const auto n = static_cast<std::int64_t>(run.sequences.size());
    const auto attention_layers =
        static_cast<std::int64_t>(std::count_if(config.layer_types.begin(), config.layer_types.end(),
                                                [](const std::string& t) { return t != "linear_attention"; }));
    const std::int64_t token_bytes =
        2 * attention_layers * config.num_key_value_heads * config.head_dim * static_cast<std::int64_t>(sizeof(float));
    const std::int64_t peak_bytes = run.stats.peak_blocks_in_use * run.bytes_per_block;
    const std::int64_t live_bytes = run.stats.live_rows_at_peak * run.bytes_per_block / run.block_size;
    const std::int64_t static_bytes = n * longest * token_bytes;  // a static cache per sequence at the longest
    const double speedup = dyn_seconds / run.seconds;
    const double hit_rate = run.stats.prefix_hit_rate();
    const bool ok = passed == n && run.stats.failed == 0;

    if (o.json) {
      nlohmann::ordered_json j;
      j["requests"] = o.requests;
      j["sequences"] = n;
      j["steps"] = run.steps;
      j["batch_tokens"] = run.tokens;
      j["generated_tokens"] = generated;
      j["seconds"] = run.seconds;
      j["generated_tokens_per_second"] = static_cast<double>(generated) / run.seconds;
      j["num_blocks"] = run.num_blocks;
      j["block_size"] = run.block_size;
      j["swap_blocks"] = run.swap_blocks;
      j["peak_kv_bytes"] = peak_bytes;
      j["live_kv_bytes_at_peak"] = live_bytes;
      j["paging_overhead"] = static_cast<double>(peak_bytes) / static_cast<double>(live_bytes);
      j["static_kv_bytes"] = static_bytes;
      j["prefix_hit_tokens"] = run.stats.prefix_hit_tokens;
      j["prefill_tokens_computed"] = run.stats.prefill_tokens;
      j["prefix_hit_rate"] = hit_rate;
      j["cpu_offloads"] = run.stats.cpu_offloads;
      j["soft_resets"] = run.stats.soft_resets;
      j["forks"] = run.stats.forks;
      j["forks_requeued"] = run.stats.forks_requeued;
      j["one_cache_per_request"] = {{"seconds", dyn_seconds}, {"peak_kv_bytes", dyn_peak}};
      j["throughput_ratio"] = speedup;
      j["peak_kv_ratio"] = static_cast<double>(peak_bytes) / static_cast<double>(dyn_peak);
      j["tolerance"] = tolerance;
      auto& seqs = j["per_sequence"] = nlohmann::ordered_json::array();
      for (const auto& [id, s] : run.sequences)
        seqs.push_back({{"id", id},
                        {"prompt_tokens", s.state.prompt_length},
                        {"generated_tokens", s.state.generated().size()},
                        {"preemptions", s.state.preemptions},
                        {"prefix_match",
                         {{"attention_tokens", s.state.prefix_match.attention_tokens},
                          {"state_tokens", s.state.prefix_match.state_tokens},
                          {"reused_tokens", s.state.prefix_match.tokens}}},
                        {"max_abs_logit_diff", s.max_diff},
                        {"result", s.pass ? "PASS" : "FAIL"}});
      j["passed"] = passed;
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf("model:   %lld layers (%s), hidden %lld, %lld KV heads of %lld, vocabulary %lld, float\n",
                  static_cast<long long>(config.num_hidden_layers),
                  o.linear        ? "linear, sliding and full"
                  : o.linear_full ? "linear and full"
                  : o.hybrid      ? "sliding and full"
                                  : "all full",
                  static_cast<long long>(config.hidden_size), static_cast<long long>(config.num_key_value_heads),
                  static_cast<long long>(config.head_dim), static_cast<long long>(config.vocab_size));
      std::printf(
          "cache:   %lld blocks of %lld tokens (%s), swap pool %lld blocks, %s scheduler, %lld tokens per step\n",
          static_cast<long long>(run.num_blocks), static_cast<long long>(run.block_size),
          human_bytes(static_cast<double>(run.num_blocks * run.bytes_per_block)).c_str(),
          static_cast<long long>(run.swap_blocks), o.scheduler.c_str(), static_cast<long long>(o.max_batch_tokens));
      std::printf("\n%-16s %7s %6s %9s %11s %13s  %s\n", "sequence", "prompt", "reused", "generated", "preemptions",
                  "max |dlogit|", "result");
      for (const auto& [id, s] : run.sequences)
        std::printf("%-16s %7lld %6lld %9lld %11lld %13.2e  %s\n", id.c_str(),
                    static_cast<long long>(s.state.prompt_length), static_cast<long long>(s.state.prefix_match.tokens),
                    static_cast<long long>(s.state.generated().size()), static_cast<long long>(s.state.preemptions),
                    s.max_diff, s.pass ? "PASS" : ("FAIL " + s.state.error).c_str());
      std::printf("\nrequests:      %lld (%lld sequences), %lld steps, %lld tokens through the model, %lld generated\n",
                  static_cast<long long>(o.requests), static_cast<long long>(n), static_cast<long long>(run.steps),
                  static_cast<long long>(run.tokens), static_cast<long long>(generated));
      std::printf(
          "throughput:    %.0f generated tokens/s paged (%.2f s), %.0f one DynamicCache per request (%.2f s): "
          "%.2fx\n",
          static_cast<double>(generated) / run.seconds, run.seconds, static_cast<double>(generated) / dyn_seconds,
          dyn_seconds, speedup);
      std::printf(
          "peak KV:       %s in blocks, %s for the live tokens then (%.3fx); static caches at the longest "
          "sequence: %s; one DynamicCache at a time: %s (paged %.1fx that, serving %lld sequences at once)\n",
          human_bytes(static_cast<double>(peak_bytes)).c_str(), human_bytes(static_cast<double>(live_bytes)).c_str(),
          static_cast<double>(peak_bytes) / static_cast<double>(live_bytes),
          human_bytes(static_cast<double>(static_bytes)).c_str(), human_bytes(static_cast<double>(dyn_peak)).c_str(),
          static_cast<double>(peak_bytes) / static_cast<double>(dyn_peak), static_cast<long long>(n));
      std::printf(
          "sharing:       %lld tokens to prefill found in shared blocks, %lld computed (hit rate %.1f%%); %lld "
          "forks, %lld sequences queued on their own\n",
          static_cast<long long>(run.stats.prefix_hit_tokens), static_cast<long long>(run.stats.prefill_tokens),
          100.0 * hit_rate, static_cast<long long>(run.stats.forks), static_cast<long long>(run.stats.forks_requeued));
      std::printf("preemptions:   %lld (%lld to the swap pool and back, %lld soft resets)\n",
                  static_cast<long long>(run.stats.preemptions()), static_cast<long long>(run.stats.cpu_offloads),
                  static_cast<long long>(run.stats.soft_resets));
      std::printf("kvc_serve_demo: %lld/%lld sequences match forward_no_cache (max |dlogit| <= %.0e)%s\n",
                  static_cast<long long>(passed), static_cast<long long>(n), tolerance, ok ? "" : " FAILED");
    }
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvc_serve_demo: %s\n", e.what());
    return 1;
  }
}
