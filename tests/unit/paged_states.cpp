// kvc::PagedCache on hybrid models: layers with linear-attention states ("linear_attention",
// "conv", and the hybrids, which also have keys and values) keep per-request conv and recurrent
// states in state slots. Checked: construction and its messages, each request's states against a
// dense LinearAttentionLayer fed the same inputs (random interleavings of requests, chunked conv
// updates, forks, frees), the slots' life (taken with the first blocks, given back with them,
// read as unwritten when taken again, copied by forks), refusals that change nothing, and
// transactions.

#include "../support/kvc_test.hpp"
#include "../support/paged_snapshot.hpp"

#include <kvc/paged/paged_batch_cache.hpp>
#include <kvc/paged/paged_cache.hpp>
#include <kvc/policies/storage/host.hpp>
#include <kvc/state.hpp>

#include <algorithm>
#include <cstdint>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

using Host = kvc::HostStorage<float>;
using Cache = kvc::PagedCache<Host>;
using LinearOnly = kvc::Cache<kvc::Layers<kvc::LinearAttentionLayer>>;
using Conv = Eigen::Tensor<float, 3, Eigen::RowMajor>;
using ids = std::vector<std::int64_t>;

// Layers: 0 linear_attention, 1 full_attention, 2 hybrid, 3 conv; two states per layer with states.
kvc::ModelConfig hybrid_model(std::int64_t states = 2) {
  kvc::ModelConfig c;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 2;
  c.head_dim = 3;
  c.hidden_size = 6;
  c.layer_types = std::vector<std::string>{"linear_attention", "full_attention", "hybrid", "conv"};
  c.number_of_conv_states = states;
  return c;
}
kvc::ContinuousBatchingConfig blocks(std::int64_t num_blocks, std::optional<std::int64_t> slots = std::nullopt) {
  kvc::ContinuousBatchingConfig c;
  c.block_size = 4;
  c.num_blocks = num_blocks;
  c.max_state_slots = slots;
  return c;
}

Conv random_conv(std::int64_t batch, std::int64_t channels, std::int64_t time, unsigned seed = 1) {
  std::mt19937 rng(seed);
  Conv x(batch, channels, time);
  for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(rng() % 1000) / 8.f;
  return x;
}

std::vector<float> values_of(const kvc::StateView<float>& v) {
  if (v.rank == 0) return {};
  return std::vector<float>(v.data(), v.data() + v.size());
}
std::vector<std::int64_t> shape_of(const kvc::StateView<float>& v) {
  std::vector<std::int64_t> out;
  for (int r = 0; r < v.rank; ++r) out.push_back(v.extent(r));
  return out;
}

template <class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no exception>";
}

constexpr std::int64_t state_layers[] = {0, 2, 3};

// Every state of one request, in the cache's order: (layer, state) -> conv, recurrent, flag.
std::vector<std::vector<float>> states_of(const Cache& c, const std::string& id) {
  std::vector<std::vector<float>> out;
  for (const std::int64_t l : state_layers)
    for (std::int64_t s = 0; s < c.states_per_layer(); ++s) {
      out.push_back(values_of(c.conv_state(id, l, s)));
      out.push_back(values_of(c.recurrent_state(id, l, s)));
      out.push_back({c.has_previous_state(id, l, s) ? 1.f : 0.f});
    }
  return out;
}
// The same of a dense reference: one LinearOnly cache per layer with states.
std::vector<std::vector<float>> states_of(const std::vector<LinearOnly>& ref) {
  std::vector<std::vector<float>> out;
  for (const LinearOnly& layer : ref)
    for (std::int64_t s = 0; s < 2; ++s) {
      out.push_back(values_of(layer.visit_layer(0, [&](const auto& l) { return l.conv_state(s); })));
      out.push_back(values_of(layer.visit_layer(0, [&](const auto& l) { return l.recurrent_state(s); })));
      out.push_back({layer.has_previous_state(0, s) ? 1.f : 0.f});
    }
  return out;
}
std::vector<LinearOnly> fresh_reference() {
  std::vector<LinearOnly> out;
  for (std::size_t i = 0; i < std::size(state_layers); ++i) out.emplace_back(kvc::LinearAttentionLayer{2});
  return out;
}

}  // namespace

TEST_CASE("PagedCache on a hybrid model: layers, groups, state slots and the messages of construction") {
  Cache c(hybrid_model(), blocks(10));
  CHECK(c.num_layers() == 4);
  CHECK(c.num_groups() == 1);
  CHECK(c.group_size() == 2);
  CHECK(c.state_layers() == ids{0, 2, 3});
  CHECK(c.states_per_layer() == 2);
  CHECK(c.state_slots() == 10);  // unset: 256, at most num_blocks
  CHECK(c.free_state_slots() == 10);
  CHECK(c.state_bytes() == 0);  // nothing made before the first state
  CHECK(!c.use_prefix_sharing());
  CHECK(c.layer_group(2) == std::pair<std::int64_t, std::int64_t>{0, 1});
  CHECK_THROWS_WITH_AS((void)c.layer_group(0),
                       "kvc::PagedCache: layer 0 keeps linear-attention states only: it has no keys and values",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS((void)c.layer_group(4), "kvc::PagedCache: layer 4 is out of range for 4 layers",
                       kvc::IndexError);

  CHECK(Cache(hybrid_model(), blocks(10, 3)).state_slots() == 3);
  auto per_batch = blocks(10);
  per_batch.max_requests_per_batch = 5;
  CHECK(Cache(hybrid_model(), per_batch).state_slots() == 5);
  CHECK_THROWS_WITH_AS(Cache(hybrid_model(), blocks(10, 0)),
                       "kvc::PagedCache: max_state_slots must be a positive integer, got 0", kvc::ValueError);
  CHECK_THROWS_WITH_AS(Cache(hybrid_model(0), blocks(10)),
                       "kvc::PagedCache: number_of_conv_states must be a positive integer, got 0", kvc::ValueError);
  auto mamba = hybrid_model();
  mamba.layer_types = std::vector<std::string>{"linear_attention", "conv"};
  mamba.num_hidden_layers = 2;
  CHECK_THROWS_WITH_AS(Cache(mamba, blocks(10)),
                       "kvc::PagedCache: the model has no attention layers; a paged cache serves linear-attention "
                       "layers next to attention layers only (a model of linear-attention layers alone keeps "
                       "fixed-size states: use a dynamic cache)",
                       kvc::ValueError);
  // The batch form (make_cache's "paged") keeps them too (transformers refuses the model:
  // "Invalid group type: linear_attention"); paged_batch_cache.cpp checks it.
  CHECK(kvc::PagedBatchCache<Host>(hybrid_model(), blocks(10)).paged().state_slots() == 10);
  // A model without states has no slots and no limit from them.
  auto plain = hybrid_model();
  plain.layer_types = std::vector<std::string>{"full_attention", "full_attention"};
  plain.num_hidden_layers = 2;
  Cache p(plain, blocks(10, 0));
  CHECK(p.state_slots() == 0);
  CHECK(p.allocate_blocks(1, "a", 0));
  CHECK(p.state_slot("a") == -1);
  CHECK(p.compute_max_num_forks("a") == 10 - 1);
}

TEST_CASE("PagedCache states: each request's states are those of a dense LinearAttentionLayer fed the same") {
  std::mt19937 rng(20261206);
  Cache c(hybrid_model(), blocks(12, 4));
  c.reserve_swap_space(3);                              // 3 swap state slots
  std::map<std::string, std::vector<LinearOnly>> ref;   // the requests holding a slot
  std::map<std::string, std::vector<LinearOnly>> away;  // the offloaded ones
  std::int64_t next = 0, forks = 0, frees = 0, updates = 0, offloads = 0, restores = 0;
  const auto pick = [&](std::int64_t n) { return std::uniform_int_distribution<std::int64_t>(0, n - 1)(rng); };
  for (int step = 0; step < 600; ++step) {
    const std::int64_t what = pick(10);
    if (!away.empty() && what == 0 && pick(2) == 0) {  // an offloaded request back
      auto back = away.begin();
      std::advance(back, pick(static_cast<std::int64_t>(away.size())));
      const std::string id = back->first;
      if (!c.allocate_blocks(1, id, 0)) continue;  // no block or slot free
      c.restore_request(id);
      CHECK(!c.is_offloaded(id));
      ref.insert(away.extract(back));
      ++restores;
    } else if (ref.empty() || what == 0) {  // a new request
      const std::string id = "r" + std::to_string(next++);
      const bool fits = c.free_state_slots() > 0 && c.get_num_free_blocks() > 0;
      CHECK(c.allocate_blocks(1, id, 0).has_value() == fits);
      if (fits) {
        ref.emplace(id, fresh_reference());
        CHECK(c.state_slot(id) >= 0);
      } else {
        CHECK(c.state_slot(id) == -1);
        CHECK(!c.find_request(id));
      }
      continue;
    }
    auto it = ref.begin();
    std::advance(it, pick(static_cast<std::int64_t>(ref.size())));
    const std::string id = it->first;
    if (what == 1) {  // free it: its slot goes back
      const std::int64_t free = c.free_state_slots();
      c.free_blocks(id);
      CHECK(c.free_state_slots() == free + 1);
      ref.erase(it);
      ++frees;
    } else if (what == 3 && pick(2) == 0) {  // offload it: its states go to a swap state slot
      const bool fits = c.free_swap_state_slots() > 0 && c.free_swap_blocks() >= c.blocks_in_use(id);
      CHECK(c.offload_request(id) == fits);
      if (fits) {
        CHECK(c.state_slot(id) == -1);
        away.insert(ref.extract(it));
        ++offloads;
      }
    } else if (what == 2) {  // fork it
      const std::string kid = "r" + std::to_string(next++);
      const bool fits = c.compute_max_num_forks(id) >= 1;
      CHECK(fits == (c.free_state_slots() > 0 && c.get_num_free_blocks() >= 1));
      if (fits) {
        (void)c.fork_request(id, std::vector<std::string>{kid});
        ref.emplace(kid, it->second);  // (it stays valid: a map)
        ++forks;
      } else {
        CHECK_THROWS_WITH_AS((void)c.fork_request(id, std::vector<std::string>{kid}),
                             ("Failed to fork blocks for request " + id).c_str(), kvc::ValueError);
      }
    } else {  // a conv step (1..5 columns), then its recurrent state, of one layer and state
      const std::size_t li = static_cast<std::size_t>(pick(3));
      const std::int64_t layer = state_layers[li], s = pick(2), t = 1 + pick(5);
      Conv x(1, 3, t);
      for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(pick(1000)) / 8.f;
      const auto got = c.update_conv_state(x, id, layer, s, 3);
      const auto want = it->second[li].update_conv_state(x, 0, s, 3);
      CHECK(shape_of(got) == shape_of(want));
      CHECK(values_of(got) == values_of(want));
      if (what < 8) {
        Eigen::Tensor<float, 3, Eigen::RowMajor> r(1, 2, 2);
        for (Eigen::Index i = 0; i < r.size(); ++i) r.data()[i] = static_cast<float>(pick(1000));
        CHECK(values_of(c.update_recurrent_state(r, id, layer, s)) ==
              values_of(it->second[li].update_recurrent_state(r, 0, s)));
      }
      ++updates;
    }
    for (const auto& [name, layers] : ref) CHECK(states_of(c, name) == states_of(layers));
  }
  CHECK(forks > 10);
  CHECK(frees > 10);
  CHECK(offloads > 5);
  CHECK(restores > 5);
  CHECK(updates > 300);
  // Every layer's tensors are made, for every slot.
  CHECK(c.state_bytes() == static_cast<std::int64_t>(sizeof(float)) * 4 * 3 * 2 * (3 * 3 + 2 * 2));
}

TEST_CASE("PagedCache states: a slot is taken with the first blocks, given back with them, and starts unwritten") {
  Cache c(hybrid_model(), blocks(8, 2));
  CHECK(c.allocate_blocks(0, "a", 0));  // no block: no slot
  CHECK(c.state_slot("a") == -1);
  CHECK_THROWS_WITH_AS((void)c.conv_state("a", 0),
                       "kvc::PagedCache::conv_state: request a holds no state slot (a request takes one with its "
                       "first blocks)",
                       kvc::ValueError);
  REQUIRE(c.allocate_blocks(1, "a", 0));
  CHECK(c.state_slot("a") == 0);
  REQUIRE(c.allocate_blocks(1, "a", 1));  // more blocks: the same slot
  CHECK(c.state_slot("a") == 0);
  CHECK(c.free_state_slots() == 1);
  CHECK(c.conv_state("a", 0).rank == 0);  // unwritten
  CHECK(!c.has_previous_state("a", 0));
  const Conv x = random_conv(1, 3, 4);
  (void)c.update_conv_state(x, "a", 0, 1, 3);
  CHECK(c.has_previous_state("a", 0, 1));
  CHECK(!c.has_previous_state("a", 0, 0));
  CHECK(c.conv_state("a", 0, 1).extent(2) == 3);
  // Freed and taken again by another request: the same slot, read as never written.
  c.free_blocks("a");
  CHECK(c.state_slot("a") == -1);
  REQUIRE(c.allocate_blocks(1, "b", 0));
  CHECK(c.state_slot("b") == 0);
  CHECK(!c.has_previous_state("b", 0, 1));
  CHECK(c.conv_state("b", 0, 1).rank == 0);
  // A dense batch: one slot per new request; too few slots is nothing taken.
  REQUIRE(c.allocate_blocks(1, std::vector<std::string>{"b", "c"}));
  CHECK(c.state_slot("c") == 1);
  CHECK(c.free_state_slots() == 0);
  CHECK(c.get_num_free_blocks() == 8 - 3);
  const auto before = kvc_test::take_paged_snapshot(c, {"b", "c", "d"});
  CHECK(!c.allocate_blocks(1, "d", 0));  // blocks are free, slots are not
  CHECK(!c.allocate_blocks(1, std::vector<std::string>{"b", "d"}));
  CHECK(kvc_test::take_paged_snapshot(c, {"b", "c", "d"}) == before);
  CHECK(!c.find_request("d"));
  CHECK(c.compute_max_num_forks("b") == 0);
  CHECK_THROWS_WITH_AS((void)c.fork_request("b", std::vector<std::string>{"e"}), "Failed to fork blocks for request b",
                       kvc::ValueError);
  CHECK(kvc_test::take_paged_snapshot(c, {"b", "c", "d"}) == before);
  // free_all_requests gives every slot back.
  c.free_all_requests();
  CHECK(c.free_state_slots() == 2);
}

TEST_CASE("PagedCache states: refusals name the problem and change nothing") {
  Cache c(hybrid_model(), blocks(8));
  REQUIRE(c.allocate_blocks(1, "a", 0));
  (void)c.open_request("k");
  const Conv x = random_conv(1, 3, 2);
  (void)c.update_conv_state(x, "a", 2, 0, 4);
  Eigen::Tensor<float, 2, Eigen::RowMajor> rec(1, 5);
  std::fill(rec.data(), rec.data() + rec.size(), 2.f);
  (void)c.update_recurrent_state(rec, "a", 2, 0);
  const auto before = kvc_test::take_paged_snapshot(c, {"a", "k"});
  const auto states = states_of(c, "a");
  CHECK(message_of([&] { (void)c.update_conv_state(x, "a", 1); }) ==
        "Cannot call `update_conv_state` on a non-LinearAttention layer!");
  CHECK(message_of([&] { (void)c.update_recurrent_state(rec, "a", 1); }) ==
        "Cannot call `update_recurrent_state` on a non-LinearAttention layer!");
  CHECK_THROWS_WITH_AS((void)c.update_conv_state(x, "a", 7), "kvc::PagedCache: layer 7 is out of range for 4 layers",
                       kvc::IndexError);
  CHECK_THROWS_WITH_AS((void)c.update_conv_state(x, "a", 0, 2),
                       "update_conv_state: state_idx 2 is out of range for a layer with 2 states", kvc::KeyError);
  CHECK_THROWS_WITH_AS((void)c.has_previous_state("a", 0, -1),
                       "has_previous_state: state_idx -1 is out of range for a layer with 2 states", kvc::KeyError);
  CHECK_THROWS_WITH_AS((void)c.update_conv_state(x, "zz", 0), "No block table found for request zz", kvc::ValueError);
  CHECK_THROWS_WITH_AS((void)c.update_conv_state(x, "k", 0),
                       "kvc::PagedCache::update_conv_state: request k holds no state slot (a request takes one "
                       "with its first blocks)",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS((void)c.update_conv_state(random_conv(2, 3, 2), "a", 0),
                       "kvc::PagedCache::update_conv_state: conv states must have shape [1, channels, time] with "
                       "positive sizes, got [2, 3, 2]",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS((void)c.update_conv_state(random_conv(1, 4, 2), "a", 2),
                       "kvc::PagedCache::update_conv_state: conv states of shape [1, 4, 2] do not match state 0 of "
                       "layer 2, which holds 3 channels",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS((void)c.update_conv_state(x, "a", 0, 0, -1),
                       "kvc::PagedCache::update_conv_state: conv_kernel_size must be positive, got -1",
                       kvc::ValueError);
  Eigen::Tensor<float, 2, Eigen::RowMajor> other(1, 4);
  std::fill(other.data(), other.data() + other.size(), 0.f);
  CHECK_THROWS_WITH_AS((void)c.update_recurrent_state(other, "a", 2, 0),
                       "kvc::PagedCache::update_recurrent_state: recurrent states of shape [1, 4] do not match "
                       "state 0 of layer 2, which holds [1, 5]",
                       kvc::ValueError);
  Eigen::Tensor<float, 2, Eigen::RowMajor> two(2, 5);
  std::fill(two.data(), two.data() + two.size(), 0.f);
  CHECK_THROWS_WITH_AS((void)c.update_recurrent_state(two, "a", 0, 0),
                       "kvc::PagedCache::update_recurrent_state: recurrent states must be a non-empty tensor [1, "
                       "...], got [2, 5]",
                       kvc::ValueError);
  // Keys and values of a layer with states only.
  kvc::PagedIndices reads(1), writes(1);
  std::mt19937 rng(3);
  const auto kv = kvc_test::random_tensor<float>(1, 2, 1, 3, rng);
  CHECK_THROWS_WITH_AS((void)c.update(kv, kv, 0, reads, writes),
                       "kvc::PagedCache: layer 0 keeps linear-attention states only: it has no keys and values",
                       kvc::ValueError);
  // A recurrent state cannot be cut back to a position (the caller prefills the request again, as
  // the scheduler does); offload needs a swap state slot.
  CHECK(!c.truncate_request("a", 1));
  c.reserve_swap_space(4, 0);
  CHECK(c.swap_state_slots() == 0);
  const auto with_swap = kvc_test::take_paged_snapshot(c, {"a", "k"});
  CHECK(!c.offload_request("a"));
  CHECK(kvc_test::take_paged_snapshot(c, {"a", "k"}) == with_swap);
  CHECK(with_swap.free_blocks == before.free_blocks);
  CHECK(states_of(c, "a") == states);
}

TEST_CASE("PagedCache states: offload and restore carry them through a swap state slot") {
  Cache c(hybrid_model(), blocks(8, 3));
  c.reserve_swap_space(4);
  CHECK(c.swap_state_slots() == 3);  // unset: the swap blocks, at most the cache's slots
  REQUIRE(c.allocate_blocks(2, "a", 0));
  REQUIRE(c.allocate_blocks(1, "b", 0));
  (void)c.update_conv_state(random_conv(1, 3, 6, 2), "a", 2, 1, 3);
  Eigen::Tensor<float, 2, Eigen::RowMajor> rec(1, 4);
  std::fill(rec.data(), rec.data() + rec.size(), 3.f);
  (void)c.update_recurrent_state(rec, "a", 3, 0);
  const auto a = states_of(c, "a");

  // Rolled back: nothing moved.
  const auto before = kvc_test::take_paged_snapshot(c, {"a", "b"});
  c.begin_transaction();
  REQUIRE(c.offload_request("a"));
  c.rollback_transaction();
  CHECK(kvc_test::take_paged_snapshot(c, {"a", "b"}) == before);

  REQUIRE(c.offload_request("a"));
  CHECK(c.is_offloaded("a"));
  CHECK(c.state_slot("a") == -1);
  CHECK(c.free_state_slots() == 2);
  CHECK(c.free_swap_state_slots() == 2);
  CHECK_THROWS_WITH_AS((void)c.conv_state("a", 2, 1),
                       "kvc::PagedCache::conv_state: request a holds no state slot (a request takes one with its "
                       "first blocks)",
                       kvc::ValueError);
  // Its cache slot is taken by another request and written: the swap keeps a's states.
  REQUIRE(c.allocate_blocks(1, "c", 0));
  CHECK(c.state_slot("c") == 0);
  (void)c.update_conv_state(random_conv(1, 3, 2, 5), "c", 2, 1, 3);
  // Back, into a new slot, in a transaction (the copy saves the slot it overwrites first).
  REQUIRE(c.allocate_blocks(2, "a", 0));
  c.transaction([&] { c.restore_request("a"); });
  CHECK(!c.is_offloaded("a"));
  CHECK(c.state_slot("a") == 2);
  CHECK(states_of(c, "a") == a);
  CHECK(c.free_swap_state_slots() == 3);

  // A request offloaded before any state was written comes back unwritten, into a slot whose last
  // holder wrote it.
  const auto c_states = states_of(c, "c");
  REQUIRE(c.offload_request("b"));
  REQUIRE(c.offload_request("c"));
  REQUIRE(c.allocate_blocks(1, "b", 0));
  CHECK(c.state_slot("b") == 0);  // c's slot
  c.restore_request("b");
  CHECK(!c.has_previous_state("b", 2, 1));
  CHECK(c.conv_state("b", 2, 1).rank == 0);
  REQUIRE(c.allocate_blocks(1, "c", 0));
  c.restore_request("c");
  CHECK(states_of(c, "c") == c_states);
  // Dropped while offloaded: the swap state slot goes back.
  REQUIRE(c.offload_request("c"));
  CHECK(c.free_swap_state_slots() == 2);
  c.drop_offloaded_request("c");
  CHECK(c.free_swap_state_slots() == 3);
  // No swap state slot free: refused, nothing changed.
  c.free_all_requests();
  c.reserve_swap_space(4, 1);
  for (const char* id : {"x", "y"}) REQUIRE(c.allocate_blocks(1, id, 0));
  REQUIRE(c.offload_request("x"));
  const auto full = kvc_test::take_paged_snapshot(c, {"x", "y"});
  CHECK(!c.offload_request("y"));
  CHECK(kvc_test::take_paged_snapshot(c, {"x", "y"}) == full);
}

TEST_CASE("PagedCache states: forks copy them, in a transaction too, and a rollback gives slots back") {
  Cache c(hybrid_model(), blocks(8, 3));
  REQUIRE(c.allocate_blocks(1, "a", 0));
  const Conv x = random_conv(1, 3, 5);
  (void)c.update_conv_state(x, "a", 3, 1, 2);
  Eigen::Tensor<float, 1, Eigen::RowMajor> rec(1);
  std::fill(rec.data(), rec.data() + rec.size(), 7.f);
  (void)c.update_recurrent_state(rec, "a", 0, 0);
  const auto a = states_of(c, "a");

  // Rolled back: no slot taken, nothing copied.
  const auto before = kvc_test::take_paged_snapshot(c, {"a", "x"});
  c.begin_transaction();
  (void)c.fork_request("a", std::vector<std::string>{"x"});
  CHECK(c.state_slot("x") == 1);
  c.rollback_transaction();
  CHECK(c.state_slot("x") == -1);
  CHECK(c.free_state_slots() == 2);
  CHECK(kvc_test::take_paged_snapshot(c, {"a", "x"}) == before);

  // Committed: the copies stay.
  c.transaction([&] { (void)c.fork_request("a", std::vector<std::string>{"x", "y"}); });
  CHECK(states_of(c, "x") == a);
  CHECK(states_of(c, "y") == a);
  // The copies are the forks' own: the source's next step changes only the source.
  (void)c.update_conv_state(random_conv(1, 3, 1, 9), "a", 3, 1);
  CHECK(states_of(c, "x") == a);
  CHECK(states_of(c, "a") != a);

  // An allocation rolled back gives its slot back too; a slot taken in a rolled-back transaction
  // and then taken again reads as unwritten.
  c.free_blocks("y");
  c.begin_transaction();
  REQUIRE(c.allocate_blocks(1, "z", 0));
  (void)c.update_conv_state(x, "z", 0);
  c.rollback_transaction();
  CHECK(!c.find_request("z"));
  REQUIRE(c.allocate_blocks(1, "w", 0));
  CHECK(!c.has_previous_state("w", 0));
}

TEST_CASE("PagedCache states: copy_states copies one request's states onto another's, rolled back in a transaction") {
  Cache c(hybrid_model(), blocks(8, 3));
  REQUIRE(c.allocate_blocks(1, "a", 0));
  REQUIRE(c.allocate_blocks(1, "b", 0));
  (void)c.update_conv_state(random_conv(1, 3, 5), "a", 3, 1, 2);
  (void)c.update_conv_state(random_conv(1, 3, 2, 4), "b", 0, 0, 2);
  const auto a = states_of(c, "a"), b = states_of(c, "b");
  REQUIRE(a != b);

  // In a transaction: b holds a's states until the rollback gives b's back.
  c.begin_transaction();
  c.copy_states("a", "b");
  CHECK(states_of(c, "b") == a);
  c.rollback_transaction();
  CHECK(states_of(c, "b") == b);
  // Outside one: b's written states are a's, and what a never wrote reads as unwritten in b.
  c.copy_states("a", "b");
  CHECK(states_of(c, "b") == a);
  CHECK(c.has_previous_state("b", 3, 1));
  CHECK_FALSE(c.has_previous_state("b", 0, 0));
  c.copy_states("b", "b");  // onto itself: nothing changes
  CHECK(states_of(c, "b") == a);

  // A request without a slot (open, no blocks yet) is refused, an unknown one too; a model
  // without states has nothing to copy.
  const kvc::paged::RequestKey k = c.open_request("k");
  const auto before = kvc_test::take_paged_snapshot(c, {"a", "b"});
  CHECK_THROWS_WITH_AS(c.copy_states("a", k), "kvc::PagedCache::copy_states: request k holds no state slot",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(c.copy_states(k, "b"), "kvc::PagedCache::copy_states: request k holds no state slot",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(c.copy_states("a", "nobody"), "No block table found for request nobody", kvc::ValueError);
  CHECK(kvc_test::take_paged_snapshot(c, {"a", "b"}) == before);
  auto plain = hybrid_model();
  plain.layer_types = std::vector<std::string>{"full_attention", "full_attention"};
  plain.num_hidden_layers = 2;
  Cache p(plain, blocks(10, 0));
  REQUIRE(p.allocate_blocks(1, "a", 0));
  REQUIRE(p.allocate_blocks(1, "b", 0));
  p.copy_states("a", "b");
  CHECK(p.state_slots() == 0);
}

TEST_CASE("PagedCache states: the example of docs/paged.md") {
  const Conv conv = random_conv(1, 3, 2);
  Eigen::Tensor<float, 2, Eigen::RowMajor> recurrent(1, 6);
  std::fill(recurrent.data(), recurrent.data() + recurrent.size(), 1.f);
  // [snippet:hybrid_states]
  kvc::ModelConfig config = hybrid_model();  // linear_attention, full_attention, hybrid, conv
  Cache cache(config, blocks(8));
  REQUIRE(cache.allocate_blocks(1, "r", 0));                       // its first blocks: a state slot too
  const auto input = cache.update_conv_state(conv, "r", 0, 0, 4);  // [1, channels, 4]: left-padded
  (void)cache.update_recurrent_state(recurrent, "r", 0);
  CHECK(cache.has_previous_state("r", 0));
  cache.free_blocks("r");  // the slot goes back; taken again, it reads as never written
  // [/snippet]
  CHECK(shape_of(input) == ids{1, 3, 4});
  CHECK(values_of(input)[0] == 0.f);
  CHECK(values_of(input)[2] == conv(0, 0, 0));
  CHECK(cache.free_state_slots() == cache.state_slots());
}

TEST_CASE(
    "PagedCache states: save_request and load_request carry them, into a cache that has made its tensors or not") {
  Cache a(hybrid_model(), blocks(8));
  REQUIRE(a.allocate_blocks(2, "r", 0));
  (void)a.update_conv_state(random_conv(1, 3, 5, 4), "r", 0, 1, 3);
  Eigen::Tensor<float, 3, Eigen::RowMajor> rec(1, 2, 2);
  for (Eigen::Index i = 0; i < rec.size(); ++i) rec.data()[i] = static_cast<float>(i) + 0.5f;
  (void)a.update_recurrent_state(rec, "r", 3, 0);
  std::ostringstream os;
  kvc::save_request(a, "r", os);
  const std::string bytes = os.str();

  // Into a fresh cache: its tensors are made from the file's shapes.
  Cache b(hybrid_model(), blocks(8));
  std::istringstream in(bytes);
  kvc::load_request(b, "q", in);
  CHECK(states_of(b, "q") == states_of(a, "r"));
  CHECK(b.state_bytes() > 0);
  // Both go on alike.
  const Conv next = random_conv(1, 3, 1, 6);
  CHECK(values_of(b.update_conv_state(next, "q", 0, 1)) == values_of(a.update_conv_state(next, "r", 0, 1)));

  // Into a cache whose layer 0 holds conv states of another width: refused, nothing changed.
  Cache c(hybrid_model(), blocks(8));
  REQUIRE(c.allocate_blocks(1, "other", 0));
  (void)c.update_conv_state(random_conv(1, 4, 2), "other", 0, 1, 3);
  const auto other = states_of(c, "other");
  const std::int64_t state_bytes = c.state_bytes(), free = c.get_num_free_blocks();
  std::istringstream in2(bytes);
  CHECK_THROWS_WITH_AS(kvc::load_request(c, "q", in2),
                       "kvc::load: request q: state 1 of layer 0 holds conv states of 3 channels and kernel 3 in "
                       "the file, and of 4 channels and kernel 3 in the cache",
                       kvc::StateError);
  CHECK(c.get_num_free_blocks() == free);  // the load's blocks and slot went back
  CHECK(c.free_state_slots() == c.state_slots() - 1);
  CHECK(!c.find_request("q"));
  CHECK(states_of(c, "other") == other);
  CHECK(c.state_bytes() == state_bytes);  // no tensor of layer 3 was made

  // A request saved before any state was written loads unwritten; a model without states refuses
  // the file (its header names the layers with states).
  Cache d(hybrid_model(), blocks(8));
  REQUIRE(d.allocate_blocks(1, "fresh", 0));
  std::ostringstream os2;
  kvc::save_request(d, "fresh", os2);
  Cache e(hybrid_model(), blocks(8));
  std::istringstream in3(os2.str());
  kvc::load_request(e, "fresh", in3);
  CHECK(!e.has_previous_state("fresh", 0));
  auto plain = hybrid_model();
  plain.layer_types = std::vector<std::string>{"full_attention", "full_attention"};
  plain.num_hidden_layers = 2;
  Cache f(plain, blocks(8));
  std::istringstream in4(bytes);
  CHECK_THROWS_WITH_AS(kvc::load_request(f, "q", in4),
                       "kvc::load: request q: state_layers is 3 in the file and 0 in the cache", kvc::StateError);
}

TEST_CASE("PagedCache states: the memory planner sets the state slots' bytes aside") {
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.max_state_slots = 8;
  kvc::PagedMemoryBudget budget;
  budget.available_bytes = std::int64_t{1} << 22;
  budget.vocab_size = 64;
  budget.flash_attention = true;
  const std::int64_t without = Cache(hybrid_model(), cb, budget).num_blocks();
  budget.state_bytes_per_request = std::int64_t{1} << 16;
  const Cache planned(hybrid_model(), cb, budget);
  // What the planner plans from the budget less 8 slots of 64 KiB.
  kvc::PagedMemoryBudget less = budget;
  less.state_bytes_per_request = 0;
  less.available_bytes -= 8 * (std::int64_t{1} << 16);
  CHECK(planned.num_blocks() == Cache(hybrid_model(), cb, less).num_blocks());
  CHECK(planned.num_blocks() < without);
  CHECK(planned.state_slots() == 8);
  // A ring of 2 steps per slot: 3 more copies of a request's states each (8 x 4 x 64 KiB).
  kvc::ContinuousBatchingConfig ringed = cb;
  ringed.state_rollback_tokens = 2;
  less.available_bytes = budget.available_bytes - 8 * 4 * (std::int64_t{1} << 16);
  CHECK(Cache(hybrid_model(), ringed, budget).num_blocks() == Cache(hybrid_model(), cb, less).num_blocks());
  less.available_bytes -= 8 * (std::int64_t{1} << 16);
  CHECK(Cache(hybrid_model(), ringed, budget).num_blocks() != Cache(hybrid_model(), cb, less).num_blocks());
  // A model without states sets nothing aside.
  auto plain = hybrid_model();
  plain.layer_types = std::vector<std::string>{"full_attention", "full_attention"};
  plain.num_hidden_layers = 2;
  less.available_bytes = budget.available_bytes;
  CHECK(Cache(plain, cb, budget).num_blocks() == Cache(plain, cb, less).num_blocks());
  // More than the budget: transformers' MemoryError type, kvc's message.
  budget.state_bytes_per_request = std::int64_t{1} << 20;
  CHECK_THROWS_WITH_AS(
      Cache(hybrid_model(), cb, budget),
      "kvc::PagedCache: the state slots and snapshots need 8 x 1048576 bytes, more than the 4194304 available",
      kvc::MemoryError);
}

TEST_CASE("PagedCache states: a slot given back and taken again in one transaction, rolled back or committed") {
  Cache c(hybrid_model(), blocks(8, 1));
  c.reserve_swap_space(4, 1);
  REQUIRE(c.allocate_blocks(1, "r", 0));
  (void)c.update_conv_state(random_conv(1, 3, 3, 1), "r", 0, 0, 3);
  const auto r = states_of(c, "r");
  // r's slot goes to s and back: r reads its own states again.
  c.begin_transaction();
  c.free_blocks("r");
  REQUIRE(c.allocate_blocks(1, "s", 0));
  CHECK(c.state_slot("s") == 0);
  CHECK(!c.has_previous_state("s", 0));
  c.rollback_transaction();
  CHECK(states_of(c, "r") == r);
  // The same with r's swap state slot.
  REQUIRE(c.offload_request("r"));
  REQUIRE(c.allocate_blocks(1, "t", 0));
  c.begin_transaction();
  c.drop_offloaded_request("r");
  REQUIRE(c.offload_request("t"));
  c.rollback_transaction();
  c.free_blocks("t");
  REQUIRE(c.allocate_blocks(1, "r", 0));
  c.restore_request("r");
  CHECK(states_of(c, "r") == r);
  // A fork's copy into a slot that is then given back and taken again in the same transaction:
  // the new holder's writes stay.
  c.free_all_requests();
  Cache d(hybrid_model(), blocks(8, 2));
  REQUIRE(d.allocate_blocks(1, "a", 0));
  (void)d.update_conv_state(random_conv(1, 3, 3, 2), "a", 0, 0, 3);
  std::vector<std::vector<float>> e;
  d.transaction([&] {
    (void)d.fork_request("a", std::vector<std::string>{"f"});
    d.free_blocks("f");
    REQUIRE(d.allocate_blocks(1, "e", 0));
    (void)d.update_conv_state(random_conv(1, 3, 3, 3), "e", 0, 0, 3);
    e = states_of(d, "e");
  });
  CHECK(states_of(d, "e") == e);
  // The swap pool is not resized within a transaction.
  d.begin_transaction();
  CHECK_THROWS_WITH_AS(d.reserve_swap_space(2),
                       "kvc::PagedCache::reserve_swap_space: not in a transaction (its undo records point into the "
                       "pool)",
                       kvc::ValueError);
  d.rollback_transaction();
}

TEST_CASE("PagedCache states: a fork of a request given no blocks takes no slot") {
  Cache c(hybrid_model(), blocks(8, 2));
  CHECK(c.allocate_blocks(0, "r", 0));
  (void)c.fork_request("r", std::vector<std::string>{"d"});
  CHECK(c.state_slot("d") == -1);
  CHECK(c.free_state_slots() == 2);
}

TEST_CASE("PagedCache states: a load refused by its checksum or its values makes no state tensor") {
  Cache a(hybrid_model(), blocks(8));
  REQUIRE(a.allocate_blocks(1, "r", 0));
  Eigen::Tensor<float, 3, Eigen::RowMajor> rec(1, 2, 3);
  for (Eigen::Index i = 0; i < rec.size(); ++i) rec.data()[i] = static_cast<float>(i);
  (void)a.update_recurrent_state(rec, "r", 0);
  std::ostringstream os;
  kvc::save_request(a, "r", os);
  const std::string bytes = os.str();
  // The recurrent state's rank and shape: int64s 3, 1, 2, 3.
  std::string pattern;
  for (const std::int64_t v : {3, 1, 2, 3}) pattern.append(reinterpret_cast<const char*>(&v), sizeof v);
  const std::size_t at = bytes.find(pattern);
  REQUIRE(at != std::string::npos);
  const auto load_error = [](Cache& into, const std::string& file) {
    std::istringstream in(file);
    try {
      kvc::load_request(into, "q", in);
    } catch (const kvc::StateError& e) {
      return std::string(e.what());
    }
    return std::string("(no exception)");
  };
  Cache b(hybrid_model(), blocks(8));
  std::string swapped = bytes;  // [1, 3, 2]: consistent, but not what was written
  const std::int64_t three = 3, two = 2;
  swapped.replace(at + 16, 8, reinterpret_cast<const char*>(&three), 8);
  swapped.replace(at + 24, 8, reinterpret_cast<const char*>(&two), 8);
  CHECK(load_error(b, swapped).starts_with("kvc::load: the checksum does not match"));
  CHECK(b.state_bytes() == 0);
  CHECK(b.free_state_slots() == b.state_slots());
  std::string zero = bytes;
  const std::int64_t none = 0;
  zero.replace(at + 16, 8, reinterpret_cast<const char*>(&none), 8);
  CHECK(load_error(b, zero) == "kvc::load: request q: the saved state is inconsistent (a recurrent state's shape)");
  std::string huge = bytes;
  const std::int64_t big = std::int64_t{1} << 32;
  huge.replace(at + 16, 8, reinterpret_cast<const char*>(&big), 8);
  huge.replace(at + 24, 8, reinterpret_cast<const char*>(&big), 8);
  CHECK(load_error(b, huge) == "kvc::load: request q: the saved state is inconsistent (a recurrent state's shape)");
  CHECK(b.state_bytes() == 0);
  // The intact file loads, and the cache takes the file's shape then.
  CHECK(load_error(b, bytes) == "(no exception)");
  CHECK(values_of(b.recurrent_state("q", 0)) == values_of(a.recurrent_state("r", 0)));
  // With no state slot free the load says so.
  Cache full(hybrid_model(), blocks(8, 1));
  REQUIRE(full.allocate_blocks(1, "x", 0));
  CHECK(load_error(full, bytes) ==
        "kvc::load: request q: the request needs a state slot for its linear-attention states, and none is free");
}

TEST_CASE("PagedCache states: write_all_layers writes the attention layers and skips those with states only") {
  Cache c(hybrid_model(), blocks(8));
  REQUIRE(c.allocate_blocks(1, "r", 0));
  kvc::PagedIndices reads(1), writes(1);
  c.extend_read_and_write_indices("r", 0, 2, nullptr, writes);
  std::mt19937 rng(11);
  std::vector<kvc::HostTensor<float>> k, v;
  for (int l = 0; l < 4; ++l) {
    k.push_back(kvc_test::random_tensor<float>(1, 2, 2, 3, rng));
    v.push_back(kvc_test::random_tensor<float>(1, 2, 2, 3, rng));
  }
  std::vector<kvc::TensorView<float>> kv, vv;
  for (int l = 0; l < 4; ++l) {
    kv.push_back(Host::input_view(k[static_cast<std::size_t>(l)]));
    vv.push_back(Host::input_view(v[static_cast<std::size_t>(l)]));
  }
  c.write_all_layers(kv, vv, writes);
  for (const std::int64_t layer : {1, 2}) {  // the attention layers: their rows hold their tokens
    std::vector<float> got_k(12), got_v(12);
    c.read_rows(layer, writes[0], got_k.data(), got_v.data());
    const auto& want = k[static_cast<std::size_t>(layer)];
    CHECK(got_k == std::vector<float>(want.data(), want.data() + 12));
  }
  CHECK_THROWS_WITH_AS(c.write_all_layers(std::span(kv).first(3), std::span(vv).first(3), writes),
                       "kvc::PagedCache::write_all_layers: 3 keys and 3 values for 4 layers, and 1 write lists for "
                       "1 layer groups",
                       kvc::ValueError);
}

namespace {

kvc::ContinuousBatchingConfig snapshotting(std::int64_t num_blocks, std::int64_t slots, std::int64_t every,
                                           std::optional<std::int64_t> kept = std::nullopt) {
  kvc::ContinuousBatchingConfig c = blocks(num_blocks, slots);
  c.state_snapshot_interval = every;
  c.max_state_snapshots = kept;
  return c;
}
// Runs tokens [from, to) of `prompt` for request `id` as a step would: blocks for them, new conv
// columns and a new recurrent state in every state of every layer with states (drawn from `seed`),
// and the blocks they complete hashed.
void run_tokens(Cache& c, const std::string& id, const ids& prompt, std::int64_t from, std::int64_t to, unsigned seed) {
  const std::int64_t bs = c.block_size();
  const std::int64_t held = (from + bs - 1) / bs, need = (to + bs - 1) / bs;
  REQUIRE(c.allocate_blocks(need - held, id, held));
  unsigned k = seed;
  for (const std::int64_t l : state_layers)
    for (std::int64_t s = 0; s < c.states_per_layer(); ++s) {
      (void)c.update_conv_state(random_conv(1, 3, to - from, ++k), id, l, s, 3);
      (void)c.update_recurrent_state(random_conv(1, 2, 2, ++k), id, l, s);
    }
  c.mark_shareable_blocks_as_complete(id, to / bs - from / bs, prompt);
}

}  // namespace

TEST_CASE("PagedCache states: snapshots at block boundaries let a later prompt resume there") {
  Cache c(hybrid_model(1), snapshotting(40, 4, 8, 3));
  REQUIRE(c.use_prefix_sharing());
  CHECK(c.state_snapshot_interval() == 8);
  CHECK(c.max_state_snapshots() == 3);
  ids prompt(21);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int64_t>(100 + i);
  // Request a runs its prompt in chunks that end on the boundaries 8 and 16; the states after
  // each boundary are kept.
  std::map<std::int64_t, std::vector<std::vector<float>>> after;
  CHECK(c.match_prefix("a", prompt).tokens == 0);  // nothing cached yet: no blocks, no slot
  CHECK(c.state_slot("a") == -1);
  std::int64_t at = 0;
  for (const std::int64_t end : {8, 16, 21}) {
    run_tokens(c, "a", prompt, at, end, static_cast<unsigned>(end));
    CHECK(c.save_state_snapshot("a", ids(prompt.begin(), prompt.begin() + end)) == (end % 8 == 0));
    after[end] = states_of(c, "a");
    at = end;
  }
  CHECK(c.num_state_snapshots() == 2);
  CHECK(c.save_state_snapshot("a", ids(prompt.begin(), prompt.begin() + 16)));  // already held
  CHECK(c.num_state_snapshots() == 2);

  // b shares 18 tokens: its blocks 0..3 are cached, and the states after 16 tokens.
  ids b(prompt.begin(), prompt.begin() + 18);
  b.insert(b.end(), {7, 7, 7, 7, 7, 7, 7});
  const kvc::PagedPrefixMatch mb = c.match_prefix("b", b);
  CHECK(mb.attention_tokens == 16);
  CHECK(mb.state_tokens == 16);
  CHECK(mb.tokens == 16);
  CHECK(c.block_table(0, "b") ==
        std::vector<std::int64_t>(c.block_table(0, "a").begin(), c.block_table(0, "a").begin() + 4));
  CHECK(states_of(c, "b") == after[16]);
  CHECK(c.total_prefix_length() == 16);

  // A prompt of exactly 16 cached tokens resumes from 8: its last token must run (its logits
  // start the generation).
  const ids d(prompt.begin(), prompt.begin() + 16);
  const kvc::PagedPrefixMatch md = c.match_prefix("d", d);
  CHECK(md.attention_tokens == 12);
  CHECK(md.tokens == 8);
  CHECK(states_of(c, "d") == after[8]);

  // Eviction: the least recently used snapshot makes room, and a match counts as a use.
  c.free_blocks("d");
  for (int round = 0; round < 3; ++round) {
    const std::string id = "x" + std::to_string(round);
    const ids other(8, 900 + round);
    run_tokens(c, id, other, 0, 8, 50u + static_cast<unsigned>(round));
    CHECK(c.save_state_snapshot(id, other));
    c.free_blocks(id);  // (its blocks stay cached)
    if (round == 0) {   // the snapshot at 8 is used again: the one at 16 is now the oldest
      CHECK(c.match_prefix("keep8", ids(prompt.begin(), prompt.begin() + 9)).tokens == 8);
      c.free_blocks("keep8");
    }
  }
  CHECK(c.num_state_snapshots() == 3);  // 8, x1, x2 (16 went first, then x0)
  const kvc::PagedPrefixMatch me = c.match_prefix("e", prompt);
  CHECK(me.attention_tokens == 20);
  CHECK(me.state_tokens == 8);
  CHECK(me.tokens == 8);
  CHECK(states_of(c, "e") == after[8]);
  // Cached blocks without a snapshot are no match: the request is given nothing.
  ids f(8, 900);
  f.push_back(1);
  const auto before = kvc_test::take_paged_snapshot(c, {"a", "b", "e", "f"});
  const kvc::PagedPrefixMatch mf = c.match_prefix("f", f);
  CHECK(mf.attention_tokens == 8);
  CHECK(mf.state_tokens == 0);
  CHECK(mf.tokens == 0);
  CHECK(!c.find_request("f"));
  CHECK(kvc_test::take_paged_snapshot(c, {"a", "b", "e", "f"}) == before);
}

TEST_CASE("PagedCache states: snapshots and their refusals, slots, transactions and the models that keep none") {
  ids prompt(12);
  for (std::size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<std::int64_t>(i + 1);
  SUBCASE("a match needs a free state slot; in a transaction a rollback takes the states back") {
    Cache c(hybrid_model(1), snapshotting(16, 2, 4));
    CHECK(c.max_state_snapshots() == 2);  // unset: as many as the state slots
    run_tokens(c, "a", prompt, 0, 4, 1);
    REQUIRE(c.save_state_snapshot("a", ids(prompt.begin(), prompt.begin() + 4)));
    const auto four = states_of(c, "a");
    run_tokens(c, "a", prompt, 4, 8, 2);
    REQUIRE(c.allocate_blocks(1, "full", 0));  // the last free slot
    const auto before = kvc_test::take_paged_snapshot(c, {"a", "b", "full"});
    const kvc::PagedPrefixMatch m = c.match_prefix("b", prompt);
    CHECK(m.attention_tokens == 8);
    CHECK(m.state_tokens == 4);
    CHECK(m.tokens == 0);
    CHECK(kvc_test::take_paged_snapshot(c, {"a", "b", "full"}) == before);
    c.free_blocks("full");
    // Rolled back: nothing; committed: b holds the blocks and the states.
    c.begin_transaction();
    CHECK(c.match_prefix("b", prompt).tokens == 4);
    c.rollback_transaction();
    CHECK(!c.find_request("b"));
    CHECK(c.free_state_slots() == 1);
    c.begin_transaction();
    CHECK(c.match_prefix("b", prompt).tokens == 4);
    CHECK(states_of(c, "b") == four);  // copied at once
    CHECK_THROWS_WITH_AS((void)c.save_state_snapshot("a", ids(prompt.begin(), prompt.begin() + 8)),
                         "kvc::PagedCache::save_state_snapshot: not in a transaction (a snapshot is kept outside the "
                         "undo log)",
                         kvc::ValueError);
    c.commit_transaction();
    CHECK(states_of(c, "b") == four);
    // What is not kept: a length off the interval, a request without a slot; an unknown request
    // is refused.
    CHECK(!c.save_state_snapshot("a", ids(prompt.begin(), prompt.begin() + 6)));
    CHECK(!c.save_state_snapshot("a", ids{}));
    (void)c.open_request("slotless");
    CHECK(!c.save_state_snapshot("slotless", ids(prompt.begin(), prompt.begin() + 4)));
    CHECK_THROWS_WITH_AS((void)c.save_state_snapshot("nobody", ids(prompt.begin(), prompt.begin() + 4)),
                         "No block table found for request nobody", kvc::ValueError);
    CHECK(c.num_state_snapshots() == 1);
    // A match starts a table: a request with blocks is refused, with nothing changed.
    CHECK_THROWS_WITH_AS((void)c.match_prefix("a", prompt),
                         "kvc::paged: request a already has blocks; a prefix match starts a table", kvc::ValueError);
    CHECK(c.free_state_slots() == 0);
  }
  SUBCASE("the interval is a multiple of the block size; models with sliding layers keep none") {
    CHECK_THROWS_WITH_AS(Cache(hybrid_model(1), snapshotting(16, 2, 6)),
                         "kvc::PagedCache: state_snapshot_interval must be 0 or a positive multiple of block_size "
                         "(4), got 6",
                         kvc::ValueError);
    CHECK_THROWS_WITH_AS(Cache(hybrid_model(1), snapshotting(16, 2, -4)),
                         "kvc::PagedCache: state_snapshot_interval must be 0 or a positive multiple of block_size "
                         "(4), got -4",
                         kvc::ValueError);
    kvc::ContinuousBatchingConfig negative = snapshotting(16, 2, 4);
    negative.max_state_snapshots = -1;
    CHECK_THROWS_WITH_AS(Cache(hybrid_model(1), negative),
                         "kvc::PagedCache: max_state_snapshots must be 0 or more, got -1", kvc::ValueError);
    kvc::ContinuousBatchingConfig huge = snapshotting(16, 2, 4);
    huge.max_state_snapshots = kvc::max_extent;  // allowed alone, too many with the 2 slots
    CHECK_THROWS_WITH_AS(Cache(hybrid_model(1), huge),
                         "kvc::PagedCache: max_state_slots + max_state_snapshots is 1099511627778, above kvc's limit "
                         "of 1099511627776",
                         kvc::ValueError);
    kvc::ModelConfig sliding = hybrid_model(1);
    sliding.layer_types = std::vector<std::string>{"linear_attention", "full_attention", "sliding_attention", "conv"};
    sliding.sliding_window = 8;
    const Cache s(sliding, snapshotting(16, 2, 4));
    CHECK(s.state_snapshot_interval() == 0);
    CHECK(s.max_state_snapshots() == 0);
    CHECK(!s.use_prefix_sharing());
    kvc::ContinuousBatchingConfig no_sharing = snapshotting(16, 2, 4);
    no_sharing.allow_block_sharing = false;
    CHECK(Cache(hybrid_model(1), no_sharing).max_state_snapshots() == 0);
    const Cache off(hybrid_model(1), blocks(16, 2));
    CHECK(!off.use_prefix_sharing());
  }
  SUBCASE("the memory planner counts the snapshots") {
    kvc::PagedMemoryBudget budget;
    budget.available_bytes = std::int64_t{1} << 24;
    budget.vocab_size = 16;
    budget.state_bytes_per_request = 1 << 20;
    kvc::ContinuousBatchingConfig cb = snapshotting(16, 8, 4, 9);
    cb.num_blocks.reset();
    CHECK_THROWS_WITH_AS(Cache(hybrid_model(1), cb, budget),
                         "kvc::PagedCache: the state slots and snapshots need 17 x 1048576 bytes, more than the "
                         "16777216 available",
                         kvc::MemoryError);
    cb.max_state_snapshots = 7;
    const Cache fits(hybrid_model(1), cb, budget);
    CHECK(fits.max_state_snapshots() == 7);
  }
}

TEST_CASE("PagedCache states: the example of docs/paged.md on state snapshots") {
  const ids prompt = {5, 6, 7, 8, 9, 10, 11, 12, 13};
  // [snippet:state_snapshots]
  Cache cache(hybrid_model(1), snapshotting(/*num_blocks*/ 16, /*state slots*/ 2, /*interval*/ 4));
  run_tokens(cache, "a", prompt, 0, 4, 1);  // a's first 4 tokens: one complete block, its states
  REQUIRE(cache.save_state_snapshot("a", std::span(prompt).first(4)));
  run_tokens(cache, "a", prompt, 4, 8, 2);
  // b starts with a's 8 tokens
  const kvc::PagedPrefixMatch m = cache.match_prefix("b", prompt);
  CHECK(m.attention_tokens == 8);  // cached blocks
  CHECK(m.state_tokens == 4);      // the last snapshot
  CHECK(m.tokens == 4);            // what b reuses: the longest prefix both can resume from
  // [/snippet]
  CHECK(cache.block_table(0, "b").size() == 1);
  CHECK(cache.has_previous_state("b", 0));
}

TEST_CASE("PagedCache states: copies chained in one transaction, in every order, and rolled back") {
  // Copies of states happen at once (the destination saved first, for a rollback), so a chain of
  // them in one transaction reads what each link wrote, whatever is given back and taken again.
  kvc::ModelConfig config = hybrid_model(1);
  Cache c(config, snapshotting(16, 4, 4));
  c.reserve_swap_space(8, 2);
  const ids prompt = {1, 2, 3, 4, 5, 6};
  run_tokens(c, "a", prompt, 0, 4, 7);
  REQUIRE(c.save_state_snapshot("a", std::span(prompt).first(4)));
  const auto four = states_of(c, "a");
  // p resumes from the snapshot, is offloaded, and its slot goes to q, in one transaction.
  c.begin_transaction();
  REQUIRE(c.match_prefix("p", prompt).tokens == 4);
  const std::int64_t slot = c.state_slot("p");
  REQUIRE(c.offload_request("p"));
  CHECK_THROWS_WITH_AS((void)c.match_prefix("p", prompt),
                       "kvc::paged: request p is offloaded; a prefix match starts a table (restore or drop it first)",
                       kvc::ValueError);
  REQUIRE(c.allocate_blocks(1, "q", 0));
  CHECK(c.state_slot("q") == slot);
  c.commit_transaction();
  CHECK(!c.has_previous_state("q", 0));  // a slot taken again reads as never written
  c.free_blocks("q");
  REQUIRE(c.allocate_blocks(1, "p", 0));
  c.restore_request("p");
  CHECK(states_of(c, "p") == four);
  // A fork of a fork whose source's slot was given back and refilled in between.
  c.free_blocks("a");
  run_tokens(c, "t", ids{40, 41, 42, 43}, 0, 4, 11);
  const auto t = states_of(c, "t");
  c.transaction([&] {
    (void)c.fork_request("p", std::vector<std::string>{"r"});
    c.free_blocks("p");
    (void)c.fork_request("t", std::vector<std::string>{"u"});  // u takes p's slot
    (void)c.fork_request("r", std::vector<std::string>{"r2"});
  });
  CHECK(states_of(c, "r2") == four);
  CHECK(states_of(c, "u") == t);
  // Restored, a request's swap slot is taken by another offload, and it is offloaded again.
  c.free_all_requests();
  run_tokens(c, "a", prompt, 0, 4, 7);
  run_tokens(c, "b", ids{50, 51, 52, 53}, 0, 4, 13);
  const auto b = states_of(c, "b");
  REQUIRE(c.offload_request("a"));
  REQUIRE(c.allocate_blocks(1, "a", 0));
  c.transaction([&] {
    c.restore_request("a");
    REQUIRE(c.offload_request("b"));
    REQUIRE(c.offload_request("a"));
  });
  REQUIRE(c.allocate_blocks(1, "a", 0));
  c.restore_request("a");
  CHECK(states_of(c, "a") == four);
  REQUIRE(c.allocate_blocks(1, "b", 0));
  c.restore_request("b");
  CHECK(states_of(c, "b") == b);
  // A fork's source given back, its slot taken and written in the same transaction: the fork has
  // the source's states; rolled back instead, everything is as before.
  c.transaction([&] {
    (void)c.fork_request("a", std::vector<std::string>{"f"});
    c.free_blocks("a");
    REQUIRE(c.allocate_blocks(1, "g", 0));
    (void)c.update_recurrent_state(random_conv(1, 2, 2, 21), "g", 0);
  });
  CHECK(states_of(c, "f") == four);
  const auto before = kvc_test::take_paged_snapshot(c, {"b", "f", "g", "h"});
  c.begin_transaction();
  (void)c.fork_request("f", std::vector<std::string>{"h"});
  c.free_blocks("f");
  (void)c.fork_request("b", std::vector<std::string>{"i"});  // i takes f's slot: f's states are saved
  c.rollback_transaction();
  CHECK(kvc_test::take_paged_snapshot(c, {"b", "f", "g", "h"}) == before);
  // A match on a request that holds blocks is refused, snapshot or not.
  CHECK_THROWS_WITH_AS((void)c.match_prefix("f", ids{9, 9, 9, 9, 9}),
                       "kvc::paged: request f already has blocks; a prefix match starts a table", kvc::ValueError);
}

TEST_CASE("PagedCache states: rollback_request takes states back through their rings") {
  kvc::ContinuousBatchingConfig cb = blocks(8, 2);
  cb.state_rollback_tokens = 3;
  Cache c(hybrid_model(), cb);
  CHECK(c.state_rollback_tokens() == 3);
  REQUIRE(c.allocate_blocks(2, "a", 0));
  // One token a step: every state with states of its own (conv column, recurrent state).
  Eigen::Tensor<float, 2, Eigen::RowMajor> rec(1, 4);
  const auto token = [&](const std::string& id, unsigned t) {
    for (const std::int64_t l : state_layers)
      for (std::int64_t s = 0; s < 2; ++s) {
        (void)c.update_conv_state(random_conv(1, 3, 1, 10 * t + static_cast<unsigned>(l + s)), id, l, s, 2);
        for (Eigen::Index i = 0; i < rec.size(); ++i) rec.data()[i] = static_cast<float>(t * 100 + i);
        (void)c.update_recurrent_state(rec, id, l, s);
      }
  };
  std::vector<std::vector<std::vector<float>>> after;  // the states after 0, 1, ... tokens
  after.push_back(states_of(c, "a"));
  for (unsigned t = 1; t <= 6; ++t) {
    token("a", t);
    after.push_back(states_of(c, "a"));
  }
  // Back 2 of the 6 tokens, then 1 more: the states after 4, then 3 tokens; the ring held 3.
  CHECK(c.state_rollback_depth("a") == 3);
  CHECK(c.rollback_request("a", 4, 2));
  CHECK(c.state_rollback_depth("a") == 1);
  CHECK(states_of(c, "a") == after[4]);
  CHECK(c.blocks_in_group(0, "a") == 1);
  CHECK(c.rollback_request("a", 3, 1));
  CHECK(states_of(c, "a") == after[3]);
  const auto held = kvc_test::take_paged_snapshot(c, {"a"});
  CHECK(c.state_rollback_depth("a") == 0);
  CHECK_FALSE(c.rollback_request("a", 2, 1));  // the ring is spent: nothing changes
  CHECK(kvc_test::take_paged_snapshot(c, {"a"}) == held);
  // New steps fill it again; in a transaction the rollback puts states and ring back.
  token("a", 7);
  token("a", 8);
  const auto at5 = states_of(c, "a");
  c.begin_transaction();
  CHECK(c.rollback_request("a", 3, 2));
  CHECK(states_of(c, "a") == after[3]);
  c.rollback_transaction();
  CHECK(states_of(c, "a") == at5);
  CHECK(c.rollback_request("a", 4, 1));
  CHECK(c.rollback_request("a", 3, 1));
  CHECK(states_of(c, "a") == after[3]);
  // A step of several tokens empties the ring, and so does a recurrent update without a conv
  // step before it: neither can be taken back by tokens.
  (void)c.update_conv_state(random_conv(1, 3, 2, 77), "a", 0, 0, 2);
  CHECK_FALSE(c.rollback_request("a", 2, 1));
  token("a", 9);
  CHECK(c.rollback_request("a", 3, 1));
  token("a", 10);
  (void)c.update_recurrent_state(rec, "a", 2, 1);
  CHECK_FALSE(c.rollback_request("a", 3, 1));
  // States copied onto a request replace its ring's history; a request with none written, or no
  // tokens to take back, is cut as truncate_request cuts.
  REQUIRE(c.allocate_blocks(1, "b", 0));
  CHECK(c.state_rollback_depth("b") == kvc::max_extent);  // nothing written
  CHECK(c.rollback_request("b", 1, 2));
  token("b", 11);
  c.copy_states("a", "b");
  CHECK_FALSE(c.rollback_request("b", 0, 1));
  CHECK(c.rollback_request("b", 1, 0));
  CHECK_THROWS_WITH_AS(c.rollback_request("b", 1, -1),
                       "kvc::PagedCache::rollback_request: removed must be 0 or more, got -1", kvc::ValueError);
  // Two steps in a transaction after a rollback write ring rows the ring counted before it: they are
  // saved, so that the transaction's rollback leaves a ring that still takes tokens back exactly.
  {
    Cache t(hybrid_model(), cb);
    REQUIRE(t.allocate_blocks(2, "a", 0));
    std::vector<std::vector<std::vector<float>>> seen{states_of(t, "a")};
    const auto one = [&](unsigned n) {
      for (const std::int64_t l : state_layers)
        for (std::int64_t st = 0; st < 2; ++st) {
          (void)t.update_conv_state(random_conv(1, 3, 1, n + static_cast<unsigned>(l + st)), "a", l, st, 2);
          for (Eigen::Index i = 0; i < rec.size(); ++i) rec.data()[i] = static_cast<float>(n + i);
          (void)t.update_recurrent_state(rec, "a", l, st);
        }
    };
    for (unsigned n = 1; n <= 4; ++n) {
      one(n);
      seen.push_back(states_of(t, "a"));
    }
    t.begin_transaction();
    CHECK(t.rollback_request("a", 2, 2));
    one(50);
    one(60);
    t.rollback_transaction();
    CHECK(t.rollback_request("a", 3, 1));
    CHECK(states_of(t, "a") == seen[3]);
    // A token whose step gives one state a conv update only rolls back too.
    const auto before = states_of(t, "a");
    for (const std::int64_t l : state_layers)
      for (std::int64_t st = 0; st < 2; ++st) {
        (void)t.update_conv_state(random_conv(1, 3, 1, 90), "a", l, st, 2);
        if (l != 3 || st != 0) (void)t.update_recurrent_state(rec, "a", l, st);
      }
    CHECK(states_of(t, "a") != before);
    CHECK(t.rollback_request("a", 4, 1));
    CHECK(states_of(t, "a") == before);
    // Not for tokens 0 (free_blocks gives everything back), nor for an offloaded request.
    CHECK_FALSE(t.rollback_request("a", 0, 1));
    CHECK(t.state_slot("a") >= 0);
    t.reserve_swap_space(4);
    REQUIRE(t.offload_request("a"));
    CHECK(t.state_rollback_depth("a") == 0);
    CHECK_FALSE(t.rollback_request("a", 3, 1));
  }
  // Without a ring (the default) a written state cannot be taken back.
  Cache plain(hybrid_model(), blocks(8, 2));
  REQUIRE(plain.allocate_blocks(1, "a", 0));
  (void)plain.update_conv_state(random_conv(1, 3, 1), "a", 0, 0, 2);
  CHECK_FALSE(plain.rollback_request("a", 0, 1));
  // The ring's rows are planned and checked with the slots.
  cb.state_rollback_tokens = -1;
  CHECK_THROWS_WITH_AS(Cache(hybrid_model(), cb), "kvc::PagedCache: state_rollback_tokens must be 0 or more, got -1",
                       kvc::ValueError);
  cb.state_rollback_tokens = (std::int64_t{1} << 20) + 1;
  CHECK_THROWS_WITH_AS(Cache(hybrid_model(), cb),
                       "kvc::PagedCache: state_rollback_tokens is 1048577, above kvc's limit of 1048576",
                       kvc::ValueError);
  cb.state_rollback_tokens = std::int64_t{1} << 20;
  cb.max_state_slots = std::int64_t{1} << 21;
  CHECK_THROWS_WITH_AS(
      Cache(hybrid_model(), cb),
      "kvc::PagedCache: max_state_slots x (state_rollback_tokens + 1) state rows are above kvc's limit",
      kvc::ValueError);
  CHECK(c.state_pools().slots() == 2 * (1 + 4));  // 2 slots, each with its own row and a ring of 4
  CHECK(plain.state_pools().slots() == 2);
}
