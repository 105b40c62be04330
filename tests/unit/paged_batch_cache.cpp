// kvc::PagedBatchCache (a paged cache behind a dynamic cache's method set) and the runtime path
// to it: make_cache("paged") and AnyCache. Its contract is the dynamic cache's: every read, length
// and mask size is compared with make_dynamic_cache's on the same inputs.

#include <map>
#include <random>

#include <kvc/attention.hpp>
#include <kvc/runtime.hpp>

#include "../support/kvc_test.hpp"
#include "../support/paged_snapshot.hpp"

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
using Conv = Eigen::Tensor<float, 3, Eigen::RowMajor>;
using Recurrent = Eigen::Tensor<float, 4, Eigen::RowMajor>;

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
  CHECK_THROWS_WITH_AS(pc.update_conv_state(Conv(2, 3, 4), 0),
                       "Cannot call `update_conv_state` on a non-LinearAttention layer!", kvc::ValueError);
  CHECK_THROWS_WITH_AS(pc.has_previous_state(),
                       "`has_previous_state` can only be called on LinearAttention layers, and the current Cache seem "
                       "to only contain Attention layers.",
                       kvc::ValueError);
  CHECK(pc.is_linear() == std::vector<bool>(3, false));
  CHECK_FALSE(pc.is_compileable());
}

TEST_CASE("PagedBatchCache::update given the views it returned reads them before writing the next result") {
  // A caller handing back what the last update returned (each step twice as long as the last, so
  // the output grows): the next result must be what a twin given copies returns.
  std::mt19937 rng(9);
  kvc::AnyCache a = kvc::make_cache(paged(), full_model(), {}, blocks(4, 100));
  kvc::AnyCache b = kvc::make_cache(paged(), full_model(), {}, blocks(4, 100));
  Paged& pa = *a.get<Paged>();
  Paged& pb = *b.get<Paged>();
  const auto k = kvc_test::random_tensor<float>(2, 1, 3, 4, rng), v = kvc_test::random_tensor<float>(2, 1, 3, 4, rng);
  auto ra = pa.update(kvc::input_view(k), kvc::input_view(v), 0);
  (void)pb.update(kvc::input_view(k), kvc::input_view(v), 0);
  for (int step = 0; step < 3; ++step) {
    CAPTURE(step);
    const kvc::HostTensor<float> ck = ra.keys.to_tensor(), cv = ra.values.to_tensor();
    ra = pa.update(ra.keys, ra.values, 0);  // keys and values: the views the last call returned
    const auto rb = pb.update(kvc::input_view(ck), kvc::input_view(cv), 0);
    CHECK(ra.keys.extents == rb.keys.extents);
    CHECK(kvc_test::flatten(ra.keys) == kvc_test::flatten(rb.keys));
    CHECK(kvc_test::flatten(ra.values) == kvc_test::flatten(rb.values));
  }
  // The same layer fed the other's views crosswise (values as keys): still read before written.
  const kvc::HostTensor<float> ck = ra.values.to_tensor(), cv = ra.keys.to_tensor();
  const auto crossed = pa.update(ra.values, ra.keys, 1);
  const auto twin = pb.update(kvc::input_view(ck), kvc::input_view(cv), 1);
  CHECK(kvc_test::flatten(crossed.keys) == kvc_test::flatten(twin.keys));
  CHECK(kvc_test::flatten(crossed.values) == kvc_test::flatten(twin.values));
}

TEST_CASE("PagedBatchCache::early_initialization fixes the batch before the first update") {
  kvc::AnyCache pc = kvc::make_cache(paged(), hybrid_model(5), {}, blocks(4, 40));
  CHECK_THROWS_WITH_AS(pc.early_initialization(2, 3, 8),
                       "kvc::PagedBatchCache::early_initialization: layer 0 has 2 heads of 8, got 3 of 8",
                       kvc::ValueError);
  CHECK_FALSE(pc.is_initialized());
  pc.early_initialization(2, 2, 8);
  CHECK(pc.batch_size() == 2);
  CHECK(held(pc).paged().get_num_free_blocks() == 40);         // blocks come with the first update
  CHECK(kvc_test::flatten(pc.stored<float>(1).keys).empty());  // the rows hold nothing yet
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

namespace {
// A hybrid model with linear-attention states: 0 linear_attention, 1 sliding_attention,
// 2 full_attention, 3 hybrid (full attention with states), 4 conv; two states per layer with states.
kvc::ModelConfig linear_model() {
  kvc::ModelConfig c = hybrid_model(5);
  c.num_hidden_layers = 5;
  c.layer_types = std::vector<std::string>{"linear_attention", "sliding_attention", "full_attention", "hybrid", "conv"};
  c.number_of_conv_states = 2;
  return c;
}
// A state view's elements (state views are contiguous).
std::vector<double> elements(const kvc::StateView<float>& v) {
  return std::vector<double>(v.data(), v.data() + (v.rank > 0 ? v.size() : 0));
}
bool has_states(std::int64_t layer) { return layer == 0 || layer == 3 || layer == 4; }
bool has_kv(std::int64_t layer) { return layer == 1 || layer == 2 || layer == 3; }

template <class X>
X random_state(X x, std::mt19937& rng) {
  for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(rng() % 2000) / 16.f - 60.f;
  return x;
}

// The recurrent states a caller gave each row last, per (layer, state): what the paged rows must hold.
using held_recurrent = std::map<std::pair<std::int64_t, std::int64_t>, std::vector<std::vector<float>>>;

// One step of q tokens through every layer of both caches (conv states of q columns and a
// recurrent state for each state of a layer with states, keys and values for a layer with them);
// every result must agree.
void hybrid_step(kvc::AnyCache& dynamic, kvc::AnyCache& paged_cache, std::int64_t batch, std::int64_t q,
                 std::mt19937& rng, held_recurrent& given, const std::string& where) {
  for (std::int64_t layer = 0; layer < dynamic.size(); ++layer) {
    INFO(where << " layer " << layer << " q " << q);
    if (has_states(layer))
      for (std::int64_t s = 0; s < 2; ++s) {
        const Conv x = random_state(Conv(batch, 5, q), rng);
        const auto dc = dynamic.update_conv_state(x, layer, s, 4);
        const auto shape = dc.extents;
        const std::vector<double> d = elements(dc);
        const auto p = paged_cache.update_conv_state(x, layer, s, 4);
        CHECK(p.extents == shape);
        CHECK(elements(p) == d);
        const Recurrent r = random_state(Recurrent(batch, 2, 3, 3), rng);
        const std::vector<double> dr = elements(dynamic.update_recurrent_state(r, layer, s));
        CHECK(elements(paged_cache.update_recurrent_state(r, layer, s)) == dr);
        auto& rows = given[{layer, s}];
        rows.assign(static_cast<std::size_t>(batch), {});
        for (std::int64_t b = 0; b < batch; ++b)
          rows[static_cast<std::size_t>(b)].assign(r.data() + b * 18, r.data() + (b + 1) * 18);
        CHECK(paged_cache.has_previous_state(layer, s) == dynamic.has_previous_state(layer, s));
      }
    if (has_kv(layer)) {
      CHECK(paged_cache.get_mask_sizes(q, layer) == dynamic.get_mask_sizes(q, layer));
      const auto k = kvc_test::random_tensor<float>(batch, 2, q, 8, rng);
      const auto v = kvc_test::random_tensor<float>(batch, 2, q, 8, rng);
      const auto rd = dynamic.update(k, v, layer);
      const std::vector<double> dk = kvc_test::flatten(rd.keys), dv = kvc_test::flatten(rd.values);
      const auto rp = paged_cache.update(k, v, layer);
      CHECK(kvc_test::flatten(rp.keys) == dk);
      CHECK(kvc_test::flatten(rp.values) == dv);
      CHECK(paged_cache.get_seq_length(layer) == dynamic.get_seq_length(layer));
    }
  }
  CHECK(paged_cache.get_seq_length(0) == dynamic.get_seq_length(0));
  CHECK(paged_cache.get_mask_sizes(2, 0) == dynamic.get_mask_sizes(2, 0));
  CHECK(paged_cache.has_previous_state() == dynamic.has_previous_state());
}

// Each row's recurrent states in the paged cache are the ones last given to that row.
void check_recurrent(const kvc::AnyCache& c, const held_recurrent& given) {
  const Paged& p = held(c);
  for (const auto& [at, rows] : given) {
    REQUIRE(static_cast<std::int64_t>(rows.size()) == p.batch_size());
    for (std::size_t b = 0; b < rows.size(); ++b) {
      const auto r = p.paged().recurrent_state(p.row_request(static_cast<std::int64_t>(b)), at.first, at.second);
      CHECK(std::vector<float>(r.data(), r.data() + r.size()) == rows[b]);
    }
  }
}

// The same row permutation applied to what the test gave each row.
void permute(held_recurrent& given, const std::vector<std::int64_t>& idx) {
  for (auto& [at, rows] : given) {
    std::vector<std::vector<float>> next;
    for (const std::int64_t i : idx) next.push_back(rows[static_cast<std::size_t>(i)]);
    rows = std::move(next);
  }
}
}  // namespace

TEST_CASE("make_cache('paged') serves a hybrid model's states as the dynamic cache does") {
  std::mt19937 rng(32);
  const kvc::ModelConfig m = linear_model();
  kvc::AnyCache dynamic = kvc::make_cache(kvc::GenerationConfig{}, m);
  kvc::AnyCache pc = kvc::make_cache(paged(), m, {}, blocks(4, 400));
  CHECK(pc.is_linear() == dynamic.is_linear());
  CHECK(pc.is_linear() == std::vector<bool>{true, false, false, false, true});
  CHECK(pc.is_sliding() == dynamic.is_sliding());
  CHECK(pc.get_max_length() == dynamic.get_max_length());
  CHECK(pc.get_max_length(0) == dynamic.get_max_length(0));
  CHECK_FALSE(pc.has_previous_state(0));
  CHECK_FALSE(pc.has_previous_state());
  CHECK(pc.get_seq_length(0) == 0);

  held_recurrent given;
  std::int64_t batch = 2;
  hybrid_step(dynamic, pc, batch, 6, rng, given, "prefill");
  CHECK(held(pc).paged().free_state_slots() == held(pc).paged().state_slots() - 2);
  std::uniform_int_distribution<int> op(0, 5);
  for (int round = 0; round < 40; ++round) {
    const int o = op(rng);
    const std::string where = "round " + std::to_string(round) + " op " + std::to_string(o);
    INFO(where);
    std::vector<std::int64_t> idx;
    std::uniform_int_distribution<std::int64_t> pick(0, batch - 1);
    if (o <= 1) {  // beam reorder, duplicates included
      idx.resize(static_cast<std::size_t>(batch));
      for (auto& i : idx) i = pick(rng);
      dynamic.reorder_cache(idx);
      pc.reorder_cache(idx);
    } else if (o == 2 && batch <= 3) {
      idx = kvc::detail::repeated_rows(batch, 2);
      dynamic.batch_repeat_interleave(2);
      pc.batch_repeat_interleave(2);
    } else if (o == 3 && batch > 1) {  // keep a random, possibly repeated, selection
      idx.resize(static_cast<std::size_t>(std::uniform_int_distribution<std::int64_t>(1, 4)(rng)));
      for (auto& i : idx) i = pick(rng);
      dynamic.batch_select_indices(idx);
      pc.batch_select_indices(idx);
    } else {
      hybrid_step(dynamic, pc, batch, o == 4 ? 3 : 1, rng, given, where);
    }
    if (!idx.empty()) {
      permute(given, idx);
      batch = static_cast<std::int64_t>(idx.size());
    }
    REQUIRE(pc.batch_size() == batch);
    check_recurrent(pc, given);
    // Every row holds one state slot: the rows' and the free ones add up.
    CHECK(held(pc).paged().free_state_slots() == held(pc).paged().state_slots() - batch);
  }
  hybrid_step(dynamic, pc, batch, 1, rng, given, "last");  // (the conv windows after the last operation)

  // reset gives the slots back; the next batch's states start unwritten.
  pc.reset();
  dynamic.reset();
  CHECK(held(pc).paged().free_state_slots() == held(pc).paged().state_slots());
  CHECK_FALSE(pc.has_previous_state(0));
  given.clear();
  hybrid_step(dynamic, pc, batch, 2, rng, given, "after reset");  // (the dynamic states keep their batch)

  // A batch whose first update is an attention layer's takes its slots there.
  kvc::AnyCache later = kvc::make_cache(paged(), m, {}, blocks(4, 40));
  const auto k = kvc_test::random_tensor<float>(2, 2, 3, 8, rng);
  (void)later.update(k, k, 2);
  CHECK(held(later).paged().free_state_slots() == held(later).paged().state_slots() - 2);
  CHECK_FALSE(later.has_previous_state(3, 1));
}

TEST_CASE("PagedBatchCache on a hybrid model: what it refuses, before anything changes") {
  std::mt19937 rng(33);
  const kvc::ModelConfig m = linear_model();
  auto cb = blocks(4, 40);
  cb.max_state_slots = 2;
  kvc::AnyCache pc = kvc::make_cache(paged(), m, {}, cb);
  const Conv three = random_state(Conv(3, 5, 2), rng);
  const auto k3 = kvc_test::random_tensor<float>(3, 2, 2, 8, rng);
  // Three rows, two state slots: refused by the state update and by the attention update.
  const char* const slots =
      "kvc::PagedBatchCache: the batch needs 3 state slots, 2 are free (ContinuousBatchingConfig::max_state_slots)";
  CHECK_THROWS_WITH_AS(pc.update_conv_state(three, 0, 0, 4), slots, kvc::MemoryError);
  CHECK_THROWS_WITH_AS(pc.update(k3, k3, 1), slots, kvc::MemoryError);
  CHECK_FALSE(pc.is_initialized());
  CHECK(held(pc).paged().get_num_free_blocks() == 40);
  CHECK(held(pc).paged().free_state_slots() == 2);

  // Too few blocks for the rows' first ones (3 groups: a block in each per row).
  kvc::AnyCache tight = kvc::make_cache(paged(), m, {}, blocks(4, 5));
  const Conv two = random_state(Conv(2, 5, 2), rng);
  CHECK_THROWS_WITH_AS(tight.update_conv_state(two, 0, 0, 4),
                       "kvc::PagedBatchCache: the step needs 6 more blocks for 2 rows, 5 are free "
                       "(ContinuousBatchingConfig::num_blocks)",
                       kvc::MemoryError);
  CHECK_FALSE(tight.is_initialized());

  // A first state update that fails its checks takes no blocks and names no rows.
  CHECK_THROWS_WITH_AS(pc.update_conv_state(Conv(2, 5, 0), 0),
                       "update_conv_state: conv states must have shape [batch, channels, time] with positive sizes, "
                       "got [2, 5, 0]",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(pc.update_conv_state(two, 0, 2),
                       "update_conv_state: state_idx 2 is out of range for a layer with 2 states", kvc::KeyError);
  CHECK_THROWS_WITH_AS(pc.update_recurrent_state(two, 1),
                       "Cannot call `update_recurrent_state` on a non-LinearAttention layer!", kvc::ValueError);
  CHECK_THROWS_WITH_AS(pc.update_conv_state(two, 5),
                       "update_conv_state: layer_idx 5 is out of range for a Cache with 5 layers", kvc::IndexError);
  CHECK_THROWS_WITH_AS(pc.update_conv_state(two, 0, 0, -1),
                       "update_conv_state: conv_kernel_size must be positive, got -1", kvc::ValueError);
  CHECK_FALSE(pc.is_initialized());
  CHECK(held(pc).paged().get_num_free_blocks() == 40);
  CHECK(held(pc).paged().free_state_slots() == 2);

  // The batch is fixed by the first call; a later one of another batch or shape is refused.
  const auto first = pc.update_conv_state(two, 0, 0, 4);
  CHECK(first.extent(2) == 4);  // two columns left-padded to the kernel
  const auto before = elements(held(pc).paged().conv_state(held(pc).row_request(1), 0, 0));
  CHECK_THROWS_WITH_AS(pc.update_conv_state(three, 0),
                       "kvc::PagedBatchCache::update_conv_state: the cache holds a batch of 2 rows, got 3",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(pc.update_recurrent_state(Recurrent(3, 2, 3, 3), 0),
                       "kvc::PagedBatchCache::update_recurrent_state: the cache holds a batch of 2 rows, got 3",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(pc.update_conv_state(Conv(2, 6, 1), 0),
                       "update_conv_state: conv states of shape [2, 6, 1] do not match state 0, which holds 5 channels",
                       kvc::ValueError);
  (void)pc.update_recurrent_state(random_state(Recurrent(2, 2, 3, 3), rng), 0);
  CHECK_THROWS_WITH_AS(pc.update_recurrent_state(Recurrent(2, 2, 3, 4), 0),
                       "update_recurrent_state: recurrent states of shape [2, 2, 3, 4] do not match state 0, which "
                       "holds [2, 2, 3, 3]",
                       kvc::ValueError);
  CHECK(elements(held(pc).paged().conv_state(held(pc).row_request(1), 0, 0)) == before);
  CHECK(pc.has_previous_state(0, 0));
  CHECK_FALSE(pc.has_previous_state(0));  // state 1 not yet
  CHECK_THROWS_WITH_AS(pc.has_previous_state(0, 2),
                       "has_previous_state: state_idx 2 is out of range for a layer with 2 states", kvc::KeyError);

  CHECK_THROWS_WITH_AS(pc.has_previous_state(0, -1), "has_previous_state: state_idx -1 is negative", kvc::KeyError);

  // A view a call returned, handed back as the next call's input: read before its buffer goes.
  const auto v = pc.update_conv_state(two, 0, 1, 4);  // state 1's first call: [2, 5, 4], left-padded
  const std::vector<double> held_v = elements(v);
  const auto w = pc.update_conv_state(v, 0, 1, 4);  // [2, 5, 8]: the 4 columns kept, then v's
  REQUIRE(w.extents == std::array<std::int64_t, 4>{2, 5, 8, 0});
  for (std::int64_t row = 0; row < 2 * 5; ++row)
    for (std::int64_t col = 0; col < 4; ++col) {
      CHECK(static_cast<double>(w.data()[row * 8 + col]) == held_v[static_cast<std::size_t>(row * 4 + col)]);
      CHECK(static_cast<double>(w.data()[row * 8 + 4 + col]) == held_v[static_cast<std::size_t>(row * 4 + col)]);
    }
  const Recurrent given = random_state(Recurrent(2, 2, 3, 3), rng);
  const auto r = pc.update_recurrent_state(given, 3, 1);
  const auto r2 = pc.update_recurrent_state(r, 3, 1);
  CHECK(elements(r2) == std::vector<double>(given.data(), given.data() + given.size()));

  // Rows copied by a fork need state slots: none free (the two rows hold both), nothing changes.
  const auto slots_before = kvc_test::take_paged_snapshot(held(pc).paged(), {"0", "1"});
  CHECK_THROWS_WITH_AS(pc.batch_repeat_interleave(2),
                       "kvc::PagedBatchCache::batch_repeat_interleave: copying rows needs 2 free state slots, 0 are "
                       "free",
                       kvc::MemoryError);
  CHECK(pc.batch_size() == 2);
  CHECK(kvc_test::take_paged_snapshot(held(pc).paged(), {"0", "1"}) == slots_before);
  pc.reorder_cache({1, 1});  // row 1 twice: the copy takes row 0's blocks and slot
  CHECK(pc.batch_size() == 2);

  // The key/value methods on a linear-attention layer, as the dynamic cache's LinearAttentionLayer.
  const auto k2 = kvc_test::random_tensor<float>(2, 2, 1, 8, rng);
  CHECK_THROWS_WITH_AS(pc.update(k2, k2, 4), "'LinearAttentionLayer' object has no attribute 'update'",
                       kvc::AttributeError);
  CHECK_THROWS_WITH_AS(pc.stored<float>(0), "'LinearAttentionLayer' object has no attribute 'keys'",
                       kvc::AttributeError);
  CHECK_THROWS_WITH_AS(pc.get_seq_length(4),
                       "You called `get_seq_length` on layer index 4, but this layer is a LinearAttention layer, "
                       "which does not track sequence length.",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(pc.has_previous_state(2),
                       "You called `has_previous_state` on layer index 2, but this layer is an Attention layer, which "
                       "does not support calling it.",
                       kvc::ValueError);
  CHECK_FALSE(pc.is_sliding(0));
  CHECK(pc.get_max_length(4) == -1);
}
