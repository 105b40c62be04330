#pragma once
// A toy model for the continuous-batching tests (tests/unit/paged_scheduler.cpp, the model-checked
// scheduler runs of tests/support/scheduler_model.hpp): the key and value at position p of a
// sequence are a function of its tokens 0..p (identical prefixes give identical rows, as a real
// model's would, so prefix sharing and forks are exact), and its next token is a function of every
// token so far. A layer with linear-attention states runs one token at a time: its conv state
// keeps the last conv_kernel columns (token, layer), and its recurrent state [1, 2] is folded from
// the one before and the token, so that a state resumed from the wrong place shows in every later
// one. No doctest here: the fuzz target includes it too.

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include <kvc/paged/scheduler.hpp>
#include <kvc/policies/storage/host.hpp>
#include <kvc/tensor.hpp>

namespace kvc_toy {

using Cache = kvc::PagedCache<kvc::HostStorage<float>>;
using Scheduler = kvc::ContinuousBatchingScheduler<kvc::HostStorage<float>>;
inline constexpr std::int64_t D = 4, KVH = 2, VOCAB = 40;

inline kvc::ModelConfig model(const std::vector<std::string>& types, std::int64_t window = 6) {
  kvc::ModelConfig c;
  c.num_hidden_layers = static_cast<std::int64_t>(types.size());
  c.num_attention_heads = KVH;
  c.num_key_value_heads = KVH;
  c.head_dim = D;
  c.hidden_size = KVH * D;
  c.sliding_window = window;
  c.layer_types = types;
  return c;
}

inline std::uint64_t mix(std::uint64_t h, std::uint64_t x) {
  std::uint64_t z = h + 0x9e3779b97f4a7c15ULL * (x + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
inline std::uint64_t prefix_hash(std::span<const std::int64_t> tokens) {
  std::uint64_t h = 7;
  for (const std::int64_t t : tokens) h = mix(h, static_cast<std::uint64_t>(t));
  return h;
}
// Row element (layer, k or v, head, d) of a position whose prefix hashes to h: exact in float.
inline float element(std::uint64_t h, std::int64_t layer, int kv, std::int64_t head, std::int64_t d) {
  return static_cast<float>(mix(h, static_cast<std::uint64_t>(((layer * 2 + kv) * KVH + head) * D + d)) % 4096) / 64.0f;
}
inline std::int64_t next_token(std::span<const std::int64_t> tokens) {
  return static_cast<std::int64_t>(mix(prefix_hash(tokens), 99) % VOCAB);
}

inline constexpr std::int64_t conv_kernel = 3;
// The recurrent state after `token` from state (r0, r1), in a layer: exact in float.
inline std::array<float, 2> fold(std::array<float, 2> r, std::int64_t token, std::int64_t layer) {
  const float r0 = std::fmod(r[0] * 3.0f + static_cast<float>(token + 1), 4093.0f);
  return {r0, std::fmod(r[1] + r0 + static_cast<float>(layer), 4093.0f)};
}
// Whether the layer has keys and values (else it has linear-attention states only).
inline bool has_kv(const Cache& cache, std::int64_t layer) {
  for (const auto& g : cache.layer_groups().groups)
    if (std::find(g.begin(), g.end(), layer) != g.end()) return true;
  return false;
}

// A layer with states over the batch: each request's tokens, one at a time, through its states.
inline void write_states(Cache& cache, const kvc::ScheduledBatch& batch, std::int64_t layer) {
  Eigen::Tensor<float, 3, Eigen::RowMajor> column(1, 2, 1);
  Eigen::Tensor<float, 2, Eigen::RowMajor> state(1, 2);
  for (std::size_t r = 0; r < batch.requests.size(); ++r) {
    const kvc::paged::RequestKey key = batch.request_keys[r];
    for (std::int64_t t = batch.cu_seqlens_q[r]; t < batch.cu_seqlens_q[r + 1]; ++t) {
      const std::int64_t token = batch.input_ids[static_cast<std::size_t>(t)];
      const auto held = cache.recurrent_state(key, layer);
      std::array<float, 2> now{0.0f, 0.0f};
      if (held.rank > 0) now = {held.data()[0], held.data()[1]};
      column(0, 0, 0) = static_cast<float>(token);
      column(0, 1, 0) = static_cast<float>(layer);
      (void)cache.update_conv_state(column, key, layer, 0, conv_kernel);
      now = fold(now, token, layer);
      state(0, 0) = now[0];
      state(0, 1) = now[1];
      (void)cache.update_recurrent_state(state, key, layer);
    }
  }
}

// The pool row of a request's position in a group: a full group's block table, or a sliding
// group's ring slot.
inline std::int64_t pool_row(const Cache& cache, std::int64_t group, const std::string& id, std::int64_t pos) {
  const auto& table = cache.block_table(group, id);
  const bool sliding = cache.is_sliding_group(group);
  const std::int64_t slot = sliding ? pos % cache.sliding_window() : pos, bs = cache.block_size();
  return table.at(static_cast<std::size_t>(slot / bs)) * bs + slot % bs;
}

// The sequence the batch's request r runs on: its cached tokens, then the step's inputs (its own
// tokens, and any draft tokens after them).
inline std::vector<std::int64_t> batch_sequence(const Scheduler& s, const kvc::ScheduledBatch& batch, std::size_t r) {
  const auto& tokens = s.request(batch.request_ids[r]).tokens;
  std::vector<std::int64_t> seq(tokens.begin(), tokens.begin() + batch.past[r]);
  seq.insert(seq.end(), batch.input_ids.begin() + batch.cu_seqlens_q[r],
             batch.input_ids.begin() + batch.cu_seqlens_q[r + 1]);
  return seq;
}

// The model's forward over a batch: every layer stores each token's key and value, computed from
// the token's request's own tokens up to it.
inline void write_batch(Cache& cache, const Scheduler& s, const kvc::ScheduledBatch& batch, std::int64_t layers) {
  const std::int64_t T = batch.num_tokens();
  for (std::int64_t layer = 0; layer < layers; ++layer) {
    if (std::find(cache.state_layers().begin(), cache.state_layers().end(), layer) != cache.state_layers().end())
      write_states(cache, batch, layer);
    if (!has_kv(cache, layer)) continue;
    kvc::HostTensor<float> k(1, KVH, T, D), v(1, KVH, T, D);
    for (std::size_t r = 0; r < batch.requests.size(); ++r) {
      const std::vector<std::int64_t> tokens = batch_sequence(s, batch, r);
      for (std::int64_t t = batch.cu_seqlens_q[r]; t < batch.cu_seqlens_q[r + 1]; ++t) {
        const auto pos = static_cast<std::size_t>(batch.position_ids[static_cast<std::size_t>(t)]);
        const std::uint64_t h = prefix_hash(std::span(tokens).first(pos + 1));
        for (std::int64_t hd = 0; hd < KVH; ++hd)
          for (std::int64_t d = 0; d < D; ++d) {
            k(0, hd, t, d) = element(h, layer, 0, hd, d);
            v(0, hd, t, d) = element(h, layer, 1, hd, d);
          }
      }
    }
    cache.update(kvc::HostStorage<float>::input_view(k), kvc::HostStorage<float>::input_view(v), layer,
                 batch.read_index, batch.write_index);
  }
}

// The next token of every logits row of the batch, in the order update() takes: a request's
// choice after its last token, and with draft tokens after each of them too.
inline std::vector<std::int64_t> next_tokens(const Scheduler& s, const kvc::ScheduledBatch& batch) {
  std::vector<std::int64_t> next;
  for (std::size_t r = 0; r < batch.requests.size(); ++r)
    if (batch.requests[r].has_new_token) {
      const std::vector<std::int64_t> seq = batch_sequence(s, batch, r);
      const std::size_t drafts = batch.requests[r].draft_tokens.size();
      for (std::size_t end = seq.size() - drafts; end <= seq.size(); ++end)
        next.push_back(next_token(std::span(seq).first(end)));
    }
  return next;
}

// The first of a request's cached positions [0, end) (a sliding group's last window of them) whose
// key or value in the pools is not the request's own, as "layer L position P"; empty when every
// row is right. `count` counts the rows checked.
inline std::string wrong_row(const Cache& cache, const std::string& id, const std::vector<std::int64_t>& tokens,
                             std::int64_t end, std::int64_t layers, std::int64_t* count = nullptr) {
  const std::int64_t rows = (cache.num_blocks() + 2) * cache.block_size();
  for (std::int64_t layer = 0; layer < layers; ++layer) {
    if (!has_kv(cache, layer)) continue;
    const auto [g, j] = cache.layer_group(layer);
    const bool sliding = cache.is_sliding_group(g);
    const std::int64_t from = sliding ? std::max<std::int64_t>(end - cache.sliding_window(), 0) : 0;
    for (std::int64_t pos = from; pos < end; ++pos) {
      const std::uint64_t h = prefix_hash(std::span(tokens).first(static_cast<std::size_t>(pos + 1)));
      const std::int64_t row = pool_row(cache, g, id, pos);
      for (std::int64_t hd = 0; hd < KVH; ++hd)
        for (std::int64_t d = 0; d < D; ++d) {
          const std::int64_t at = (hd * rows + row) * D + d;
          if (cache.key_pool(j)[at] != element(h, layer, 0, hd, d) ||
              cache.value_pool(j)[at] != element(h, layer, 1, hd, d))
            return "layer " + std::to_string(layer) + " position " + std::to_string(pos);
        }
      if (count) ++*count;
    }
  }
  return {};
}

// The first layer whose states (conv window, recurrent state) are not those of the request's
// tokens [0, end) (none written for end 0), as "layer L state"; empty when every state is right (or
// the model has none).
inline std::string wrong_state(const Cache& cache, const std::string& id, const std::vector<std::int64_t>& tokens,
                               std::int64_t end) {
  for (const std::int64_t layer : cache.state_layers()) {
    std::array<float, 2> want{0.0f, 0.0f};
    for (std::int64_t p = 0; p < end; ++p) want = fold(want, tokens[static_cast<std::size_t>(p)], layer);
    const auto r = cache.recurrent_state(id, layer);
    const auto c = cache.conv_state(id, layer);
    if (end == 0) {  // nothing run yet: nothing written
      if (r.rank != 0 || c.rank != 0) return "layer " + std::to_string(layer) + " state";
      continue;
    }
    bool ok = r.rank > 0 && r.size() == 2 && r.data()[0] == want[0] && r.data()[1] == want[1] && c.rank == 3 &&
              c.extent(1) == 2 && c.extent(2) == conv_kernel;
    for (std::int64_t j = 0; ok && j < conv_kernel; ++j) {
      const std::int64_t p = end - conv_kernel + j;
      const float token = p < 0 ? 0.0f : static_cast<float>(tokens[static_cast<std::size_t>(p)]);
      const float tag = p < 0 ? 0.0f : static_cast<float>(layer);
      ok = c.data()[j] == token && c.data()[conv_kernel + j] == tag;
    }
    if (!ok) return "layer " + std::to_string(layer) + " state";
  }
  return {};
}

}  // namespace kvc_toy
