// kvc_speculative_demo: speculative decoding on hybrid models (linear-attention, sliding and full
// layers; linear-attention and full layers), rolled back exactly by the cache. The example decoder
// (examples/common/decoder.hpp) runs a gated linear recurrence in its linear_attention layers; a
// prompt-lookup drafter proposes up to k tokens from the sequence so far; one forward pass
// verifies them; the agreeing prefix is kept and the rest taken back with cache.crop(-n): the
// linear layers restore their recurrent and conv states from a ring of the last k steps
// (kvc::SpeculativeLinearAttentionLayer<k>), the sliding layers keep k tokens past their window
// (kvc::SpeculativeSlidingWindowLayer<k>), and the cache type promises the rollback at compile
// time (kvc::require_rollback<k>, docs/rollback.md).
//
// Then the same sequences are served together, as requests of a kvc::PagedCache driven by the
// continuous-batching scheduler: before each step every request gets its drafts
// (ContinuousBatchingScheduler::set_draft_tokens), one forward pass runs them all, and update()
// keeps the agreeing drafts and rolls the rest back (docs/continuous_batching.md): the
// linear-attention states from a ring of their last steps (state_rollback_tokens), in place, while
// a sliding window that has slid makes the request prefill its kept tokens again.
//
// Each sequence is also decoded greedily, one token per forward pass, on transformers' default
// layers (kvc::make_dynamic_cache): every emitted token and every logit, dense and paged, must be
// the same. Prints PASS per sequence, the acceptance rate and the forward passes saved; exits 0
// when every sequence passes, 1 otherwise.
//
//   kvc_speculative_demo [--tokens N] [--sequences S] [--draft K]   (K from 1 to 4)
#include "../common/decoder.hpp"
#include "../common/serving.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using examples::Decoder;
using examples::DecoderConfig;
using examples::Logits;

constexpr std::int64_t max_draft = 4;

// The speculative decoder's cache: what each kind can take back is in its type.
using SpeculativeCache = kvc::Cache<kvc::Layers<kvc::SpeculativeLinearAttentionLayer<max_draft>,
                                                kvc::SpeculativeSlidingWindowLayer<max_draft>, kvc::DynamicLayer>>;

SpeculativeCache speculative_cache(const DecoderConfig& config) {
  std::vector<SpeculativeCache::kind_variant> kinds;
  for (std::int64_t l = 0; l < config.num_hidden_layers; ++l) {
    if (config.is_linear(l))
      kinds.emplace_back(kvc::SpeculativeLinearAttentionLayer<max_draft>{});
    else if (config.is_sliding(l))
      kinds.emplace_back(kvc::SpeculativeSlidingWindowLayer<max_draft>{{.sliding_window = *config.sliding_window}});
    else
      kinds.emplace_back(kvc::DynamicLayer{});
  }
  SpeculativeCache cache(kinds);
  kvc::require_rollback<max_draft>(cache);  // fails to compile if a kind could not take back k tokens
  return cache;
}

std::int32_t argmax(const Eigen::Ref<const Eigen::RowVectorXf>& row) {
  Eigen::Index best = 0;
  row.maxCoeff(&best);
  return static_cast<std::int32_t>(best);
}

// What a decoding run emitted: each token with the logits it was chosen from.
struct Run {
  std::vector<std::int32_t> tokens;
  std::vector<Eigen::RowVectorXf> logits;
  std::int64_t forwards = 0;  // forward passes, the prefill included
  std::int64_t drafted = 0, accepted = 0;
};

// Greedy decoding, one token per forward pass.
template <class Cache>
Run greedy(const Decoder<float>& model, Cache cache, const std::vector<std::int32_t>& prompt, std::int64_t n) {
  Run run;
  Logits logits = model.forward(prompt, cache);
  run.forwards = 1;
  while (true) {
    run.logits.emplace_back(logits.row(0));
    run.tokens.push_back(argmax(logits.row(0)));
    if (static_cast<std::int64_t>(run.tokens.size()) == n) return run;
    const std::int32_t next = run.tokens.back();
    logits = model.forward(std::span<const std::int32_t>(&next, 1), cache);
    ++run.forwards;
  }
}

// Prompt lookup: the tokens that followed an earlier occurrence of the sequence's last 3 (then 2,
// then 1) tokens, at most k of them: the latest occurrence followed by k tokens, else the latest.
std::vector<std::int32_t> lookup_draft(const std::vector<std::int32_t>& seq, std::int64_t k) {
  const auto n = static_cast<std::int64_t>(seq.size());
  for (std::int64_t g = 3; g >= 1; --g) {
    std::int64_t found = -1;
    for (std::int64_t start = n - g - 1; start >= 0; --start) {
      if (!std::equal(seq.begin() + start, seq.begin() + start + g, seq.end() - g)) continue;
      if (found < 0) found = start + g;
      if (n - (start + g) >= k) {
        found = start + g;
        break;
      }
    }
    if (found >= 0) return {seq.begin() + found, seq.begin() + found + std::min(k, n - found)};
  }
  return {};
}

// Speculative decoding: draft, verify in one pass, keep the agreeing prefix, crop the rest.
Run speculative(const Decoder<float>& model, SpeculativeCache cache, const std::vector<std::int32_t>& prompt,
                std::int64_t n, std::int64_t k) {
  Run run;
  Logits logits = model.forward(prompt, cache);
  run.forwards = 1;
  run.logits.emplace_back(logits.row(0));
  run.tokens.push_back(argmax(logits.row(0)));
  std::vector<std::int32_t> seq = prompt;
  seq.push_back(run.tokens.back());
  while (static_cast<std::int64_t>(run.tokens.size()) < n) {
    // The last emitted token is not in the cache yet: it goes first, then the draft.
    std::vector<std::int32_t> input{run.tokens.back()};
    const std::vector<std::int32_t> draft = lookup_draft(seq, k);
    input.insert(input.end(), draft.begin(), draft.end());
    const Logits verify = model.forward(input, cache, /*all_logits=*/true);
    ++run.forwards;
    std::int64_t m = 0;  // the drafted tokens greedy decoding would have chosen
    while (m < static_cast<std::int64_t>(draft.size()) && argmax(verify.row(m)) == draft[static_cast<std::size_t>(m)])
      ++m;
    run.drafted += static_cast<std::int64_t>(draft.size());
    run.accepted += m;
    cache.crop(-(static_cast<std::int64_t>(draft.size()) - m));  // the rejected drafts, exactly
    for (std::int64_t i = 0; i <= m && static_cast<std::int64_t>(run.tokens.size()) < n; ++i) {
      run.logits.emplace_back(verify.row(i));
      run.tokens.push_back(argmax(verify.row(i)));
      seq.push_back(run.tokens.back());
    }
  }
  return run;
}

// The paged runs: each request's tokens and logits, and the scheduler's counts.
struct PagedRun {
  std::vector<Run> runs;
  kvc::SchedulerStats stats;
};

// Serves the prompts together through a paged cache and the scheduler, n tokens each, greedily;
// before each step, every request gets up to k drafts by prompt lookup (none for k = 0).
PagedRun serve_paged(const Decoder<float>& model, const std::vector<std::vector<std::int32_t>>& prompts, std::int64_t n,
                     std::int64_t k) {
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 8;
  cb.num_blocks = 64 * static_cast<std::int64_t>(prompts.size());
  cb.max_batch_tokens = 512;
  // The linear-attention states keep a ring of their last max_draft steps, so that rejected drafts
  // are taken back in place; a sliding window that has slid cannot be, so such a request prefills
  // its kept tokens again.
  cb.state_rollback_tokens = max_draft;
  examples::ServingCache cache(model.config().cache_config(), cb);
  examples::ServingScheduler scheduler(cache, cb);
  std::map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    index["seq" + std::to_string(i)] = i;
    (void)scheduler.add_request({.request_id = "seq" + std::to_string(i),
                                 .prompt = std::vector<std::int64_t>(prompts[i].begin(), prompts[i].end()),
                                 .max_new_tokens = n});
  }
  PagedRun out;
  out.runs.resize(prompts.size());
  std::vector<std::int64_t> next, before;
  // [snippet:paged_speculative]
  for (;;) {
    // Drafts for every request still running: they follow its last token in its next step.
    for (const auto& [id, i] : index) {
      const kvc::RequestState& st = scheduler.request(id);
      if (st.has_ended() || k == 0) continue;
      const std::vector<std::int32_t> draft = lookup_draft({st.tokens.begin(), st.tokens.end()}, k);
      scheduler.set_draft_tokens(id, std::vector<std::int64_t>(draft.begin(), draft.end()));
    }
    const std::optional<kvc::ScheduledBatch> batch = scheduler.schedule();
    if (!batch) break;
    // One forward pass; a request with k drafts has k + 1 logits rows: the model's choice after
    // its last token and after each draft.
    const Logits logits = examples::forward_step(model, cache, *batch);
    next.resize(static_cast<std::size_t>(logits.rows()));
    for (Eigen::Index r = 0; r < logits.rows(); ++r) next[static_cast<std::size_t>(r)] = argmax(logits.row(r));
    before.clear();
    for (const kvc::ScheduledRequest& r : batch->requests)
      before.push_back(std::ssize(scheduler.request(r.handle).generated()));
    scheduler.update(*batch, next);  // keeps the agreeing drafts, rolls the others back
    // What each request generated came from its first rows.
    Eigen::Index row = 0;
    for (std::size_t j = 0; j < batch->requests.size(); ++j) {
      const kvc::ScheduledRequest& r = batch->requests[j];
      if (!r.has_new_token) continue;
      const std::span<const std::int64_t> made = scheduler.request(r.handle).generated();
      Run& run = out.runs[index.at(r.request_id)];
      for (std::int64_t e = before[j]; e < std::ssize(made); ++e) {
        run.tokens.push_back(static_cast<std::int32_t>(made[static_cast<std::size_t>(e)]));
        run.logits.emplace_back(logits.row(row + (e - before[j])));
      }
      row += 1 + std::ssize(r.draft_tokens);
    }
  }
  // [/snippet]
  out.stats = scheduler.stats();
  return out;
}

// The largest difference between two runs' logits, over the rows both have.
double max_diff(const Run& a, const Run& b) {
  double diff = 0;
  for (std::size_t i = 0; i < a.logits.size() && i < b.logits.size(); ++i)
    diff = std::max(diff, static_cast<double>((a.logits[i] - b.logits[i]).cwiseAbs().maxCoeff()));
  return diff;
}

std::int64_t option(int argc, char** argv, const char* name, std::int64_t fallback, std::int64_t lo, std::int64_t hi) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], name) != 0) continue;
    char* end = nullptr;
    const long long v = std::strtoll(argv[i + 1], &end, 10);
    if (end == argv[i + 1] || *end != '\0' || v < lo || v > hi)
      throw std::invalid_argument(std::string(name) + " must be an integer from " + std::to_string(lo) + " to " +
                                  std::to_string(hi) + ", got '" + argv[i + 1] + "'");
    return v;
  }
  return fallback;
}

}  // namespace

int main(int argc, char** argv) try {
  for (int i = 1; i < argc; i += 2)
    if (std::strcmp(argv[i], "--tokens") != 0 && std::strcmp(argv[i], "--sequences") != 0 &&
        std::strcmp(argv[i], "--draft") != 0)
      throw std::invalid_argument(std::string("unknown option '") + argv[i] +
                                  "' (usage: kvc_speculative_demo [--tokens N] [--sequences S] [--draft K])");
  const std::int64_t tokens = option(argc, argv, "--tokens", 64, 2, 4096);
  const std::int64_t sequences = option(argc, argv, "--sequences", 3, 1, 64);
  const std::int64_t k = option(argc, argv, "--draft", max_draft, 1, max_draft);

  std::printf("kvc_speculative_demo: two hybrids of 4 layers; drafts of up to %lld tokens by prompt lookup\n",
              static_cast<long long>(k));

  // Two models with random weights: with tied embeddings the model tends to repeat what it reads,
  // so the drafter's guesses are mostly right; with an untied LM head its choices look random, so
  // most drafts are rejected and rolled back. Exactness must hold for both.
  std::int64_t passed = 0, checked = 0, drafted = 0, accepted = 0, greedy_forwards = 0, speculative_forwards = 0;
  std::int64_t paged_steps = 0, paged_greedy_steps = 0, paged_drafted = 0, paged_accepted = 0, recomputed = 0;
  const auto report = [&](const char* what, std::int64_t s, const Run& got, const Run& want) {
    // Row arithmetic differs between a pass over one token and over several (the GEMM blocks), so
    // the logits agree to rounding, and the tokens exactly.
    const double diff = max_diff(got, want);
    const bool ok = got.tokens == want.tokens && got.logits.size() == want.logits.size() && diff <= 1e-4;
    passed += ok ? 1 : 0;
    ++checked;
    std::printf("  %s sequence %lld: tokens %s, logits max |diff| %.3g: %s\n", what, static_cast<long long>(s),
                got.tokens == want.tokens ? "equal" : "DIFFER", diff, ok ? "PASS" : "FAIL");
  };
  // The layouts: linear-attention, sliding (a short window, so that it slides while the demo
  // decodes) and full layers; and linear-attention and full layers only (Qwen3-Next's kind).
  for (const bool with_sliding : {true, false})
    for (const bool tied : {true, false}) {
      DecoderConfig config;
      if (with_sliding) {
        config.sliding_window = 16;
        config.layer_types = {"linear_attention", "sliding_attention", "full_attention", "linear_attention"};
      } else {
        config.layer_types = {"linear_attention", "full_attention", "linear_attention", "full_attention"};
      }
      config.tie_word_embeddings = tied;
      const Decoder<float> model(config, 2026);
      std::printf("%s, %s:\n",
                  with_sliding ? "linear_attention, sliding_attention (window 16), full_attention, linear_attention"
                               : "linear_attention, full_attention, linear_attention, full_attention",
                  tied ? "a model with tied embeddings (repetitive)" : "a model with its own LM head (random-looking)");
      std::vector<std::vector<std::int32_t>> prompts;
      std::vector<Run> wanted;
      for (std::int64_t s = 0; s < sequences; ++s) {
        // A prompt with a repeated motif, as code or structured text has: the drafter finds matches.
        std::mt19937 rng(static_cast<std::uint32_t>(100 + s));
        std::uniform_int_distribution<std::int32_t> token(0, static_cast<std::int32_t>(config.vocab_size - 1));
        std::vector<std::int32_t> motif(8), prompt;
        for (auto& t : motif) t = token(rng);
        for (int r = 0; r < 3; ++r) {
          prompt.insert(prompt.end(), motif.begin(), motif.end());
          prompt.push_back(token(rng));
        }
        const Run want = greedy(model, kvc::make_dynamic_cache<float>(config.cache_config()), prompt, tokens);
        const Run got = speculative(model, speculative_cache(config), prompt, tokens, k);
        drafted += got.drafted;
        accepted += got.accepted;
        greedy_forwards += want.forwards;
        speculative_forwards += got.forwards;
        std::printf(
            "  dense sequence %lld: %lld tokens in %lld forward passes (greedy: %lld); drafted %lld, accepted %lld\n",
            static_cast<long long>(s), static_cast<long long>(got.tokens.size()), static_cast<long long>(got.forwards),
            static_cast<long long>(want.forwards), static_cast<long long>(got.drafted),
            static_cast<long long>(got.accepted));
        report("dense", s, got, want);
        prompts.push_back(std::move(prompt));
        wanted.push_back(want);
      }
      // The same sequences as requests of one paged cache, with drafts and without.
      const PagedRun spec = serve_paged(model, prompts, tokens, k), plain = serve_paged(model, prompts, tokens, 0);
      std::printf(
          "  paged cache, %lld requests at once: %lld steps (without drafts: %lld); drafted %lld, accepted %lld; "
          "rollbacks in place %lld, by prefilling again %lld (%lld tokens)\n",
          static_cast<long long>(sequences), static_cast<long long>(spec.stats.steps),
          static_cast<long long>(plain.stats.steps), static_cast<long long>(spec.stats.draft_tokens),
          static_cast<long long>(spec.stats.accepted_draft_tokens), static_cast<long long>(spec.stats.cuts_in_place),
          static_cast<long long>(spec.stats.cuts_prefilled),
          static_cast<long long>(spec.stats.prefill_tokens - plain.stats.prefill_tokens));
      for (std::int64_t s = 0; s < sequences; ++s) {
        report("paged", s, spec.runs[static_cast<std::size_t>(s)], wanted[static_cast<std::size_t>(s)]);
        report("paged, no drafts,", s, plain.runs[static_cast<std::size_t>(s)], wanted[static_cast<std::size_t>(s)]);
      }
      paged_steps += spec.stats.steps;
      paged_greedy_steps += plain.stats.steps;
      paged_drafted += spec.stats.draft_tokens;
      paged_accepted += spec.stats.accepted_draft_tokens;
      recomputed += spec.stats.prefill_tokens - plain.stats.prefill_tokens;
    }
  const auto percent = [](std::int64_t part, std::int64_t all) {
    return all == 0 ? 0.0 : 100.0 * static_cast<double>(part) / static_cast<double>(all);
  };
  std::printf(
      "dense: acceptance %.1f%% (%lld of %lld drafted tokens); %lld forward passes instead of %lld (%lld saved)\n",
      percent(accepted, drafted), static_cast<long long>(accepted), static_cast<long long>(drafted),
      static_cast<long long>(speculative_forwards), static_cast<long long>(greedy_forwards),
      static_cast<long long>(greedy_forwards - speculative_forwards));
  std::printf(
      "paged: acceptance %.1f%% (%lld of %lld drafted tokens); %lld steps instead of %lld (%lld saved); %lld tokens "
      "prefilled again after rollbacks\n",
      percent(paged_accepted, paged_drafted), static_cast<long long>(paged_accepted),
      static_cast<long long>(paged_drafted), static_cast<long long>(paged_steps),
      static_cast<long long>(paged_greedy_steps), static_cast<long long>(paged_greedy_steps - paged_steps),
      static_cast<long long>(recomputed));
  std::printf("kvc_speculative_demo: %lld/%lld sequences equal greedy decoding (tokens and logits): %s\n",
              static_cast<long long>(passed), static_cast<long long>(checked), passed == checked ? "PASS" : "FAIL");
  return passed == checked ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvc_speculative_demo: %s\n", e.what());
  return 2;
}
