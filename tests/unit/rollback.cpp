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

// One step of q tokens from position `first` into every layer: K/V where the layer has them, conv
// columns where it has a linear part. Returns what the step returned, flat (attention's input and
// the conv window: the last kernel - 1 + q columns).
template <class C>
std::vector<double> step(C& cache, std::int64_t first, std::int64_t q) {
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
      if (conv) {
        const auto x = cache.update_conv_state(conv_columns(first, q, l), l, 0, kernel);
        const std::int64_t width = x.extent(2), shown = std::min(width, kernel - 1 + q);
        for (std::int64_t c = 0; c < channels; ++c)
          for (std::int64_t t = width - shown; t < width; ++t) out.push_back(x[c * width + t]);
      }
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
      if constexpr (requires { st.linear_part(); })
        last_columns(st.linear_part().conv_state(0));
      else if constexpr (requires { st.conv_state(0); })
        last_columns(st.conv_state(0));
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
  std::vector<std::int64_t> steps;  // the tokens of each step the cache holds
  std::int64_t seen = 0;
  std::string log;
  for (int op = 0; op < 40; ++op) {
    if (uniform(0, 2) > 0 || seen == 0) {
      const std::int64_t q = uniform(1, 4);
      step(cache, seen, q);
      log += " s" + std::to_string(q);
      steps.push_back(q);
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
      const std::int64_t cut = std::min(drop, steps.back());
      steps.back() -= cut;
      drop -= cut;
      if (steps.back() == 0) steps.pop_back();
    }
    C fresh = make();
    std::int64_t pos = 0;
    for (const std::int64_t q : steps) {
      step(fresh, pos, q);
      pos += q;
    }
    const auto got = observables(cache, seen), want = observables(fresh, seen);
    CAPTURE(cache.layer_name(0));
    CAPTURE(got.size());
    CAPTURE(want.size());
    const auto at = std::mismatch(got.begin(), got.end(), want.begin(), want.end()).first - got.begin();
    CAPTURE(at);
    CAPTURE(log);  // the operations: s<q> a step of q tokens, c<n> crop(-n)
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
  // Both outcomes happen often enough for the test to mean something.
  CHECK(exact > 100);
  CHECK(refused > 20);
}
