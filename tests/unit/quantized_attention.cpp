// kvc::attend_quantized (attention straight from a quantized layer's codes) against attention in
// double over the values the layer holds, and against kvc::attend (attention over what
// transformers' update returns) for the codes: two caches of the same quantized layer kind fed the
// same steps, across several flushes of the residual. The outputs agree to the output's rounding,
// the two layers hold the same codes, and the fused one keeps no dequantized workspace.

#include <algorithm>
#include <cmath>
#include <optional>
#include <random>
#include <sstream>
#include <string>

#include <kvc/kvc.hpp>
#include <kvc/quantized_attention.hpp>
#include <kvc/rotation.hpp>
#include <kvc/state.hpp>

#include "../support/kvc_test.hpp"
#include "../support/sanitized.hpp"

namespace {

template <class T>
kvc::TensorView<T> view(const kvc::HostTensor<T>& t) {
  return kvc::HostStorage<T>::input_view(t);
}

// Attention in double against T's output: one ulp of T at |x| < 8 for the 16-bit types (the output
// rounded, after a float accumulation that may land it on the other side of a rounding step); float
// accumulation over peaked softmaxes (scores up to ~100) for float.
template <class T>
double tolerance() {
  if constexpr (std::is_same_v<T, Eigen::half>) return 1.0 / 256 + 1e-4;
  if constexpr (std::is_same_v<T, Eigen::bfloat16>) return 1.0 / 32 + 1e-4;
  if constexpr (std::is_same_v<T, double>) return 1e-12;
  return 1e-4;
}

// The workspace and code bytes of layer 0.
template <class Cache>
std::pair<std::int64_t, std::vector<std::uint8_t>> layer_state(const Cache& c) {
  return c.visit_layer(0, [](const auto& st) {
    std::vector<std::uint8_t> codes;
    for (const auto* h : {&st.quantized_keys(), &st.quantized_values()})
      for (std::size_t i = 0; i < h->chunks(); ++i)
        codes.insert(codes.end(), h->chunk(i).packed().begin(), h->chunk(i).packed().end());
    return std::pair{st.workspace_bytes(), codes};
  });
}

// What layer 0 holds followed by `fresh`, as doubles [B, H, n, D]: the history dequantized in float
// (the values attend_quantized reads; rows of a rotated history rotated back in double), the
// residual, then the step's tokens.
template <class Cache, class T>
std::pair<kvc::HostTensor<double>, kvc::HostTensor<double>> held_then(const Cache& c, const kvc::HostTensor<T>& k,
                                                                      const kvc::HostTensor<T>& v) {
  const std::int64_t B = k.dimension(0), H = k.dimension(1), q = k.dimension(2), D = k.dimension(3);
  const std::int64_t past = c.get_seq_length(0), n = past + q;
  kvc::HostTensor<double> K(B, H, n, D), V(B, H, n, D);
  if (past > 0)
    c.visit_layer(0, [&](const auto& st) {
      std::vector<float> buf;
      std::vector<double> row(static_cast<std::size_t>(D));
      std::int64_t start = 0;
      for (std::size_t i = 0; i < st.quantized_keys().chunks(); ++i) {
        const auto &ck = st.quantized_keys().chunk(i), &cv = st.quantized_values().chunk(i);
        const std::int64_t len = ck.tokens();
        buf.resize(static_cast<std::size_t>(len * D));
        for (std::int64_t blk = 0; blk < B * H; ++blk)
          for (auto [t, to] : {std::pair{&ck, &K}, std::pair{&cv, &V}}) {
            t->decode_rows(blk, 0, len, buf.data());
            const bool rotated = t == &ck ? st.options().rotate_keys : st.options().rotate_values;
            for (std::int64_t s = 0; s < len; ++s) {
              for (std::int64_t d = 0; d < D; ++d)
                row[static_cast<std::size_t>(d)] = buf[static_cast<std::size_t>(s * D + d)];
              if (rotated) kvc::hadamard_rotate(row.data(), 1, D);
              for (std::int64_t d = 0; d < D; ++d)
                (*to)(blk / H, blk % H, start + s, d) = row[static_cast<std::size_t>(d)];
            }
          }
        start += len;
      }
      const auto r = st.residual_kv();
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t h = 0; h < H; ++h)
          for (std::int64_t s = 0; s < st.residual_tokens(); ++s)
            for (std::int64_t d = 0; d < D; ++d) {
              K(b, h, start + s, d) = static_cast<double>(r.keys(b, h, s, d));
              V(b, h, start + s, d) = static_cast<double>(r.values(b, h, s, d));
            }
    });
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t s = 0; s < q; ++s)
        for (std::int64_t d = 0; d < D; ++d) {
          K(b, h, past + s, d) = static_cast<double>(k(b, h, s, d));
          V(b, h, past + s, d) = static_cast<double>(v(b, h, s, d));
        }
  return {K, V};
}

// Two caches of one quantized layer kind fed the same steps: the fused one (attend_quantized)
// against attention in double over the values it holds, and against the update path (kvc::attend
// on the twin) for the codes: quantized at the same moments, to the same codes.
// The first step is a prompt of `prompt` tokens: past 512 keys, the decode steps after it are cut
// into key splits.
template <class T, class Kind>
void compare(const Kind& kind, std::optional<std::int64_t> window, unsigned seed, std::int64_t prompt = 20,
             double tol = tolerance<T>()) {
  using Cache = kvc::Cache<kvc::Replicate<Kind>, kvc::HostStorage<T>>;
  Cache exact(kind), fused(kind);
  std::mt19937 rng(seed);
  const std::int64_t B = 2, Hq = 4, Hkv = 2, D = 32;
  const std::vector<std::int64_t> steps = {prompt, 1, 1, 1, 5, 1, 1, 1, 1, 1, 1, 1, 1,
                                           3,      1, 1, 1, 1, 1, 1, 1, 1, 9, 1, 1};
  double worst = 0;
  for (const std::int64_t q : steps) {
    const auto qs = kvc_test::random_tensor<T>(B, Hq, q, D, rng);
    const auto ks = kvc_test::random_tensor<T>(B, Hkv, q, D, rng);
    const auto vs = kvc_test::random_tensor<T>(B, Hkv, q, D, rng);
    const kvc::AttendOptions opts{.sliding_window = window};
    const auto [K, V] = held_then(fused, ks, vs);
    const std::int64_t past = fused.get_seq_length(0);
    kvc::HostTensor<double> qd = qs.template cast<double>();
    const auto want = kvc::scaled_dot_product_attention<double>(
        view(qd), view(K), view(V), kvc::AttentionMask{past + q, 0, past, window, true, std::nullopt, {}});
    (void)kvc::attend(exact, 0, qs, ks, vs, opts);
    const auto got = kvc::attend_quantized(fused, 0, view(qs), view(ks), view(vs), opts);
    REQUIRE(got.dimension(2) == q);
    for (std::int64_t i = 0; i < got.size(); ++i)
      worst = std::max(worst, std::abs(static_cast<double>(got.data()[i]) - want.data()[i]));
    CHECK(fused.get_seq_length(0) == exact.get_seq_length(0));
    const auto [ws, codes] = layer_state(fused);
    CHECK(ws == 0);
    CHECK(codes == layer_state(exact).second);  // quantized at the same moments, to the same codes
  }
  CAPTURE(worst);
  CHECK(worst <= tol);
  CHECK(fused.bytes() < exact.bytes());
}

}  // namespace

TEST_CASE("attend_quantized: attention over the values held (double reference), update's codes, no workspace") {
  const kvc::QuantoQuantizedLayer quanto{
      .nbits = 4, .axis_key = 0, .axis_value = 0, .q_group_size = 16, .residual_length = 6};
  const kvc::QuantoQuantizedLayer quanto_seq{
      .nbits = 2, .axis_key = -1, .axis_value = -1, .q_group_size = 8, .residual_length = 5};
  const kvc::HQQQuantizedLayer hqq{
      .nbits = 4, .axis_key = 1, .axis_value = 1, .q_group_size = 32, .residual_length = 7};
  // Keys and values at their own widths (value_nbits): each side read from its own codes.
  const kvc::HQQQuantizedLayer hqq_split{
      .nbits = 8, .axis_key = 1, .axis_value = 1, .q_group_size = 32, .residual_length = 7, .value_nbits = 2};
  const kvc::QuantoQuantizedLayer quanto_split{
      .nbits = 2, .axis_key = -1, .axis_value = 0, .q_group_size = 8, .residual_length = 5, .value_nbits = 4};
  // KIVI's groupings, append-only: the history is a list of chunks.
  const kvc::QuantoQuantizedLayer kivi{
      .nbits = 2, .axis_key = -1, .axis_value = 0, .q_group_size = 4, .residual_length = 5, .append_only = true};
  // Under the sanitizers, one seed: the second takes the same paths with other values.
  for (unsigned seed = 1; seed <= (kvc_test::sanitized ? 1u : 2u); ++seed) {
    compare<float>(kivi, std::nullopt, seed);
    compare<float>(kivi, 9, seed);
    compare<double>(kivi, std::nullopt, seed);
    compare<float>(quanto, std::nullopt, seed);
    compare<float>(quanto_seq, std::nullopt, seed);
    compare<float>(hqq, std::nullopt, seed);
    compare<float>(hqq_split, std::nullopt, seed);
    compare<float>(quanto_split, std::nullopt, seed);
    compare<float>(quanto, 9, seed);  // the model's sliding window over a quantized history
    compare<Eigen::half>(quanto, std::nullopt, seed);
    compare<Eigen::bfloat16>(hqq, std::nullopt, seed);
    compare<double>(quanto_seq, 12, seed);
    compare<double>(hqq, std::nullopt, seed);
    compare<double>(quanto, 9, seed);
  }
  compare<float>(quanto, 4096, 1);  // a window longer than the context: no key is out of it
  // Decode steps in key splits: long histories, one seed (the test's slowest part under the
  // sanitizers and valgrind; under the sanitizers, the append-only and windowed ones: the window
  // longer than the context runs short above).
  compare<float>(kivi, std::nullopt, 1, 560);
  compare<float>(quanto, 540, 2, 560);
  if (!kvc_test::sanitized) {
    compare<double>(hqq, std::nullopt, 1, 560);
    compare<float>(quanto, std::nullopt, 2, 560);
    compare<float>(quanto, 4096, 1, 560);  // a window longer than the context
  }
}

TEST_CASE("attend_quantized over rotated codes: attention over the values held, rotated back") {
  // rotate_keys / rotate_values: the codes are those of rotated rows; attend_quantized rotates the
  // queries and the full-precision rows (in float) and the output back. Against attention in double
  // over the history dequantized and rotated back, to float rounding, and the same codes as update's.
  kvc::QuantoQuantizedLayer both{.nbits = 4, .q_group_size = 16, .residual_length = 6};
  both.rotate_keys = both.rotate_values = true;
  kvc::QuantoQuantizedLayer kivi_keys = kvc::detail::with_codec<kvc::QuantoCodec>(kvc::kivi_options(2));
  kivi_keys.q_group_size = 4;
  kivi_keys.residual_length = 5;
  kivi_keys.rotate_keys = true;
  kvc::HQQQuantizedLayer hqq_values{
      .nbits = 4, .axis_key = 1, .axis_value = 1, .q_group_size = 32, .residual_length = 7};
  hqq_values.rotate_values = true;
  compare<float>(both, std::nullopt, 1);
  compare<float>(both, 9, 2);
  compare<float>(kivi_keys, std::nullopt, 1);
  compare<float>(hqq_values, std::nullopt, 2);
  compare<Eigen::half>(both, std::nullopt, 1);
  compare<double>(both, std::nullopt, 2, 20, 1e-5);  // the full-precision rows rotated in float
  compare<float>(both, std::nullopt, 1, 560);        // key splits: each rotated back before the merge

  // The residual's rotated copy follows the layer through a save and load and a batch selection:
  // the next steps read the same as on the original.
  using Cache = kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>, kvc::HostStorage<float>>;
  std::mt19937 rng(3);
  Cache a(both);
  for (const std::int64_t q : {9, 1, 1, 2}) {
    const auto x = kvc_test::random_tensor<float>(2, 2, q, 32, rng);
    (void)kvc::attend_quantized(a, 0, view(x), view(x), view(x));
  }
  REQUIRE(a.visit_layer(0, [](const auto& l) { return l.residual_tokens(); }) > 0);
  std::stringstream bytes(std::ios::in | std::ios::out | std::ios::binary);
  kvc::save(a, bytes);
  Cache loaded(both);
  kvc::load(loaded, bytes);
  Cache selected = a;
  selected.batch_select_indices({1});
  for (int step = 0; step < 3; ++step) {
    const auto x = kvc_test::random_tensor<float>(2, 2, 1, 32, rng);
    auto qx = kvc_test::random_tensor<float>(2, 2, 1, 32, rng);
    for (std::int64_t i = 0; i < qx.size(); ++i) qx.data()[i] *= 0.05f;  // every key weighs in
    const auto want = kvc::attend_quantized(a, 0, view(qx), view(x), view(x));
    CHECK(kvc_test::flatten(view(kvc::attend_quantized(loaded, 0, view(qx), view(x), view(x)))) ==
          kvc_test::flatten(view(want)));
    kvc::HostTensor<float> row(1, 2, 1, 32), qrow(1, 2, 1, 32);
    std::copy_n(x.data() + 64, 64, row.data());
    std::copy_n(qx.data() + 64, 64, qrow.data());
    const auto got = kvc_test::flatten(view(kvc::attend_quantized(selected, 0, view(qrow), view(row), view(row))));
    const auto all = kvc_test::flatten(view(want));
    CHECK(got == std::vector<double>(all.begin() + 64, all.end()));
  }
}

TEST_CASE("rotate_keys: 4-bit keys per token with outlier channels, attention error at least 2x lower") {
  // Keys whose first channels are 30x the rest (what real models' keys look like), 4 bits per token
  // (groups along head_dim, one per row of 64): the scale must cover the outliers, so the other
  // channels get few steps, unless the rows are rotated first. Every decode step against an exact
  // DynamicCache; the residual is short so that most keys are read from codes.
  using T = float;
  std::mt19937 rng(5);
  const std::int64_t Hq = 4, Hkv = 2, D = 64, prompt = 96, steps = 40;
  std::normal_distribution<float> dist(0.f, 1.f);
  const auto keys = [&](std::int64_t n) {
    kvc::HostTensor<T> t(1, Hkv, n, D);
    for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] = dist(rng) * (i % D < 2 ? 30.f : 1.f);
    return t;
  };
  using Quanto = kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>, kvc::HostStorage<T>>;
  kvc::QuantoQuantizedLayer plain{.nbits = 4, .q_group_size = 64, .residual_length = 8}, rotated = plain;
  rotated.rotate_keys = true;
  kvc::DynamicCache<T> exact;
  Quanto a(plain), b(rotated);
  double err_plain = 0, err_rotated = 0, norm = 0;
  for (std::int64_t s = 0; s <= steps; ++s) {
    const std::int64_t q = s == 0 ? prompt : 1;
    auto qs = kvc_test::random_tensor<T>(1, Hq, q, D, rng);
    for (std::int64_t i = 0; i < qs.size(); ++i) qs.data()[i] *= 0.1f;  // scores of a few units, not hundreds
    const auto ks = keys(q), vs = kvc_test::random_tensor<T>(1, Hkv, q, D, rng);
    const auto want = kvc::attend(exact, 0, qs, ks, vs);
    const auto got_plain = kvc::attend_quantized(a, 0, view(qs), view(ks), view(vs));
    const auto got_rotated = kvc::attend_quantized(b, 0, view(qs), view(ks), view(vs));
    if (s == 0) continue;
    for (std::int64_t i = 0; i < want.size(); ++i) {
      const double w = want.data()[i];
      err_plain += std::pow(static_cast<double>(got_plain.data()[i]) - w, 2);
      err_rotated += std::pow(static_cast<double>(got_rotated.data()[i]) - w, 2);
      norm += w * w;
    }
  }
  err_plain = std::sqrt(err_plain / norm);
  err_rotated = std::sqrt(err_rotated / norm);
  MESSAGE("relative RMS attention error, int4 keys per token: " << err_plain << ", rotated " << err_rotated);
  CHECK(err_rotated * 2 <= err_plain);
}

TEST_CASE("attend_quantized: views whose heads lie apart read as their contiguous copies") {
  // Every head's [seq, head_dim] block contiguous (what the cache's update takes), the heads and
  // batch rows of a larger buffer: twice the tokens' room per head, half of it unused.
  std::mt19937 rng(21);
  kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>, kvc::HostStorage<float>> spaced(kvc::QuantoQuantizedLayer{}),
      copied(kvc::QuantoQuantizedLayer{});
  for (const std::int64_t n : {40, 3, 1, 5}) {
    CAPTURE(n);
    const auto qb = kvc_test::random_tensor<float>(2, 4, 2 * n, 16, rng),
               kb = kvc_test::random_tensor<float>(2, 2, 2 * n, 16, rng),
               vb = kvc_test::random_tensor<float>(2, 2, 2 * n, 16, rng);
    const auto apart = [&](const kvc::HostTensor<float>& b) {
      const std::int64_t heads = b.dimension(1);
      return kvc::TensorView<float>{b.data(), {2, heads, n, 16}, {heads * 2 * n * 16, 2 * n * 16, 16, 1}};
    };
    const auto a = kvc::attend_quantized(spaced, 0, apart(qb), apart(kb), apart(vb));
    const auto b = kvc::attend_quantized(copied, 0, view(apart(qb).to_tensor()), view(apart(kb).to_tensor()),
                                         view(apart(vb).to_tensor()));
    REQUIRE(a.size() == b.size());
    CHECK(std::equal(a.data(), a.data() + a.size(), b.data()));
  }
}

TEST_CASE("attend_quantized: what it refuses, before anything is stored; full-precision layers go to attend") {
  using Cache = kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>, kvc::HostStorage<float>>;
  Cache cache(kvc::QuantoQuantizedLayer{});
  std::mt19937 rng(3);
  const auto q = kvc_test::random_tensor<float>(1, 4, 2, 16, rng);
  const auto k = kvc_test::random_tensor<float>(1, 2, 2, 16, rng);
  const auto k3 = kvc_test::random_tensor<float>(1, 3, 2, 16, rng);
  (void)kvc::attend_quantized(cache, 0, view(q), view(k), view(k));
  const std::vector<std::uint8_t> mask(8, 1);
  CHECK_THROWS_WITH_AS(kvc::attend_quantized(cache, 0, view(q), view(k), view(k), {.key_padding_mask = mask}),
                       "kvc::attend_quantized: a key_padding_mask is not supported (use kvc::attend)", kvc::ValueError);
  const auto q3 = kvc_test::random_tensor<float>(1, 3, 2, 16, rng);
  CHECK_THROWS_WITH_AS(kvc::attend_quantized(cache, 0, view(q3), view(k), view(k)),
                       "kvc::attend_quantized: queries [1, 3, 2, 16], keys [1, 2, 2, 16] and values [1, 2, 2, 16] do "
                       "not fit each other or the layer (head_dim at most 256)",
                       kvc::ValueError);
  // Keys the layer cannot hold: the cache's update message.
  CHECK_THROWS_WITH_AS(kvc::attend_quantized(cache, 0, view(q), view(k3), view(k3)),
                       "update: keys of shape [1, 3, 2, 16] and values of shape [1, 3, 2, 16] do not match layer 0, "
                       "which holds batch 1, 2 heads, key head_dim 16 and value head_dim 16",
                       kvc::ValueError);
  CHECK(cache.get_seq_length(0) == 2);

  // A layer in full precision is kvc::attend's: the same output, the same tokens stored.
  kvc::DynamicCache<float> dynamic;
  (void)kvc::attend(dynamic, 0, q, k, k);
  kvc::DynamicCache<float> twin = dynamic;
  const auto by_codes_path = kvc::attend_quantized(dynamic, 0, view(q), view(k), view(k));
  const auto by_attend = kvc::attend(twin, 0, q, k, k);
  REQUIRE(by_codes_path.size() == by_attend.size());
  CHECK(std::equal(by_codes_path.data(), by_codes_path.data() + by_codes_path.size(), by_attend.data()));
  CHECK(dynamic.get_seq_length(0) == twin.get_seq_length(0));
  CHECK(dynamic.get_seq_length(0) == 2 * k.dimension(2));
}

TEST_CASE("attend_quantized: a step of no query tokens gives an empty output and stores as update does") {
  // kvc::attend accepts a step of zero tokens and returns [batch, Hq, 0, head_dim]; attend_quantized
  // must too, on an empty layer and on one that holds a quantized history and a residual, and store
  // the step as update does (a zero-token step on a full residual flushes it).
  using Cache = kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>, kvc::HostStorage<float>>;
  const kvc::QuantoQuantizedLayer kind{
      .nbits = 4, .axis_key = 0, .axis_value = 0, .q_group_size = 16, .residual_length = 3};
  Cache exact(kind), fused(kind);
  std::mt19937 rng(7);
  const std::int64_t B = 2, Hq = 4, Hkv = 2, D = 16;
  for (const std::int64_t q : {0, 6, 0, 1, 0, 1, 0, 1, 0, 0}) {
    CAPTURE(q);
    const auto qs = kvc_test::random_tensor<float>(B, Hq, q, D, rng);
    const auto ks = kvc_test::random_tensor<float>(B, Hkv, q, D, rng);
    const auto vs = kvc_test::random_tensor<float>(B, Hkv, q, D, rng);
    const auto want = kvc::attend(exact, 0, qs, ks, vs);
    const auto got = kvc::attend_quantized(fused, 0, view(qs), view(ks), view(vs));
    CHECK(got.dimensions() == want.dimensions());
    if (q == 0) {
      CHECK(got.dimension(0) == B);
      CHECK(got.dimension(1) == Hq);
      CHECK(got.dimension(2) == 0);
      CHECK(got.dimension(3) == D);
    }
    CHECK(fused.get_seq_length(0) == exact.get_seq_length(0));
    CHECK(layer_state(fused).second == layer_state(exact).second);
  }
  CHECK(fused.get_seq_length(0) == 9);
}

TEST_CASE(
    "attend_quantized's store: int4 under 0.30 and int2 under 0.17 of fp16 bytes at 4096 tokens (update: over 1)") {
  using H = Eigen::half;
  using Cache = kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>, kvc::HostStorage<H>>;
  std::mt19937 rng(5);
  const auto prefill = kvc_test::random_tensor<H>(1, 8, 4032, 128, rng);
  const auto tok = kvc_test::random_tensor<H>(1, 8, 1, 128, rng);
  const double fp16 = 4096.0 * 2 * 8 * 128 * 2;  // K and V of 4096 tokens, 2 bytes each
  const auto held = [&](std::int64_t nbits, bool fused) {
    Cache cache(kvc::QuantoQuantizedLayer{
        .nbits = nbits, .axis_key = 0, .axis_value = 0, .q_group_size = 64, .residual_length = 128});
    const auto store = [&](const kvc::HostTensor<H>& x) {
      if (fused)
        cache.update_with(view(x), view(x), 0, [&](auto& st) {
          st.append(view(x), view(x));
          return 0;
        });
      else
        (void)cache.update(x, x, 0);
    };
    store(prefill);
    for (int i = 0; i < 64; ++i) store(tok);
    CHECK(cache.get_seq_length(0) == 4096);
    return static_cast<double>(cache.bytes()) / fp16;
  };
  const double int4 = held(4, true), int2 = held(2, true), int4_update = held(4, false);
  CAPTURE(int4);
  CAPTURE(int2);
  CAPTURE(int4_update);
  CHECK(int4 <= 0.30);
  CHECK(int2 <= 0.17);
  CHECK(int4_update > 1.0);  // the workspace: a dequantized copy of every token
}

TEST_CASE("KIVI (append-only, keys per channel) against transformers' requantize-all: attention error, measured") {
  // Keys with a few outlier channels (what KIVI observed in real models), values without; 2 bits,
  // groups of 32, a residual of 128 tokens: the attention of every decode step against an exact
  // DynamicCache. Keys grouped per channel keep the outliers out of the other channels' scales;
  // append-only quantizes each token once instead of again at every flush.
  using T = float;
  std::mt19937 rng(11);
  const std::int64_t Hq = 4, Hkv = 2, D = 64, prompt = 200, steps = 300;
  std::normal_distribution<float> dist(0.f, 1.f);
  const auto keys = [&](std::int64_t n) {
    kvc::HostTensor<T> t(1, Hkv, n, D);
    for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] = dist(rng) * (i % D < 4 ? 15.f : 1.f);
    return t;
  };
  const auto values = [&](std::int64_t n) {  // a mean per channel, so that outputs are not ~0
    kvc::HostTensor<T> t(1, Hkv, n, D);
    for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] = dist(rng) + static_cast<float>(i % D % 5) - 2.f;
    return t;
  };
  using Quanto = kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>, kvc::HostStorage<T>>;
  const auto kind = [](std::int64_t axis_key, bool append_only) {
    auto o = kvc::detail::with_codec<kvc::QuantoCodec>(kvc::kivi_options(2));
    o.axis_key = axis_key;
    o.append_only = append_only;
    return o;
  };
  kvc::DynamicCache<T> exact;
  std::vector<Quanto> caches{Quanto(kind(-1, true)), Quanto(kind(-1, false)), Quanto(kind(0, true)),
                             Quanto(kind(0, false))};
  std::vector<double> err(caches.size(), 0.0);
  double norm = 0;
  for (std::int64_t s = 0; s <= steps; ++s) {
    const std::int64_t q = s == 0 ? prompt : 1;
    const auto qs = kvc_test::random_tensor<T>(1, Hq, q, D, rng);
    const auto ks = keys(q), vs = values(q);
    const auto want = kvc::attend(exact, 0, qs, ks, vs);
    for (std::size_t c = 0; c < caches.size(); ++c) {
      const auto got = kvc::attend_quantized(caches[c], 0, view(qs), view(ks), view(vs));
      if (s == 0) continue;
      for (std::int64_t i = 0; i < got.size(); ++i) {
        const double d = static_cast<double>(got.data()[i]) - static_cast<double>(want.data()[i]);
        err[c] += d * d;
        if (c == 0) norm += static_cast<double>(want.data()[i]) * static_cast<double>(want.data()[i]);
      }
    }
  }
  for (double& e : err) e = std::sqrt(e / norm);
  MESSAGE("relative RMS attention error, 2 bits: keys per channel append-only (KIVI) "
          << err[0] << ", per channel requantized (transformers) " << err[1] << "; keys per token append-only "
          << err[2] << ", per token requantized " << err[3]);
  CHECK(err[0] < err[2]);  // per-channel keys beat per-token keys on outlier channels
  CHECK(err[1] < err[3]);
  CHECK(err[0] <= 1.05 * err[1]);  // quantizing once loses nothing against quantizing again
}
