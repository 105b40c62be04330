// kvc::PagedBatchCache (a paged cache behind a dynamic cache's method set) and the runtime path
// to it: make_cache("paged") and AnyCache. Its contract is the dynamic cache's: every read, length
// and mask size is compared with make_dynamic_cache's on the same inputs.

#include <random>

#include <kvc/attention.hpp>
#include <kvc/runtime.hpp>

#include "../support/kvc_test.hpp"

namespace {
kvc::ModelConfig hybrid_model(std::int64_t window) {
  kvc::ModelConfig c;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.sliding_window = window;
  c.layer_types = std::vector<std::string>{"sliding_attention", "full_attention", "sliding_attention"};
  return c;
}
kvc::ModelConfig full_model() {
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 4;
  return c;
}
kvc::GenerationConfig paged() {
  kvc::GenerationConfig g;
  g.cache_implementation = "paged";
  return g;
}
kvc::ContinuousBatchingConfig blocks(std::int64_t block_size, std::optional<std::int64_t> num_blocks) {
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = block_size;
  cb.num_blocks = num_blocks;
  return cb;
}
using Paged = kvc::PagedBatchCache<kvc::HostStorage<float>>;

const Paged& held(const kvc::AnyCache& c) { return *c.get<Paged>(); }

// Blocks the rows hold plus free blocks: the pool, always (rows never share blocks here).
std::int64_t accounted(const Paged& p) {
  std::int64_t n = p.paged().get_num_free_blocks();
  for (std::int64_t b = 0; b < p.batch_size(); ++b) n += p.paged().blocks_in_use(p.row_request(b));
  return n;
}

// What a caller can observe of every layer, and the free blocks.
struct observed {
  std::vector<std::vector<double>> keys, values;
  std::vector<std::int64_t> lengths, mask;
  std::int64_t free_blocks = -1;
  friend bool operator==(const observed&, const observed&) = default;
};
observed observe(const kvc::AnyCache& c) {
  observed o;
  for (std::int64_t i = 0; i < c.size(); ++i) {
    const auto kv = c.stored<float>(i);
    o.keys.push_back(kvc_test::flatten(kv.keys));
    o.values.push_back(kvc_test::flatten(kv.values));
    o.lengths.push_back(c.get_seq_length(i));
    const auto [kl, ko] = c.get_mask_sizes(3, i);
    o.mask.push_back(kl);
    o.mask.push_back(ko);
  }
  if (const Paged* p = c.get<Paged>()) o.free_blocks = p->paged().get_num_free_blocks();
  return o;
}

// One step of q tokens through every layer of both caches; every read must agree.
void step_both(kvc::AnyCache& dynamic, kvc::AnyCache& paged_cache, std::int64_t batch, std::int64_t q,
               std::mt19937& rng, const std::string& where) {
  for (std::int64_t layer = 0; layer < dynamic.size(); ++layer) {
    INFO(where << " layer " << layer << " q " << q);
    const auto mask_d = dynamic.get_mask_sizes(q, layer);
    const auto mask_p = paged_cache.get_mask_sizes(q, layer);
    CHECK(mask_d == mask_p);
    const auto k = kvc_test::random_tensor<float>(batch, 2, q, 8, rng);
    const auto v = kvc_test::random_tensor<float>(batch, 2, q, 8, rng);
    const auto rd = dynamic.update(k, v, layer);
    const std::vector<double> dk = kvc_test::flatten(rd.keys), dv = kvc_test::flatten(rd.values);
    const auto rp = paged_cache.update(k, v, layer);
    CHECK(rp.keys.extents == rd.keys.extents);
    CHECK(kvc_test::flatten(rp.keys) == dk);
    CHECK(kvc_test::flatten(rp.values) == dv);
    CHECK(paged_cache.get_seq_length(layer) == dynamic.get_seq_length(layer));
  }
}
}  // namespace

TEST_CASE("make_cache('paged') builds a PagedBatchCache sized for the request") {
  auto g = paged();
  g.max_length = 30;
  g.num_beams = 2;
  const kvc::AnyCache c = kvc::make_cache(g, hybrid_model(5), {3, -1}, blocks(4, std::nullopt));
  REQUIRE(c.get<Paged>() != nullptr);
  const Paged& p = held(c);
  // 6 rows (3 × 2 beams) of 30 tokens: 8 blocks in the full group, the ring's 2 in each of the two
  // sliding groups (the gcd rule puts each sliding layer in a group of its own).
  CHECK(p.paged().num_groups() == 3);
  CHECK(p.paged().num_blocks() == 6 * (8 + 2 + 2));
  CHECK(p.paged().block_size() == 4);
  CHECK(c.size() == 3);
  CHECK(c.is_sliding() == std::vector<bool>{true, false, true});
  CHECK(c.get_max_length(0) == 5);
  CHECK(c.get_max_length(1) == -1);
  CHECK(c.get_max_length() == -1);
  CHECK(c.layer_name(1) == "PagedAttentionCache");
  CHECK(c.repr() == "PagedAttentionCache(num_blocks=72, block_size=4)");
  CHECK_FALSE(c.is_dynamic_cache());
  CHECK_FALSE(c.is_initialized());
  CHECK(c.bytes() == p.paged().bytes());

  // A num_blocks the caller sets is kept; the three-argument make_cache takes the default config
  // (block_size 256: one block per row and group for max_length 20).
  CHECK(held(kvc::make_cache(paged(), hybrid_model(5), {}, blocks(16, 7))).paged().num_blocks() == 7);
  const kvc::AnyCache d = kvc::make_cache(paged(), full_model(), {2, -1});
  CHECK(held(d).paged().block_size() == 256);
  CHECK(held(d).paged().num_blocks() == 2);
  CHECK(kvc::make_cache<double>(paged(), full_model()).element_type_name() == "double");

  // transformers' message for a block size below 4 comes through make_cache unchanged.
  CHECK_THROWS_AS(kvc::make_cache(paged(), full_model(), {}, blocks(2, std::nullopt)), kvc::ValueError);
  kvc::ModelConfig t5 = full_model();
  t5.is_encoder_decoder = true;
  CHECK_THROWS_WITH_AS(kvc::make_cache(paged(), t5),
                       "make_cache: cache_implementation 'paged' (continuous batching) is for decoder-only models; an "
                       "encoder-decoder model needs another cache_implementation",
                       kvc::ValueError);
  auto huge = paged();
  huge.num_beams = kvc::max_batch;
  huge.max_length = 300;  // 2 blocks of 256 per row
  CHECK_THROWS_WITH_AS(kvc::make_cache(huge, full_model(), {kvc::max_batch, -1}),
                       "make_cache: a paged cache for 1099511627776 rows of 300 tokens needs more than "
                       "1099511627776 blocks",
                       kvc::ValueError);
}

TEST_CASE("a paged batch reads exactly what a dynamic cache reads") {
  // Windows that are and are not a multiple of the block size; chunked prefills longer than the window.
  for (const std::int64_t window : {4, 5, 11}) {
    std::mt19937 rng(static_cast<unsigned>(window));
    const kvc::ModelConfig m = hybrid_model(window);
    kvc::AnyCache dynamic = kvc::make_cache(kvc::GenerationConfig{}, m);
    kvc::AnyCache pc = kvc::make_cache(paged(), m, {}, blocks(4, 200));
    const std::int64_t batch = 3;
    std::int64_t total = 0;
    for (const std::int64_t q : {7, 1, 1, 12, 1, 3, 1, 1, 1, 1, 1, 9, 1}) {
      step_both(dynamic, pc, batch, q, rng, "window " + std::to_string(window));
      total += q;
      CHECK(observe(pc).keys == observe(dynamic).keys);
      CHECK(observe(pc).lengths == observe(dynamic).lengths);
      CHECK(observe(pc).mask == observe(dynamic).mask);
    }
    CHECK(pc.batch_size() == 3);
    CHECK(pc.is_initialized());
    const Paged& p = held(pc);
    // Each row: ceil(total / 4) blocks in the full group, the ring's ceil(window / 4) in each sliding one.
    CHECK(p.paged().num_blocks() - p.paged().get_num_free_blocks() ==
          batch * ((total + 3) / 4 + 2 * ((window + 3) / 4)));
    CHECK(accounted(p) == 200);
  }
}

TEST_CASE("batch operations move block tables and read as a dynamic cache does") {
  std::mt19937 rng(7);
  const kvc::ModelConfig m = hybrid_model(5);
  kvc::AnyCache dynamic = kvc::make_cache(kvc::GenerationConfig{}, m);
  kvc::AnyCache pc = kvc::make_cache(paged(), m, {}, blocks(4, 400));
  std::int64_t batch = 2;
  step_both(dynamic, pc, batch, 6, rng, "prefill");
  std::uniform_int_distribution<int> op(0, 5);
  for (int round = 0; round < 60; ++round) {
    const int o = op(rng);
    const std::string where = "round " + std::to_string(round) + " op " + std::to_string(o);
    INFO(where);
    if (o <= 1) {  // beam reorder, duplicates included
      std::vector<std::int64_t> idx(static_cast<std::size_t>(batch));
      std::uniform_int_distribution<std::int64_t> pick(0, batch - 1);
      for (auto& i : idx) i = pick(rng);
      dynamic.reorder_cache(idx);
      pc.reorder_cache(idx);
    } else if (o == 2 && batch <= 3) {
      dynamic.batch_repeat_interleave(2);
      pc.batch_repeat_interleave(2);
      batch *= 2;
    } else if (o == 3 && batch > 1) {  // keep a random, possibly repeated, selection
      std::uniform_int_distribution<std::int64_t> pick(0, batch - 1);
      std::vector<std::int64_t> idx(static_cast<std::size_t>(std::uniform_int_distribution<std::int64_t>(1, 4)(rng)));
      for (auto& i : idx) i = pick(rng);
      dynamic.batch_select_indices(idx);
      pc.batch_select_indices(idx);
      batch = static_cast<std::int64_t>(idx.size());
    } else {
      step_both(dynamic, pc, batch, o == 4 ? 3 : 1, rng, where);
    }
    REQUIRE(pc.batch_size() == batch);
    CHECK(observe(pc).keys == observe(dynamic).keys);
    CHECK(observe(pc).values == observe(dynamic).values);
    CHECK(accounted(held(pc)) == 400);
  }
  // reset frees every block; the next update starts a new batch of any size.
  pc.reset();
  CHECK(held(pc).paged().get_num_free_blocks() == 400);
  CHECK_FALSE(pc.is_initialized());
  CHECK(pc.get_seq_length(1) == 0);
  dynamic.reset();
  step_both(dynamic, pc, 5, 2, rng, "after reset");
}

TEST_CASE("PagedBatchCache: a call that fails changes nothing, and says why") {
  std::mt19937 rng(3);
  const kvc::ModelConfig m = hybrid_model(5);
  kvc::AnyCache pc = kvc::make_cache(paged(), m, {}, blocks(4, 12));
  pc.update(kvc_test::random_tensor<float>(2, 2, 4, 8, rng), kvc_test::random_tensor<float>(2, 2, 4, 8, rng), 0);
  // Per row: 1 full block and 1 block in each of the 2 sliding groups: 6 taken, 6 free.
  const observed before = observe(pc);
  CHECK(before.free_blocks == 6);

  // 9 more tokens for layer 0: each row needs 3 more full blocks and 1 more ring block per sliding group.
  const auto big = kvc_test::random_tensor<float>(2, 2, 9, 8, rng);
  CHECK_THROWS_WITH_AS(pc.update(big, big, 0),
                       "kvc::PagedBatchCache: the step needs 10 more blocks for 2 rows, 6 are free "
                       "(ContinuousBatchingConfig::num_blocks)",
                       kvc::MemoryError);
  CHECK(observe(pc) == before);

  const auto three_rows = kvc_test::random_tensor<float>(3, 2, 1, 8, rng);
  CHECK_THROWS_WITH_AS(pc.update(three_rows, three_rows, 1),
                       "kvc::PagedBatchCache::update: the cache holds a batch of 2 rows, got 3", kvc::ValueError);
  const auto heads = kvc_test::random_tensor<float>(2, 3, 1, 8, rng);
  CHECK_THROWS_WITH_AS(pc.update(heads, heads, 1),
                       "kvc::PagedBatchCache::update: keys and values must be [batch, 2, tokens, 8], got [2, 3, 1, 8]",
                       kvc::ValueError);
  const auto one = kvc_test::random_tensor<float>(2, 2, 1, 8, rng);
  const auto two = kvc_test::random_tensor<float>(2, 2, 2, 8, rng);
  CHECK_THROWS_WITH_AS(pc.update(one, two, 1),
                       "kvc::PagedBatchCache::update: keys [2, 2, 1, 8] and values [2, 2, 2, 8] differ in shape",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(pc.update(one, one, 3), "kvc::PagedCache: layer 3 is out of range for 3 layers",
                       kvc::IndexError);
  const auto none = kvc_test::random_tensor<float>(2, 2, 0, 8, rng);
  CHECK_THROWS_WITH_AS(pc.update(none, none, 1),
                       "kvc::PagedBatchCache::update: tokens must be a positive integer, got 0", kvc::ValueError);
  CHECK(observe(pc) == before);

  // Batch operations: bad indices, and a fork with no free blocks.
  CHECK_THROWS_WITH_AS(pc.reorder_cache({0, 2}), "reorder_cache: index 2 is out of bounds for dimension 0 with size 2",
                       kvc::IndexError);
  CHECK_THROWS_WITH_AS(pc.batch_select_indices(std::span<const std::int64_t>{}),
                       "batch_select_indices: the batch cannot become empty", kvc::ValueError);
  CHECK_THROWS_AS(pc.batch_repeat_interleave(0), kvc::ValueError);
  pc.batch_repeat_interleave(2);  // 2 more rows of 3 blocks each: none left
  CHECK(held(pc).paged().get_num_free_blocks() == 0);
  const observed four = observe(pc);
  CHECK_THROWS_WITH_AS(pc.batch_select_indices({0, 0, 1, 1, 2}),
                       "kvc::PagedBatchCache::batch_select_indices: copying rows needs 3 free blocks, 0 are free",
                       kvc::MemoryError);
  CHECK(observe(pc) == four);
  // Reusing the blocks of rows that are dropped needs no free block.
  pc.reorder_cache({3, 3, 3, 0});
  CHECK(held(pc).paged().get_num_free_blocks() == 0);
  CHECK(accounted(held(pc)) == 12);

  // What a paged cache does not have.
  CHECK_THROWS_WITH_AS(pc.crop(-1), "'PagedAttentionCache' object has no attribute 'crop'", kvc::AttributeError);
  CHECK_THROWS_WITH_AS(pc.set_write_position(0), "'PagedAttentionCache' object has no attribute 'set_write_position'",
                       kvc::AttributeError);
  CHECK_THROWS_WITH_AS(pc.update_conv_state(kvc::HostTensor<float>(1, 2, 3, 4), 0),
                       "'PagedAttentionCache' object has no attribute 'update_conv_state'", kvc::AttributeError);
  CHECK_THROWS_WITH_AS(pc.has_previous_state(),
                       "`has_previous_state` can only be called on LinearAttention layers, and the current Cache seem "
                       "to only contain Attention layers.",
                       kvc::ValueError);
  CHECK(pc.is_linear() == std::vector<bool>(3, false));
  CHECK_FALSE(pc.is_compileable());
}

TEST_CASE("PagedBatchCache::early_initialization fixes the batch before the first update") {
  kvc::AnyCache pc = kvc::make_cache(paged(), hybrid_model(5), {}, blocks(4, 40));
  CHECK_THROWS_WITH_AS(pc.early_initialization(2, 3, 8),
                       "kvc::PagedBatchCache::early_initialization: layer 0 has 2 heads of 8, got 3 of 8",
                       kvc::ValueError);
  CHECK_FALSE(pc.is_initialized());
  pc.early_initialization(2, 2, 8);
  CHECK(pc.batch_size() == 2);
  CHECK(held(pc).paged().get_num_free_blocks() == 40);  // blocks come with the first update
  pc.batch_repeat_interleave(3);
  CHECK(pc.batch_size() == 6);
  CHECK_THROWS_WITH_AS(pc.early_initialization(4, 2, 8),
                       "kvc::PagedBatchCache::early_initialization: the cache already holds a batch of 6",
                       kvc::ValueError);
  std::mt19937 rng(1);
  const auto k = kvc_test::random_tensor<float>(6, 2, 3, 8, rng);
  CHECK(pc.update(k, k, 1).keys.extents == std::array<std::int64_t, 4>{6, 2, 3, 8});
}

TEST_CASE("attend over make_cache('paged') gives what it gives over the dynamic cache") {
  std::mt19937 rng(21);
  const kvc::ModelConfig m = hybrid_model(5);
  kvc::AnyCache dynamic = kvc::make_cache(kvc::GenerationConfig{}, m);
  kvc::AnyCache pc = kvc::make_cache(paged(), m, {}, blocks(4, 100));
  for (const std::int64_t q : {6, 1, 1, 4, 1}) {
    for (std::int64_t layer = 0; layer < 3; ++layer) {
      CAPTURE(layer);
      const auto queries = kvc_test::random_tensor<float>(2, 4, q, 8, rng);
      const auto k = kvc_test::random_tensor<float>(2, 2, q, 8, rng),
                 v = kvc_test::random_tensor<float>(2, 2, q, 8, rng);
      const auto a = kvc::attend(dynamic, layer, queries, k, v);
      const auto b = kvc::attend(pc, layer, queries, k, v);
      const std::vector<double> fa = kvc_test::flatten(kvc::HostStorage<float>::input_view(a));
      CHECK(kvc_test::flatten(kvc::HostStorage<float>::input_view(b)) == fa);
    }
  }
}
