// The rollback contract (docs/rollback.md): every layer kind says how many of its last tokens it can
// drop exactly (rollback_depth(), kvc::rollback_bound_v), Cache::crop refuses more before anything
// changes, and a crop within the depth leaves what a cache that never saw the dropped tokens holds:
// checked on random step sequences against such a cache, rebuilt from the steps that remain.
#include <algorithm>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include <kvc/state.hpp>

#include "../support/kvc_test.hpp"

namespace {

using Conv = Eigen::Tensor<float, 3, Eigen::RowMajor>;
constexpr std::int64_t heads = 2, dim = 4, channels = 3, kernel = 3, window = 4;

// The K (or V, odd `which`) of token `pos` in layer `layer`: distinct values, so that a token
// shifted by one position shows.
float value_of(std::int64_t pos, std::int64_t layer, std::int64_t h, std::int64_t d, int which) {
  return static_cast<float>(std::sin(0.37 * static_cast<double>(pos) + 1.3 * static_cast<double>(layer) +
                                     0.71 * static_cast<double>(h) + 0.19 * static_cast<double>(d) + 2.1 * which));
}

kvc::HostTensor<float> tokens(std::int64_t first, std::int64_t q, std::int64_t layer, int which) {
  kvc::HostTensor<float> t(1, heads, q, dim);
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t s = 0; s < q; ++s)
      for (std::int64_t d = 0; d < dim; ++d) t(0, h, s, d) = value_of(first + s, layer, h, d, which);
  return t;
}

Conv conv_columns(std::int64_t first, std::int64_t q, std::int64_t layer) {
  Conv x(1, channels, q);
  for (std::int64_t c = 0; c < channels; ++c)
    for (std::int64_t s = 0; s < q; ++s) x(0, c, s) = value_of(first + s, layer, c, 0, 2);
  return x;
}

template <class C>
constexpr bool has_conv_v = requires(C& c, const Conv& x) { c.update_conv_state(x, 0, 0, kernel); };

// Whether layer l has a linear part that keeps a ring of states: the steps then also write a
// recurrent state, the way a model does.
template <class C>
bool has_ring(const C& cache, std::int64_t l) {
  return cache.visit_layer(l, [](const auto& st) {
    if constexpr (requires { st.linear_part(); })
      return st.linear_part().rollback_states() > 0;
    else if constexpr (requires { st.rollback_states(); })
      return st.rollback_states() > 0;
    else
      return false;
  });
}

constexpr std::int64_t rec_size = 4;  // the recurrent state: [1, 2, 2]

// The recurrence the ring tests run: each column decays the state and adds the column with its left
// neighbour (so that a wrong conv context or a wrong earlier state shows in every later state).
void advance(std::vector<float>& rec, const kvc::StateView<float>& x, std::int64_t column) {
  const std::int64_t width = x.extent(2);
  for (std::int64_t j = 0; j < rec_size; ++j) {
    float add = 0;
    for (std::int64_t c = 0; c < channels; ++c)
      add += x[c * width + column] * static_cast<float>(j + 1) +
             (column > 0 ? 0.5f * x[c * width + column - 1] : 0.0f) * static_cast<float>(c + 1);
    rec[static_cast<std::size_t>(j)] = 0.5f * rec[static_cast<std::size_t>(j)] + 0.1f * add;
  }
}

// Writes the conv columns of q tokens into layer l's linear part and, for a ring layer, the
// recurrent state after them: in one step (`chunk`: the state after the last token only) or one
// step per token (as a verify forward that keeps each token's state). Appends what it returned.
template <class C>
void linear_step(C& cache, std::int64_t l, std::int64_t first, std::int64_t q, bool chunk, std::vector<double>& out) {
  const bool ring = has_ring(cache, l);
  std::vector<float> rec(rec_size, 0.0f);
  const auto read = [&](const auto& lin) {
    const auto held = lin.recurrent_state(0);
    for (std::int64_t j = 0; j < held.size(); ++j) rec[static_cast<std::size_t>(j)] = held[j];
  };
  cache.visit_layer(l, [&](const auto& st) {
    if constexpr (requires { st.linear_part(); })
      read(st.linear_part());
    else if constexpr (requires { st.recurrent_state(0); })
      read(st);
  });
  const auto write = [&](std::int64_t from, std::int64_t count) {
    const auto x = cache.update_conv_state(conv_columns(from, count, l), l, 0, kernel);
    const std::int64_t width = x.extent(2), shown = std::min(width, kernel - 1 + count);
    for (std::int64_t c = 0; c < channels; ++c)
      for (std::int64_t t = width - shown; t < width; ++t) out.push_back(x[c * width + t]);
    if (!ring) return;
    for (std::int64_t t = width - count; t < width; ++t) advance(rec, x, t);
    Conv r(1, 2, 2);
    std::copy(rec.begin(), rec.end(), r.data());
    const auto back = cache.update_recurrent_state(r, l, 0);
    for (std::int64_t j = 0; j < back.size(); ++j) out.push_back(back[j]);
  };
  if (chunk || !ring)
    write(first, q);
  else
    for (std::int64_t s = 0; s < q; ++s) write(first + s, 1);
}

// One step of q tokens from position `first` into every layer: K/V where the layer has them, conv
// columns (and for ring layers recurrent states, see linear_step) where it has a linear part.
// Returns what the step returned, flat (attention's input, the conv window: the last
// kernel - 1 + q columns, the recurrent states).
template <class C>
std::vector<double> step(C& cache, std::int64_t first, std::int64_t q, bool chunk = false) {
  std::vector<double> out;
  for (std::int64_t l = 0; l < cache.size(); ++l) {
    const bool linear = cache.is_linear()[static_cast<std::size_t>(l)];
    if (!linear) {
      const auto kv = cache.update(tokens(first, q, l, 0), tokens(first, q, l, 1), l);
      for (const auto& v : {kvc_test::flatten(kv.keys), kvc_test::flatten(kv.values)})
        out.insert(out.end(), v.begin(), v.end());
    }
    const bool conv = cache.visit_layer(l, [](const auto& st) { return requires { st.number_of_states(); }; });
    if constexpr (has_conv_v<C>) {
      if (conv) linear_step(cache, l, first, q, chunk, out);
    }
  }
  return out;
}

// What attention and the conv read from the cache: lengths, mask sizes, the window of each sliding
// layer (a recording or slack layer may hold more, which attention never reads), the last conv
// columns, and what a step of two more tokens returns (on a copy).
template <class C>
std::vector<double> observables(const C& cache, std::int64_t seen) {
  std::vector<double> out;
  for (std::int64_t l = 0; l < cache.size(); ++l) {
    if (!cache.is_linear()[static_cast<std::size_t>(l)]) {
      const auto [kl, ko] = cache.get_mask_sizes(2, l);
      out.insert(out.end(),
                 {static_cast<double>(cache.get_seq_length(l)), static_cast<double>(kl), static_cast<double>(ko)});
      const auto kv = cache.stored(l);
      const std::int64_t held = kv.keys.extent(2);
      const std::int64_t shown = cache.is_sliding(l) ? std::min(held, window - 1) : held;
      const auto keys = kvc_test::flatten(kv.keys), values = kvc_test::flatten(kv.values);
      for (std::int64_t h = 0; h < heads; ++h)
        for (std::int64_t s = held - shown; s < held; ++s)
          for (std::int64_t d = 0; d < dim; ++d) {
            const auto i = static_cast<std::size_t>((h * held + s) * dim + d);
            out.push_back(keys[i]);
            out.push_back(values[i]);
          }
    }
    // The last `kernel` conv columns, of a linear layer or of a hybrid's linear part.
    const auto last_columns = [&](const kvc::StateView<float>& c) {
      const std::int64_t width = c.rank == 3 ? c.extent(2) : 0, shown = std::min(width, kernel);
      for (std::int64_t ch = 0; ch < channels; ++ch)
        for (std::int64_t t = width - shown; t < width; ++t) out.push_back(c[ch * width + t]);
    };
    cache.visit_layer(l, [&](const auto& st) {
      const auto add = [&](const auto& lin) {
        last_columns(lin.conv_state(0));
        const auto rec = lin.recurrent_state(0);
        for (std::int64_t j = 0; j < rec.size(); ++j) out.push_back(rec[j]);
        out.push_back(lin.has_previous_state(0));
      };
      if constexpr (requires { st.linear_part(); })
        add(st.linear_part());
      else if constexpr (requires { st.conv_state(0); })
        add(st);
    });
  }
  C probe = cache;
  const auto next = step(probe, seen, 2);
  out.insert(out.end(), next.begin(), next.end());
  return out;
}

// Random steps of 1 to 4 tokens; now and then a crop of 1 to 6 tokens. Within the cache's
// rollback_depth() the crop must give what a cache fed the remaining tokens (the same steps, the
// last ones cut short) gives; past it, it must throw and change nothing.
template <class C, class Make>
void check_random_rollbacks(const Make& make, std::uint32_t seed, int& exact, int& refused) {
  std::mt19937 rng(seed);
  const auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  C cache = make();
  std::vector<std::pair<std::int64_t, bool>> steps;  // the tokens of each step the cache holds, chunked
  std::int64_t seen = 0;
  std::string log;
  for (int op = 0; op < 40; ++op) {
    if (uniform(0, 2) > 0 || seen == 0) {
      const std::int64_t q = uniform(1, 4);
      const bool chunk = uniform(0, 4) == 0;  // ring layers: the state after the last token only
      step(cache, seen, q, chunk);
      log += (chunk ? " S" : " s") + std::to_string(q);
      steps.emplace_back(q, chunk);
      seen += q;
      continue;
    }
    const std::int64_t n = uniform(1, 6), depth = cache.rollback_depth();
    CAPTURE(seen);
    CAPTURE(n);
    CAPTURE(depth);
    if (n > depth) {
      const auto before = kvc_test::take_snapshot(cache);
      CHECK_THROWS_AS(cache.crop(-n), kvc::RuntimeError);
      CHECK(kvc_test::take_snapshot(cache) == before);
      ++refused;
      continue;
    }
    cache.crop(-n);
    log += " c" + std::to_string(n);
    std::int64_t drop = std::min(n, seen);
    seen -= drop;
    while (drop > 0) {
      const std::int64_t cut = std::min(drop, steps.back().first);
      steps.back().first -= cut;
      drop -= cut;
      if (steps.back().first == 0) steps.pop_back();
    }
    C fresh = make();
    std::int64_t pos = 0;
    for (const auto& [q, chunk] : steps) {
      step(fresh, pos, q, chunk);
      pos += q;
    }
    const auto got = observables(cache, seen), want = observables(fresh, seen);
    CAPTURE(cache.layer_name(0));
    CAPTURE(got.size());
    CAPTURE(want.size());
    const auto at = std::mismatch(got.begin(), got.end(), want.begin(), want.end()).first - got.begin();
    CAPTURE(at);
    CAPTURE(log);  // the operations: s<q> a step of q tokens (S<q>: one linear step), c<n> crop(-n)
    REQUIRE(got == want);
    ++exact;
  }
}

template <class Kind>
using One = kvc::Cache<kvc::Layers<Kind>>;

template <class Kind>
void check_kind(const Kind& kind, bool record, int& exact, int& refused) {
  using C = One<Kind>;
  const auto make = [&] {
    C c(std::vector<typename C::kind_variant>{kind, kind});
    if (record) c.activate_past_recording();
    return c;
  };
  for (std::uint32_t seed = 1; seed <= 6; ++seed) check_random_rollbacks<C>(make, seed, exact, refused);
}

std::string crop_message(auto& cache, std::int64_t n) {
  try {
    cache.crop(n);
  } catch (const kvc::RuntimeError& e) {
    return e.what();
  }
  return "no exception";
}

}  // namespace

TEST_CASE("rollback bounds: what a cache type guarantees at compile time") {
  static_assert(kvc::Cache<kvc::Layers<kvc::DynamicLayer>>::rollback_bound == kvc::unbounded_rollback);
  static_assert(kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::DynamicIndexedLayer>>::rollback_bound ==
                kvc::unbounded_rollback);
  static_assert(kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer>>::rollback_bound == 0);
  static_assert(kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::StaticLayer>>::rollback_bound == 0);
  static_assert(kvc::Cache<kvc::Layers<kvc::LinearAttentionAndFullAttentionLayer>>::rollback_bound == 0);
  static_assert(kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>>::rollback_bound == 0);
  static_assert(kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::SpeculativeSlidingWindowLayer<3>>>::rollback_bound == 3);
  static_assert(
      kvc::Cache<
          kvc::Layers<kvc::SpeculativeSlidingWindowLayer<5>, kvc::SpeculativeSlidingWindowLayer<2>>>::rollback_bound ==
      2);
  kvc::Cache<kvc::Layers<kvc::DynamicLayer>> dynamic(kvc::DynamicLayer{});
  kvc::require_rollback<1000>(dynamic);  // compiles: a dynamic cache rolls back any count
  CHECK(dynamic.rollback_depth() == kvc::unbounded_rollback);
}

TEST_CASE("SpeculativeSlidingWindowLayer<R>: a slack of at least R, kept through copies, batch operations and saves") {
  using Spec = kvc::SpeculativeSlidingWindowLayer<3>;
  using C = One<Spec>;
  C cache(Spec{{.sliding_window = window}});
  CHECK(cache.visit_layer(0, [](const auto& l) { return l.rollback_slack(); }) == 3);
  C wider(Spec{{.sliding_window = window, .rollback_slack = 5}});  // a larger run-time slack stays
  CHECK(wider.visit_layer(0, [](const auto& l) { return l.rollback_slack(); }) == 5);
  CHECK(cache.layer_name(0) == "DynamicSlidingWindowLayer");
  // A speculative loop: draft 3 tokens, accept some, take the rest back; the depth never falls
  // below what the last step added.
  std::mt19937 rng(9);
  std::int64_t seen = 0;
  for (int s = 0; s < 12; ++s) {
    step(cache, seen, 3);
    seen += 3;
    CHECK(cache.rollback_depth() >= 3);
    const std::int64_t rejected = std::uniform_int_distribution<std::int64_t>(0, 3)(rng);
    cache.crop(-rejected);
    seen -= rejected;
  }
  C fresh(Spec{{.sliding_window = window}});
  step(fresh, 0, seen);
  CHECK(observables(cache, seen) == observables(fresh, seen));
  // Saved and loaded: the same tokens, slack and depth.
  std::stringstream saved;
  kvc::save(cache, saved);
  C loaded(Spec{{.sliding_window = window}});
  kvc::load(loaded, saved);
  CHECK(observables(loaded, seen) == observables(cache, seen));
  CHECK(loaded.rollback_depth() == cache.rollback_depth());
  // The kind survives the operations that rebuild the layer.
  cache.batch_repeat_interleave(2);
  CHECK(cache.visit_layer(0, [](const auto& l) { return l.kind().rollback_slack; }) == 3);
  CHECK(cache.visit_layer(0, [](const auto& l) { return std::is_same_v<std::decay_t<decltype(l.kind())>, Spec>; }));
}

TEST_CASE("rollback depth per kind, and the refusal past it with the message") {
  SUBCASE("a sliding layer: every token until the window slides, then its slack") {
    One<kvc::DynamicSlidingWindowLayer> plain(kvc::DynamicSlidingWindowLayer{window});
    step(plain, 0, 3);
    CHECK(plain.rollback_depth() == kvc::unbounded_rollback);
    step(plain, 3, 1);  // 4 tokens seen: the first left the window
    CHECK(plain.rollback_depth() == 0);
    One<kvc::DynamicSlidingWindowLayer> slack(kvc::DynamicSlidingWindowLayer{window, 2});
    step(slack, 0, 5);
    CHECK(slack.rollback_depth() == kvc::unbounded_rollback);  // 5 = W - 1 + 2: nothing dropped
    step(slack, 5, 3);
    CHECK(slack.rollback_depth() == 2);
    CHECK(slack.stored(0).keys.extent(2) == window - 1);  // the slack's tokens are not shown
    const auto before = kvc_test::take_snapshot(slack);
    CHECK(crop_message(slack, -3) ==
          "`crop` would remove 3 tokens, but this DynamicSlidingWindowLayer can roll back only 2 exactly (the tokens "
          "it keeps past its window: rollback_slack, or every token while recording)");
    CHECK(kvc_test::take_snapshot(slack) == before);
    CHECK(crop_message(slack, 1) ==
          "Once the sliding window size has been reached, `DynamicSlidingWindowLayer` can only be cropped by passing "
          "a negative int, to specify how many tokens to remove");
    slack.crop(-2);
    CHECK(slack.get_seq_length() == 6);
    CHECK(slack.rollback_depth() == 0);
    CHECK_THROWS_WITH_AS(One<kvc::DynamicSlidingWindowLayer>(kvc::DynamicSlidingWindowLayer{window, -1}),
                         "DynamicSlidingWindowLayer: rollback_slack must be 0 or more, got -1", kvc::ValueError);
  }
  SUBCASE("a quantized layer: the tokens of its residual") {
    One<kvc::QuantoQuantizedLayer> q(kvc::QuantoQuantizedLayer{4, 0, 0, dim, 4});
    CHECK(q.rollback_depth() == kvc::unbounded_rollback);  // no layer yet
    step(q, 0, 2);                                         // the first update quantizes what it gets
    CHECK(q.rollback_depth() == 0);
    step(q, 2, 2);
    const std::int64_t residual = q.visit_layer(0, [](const auto& l) { return l.residual_tokens(); });
    REQUIRE(residual == 2);
    CHECK(q.rollback_depth() == residual);
    const auto before = kvc_test::take_snapshot(q);
    CHECK(crop_message(q, -(residual + 1)) ==
          "`crop` would remove " + std::to_string(residual + 1) +
              " tokens, but this QuantoQuantizedLayer can roll back only " + std::to_string(residual) +
              " exactly (the tokens of its full-precision residual; the quantized history cannot be cut exactly)");
    CHECK(kvc_test::take_snapshot(q) == before);
  }
  SUBCASE("a linear layer: nothing once a recurrent state was written") {
    kvc::Cache<kvc::Layers<kvc::LinearAttentionLayer, kvc::DynamicLayer>> c(
        std::vector<kvc::Cache<kvc::Layers<kvc::LinearAttentionLayer, kvc::DynamicLayer>>::kind_variant>{
            kvc::LinearAttentionLayer{}, kvc::DynamicLayer{}});
    c.activate_past_recording();
    step(c, 0, 3);
    CHECK(c.rollback_depth() == kvc::unbounded_rollback);  // conv states recorded, no recurrent state
    Conv rec(1, 2, 2);
    rec.setConstant(1.0f);
    c.update_recurrent_state(rec, 0, 0);
    CHECK(c.rollback_depth() == 0);
    const auto before = kvc_test::take_snapshot(c);
    CHECK(crop_message(c, -1) ==
          "`crop` would remove 1 tokens, but this LinearAttentionLayer can roll back only 0 exactly (its recurrent "
          "states hold only the last update)");
    CHECK(kvc_test::take_snapshot(c) == before);
    c.crop(0);  // removes nothing: allowed
  }
  SUBCASE("a static layer in the cache: depth 0") {
    kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::StaticLayer>> c(
        std::vector<kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::StaticLayer>>::kind_variant>{kvc::DynamicLayer{},
                                                                                                kvc::StaticLayer{8}});
    CHECK(c.rollback_depth() == 0);
  }
}

TEST_CASE("model-checked rollback: a crop within the depth equals a cache that never saw the tokens") {
  int exact = 0, refused = 0;
  check_kind(kvc::DynamicLayer{}, false, exact, refused);
  check_kind(kvc::DynamicSlidingWindowLayer{window}, false, exact, refused);
  check_kind(kvc::DynamicSlidingWindowLayer{window, 3}, false, exact, refused);
  check_kind(kvc::DynamicSlidingWindowLayer{window, 2}, true, exact, refused);
  check_kind(kvc::SpeculativeSlidingWindowLayer<2>{{window, 1}}, false, exact, refused);
  check_kind(kvc::QuantoQuantizedLayer{4, 0, 0, dim, 5}, false, exact, refused);
  check_kind(kvc::HQQQuantizedLayer{4, 1, 1, dim, 4, true}, false, exact, refused);
  check_kind(kvc::DynamicIndexedLayer{}, false, exact, refused);
  check_kind(kvc::LinearAttentionLayer{}, true, exact, refused);
  check_kind(kvc::LinearAttentionAndSlidingWindowAttentionLayer{{window, 2}, 1}, true, exact, refused);
  check_kind(kvc::LinearAttentionAndFullAttentionLayer{}, true, exact, refused);
  // Rings of recurrent and conv states: alone, recording, and in hybrids.
  check_kind(kvc::LinearAttentionLayer{1, 4}, false, exact, refused);
  check_kind(kvc::LinearAttentionLayer{1, 3}, true, exact, refused);
  check_kind(kvc::SpeculativeLinearAttentionLayer<2>{}, false, exact, refused);
  check_kind(kvc::LinearAttentionAndSlidingWindowAttentionLayer{{window, 3}, 1, 4}, false, exact, refused);
  check_kind(kvc::LinearAttentionAndFullAttentionLayer{{}, 1, 3}, true, exact, refused);
  // Both outcomes happen often enough for the test to mean something.
  CHECK(exact > 100);
  CHECK(refused > 20);
}

// Layer l's recurrent state (slot 0), flat; empty for a layer without one.
template <class C>
std::vector<double> recurrent_of(const C& cache, std::int64_t l) {
  return cache.visit_layer(l, [](const auto& st) {
    std::vector<double> out;
    if constexpr (requires { st.recurrent_state(0); }) {
      const auto rec = st.recurrent_state(0);
      for (std::int64_t j = 0; j < rec.size(); ++j) out.push_back(rec[j]);
    }
    return out;
  });
}

template <class C>
std::int64_t ring_of(const C& cache, std::int64_t l) {
  return cache.visit_layer(l, [](const auto& st) -> std::int64_t {
    if constexpr (requires { st.rollback_states(); })
      return st.rollback_states();
    else
      return -1;
  });
}

TEST_CASE("a ring of linear states: one-token steps roll back, longer steps and uncounted updates stop it") {
  using Ring = kvc::LinearAttentionLayer;
  using C = kvc::Cache<kvc::Layers<Ring, kvc::DynamicLayer>>;
  const auto make = [] { return C(std::vector<C::kind_variant>{Ring{1, 3}, kvc::DynamicLayer{}}); };
  CHECK_THROWS_WITH_AS(C(std::vector<C::kind_variant>{Ring{1, -1}, kvc::DynamicLayer{}}),
                       "LinearAttentionLayer: rollback_states must be 0 or more, got -1", kvc::ValueError);
  C cache = make();
  step(cache, 0, 5, true);  // a prefill: one step of 5 tokens
  CHECK(cache.rollback_depth() == 0);
  const auto before = kvc_test::take_snapshot(cache);
  CHECK(crop_message(cache, -1) ==
        "`crop` would remove 1 tokens, but this LinearAttentionLayer can roll back only 0 exactly (it keeps its "
        "states from before each of its last 3 steps; only steps of one token each can be undone)");
  CHECK(kvc_test::take_snapshot(cache) == before);
  const std::int64_t empty_bytes = cache.visit_layer(0, [](const auto& l) { return l.bytes(); });
  step(cache, 5, 2);  // two one-token steps
  CHECK(cache.rollback_depth() == 2);
  step(cache, 7, 4);  // four more: the ring keeps the last 3
  CHECK(cache.rollback_depth() == 3);
  // Full ring: a step reuses the oldest entry's buffers.
  const std::int64_t full_bytes = cache.visit_layer(0, [](const auto& l) { return l.bytes(); });
  CHECK(full_bytes > empty_bytes);
  step(cache, 11, 2);
  CHECK(cache.visit_layer(0, [](const auto& l) { return l.bytes(); }) == full_bytes);

  SUBCASE("saved and loaded, the ring still rolls back") {
    std::stringstream saved;
    kvc::save(cache, saved);
    C loaded = make();
    kvc::load(loaded, saved);
    CHECK(loaded.rollback_depth() == 3);
    cache.crop(-3);
    loaded.crop(-3);
    auto got = kvc_test::take_snapshot(loaded), want = kvc_test::take_snapshot(cache);
    CHECK(got.bytes < want.bytes);  // the original keeps the popped entries' buffers for its next steps
    got.bytes = want.bytes;
    CHECK(got == want);
    CHECK(observables(loaded, 10) == observables(cache, 10));
    C other = C(std::vector<C::kind_variant>{Ring{1, 2}, kvc::DynamicLayer{}});
    std::stringstream again;
    kvc::save(cache, again);
    CHECK_THROWS_AS(kvc::load(other, again), kvc::StateError);  // another rollback_states
  }
  SUBCASE("batch operations carry the ring") {
    C one = cache;
    one.crop(-2);
    const auto want = recurrent_of(one, 0);
    cache.batch_repeat_interleave(2);
    cache.crop(-2);
    const auto got = recurrent_of(cache, 0);
    REQUIRE(got.size() == 2 * want.size());
    CHECK(std::equal(want.begin(), want.end(), got.begin()));
    CHECK(std::equal(want.begin(), want.end(), got.begin() + static_cast<std::ptrdiff_t>(want.size())));
  }
  SUBCASE("a recurrent update with no conv step before it empties the ring") {
    Conv rec(1, 2, 2);
    rec.setConstant(0.5f);
    cache.update_recurrent_state(rec, 0, 0);
    CHECK(cache.rollback_depth() == 0);
    step(cache, 13, 1);
    CHECK(cache.rollback_depth() == 1);
  }
  SUBCASE("reset empties the ring; every step since is kept: any count rolls back") {
    cache.reset();
    auto at_reset = kvc_test::take_snapshot(cache);
    step(cache, 0, 2);
    CHECK(cache.rollback_depth() == kvc::unbounded_rollback);
    cache.crop(-5);  // back to before the first step: the zeroed states reset left
    const auto now = kvc_test::take_snapshot(cache);
    CHECK(now.layers[0] == at_reset.layers[0]);  // the linear layer (a cropped DynamicLayer keeps its shape)
    CHECK(cache.get_seq_length(1) == 0);
    CHECK(recurrent_of(cache, 0) == std::vector<double>(4, 0.0));
  }
}

TEST_CASE("SpeculativeLinearAttentionLayer<R>: R steps of rollback promised by the type") {
  using Spec = kvc::SpeculativeLinearAttentionLayer<4>;
  using C = kvc::Cache<kvc::Layers<Spec, kvc::SpeculativeSlidingWindowLayer<4>, kvc::DynamicLayer>>;
  static_assert(C::rollback_bound == 4);
  static_assert(kvc::Cache<kvc::Layers<kvc::SpeculativeLinearAttentionLayer<2>, kvc::DynamicLayer>>::rollback_bound ==
                2);
  static_assert(kvc::Cache<kvc::Layers<kvc::LinearAttentionLayer>>::rollback_bound == 0);
  C cache(std::vector<C::kind_variant>{Spec{}, kvc::SpeculativeSlidingWindowLayer<4>{{window}}, kvc::DynamicLayer{}});
  kvc::require_rollback<4>(cache);
  CHECK(ring_of(cache, 0) == 4);
  CHECK(cache.layer_name(0) == "LinearAttentionLayer");
  // Draft 4 tokens one by one, reject some, take them back: equal to never having seen them.
  std::mt19937 rng(5);
  std::int64_t seen = 0;
  step(cache, 0, 6, true);
  seen = 6;
  for (int round = 0; round < 10; ++round) {
    step(cache, seen, 4);
    seen += 4;
    CHECK(cache.rollback_depth() >= 4);
    const std::int64_t rejected = std::uniform_int_distribution<std::int64_t>(0, 4)(rng);
    cache.crop(-rejected);
    seen -= rejected;
  }
  C fresh(std::vector<C::kind_variant>{Spec{}, kvc::SpeculativeSlidingWindowLayer<4>{{window}}, kvc::DynamicLayer{}});
  step(fresh, 0, 6, true);
  step(fresh, 6, seen - 6);
  CHECK(observables(cache, seen) == observables(fresh, seen));
  cache.batch_repeat_interleave(2);
  CHECK(cache.visit_layer(0, [](const auto& l) { return std::is_same_v<std::decay_t<decltype(l.kind())>, Spec>; }));
}

TEST_CASE("a ring with past recording turned on later, and after reset") {
  using C = kvc::Cache<kvc::Layers<kvc::SpeculativeLinearAttentionLayer<3>>>;
  const auto depth_and_reload = [](C& c) {
    std::stringstream saved;
    kvc::save(c, saved);
    C loaded(kvc::SpeculativeLinearAttentionLayer<3>{});
    kvc::load(loaded, saved);
    CHECK(loaded.rollback_depth() == c.rollback_depth());
    return c.rollback_depth();
  };
  SUBCASE("recording after two one-token steps keeps their rollback (the type promises 3)") {
    C cache(kvc::SpeculativeLinearAttentionLayer<3>{});
    step(cache, 0, 5, true);
    step(cache, 5, 2);
    cache.activate_past_recording();
    CHECK(depth_and_reload(cache) == 2);
    C want(kvc::SpeculativeLinearAttentionLayer<3>{});
    step(want, 0, 5, true);
    cache.crop(-2);
    CHECK(observables(cache, 5) == observables(want, 5));
    step(cache, 5, 3);  // recorded steps: their entries hold no conv state, the columns roll back
    CHECK(depth_and_reload(cache) == 3);
    cache.crop(-3);
    CHECK(observables(cache, 5) == observables(want, 5));
  }
  SUBCASE("reset: nothing to roll back, any crop keeps the reset state") {
    C cache(kvc::SpeculativeLinearAttentionLayer<3>{});
    step(cache, 0, 3);
    cache.reset();
    CHECK(cache.rollback_depth() == kvc::unbounded_rollback);
    cache.crop(-1);
    cache.activate_past_recording();  // a reset slot holds no columns to count as trimmed
    step(cache, 0, 1);
    CHECK(depth_and_reload(cache) == kvc::unbounded_rollback);
  }
  SUBCASE("a recurrent update before any step: the tokens before the ring are unknown") {
    C cache(kvc::SpeculativeLinearAttentionLayer<3>{});
    Conv rec(1, 2, 2);
    rec.setConstant(0.25f);
    cache.update_recurrent_state(rec, 0, 0);
    step(cache, 0, 2);
    CHECK(depth_and_reload(cache) == 2);  // not unbounded: the state before them was written
  }
}
