#pragma once
// Continuous batching with the decoder of examples/common: the model shape, the requests, the
// sampler and the serving loop shared by kvc_serve_demo (examples/06_serve) and the serving
// benchmark (benchmarks/bench_serving.cpp).
#include <kvc/kvc.hpp>
#include <kvc/paged/paged_attention.hpp>
#include <kvc/paged/scheduler.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "decoder.hpp"

namespace examples {

using ServingStorage = kvc::HostStorage<float>;
using ServingCache = kvc::PagedCache<ServingStorage>;
using ServingScheduler = kvc::ContinuousBatchingScheduler<ServingStorage>;

// The decoder in a serving shape: 4 layers, hidden 768, 12 query heads and 2 KV heads of 64, MLP
// 2048, vocabulary 2048: 105 MB of float weights, more than this machine's caches, so that
// decoding one token at a time reads every weight from memory while a batch of tokens shares each
// read. Llama-style (every layer full attention, so prompts can share blocks), Gemma-style with
// sliding layers of window 64, or (linear) a hybrid of linear-attention, sliding and full layers,
// the linear layers' states kept in the paged cache's state slots, or (linear_full) linear-attention
// and full layers only (Qwen3-Next's kind of hybrid, which prefix sharing serves through state
// snapshots).
inline DecoderConfig serving_model(bool hybrid, bool linear = false, bool linear_full = false) {
  DecoderConfig c;
  c.num_hidden_layers = 4;
  c.hidden_size = 768;
  c.num_attention_heads = 12;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.intermediate_size = 2048;
  c.vocab_size = 2048;
  if (linear) {
    c.layer_types = {"linear_attention", "sliding_attention", "full_attention", "linear_attention"};
    c.sliding_window = 64;
  } else if (linear_full) {
    c.layer_types = {"linear_attention", "full_attention", "linear_attention", "full_attention"};
    c.sliding_window.reset();
  } else if (hybrid) {
    c.layer_types = {"sliding_attention", "full_attention", "sliding_attention", "full_attention"};
    c.sliding_window = 64;
  } else {
    c.layer_types.assign(4, "full_attention");
    c.sliding_window.reset();
  }
  return c;
}

// What the requests look like: lengths drawn uniformly from the ranges.
struct WorkloadShape {
  std::int64_t shared_prefix = 32;               // tokens of the system prefix
  double shared_fraction = 0.5;                  // of the requests that start with it (evenly spread)
  std::int64_t prompt_min = 8, prompt_max = 40;  // tokens after the prefix
  std::int64_t new_min = 64, new_max = 160;      // max_new_tokens
  std::int64_t forked_requests = 2;              // requests 1 .. n ask for three sequences
};

// n requests "req0" .. from the seed.
inline std::vector<kvc::GenerationRequest> make_requests(std::int64_t n, std::uint64_t seed, std::int64_t vocab,
                                                         const WorkloadShape& shape) {
  std::mt19937_64 rng(seed ^ 0x5eed5eedULL);
  auto draw = [&](std::int64_t lo, std::int64_t hi) {
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng);
  };
  std::vector<std::int64_t> system(static_cast<std::size_t>(shape.shared_prefix));
  for (auto& t : system) t = draw(0, vocab - 1);
  std::vector<kvc::GenerationRequest> out;
  double shared = shape.shared_fraction > 0 ? 1.0 - shape.shared_fraction : 0.0;
  for (std::int64_t i = 0; i < n; ++i) {
    kvc::GenerationRequest r;
    r.request_id = "req" + std::to_string(i);
    shared += shape.shared_fraction;
    if (shared >= 1.0 - 1e-9) {  // every 1 / fraction-th request, the first one included
      r.prompt = system;
      shared -= 1.0;
    }
    for (std::int64_t k = draw(shape.prompt_min, shape.prompt_max); k > 0; --k) r.prompt.push_back(draw(0, vocab - 1));
    r.max_new_tokens = draw(shape.new_min, shape.new_max);
    r.num_return_sequences = i >= 1 && i <= shape.forked_requests ? 3 : 1;
    out.push_back(std::move(r));
  }
  return out;
}

// A sampled token (Gumbel-max at temperature 1): the noise depends only on the seed, the sequence
// and the position, so a sequence samples the same way whatever else shares its batch, and the
// children of a fork draw differently from their parent.
inline std::int64_t sample(const Logits& logits, Eigen::Index row, const std::string& id, std::int64_t position,
                           std::uint64_t seed) {
  std::mt19937_64 rng(seed ^ std::hash<std::string>{}(id) ^
                      (static_cast<std::uint64_t>(position) * 0x9e3779b97f4a7c15ULL));
  std::uniform_real_distribution<double> u(1e-12, 1.0);
  Eigen::Index best = 0;
  double best_score = -INFINITY;
  for (Eigen::Index v = 0; v < logits.cols(); ++v) {
    const double score = static_cast<double>(logits(row, v)) - std::log(-std::log(u(rng)));
    if (score > best_score) best_score = score, best = v;
  }
  return static_cast<std::int64_t>(best);
}

// The token of every logits row of a step (`next`, in row order: the requests that give a token, in
// batch order), the rows sampled on OpenMP's threads where the program is built with it. Each
// row's draw depends on its own seed only, so the tokens do not depend on the thread count.
inline void sample_batch(const Logits& logits, const kvc::ScheduledBatch& batch, std::uint64_t seed,
                         std::vector<std::int64_t>& next) {
  std::vector<const kvc::ScheduledRequest*> rows;
  for (const kvc::ScheduledRequest& s : batch.requests)
    if (s.has_new_token) rows.push_back(&s);
  next.resize(rows.size());
  const auto n = static_cast<std::int64_t>(rows.size());
#if defined(_OPENMP)
#pragma omp parallel for schedule(static) if (n >= 4)
#endif
  for (std::int64_t i = 0; i < n; ++i) {
    const kvc::ScheduledRequest& s = *rows[static_cast<std::size_t>(i)];
    next[static_cast<std::size_t>(i)] = sample(logits, i, s.request_id, s.past + s.query_length, seed);
  }
}

// One step of the model over a scheduled batch: each layer attends through the block tables
// (kvc::paged_attention reads the cached keys in place and the step's own from its inputs, on the
// context's threads and workspace), then stores the step's keys and values (write-only update).
// A linear_attention layer runs each request's tokens through that request's states in the cache
// (update_conv_state and update_recurrent_state by its key). Returns the logits of the rows that
// give a token, in batch order.
inline Logits forward_step(const Decoder<float>& model, ServingCache& cache, const kvc::ScheduledBatch& batch,
                           const kvc::AttentionContext& context = {}) {
  const std::vector<std::int32_t> ids(batch.input_ids.begin(), batch.input_ids.end());
  const auto attend = [&](std::int64_t layer, const kvc::HostTensor<float>& q, const kvc::HostTensor<float>& k,
                          const kvc::HostTensor<float>& v) {
    kvc::HostTensor<float> out;
    kvc::paged_attention(cache, layer, batch.attention_step(), q, k, v, out, context);
    cache.update(k, v, layer, batch.read_index, batch.write_index);
    return out;
  };
  if (cache.state_layers().empty()) return model.forward_packed(ids, batch.position_ids, batch.logits_indices, attend);
  using Matrix = Decoder<float>::Matrix;
  const auto linear = [&](std::int64_t layer, const Matrix& q, const Matrix& k, const Matrix& v, Matrix& out) {
    out.resize(q.rows(), q.cols());
    for (std::size_t i = 0; i < batch.request_keys.size(); ++i) {
      const kvc::paged::RequestKey key = batch.request_keys[i];
      const Eigen::Index first = batch.cu_seqlens_q[i], count = batch.cu_seqlens_q[i + 1] - first;
      model.linear_rows(
          cache.recurrent_state(key, layer),
          [&](const auto& column) {
            return cache.update_conv_state(column, key, layer, 0, Decoder<float>::conv_kernel);
          },
          [&](const auto& state) { cache.update_recurrent_state(state, key, layer); }, layer, q, k, v, out, first,
          count);
    }
  };
  return model.forward_packed(ids, batch.position_ids, batch.logits_indices, attend, linear);
}

struct ServeTotals {
  std::int64_t steps = 0, batch_tokens = 0;
  double seconds = 0;
};

// Runs the scheduler to the end: each step's logits rows are sampled, and on_token(request, row
// of logits, token) sees each; on_step() runs after each update (finished requests can be taken
// there).
inline ServeTotals serve(
    const Decoder<float>& model, ServingCache& cache, ServingScheduler& scheduler, std::uint64_t seed,
    const std::function<void(const kvc::ScheduledRequest&, const Logits&, Eigen::Index, std::int64_t)>& on_token,
    const std::function<void()>& on_step) {
  ServeTotals totals;
  const auto start = std::chrono::steady_clock::now();
  const AttentionExecutor executor{};  // every thread the program is given (OpenMP), or one
  kvc::AttentionWorkspace workspace;   // the attention's scratch, reused by every step
  std::vector<std::int64_t> next;      // one token per logits row
  while (auto batch = scheduler.schedule()) {
    const Logits logits = forward_step(model, cache, *batch, {executor, &workspace});
    sample_batch(logits, *batch, seed, next);
    Eigen::Index row = 0;
    for (const kvc::ScheduledRequest& s : batch->requests) {
      if (!s.has_new_token) continue;
      if (on_token) on_token(s, logits, row, next[static_cast<std::size_t>(row)]);
      ++row;
    }
    scheduler.update(*batch, next);
    ++totals.steps;
    totals.batch_tokens += batch->num_tokens();
    if (on_step) on_step();
  }
  totals.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (on_step) on_step();
  return totals;
}

// The sequences of finished requests again, one after another, each through its own DynamicCache
// (make_dynamic_cache's cache for a model with linear_attention layers), teacher-forced with the
// tokens they generated (the same work as serving them, without batching). Returns seconds and
// the largest cache any of them held.
inline std::pair<double, std::int64_t> one_cache_per_request(const Decoder<float>& model,
                                                             const std::vector<const kvc::RequestState*>& sequences) {
  std::int64_t peak = 0;
  const auto start = std::chrono::steady_clock::now();
  const auto& types = model.config().layer_types;
  const bool linear = std::find(types.begin(), types.end(), "linear_attention") != types.end();
  const auto one = [&](const kvc::RequestState& st, auto&& cache) {
    const std::vector<std::int32_t> tokens(st.tokens.begin(), st.tokens.end());
    model.forward(std::span(tokens).first(static_cast<std::size_t>(st.prompt_length)), cache);
    for (std::size_t t = static_cast<std::size_t>(st.prompt_length); t + 1 < tokens.size(); ++t)
      model.forward(std::span(tokens).subspan(t, 1), cache);
    peak = std::max<std::int64_t>(peak, cache.bytes());
  };
  for (const kvc::RequestState* st : sequences)
    if (linear)
      one(*st, kvc::make_dynamic_cache<float>(model.config().cache_config()));
    else
      one(*st, kvc::DynamicCache<float>());
  return {std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), peak};
}

}  // namespace examples
