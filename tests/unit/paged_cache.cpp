// kvc::PagedCache<HostStorage>: construction and its messages, the padding zone, allocation over
// groups (transformers' will_allocation_be_successful vectors), update's write-only, full and
// sliding paths on the hybrid worked example, forks with copy-on-write, and random batches of
// requests (prefill chunks, decode, prefix sharing, forks, finishing) checked against a model that
// keeps each request's tokens (generation/continuous_batching/cache.py at a597f974; docs/paged.md).

#include "../support/kvc_test.hpp"
#include "../support/paged_snapshot.hpp"

#include <kvc/paged/continuous_batching_config_json.hpp>
#include <kvc/paged/memory_planner.hpp>
#include <kvc/paged/paged_cache.hpp>
#include <kvc/policies/storage/host.hpp>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <random>
#include <string>
#include <vector>

using Cache = kvc::PagedCache<kvc::HostStorage<float>>;
using ids = std::vector<std::int64_t>;

namespace {

kvc::ModelConfig model(std::string_view letters, std::int64_t kv_heads = 2, std::int64_t head_dim = 3,
                       std::optional<std::int64_t> window = std::nullopt) {
  kvc::ModelConfig c;
  c.num_hidden_layers = static_cast<std::int64_t>(letters.size());
  c.num_attention_heads = kv_heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = head_dim;
  c.hidden_size = kv_heads * head_dim;
  c.sliding_window = window;
  std::vector<std::string> types;
  for (const char ch : letters) types.push_back(ch == 's' ? "sliding_attention" : "full_attention");
  c.layer_types = types;
  return c;
}
kvc::ContinuousBatchingConfig cb(std::int64_t block_size, std::int64_t num_blocks, bool sharing = true) {
  kvc::ContinuousBatchingConfig c;
  c.block_size = block_size;
  c.num_blocks = num_blocks;
  c.allow_block_sharing = sharing;
  return c;
}

// The K (or V: +0.5) of token `token` at position `pos`, layer `layer`, head h, element d: exact in
// float, and the same for every request that has that token at that position (shared prefixes).
float value(std::int64_t token, std::int64_t pos, std::int64_t layer, std::int64_t h, std::int64_t d, bool v) {
  return static_cast<float>(token * 4096 + pos * 16 + layer * 4 + h) + 0.125f * static_cast<float>(d) +
         (v ? 0.5f : 0.f);
}

// The new tokens of a batch as [1, heads, T, dim].
kvc::HostTensor<float> step_tensor(const std::vector<std::pair<std::int64_t, std::int64_t>>& token_pos,
                                   std::int64_t layer, std::int64_t heads, std::int64_t dim, bool v) {
  kvc::HostTensor<float> t(1, heads, static_cast<Eigen::Index>(token_pos.size()), dim);
  for (std::size_t i = 0; i < token_pos.size(); ++i)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t d = 0; d < dim; ++d)
        t(0, h, static_cast<Eigen::Index>(i), d) = value(token_pos[i].first, token_pos[i].second, layer, h, d, v);
  return t;
}
kvc::TensorView<float> view(const kvc::HostTensor<float>& t) {
  return {t.data(),
          {t.dimension(0), t.dimension(1), t.dimension(2), t.dimension(3)},
          {t.dimension(1) * t.dimension(2) * t.dimension(3), t.dimension(2) * t.dimension(3), t.dimension(3), 1}};
}

}  // namespace

TEST_CASE("PagedCache: construction, the padding zone and transformers' messages") {
  const Cache c(model("fs", 2, 3, 6), cb(4, 8));
  CHECK(c.read_trash_index() == 32);
  CHECK(c.sentinel_index() == 33);
  CHECK(c.write_trash_index() == 36);
  CHECK(c.num_groups() == 2);
  CHECK(c.group_size() == 1);
  CHECK(c.num_full_attention_groups() == 1);
  CHECK(c.num_sliding_attention_groups() == 1);
  CHECK(c.max_sliding_window_blocks_per_request() == 2);
  CHECK(!c.use_prefix_sharing());
  CHECK(c.bytes() == 2 * 1 * 10 * 4 * 2 * 3 * 4);
  CHECK(c.get_num_free_blocks() == 8);
  // The read-trash block is zeroed.
  for (std::int64_t h = 0; h < 2; ++h)  // [heads, 40 rows, 3]
    for (std::int64_t e = (h * 40 + 32) * 3; e < (h * 40 + 36) * 3; ++e) CHECK(c.key_pool(0)[e] == 0.f);
  CHECK(Cache(model("ff"), cb(4, 8)).use_prefix_sharing());
  CHECK(!Cache(model("ff"), cb(4, 8, false)).use_prefix_sharing());

  CHECK_THROWS_WITH_AS(Cache(model("f"), cb(3, 8)), "Block size must be at least 4, but got 3", kvc::ValueError);
  auto chunked = model("f");
  chunked.layer_types = std::vector<std::string>{"chunked_attention"};
  CHECK_THROWS_WITH_AS(Cache(chunked, cb(4, 8)), "Invalid group type: chunked_attention", kvc::ValueError);
  auto mlp = model("ff");  // (layers with linear-attention states: tests/unit/paged_states.cpp)
  mlp.layer_types = std::vector<std::string>{"full_attention", "mlp"};
  CHECK_THROWS_WITH_AS(Cache(mlp, cb(4, 8)), "Invalid group type: mlp", kvc::ValueError);
  kvc::ContinuousBatchingConfig unplanned;
  unplanned.block_size = 4;
  CHECK_THROWS_AS(Cache(model("f"), unplanned), kvc::ValueError);
  CHECK_THROWS_WITH_AS(Cache(model("fs"), cb(4, 8)),
                       "kvc::PagedCache: the model has sliding_attention layers but no sliding_window",
                       kvc::ValueError);
  // Without layer_types: all sliding with a window, all full without.
  kvc::ModelConfig plain = model("ff");
  plain.layer_types.reset();
  CHECK(Cache(plain, cb(4, 8)).num_full_attention_groups() == 1);
  plain.sliding_window = 5;
  CHECK(Cache(plain, cb(4, 8)).num_sliding_attention_groups() == 1);
}

TEST_CASE("PagedCache: will_allocation_be_successful, transformers' test vectors") {
  // (requested, allocated, layer types, window -> max sliding blocks at block size 4, free blocks, result).
  // transformers' vectors with two full groups and no sliding group cannot come from a model (the
  // gcd rule makes one group of two layers); the others can.
  struct row {
    std::int64_t n, allocated;
    std::string_view types;
    std::int64_t window, free;
    bool ok;
  };
  for (const row& r : {row{2, 0, "f", 0, 10, true}, row{2, 0, "fs", 16, 10, true}, row{3, 2, "fs", 16, 5, true},
                       row{3, 5, "fs", 16, 5, true}, row{6, 4, "fs", 16, 5, false}, row{2, 1, "fss", 16, 6, true},
                       row{0, 0, "fs", 16, 1, true}, row{2, 0, "fs", 12, 4, true}, row{5, 0, "f", 0, 4, false}}) {
    CAPTURE(r.types);
    CAPTURE(r.n);
    const Cache c(model(r.types, 1, 2, r.window > 0 ? std::optional<std::int64_t>(r.window) : std::nullopt),
                  cb(4, r.free));
    CHECK(c.will_allocation_be_successful(r.n, r.allocated) == r.ok);
  }
  // blocks_needed: n per full group, plus what each sliding ring still lacks, at most n.
  const Cache c(model("fss", 1, 2, 16), cb(4, 20));
  CHECK(c.blocks_needed(2, 1) == 2 + 2 * 2);
  CHECK(c.blocks_needed(3, 2) == 3 + 2 * 2);
  CHECK(c.blocks_needed(3, 5) == 3);
}

TEST_CASE("PagedCache: allocation over groups is all or nothing") {
  Cache c(model("fs", 1, 2, 8), cb(4, 5));
  CHECK(c.allocate_blocks(2, "a", 0) == 2);  // full 2, sliding 2 (its whole ring)
  CHECK(c.blocks_in_use("a") == 4);
  CHECK(c.get_num_free_blocks() == 1);
  CHECK(!c.allocate_blocks(1, "b", 0));  // needs 2
  CHECK(c.get_num_free_blocks() == 1);
  CHECK(c.blocks_in_use("b") == 0);
  CHECK(c.allocate_blocks(1, "a", 2) == 1);  // the ring is whole: only the full group grows
  CHECK(c.blocks_in_use("a") == 5);
  c.free_blocks("a");
  CHECK(c.get_num_free_blocks() == 5);
  CHECK(c.allocate_blocks(1, "x", 0) == 1);
  CHECK(c.allocate_blocks(1, "y", 0) == 1);
  c.free_all_requests();
  CHECK(c.get_num_free_blocks() == 5);
}

TEST_CASE("PagedCache::update: the hybrid worked example (bs 4, sw 6, NB 8), prefill 9 then decode to 14") {
  // Layer 0 full (group 0), layer 1 sliding (group 1). Token id = 1 + position.
  const std::int64_t heads = 2, dim = 3;
  Cache c(model("fs", heads, dim, 6), cb(4, 8));
  std::int64_t allocated = 0;
  for (std::int64_t past = 0; past < 14;) {
    const std::int64_t q = past == 0 ? 9 : 1;
    const std::int64_t need = (past + q + 3) / 4 - allocated;
    if (need > 0) allocated += *c.allocate_blocks(need, "r", allocated);
    kvc::PagedIndices reads(2), writes(2);
    c.extend_read_and_write_indices("r", past, q, past == 0 ? nullptr : &reads, writes);
    std::vector<std::pair<std::int64_t, std::int64_t>> tp;
    for (std::int64_t p = past; p < past + q; ++p) tp.emplace_back(1 + p, p);
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      const auto k = step_tensor(tp, layer, heads, dim, false), v = step_tensor(tp, layer, heads, dim, true);
      const auto kv = c.update(view(k), view(v), layer, reads, writes);
      // What attention sees: the full layer every position, the sliding layer the last
      // min(past, 5) cached positions and the new ones (the write-only prefill returns its input).
      const std::int64_t first = layer == 0 || past == 0 ? 0 : past - std::min<std::int64_t>(past, 5);
      REQUIRE(kv.keys.extent(2) == past + q - first);
      for (std::int64_t i = 0; i < kv.keys.extent(2); ++i)
        for (std::int64_t h = 0; h < heads; ++h)
          for (std::int64_t d = 0; d < dim; ++d) {
            const std::int64_t p = first + i;
            CHECK_MESSAGE(kv.keys(0, h, i, d) == value(1 + p, p, layer, h, d, false),
                          "past " << past << " layer " << layer << " position " << p);
            CHECK(kv.values(0, h, i, d) == value(1 + p, p, layer, h, d, true));
          }
    }
    past += q;
  }
  CHECK(allocated == 4);
  CHECK(c.blocks_in_use("r") == 4 + 2);
  const auto s = c.get_seqlens_k(9, 1);
  CHECK(s.full_attention == 10);
  CHECK(s.sliding_attention == 6);
  std::vector<std::int64_t> table(2 * 32, -1);
  CHECK_THROWS_WITH_AS(c.fill_block_table("r", 13, 1, table),
                       "Sliding window attention layers do not support block table", kvc::NotImplementedError);
}

TEST_CASE("PagedCache::update refuses bad input before it writes anything") {
  const std::int64_t heads = 2, dim = 3;
  Cache c(model("f", heads, dim), cb(4, 4));
  REQUIRE(c.allocate_blocks(1, "r", 0));
  kvc::PagedIndices reads(1), writes(1);
  c.extend_read_and_write_indices("r", 0, 2, &reads, writes);
  const auto k = step_tensor({{1, 0}, {2, 1}}, 0, heads, dim, false),
             v = step_tensor({{1, 0}, {2, 1}}, 0, heads, dim, true);
  c.update(view(k), view(v), 0, reads, writes);
  const std::vector<float> before(c.key_pool(0), c.key_pool(0) + 6 * 4 * heads * dim);
  auto unchanged = [&] { return std::equal(before.begin(), before.end(), c.key_pool(0)); };
  const auto k3 = step_tensor({{1, 0}, {2, 1}, {3, 2}}, 0, heads, dim, false);
  kvc::PagedIndices bad = writes;
  bad[0][1] = 24;  // one past the last row
  CHECK_THROWS_WITH_AS(c.update(view(k), view(v), 0, reads, bad),
                       "kvc::PagedCache::update: write row 24 is outside the cache's 24 rows", kvc::ValueError);
  CHECK_THROWS_AS(c.update(view(k3), view(k3), 0, reads, writes), kvc::ValueError);  // 3 tokens, 2 rows
  CHECK_THROWS_AS(c.update(view(k), view(k3), 0, reads, writes), kvc::ValueError);   // K and V disagree
  CHECK_THROWS_AS(c.update(view(k), view(v), 1, reads, writes), kvc::IndexError);    // no layer 1
  kvc::HostTensor<float> wrong_heads(1, 1, 2, dim);
  wrong_heads.setZero();
  CHECK_THROWS_WITH_AS(c.update(view(wrong_heads), view(wrong_heads), 0, reads, writes),
                       "kvc::PagedCache::update: keys must be [1, 2, tokens, 3], got [1, 1, 2, 3]", kvc::ValueError);
  CHECK(unchanged());
  std::vector<std::int64_t> table(1 * 32, -1);
  c.fill_block_table("r", 0, 2, table);
  CHECK(table[0] == c.block_table(0, "r")[0]);
  CHECK(table[1] == -1);
}

TEST_CASE("PagedCache::write_all_layers writes what update writes, and checks every layer first") {
  const std::int64_t heads = 2, dim = 3;
  Cache a(model("fs", heads, dim, 5), cb(4, 8)), b = a;
  for (Cache* c : {&a, &b}) REQUIRE(c->allocate_blocks(2, "r", 0));
  kvc::PagedIndices none(2), writes(2);
  a.extend_read_and_write_indices("r", 0, 7, nullptr, writes);
  const auto k0 = step_tensor({{1, 0}, {2, 1}, {3, 2}, {4, 3}, {5, 4}, {6, 5}, {7, 6}}, 0, heads, dim, false);
  const auto k1 = step_tensor({{1, 0}, {2, 1}, {3, 2}, {4, 3}, {5, 4}, {6, 5}, {7, 6}}, 1, heads, dim, true);
  const std::vector<kvc::TensorView<float>> keys = {view(k0), view(k1)}, values = {view(k1), view(k0)};
  for (std::int64_t layer = 0; layer < 2; ++layer)
    b.update(keys[static_cast<std::size_t>(layer)], values[static_cast<std::size_t>(layer)], layer, none, writes);
  const std::vector<float> before(a.key_pool(0), a.key_pool(0) + 10 * 4 * heads * dim);
  const std::vector<kvc::TensorView<float>> one = {view(k0)};
  CHECK_THROWS_WITH_AS(a.write_all_layers(one, one, writes),
                       "kvc::PagedCache::write_all_layers: 1 keys and 1 values for 2 layers, and 2 write lists for 2 "
                       "layer groups",
                       kvc::ValueError);
  kvc::PagedIndices bad = writes;
  bad[1].pop_back();  // layer 1's group: 6 rows for 7 tokens, found after layer 0 passed its checks
  CHECK_THROWS_WITH_AS(a.write_all_layers(keys, values, bad),
                       "kvc::PagedCache::update: 7 new tokens but 6 write rows for group 1", kvc::ValueError);
  CHECK(std::equal(before.begin(), before.end(), a.key_pool(0)));  // nothing written
  a.write_all_layers(keys, values, writes);
  const std::int64_t n = 10 * 4 * heads * dim;  // (blocks + 2) * block_size rows of every head
  CHECK(std::equal(a.key_pool(0), a.key_pool(0) + n, b.key_pool(0)));
  CHECK(std::equal(a.value_pool(0), a.value_pool(0) + n, b.value_pool(0)));
}

TEST_CASE("PagedCache: random batches of requests read exactly their own tokens") {
  // A model keeps each request's tokens; each step picks some requests and a query length for each
  // (a prefill chunk or one decode token), allocates the blocks the step needs as transformers'
  // scheduler does, builds the batch's indices and updates every layer, then splits what update
  // returned per request and checks it token by token. Requests finish, fork and (with full
  // attention only) start from a shared prefix.
  for (const std::string_view letters : {"ff", "fsf", "sfs"}) {
    CAPTURE(letters);
    const std::int64_t heads = 2, dim = 2, bs = 4, window = 5;
    kvc_test::captured_warnings quiet;  // requests finished before they got blocks warn, as upstream
    Cache c(model(letters, heads, dim, window), cb(bs, 48));
    c.reserve_swap_space(32);
    int offloads = 0, restores = 0;
    const bool has_sliding = c.num_sliding_attention_groups() > 0;
    const std::int64_t layers = static_cast<std::int64_t>(letters.size());
    std::mt19937 rng(static_cast<unsigned>(letters.size()));
    struct request {
      ids tokens;                  // every token known (prompt, then generated)
      std::int64_t past = 0;       // tokens in the cache
      std::int64_t allocated = 0;  // logical (full-group) blocks
      bool offloaded = false;      // in the swap pool
    };
    std::map<std::string, request> live;
    const ids system = {7, 7, 8, 9, 10, 11, 12, 13};  // two whole blocks many prompts start with
    int next = 0;
    for (int step = 0; step < 120; ++step) {
      // New requests (some with the shared system prompt).
      if (live.size() < 4 || rng() % 3 == 0) {
        const std::string id = "req_" + std::to_string(next++);
        request r;
        if (rng() % 2) r.tokens = system;
        for (std::int64_t i = 0, n = 2 + static_cast<std::int64_t>(rng() % 9); i < n; ++i)
          r.tokens.push_back(20 + static_cast<std::int64_t>(rng() % 30));
        r.past = c.search_prefix_match(id, r.tokens);
        r.allocated = r.past / bs;
        if (r.past == static_cast<std::int64_t>(r.tokens.size())) r.past -= 1;  // keep one token to compute
        live.emplace(id, r);
      }
      // The batch: each request gets a chunk of its prompt, or one decode token.
      std::vector<std::pair<std::string, std::int64_t>> batch;
      for (auto& [id, r] : live) {
        if (rng() % 4 == 0) continue;
        if (r.past == static_cast<std::int64_t>(r.tokens.size()))
          r.tokens.push_back(20 + static_cast<std::int64_t>(rng() % 30));  // "generate" the next token
        const std::int64_t left = static_cast<std::int64_t>(r.tokens.size()) - r.past;
        const std::int64_t q = std::min<std::int64_t>(left, 1 + static_cast<std::int64_t>(rng() % 7));
        const std::int64_t need = (r.past + q + bs - 1) / bs - r.allocated;
        if (need > 0) {
          const auto got = c.allocate_blocks(need, id, r.allocated);
          if (!got) continue;  // out of blocks: this request waits
          r.allocated += need;
        }
        if (r.offloaded) {  // back from the swap pool into the blocks just allocated
          c.restore_request(id);
          r.offloaded = false;
          ++restores;
        }
        batch.emplace_back(id, q);
      }
      if (batch.empty()) continue;
      bool any_cache = false;
      for (const auto& [id, q] : batch) any_cache = any_cache || live[id].past > 0;
      kvc::PagedIndices reads(static_cast<std::size_t>(c.num_groups())), writes(reads.size());
      std::vector<std::pair<std::int64_t, std::int64_t>> tp;
      for (const auto& [id, q] : batch) {
        const request& r = live[id];
        c.extend_read_and_write_indices(id, r.past, q, any_cache ? &reads : nullptr, writes);
        for (std::int64_t p = r.past; p < r.past + q; ++p) tp.emplace_back(r.tokens[static_cast<std::size_t>(p)], p);
      }
      for (std::int64_t layer = 0; layer < layers; ++layer) {
        const bool sliding = letters[static_cast<std::size_t>(layer)] == 's';
        const auto k = step_tensor(tp, layer, heads, dim, false), v = step_tensor(tp, layer, heads, dim, true);
        const auto kv = c.update(view(k), view(v), layer, reads, writes);
        std::int64_t at = 0;
        for (const auto& entry : batch) {  // not a structured binding: clang 14 cannot capture one
          const std::string& id = entry.first;
          const std::int64_t q = entry.second;
          const request& r = live[id];
          const std::int64_t first = !any_cache ? r.past : sliding ? r.past - std::min(r.past, window - 1) : 0;
          for (std::int64_t p = first; p < r.past + q; ++p, ++at) {
            REQUIRE(at < kv.keys.extent(2));
            const std::int64_t token = r.tokens[static_cast<std::size_t>(p)];
            for (std::int64_t h = 0; h < heads; ++h)
              for (std::int64_t d = 0; d < dim; ++d) {
                REQUIRE_MESSAGE(kv.keys(0, h, at, d) == value(token, p, layer, h, d, false),
                                id << " layer " << layer << " position " << p << " step " << step);
                REQUIRE(kv.values(0, h, at, d) == value(token, p, layer, h, d, true));
              }
          }
        }
        CHECK(at == kv.keys.extent(2));
      }
      for (const auto& [id, q] : batch) {
        request& r = live[id];
        r.past += q;
        if (has_sliding) continue;
        std::int64_t marked = 0;  // the leading run of complete blocks
        for (const std::int64_t b : c.block_table(0, id)) {
          if (!c.manager().block(b)->is_complete()) break;
          ++marked;
        }
        c.mark_shareable_blocks_as_complete(id, r.past / bs - marked, r.tokens);
      }
      // Offload one request now and then: it comes back, bit-identical, when it is next scheduled.
      if (!live.empty() && rng() % 3 == 0) {
        auto it = std::next(live.begin(), static_cast<std::ptrdiff_t>(rng() % live.size()));
        if (!it->second.offloaded && it->second.past > 0) {
          const std::int64_t free_before = c.get_num_free_blocks();
          const std::int64_t held = c.blocks_in_use(it->first);
          if (c.offload_request(it->first)) {
            it->second.offloaded = true;
            it->second.allocated = 0;
            ++offloads;
            CHECK(c.blocks_in_use(it->first) == 0);
          } else {
            CHECK(c.get_num_free_blocks() == free_before);  // refused: nothing changed
            CHECK(c.blocks_in_use(it->first) == held);
          }
        }
      }
      // Finish or fork one request now and then.
      if (!live.empty() && rng() % 5 == 0) {
        auto it = std::next(live.begin(), static_cast<std::ptrdiff_t>(rng() % live.size()));
        if (rng() % 2) {
          if (it->second.offloaded)
            c.drop_offloaded_request(it->first);
          else
            c.free_blocks(it->first);
          live.erase(it);
        } else if (!it->second.offloaded && it->second.past > 0 && c.compute_max_num_forks(it->first) >= 1) {
          const std::vector<std::string> kids = {"req_" + std::to_string(next++)};
          c.fork_request(it->first, kids);
          live.emplace(kids[0], it->second);
        }
      }
      // Every held block is counted once: free + held = num_blocks.
      std::map<std::int64_t, int> held;
      for (const auto& entry : live)
        for (std::int64_t g = 0; g < c.num_groups(); ++g)
          if (c.blocks_in_group(static_cast<std::size_t>(g), entry.first) > 0)
            for (const std::int64_t b : c.block_table(g, entry.first)) held[b] += 1;
      CHECK(c.get_num_free_blocks() + static_cast<std::int64_t>(held.size()) == c.num_blocks());
    }
    if (!has_sliding) CHECK(c.total_prefix_length() > 0);
    CHECK(offloads >= 5);
    CHECK(restores >= 3);
  }
}

TEST_CASE("PagedAttentionMemoryHandler: transformers' worked examples (a Llama-3-8B-like model, bf16)") {
  kvc::PagedMemoryModel llama;
  llama.hidden_size = 4096;
  llama.vocab_size = 128256;
  llama.num_attention_heads = 32;
  llama.num_key_value_heads = 8;
  llama.head_dim = 128;
  llama.dtype_bytes = 2;
  llama.num_groups = 1;
  llama.group_size = 32;
  llama.max_blocks_per_request = 0;  // sdpa: no decode fast path
  llama.block_size = 256;
  const std::int64_t gib20 = 20LL << 30;
  {
    const kvc::PagedAttentionMemoryHandler h(llama);
    CHECK(h.lm_head().cm == 521264);
    CHECK(h.lm_head().cn == 131080);
    CHECK(h.attention().cm == 20528);
    CHECK(h.attention().cn == 135176);
    CHECK(h.attention().cmn == 2);
    CHECK(h.attention().cmm == 2);
    CHECK(h.infer_max_batch_tokens_and_num_blocks(std::nullopt, std::nullopt, gib20) ==
          std::pair<std::int64_t, std::int64_t>{8192, 452});
    CHECK(h.compute_memory_footprint(8192, 452) == 21467766784);
    // num_blocks given: M is only bounded by memory (no 8192 cap).
    CHECK(h.infer_max_batch_tokens_and_num_blocks(std::nullopt, 100, gib20).first == 28761);
    // 1 GiB: the 10%-fill bound gives M 582.
    CHECK(h.infer_max_batch_tokens_and_num_blocks(std::nullopt, std::nullopt, 1LL << 30) ==
          std::pair<std::int64_t, std::int64_t>{582, 22});
    // Both given: only checked.
    const std::string too_much = "Memory footprint " + std::to_string(h.compute_memory_footprint(8192, 453)) +
                                 " is more than available memory 21474836480";
    CHECK_THROWS_WITH_AS(h.infer_max_batch_tokens_and_num_blocks(8192, 453, gib20), too_much.c_str(), kvc::MemoryError);
    CHECK_THROWS_WITH_AS(h.infer_max_batch_tokens_and_num_blocks(0, 10, gib20),
                         "Invalid values: max_batch_tokens = 0, num_blocks = 10", kvc::ValueError);
  }
  {
    // paged|flash_attention_2, async batching, a decode block table of 32.
    kvc::PagedMemoryModel flash = llama;
    flash.flash_attention = true;
    flash.async_batching = true;
    flash.max_blocks_per_request = 32;
    const kvc::PagedAttentionMemoryHandler h(flash);
    CHECK(h.lm_head().cm == 521568);
    CHECK(h.attention().cm == 20832);
    CHECK(h.lm_head().cn == 131088);
    CHECK(h.attention().cn == 135184);
    CHECK(h.attention().cmm == 0);
    CHECK(h.infer_max_batch_tokens_and_num_blocks(std::nullopt, std::nullopt, gib20) ==
          std::pair<std::int64_t, std::int64_t>{8192, 512});
  }
  CHECK_THROWS_WITH_AS(kvc::PagedAttentionMemoryHandler::solve_quadratic(1.0, 0.0, 1.0),
                       "No real solution (discriminant = -4.0)", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::PagedAttentionMemoryHandler::solve_quadratic(1, 3, 2), "No positive solution (root = -1.0)",
                       kvc::ValueError);
}

TEST_CASE("PagedCache with a memory budget: num_blocks and max_batch_tokens come from the planner") {
  const kvc::ModelConfig cfg = model("fsfs", 2, 8, 16);
  kvc::ContinuousBatchingConfig c;
  c.block_size = 16;
  const kvc::PagedMemoryBudget budget{.available_bytes = 4 << 20, .vocab_size = 1000};
  const Cache cache(cfg, c, budget);
  const kvc::PagedAttentionMemoryHandler h(Cache::memory_model(cfg, c, budget));
  const auto [m, nb] = h.infer_max_batch_tokens_and_num_blocks(std::nullopt, std::nullopt, 4 << 20);
  CHECK(cache.num_blocks() == nb);
  CHECK(cache.max_batch_tokens() == m);
  CHECK(m == 256);  // the floor of the 10%-fill rule for so small a budget
  CHECK(h.compute_memory_footprint(m, nb) <= (4 << 20));
  CHECK(h.compute_memory_footprint(m, nb + 1) > (4 << 20));
  // The model the planner saw: 2 groups of 2 layers, a sliding group (two masks), float.
  const kvc::PagedMemoryModel mm = Cache::memory_model(cfg, c, budget);
  CHECK(mm.num_groups == 2);
  CHECK(mm.group_size == 2);
  CHECK(mm.has_sliding_groups);
  CHECK(mm.dtype_bytes == 4);
  CHECK(mm.max_blocks_per_request == 32);
  // A value the config sets is kept.
  c.num_blocks = 7;
  CHECK(Cache(cfg, c, budget).num_blocks() == 7);
  // A budget too small for anything.
  c.num_blocks.reset();
  CHECK_THROWS_AS(Cache(cfg, c, kvc::PagedMemoryBudget{.available_bytes = 1000, .vocab_size = 1000}), kvc::ValueError);
}

TEST_CASE("request offload: victims as transformers' offloading manager picks them; the swap pool") {
  using kvc::paged::StarvedRequest;
  const std::map<std::string, std::int64_t> held = {{"a", 3}, {"b", 2}, {"c", 4}, {"d", 1}};
  auto in_use = [&](const std::string& id) { return held.at(id); };
  const std::vector<StarvedRequest> starved = {{"a", 2}, {"b", 2}, {"c", 3}};
  // Demand 7 > 1 free: c goes first (the newest), freeing 4; demand 4 > 5? no: stop.
  CHECK(kvc::paged::select_offload_victims(starved, 1, 4, in_use) == std::vector<std::string>{"c"});
  // Not enough after c: b too, then a; victims come back oldest first.
  CHECK(kvc::paged::select_offload_victims(starved, -10, 5, in_use) == std::vector<std::string>{"a", "b", "c"});
  // The last active request is never evicted.
  CHECK(kvc::paged::select_offload_victims(starved, -10, 2, in_use) == std::vector<std::string>{"c"});
  // Enough free blocks already: nobody.
  CHECK(kvc::paged::select_offload_victims(starved, 7, 4, in_use).empty());

  // The pool: a request that does not fit is refused and keeps its blocks.
  Cache c(model("fs", 1, 2, 8), cb(4, 8));
  c.reserve_swap_space(3);
  CHECK(c.bytes_per_block() == 2 * 1 * 4 * 2 * 4);
  REQUIRE(c.allocate_blocks(2, "big", 0));  // 2 full + 2 sliding blocks
  REQUIRE(c.allocate_blocks(1, "small", 0));
  CHECK(!c.offload_request("big"));
  CHECK(c.blocks_in_use("big") == 4);
  CHECK(!c.offload_request("nobody"));  // holds no block
  CHECK(c.offload_request("small"));
  CHECK(c.is_offloaded("small"));
  CHECK(c.free_swap_blocks() == 1);
  CHECK_THROWS_AS(c.reserve_swap_space(10), kvc::ValueError);
  CHECK_THROWS_WITH_AS(c.restore_request("small"),
                       "kvc::PagedCache: request small needs 1 blocks in group 0 to be restored, and has 0",
                       kvc::ValueError);
  CHECK(c.is_offloaded("small"));
  c.drop_offloaded_request("small");
  CHECK(c.free_swap_blocks() == 3);
}

TEST_CASE("ContinuousBatchingConfig: transformers' defaults, and its fields from JSON") {
  const kvc::ContinuousBatchingConfig d;
  CHECK(d.block_size == 256);
  CHECK(!d.num_blocks);
  CHECK(!d.max_batch_tokens);
  CHECK(d.allow_block_sharing);
  CHECK(d.resolved_max_blocks_per_request() == 32);
  CHECK(d.scheduler_type == "fifo");
  CHECK(d.cpu_offload_space == 0.0);
  CHECK(d.cpu_offload_space_safety_threshold == 0.8);

  const auto c = kvc::continuous_batching_config_from_json(R"({
    "block_size": 32, "num_blocks": 100, "max_batch_tokens": null, "max_memory_percent": 0.5,
    "max_blocks_per_request": 0, "allow_block_sharing": false, "use_async_batching": true,
    "scheduler_type": "prefill_first", "safety_margin": 0.1, "return_logprobs": true,
    "cpu_offload_space": null, "max_queue_size": 8, "use_cuda_graph": [true, false], "seed": 3})");
  CHECK(c.block_size == 32);
  CHECK(c.num_blocks == 100);
  CHECK(!c.max_batch_tokens);
  CHECK(c.max_memory_percent == 0.5);
  CHECK(c.max_blocks_per_request == 0);
  CHECK(c.resolved_max_blocks_per_request() == 0);
  CHECK(!c.allow_block_sharing);
  CHECK(c.use_async_batching == true);
  CHECK(c.scheduler_type == "prefill_first");
  CHECK(c.safety_margin == 0.1);
  CHECK(c.return_logprobs);
  CHECK(!c.cpu_offload_space);
  CHECK(c.max_queue_size == 8);
  // Nested in a generation config.
  CHECK(kvc::continuous_batching_config_from_json(
            R"({"max_new_tokens": 5, "continuous_batching_config": {"block_size": 64}})")
            .block_size == 64);
  CHECK_THROWS_WITH_AS(kvc::continuous_batching_config_from_json(R"({"block_size": "32"})"),
                       "ContinuousBatchingConfig: `block_size` must be an integer, got \"32\"", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::continuous_batching_config_from_json(R"({"safety_margin": 2})"),
                       "ContinuousBatchingConfig: `safety_margin` must be a number between 0.0 and 1.0, got 2",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::continuous_batching_config_from_json(R"({"num_blocks": 0})"),
                       "ContinuousBatchingConfig: `num_blocks` must be a positive integer, got 0", kvc::ValueError);
  CHECK_THROWS_AS(kvc::continuous_batching_config_from_json("{"), kvc::ValueError);
  CHECK_THROWS_AS(kvc::continuous_batching_config_from_json("[1]"), kvc::ValueError);
  // A config read from JSON builds the cache it describes.
  const Cache cache(model("ff"), kvc::continuous_batching_config_from_json(R"({"block_size": 4, "num_blocks": 9})"));
  CHECK(cache.num_blocks() == 9);
}

TEST_CASE("PagedCache under tensor parallelism: sharded heads, sizes agreed as the minimum over ranks") {
  const kvc::ModelConfig cfg = model("ff", 4, 8);
  kvc::PagedTensorParallel tp;
  tp.tp_size = 2;
  tp.kv_is_tp = true;
  const Cache sharded(cfg, cb(4, 10), tp);
  CHECK(sharded.num_key_value_heads() == 2);
  CHECK(sharded.num_blocks() == 10);  // no agreement hook: this rank's value stands
  tp.kv_is_tp = false;                // replicated K/V projections: every head on every rank
  CHECK(Cache(cfg, cb(4, 10), tp).num_key_value_heads() == 4);
  tp.kv_is_tp = true;
  CHECK_THROWS_WITH_AS(Cache(model("ff", 3, 8), cb(4, 10), tp),
                       "Number of key value heads 3 must be divisible by tensor parallel size 2.", kvc::ValueError);
  // The other rank has less room: both take its sizes.
  std::vector<std::int64_t> seen;
  tp.min_over_ranks = [&](std::span<std::int64_t> v) {
    seen.assign(v.begin(), v.end());
    const std::int64_t other[2] = {300, 6};
    for (std::size_t i = 0; i < v.size(); ++i) v[i] = std::min(v[i], other[i]);
  };
  auto c = cb(4, 10);
  c.max_batch_tokens = 512;
  const Cache agreed(cfg, c, tp);
  CHECK(seen == std::vector<std::int64_t>{512, 10});
  CHECK(agreed.num_blocks() == 6);
  CHECK(agreed.max_batch_tokens() == 300);
  // A rank without max_batch_tokens passes "no bound", and takes the other ranks' value.
  const Cache unset(cfg, cb(4, 10), tp);
  CHECK(seen == std::vector<std::int64_t>{INT64_MAX, 10});
  CHECK(unset.max_batch_tokens() == 300);
  // Planned from a budget with this rank's heads: more blocks than planning with every head.
  kvc::ContinuousBatchingConfig unplanned;
  unplanned.block_size = 16;
  tp.min_over_ranks = nullptr;
  const kvc::PagedMemoryBudget budget{.available_bytes = 8 << 20, .vocab_size = 100};
  const Cache planned(cfg, unplanned, tp, budget);
  const Cache unsharded(cfg, unplanned, budget);
  CHECK(planned.num_blocks() > unsharded.num_blocks());
}

namespace {

using kvc_test::paged_snapshot;
paged_snapshot snap(const Cache& c, const std::vector<std::string>& requests) {
  return kvc_test::take_paged_snapshot(c, requests);
}

}  // namespace

TEST_CASE("PagedCache: every refused call changes nothing") {
  for (const std::string_view letters : {"ff", "fs"}) {
    CAPTURE(letters);
    const std::int64_t heads = 2, dim = 2;
    Cache c(model(letters, heads, dim, 6), cb(4, 12));
    c.reserve_swap_space(4);
    const std::vector<std::string> requests = {"a", "b", "off", "nobody"};
    // A state to protect: two requests with tokens, one offloaded, completed blocks.
    const ids prompt = {1, 2, 3, 4, 5, 6, 7};
    for (const std::string r : {"a", "b", "off"}) {
      REQUIRE(c.allocate_blocks(2, r, 0));
      kvc::PagedIndices reads(static_cast<std::size_t>(c.num_groups())), writes(reads.size());
      c.extend_read_and_write_indices(r, 0, 7, nullptr, writes);
      std::vector<std::pair<std::int64_t, std::int64_t>> tp;
      for (std::int64_t p = 0; p < 7; ++p) tp.emplace_back(prompt[static_cast<std::size_t>(p)], p);
      for (std::int64_t layer = 0; layer < 2; ++layer) {
        const auto k = step_tensor(tp, layer, heads, dim, false);
        c.update(view(k), view(k), layer, reads, writes);
      }
      if (letters == "ff") c.mark_shareable_blocks_as_complete(r, 1, prompt);
    }
    REQUIRE(c.offload_request("off"));
    const paged_snapshot before = snap(c, requests);
    auto unchanged = [&] { return snap(c, requests) == before; };

    kvc::PagedIndices reads(static_cast<std::size_t>(c.num_groups())), writes(reads.size());
    c.extend_read_and_write_indices("a", 7, 1, &reads, writes);
    const auto k1 = step_tensor({{9, 7}}, 0, heads, dim, false);
    const auto k2 = step_tensor({{9, 7}, {10, 8}}, 0, heads, dim, false);
    kvc::PagedIndices out_of_range = writes;
    out_of_range[0][0] = (c.num_blocks() + 2) * c.block_size();
    kvc::PagedIndices one_group(static_cast<std::size_t>(c.num_groups() + 1));  // one list too many
    kvc::HostTensor<float> three_heads(1, 3, 1, dim);
    three_heads.setZero();
    std::vector<std::int64_t> small_table(3);
    const std::vector<std::string> existing = {"b"};
    std::vector<std::string> kids;  // more forks than the free blocks allow, whatever each needs
    for (int i = 0; i < 20; ++i) kids.push_back("k" + std::to_string(i));
    const std::vector<std::int64_t> bad_blocks = {0, 99}, two = {0, 1};
    const ids short_prompt = {1, 2};

    CHECK_THROWS_AS(c.allocate_blocks(-1, "a", 2), kvc::ValueError);
    CHECK(!c.allocate_blocks(100, "a", 2));
    CHECK_THROWS_AS(c.update(view(k1), view(k1), 0, reads, out_of_range), kvc::ValueError);
    CHECK_THROWS_AS(c.update(view(k2), view(k2), 0, reads, writes), kvc::ValueError);
    CHECK_THROWS_AS(c.update(view(k1), view(k2), 0, reads, writes), kvc::ValueError);
    CHECK_THROWS_AS(c.update(view(three_heads), view(three_heads), 0, reads, writes), kvc::ValueError);
    CHECK_THROWS_AS(c.update(view(k1), view(k1), 5, reads, writes), kvc::IndexError);
    CHECK_THROWS_AS(c.update(view(k1), view(k1), 0, one_group, writes), kvc::ValueError);
    CHECK_THROWS_AS(c.fill_block_table("a", 7, 1, small_table), kvc::ValueError);
    CHECK_THROWS_AS(c.fork_request("nobody", kids), kvc::ValueError);
    CHECK_THROWS_AS(c.fork_request("a", existing), kvc::ValueError);
    CHECK_THROWS_AS(c.fork_request("a", kids), kvc::ValueError);
    CHECK_THROWS_AS(c.copy_cache(bad_blocks, two), kvc::ValueError);
    CHECK_THROWS_AS(c.copy_cache(two, bad_blocks), kvc::ValueError);
    CHECK_THROWS_AS(c.offload_request("off"), kvc::ValueError);
    CHECK_THROWS_AS(c.restore_request("a"), kvc::ValueError);
    CHECK_THROWS_AS(c.restore_request("off"), kvc::ValueError);  // it has no blocks yet
    CHECK_THROWS_AS(c.reserve_swap_space(8), kvc::ValueError);
    CHECK(!c.offload_request("nobody"));
    if (letters == "ff") {
      CHECK_THROWS_AS(c.search_prefix_match("a", prompt), kvc::ValueError);  // "a" has blocks
      CHECK_THROWS_AS(c.mark_shareable_blocks_as_complete("b", 2, short_prompt), kvc::ValueError);
    }
    CHECK(unchanged());
  }
}

TEST_CASE("the swap pool's size from cpu_offload_space, as transformers' offloading manager plans it") {
  const Cache c(model("f", 2, 4), cb(4, 8));  // K and V, 1 pool each, 4 rows of 2 x 4 floats: 256 bytes
  REQUIRE(c.bytes_per_block() == 256);
  kvc_test::captured_warnings w;
  kvc::ContinuousBatchingConfig o;
  o.cpu_offload_space = 1.0 / 1024;  // 1 MiB
  CHECK(c.plan_swap_blocks(o, std::int64_t{1} << 30) == 4096);
  CHECK(w.messages.empty());
  // Above the cap (0.8 of 1 GiB available): clamped, with transformers' text.
  o.cpu_offload_space = 2.0;
  CHECK(c.plan_swap_blocks(o, std::int64_t{1} << 30) == static_cast<std::int64_t>((1 << 30) * 0.8) / 256);
  REQUIRE(w.messages.size() == 1);
  CHECK(w.messages[0] == "cpu_offload_space=2.0 GiB exceeds 80% of total RAM (1.0 GiB). Clamping to 0.8 GiB.");
  // None: the whole cap.
  o.cpu_offload_space.reset();
  CHECK(c.plan_swap_blocks(o, std::int64_t{1} << 30) == static_cast<std::int64_t>((1 << 30) * 0.8) / 256);
  CHECK(w.messages.back() == "Auto-sizing CPU swap pool from safety threshold: 0.80 GiB.");
  // Too small for one block.
  o.cpu_offload_space = 1e-7;
  CHECK(c.plan_swap_blocks(o, std::int64_t{1} << 30) == 0);
  CHECK(w.messages.back() == "cpu_offload_space=0.0 GiB is too small for even one block. No CPU offloading.");
  // The default 0.0: no pool, no warning.
  const auto before = w.messages.size();
  CHECK(c.plan_swap_blocks(kvc::ContinuousBatchingConfig{}, std::int64_t{1} << 30) == 0);
  CHECK(w.messages.size() == before);
  // Without a RAM figure this machine's /proc/meminfo is read: some blocks for 1 MiB.
  o.cpu_offload_space = 1.0 / 1024;
  CHECK(c.plan_swap_blocks(o) == 4096);
}

TEST_CASE("PagedCache: review findings, each refused without a change") {
  // A fork naming one destination twice (it used to take blocks and references for a table it then dropped).
  Cache full(model("ff", 1, 2), cb(4, 12));
  REQUIRE(full.allocate_blocks(2, "a", 0));
  const std::vector<std::string> twice = {"x", "x"};
  const std::int64_t free_before = full.get_num_free_blocks();
  CHECK_THROWS_WITH_AS(full.fork_request("a", twice), "kvc::paged: fork destination x is named twice", kvc::ValueError);
  CHECK(full.get_num_free_blocks() == free_before);
  // Marking blocks whose tokens do not fit a C int: nothing is hashed.
  const ids big = {1, 2, 3, 4, 5, 6, 7, 1LL << 32};
  CHECK_THROWS_AS(full.mark_shareable_blocks_as_complete("a", 2, big), kvc::ValueError);
  for (const std::int64_t b : full.block_table(0, "a")) CHECK(!full.manager().block(b)->is_complete());
  // Index lists: nothing is appended when a later position has no block.
  kvc::PagedIndices reads(1), writes(1);
  CHECK_THROWS_AS(full.extend_read_and_write_indices("a", 4, 6, &reads, writes), kvc::ValueError);
  CHECK(writes[0].empty());
  CHECK(reads[0].empty());
  // Views whose head_dim is not contiguous.
  full.extend_read_and_write_indices("a", 0, 1, nullptr, writes);
  kvc::HostTensor<float> t(1, 1, 1, 4);
  t.setZero();
  const kvc::TensorView<float> strided{t.data(), {1, 1, 1, 2}, {4, 4, 4, 2}};
  CHECK_THROWS_WITH_AS(full.update(strided, strided, 0, reads, writes),
                       "kvc::PagedCache::update: keys must have contiguous head_dim rows, got strides [4, 4, 4, 2]",
                       kvc::ValueError);
  // num_blocks far too large: refused before anything is allocated for it.
  CHECK_THROWS_AS(Cache(model("f", 8, 128), cb(16, std::int64_t{1} << 39)), kvc::ValueError);
  // A wrong `allocated` for a hybrid: what each group really takes must fit, or nothing is taken.
  Cache hybrid(model("fs", 1, 2, 8), cb(4, 3));
  CHECK(!hybrid.allocate_blocks(2, "r", 2));  // full 2 + sliding 2 (its table is empty) > 3 free
  CHECK(hybrid.get_num_free_blocks() == 3);
  CHECK(hybrid.blocks_in_use("r") == 0);
  // The planner with sizes far beyond any budget: a MemoryError, not a wrapped-around "fits".
  kvc::PagedMemoryModel m;
  m.hidden_size = 4096;
  m.vocab_size = 128256;
  m.num_attention_heads = 32;
  m.num_key_value_heads = 8;
  m.head_dim = 128;
  m.group_size = 32;
  const kvc::PagedAttentionMemoryHandler h(m);
  CHECK_THROWS_AS(h.infer_max_batch_tokens_and_num_blocks(8192, std::int64_t{1} << 39, 20LL << 30), kvc::MemoryError);
  CHECK(h.compute_memory_footprint(8192, std::int64_t{1} << 39) == INT64_MAX);
}

TEST_CASE("PagedCache messages, each word for word") {
  const std::int64_t heads = 2, dim = 2;
  Cache c(model("fs", heads, dim, 6), cb(4, 8));
  c.reserve_swap_space(4);
  REQUIRE(c.allocate_blocks(1, "r", 0));
  REQUIRE(c.allocate_blocks(1, "o", 0));
  REQUIRE(c.offload_request("o"));
  kvc::PagedIndices reads(2), writes(2);
  c.extend_read_and_write_indices("r", 0, 2, &reads, writes);
  const auto k2 = step_tensor({{1, 0}, {2, 1}}, 0, heads, dim, false);
  const auto k1 = step_tensor({{1, 0}}, 0, heads, dim, false);
  kvc::ContinuousBatchingConfig unset;
  unset.block_size = 4;
  kvc::ModelConfig headless = model("f");
  headless.num_attention_heads = 0;
  headless.num_key_value_heads.reset();
  kvc::ModelConfig dimless = model("f");
  dimless.head_dim.reset();
  dimless.hidden_size = 0;
  kvc::PagedIndices one(1), three_sentinels = reads;
  three_sentinels[1] = {c.sentinel_index(), c.sentinel_index(), c.sentinel_index()};
  std::vector<std::int64_t> table(5);
  const std::vector<std::int64_t> src = {0, 1}, dst = {2}, far = {8}, zero = {0};
  struct row {
    std::function<void()> call;
    std::string text;
  };
  const std::vector<row> rows = {
      {[&] { Cache(model("f"), unset); },
       "kvc::PagedCache: num_blocks is not set: set it, or give the cache a memory budget (kvc::PagedMemoryBudget) to "
       "plan it from"},
      {[&] { Cache(headless, cb(4, 8)); },
       "kvc::PagedCache: num_key_value_heads or num_attention_heads could not be found in the config"},
      {[&] { Cache(dimless, cb(4, 8)); },
       "kvc::PagedCache: head_dim or (hidden_size and num_attention_heads) could not be found in the config"},
      {[&] { (void)c.allocate_blocks(-1, "r", 1); }, "kvc::PagedCache: cannot allocate -1 blocks"},
      {[&] { c.extend_read_and_write_indices("r", 0, 1, nullptr, one); },
       "kvc::PagedCache: index lists need one entry per layer group (2)"},
      {[&] { c.fill_block_table("r", 0, 1, table); },
       "kvc::PagedCache: a block table needs num_groups * max_blocks_per_request = 64 entries, got 5"},
      {[&] { c.copy_cache(src, dst); }, "kvc::PagedCache::copy_cache: as many sources as destinations"},
      {[&] { c.copy_cache(far, zero); }, "kvc::PagedCache::copy_cache: block 8 is not one of the 8 blocks"},
      {[&] { c.reserve_swap_space(8); },
       "kvc::PagedCache: the swap pool cannot be resized while 1 requests are offloaded to it"},
      {[&] { (void)c.offload_request("o"); }, "kvc::PagedCache: request o is already offloaded"},
      {[&] { c.restore_request("r"); }, "kvc::PagedCache: request r is not offloaded"},
      {[&] { (void)c.layer_group(2); }, "kvc::PagedCache: layer 2 is out of range for 2 layers"},
      {[&] { (void)c.block_table(2, "r"); }, "kvc::PagedCache: layer group 2 is out of range for 2 groups"},
      {[&] { (void)c.is_sliding_group(-1); }, "kvc::PagedCache: layer group -1 is out of range for 2 groups"},
      {[&] {
         (void)c.allocate_blocks(-1, std::vector<std::string>{"r", "s"});
       },
       "kvc::PagedCache: cannot allocate -1 blocks"},
      {[&] { c.update_rows(view(k1), view(k1), 0, reads[0], writes[0], nullptr, nullptr); },
       "kvc::PagedCache::update: 1 new tokens but 2 write rows for group 0"},
      {[&] { c.update(view(k2), view(k2), 0, one, writes); },
       "kvc::PagedCache::update: index lists need one entry per layer group (2)"},
      {[&] { c.update(view(k2), view(k1), 0, reads, writes); },
       "kvc::PagedCache::update: keys and values have 2 and 1 tokens"},
      {[&] { c.update(view(k1), view(k1), 0, reads, writes); },
       "kvc::PagedCache::update: 1 new tokens but 2 write rows for group 0"},
      {[&] { c.update(view(k2), view(k2), 1, three_sentinels, writes); },
       "kvc::PagedCache::update: 3 sentinel rows but only 2 new tokens"},
  };
  for (const row& r : rows) {
    CAPTURE(r.text);
    std::string got;
    try {
      r.call();
    } catch (const std::exception& e) {
      got = e.what();
    }
    CHECK(got == r.text);
  }
  kvc::ContinuousBatchingConfig o;
  o.cpu_offload_space = -1.0;
  CHECK_THROWS_WITH_AS((void)c.plan_swap_blocks(o, 1 << 30),
                       "kvc::PagedCache: cpu_offload_space must be between 0 and 1e9 GiB, got -1.0", kvc::ValueError);
  o.cpu_offload_space.reset();
  CHECK_THROWS_WITH_AS((void)c.plan_swap_blocks(o, -1),
                       "kvc::PagedCache: cpu_offload_space is None, which sizes the swap pool from the available RAM, "
                       "and the available RAM is unknown: pass it, or an explicit cpu_offload_space in GiB",
                       kvc::ValueError);
  kvc_test::captured_warnings w;
  o.cpu_offload_space = 1.0 / 1024;
  CHECK(c.plan_swap_blocks(o, -1) > 0);
  CHECK(w.messages == std::vector<std::string>{"kvc::PagedCache: the available RAM is unknown, so "
                                               "cpu_offload_space_safety_threshold cannot be enforced"});
  // JSON: every kind of wrong value, and malformed text.
  CHECK_THROWS_WITH_AS(kvc::continuous_batching_config_from_json(R"({"allow_block_sharing": 1})"),
                       "ContinuousBatchingConfig: `allow_block_sharing` must be true or false, got 1", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::continuous_batching_config_from_json(R"({"scheduler_type": 3})"),
                       "ContinuousBatchingConfig: `scheduler_type` must be a string, got 3", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::continuous_batching_config_from_json("[1]"),
                       "ContinuousBatchingConfig: `(the document)` must be a JSON object, got [1]", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::continuous_batching_config_from_json(R"({"max_memory_percent": "a"})"),
                       "ContinuousBatchingConfig: `max_memory_percent` must be a number, got \"a\"", kvc::ValueError);
  std::string malformed;
  try {
    kvc::continuous_batching_config_from_json("{");
  } catch (const kvc::ValueError& e) {
    malformed = e.what();
  }
  CHECK(malformed ==
        "ContinuousBatchingConfig: malformed JSON: [json.exception.parse_error.101] parse error at line 1, column 2: "
        "syntax error while parsing object key - unexpected end of input; expected string literal");
}

TEST_CASE("a sliding group refuses a step too large for memory before it makes a row") {
  const std::int64_t q = std::int64_t{1} << 40;
  // A whole ring (window 4, one block): the rows of the kept tokens are fine, and the 2^40 - 4 rows
  // of write trash in front of them are over kvc's allocation limit (8 TiB of int64).
  Cache whole(model("s", 1, 2, 4), cb(4, 8));
  REQUIRE(whole.allocate_blocks(1, "r", 0));
  kvc::PagedIndices reads(1), writes(1);
  CHECK_THROWS_WITH_AS(whole.extend_read_and_write_indices("r", 0, q, &reads, writes),
                       "kvc: a buffer of [1099511627776] elements of 8 bytes is larger than kvc's allocation limit of "
                       "1099511627776 bytes (kvc::set_allocation_limit)",
                       kvc::ValueError);
  CHECK(writes[0].empty());
  CHECK(reads[0].empty());
  // The step's reads, q sentinels, are checked the same way.
  std::vector<std::int64_t> out;
  CHECK_THROWS_WITH_AS(whole.block_tables().get_read_indices(0, *whole.find_request("r"), 0, q, out),
                       "kvc: a buffer of [1099511627776] elements of 8 bytes is larger than kvc's allocation limit of "
                       "1099511627776 bytes (kvc::set_allocation_limit)",
                       kvc::ValueError);
  CHECK(out.empty());
  // A ring missing a block (window 6 on blocks of 4, one held): the table is checked first, as
  // a full group's is.
  Cache partial(model("s", 1, 2, 6), cb(4, 8));
  REQUIRE(partial.allocate_blocks(1, "r", 0) == 1);
  CHECK_THROWS_WITH_AS(partial.extend_read_and_write_indices("r", 0, q, nullptr, writes),
                       "kvc::paged: request r has 1 blocks in group 0, too few for slot 4", kvc::ValueError);
  CHECK(writes[0].empty());
  // A long prefill that fits still writes its oldest tokens to the trash, then the ring.
  partial.extend_read_and_write_indices("r", 0, 3, nullptr, writes);
  CHECK(writes[0] == ids{0, 1, 2});
  REQUIRE(partial.allocate_blocks(1, "r", 1) == 1);
  writes[0].clear();
  partial.extend_read_and_write_indices("r", 0, 8, nullptr, writes);
  const std::int64_t trash = partial.write_trash_index();
  CHECK(writes[0] == ids{trash, trash, 2, 3, 4, 5, 0, 1});
}

TEST_CASE("PagedCache: lengths and counts at the int64 extremes are ValueErrors naming the call; nothing changes") {
  constexpr std::int64_t big = INT64_MAX;
  for (const std::string_view letters : {"f", "fs"}) {
    CAPTURE(letters);
    Cache c(model(letters, 1, 2, 6), cb(4, 8));
    REQUIRE(c.allocate_blocks(2, "r", 0));
    const auto before = kvc_test::take_paged_snapshot(c, {"r"});
    kvc::PagedIndices reads(static_cast<std::size_t>(c.num_groups())), writes(reads.size());
    std::vector<std::int64_t> table(static_cast<std::size_t>(c.num_groups() * c.max_blocks_per_request()));
    struct row {
      std::function<void()> call;
      std::string text;
    };
    const std::vector<row> rows = {
        {[&] { (void)c.truncate_request("r", big); },
         "kvc::PagedCache::truncate_request: tokens is 9223372036854775807, above kvc's limit of 1099511627776"},
        {[&] { c.extend_read_and_write_indices("r", big, 1, &reads, writes); },
         "kvc::PagedCache::extend_read_and_write_indices: past is 9223372036854775807, above kvc's limit of "
         "1099511627776"},
        {[&] { c.extend_read_and_write_indices("r", 1, big, nullptr, writes); },
         "kvc::PagedCache::extend_read_and_write_indices: q is 9223372036854775807, above kvc's limit of "
         "1099511627776"},
        {[&] { (void)c.allocate_blocks(1, "r", INT64_MIN); },
         "kvc::PagedCache::allocate_blocks: allocated must be 0 or more, got -9223372036854775808"},
        {[&] { (void)c.allocate_blocks(1, "r", big); },
         "kvc::PagedCache::allocate_blocks: allocated is 9223372036854775807, above kvc's limit of 1099511627776"},
        {[&] { (void)c.allocate_blocks(big, "r", 0); },
         "kvc::PagedCache::allocate_blocks: n is 9223372036854775807, above kvc's limit of 1099511627776"},
        {[&] { (void)c.get_seqlens_k(big, 1); },
         "kvc::PagedCache::get_seqlens_k: past is 9223372036854775807, above kvc's limit of 1099511627776"},
        {[&] { (void)c.get_seqlens_k(1, big); },
         "kvc::PagedCache::get_seqlens_k: q is 9223372036854775807, above kvc's limit of 1099511627776"},
        {[&] { (void)c.get_seqlens_k(INT64_MIN, -1); },
         "kvc::PagedCache::get_seqlens_k: past must be 0 or more, got -9223372036854775808"},
    };
    for (const row& r : rows) {
      CAPTURE(r.text);
      std::string got;
      try {
        r.call();
      } catch (const kvc::ValueError& e) {
        got = e.what();
      }
      CHECK(got == r.text);
    }
    if (letters == "f")
      CHECK_THROWS_WITH_AS(c.fill_block_table("r", big, 1, table),
                           "kvc::PagedCache::fill_block_table: past is 9223372036854775807, above kvc's limit of "
                           "1099511627776",
                           kvc::ValueError);
    CHECK(reads == kvc::PagedIndices(reads.size()));
    CHECK(writes == kvc::PagedIndices(writes.size()));
    CHECK(kvc_test::take_paged_snapshot(c, {"r"}) == before);
    // The queries that only count stay total: no overflow, no throw.
    CHECK(c.blocks_needed(1, INT64_MIN) == (letters == "f" ? 1 : 2));
    CHECK(c.blocks_needed(INT64_MAX, 0) == INT64_MAX);
    CHECK(!c.will_allocation_be_successful(INT64_MAX, INT64_MIN));
  }
}

TEST_CASE("PagedAttentionMemoryHandler: the 10%-fill bound squares 0.1 as transformers does (0.1 ** 2)") {
  // A one-layer toy model, bf16, SDPA: cm, cn, cmn, cmm = (54, 12, 2, 2) and (56, 16, 2, 2).
  kvc::PagedMemoryModel toy;
  toy.hidden_size = 1;
  toy.vocab_size = 1;
  toy.num_attention_heads = 1;
  toy.num_key_value_heads = 1;
  toy.head_dim = 1;
  toy.dtype_bytes = 2;
  toy.max_blocks_per_request = 0;
  toy.block_size = 4;
  const kvc::PagedAttentionMemoryHandler h(toy);
  REQUIRE(h.lm_head().cm == 54);
  REQUIRE(h.attention().cn == 16);
  // transformers' plan for 1,638,016 bytes (with 0.01 for 0.1 ** 2 it is (268, 670)).
  CHECK(h.infer_max_batch_tokens_and_num_blocks(std::nullopt, std::nullopt, 1638016) ==
        std::pair<std::int64_t, std::int64_t>{267, 672});
  // Its messages, digit for digit (with 0.01: -577.24 and -0.5789505997312943).
  CHECK_THROWS_WITH_AS(h.infer_max_batch_tokens_and_num_blocks(std::nullopt, std::nullopt, -1000),
                       "No real solution (discriminant = -577.2400000000002)", kvc::ValueError);
  CHECK_THROWS_WITH_AS(h.infer_max_batch_tokens_and_num_blocks(std::nullopt, std::nullopt, -10),
                       "No positive solution (root = -0.5789505997312941)", kvc::ValueError);
}

TEST_CASE("PagedAttentionMemoryHandler: a discriminant of integers prints as a Python int") {
  // transformers' _solve_quadratic(1, 1, 1) computes b**2 - 4*a*c on ints; with floats it prints -3.0.
  CHECK_THROWS_WITH_AS(kvc::PagedAttentionMemoryHandler::solve_quadratic(1, 1, 1),
                       "No real solution (discriminant = -3)", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::PagedAttentionMemoryHandler::solve_quadratic(1.0, 1.0, 1.0),
                       "No real solution (discriminant = -3.0)", kvc::ValueError);
  // Exact, where doubles would print -1.0606877842382992e+20.
  CHECK_THROWS_WITH_AS(kvc::PagedAttentionMemoryHandler::solve_quadratic(std::int64_t{3}, std::int64_t{1} << 31,
                                                                         std::int64_t{INT64_MAX}),
                       "No real solution (discriminant = -106068778423829921780)", kvc::ValueError);
  CHECK(kvc::PagedAttentionMemoryHandler::solve_quadratic(1, -5, 6) == 3);
  CHECK(kvc::PagedAttentionMemoryHandler::solve_quadratic(0, 4, -9) == 2);
  // With num_blocks given, transformers' coefficients are ints (N = num_blocks * block_size). A
  // negative vocabulary is only a way to get past the logits peak to the attention one.
  kvc::PagedMemoryModel odd;
  odd.hidden_size = 1;
  odd.vocab_size = -500;
  odd.num_attention_heads = 1;
  odd.num_key_value_heads = 1;
  odd.head_dim = 1;
  odd.dtype_bytes = 2;
  odd.group_size = 100;
  odd.max_blocks_per_request = 0;
  odd.block_size = 4;
  const kvc::PagedAttentionMemoryHandler h(odd);
  CHECK_THROWS_WITH_AS(h.infer_max_batch_tokens_and_num_blocks(std::nullopt, 96, 1000),
                       "No real solution (discriminant = -578688)", kvc::ValueError);
}

TEST_CASE("the swap-pool warnings come every time, as transformers' logger.warning") {
  const Cache c(model("f", 2, 4), cb(4, 8));
  kvc_test::captured_warnings w;
  kvc::ContinuousBatchingConfig o;
  const std::int64_t gib = std::int64_t{1} << 30;
  for (int i = 0; i < 2; ++i) {
    o.cpu_offload_space = 2.0;
    (void)c.plan_swap_blocks(o, gib);
    o.cpu_offload_space.reset();
    (void)c.plan_swap_blocks(o, gib);
    o.cpu_offload_space = 1e-7;
    (void)c.plan_swap_blocks(o, gib);
    o.cpu_offload_space = 1.0 / 1024;
    (void)c.plan_swap_blocks(o, -1);
  }
  const std::vector<std::string> once = {
      "cpu_offload_space=2.0 GiB exceeds 80% of total RAM (1.0 GiB). Clamping to 0.8 GiB.",
      "Auto-sizing CPU swap pool from safety threshold: 0.80 GiB.",
      "cpu_offload_space=0.0 GiB is too small for even one block. No CPU offloading.",
      "kvc::PagedCache: the available RAM is unknown, so cpu_offload_space_safety_threshold cannot be enforced"};
  std::vector<std::string> twice = once;
  twice.insert(twice.end(), once.begin(), once.end());
  CHECK(w.messages == twice);
}

TEST_CASE("PagedCache transactions: a rollback undoes every change, a commit keeps them and makes the copies") {
  // One sequence of calls (an offload, a fork that evicts a free block still holding a prefix and
  // copies into it, a release, an allocation and a restore, a truncation that copies a shared
  // block) on a cache whose blocks are all taken or hold a prefix: plain, in a transaction that
  // commits, and in one that is rolled back (after the sequence, or after a call that throws).
  const auto heads = 2, dim = 3;
  const auto write = [&](Cache& c, const std::string& id, const ids& tokens, std::int64_t past) {
    kvc::PagedIndices reads(static_cast<std::size_t>(c.num_groups())), writes(reads.size());
    c.extend_read_and_write_indices(id, past, std::ssize(tokens) - past, nullptr, writes);
    std::vector<std::pair<std::int64_t, std::int64_t>> tp;
    for (auto p = past; p < std::ssize(tokens); ++p) tp.emplace_back(tokens[static_cast<std::size_t>(p)], p);
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      const auto k = step_tensor(tp, layer, heads, dim, false), v = step_tensor(tp, layer, heads, dim, true);
      c.update(view(k), view(v), layer, reads, writes);
    }
  };
  const ids a = {1, 2, 3, 4, 5, 6, 7, 8}, p = {20, 21, 22, 23, 24, 25}, q = {30, 31, 32};
  const auto make = [&] {
    Cache c(model("fs", heads, dim, 6), cb(4, 8));
    c.reserve_swap_space(4);
    REQUIRE(c.allocate_blocks(2, "a", 0));  // 2 full + 2 sliding blocks
    write(c, "a", a, 0);
    c.mark_shareable_blocks_as_complete("a", 2, a);
    c.release_request("a");  // its full blocks stay findable: initialized
    REQUIRE(c.allocate_blocks(2, "p", 0));
    write(c, "p", p, 0);
    c.mark_shareable_blocks_as_complete("p", 1, p);
    REQUIRE(c.allocate_blocks(1, "q", 0));
    write(c, "q", q, 0);
    return c;
  };
  const std::vector<std::string> names = {"a", "p", "p1", "q"};
  const auto calls = [&](Cache& c) {
    REQUIRE(c.offload_request("q"));
    const std::string child = "p1";
    const auto copies = c.fork_request("p", std::span(&child, 1));
    CHECK(copies.first.size() == 3);                   // p's partial full block and both sliding blocks
    CHECK(c.manager().num_initialized_blocks() == 1);  // one of a's was evicted for a copy
    c.release_request("p1");
    REQUIRE(c.allocate_blocks(1, "q", 0));
    c.restore_request("q");
    REQUIRE(c.truncate_request("p", 3));  // its first block is complete: copied before the cut
  };

  Cache plain = make();
  calls(plain);
  const kvc_test::paged_snapshot after = kvc_test::take_paged_snapshot(plain, names);

  Cache kept = make();
  kept.begin_transaction();
  CHECK(kept.in_transaction());
  CHECK_THROWS_WITH_AS(kept.begin_transaction(), "kvc::PagedCache::begin_transaction: a transaction is already open",
                       kvc::ValueError);
  calls(kept);
  kept.commit_transaction();
  CHECK(!kept.in_transaction());
  CHECK(kvc_test::take_paged_snapshot(kept, names) == after);

  Cache undone = make();
  const kvc_test::paged_snapshot before = kvc_test::take_paged_snapshot(undone, names);
  undone.begin_transaction();
  calls(undone);
  CHECK(kvc_test::take_paged_snapshot(undone, names) != before);
  undone.rollback_transaction();
  CHECK(!undone.in_transaction());
  CHECK(kvc_test::take_paged_snapshot(undone, names) == before);
  CHECK(undone.manager().num_initialized_blocks() == 2);  // a's blocks hold its prefix again

  Cache failed = make();
  failed.begin_transaction();
  REQUIRE(failed.offload_request("q"));
  const std::vector<std::string> twice = {"p1", "p1"};
  CHECK_THROWS_AS(failed.fork_request("p", twice), kvc::ValueError);
  failed.rollback_transaction();
  CHECK(kvc_test::take_paged_snapshot(failed, names) == before);
  // And the cache works on: the same calls, plainly, end as the plain run did.
  calls(failed);
  CHECK(kvc_test::take_paged_snapshot(failed, names) == after);

  Cache cache = make();
  REQUIRE(cache.offload_request("q"));  // room for the fork's copies
  const std::string child = "p2";
  // [snippet:paged_transaction]
  // A fork and a cut of the child as one: if the cut cannot be made, neither happens.
  cache.transaction([&] {
    cache.fork_request("p", std::span(&child, 1));
    if (!cache.truncate_request(child, 3)) throw std::runtime_error("no block free for the copy");
  });  // kept when it returns (the fork's block copies are made then), rolled back if it throws
  // [/snippet]
  CHECK(cache.blocks_in_group(0, child) == 1);
  CHECK(!cache.in_transaction());

  // transaction(): what throws is rolled back and passed on; a value is returned.
  Cache thrown = make();
  CHECK_THROWS_WITH_AS(thrown.transaction([&] {
    REQUIRE(thrown.offload_request("q"));
    thrown.fork_request("p", twice);
  }),
                       "kvc::paged: fork destination p1 is named twice", kvc::ValueError);
  CHECK(!thrown.in_transaction());
  CHECK(kvc_test::take_paged_snapshot(thrown, names) == before);
  CHECK(thrown.transaction([&] { return thrown.offload_request("q"); }));
  CHECK(thrown.is_offloaded("q"));
}

TEST_CASE("PagedCache's parts alone: block tables, page pools, swap pool") {
  using Pools = kvc::paged::PagePools<kvc::HostStorage<float>>;
  // Block tables: every group of every request or none, and the kinds asked by group.
  const std::vector<std::string> types = {"full_attention", "sliding_attention"};
  kvc::paged::BlockTables t(types, 5, 4, 6, true);
  CHECK(!t.is_sliding(0));
  CHECK(t.is_sliding(1));
  CHECK(t.sentinel_index() == 21);
  // (requests by key: the tables make one for each id)
  const kvc::paged::RequestKey a = t.key("a"), b = t.key("b"), c = t.key("c");
  const std::vector<kvc::paged::RequestKey> two = {a, b}, three = {a, b, c};
  REQUIRE(t.allocate_blocks(1, two) == 1);  // 1 full + 1 sliding each
  CHECK(t.get_num_free_blocks() == 1);
  CHECK(t.table(0, a) == ids{0});
  CHECK(t.table(1, b) == ids{3});
  CHECK(!t.allocate_blocks(1, three));  // c's 2 blocks do not fit beside a's and b's 2 each
  CHECK(t.get_num_free_blocks() == 1);
  CHECK(t.blocks_in_use(a) == 2);
  CHECK(!t.has_table(0, c));
  CHECK(t.names().name(c.index) == "c");
  CHECK(*t.find("b") == b);
  CHECK_THROWS_WITH_AS((void)t.table(2, a), "kvc::PagedCache: layer group 2 is out of range for 2 groups",
                       kvc::IndexError);
  const std::vector<std::string> odd = {"full_attention", "linear_attention"};
  CHECK_THROWS_WITH_AS(kvc::paged::BlockTables(odd, 5, 4, 6, true), "Invalid group type: linear_attention",
                       kvc::ValueError);

  // Page pools: scatter rows, gather them, copy blocks into another pool of the same geometry.
  const kvc::paged::PageGeometry geo{4, 2, 3};
  Pools pages(geo, 3, 1, true), other(geo, 2, 1, true);
  CHECK(pages.rows() == 12);
  CHECK(pages.bytes() == 3 * 2 * 4 * 6 * 4);
  const auto k = step_tensor({{7, 0}, {8, 1}}, 0, 2, 3, false), v = step_tensor({{7, 0}, {8, 1}}, 0, 2, 3, true);
  const ids rows = {9, 2};
  pages.scatter(0, view(k), view(v), rows);
  std::vector<float> out_k(12), out_v(12);
  pages.gather(0, rows, out_k.data(), out_v.data());
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t i = 0; i < 2; ++i)
      for (std::int64_t d = 0; d < 3; ++d) {
        CHECK(out_k[static_cast<std::size_t>((h * 2 + i) * 3 + d)] == value(7 + i, i, 0, h, d, false));
        CHECK(out_v[static_cast<std::size_t>((h * 2 + i) * 3 + d)] == value(7 + i, i, 0, h, d, true));
      }
  const ids from = {2, 0}, to = {0, 1};  // block 2 holds row 9, block 0 row 2
  Pools::copy_blocks(pages, from, other, to);
  const ids moved = {1, 6};  // row 9 is row 1 of block 2, now block 0; row 2 is now row 6
  std::vector<float> again_k(12), again_v(12);
  other.gather(0, moved, again_k.data(), again_v.data());
  CHECK(again_k == out_k);
  CHECK(again_v == out_v);

  // Swap pool: the smallest free blocks in order, given back ascending; a transaction undoes both.
  kvc::paged::SwapPool<kvc::HostStorage<float>> swap(geo, 1);
  swap.reserve(4);
  kvc::paged::UndoLog log;
  const kvc::paged::RequestKey x{0, 0}, y{1, 0}, z{2, 0}, w{3, 0};  // (the swap pool takes any key)
  CHECK(swap.take(log, x, {1, 1}).swap_ids == ids{0, 1});
  CHECK(swap.take(log, y, {2, 0}).swap_ids == ids{2, 3});
  swap.give_back(log, x);
  CHECK(swap.free_blocks() == 2);
  log.begin();
  swap.give_back(log, y);
  CHECK(swap.take(log, z, {3, 0}).swap_ids == ids{0, 1, 2});
  log.rollback();
  CHECK(swap.is_offloaded(y));
  CHECK(!swap.is_offloaded(z));
  CHECK(swap.find(y)->swap_ids == ids{2, 3});
  CHECK(swap.free_blocks() == 2);
  CHECK(swap.take(log, w, {2, 0}).swap_ids == ids{0, 1});
  CHECK_THROWS_WITH_AS(swap.reserve(2),
                       "kvc::PagedCache: the swap pool cannot be resized while 2 requests are offloaded to it",
                       kvc::ValueError);
}

TEST_CASE("PagedCache::update_rows and read_rows: update's rows, into the caller's buffers") {
  // The hybrid worked example's decode at past 9, once through update and once through the rows
  // form: the same pools and the same reads.
  const std::int64_t heads = 2, dim = 3;
  Cache a(model("fs", heads, dim, 6), cb(4, 8)), b = a;
  for (Cache* c : {&a, &b}) REQUIRE(c->allocate_blocks(3, "r", 0) == 3);
  std::vector<std::pair<std::int64_t, std::int64_t>> prompt;
  for (std::int64_t p = 0; p < 9; ++p) prompt.emplace_back(p + 1, p);
  for (Cache* c : {&a, &b}) {
    kvc::PagedIndices reads(2), writes(2);
    c->extend_read_and_write_indices("r", 0, 9, nullptr, writes);
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      const auto k = step_tensor(prompt, layer, heads, dim, false), v = step_tensor(prompt, layer, heads, dim, true);
      if (c == &a)
        (void)c->update(view(k), view(v), layer, reads, writes);
      else
        c->update_rows(view(k), view(v), layer, {}, writes[static_cast<std::size_t>(c->layer_group(layer).first)],
                       nullptr, nullptr);
    }
  }
  kvc::PagedIndices reads(2), writes(2);
  a.extend_read_and_write_indices("r", 9, 1, &reads, writes);
  for (std::int64_t layer = 0; layer < 2; ++layer) {
    const auto g = static_cast<std::size_t>(a.layer_group(layer).first);
    const auto k = step_tensor({{10, 9}}, layer, heads, dim, false),
               v = step_tensor({{10, 9}}, layer, heads, dim, true);
    const auto want = a.update(view(k), view(v), layer, reads, writes);
    std::vector<float> got_k(static_cast<std::size_t>(heads * dim) * reads[g].size()), got_v(got_k.size());
    b.update_rows(view(k), view(v), layer, reads[g], writes[g], got_k.data(), got_v.data());
    CHECK(std::equal(got_k.begin(), got_k.end(), want.keys.data()));
    CHECK(std::equal(got_v.begin(), got_v.end(), want.values.data()));
    // read_rows: a full group's rows hold what update read (no sentinels there).
    if (!a.is_sliding_group(static_cast<std::int64_t>(g))) {
      std::vector<float> held_k(got_k.size()), held_v(got_k.size());
      b.read_rows(layer, reads[g], held_k.data(), held_v.data());
      CHECK(held_k == got_k);
      CHECK(held_v == got_v);
    }
  }
  const std::int64_t n = (a.num_blocks() + 2) * a.block_size() * heads * dim;
  for (std::int64_t j = 0; j < a.group_size(); ++j) {
    CHECK(std::equal(a.key_pool(j), a.key_pool(j) + n, b.key_pool(j)));
    CHECK(std::equal(a.value_pool(j), a.value_pool(j) + n, b.value_pool(j)));
  }
  // Refused before anything is written.
  const ids far = {40};
  std::vector<float> buf(heads * dim);
  const auto k = step_tensor({{10, 9}}, 0, heads, dim, false);
  CHECK_THROWS_WITH_AS(b.update_rows(view(k), view(k), 0, {}, far, nullptr, nullptr),
                       "kvc::PagedCache::update: write row 40 is outside the cache's 40 rows", kvc::ValueError);
  CHECK_THROWS_WITH_AS(b.read_rows(0, far, buf.data(), buf.data()),
                       "kvc::PagedCache::update: read row 40 is outside the cache's 40 rows", kvc::ValueError);
  CHECK(std::equal(a.key_pool(0), a.key_pool(0) + n, b.key_pool(0)));
}

TEST_CASE("PagedCache: requests by id and by key") {
  Cache c(model("fs", 2, 3, 6), cb(4, 8));
  c.reserve_swap_space(4);
  using kvc::paged::RequestKey;
  // An id gets a key when it first gets blocks, and loses it once it holds nothing.
  CHECK(c.num_requests() == 0);
  REQUIRE(c.allocate_blocks(2, "a", 0));
  const RequestKey a = *c.find_request("a");
  CHECK(c.request_name(a) == "a");
  CHECK(c.num_requests() == 1);
  CHECK(c.block_table(0, a) == c.block_table(0, "a"));
  CHECK(c.blocks_in_use(a) == 4);
  CHECK(!c.allocate_blocks(9, "big", 0));  // refused: nothing is made for it
  CHECK(!c.find_request("big"));
  CHECK(c.search_prefix_match("miss", ids{1, 2, 3, 4}) == 0);  // no hit: no table, no key
  CHECK(!c.find_request("miss"));
  CHECK(c.num_requests() == 1);
  // Offloaded, it holds swap blocks: still known; released, forgotten, and its key refused.
  REQUIRE(c.offload_request("a"));
  CHECK(c.find_request("a") == a);
  c.release_request("a");
  CHECK(!c.find_request("a"));
  CHECK(c.num_requests() == 0);
  CHECK_THROWS_WITH_AS(c.blocks_in_use(a), "kvc::PagedCache: no request with key 0.0 (it was closed, or never opened)",
                       kvc::KeyError);
  CHECK(c.blocks_in_use("a") == 0);  // (by id: a request the cache does not know holds nothing)

  // An opened request keeps its key while it holds nothing, until it is closed.
  // [snippet:request_keys]
  const RequestKey k = c.open_request("k");  // "k" is known under k until close_request
  REQUIRE(c.allocate_blocks(1, k, 0));       // every call on a request takes its key or its id
  c.free_blocks(k);                          // k holds nothing now, and stays open
  REQUIRE(c.allocate_blocks(2, k, 0));
  const RequestKey z = c.open_request("z");
  const auto copies = c.fork_request(k, std::span(&z, 1));  // z: a copy of k
  // [/snippet]
  CHECK(k == RequestKey{0, 1});  // the index again, under the next generation
  CHECK(c.find_request("k") == k);
  CHECK_THROWS_WITH_AS(c.open_request("k"), "kvc::PagedCache::open_request: request k is already open",
                       kvc::ValueError);
  CHECK(copies.first.size() == 4);  // none complete: k's 2 full and 2 ring blocks
  CHECK(c.block_table(0, "z").size() == 2);
  CHECK_THROWS_WITH_AS(c.fork_request(k, std::span(&z, 1)), "Block table already exists for request z",
                       kvc::ValueError);
  c.close_request(k);
  CHECK(!c.find_request("k"));
  CHECK(c.blocks_in_use("z") == 4);
  CHECK_THROWS_WITH_AS(c.allocate_blocks(1, k, 0),
                       "kvc::PagedCache: no request with key 0.1 (it was closed, or never opened)", kvc::KeyError);
  // An id the cache holds blocks for can be opened: the key is the one it has.
  REQUIRE(c.allocate_blocks(1, "b", 0));
  const RequestKey b = *c.find_request("b");
  CHECK(c.open_request("b") == b);
  c.free_blocks("b");
  CHECK(c.find_request("b") == b);

  // A copy names its requests itself: its messages survive the original.
  auto copy = std::make_unique<Cache>(c);
  const Cache moved = [&] {
    Cache original = std::move(c);
    return Cache(original);
  }();
  CHECK_THROWS_WITH_AS(copy->block_table(0, "b"), "No block table found for request b", kvc::ValueError);
  CHECK_THROWS_WITH_AS(moved.block_table(0, b), "No block table found for request b", kvc::ValueError);
  CHECK(moved.request_name(z) == "z");
  CHECK(moved.num_requests() == 2);
}
