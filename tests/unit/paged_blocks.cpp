// The block bookkeeping of the paged cache (<kvc/paged/...>): the block hash, layer grouping,
// kvc::paged::BlockManager and the full and sliding allocators, against the worked examples and
// test vectors of transformers' generation/continuous_batching (cache.py, cache_manager.py at
// a597f974; docs/paged.md), the fixed sliding ring, and random request streams checked against a
// model that keeps each request's tokens.

#include "../support/kvc_test.hpp"

#include <kvc/paged/allocators.hpp>
#include <kvc/paged/block_hash.hpp>
#include <kvc/paged/block_manager.hpp>
#include <kvc/paged/layer_groups.hpp>

#include <cstddef>
#include <cstdint>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

using kvc::paged::BlockManager;
using ids = std::vector<std::int64_t>;

namespace {

ids iota(std::int64_t from, std::int64_t to) {  // [from, to)
  ids out(static_cast<std::size_t>(to - from));
  std::iota(out.begin(), out.end(), from);
  return out;
}
ids concat(std::initializer_list<ids> parts) {
  ids out;
  for (const ids& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}
ids reads(const auto& alloc, const std::string& r, std::int64_t past, std::int64_t q) {
  ids out;
  alloc.get_read_indices(r, past, q, out);
  return out;
}
ids writes(const auto& alloc, const std::string& r, std::int64_t past, std::int64_t q) {
  ids out;
  alloc.get_write_indices(r, past, q, out);
  return out;
}
// An allocator called by request id, as transformers' tests call theirs: each id gets a key from
// the adapter's own RequestNames (the ids are what the allocator's messages name).
template <class A>
class by_id : public A {
 public:
  template <class... Args>
  explicit by_id(Args... args) : A(args...) {
    A::set_names(&names_);
  }
  by_id(const by_id&) = delete;
  by_id& operator=(const by_id&) = delete;

  kvc::paged::RequestKey key(const std::string& id) const { return names_.add(log_, id); }
  std::optional<std::int64_t> allocate_blocks(std::int64_t n, const std::string& id, BlockManager& bm) {
    return A::allocate_blocks(n, key(id), bm);
  }
  const ids& table(const std::string& id) const { return A::table(key(id)); }
  ids& mutable_table(const std::string& id) { return A::mutable_table(key(id)); }
  bool has_request(const std::string& id) const { return A::has_request(key(id)); }
  void set_table(const std::string& id, ids blocks) { A::set_table(key(id), std::move(blocks)); }
  void free_blocks(const std::string& id, BlockManager& bm) { A::free_blocks(key(id), bm); }
  std::vector<std::string> requests() const {
    std::vector<std::string> out;
    for (const kvc::paged::RequestKey k : A::requests()) out.push_back(names_.name(k.index));
    std::sort(out.begin(), out.end());
    return out;
  }
  std::int64_t search_prefix_match(const std::string& id, std::span<const std::int64_t> prompt, BlockManager& bm) {
    return A::search_prefix_match(key(id), prompt, bm);
  }
  std::pair<ids, ids> fork_blocks(const std::string& parent, std::span<const std::string> children, BlockManager& bm) {
    std::vector<kvc::paged::RequestKey> keys;
    for (const std::string& c : children) keys.push_back(key(c));
    return A::fork_blocks(key(parent), keys, bm);
  }
  void get_read_indices(const std::string& id, std::int64_t past, std::int64_t q, ids& out) const {
    A::get_read_indices(key(id), past, q, out);
  }
  void get_write_indices(const std::string& id, std::int64_t past, std::int64_t q, ids& out) const {
    A::get_write_indices(key(id), past, q, out);
  }
  void fill_block_table(const std::string& id, std::int64_t past, std::int64_t q, std::span<std::int64_t> out) const {
    A::fill_block_table(key(id), past, q, out);
  }

 private:
  mutable kvc::paged::RequestNames names_;
  mutable kvc::paged::UndoLog log_;
};
using FullAttentionCacheAllocator = by_id<kvc::paged::FullAttentionCacheAllocator>;
using SlidingAttentionCacheAllocator = by_id<kvc::paged::SlidingAttentionCacheAllocator>;

std::vector<std::string> types(std::string_view letters) {
  std::vector<std::string> out;
  for (const char c : letters) out.push_back(c == 's' ? "sliding_attention" : "full_attention");
  return out;
}

}  // namespace

TEST_CASE("block hash: BLAKE2b-64 as Python's hashlib.blake2b(digest_size=8), read little-endian") {
  // Expected values: int.from_bytes(hashlib.blake2b(bytes((i * 7 + 1) & 255 for i in range(n)),
  // digest_size=8).digest(), "little") in Python.
  const std::vector<std::pair<int, std::uint64_t>> vectors = {
      {0, 0xb4b2797457a0a6e4ULL},   {3, 0x64079230b1345c41ULL},   {127, 0xfd7b589b9e251a60ULL},
      {128, 0xa4af7add24814b8aULL}, {129, 0xc7d8b9ce0be104c2ULL}, {256, 0xd8d58fc62a924506ULL},
      {300, 0x84c4874066e9d1caULL}};
  for (const auto& vector : vectors) {
    const int n = vector.first;  // not a structured binding: clang 14 cannot capture one
    const std::uint64_t expected = vector.second;
    std::vector<std::byte> bytes;
    for (int i = 0; i < n; ++i) bytes.push_back(static_cast<std::byte>((i * 7 + 1) & 255));
    CHECK_MESSAGE(kvc::paged::blake2b_64(bytes) == expected, "n = " << n);
  }
  // compute_block_hash = blake2b(<Q parent> + array('i', tokens) + <i group>), as transformers with TP.
  const ids first = {1, 2, 3, 4}, second = {5, 6, 7, 8};
  const std::uint64_t h1 = kvc::paged::compute_block_hash(std::nullopt, first, 0);
  CHECK(h1 == 1108391642455358300ULL);
  CHECK(kvc::paged::compute_block_hash(h1, second, 1) == 3193542449242264775ULL);
  // Every input matters: the parent, each token, the group.
  CHECK(kvc::paged::compute_block_hash(h1 + 1, second, 1) != 3193542449242264775ULL);
  CHECK(kvc::paged::compute_block_hash(h1, ids{5, 6, 7, 9}, 1) != 3193542449242264775ULL);
  CHECK(kvc::paged::compute_block_hash(h1, second, 0) != 3193542449242264775ULL);
  CHECK_THROWS_AS(kvc::paged::compute_block_hash(std::nullopt, first, std::int64_t{1} << 32), kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::paged::compute_block_hash(std::nullopt, ids{1LL << 40}, 0),
                       "kvc::paged::compute_block_hash: token id 1099511627776 does not fit a 32-bit int (block "
                       "hashes pack token ids as C ints)",
                       kvc::ValueError);
}

TEST_CASE("layer groups: first-appearance order of the types, groups of gcd(bucket sizes) layers") {
  using G = std::vector<ids>;
  {
    const auto g = kvc::paged::group_layers_by_attn_type(types("sffsffff"));
    CHECK(g.group_size == 2);
    CHECK(g.groups == G{{0, 3}, {1, 2}, {4, 5}, {6, 7}});
    CHECK(g.types ==
          std::vector<std::string>{"sliding_attention", "full_attention", "full_attention", "full_attention"});
  }
  {
    const auto g = kvc::paged::group_layers_by_attn_type(types("ssfssf"));
    CHECK(g.groups == G{{0, 1}, {3, 4}, {2, 5}});
    CHECK(g.types == types("ssf"));
  }
  CHECK(kvc::paged::group_layers_by_attn_type(types("fffsffs")).groups.size() == 7);
  CHECK(kvc::paged::group_layers_by_attn_type(types("ssssf")).groups.size() == 5);
  {
    // Gemma-3-1B: 26 layers, every sixth full: 22 sliding, 4 full -> 11 sliding groups, then 2 full.
    std::string gemma;
    for (int i = 0; i < 26; ++i) gemma += (i % 6 == 5) ? 'f' : 's';
    const auto g = kvc::paged::group_layers_by_attn_type(types(gemma));
    CHECK(g.group_size == 2);
    REQUIRE(g.groups.size() == 13);
    CHECK(g.types.front() == "sliding_attention");
    CHECK(g.types[11] == "full_attention");
    CHECK(g.groups[11] == ids{5, 11});
    CHECK(g.groups[12] == ids{17, 23});
  }
  // From a ModelConfig: layer_types, else all sliding with a window, else all full.
  kvc::ModelConfig cfg;
  cfg.num_hidden_layers = 3;
  CHECK(kvc::paged::paged_layer_types(cfg) == types("fff"));
  cfg.sliding_window = 8;
  CHECK(kvc::paged::paged_layer_types(cfg) == types("sss"));
  cfg.layer_types = types("fsf");
  const auto g = kvc::paged::group_paged_layers(cfg);
  CHECK(g.groups == G{{0}, {2}, {1}});
  CHECK(g.state_layers.empty());
  CHECK(g.num_layers == 3);
}

TEST_CASE("layer groups of a hybrid model: linear layers join no group, hybrids join one and hold states") {
  using G = std::vector<ids>;
  const std::vector<std::string> layout{"linear_attention", "full_attention", "hybrid_sliding",   "conv",
                                        "full_attention",   "hybrid",         "sliding_attention"};
  const auto g = kvc::paged::group_paged_layers(std::span<const std::string>(layout));
  // The attention layers 1 f, 2 s, 4 f, 5 f, 6 s: sliding {2, 6}, full {1, 4, 5} -> gcd 1.
  CHECK(g.group_size == 1);
  CHECK(g.groups == G{{1}, {4}, {5}, {2}, {6}});
  CHECK(g.types == types("fffss"));
  CHECK(g.state_layers == ids{0, 2, 3, 5});
  CHECK(g.num_layers == 7);
  // Linear layers between attention layers do not change the gcd of the attention buckets.
  const std::vector<std::string> qwen{"linear_attention", "linear_attention", "linear_attention", "full_attention",
                                      "linear_attention", "linear_attention", "linear_attention", "full_attention"};
  const auto q = kvc::paged::group_paged_layers(std::span<const std::string>(qwen));
  CHECK(q.group_size == 2);
  CHECK(q.groups == G{{3, 7}});
  CHECK(q.state_layers == ids{0, 1, 2, 4, 5, 6});
  // Without attention layers there is no group.
  const std::vector<std::string> mamba{"linear_attention", "linear_attention"};
  const auto m = kvc::paged::group_paged_layers(std::span<const std::string>(mamba));
  CHECK(m.groups.empty());
  CHECK(m.group_size == 0);
  CHECK(m.state_layers == ids{0, 1});
}

TEST_CASE("BlockManager: the worked example (bs 4, NB 6, one full group with sharing, prompt 1..9)") {
  BlockManager bm(6, 4);
  FullAttentionCacheAllocator full(0, 4, true);
  const ids prompt = iota(1, 10);
  REQUIRE(full.allocate_blocks(3, "A", bm) == 3);
  CHECK(full.table("A") == ids{0, 1, 2});
  CHECK(bm.uninitialized_blocks() == ids{3, 4, 5});
  REQUIRE(bm.block(1) != nullptr);
  CHECK(bm.block(1)->parent_id == 0);
  CHECK(kvc::paged::block_repr(*bm.block(0)) == "Block(id=0, parent_id=None, group_id=0, hash=None, ref_count=1)");

  CHECK(bm.mark_shareable_blocks_as_complete(2, full.mutable_table("A"), prompt) == 0);
  CHECK(bm.block(0)->is_complete());
  CHECK(bm.block(1)->is_complete());
  CHECK(!bm.block(2)->is_complete());

  full.free_blocks("A", bm);
  CHECK(bm.uninitialized_blocks() == ids{3, 4, 5, 2});  // the incomplete block to the back of the FIFO
  CHECK(bm.initialized_blocks() == ids{1, 0});          // next evicted first: the most recently freed
  CHECK(bm.num_free_blocks() == 6);

  // B has the same prompt: its first two blocks are found by hash.
  CHECK(full.search_prefix_match("B", prompt, bm) == 8);
  CHECK(full.table("B") == ids{0, 1});
  CHECK(bm.block(0)->ref_count == 1);
  CHECK(bm.num_initialized_blocks() == 0);
  CHECK(bm.uninitialized_blocks() == ids{3, 4, 5, 2});

  REQUIRE(full.allocate_blocks(1, "B", bm) == 1);
  CHECK(full.table("B") == ids{0, 1, 3});
  CHECK(bm.block(3)->parent_id == 1);

  const std::vector<std::string> children = {"B1", "B2"};
  const auto [src, dst] = full.fork_blocks("B", children, bm);
  CHECK(full.table("B1") == ids{0, 1, 4});
  CHECK(full.table("B2") == ids{0, 1, 5});
  CHECK(bm.block(0)->ref_count == 3);
  CHECK(bm.block(1)->ref_count == 3);
  CHECK(src == ids{3, 3});
  CHECK(dst == ids{4, 5});
  CHECK(bm.uninitialized_blocks() == ids{2});
}

TEST_CASE("BlockManager: eviction takes the most recently freed complete block first") {
  BlockManager bm(3, 4);
  FullAttentionCacheAllocator full(0, 4, true);
  REQUIRE(full.allocate_blocks(3, "A", bm) == 3);
  bm.mark_shareable_blocks_as_complete(3, full.mutable_table("A"), iota(0, 12));
  full.free_blocks("A", bm);
  CHECK(bm.initialized_blocks() == ids{2, 1, 0});
  REQUIRE(full.allocate_blocks(1, "B", bm) == 1);
  CHECK(full.table("B") == ids{2});
  CHECK(bm.initialized_blocks() == ids{1, 0});
  // The evicted block lost its hash: A's prompt now matches only its first two blocks.
  CHECK(full.search_prefix_match("C", iota(0, 12), bm) == 8);
  // Not enough even with eviction: nothing changes.
  CHECK(!full.allocate_blocks(1, "D", bm));
  CHECK(!full.has_request("D"));
  CHECK(bm.num_free_blocks() == 0);
}

TEST_CASE("BlockManager: a block completed twice is replaced by the registered one") {
  BlockManager bm(6, 4);
  FullAttentionCacheAllocator full(0, 4, true);
  const ids prompt = iota(100, 108);
  REQUIRE(full.allocate_blocks(2, "A", bm));
  REQUIRE(full.allocate_blocks(2, "B", bm));
  CHECK(bm.mark_shareable_blocks_as_complete(2, full.mutable_table("A"), prompt) == 0);
  // B computed the same KV into its own blocks 2 and 3: they go back, B holds A's.
  CHECK(bm.mark_shareable_blocks_as_complete(2, full.mutable_table("B"), prompt) == 2);
  CHECK(full.table("B") == ids{0, 1});
  CHECK(bm.block(0)->ref_count == 2);
  CHECK(bm.block(1)->ref_count == 2);
  CHECK(bm.block(2) == nullptr);
  CHECK(bm.uninitialized_blocks() == ids{4, 5, 2, 3});
  // Marking needs the tokens of the blocks it hashes.
  REQUIRE(full.allocate_blocks(1, "A", bm));
  const ids table_before = full.table("A");
  CHECK_THROWS_AS(bm.mark_shareable_blocks_as_complete(1, full.mutable_table("A"), prompt), kvc::ValueError);
  CHECK(full.table("A") == table_before);
  // Only an unshared block can be uninitialized; the refusal changes nothing.
  CHECK_THROWS_WITH_AS(bm.uninitialize_unshared_block(0), "Block 0 has more than one reference: block.ref_count = 2",
                       kvc::RuntimeError);
  CHECK(bm.block(0)->ref_count == 2);
}

TEST_CASE("forks: shared complete prefix, copied tail; the docstring example; a failed fork changes nothing") {
  for (const bool shareable : {false, true}) {
    CAPTURE(shareable);
    BlockManager bm(13, 4);
    FullAttentionCacheAllocator full(0, 4, shareable);
    REQUIRE(full.allocate_blocks(4, "P", bm));
    REQUIRE(full.allocate_blocks(1, "other", bm));  // block 4
    if (shareable) bm.mark_shareable_blocks_as_complete(3, full.mutable_table("P"), iota(0, 12));
    const std::vector<std::string> children = {"c1", "c2"};
    const auto [src, dst] = full.fork_blocks("P", children, bm);
    if (shareable) {
      CHECK(full.table("c1") == ids{0, 1, 2, 5});
      CHECK(full.table("c2") == ids{0, 1, 2, 6});
      CHECK(src == ids{3, 3});
      CHECK(dst == ids{5, 6});
      CHECK(bm.block(0)->ref_count == 3);
      CHECK(bm.block(3)->ref_count == 1);
    } else {
      CHECK(full.table("c1") == ids{5, 6, 7, 8});
      CHECK(full.table("c2") == ids{9, 10, 11, 12});
      CHECK(src == ids{0, 1, 2, 3, 0, 1, 2, 3});
      CHECK(dst == iota(5, 13));
    }
  }
  // Errors: an unknown parent, an existing child, not enough blocks (transformers leaks the
  // references and blocks it took before failing; kvc takes nothing).
  BlockManager bm(6, 4);
  FullAttentionCacheAllocator full(0, 4, true);
  REQUIRE(full.allocate_blocks(2, "P", bm));
  bm.mark_shareable_blocks_as_complete(1, full.mutable_table("P"), iota(0, 8));
  const std::vector<std::string> three = {"a", "b", "c"}, one = {"P"};
  CHECK_THROWS_WITH_AS(full.fork_blocks("nobody", three, bm), "No block table found for request nobody",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(full.fork_blocks("P", one, bm), "Block table already exists for request P", kvc::ValueError);
  const std::vector<std::string> five = {"a", "b", "c", "d", "e"};
  CHECK_THROWS_WITH_AS(full.fork_blocks("P", five, bm), "Failed to fork blocks for request P", kvc::ValueError);
  CHECK(bm.block(0)->ref_count == 1);
  CHECK(bm.num_free_blocks() == 4);
  CHECK(full.requests() == std::vector<std::string>{"P"});
  const auto [src, dst] = full.fork_blocks("P", three, bm);  // 3 copies of one block fit
  CHECK(src == ids{1, 1, 1});
  CHECK(bm.block(0)->ref_count == 4);
}

TEST_CASE("full-attention indices: transformers' test vectors") {
  BlockManager bm(16, 32);
  FullAttentionCacheAllocator full(0, 32, false);
  full.set_table("r", {2, 5, 8});
  CHECK(writes(full, "r", 60, 10) == concat({iota(188, 192), iota(256, 262)}));
  CHECK(reads(full, "r", 60, 10) == concat({iota(64, 96), iota(160, 192), iota(256, 262)}));
  ids row(6, -1);
  full.fill_block_table("r", 60, 10, row);
  CHECK(row == ids{2, 5, 8, -1, -1, -1});
  FullAttentionCacheAllocator small(0, 16, false);
  small.set_table("r", {0, 1, 2, 3});
  CHECK(writes(small, "r", 14, 4) == ids{14, 15, 16, 17});
  CHECK_THROWS_WITH_AS(reads(full, "nobody", 0, 1), "No block table found for request nobody", kvc::ValueError);
  CHECK_THROWS_AS(writes(full, "r", 90, 10), kvc::ValueError);  // position 96 is past the 3 blocks
}

TEST_CASE("sliding ring: the hybrid worked example (bs 4, sw 6, NB 8), with the ring fixed") {
  // Read trash 32, sentinel 33, write trash 36. Group 0 full, group 1 sliding.
  BlockManager bm(8, 4);
  FullAttentionCacheAllocator full(0, 4, true);
  SlidingAttentionCacheAllocator sliding(1, 4, 6, 33, 36);
  CHECK(sliding.max_blocks_per_request() == 2);
  REQUIRE(full.allocate_blocks(3, "r", bm) == 3);
  REQUIRE(sliding.allocate_blocks(3, "r", bm) == 2);
  CHECK(full.table("r") == ids{0, 1, 2});
  CHECK(sliding.table("r") == ids{3, 4});
  REQUIRE(full.allocate_blocks(1, "r", bm) == 1);
  CHECK(sliding.allocate_blocks(1, "r", bm) == 0);  // the ring is whole
  CHECK(full.table("r") == ids{0, 1, 2, 5});

  CHECK(writes(full, "r", 0, 9) == iota(0, 9));
  CHECK(writes(sliding, "r", 0, 9) == ids{36, 36, 36, 15, 16, 17, 12, 13, 14});
  CHECK(reads(sliding, "r", 0, 9) == ids(9, 33));
  // Decode past 9 .. 13: the window of the new token is the last 5 cached positions plus itself.
  const std::vector<std::pair<ids, ids>> decode = {{{15}, {16, 17, 12, 13, 14, 33}},
                                                   {{16}, {17, 12, 13, 14, 15, 33}},
                                                   {{17}, {12, 13, 14, 15, 16, 33}},
                                                   {{12}, {13, 14, 15, 16, 17, 33}},
                                                   {{13}, {14, 15, 16, 17, 12, 33}}};
  for (std::int64_t past = 9; past < 14; ++past) {
    CAPTURE(past);
    const auto& [w, r] = decode[static_cast<std::size_t>(past - 9)];
    CHECK(writes(sliding, "r", past, 1) == w);
    CHECK(reads(sliding, "r", past, 1) == r);
  }
  CHECK(reads(full, "r", 12, 1) == concat({iota(0, 12), {20}}));
  CHECK(writes(full, "r", 13, 1) == ids{21});
}

TEST_CASE("sliding ring: random prefill/decode streams read exactly the window") {
  // A model of the cache rows: which position each row holds. Every read must return the last
  // min(past, sw - 1) positions, oldest first, then one sentinel per new token; every write must
  // put position p in the row of slot p % sw (or the oldest overflow in the trash).
  std::mt19937 rng(7);
  for (const std::int64_t bs : {4, 16}) {
    for (const std::int64_t sw : {4, 5, 6, 8, 32}) {
      CAPTURE(bs);
      CAPTURE(sw);
      const std::int64_t nb = 64, sentinel = nb * bs + 1, trash = (nb + 1) * bs;
      BlockManager bm(nb, bs);
      SlidingAttentionCacheAllocator sliding(0, bs, sw, sentinel, trash);
      REQUIRE(sliding.allocate_blocks(nb, "r", bm) == (sw + bs - 1) / bs);
      std::map<std::int64_t, std::int64_t> rows;  // row -> position stored there
      std::int64_t past = 0;
      for (int step = 0; step < 40; ++step) {
        const std::int64_t q = step == 0 || rng() % 4 == 0 ? 1 + static_cast<std::int64_t>(rng() % (3 * sw)) : 1;
        const ids r = reads(sliding, "r", past, q);
        const std::int64_t len = std::min(past, sw - 1);
        REQUIRE(static_cast<std::int64_t>(r.size()) == len + q);
        for (std::int64_t i = 0; i < len; ++i) CHECK(rows.at(r[static_cast<std::size_t>(i)]) == past - len + i);
        for (std::int64_t i = len; i < len + q; ++i) CHECK(r[static_cast<std::size_t>(i)] == sentinel);
        const ids w = writes(sliding, "r", past, q);
        REQUIRE(static_cast<std::int64_t>(w.size()) == q);
        for (std::int64_t i = 0; i < q; ++i) {
          const std::int64_t row = w[static_cast<std::size_t>(i)];
          if (i < q - std::min(q, sw)) {
            CHECK(row == trash);
          } else {
            CHECK(row != trash);
            rows[row] = past + i;
          }
        }
        past += q;
      }
    }
  }
}

TEST_CASE("BlockManager invariants under random streams of requests") {
  // Requests allocate, complete blocks, share prefixes, fork and finish at random; after every
  // operation: free + held = num_blocks, every shareable block's ref count is the number of tables
  // that hold it, and a failed call changed nothing.
  std::mt19937 rng(11);
  const std::int64_t bs = 4, nb = 24;
  BlockManager bm(nb, bs);
  FullAttentionCacheAllocator full(0, bs, true);
  std::map<std::string, ids> tokens;  // each live request's known tokens
  int next = 0;
  auto check_invariants = [&] {
    std::map<std::int64_t, std::int64_t> holders;
    for (const std::string& r : full.requests())
      for (const std::int64_t b : full.table(r)) holders[b] += 1;
    CHECK(bm.num_free_blocks() + static_cast<std::int64_t>(holders.size()) == nb);
    for (const auto& [b, n] : holders) {
      REQUIRE(bm.block(b) != nullptr);
      CHECK(bm.block(b)->ref_count == n);
    }
  };
  const ids shared_prompt = iota(500, 512);  // three whole blocks many requests start with
  for (int op = 0; op < 3000; ++op) {
    const auto live = full.requests();
    const int kind = static_cast<int>(rng() % 5);
    if (kind == 0 || live.empty()) {  // a new request, half of them with the shared prompt
      const std::string r = "req_" + std::to_string(next++);
      ids prompt = rng() % 2 ? shared_prompt : iota(1000 * next, 1000 * next + 5);
      const std::int64_t matched = full.search_prefix_match(r, prompt, bm);
      CHECK(matched % bs == 0);
      const std::int64_t need = (static_cast<std::int64_t>(prompt.size()) + bs - 1) / bs - matched / bs + 1;
      const std::int64_t free_before = bm.num_free_blocks();
      if (!full.allocate_blocks(need, r, bm)) {
        CHECK(bm.num_free_blocks() == free_before);
        if (matched > 0) full.free_blocks(r, bm);
        continue;
      }
      tokens[r] = prompt;
    } else {
      const std::string& r = live[rng() % live.size()];
      ids& t = tokens[r];
      if (kind == 1) {  // decode a few tokens, then mark the blocks they complete
        const std::int64_t add = 1 + static_cast<std::int64_t>(rng() % 6);
        const std::int64_t have = static_cast<std::int64_t>(full.table(r).size()) * bs;
        const std::int64_t need = (static_cast<std::int64_t>(t.size()) + add + bs - 1) / bs * bs - have;
        if (need > 0 && !full.allocate_blocks(need / bs, r, bm)) continue;
        for (std::int64_t i = 0; i < add; ++i) t.push_back(static_cast<std::int64_t>(rng() % 50));
        std::int64_t complete = 0;  // the leading run of complete blocks
        for (const std::int64_t b : full.table(r)) {
          if (!bm.block(b)->is_complete()) break;
          ++complete;
        }
        const std::int64_t whole = static_cast<std::int64_t>(t.size()) / bs;
        bm.mark_shareable_blocks_as_complete(whole - complete, full.mutable_table(r), t);
      } else if (kind == 2) {  // finish
        full.free_blocks(r, bm);
        tokens.erase(r);
      } else if (kind == 3) {  // fork into one or two children
        std::vector<std::string> kids;
        for (std::int64_t i = 0, n = 1 + static_cast<std::int64_t>(rng() % 2); i < n; ++i)
          kids.push_back("req_" + std::to_string(next++));
        const std::int64_t free_before = bm.num_free_blocks();
        const ids parent_table = full.table(r);
        try {
          full.fork_blocks(r, kids, bm);
          for (const auto& k : kids) tokens[k] = t;
        } catch (const kvc::ValueError&) {
          CHECK(bm.num_free_blocks() == free_before);
          CHECK(full.table(r) == parent_table);
          for (const auto& k : kids) CHECK(!full.has_request(k));
        }
      } else {  // a bad call: freeing a request that does not exist only warns
        kvc_test::captured_warnings warnings;
        full.free_blocks("nobody", bm);
        CHECK(
            warnings.messages ==
            std::vector<std::string>{"CacheAllocator 0 attempted to free blocks for non-existent request_id: nobody"});
      }
    }
    check_invariants();
  }
}

TEST_CASE("BlockManager::free_blocks refuses a list it does not hold as often as listed; nothing changes") {
  BlockManager bm(4, 4);
  FullAttentionCacheAllocator full(0, 4, true);
  REQUIRE(full.allocate_blocks(2, "r", bm));
  full.set_table("bad", {0, 0});  // block 0 listed twice, held once
  CHECK_THROWS_AS(full.free_blocks("bad", bm), kvc::RuntimeError);
  CHECK(bm.block(0)->ref_count == 1);
  CHECK(full.has_request("bad"));
  full.set_table("bad", {1, 3});  // block 3 is not in use
  CHECK_THROWS_AS(full.free_blocks("bad", bm), kvc::RuntimeError);
  CHECK(bm.block(1)->ref_count == 1);
  CHECK(bm.num_free_blocks() == 2);
}

TEST_CASE("block bookkeeping messages, each word for word") {
  BlockManager bm(4, 4);
  FullAttentionCacheAllocator full(0, 4, true);
  REQUIRE(full.allocate_blocks(1, "r", bm));
  CHECK_THROWS_WITH_AS(BlockManager(-1, 4), "kvc::paged::BlockManager: num_blocks must be >= 0, got -1",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(BlockManager(4, 0), "kvc::paged::BlockManager: block_size must be >= 1, got 0", kvc::ValueError);
  CHECK_THROWS_WITH_AS(bm.get_free_blocks(-2, std::nullopt, false, 0),
                       "kvc::paged::BlockManager: cannot take -2 blocks", kvc::ValueError);
  CHECK_THROWS_WITH_AS(bm.fork_blocks(full.table("r"), -1, true, 0), "kvc::paged::BlockManager: cannot fork -1 times",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(bm.increase_ref_count(3),
                       "kvc::paged::BlockManager::increase_ref_count: block 3 is not a shareable block in use",
                       kvc::RuntimeError);
  full.set_table("twice", {0, 0});
  CHECK_THROWS_WITH_AS(full.free_blocks("twice", bm),
                       "kvc::paged::BlockManager: block 0 is listed 2 times but held 1 times", kvc::RuntimeError);
  // Blocks that are not shareable (a sliding ring's) have no count: a block already free, or listed
  // twice, is refused before any of the list goes back (it would be in the FIFO twice).
  SlidingAttentionCacheAllocator ring(1, 4, 8, 17, 20);
  REQUIRE(ring.allocate_blocks(2, "s", bm));
  const ids ring_blocks = ring.table("s");
  const std::int64_t free_before = bm.num_free_blocks();
  ring.set_table("s", {ring_blocks[0], ring_blocks[0]});
  const std::string twice =
      "kvc::paged::BlockManager: block " + std::to_string(ring_blocks[0]) + " is not in use, or is given back twice";
  CHECK_THROWS_WITH_AS(ring.free_blocks("s", bm), twice.c_str(), kvc::RuntimeError);
  ring.set_table("s", {ring_blocks[1], 3});  // block 3 is free
  CHECK_THROWS_WITH_AS(ring.free_blocks("s", bm),
                       "kvc::paged::BlockManager: block 3 is not in use, or is given back twice", kvc::RuntimeError);
  CHECK(bm.num_free_blocks() == free_before);
  ring.set_table("s", ring_blocks);
  ring.free_blocks("s", bm);
  CHECK(bm.num_free_blocks() == free_before + 2);
  CHECK_THROWS_WITH_AS(bm.uninitialize_unshared_block(3),
                       "kvc::paged::BlockManager: block 3 is not in use, or is given back twice", kvc::RuntimeError);
  kvc::paged::ForkedBlocks unprepared;
  CHECK_THROWS_WITH_AS(bm.commit_fork(full.table("r"), 2, true, 0, unprepared),
                       "kvc::paged::BlockManager: commit_fork needs the ForkedBlocks prepare_fork made",
                       kvc::ValueError);
  ids small;
  CHECK_THROWS_WITH_AS(bm.take_free_blocks(1, std::nullopt, false, 0, small),
                       "kvc::paged::BlockManager: take_free_blocks needs room for 1 ids", kvc::ValueError);
  CHECK_THROWS_WITH_AS(bm.mark_shareable_blocks_as_complete(1, full.mutable_table("r"), ids{1, 2}),
                       "kvc::paged::BlockManager: block 0 of the request needs tokens up to 4, but only 2 are known",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::paged::compute_block_hash(std::nullopt, ids{1}, std::int64_t{1} << 32),
                       "kvc::paged::compute_block_hash: group 4294967296 is outside 0 .. 2^31 - 1 (block hashes pack "
                       "the group as a C int)",
                       kvc::ValueError);
  ids out;
  CHECK_THROWS_WITH_AS(full.get_write_indices("r", 2, 4, out),
                       "kvc::paged: request r has 1 blocks in group 0, too few for slot 4", kvc::ValueError);
  CHECK_THROWS_WITH_AS(full.get_read_indices("r", -1, 1, out),
                       "kvc::paged: past and query lengths must be >= 0, got past -1 and q 1", kvc::ValueError);
  CHECK_THROWS_WITH_AS(full.search_prefix_match("r", ids{1, 2, 3, 4}, bm),
                       "kvc::paged: request r already has blocks; a prefix match starts a table", kvc::ValueError);
  ids row(1);
  CHECK_THROWS_WITH_AS(full.fill_block_table("r", 4, 1, row),
                       "kvc::paged: a block table row of 1 entries cannot hold the 2 blocks of request r (it has 1)",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(SlidingAttentionCacheAllocator(1, 4, 0, 17, 20),
                       "kvc::paged: sliding_window must be >= 1, got 0", kvc::ValueError);
  // A complete block nobody holds any more cannot lose a reference.
  FullAttentionCacheAllocator other(0, 4, true);
  REQUIRE(other.allocate_blocks(1, "done", bm));
  bm.mark_shareable_blocks_as_complete(1, other.mutable_table("done"), ids{9, 9, 9, 9});
  const std::int64_t freed = other.table("done")[0];
  other.free_blocks("done", bm);
  const std::string unreferenced = "kvc::paged::BlockManager: block " + std::to_string(freed) + " is not referenced";
  CHECK_THROWS_WITH_AS(bm.decrease_ref_count(freed), unreferenced.c_str(), kvc::RuntimeError);
  // The refusals changed nothing.
  CHECK(full.table("r") == ids{0});
  CHECK(bm.block(0)->ref_count == 1);
  CHECK(!bm.block(0)->is_complete());
  CHECK(bm.num_free_blocks() == 3);
}

TEST_CASE("BlockManager: a block replaced by a registered one hands its id to the next block's parent_id") {
  // A and B: the same 9 prompt tokens on blocks of 4, 3 blocks each, marked complete A then B.
  // B's first two blocks are replaced by A's 0 and 1; its third block (5) is not hashed, but its
  // parent is now 1, as transformers re-points it before it stops (4 has gone back to the FIFO).
  BlockManager bm(6, 4);
  FullAttentionCacheAllocator full(0, 4, true);
  const ids prompt = iota(1, 10);
  REQUIRE(full.allocate_blocks(3, "A", bm) == 3);
  REQUIRE(full.allocate_blocks(3, "B", bm) == 3);
  CHECK(bm.mark_shareable_blocks_as_complete(2, full.mutable_table("A"), prompt) == 0);
  CHECK(bm.mark_shareable_blocks_as_complete(2, full.mutable_table("B"), prompt) == 2);
  CHECK(full.table("B") == ids{0, 1, 5});
  REQUIRE(bm.block(5) != nullptr);
  CHECK(bm.block(5)->parent_id == 1);
  CHECK(!bm.block(5)->is_complete());
  CHECK(bm.block(4) == nullptr);
  // One block at a time: the block after a replaced one is re-pointed when it is its turn.
  BlockManager bm2(6, 4);
  FullAttentionCacheAllocator full2(0, 4, true);
  REQUIRE(full2.allocate_blocks(3, "A", bm2) == 3);
  REQUIRE(full2.allocate_blocks(3, "B", bm2) == 3);
  bm2.mark_shareable_blocks_as_complete(2, full2.mutable_table("A"), prompt);
  CHECK(bm2.mark_shareable_blocks_as_complete(1, full2.mutable_table("B"), prompt) == 1);
  CHECK(full2.table("B") == ids{0, 4, 5});
  CHECK(bm2.block(4)->parent_id == 0);
  CHECK(bm2.mark_shareable_blocks_as_complete(1, full2.mutable_table("B"), prompt) == 1);
  CHECK(full2.table("B") == ids{0, 1, 5});
  CHECK(bm2.block(5)->parent_id == 1);
}

TEST_CASE("allocators: lengths at the int64 extremes are ValueErrors naming the call") {
  constexpr std::int64_t big = INT64_MAX;
  BlockManager bm(8, 4);
  FullAttentionCacheAllocator full(0, 4, false);
  SlidingAttentionCacheAllocator ring(1, 4, 6, 33, 36);
  REQUIRE(full.allocate_blocks(1, "r", bm));
  REQUIRE(ring.allocate_blocks(1, "r", bm) == 1);
  // A count of blocks past any ring takes what the ring lacks, without overflowing.
  CHECK(ring.allocate_blocks(big, "r", bm) == 1);
  CHECK(ring.table("r").size() == 2);
  CHECK(ring.allocate_blocks(big, "r", bm) == 0);
  ids out, row(4);
  const std::string limit = ", above kvc's limit of 1099511627776";
  CHECK_THROWS_WITH_AS(
      full.get_read_indices("r", big, 1, out),
      ("kvc::paged::FullAttentionCacheAllocator::get_read_indices: past is 9223372036854775807" + limit).c_str(),
      kvc::ValueError);
  CHECK_THROWS_WITH_AS(
      full.get_write_indices("r", 1, big, out),
      ("kvc::paged::FullAttentionCacheAllocator::get_write_indices: q is 9223372036854775807" + limit).c_str(),
      kvc::ValueError);
  CHECK_THROWS_WITH_AS(
      full.fill_block_table("r", big, 1, row),
      ("kvc::paged::FullAttentionCacheAllocator::fill_block_table: past is 9223372036854775807" + limit).c_str(),
      kvc::ValueError);
  CHECK_THROWS_WITH_AS(
      ring.get_read_indices("r", big, 1, out),
      ("kvc::paged::SlidingAttentionCacheAllocator::get_read_indices: past is 9223372036854775807" + limit).c_str(),
      kvc::ValueError);
  CHECK_THROWS_WITH_AS(
      ring.get_write_indices("r", big, 1, out),
      ("kvc::paged::SlidingAttentionCacheAllocator::get_write_indices: past is 9223372036854775807" + limit).c_str(),
      kvc::ValueError);
  // Negative lengths keep their message.
  CHECK_THROWS_WITH_AS(ring.get_write_indices("r", -1, big, out),
                       "kvc::paged: past and query lengths must be >= 0, got past -1 and q 9223372036854775807",
                       kvc::ValueError);
  CHECK(out.empty());
  CHECK(row == ids(4));
}
