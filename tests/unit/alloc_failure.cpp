// Allocation failures: a replacement operator new fails the N-th allocation, for N = 0, 1, 2, ...,
// during each operation of a sequence, over every cache kind. After each failure the cache must
// be exactly as it was before the call (the strong guarantee, docs/errors.md); an operation that
// absorbs a failure (a warning dropped, a prefetch thread not started) must end as it does when
// nothing fails. The replacement counts every thread's allocations, so one on OffloadToFile's
// prefetch thread would fail too (and end the process if it escaped the thread).

#include <array>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <kvc/fp8_attention.hpp>
#include <kvc/kvc.hpp>
#include <kvc/paged/paged_batch_cache.hpp>
#include <kvc/quantized_attention.hpp>

#include "../support/kvc_test.hpp"
#include "../support/failing_allocator.hpp"
#include "../support/paged_snapshot.hpp"
#include "../support/sanitized.hpp"
#include "../support/scheduler_model.hpp"
#include "../support/toy_model.hpp"

// ---- scenarios ---------------------------------------------------------------------------------

namespace {

using kvc_test::random_tensor;
using Host = kvc::HostStorage<float>;
using T3 = Eigen::Tensor<float, 3, Eigen::RowMajor>;
using T2 = Eigen::Tensor<float, 2, Eigen::RowMajor>;

constexpr std::int64_t batch = 2, heads = 2, head_dim = 4;

kvc::HostTensor<float> tokens(std::int64_t q, unsigned seed) {
  std::mt19937 rng(seed);
  return random_tensor<float>(batch, heads, q, head_dim, rng);
}
T3 conv_input(std::int64_t time, unsigned seed) {
  T3 x(batch, 3, time);
  for (std::int64_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>((seed * 7 + i) % 13) - 6.0f;
  return x;
}
T2 recurrent_input(unsigned seed) {
  T2 x(batch, 5);
  for (std::int64_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>((seed * 5 + i) % 11) - 5.0f;
  return x;
}
T3 indexer_input(std::int64_t q, unsigned seed) {
  T3 x(batch, q, 2);
  for (std::int64_t i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>((seed * 3 + i) % 17) - 8.0f;
  return x;
}

// What a caller can observe of a cache (every layer brought back into memory first, so that where
// an offloaded layer's bytes are does not count).
// A cache that can roll back also shows what a crop by its depth (at most 4) leaves: the rings and
// slack a failed call must not have touched either.
template <class C>
kvc_test::snapshot observe(C& c) {
  c.make_resident(-1);
  kvc_test::snapshot s = kvc_test::take_snapshot(c);
  if constexpr (requires { c.rollback_depth(); } && C::can_crop) {
    const std::int64_t depth = std::min<std::int64_t>(c.rollback_depth(), 4);
    if (depth > 0) {
      C rolled = c;
      rolled.crop(-depth);
      for (auto& layer : kvc_test::take_snapshot(rolled).layers) s.layers.push_back(std::move(layer));
    }
  }
  return s;
}
template <class S, class X>
std::pair<std::pair<kvc_test::snapshot, kvc_test::snapshot>, std::map<std::int64_t, bool>> observe(
    kvc::EncoderDecoderCache<S, X>& c) {
  return {{observe(c.self_attention_cache()), observe(c.cross_attention_cache())}, c.is_updated()};
}

template <class C>
struct op {
  std::string name;
  std::function<void(C&)> run;
};

template <class C>
struct scenario {
  std::string name;
  std::function<C()> make;
  std::vector<op<C>> ops;
};

// For every op k and every N until op k runs without reaching its N-th allocation: replays ops
// [0, k) on a fresh cache, fails allocation N during op k, and compares with the cache as it was
// (replayed again: observing an offloaded cache brings its layers back, which would change the
// paths op k takes).
template <class C>
void check_every_failure(const scenario<C>& s) {
  std::int64_t failures = 0;
  for (std::size_t k = 0; k < s.ops.size(); ++k) {
    for (std::int64_t n = 0;; ++n) {
      C before = s.make();
      for (std::size_t j = 0; j < k; ++j) s.ops[j].run(before);
      const auto expected_before = observe(before);
      C cache = s.make();
      for (std::size_t j = 0; j < k; ++j) s.ops[j].run(cache);
      bool threw = false;
      std::string what;
      arm(n);
      try {
        s.ops[k].run(cache);
      } catch (const std::bad_alloc&) {
        threw = true;
      } catch (const std::exception& e) {
        disarm();
        what = e.what();
      }
      const bool failed = disarm();
      CAPTURE(s.name);
      CAPTURE(s.ops[k].name);
      CAPTURE(n);
      CAPTURE(what);
      REQUIRE(what.empty());  // only the injected failure may stop an op
      if (!failed) {
        CHECK_FALSE(threw);
        break;
      }
      ++failures;
      if (threw) {
        CHECK(observe(cache) == expected_before);
      } else {  // absorbed: the op must end as it does without a failure
        C reference = s.make();
        for (std::size_t j = 0; j <= k; ++j) s.ops[j].run(reference);
        CHECK(observe(cache) == observe(reference));
      }
    }
  }
  MESSAGE(s.name << ": " << failures << " injected failures over " << s.ops.size() << " operations");
  CHECK(failures > 0);
}

// The ops of a mixed config layout: K/V updates of the attention layers, linear states, indexer
// keys, then the whole-cache operations given.
template <class C>
std::vector<op<C>> layer_ops(const std::vector<std::string>& types, std::int64_t prefill, std::int64_t decodes) {
  std::vector<op<C>> ops;
  auto add_step = [&](std::int64_t q, unsigned seed) {
    for (std::size_t i = 0; i < types.size(); ++i) {
      const auto layer = static_cast<std::int64_t>(i);
      const std::string& t = types[i];
      const std::string at = std::to_string(i) + " (" + t + "), q=" + std::to_string(q);
      const bool linear = t == "linear_attention" || t == "hybrid" || t == "hybrid_sliding";
      if (linear) {
        ops.push_back(
            {"update_conv_state " + at, [=](C& c) { c.update_conv_state(conv_input(q, seed), layer, 0, 4); }});
        ops.push_back(
            {"update_recurrent_state " + at, [=](C& c) { c.update_recurrent_state(recurrent_input(seed), layer); }});
      }
      if (t != "linear_attention")
        ops.push_back({"update " + at, [=](C& c) {
                         const auto k = tokens(q, seed + static_cast<unsigned>(i)), v = tokens(q, seed + 100);
                         c.update(k, v, layer);
                       }});
      if (t == "deepseek_sparse_attention")
        ops.push_back({"update_indexer " + at, [=](C& c) { c.update_indexer(indexer_input(q, seed), layer); }});
    }
  };
  add_step(prefill, 1);
  for (std::int64_t d = 0; d < decodes; ++d) add_step(1, 10 + static_cast<unsigned>(d));
  return ops;
}

template <class C>
void add_dynamic_ops(std::vector<op<C>>& ops, std::int64_t crop = -2) {
  ops.push_back({"crop(" + std::to_string(crop) + ")", [crop](C& c) { c.crop(crop); }});
  ops.push_back({"reorder_cache({1, 0})", [](C& c) { c.reorder_cache({1, 0}); }});
  ops.push_back({"batch_repeat_interleave(2)", [](C& c) { c.batch_repeat_interleave(2); }});
  ops.push_back({"batch_select_indices({3, 0})", [](C& c) { c.batch_select_indices({3, 0}); }});
  ops.push_back({"reserve(40)", [](C& c) { c.reserve(40); }});
}
// Copy assignment from another cache of the kind (`make()` with its first `layers` layers updated,
// built once, outside the failing window) and reset.
template <class C>
void add_common_ops(std::vector<op<C>>& ops, const std::function<C()>& make, std::int64_t layers = 1) {
  auto source = std::make_shared<C>(make());
  for (std::int64_t i = 0; i < layers; ++i) source->update(tokens(2, 3), tokens(2, 4), i);
  ops.push_back({"copy assignment", [source](C& c) { c = *source; }});
  ops.push_back({"reset", [](C& c) { c.reset(); }});
}

const std::vector<std::string> dynamic_types{"full_attention", "sliding_attention", "linear_attention",
                                             "hybrid",         "hybrid_sliding",    "deepseek_sparse_attention"};

kvc::ModelConfig config_of(const std::vector<std::string>& types) {
  kvc::ModelConfig c;
  c.num_hidden_layers = static_cast<std::int64_t>(types.size());
  c.num_attention_heads = heads;
  c.num_key_value_heads = heads;
  c.head_dim = head_dim;
  c.hidden_size = heads * head_dim;
  c.sliding_window = 3;
  c.layer_types = types;
  return c;
}

// ---- the paged cache: its bookkeeping (block manager, tables, swap pool) and one dense batch ----

// A PagedCache and the index lists a caller keeps for it.
struct paged_rig {
  kvc::PagedCache<Host> cache;
  kvc::PagedIndices reads, writes;
};
// A PagedBatchCache (the scenarios take a struct of this file).
struct batch_rig {
  kvc::PagedBatchCache<Host> cache;
};

kvc::ModelConfig paged_model(const std::vector<std::string>& types) {
  kvc::ModelConfig c = config_of(types);
  c.sliding_window = 5;
  return c;
}
kvc::ContinuousBatchingConfig paged_blocks(std::int64_t num_blocks) {
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = num_blocks;
  return cb;
}

// A step of q tokens of `request` after `past`: its index lists (kept in the rig), then one
// update per layer (each call on its own, as the strong guarantee is per call).
void add_paged_step(std::vector<op<paged_rig>>& ops, const std::string& request, std::int64_t past, std::int64_t q,
                    bool read) {
  const std::string at = request + " past " + std::to_string(past) + " q " + std::to_string(q);
  ops.push_back({"indices " + at, [=](paged_rig& r) {
                   kvc::PagedIndices reads(static_cast<std::size_t>(r.cache.num_groups())), writes(reads.size());
                   r.cache.extend_read_and_write_indices(request, past, q, read ? &reads : nullptr, writes);
                   r.reads = std::move(reads);
                   r.writes = std::move(writes);
                 }});
  for (std::int64_t layer = 0; layer < 2; ++layer)
    ops.push_back({"update " + at + " layer " + std::to_string(layer), [=](paged_rig& r) {
                     std::mt19937 rng(static_cast<unsigned>(past * 31 + q + layer));
                     const auto k = random_tensor<float>(1, heads, q, head_dim, rng);
                     r.cache.update(Host::input_view(k), Host::input_view(k), layer, r.reads, r.writes);
                   }});
}

// The paged bookkeeping's invariants: every block is free (once) or held, and a held block's
// reference count is the number of tables that list it. Returns a description of the first
// violation, or an empty string.
std::string paged_invariants(const kvc::PagedCache<Host>& c) {
  const kvc::paged::BlockManager& m = c.manager();
  std::vector<std::int64_t> held(static_cast<std::size_t>(c.num_blocks()), 0), free(held.size(), 0);
  for (std::int64_t g = 0; g < c.num_groups(); ++g)
    for (const std::string& r : c.block_tables().requests(g))
      for (const std::int64_t b : c.block_table(g, r)) ++held.at(static_cast<std::size_t>(b));
  for (const std::int64_t b : m.uninitialized_blocks()) ++free.at(static_cast<std::size_t>(b));
  for (const std::int64_t b : m.initialized_blocks()) ++free.at(static_cast<std::size_t>(b));
  if (static_cast<std::int64_t>(m.uninitialized_blocks().size() + m.initialized_blocks().size()) !=
      c.get_num_free_blocks())
    return "the free count is not the free lists' size";
  for (std::size_t b = 0; b < held.size(); ++b) {
    const std::string at = "block " + std::to_string(b) + ": ";
    if (held[b] > 0 && free[b] > 0) return at + "held and free";
    if (held[b] == 0 && free[b] != 1) return at + "neither held nor free once";
    // A shareable block counts its holders; another (a sliding ring's) has exactly one.
    const kvc::paged::Block* block = m.block(static_cast<std::int64_t>(b));
    if (held[b] > 0 && (block ? block->ref_count != held[b] : held[b] != 1))
      return at + "its reference count is not the number of tables holding it";
  }
  return {};
}

// For every op and every N, an allocation failure leaves the cache as it was (compared through
// `observe`) where `strong(op)`, and for the other ops the basic guarantee: the invariants above
// hold and the cache is usable (`recover` gives every block back).
template <class C, class Observe>
void check_paged_failures(const scenario<C>& s, const std::function<const kvc::PagedCache<Host>&(C&)>& pages,
                          const std::function<void(C&)>& recover, const std::function<bool(const std::string&)>& strong,
                          Observe observe) {
  std::int64_t failures = 0;
  for (std::size_t k = 0; k < s.ops.size(); ++k) {
    for (std::int64_t n = 0;; ++n) {
      C cache = s.make();
      for (std::size_t j = 0; j < k; ++j) s.ops[j].run(cache);
      const auto before = observe(cache);
      arm(n);
      bool threw = false;
      try {
        s.ops[k].run(cache);
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      const bool failed = disarm();
      CAPTURE(s.name);
      CAPTURE(s.ops[k].name);
      CAPTURE(n);
      if (!failed) break;
      ++failures;
      CHECK(threw);
      CHECK(paged_invariants(pages(cache)) == "");
      if (strong(s.ops[k].name)) CHECK(observe(cache) == before);
      recover(cache);
      CHECK(pages(cache).get_num_free_blocks() == pages(cache).num_blocks());
    }
  }
  MESSAGE(s.name << ": " << failures << " injected failures over " << s.ops.size() << " operations");
  CHECK(failures > 0);
}

}  // namespace

TEST_CASE("PagedCache: allocation, indices, prefix sharing, forks and request offload") {
  for (const bool hybrid : {false, true}) {
    using C = paged_rig;
    const std::vector<std::string> types = hybrid ? std::vector<std::string>{"sliding_attention", "full_attention"}
                                                  : std::vector<std::string>{"full_attention", "full_attention"};
    const auto make = [types] {
      C r{kvc::PagedCache<Host>(paged_model(types), paged_blocks(16)), {}, {}};
      r.cache.reserve_swap_space(6);
      return r;
    };
    const std::vector<std::int64_t> prompt = {1, 2, 3, 4, 5, 6, 7};
    scenario<C> s{hybrid ? "PagedCache (sliding + full)" : "PagedCache (full)", make, {}};
    s.ops.push_back({"allocate a", [](C& r) { (void)r.cache.allocate_blocks(2, "a", 0); }});
    add_paged_step(s.ops, "a", 0, 7, false);
    s.ops.push_back({"mark a complete", [=](C& r) { r.cache.mark_shareable_blocks_as_complete("a", 1, prompt); }});
    s.ops.push_back({"prefix match b", [=](C& r) { (void)r.cache.search_prefix_match("b", prompt); }});
    s.ops.push_back({"allocate b", [](C& r) {
                       const std::int64_t held = r.cache.blocks_in_use("b");
                       (void)r.cache.allocate_blocks(2 - held, "b", held);
                     }});
    s.ops.push_back({"allocate c and d together", [](C& r) {
                       const std::vector<std::string> both = {"c", "d"};
                       (void)r.cache.allocate_blocks(1, both);
                     }});
    add_paged_step(s.ops, "b", 4, 3, true);
    s.ops.push_back({"update_rows of b", [](C& r) {
                       const auto g = static_cast<std::size_t>(r.cache.layer_group(1).first);
                       std::mt19937 rng(5);
                       const auto k = random_tensor<float>(1, heads, 3, head_dim, rng);
                       std::vector<float> out(static_cast<std::size_t>(heads * head_dim) * r.reads[g].size());
                       r.cache.update_rows(Host::input_view(k), Host::input_view(k), 1, r.reads[g], r.writes[g],
                                           out.data(), out.data());
                     }});
    s.ops.push_back({"free c and d", [](C& r) {
                       r.cache.free_blocks("c");
                       r.cache.free_blocks("d");
                     }});
    add_paged_step(s.ops, "a", 7, 1, true);
    s.ops.push_back({"fork a to x, y", [](C& r) {
                       const std::vector<std::string> kids = {"x", "y"};
                       (void)r.cache.fork_request("a", kids);
                     }});
    // a's first block is complete and shared with x and y: cutting inside it copies it.
    s.ops.push_back({"truncate a to 3", [](C& r) { (void)r.cache.truncate_request("a", 3); }});
    s.ops.push_back({"offload x", [](C& r) { (void)r.cache.offload_request("x"); }});
    s.ops.push_back({"free y", [](C& r) { r.cache.free_blocks("y"); }});
    s.ops.push_back({"allocate x", [](C& r) { (void)r.cache.allocate_blocks(2, "x", 0); }});
    s.ops.push_back({"restore x", [](C& r) { r.cache.restore_request("x"); }});
    s.ops.push_back({"release x", [](C& r) { r.cache.release_request("x"); }});
    s.ops.push_back({"offload b", [](C& r) { (void)r.cache.offload_request("b"); }});
    s.ops.push_back({"drop b", [](C& r) { r.cache.drop_offloaded_request("b"); }});
    s.ops.push_back({"offload a", [](C& r) { (void)r.cache.offload_request("a"); }});
    s.ops.push_back({"release a (offloaded)", [](C& r) { r.cache.release_request("a"); }});
    s.ops.push_back({"free all", [](C& r) { r.cache.free_all_requests(); }});
    // Requests by key: opened, given blocks, forked into another opened key, closed.
    s.ops.push_back({"open k", [](C& r) { (void)r.cache.open_request("k"); }});
    s.ops.push_back(
        {"allocate k by key", [](C& r) { (void)r.cache.allocate_blocks(2, *r.cache.find_request("k"), 0); }});
    s.ops.push_back({"open z", [](C& r) { (void)r.cache.open_request("z"); }});
    s.ops.push_back({"fork k to z by key", [](C& r) {
                       const kvc::paged::RequestKey z = *r.cache.find_request("z");
                       (void)r.cache.fork_request(*r.cache.find_request("k"), std::span(&z, 1));
                     }});
    s.ops.push_back({"allocate e, too many", [](C& r) { (void)r.cache.allocate_blocks(100, "e", 0); }});
    s.ops.push_back({"close k", [](C& r) { r.cache.close_request("k"); }});
    s.ops.push_back({"close z", [](C& r) { r.cache.close_request("z"); }});
    // Every call is strong.
    check_paged_failures<C>(
        s, [](C& r) -> const kvc::PagedCache<Host>& { return r.cache; },
        [](C& r) {
          for (const char* id : {"a", "b", "c", "d", "x", "y"}) r.cache.drop_offloaded_request(id);
          r.cache.free_all_requests();
          r.cache.close_request("k");
          r.cache.close_request("z");
        },
        [](const std::string&) { return true; },
        [](C& r) {
          return std::pair{kvc_test::take_paged_snapshot(r.cache, {"a", "b", "c", "d", "x", "y"}),
                           std::pair{r.reads, r.writes}};
        });
  }
}

TEST_CASE("PagedCache with linear-attention states: slots, state updates, forks and transactions") {
  using C = paged_rig;
  // Layers 0 and 1 have keys and values (one full group), 1 and 2 linear-attention states.
  const auto make = [] {
    kvc::ContinuousBatchingConfig cb = paged_blocks(12);
    cb.max_state_slots = 4;
    cb.state_snapshot_interval = 4;  // prefix matches through state snapshots
    cb.max_state_snapshots = 2;
    C r{kvc::PagedCache<Host>(paged_model({"full_attention", "hybrid", "linear_attention"}), cb), {}, {}};
    r.cache.reserve_swap_space(6);
    return r;
  };
  const auto conv = [](std::int64_t t, unsigned seed) {
    std::mt19937 rng(seed);
    Eigen::Tensor<float, 3, Eigen::RowMajor> x(1, 5, t);
    for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(rng() % 64);
    return x;
  };
  const auto recurrent = [](unsigned seed) {
    std::mt19937 rng(seed);
    Eigen::Tensor<float, 3, Eigen::RowMajor> x(1, 2, 3);
    for (Eigen::Index i = 0; i < x.size(); ++i) x.data()[i] = static_cast<float>(rng() % 64);
    return x;
  };
  scenario<C> s{"PagedCache (full + hybrid + linear)", make, {}};
  const auto states = [&](const std::string& request, std::int64_t t, unsigned seed) {
    for (const std::int64_t layer : {1, 2}) {
      s.ops.push_back({"conv " + request + " layer " + std::to_string(layer),
                       [=](C& r) { (void)r.cache.update_conv_state(conv(t, seed), request, layer, 0, 3); }});
      s.ops.push_back({"recurrent " + request + " layer " + std::to_string(layer),
                       [=](C& r) { (void)r.cache.update_recurrent_state(recurrent(seed), request, layer); }});
    }
  };
  s.ops.push_back({"allocate a", [](C& r) { (void)r.cache.allocate_blocks(2, "a", 0); }});
  add_paged_step(s.ops, "a", 0, 7, false);
  states("a", 7, 1);
  // a's first block complete, its states kept after it; p resumes there, in a transaction or not.
  static const std::vector<std::int64_t> prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9};
  s.ops.push_back(
      {"complete a's first block", [](C& r) { r.cache.mark_shareable_blocks_as_complete("a", 1, prompt); }});
  s.ops.push_back({"snapshot a", [](C& r) { (void)r.cache.save_state_snapshot("a", std::span(prompt).first(4)); }});
  s.ops.push_back({"match p", [](C& r) {
                     const kvc::PagedPrefixMatch m = r.cache.match_prefix("p", prompt);
                     CHECK(m.tokens == 4);  // (when the call succeeds: the sweep covers a real match)
                   }});
  s.ops.push_back({"free p", [](C& r) { r.cache.free_blocks("p"); }});
  s.ops.push_back({"match p in a transaction", [](C& r) {
                     const kvc::PagedPrefixMatch m =
                         r.cache.transaction([&] { return r.cache.match_prefix("p", prompt); });
                     CHECK(m.tokens == 4);
                   }});
  s.ops.push_back({"free p again", [](C& r) { r.cache.free_blocks("p"); }});
  s.ops.push_back({"allocate c and d together", [](C& r) {
                     const std::vector<std::string> both = {"c", "d"};
                     (void)r.cache.allocate_blocks(1, both);
                   }});
  states("c", 2, 2);
  states("a", 1, 3);
  s.ops.push_back({"allocate e, the last slot", [](C& r) { (void)r.cache.allocate_blocks(1, "e", 0); }});
  s.ops.push_back({"free d", [](C& r) { r.cache.free_blocks("d"); }});
  s.ops.push_back({"fork a to x", [](C& r) { (void)r.cache.fork_request("a", std::vector<std::string>{"x"}); }});
  s.ops.push_back({"fork c to y, no slot left", [](C& r) {
                     try {
                       (void)r.cache.fork_request("c", std::vector<std::string>{"y"});
                     } catch (const kvc::ValueError&) {
                     }
                   }});
  s.ops.push_back({"truncate a (refused)", [](C& r) { (void)r.cache.truncate_request("a", 3); }});
  s.ops.push_back({"offload x", [](C& r) { (void)r.cache.offload_request("x"); }});
  s.ops.push_back({"allocate x", [](C& r) { (void)r.cache.allocate_blocks(2, "x", 0); }});
  s.ops.push_back({"restore x", [](C& r) { r.cache.restore_request("x"); }});
  states("x", 2, 4);
  s.ops.push_back({"offload c", [](C& r) { (void)r.cache.offload_request("c"); }});
  s.ops.push_back({"drop c", [](C& r) { r.cache.drop_offloaded_request("c"); }});
  s.ops.push_back({"release x", [](C& r) { r.cache.release_request("x"); }});
  s.ops.push_back({"fork a to x in a transaction, rolled back", [](C& r) {
                     r.cache.begin_transaction();
                     try {
                       (void)r.cache.fork_request("a", std::vector<std::string>{"x"});
                     } catch (...) {
                       r.cache.rollback_transaction();
                       throw;
                     }
                     r.cache.rollback_transaction();
                   }});
  s.ops.push_back({"fork a to x in a transaction", [](C& r) {
                     r.cache.transaction([&] { (void)r.cache.fork_request("a", std::vector<std::string>{"x"}); });
                   }});
  s.ops.push_back({"open k", [](C& r) { (void)r.cache.open_request("k"); }});
  s.ops.push_back({"allocate k by key, no slot left",
                   [](C& r) { (void)r.cache.allocate_blocks(1, *r.cache.find_request("k"), 0); }});
  s.ops.push_back({"free all", [](C& r) { r.cache.free_all_requests(); }});
  s.ops.push_back({"allocate k by key", [](C& r) { (void)r.cache.allocate_blocks(1, *r.cache.find_request("k"), 0); }});
  states("k", 3, 5);
  s.ops.push_back({"close k", [](C& r) { r.cache.close_request("k"); }});
  check_paged_failures<C>(
      s, [](C& r) -> const kvc::PagedCache<Host>& { return r.cache; },
      [](C& r) {
        for (const char* id : {"a", "c", "x"}) r.cache.drop_offloaded_request(id);
        r.cache.free_all_requests();
        r.cache.close_request("k");
        CHECK(r.cache.free_state_slots() == r.cache.state_slots());
        CHECK(r.cache.free_swap_state_slots() == r.cache.swap_state_slots());
      },
      [](const std::string&) { return true; },
      [](C& r) {
        return std::pair{kvc_test::take_paged_snapshot(r.cache, {"a", "c", "d", "e", "x", "y", "k", "p"}),
                         std::pair{r.reads, r.writes}};
      });
}

TEST_CASE("PagedCache with state rings: one-token steps and rollback_request, in transactions too") {
  using C = paged_rig;
  const auto make = [] {
    kvc::ContinuousBatchingConfig cb = paged_blocks(8);
    cb.max_state_slots = 2;
    cb.state_rollback_tokens = 2;
    return C{kvc::PagedCache<Host>(paged_model({"full_attention", "linear_attention"}), cb), {}, {}};
  };
  scenario<C> s{"PagedCache with state rings", make, {}};
  // A token of layer 1 is two calls (each an op): its conv column, which starts a step of the ring,
  // then its recurrent state.
  const auto conv = [](C& r, const std::string& request, unsigned seed) {
    std::mt19937 rng(seed);
    Eigen::Tensor<float, 3, Eigen::RowMajor> column(1, 5, 1);
    for (Eigen::Index i = 0; i < column.size(); ++i) column.data()[i] = static_cast<float>(rng() % 64);
    (void)r.cache.update_conv_state(column, request, 1, 0, 3);
  };
  const auto recurrent = [](C& r, const std::string& request, unsigned seed) {
    std::mt19937 rng(seed);
    Eigen::Tensor<float, 3, Eigen::RowMajor> state(1, 2, 3);
    for (Eigen::Index i = 0; i < state.size(); ++i) state.data()[i] = static_cast<float>(rng() % 64);
    (void)r.cache.update_recurrent_state(state, request, 1);
  };
  const auto token = [&](const std::string& request, unsigned seed) {
    s.ops.push_back({"conv " + request + " " + std::to_string(seed), [=](C& r) { conv(r, request, seed); }});
    s.ops.push_back({"recurrent " + request + " " + std::to_string(seed), [=](C& r) { recurrent(r, request, seed); }});
  };
  s.ops.push_back({"allocate a", [](C& r) { (void)r.cache.allocate_blocks(2, "a", 0); }});
  for (unsigned t = 1; t <= 3; ++t) token("a", t);
  s.ops.push_back({"roll a back 1", [](C& r) {
                     const bool done = r.cache.rollback_request("a", 2, 1);
                     CHECK(done);
                   }});
  s.ops.push_back({"conv a in a transaction", [=](C& r) { r.cache.transaction([&] { conv(r, "a", 4); }); }});
  s.ops.push_back({"recurrent a", [=](C& r) { recurrent(r, "a", 4); }});
  s.ops.push_back({"roll a back 2 and run a token in a transaction, rolled back", [=](C& r) {
                     r.cache.begin_transaction();
                     try {
                       const bool done = r.cache.rollback_request("a", 1, 2);
                       CHECK(done);
                       conv(r, "a", 5);
                       recurrent(r, "a", 5);
                       conv(r, "a", 6);
                     } catch (...) {
                       r.cache.rollback_transaction();
                       throw;
                     }
                     r.cache.rollback_transaction();
                   }});
  s.ops.push_back({"roll a back 1 in a transaction",
                   [](C& r) { r.cache.transaction([&] { (void)r.cache.rollback_request("a", 2, 1); }); }});
  s.ops.push_back({"allocate b", [](C& r) { (void)r.cache.allocate_blocks(1, "b", 0); }});
  token("b", 7);
  s.ops.push_back({"copy a's states to b", [](C& r) { r.cache.copy_states("a", "b"); }});
  s.ops.push_back({"roll b back (refused: copied states)", [](C& r) {
                     const bool done = r.cache.rollback_request("b", 1, 1);
                     CHECK_FALSE(done);
                   }});
  check_paged_failures<C>(
      s, [](C& r) -> const kvc::PagedCache<Host>& { return r.cache; },
      [](C& r) {
        r.cache.free_all_requests();
        CHECK(r.cache.free_state_slots() == r.cache.state_slots());
      },
      [](const std::string&) { return true; },
      [](C& r) {
        // (the rings' bookkeeping too, through what they can take back)
        const auto depth = [&](const char* id) {
          return r.cache.find_request(id) ? r.cache.state_rollback_depth(id) : std::int64_t{-1};
        };
        return std::pair{kvc_test::take_paged_snapshot(r.cache, {"a", "b"}), std::array{depth("a"), depth("b")}};
      });
}

TEST_CASE("PagedCache: what an all-or-nothing caller commits with allocates nothing") {
  // release_request, drop_offloaded_request, truncate_request (a cut that copies a shared block
  // included) and close_request are what the scheduler calls after its last allocation: the first allocation
  // they would make fails here.
  for (const bool hybrid : {false, true}) {
    CAPTURE(hybrid);
    const std::vector<std::string> types = hybrid ? std::vector<std::string>{"sliding_attention", "full_attention"}
                                                  : std::vector<std::string>{"full_attention", "full_attention"};
    kvc::PagedCache<Host> cache(paged_model(types), paged_blocks(16));
    cache.reserve_swap_space(6);
    const std::vector<std::int64_t> prompt = {1, 2, 3, 4, 5, 6, 7};
    REQUIRE(cache.allocate_blocks(2, "a", 0));
    cache.mark_shareable_blocks_as_complete("a", 1, prompt);
    const std::vector<std::string> kids = {"x", "y"};
    (void)cache.fork_request("a", kids);
    REQUIRE(cache.offload_request("y"));
    const auto quiet = [](const char* what, auto&& call) {
      CAPTURE(what);
      arm(0);
      call();
      CHECK_FALSE(disarm());
    };
    quiet("truncate_request copying a shared block", [&] { CHECK(cache.truncate_request("a", 3)); });
    quiet("release_request of a request in the cache", [&] { cache.release_request("x"); });
    quiet("release_request of an offloaded request", [&] { cache.release_request("y"); });
    REQUIRE(cache.offload_request("a"));
    quiet("drop_offloaded_request", [&] { cache.drop_offloaded_request("a"); });
    quiet("release_request of a request with nothing", [&] { cache.release_request("nobody"); });
    const kvc::paged::RequestKey k = cache.open_request("k");
    REQUIRE(cache.allocate_blocks(1, k, 0));
    quiet("close_request of an opened request with blocks", [&] { cache.close_request(k); });
    CHECK(cache.get_num_free_blocks() == cache.num_blocks());
    CHECK(cache.free_swap_blocks() == cache.swap_blocks());
  }
}

TEST_CASE("PagedBatchCache: updates, beam reorders, repeats, selections") {
  using C = batch_rig;
  const auto make = [] {
    return C{kvc::PagedBatchCache<Host>(paged_model({"sliding_attention", "full_attention"}), paged_blocks(40))};
  };
  scenario<C> s{"PagedBatchCache", make, {}};
  auto step = [&](std::int64_t q, unsigned seed) {
    for (std::int64_t layer = 0; layer < 2; ++layer)
      s.ops.push_back({"update layer " + std::to_string(layer) + " q " + std::to_string(q),
                       [=](C& r) { r.cache.update(tokens(q, seed), tokens(q, seed + 1), layer); }});
  };
  step(6, 1);
  step(1, 2);
  step(3, 3);
  s.ops.push_back({"reorder_cache({1, 1})", [](C& r) { r.cache.reorder_cache({1, 1}); }});
  s.ops.push_back({"batch_repeat_interleave(2)", [](C& r) { r.cache.batch_repeat_interleave(2); }});
  s.ops.push_back({"batch_select_indices({0, 2, 2, 2, 1})", [](C& r) {
                     r.cache.batch_select_indices({0, 2, 2, 2, 1});
                   }});
  s.ops.push_back({"update layer 0 after the selection", [](C& r) {
                     std::mt19937 rng(5);
                     const auto k = random_tensor<float>(5, heads, 2, head_dim, rng);
                     r.cache.update(k, k, 0);
                   }});
  s.ops.push_back({"reset", [](C& r) { r.cache.reset(); }});
  check_paged_failures<C>(
      s, [](C& r) -> const kvc::PagedCache<Host>& { return r.cache.paged(); },
      [](C& r) {
        r.cache.reset();
        // And it still reads what a fresh cache reads.
        C fresh = C{kvc::PagedBatchCache<Host>(paged_model({"sliding_attention", "full_attention"}), paged_blocks(40))};
        const auto a = r.cache.update(tokens(3, 8), tokens(3, 9), 1);
        const std::vector<double> got = kvc_test::flatten(a.keys);
        CHECK(got == kvc_test::flatten(fresh.cache.update(tokens(3, 8), tokens(3, 9), 1).keys));
        r.cache.reset();
      },
      [](const std::string&) { return true; },
      [](C& r) {  // every layer's tokens and length, the rows, and the pages under them
        std::vector<std::vector<double>> held;
        std::vector<std::string> rows;
        for (std::int64_t i = 0; i < r.cache.size(); ++i) {
          const auto kv = r.cache.stored(i);
          held.push_back(kvc_test::flatten(kv.keys));
          held.push_back(kvc_test::flatten(kv.values));
          held.push_back({static_cast<double>(r.cache.get_seq_length(i))});
        }
        for (std::int64_t b = 0; b < r.cache.batch_size(); ++b) rows.push_back(r.cache.row_request(b));
        return std::tuple{held, rows, kvc_test::take_paged_snapshot(r.cache.paged(), rows)};
      });
}

TEST_CASE("PagedBatchCache on a hybrid model: state updates with the rows' first blocks, reorders, repeats") {
  using C = batch_rig;
  const auto make = [] {
    return C{
        kvc::PagedBatchCache<Host>(paged_model({"linear_attention", "full_attention", "hybrid"}), paged_blocks(40))};
  };
  scenario<C> s{"PagedBatchCache (hybrid)", make, {}};
  auto step = [&](std::int64_t q, unsigned seed) {
    s.ops.push_back({"conv layer 0 q " + std::to_string(q),
                     [=](C& r) { r.cache.update_conv_state(conv_input(q, seed), 0, 0, 4); }});
    s.ops.push_back({"recurrent layer 0", [=](C& r) { r.cache.update_recurrent_state(recurrent_input(seed), 0); }});
    s.ops.push_back({"update layer 1 q " + std::to_string(q),
                     [=](C& r) { r.cache.update(tokens(q, seed), tokens(q, seed + 1), 1); }});
    s.ops.push_back({"update layer 2 q " + std::to_string(q),
                     [=](C& r) { r.cache.update(tokens(q, seed + 2), tokens(q, seed + 3), 2); }});
    s.ops.push_back({"conv layer 2 q " + std::to_string(q),
                     [=](C& r) { r.cache.update_conv_state(conv_input(q, seed + 4), 2, 0, 3); }});
  };
  step(5, 1);  // the rows take their blocks and slots at the first conv update
  step(1, 2);
  s.ops.push_back({"reorder_cache({1, 1})", [](C& r) { r.cache.reorder_cache({1, 1}); }});
  s.ops.push_back({"batch_repeat_interleave(2)", [](C& r) { r.cache.batch_repeat_interleave(2); }});
  s.ops.push_back({"batch_select_indices({0, 2, 2, 1})", [](C& r) { r.cache.batch_select_indices({0, 2, 2, 1}); }});
  s.ops.push_back({"reset", [](C& r) { r.cache.reset(); }});
  s.ops.push_back({"update layer 1 first", [](C& r) { r.cache.update(tokens(2, 7), tokens(2, 8), 1); }});
  s.ops.push_back({"reset again", [](C& r) { r.cache.reset(); }});
  s.ops.push_back({"early_initialization", [](C& r) { r.cache.early_initialization(batch, heads, head_dim); }});
  s.ops.push_back({"recurrent layer 2 first, on rows early_initialization named",
                   [](C& r) { r.cache.update_recurrent_state(recurrent_input(9), 2); }});
  check_paged_failures<C>(
      s, [](C& r) -> const kvc::PagedCache<Host>& { return r.cache.paged(); }, [](C& r) { r.cache.reset(); },
      [](const std::string&) { return true; },
      [](C& r) {  // every layer's tokens and length, the rows, and the pages and states under them
        std::vector<std::vector<double>> held;
        std::vector<std::string> rows;
        for (const std::int64_t i : {1, 2}) {
          const auto kv = r.cache.stored(i);
          held.push_back(kvc_test::flatten(kv.keys));
          held.push_back({static_cast<double>(r.cache.get_seq_length(i))});
        }
        std::vector<std::string> known;  // (rows early_initialization named have no table yet)
        for (std::int64_t b = 0; b < r.cache.batch_size(); ++b) {
          rows.push_back(r.cache.row_request(b));
          if (r.cache.paged().state_slot(rows.back()) >= 0) known.push_back(rows.back());
        }
        return std::tuple{held, rows, kvc_test::take_paged_snapshot(r.cache.paged(), known)};
      });
}

namespace {

// ---- the scheduler ---------------------------------------------------------------------------------

// A scheduler over a paged cache (sliding + full layers, prefix sharing, a swap pool), the toy
// model of tests/support/toy_model.hpp writing every layer, and the requests taken so far.
struct sched_rig {
  std::unique_ptr<kvc_toy::Cache> cache;  // the scheduler points at it: it does not move
  std::unique_ptr<kvc_toy::Scheduler> sched;
  std::vector<kvc::RequestState> done;
  std::optional<kvc::ScheduledBatch> batch;  // schedule()'s, until update()
};
constexpr std::int64_t sched_layers = 2;
const std::vector<std::string> sched_ids = {"a", "a__child#0", "a__child#1", "b", "b__child#0", "c", "a2", "a3", "c2"};

sched_rig make_sched_rig() {
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 16;
  cb.max_batch_tokens = 12;
  cb.allow_block_sharing = true;
  sched_rig r;
  r.cache = std::make_unique<kvc_toy::Cache>(kvc_toy::model({"sliding_attention", "full_attention"}, 6), cb);
  r.cache->reserve_swap_space(4);
  r.sched = std::make_unique<kvc_toy::Scheduler>(*r.cache, cb);
  r.done.reserve(sched_ids.size());  // take() appends without allocating: a failure is take_finished's
  return r;
}

bool known(const sched_rig& r, const std::string& id) {
  try {
    (void)r.sched->request(id);
    return true;
  } catch (const kvc::KeyError&) {
    return false;
  }
}

// Every request's state as a caller sees it, the queues' sizes and the statistics.
std::string sched_state(const sched_rig& r) {
  const kvc::SchedulerStats& t = r.sched->stats();
  std::string out = std::to_string(r.sched->num_waiting()) + "/" + std::to_string(r.sched->num_active()) + " " +
                    std::to_string(t.steps) + "," + std::to_string(t.forks) + "," + std::to_string(t.forks_requeued) +
                    "," + std::to_string(t.failed) + "," + std::to_string(t.prefix_hit_tokens) + ";";
  for (const std::string& id : sched_ids) {
    if (!known(r, id)) continue;
    const kvc::RequestState& st = r.sched->request(id);
    out += id + ":" + std::to_string(static_cast<int>(st.status)) + "," + std::to_string(st.position_offset) + "," +
           std::to_string(r.sched->allocated_blocks(id)) + "," + std::to_string(st.prompt_length) + "," +
           std::to_string(st.num_children) + "," + std::to_string(r.cache->is_offloaded(id)) + "," +
           std::to_string(st.next_token()) + "," + st.error + ",";
    for (const std::int64_t x : st.tokens) out += std::to_string(x) + " ";
    out += "|";
    for (const std::int64_t x : st.remaining_prefill_tokens()) out += std::to_string(x) + " ";
    out += ";";
  }
  for (const kvc::RequestState& st : r.done) {
    out += "done " + st.request_id + ":" + std::to_string(static_cast<int>(st.status)) + "," + st.error + ",";
    for (const std::int64_t x : st.tokens) out += std::to_string(x) + " ";
  }
  return out;
}

// One step of the model loop; then every running request's cached rows must be its own.
void sched_step(sched_rig& r) {
  auto scheduled = r.sched->schedule();
  if (!scheduled) return;
  kvc_toy::write_batch(*r.cache, *r.sched, *scheduled, sched_layers);
  r.sched->update(*scheduled, kvc_toy::next_tokens(*r.sched, *scheduled));
  for (const std::string& id : sched_ids) {
    if (!known(r, id)) continue;
    const kvc::RequestState& st = r.sched->request(id);
    if (!st.is_active() || r.cache->is_offloaded(id)) continue;
    CAPTURE(id);
    CHECK(kvc_toy::wrong_row(*r.cache, id, st.tokens, st.position_offset, sched_layers) == "");
  }
}

void take(sched_rig& r) {
  std::vector<kvc::RequestState> got = r.sched->take_finished();
  for (kvc::RequestState& st : got) r.done.push_back(std::move(st));
}

// An operation of the scenario; `inject`: the sweep fails each of its allocations in turn (in
// `run`; `prepare` runs first, without failures: the model's work between schedule and update).
struct sched_op {
  std::string name;
  std::function<void(sched_rig&)> run;
  bool inject;
  std::function<void(sched_rig&)> prepare = [](sched_rig&) {};
};

// A step in two operations: schedule(), then (the toy model writes every layer) update().
void sched_schedule(sched_rig& r) {
  r.batch = r.sched->schedule();
  if (!r.batch) throw std::logic_error("nothing was scheduled");
}
void sched_write(sched_rig& r) { kvc_toy::write_batch(*r.cache, *r.sched, *r.batch, sched_layers); }
void sched_update(sched_rig& r) {
  r.sched->update(*r.batch, kvc_toy::next_tokens(*r.sched, *r.batch));
  r.batch.reset();
}

}  // namespace

TEST_CASE("ContinuousBatchingScheduler: every call, schedule() and update() with them") {
  const auto add = [](std::string id, std::vector<std::int64_t> prompt, std::int64_t n) {
    return [=](sched_rig& r) {
      kvc::GenerationRequest q;
      q.request_id = id;
      q.prompt = prompt;
      q.max_new_tokens = 5;
      q.num_return_sequences = n;
      r.sched->add_request(q);
    };
  };
  const std::vector<std::int64_t> system = {1, 2, 3, 4, 5, 6, 7, 8};
  std::vector<std::int64_t> pa = system, pc = system;
  pa.push_back(9);
  pc.insert(pc.end(), {20, 21});
  const auto expect = [](bool ok) {
    if (!ok) throw std::logic_error("a sequence operation was refused");
  };
  // seq_cp(src, dst, 0, p1), which must count one more in `counter` (a fork, or a queued copy).
  const auto copy_counted = [&](std::string src, std::string dst, std::int64_t p1,
                                std::int64_t kvc::SchedulerStats::*counter) {
    return [=](sched_rig& r) {
      const std::int64_t before = r.sched->stats().*counter;
      expect(r.sched->seq_cp(src, dst, 0, p1));
      if (r.sched->stats().*counter != before + 1) throw std::logic_error("seq_cp " + src + " " + dst + " miscounted");
    };
  };
  std::vector<sched_op> ops = {
      {"add a (3 sequences)", add("a", pa, 3), true},
      {"add b (one token, 2 sequences)", add("b", {7}, 2), true},
      {"schedule 1", sched_schedule, true},
      {"update 1", sched_update, true, sched_write},
      {"schedule 2", sched_schedule, true},
      {"update 2", sched_update, true, sched_write},
      {"add c (a's system prompt)", add("c", pc, 1), true},
      {"schedule 3", sched_schedule, true},
      {"update 3", sched_update, true, sched_write},
      {"seq_cp a a2 (a fork)", [&](sched_rig& r) { expect(r.sched->seq_cp("a", "a2", -1, -1)); }, true},
      {"schedule 4", sched_schedule, true},
      {"update 4", sched_update, true, sched_write},
      {"seq_cp a a3 [0, 10) (a fork, then a cut that copies a shared block)",
       copy_counted("a", "a3", 10, &kvc::SchedulerStats::forks), true},
      {"seq_cp c c2 [0, 9) (c still waits: a queued copy, cut)",
       copy_counted("c", "c2", 9, &kvc::SchedulerStats::forks_requeued), true},
      {"seq_rm a [6, end)", [&](sched_rig& r) { expect(r.sched->seq_rm("a", 6, -1)); }, true},
      {"schedule 5", sched_schedule, true},
      {"update 5", sched_update, true, sched_write},
      {"cancel a2", [](sched_rig& r) { r.sched->cancel_request("a2"); }, true},
      {"take_finished", take, true},
      {"schedule 6", sched_schedule, true},
      {"update 6", sched_update, true, sched_write},
      {"seq_keep c2", [](sched_rig& r) { r.sched->seq_keep("c2"); }, true},
      {"take_finished again", take, true},
  };
  const auto finish = [](sched_rig& r) {
    for (int i = 0; i < 100 && r.sched->has_unfinished_requests(); ++i) sched_step(r);
    take(r);
  };
  // The run without a failure: what every retried run must end with.
  sched_rig clean = make_sched_rig();
  std::vector<char> changes;  // whether the operation changed what a caller sees
  for (const sched_op& o : ops) {
    CAPTURE(o.name);
    o.prepare(clean);
    const std::string before = sched_state(clean);
    o.run(clean);
    changes.push_back(sched_state(clean) != before);
  }
  finish(clean);
  const std::string expected = sched_state(clean);
  CHECK(!clean.sched->has_unfinished_requests());
  CHECK(clean.cache->get_num_free_blocks() == clean.cache->num_blocks());

  std::int64_t failures = 0;
  for (std::size_t k = 0; k < ops.size(); ++k) {
    if (!ops[k].inject) continue;
    std::int64_t here = 0;
    for (std::int64_t n = 0;; ++n) {
      sched_rig r = make_sched_rig();
      for (std::size_t j = 0; j < k; ++j) {
        ops[j].prepare(r);
        ops[j].run(r);
      }
      ops[k].prepare(r);
      const std::string before = sched_state(r);
      const kvc_test::paged_snapshot cache_before = kvc_test::take_paged_snapshot(*r.cache, sched_ids);
      arm(n);
      bool threw = false;
      try {
        ops[k].run(r);
      } catch (const std::bad_alloc&) {
        threw = true;
      }
      const bool failed = disarm();
      CAPTURE(ops[k].name);
      CAPTURE(n);
      if (!failed) break;
      ++here;
      CHECK(threw);
      CHECK(sched_state(r) == before);
      CHECK(kvc_test::take_paged_snapshot(*r.cache, sched_ids) == cache_before);
      CHECK(paged_invariants(*r.cache) == "");
      // The same call again succeeds, and the run ends as the one without a failure.
      ops[k].run(r);
      for (std::size_t j = k + 1; j < ops.size(); ++j) {
        ops[j].prepare(r);
        ops[j].run(r);
      }
      finish(r);
      CHECK(sched_state(r) == expected);
    }
    CAPTURE(ops[k].name);
    CHECK((here > 0 || changes[k]));  // the operation did something (with or without allocating)
    failures += here;
  }
  MESSAGE("scheduler: " << failures << " injected failures");
}

TEST_CASE("the model-checked scheduler runs, with allocation failures in every call") {
  // tests/support/scheduler_model.hpp's random operation sequences (its layouts, pool sizes, swap
  // pools, sharing and schedule orders), with add_request, schedule, update, cancel_request,
  // take_finished, the sequence operations and set_draft_tokens failing an allocation at random:
  // each failure must change nothing, and every invariant must hold after every operation.
  // Under the sanitizers (where this is one of the slowest tests), the first half of the sequences;
  // the g++ build runs all.
  std::int64_t injected = 0, operations = 0;
  for (std::uint64_t seed = 0; seed < (kvc_test::sanitized ? 150u : 300u); ++seed) {
    CAPTURE(seed);
    kvc_model::source src(seed, 400);
    kvc_model::run r(src);
    r.inject([](std::int64_t n) { arm(n); }, [] { return disarm(); });
    try {
      operations += r.go().operations;
    } catch (const std::exception& e) {  // a violation, or a call the scheduler refused on retry
      FAIL_CHECK(std::string(e.what()));
    }
    injected += r.injected();
  }
  MESSAGE(injected << " injected failures over " << operations << " operations");
  CHECK(injected > 100);
}

TEST_CASE("DynamicCache: every allocation failure leaves the cache as it was") {
  using C = kvc::DynamicCache<float>;
  scenario<C> s{"DynamicCache", [] { return C(); }, layer_ops<C>({"full_attention", "full_attention"}, 5, 2)};
  add_dynamic_ops(s.ops);
  add_common_ops<C>(s.ops, [] { return C(); });
  s.ops.push_back({"update after reset", [](C& c) { c.update(tokens(2, 9), tokens(2, 9), 1); }});
  check_every_failure(s);
}

TEST_CASE("make_dynamic_cache, every dynamic kind (full, sliding, linear, hybrids, indexed)") {
  using C = kvc::ConfiguredDynamicCache<float>;
  const auto make = [] {
    auto c = kvc::make_dynamic_cache<float>(config_of(dynamic_types));
    c.activate_past_recording();  // linear layers crop only while recording
    return c;
  };
  scenario<C> s{"make_dynamic_cache", make, layer_ops<C>(dynamic_types, 5, 2)};
  // crop(0): the linear layers' recurrent states cannot roll back (docs/rollback.md), and crop(0)
  // still rebuilds their conv states
  add_dynamic_ops(s.ops, 0);
  add_common_ops<C>(s.ops, make);
  s.ops.push_back({"early_initialization after reset", [](C& c) { c.early_initialization(batch, heads, head_dim); }});
  check_every_failure(s);
}

TEST_CASE("StaticCache, every static kind (full, sliding, linear, hybrids, indexed)") {
  using C = kvc::StaticCache<float>;
  const auto make = [] { return C(config_of(dynamic_types), 12); };
  scenario<C> s{"StaticCache", make, {}};
  s.ops.push_back({"early_initialization", [](C& c) { c.early_initialization(batch, heads, head_dim); }});
  for (auto& o : layer_ops<C>(dynamic_types, 5, 2)) s.ops.push_back(std::move(o));
  s.ops.push_back({"reorder_cache({1, 0})", [](C& c) { c.reorder_cache({1, 0}); }});
  add_common_ops<C>(s.ops, make);
  check_every_failure(s);
}

TEST_CASE("QuantizedCache, quanto and HQQ: quantization, crop of the residual, batch operations") {
  for (const char* backend : {"quanto", "hqq"}) {
    using C = kvc::QuantizedCache<float>;
    const std::string b = backend;
    const auto make = [b] {
      return C(
          b, config_of({"full_attention", "full_attention"}),
          kvc::QuantizedOptions{.nbits = 4, .axis_key = 0, .axis_value = 0, .q_group_size = 4, .residual_length = 3});
    };
    // Decode steps past residual_length quantize everything again.
    scenario<C> s{std::string("QuantizedCache ") + backend, make,
                  layer_ops<C>({"full_attention", "full_attention"}, 5, 4)};
    add_dynamic_ops(s.ops, -1);  // the residual holds 1 token: 4 decode steps, residual_length 3
    add_common_ops<C>(s.ops, make);
    check_every_failure(s);
  }
}

TEST_CASE("kvc::attend: the output and the scratch are made before the update") {
  // Prefill and decode steps through a dynamic and a sliding layer, with no workspace and with one
  // that is too small at first: an allocation that fails leaves the cache as it was.
  using C = kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer>, kvc::HostStorage<float>>;
  const auto make = [] { return C(kvc::DynamicLayer{}, kvc::DynamicSlidingWindowLayer{.sliding_window = 4}); };
  scenario<C> s{"attend", make, {}};
  for (std::int64_t step = 0; step < 4; ++step)
    for (const std::int64_t layer : {0, 1})
      s.ops.push_back({"attend, layer " + std::to_string(layer), [step, layer](C& c) {
                         const auto x = tokens(step == 0 ? 6 : 1, static_cast<unsigned>(step) + 70);
                         if (step % 2 == 0) {
                           (void)kvc::attend(c, layer, x, x, x);
                         } else {
                           kvc::AttentionWorkspace ws;
                           kvc::HostTensor<float> out;
                           kvc::attend(c, layer, x, x, x, out, {.context = {.workspace = &ws}});
                         }
                       }});
  check_every_failure(s);
}

TEST_CASE("PerLayerQuantizedCache: a full-precision layer beside quantized ones, through attend_quantized") {
  using C = kvc::PerLayerQuantizedCache<float>;
  const auto make = [] {
    return C("quanto", config_of({"full_attention", "full_attention"}),
             kvc::QuantizedOptions{.nbits = 4, .q_group_size = 4, .residual_length = 3}, {.skip_layers = {0}});
  };
  scenario<C> s{"PerLayerQuantizedCache", make, layer_ops<C>({"full_attention", "full_attention"}, 5, 4)};
  for (std::int64_t step = 0; step < 4; ++step)
    for (const std::int64_t layer : {0, 1})
      s.ops.push_back({"attend_quantized, layer " + std::to_string(layer), [step, layer](C& c) {
                         const auto x = tokens(step == 0 ? 3 : 1, static_cast<unsigned>(step) + 60);
                         (void)kvc::attend_quantized(c, layer, x, x, x);
                       }});
  add_common_ops<C>(s.ops, make);
  check_every_failure(s);
}

TEST_CASE("attend_fp8: the output, the scratch and the rotated queries are made before the update") {
  // Plain and rotated codes (Fp8Scales::rotation), a prefill and decode steps: an allocation that
  // fails leaves the cache as it was.
  using C = kvc::DynamicCache<kvc::float8_e4m3>;
  for (const bool rotated : {false, true}) {
    scenario<C> s{rotated ? "attend_fp8, rotated" : "attend_fp8", [] { return C(); }, {}};
    for (std::int64_t step = 0; step < 4; ++step) {
      const std::int64_t q = step == 0 ? 5 : 1;
      s.ops.push_back({"attend_fp8 of " + std::to_string(q) + " tokens", [q, step, rotated](C& c) {
                         const auto x = tokens(q, static_cast<unsigned>(step) + 60);
                         const kvc::Fp8Scales scales{{0.5f, 0.25f}, {0.125f}, {.keys = rotated, .values = rotated}};
                         (void)kvc::attend_fp8(c, 0, x, x, x, scales);
                       }});
    }
    check_every_failure(s);
  }
}

TEST_CASE("QuantizedCache with rotated codes: attend_quantized, update, flushes, crop, batch selection") {
  // rotate_keys / rotate_values keep a rotated copy of the residual beside it: every call that
  // grows the residual grows the copy before anything changes.
  for (const bool append_only : {false, true}) {
    using C = kvc::QuantizedCache<float>;
    const auto make = [append_only] {
      kvc::QuantizedOptions o{.nbits = 4, .q_group_size = 4, .residual_length = 3, .append_only = append_only};
      o.rotate_keys = true;
      o.rotate_values = !append_only;
      return C("quanto", config_of({"full_attention"}), o);
    };
    scenario<C> s{std::string("QuantizedCache rotated") + (append_only ? ", append_only" : ""), make, {}};
    for (std::int64_t step = 0; step < 7; ++step) {
      const std::int64_t q = step == 0 ? 5 : step == 3 ? 2 : 1;
      s.ops.push_back({"attend_quantized of " + std::to_string(q) + " tokens", [q, step](C& c) {
                         const auto x = tokens(q, static_cast<unsigned>(step) + 40);
                         (void)kvc::attend_quantized(c, 0, x, x, x);
                       }});
    }
    s.ops.push_back({"update of 1 token", [](C& c) {
                       const auto x = tokens(1, 50);
                       (void)c.update(x, x, 0);
                     }});
    s.ops.push_back({"crop(-1)", [](C& c) { c.crop(-1); }});
    s.ops.push_back({"batch_select_indices({1})", [](C& c) { c.batch_select_indices({1}); }});
    s.ops.push_back({"attend_quantized after the selection", [](C& c) {
                       kvc::HostTensor<float> x(1, heads, 1, head_dim);
                       x.setConstant(0.5f);
                       (void)kvc::attend_quantized(c, 0, x, x, x);
                     }});
    check_every_failure(s);
  }
}

TEST_CASE("a hybrid whose attention part is quantized: its crop is prepared in both parts") {
  // crop(0): the recurrent states cannot roll back; crop(0) still rebuilds the conv states.
  using Hybrid = kvc::LinearAttentionHybrid<kvc::QuantoQuantizedLayer>;
  using C = kvc::Cache<kvc::Layers<Hybrid>>;
  const auto make = [] {
    const Hybrid kind{kvc::QuantoQuantizedLayer{.q_group_size = 4, .residual_length = 3}, 1};
    C c(kind, kind);
    c.activate_past_recording();
    return c;
  };
  scenario<C> s{"quantized hybrid", make, layer_ops<C>({"hybrid", "hybrid"}, 5, 4)};
  s.ops.push_back({"crop(0)", [](C& c) { c.crop(0); }});
  check_every_failure(s);
}

TEST_CASE("rings of linear states: the steps that fill and reuse them, and the crops that restore them") {
  // rollback_states 3: the prefill and 4 one-token steps overflow the ring, the crop restores
  // entries, and the steps after it reuse the popped entries' buffers.
  using C = kvc::Cache<kvc::Layers<kvc::LinearAttentionAndFullAttentionLayer, kvc::LinearAttentionLayer>>;
  const auto make = [] {
    return C(std::vector<C::kind_variant>{kvc::LinearAttentionAndFullAttentionLayer{{}, 1, 3},
                                          kvc::LinearAttentionLayer{1, 3}});
  };
  scenario<C> s{"linear rings", make, layer_ops<C>({"hybrid", "linear_attention"}, 5, 4)};
  s.ops.push_back({"crop(-2)", [](C& c) { c.crop(-2); }});
  for (auto& o : layer_ops<C>({"hybrid", "linear_attention"}, 1, 2)) s.ops.push_back(std::move(o));
  add_dynamic_ops(s.ops, -1);
  s.ops.push_back({"reset", [](C& c) { c.reset(); }});
  check_every_failure(s);
}

TEST_CASE("OffloadToFile: dynamic and static caches with spilled layers and prefetches") {
  kvc_test::spill_dir dir;
  off_thread = 0;
  {
    using C = kvc::ConfiguredDynamicCache<float, Host, kvc::OffloadToFile<false>>;
    const std::vector<std::string> types{"full_attention", "sliding_attention", "full_attention"};
    const auto make = [types] {
      auto c = kvc::make_dynamic_cache<float, Host, kvc::OffloadToFile<false>>(config_of(types));
      c.activate_past_recording();  // the sliding layer crops past its window only while recording
      return c;
    };
    scenario<C> s{"offloaded dynamic", make, layer_ops<C>(types, 5, 3)};
    s.ops.push_back({"stored(1)", [](C& c) { (void)c.stored(1); }});
    s.ops.push_back({"crop(-1)", [](C& c) { c.crop(-1); }});
    s.ops.push_back({"reorder_cache({1, 0})", [](C& c) { c.reorder_cache({1, 0}); }});
    s.ops.push_back({"update layer 0 again", [](C& c) { c.update(tokens(1, 50), tokens(1, 51), 0); }});
    add_common_ops<C>(s.ops, make, 3);  // layers 0 and 1 of the source spilled
    check_every_failure(s);
  }
  {
    using C = kvc::StaticCache<float, Host, kvc::OffloadToFile<true>>;
    const std::vector<std::string> types{"full_attention", "sliding_attention", "full_attention"};
    const auto make = [types] { return C(config_of(types), 10); };
    scenario<C> s{"offloaded static", make, layer_ops<C>(types, 5, 3)};
    s.ops.push_back({"reorder_cache({1, 0})", [](C& c) { c.reorder_cache({1, 0}); }});
    add_common_ops<C>(s.ops, make, 3);
    check_every_failure(s);
  }
  // Every cache is gone: no spilled layer may still be counted (a failed copy once uncounted
  // layers it had never counted).
  CHECK(kvc::offload_file_stats().spilled_layers == 0);
  CHECK(kvc::offload_file_stats().spilled_bytes == 0);
  // The prefetch thread reads into buffers the caller allocated: it allocates nothing itself.
  CHECK(off_thread == 0);
}

namespace {
template <class E>
std::vector<op<E>> encoder_decoder_ops() {
  std::vector<op<E>> ops;
  for (std::int64_t i = 0; i < 2; ++i) {
    ops.push_back({"self update " + std::to_string(i),
                   [i](E& c) { c.self_attention_cache().update(tokens(4, 1), tokens(4, 2), i); }});
    ops.push_back({"cross update " + std::to_string(i),
                   [i](E& c) { c.cross_attention_cache().update(tokens(6, 3), tokens(6, 4), i); }});
    ops.push_back({"set_is_updated(" + std::to_string(i) + ")", [i](E& c) { c.set_is_updated(i); }});
  }
  ops.push_back({"self decode", [](E& c) { c.self_attention_cache().update(tokens(1, 5), tokens(1, 6), 0); }});
  ops.push_back({"reorder_cache({1, 0})", [](E& c) { c.reorder_cache({1, 0}); }});
  ops.push_back({"batch_repeat_interleave(2)", [](E& c) { c.batch_repeat_interleave(2); }});
  ops.push_back({"batch_select_indices({2, 1})", [](E& c) { c.batch_select_indices({2, 1}); }});
  ops.push_back({"crop(-1)", [](E& c) { c.crop(-1); }});
  auto source = std::make_shared<E>();
  source->self_attention_cache().update(tokens(2, 7), tokens(2, 8), 0);
  source->cross_attention_cache().update(tokens(3, 9), tokens(3, 9), 1);
  ops.push_back({"copy assignment", [source](E& c) { c = *source; }});
  ops.push_back({"reset", [](E& c) { c.reset(); }});
  return ops;
}
}  // namespace

TEST_CASE("EncoderDecoderCache: operations on both halves, plain and offloaded") {
  kvc_test::spill_dir dir;
  {
    using D = kvc::DynamicCache<float>;
    using E = kvc::EncoderDecoderCache<D, D>;
    check_every_failure(scenario<E>{"EncoderDecoderCache", [] { return E(D(), D()); }, encoder_decoder_ops<E>()});
  }
  {
    using D = kvc::DynamicCache<float, Host, kvc::OffloadToFile<false>>;
    using E = kvc::EncoderDecoderCache<D, D>;
    check_every_failure(
        scenario<E>{"offloaded EncoderDecoderCache", [] { return E(D(), D()); }, encoder_decoder_ops<E>()});
  }
}

TEST_CASE("copy assignment of a layer's buffers reports an allocation failure and changes nothing") {
  // A by-value `operator=(buffer) noexcept` made the implicit copy assignment of every class holding
  // a buffer noexcept under clang, so an allocation failure there called std::terminate; and a
  // member-by-member assignment could fail after the capacity or K had changed.
  CHECK_FALSE(std::is_nothrow_copy_assignable_v<kvc::detail::host_buffer<float>>);
  CHECK_FALSE(std::is_nothrow_copy_assignable_v<kvc::detail::kv_store<Host>>);
  CHECK_FALSE(std::is_nothrow_copy_assignable_v<kvc::DynamicLayer::state<Host>>);
  CHECK(std::is_nothrow_move_assignable_v<kvc::detail::kv_store<Host>>);
  // Different shapes and capacities, and a failure at each allocation the copy makes.
  const kvc::detail::kv_store<Host> small({1, 1, 2, 2}, 3, true), large({2, 2, 4, 4}, 9, true);
  for (std::int64_t n = 0;; ++n) {
    kvc::detail::kv_store<Host> target = small;
    arm(n);
    bool threw = false;
    try {
      target = large;
    } catch (const std::bad_alloc&) {
      threw = true;
    }
    const bool failed = disarm();
    CAPTURE(n);
    if (!failed) {
      CHECK_FALSE(threw);
      CHECK(target.capacity() == 9);
      CHECK(target.shape() == large.shape());
      break;
    }
    CHECK(threw);
    CHECK(target.capacity() == 3);
    CHECK(target.shape() == small.shape());
    CHECK(target.bytes() == small.bytes());
  }
}

TEST_CASE("a host allocation the system refuses is a kvc::MemoryError naming its bytes") {
  arm(0);
  try {
    kvc::detail::host_buffer<float> b(16);
    FAIL("the allocation did not fail");
  } catch (const kvc::MemoryError& e) {
    CHECK(std::string(e.what()) == "kvc: the system cannot allocate 64 bytes (out of memory)");
  }
  CHECK(disarm());
  CHECK(std::is_base_of_v<std::bad_alloc, kvc::MemoryError>);
}
