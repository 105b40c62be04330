// kvc_paged_cache: a kvc::PagedCache driven by hand, without the scheduler, in one file. Two
// requests share a prompt prefix (the second finds the first's complete blocks by hash and
// computes only its own tokens), the second is offloaded to the swap pool and restored, and every
// step's paged attention is checked against dense attention over the request's whole history.
//
// Exits 0 when every check passes, 1 otherwise.
// [snippet:paged_cache]
#include <kvc/paged.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

constexpr std::int64_t heads = 4, kv_heads = 2, head_dim = 8, block_size = 4;

// Stands in for a model: the query, key or value row of token `id` at position `pos`.
float feature(int which, std::int64_t id, std::int64_t pos, std::int64_t h, std::int64_t d) {
  return std::sin(0.37f * static_cast<float>(id) + 0.11f * static_cast<float>(pos) + 1.3f * static_cast<float>(which) +
                  0.7f * static_cast<float>(h) + 0.05f * static_cast<float>(d));
}
kvc::HostTensor<float> rows(int which, std::int64_t h, const std::vector<std::int64_t>& tokens, std::int64_t from) {
  kvc::HostTensor<float> t(1, h, static_cast<std::int64_t>(tokens.size()) - from, head_dim);
  for (std::int64_t hh = 0; hh < h; ++hh)
    for (std::int64_t s = 0; s < t.dimension(2); ++s)
      for (std::int64_t d = 0; d < head_dim; ++d)
        t(0, hh, s, d) = feature(which, tokens[static_cast<std::size_t>(from + s)], from + s, hh, d);
  return t;
}

bool all_ok = true;
void check(bool ok, const char* what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAILED", what);
  all_ok = all_ok && ok;
}

// The step of request `id` over tokens[past..]: blocks for them, paged attention (cached tokens
// from the pools, the new ones from the inputs), then the write of the new keys and values. The
// output is compared with dense attention over every token's keys and values.
void step(kvc::PagedCache<kvc::HostStorage<float>>& cache, const std::string& id,
          const std::vector<std::int64_t>& tokens, std::int64_t past) {
  const auto total = static_cast<std::int64_t>(tokens.size()), q = total - past;
  const std::int64_t have = cache.blocks_in_use(id), need = (total + block_size - 1) / block_size - have;
  if (need > 0 && !cache.allocate_blocks(need, id, have)) throw std::runtime_error("out of blocks");
  kvc::PagedIndices writes(static_cast<std::size_t>(cache.num_groups())), no_reads(writes.size());
  cache.extend_read_and_write_indices(id, past, q, nullptr, writes);
  const std::vector<std::string> ids = {id};
  const std::vector<std::int64_t> cu = {0, q}, pasts = {past};
  const kvc::PagedAttentionStep layout{ids, cu, pasts};

  const auto queries = rows(0, heads, tokens, past), keys = rows(1, kv_heads, tokens, past),
             values = rows(2, kv_heads, tokens, past);
  const kvc::HostTensor<float> out = kvc::paged_attention(cache, 0, layout, queries, keys, values);
  cache.update(keys, values, 0, no_reads, writes);
  // The blocks this step filled are hashed, so that a later prompt with the same tokens finds them.
  cache.mark_shareable_blocks_as_complete(id, total / block_size - past / block_size, tokens);

  const kvc::HostTensor<float> dense = kvc::scaled_dot_product_attention(
      queries, rows(1, kv_heads, tokens, 0), rows(2, kv_heads, tokens, 0), kvc::AttentionMask{total, 0, past});
  float worst = 0;
  for (Eigen::Index i = 0; i < out.size(); ++i) worst = std::max(worst, std::abs(out.data()[i] - dense.data()[i]));
  check(worst < 1e-5f, ("request " + id + ", tokens " + std::to_string(past) + ".." + std::to_string(total) +
                        ": paged attention = dense attention")
                           .c_str());
}

}  // namespace

int main() {
  kvc::ModelConfig config;
  config.num_hidden_layers = 1;
  config.num_attention_heads = heads;
  config.num_key_value_heads = kv_heads;
  config.head_dim = head_dim;
  config.hidden_size = heads * head_dim;
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = block_size;
  cb.num_blocks = 16;
  kvc::PagedCache<kvc::HostStorage<float>> cache(config, cb);
  cache.reserve_swap_space(8);

  // Request a: a 14-token prompt, then one decode token.
  std::vector<std::int64_t> a = {5, 9, 2, 7, 1, 8, 3, 3, 6, 4, 0, 2, 11, 13};
  step(cache, "a", a, 0);
  a.push_back(21);
  step(cache, "a", a, 14);

  // Request b: a's first 12 tokens, then its own. Its first 3 blocks are a's, found by hash.
  std::vector<std::int64_t> b(a.begin(), a.begin() + 12);
  b.insert(b.end(), {30, 31, 32});
  const std::int64_t reused = cache.search_prefix_match("b", b);
  check(reused == 12, "b reuses a's 12 prompt tokens (3 blocks)");
  step(cache, "b", b, reused);

  // b leaves the pools for the swap pool, and comes back to fresh blocks to decode on.
  const std::int64_t free_before = cache.get_num_free_blocks();
  check(cache.offload_request("b"), "b offloaded to the swap pool");
  check(cache.get_num_free_blocks() == free_before + 1, "b's own block is free again (the shared ones stay a's)");
  if (!cache.allocate_blocks(4, "b", 0)) return 1;  // as many blocks as b held
  cache.restore_request("b");
  b.push_back(40);
  step(cache, "b", b, 15);

  cache.free_blocks("a");
  cache.free_blocks("b");
  check(cache.get_num_free_blocks() == 16, "every block free at the end");
  std::printf("kvc_paged_cache: %s\n", all_ok ? "OK" : "FAILED");
  return all_ok ? 0 : 1;
}
// [/snippet]
