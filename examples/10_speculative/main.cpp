// kvc_speculative_demo: speculative decoding on a hybrid model (linear-attention, sliding and full
// layers), rolled back exactly by the cache. The example decoder (examples/common/decoder.hpp) runs
// a gated linear recurrence in its linear_attention layers; a prompt-lookup drafter proposes up to
// k tokens from the sequence so far; one forward pass verifies them; the agreeing prefix is kept
// and the rest taken back with cache.crop(-n): the linear layers restore their recurrent and conv
// states from a ring of the last k steps (kvc::SpeculativeLinearAttentionLayer<k>), the sliding
// layers keep k tokens past their window (kvc::SpeculativeSlidingWindowLayer<k>), and the cache
// type promises the rollback at compile time (kvc::require_rollback<k>, docs/rollback.md).
//
// Each sequence is also decoded greedily, one token per forward pass, on transformers' default
// layers (kvc::make_dynamic_cache): every emitted token and every logit must be the same. Prints
// PASS per sequence, the acceptance rate and the forward passes saved; exits 0 when every sequence
// passes, 1 otherwise.
//
//   kvc_speculative_demo [--tokens N] [--sequences S] [--draft K]   (K from 1 to 4)
#include "../common/decoder.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
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

  DecoderConfig config;
  config.sliding_window = 16;  // short, so that the window slides while the demo decodes
  config.layer_types = {"linear_attention", "sliding_attention", "full_attention", "linear_attention"};
  std::printf(
      "kvc_speculative_demo: a hybrid of %lld layers (linear_attention, sliding_attention with window %lld, "
      "full_attention, linear_attention); drafts of up to %lld tokens by prompt lookup\n",
      static_cast<long long>(config.num_hidden_layers), static_cast<long long>(*config.sliding_window),
      static_cast<long long>(k));

  // Two models with random weights: with tied embeddings the model tends to repeat what it reads,
  // so the drafter's guesses are mostly right; with an untied LM head its choices look random, so
  // most drafts are rejected and rolled back. Exactness must hold for both.
  std::int64_t passed = 0, drafted = 0, accepted = 0, greedy_forwards = 0, speculative_forwards = 0;
  for (std::int64_t run_index = 0; run_index < 2 * sequences; ++run_index) {
    const std::int64_t s = run_index % sequences;
    config.tie_word_embeddings = run_index < sequences;
    const Decoder<float> model(config, 2026);
    if (s == 0)
      std::printf("%s:\n", config.tie_word_embeddings ? "a model with tied embeddings (repetitive)"
                                                      : "a model with its own LM head (random-looking)");
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
    double diff = 0;
    for (std::size_t i = 0; i < want.logits.size() && i < got.logits.size(); ++i)
      diff = std::max(diff, static_cast<double>((want.logits[i] - got.logits[i]).cwiseAbs().maxCoeff()));
    // Row arithmetic differs between a pass over one token and over k + 1 (the GEMM blocks), so the
    // logits agree to rounding, and the tokens exactly.
    const bool ok = got.tokens == want.tokens && diff <= 1e-4;
    passed += ok ? 1 : 0;
    drafted += got.drafted;
    accepted += got.accepted;
    greedy_forwards += want.forwards;
    speculative_forwards += got.forwards;
    std::printf(
        "  sequence %lld: %lld tokens in %lld forward passes (greedy: %lld); drafted %lld, accepted %lld; "
        "tokens %s, logits max |diff| %.3g: %s\n",
        static_cast<long long>(s), static_cast<long long>(got.tokens.size()), static_cast<long long>(got.forwards),
        static_cast<long long>(want.forwards), static_cast<long long>(got.drafted),
        static_cast<long long>(got.accepted), got.tokens == want.tokens ? "equal" : "DIFFER", diff,
        ok ? "PASS" : "FAIL");
  }
  std::printf("acceptance %.1f%% (%lld of %lld drafted tokens); %lld forward passes instead of %lld (%lld saved)\n",
              drafted == 0 ? 0.0 : 100.0 * static_cast<double>(accepted) / static_cast<double>(drafted),
              static_cast<long long>(accepted), static_cast<long long>(drafted),
              static_cast<long long>(speculative_forwards), static_cast<long long>(greedy_forwards),
              static_cast<long long>(greedy_forwards - speculative_forwards));
  std::printf("kvc_speculative_demo: %lld/%lld sequences equal greedy decoding (tokens and logits): %s\n",
              static_cast<long long>(passed), static_cast<long long>(2 * sequences),
              passed == 2 * sequences ? "PASS" : "FAIL");
  return passed == 2 * sequences ? 0 : 1;
} catch (const std::exception& e) {
  std::fprintf(stderr, "kvc_speculative_demo: %s\n", e.what());
  return 2;
}
