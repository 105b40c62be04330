// kvc::scaled_dot_product_attention and kvc::attend against a plain reference implementation:
// causal and sliding masks driven by get_mask_sizes, GQA/MQA/MHA, all four element types.

#include <type_traits>

#include <kvc/attention.hpp>

#include "../support/kvc_test.hpp"
#include "../support/sanitized.hpp"

namespace {

template <class T>
double tolerance() {
  if constexpr (std::is_same_v<T, double>) return 1e-12;
  if constexpr (std::is_same_v<T, float>) return 1e-5;
  if constexpr (std::is_same_v<T, Eigen::half>) return 4e-3;
  return 3e-2;  // bfloat16: 8 bits of mantissa in the output
}

template <class T>
double max_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

template <class T>
kvc::HostTensor<T> gaussian(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d, std::mt19937& rng) {
  std::normal_distribution<float> n(0.f, 1.f);
  kvc::HostTensor<T> t(b, h, s, d);
  for (std::int64_t i = 0; i < t.size(); ++i) t.data()[i] = T(n(rng));
  return t;
}

kvc::ModelConfig gemma_like(std::int64_t kv_heads) {
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 8;
  c.num_key_value_heads = kv_heads;
  c.head_dim = 16;
  c.sliding_window = 5;
  c.layer_types = std::vector<std::string>{"sliding_attention", "full_attention"};
  return c;
}

// Prefill then decode through `cache`; every step's output must equal attention over the whole
// history with the layer's mask (what a model recomputing everything without a cache computes).
template <class T, class Cache>
void check_cache(Cache& cache, const kvc::ModelConfig& c, std::mt19937& rng) {
  const std::int64_t B = 2, Hq = c.num_attention_heads, Hkv = c.layer_num_key_value_heads(0), D = 16;
  std::vector<kvc::HostTensor<T>> all_k(2, kvc::HostTensor<T>(B, Hkv, 0, D)),
      all_v(2, kvc::HostTensor<T>(B, Hkv, 0, D));
  std::int64_t pos = 0;
  for (const std::int64_t q : {7, 1, 1, 3, 1, 1, 1, 6, 1}) {
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      const auto qs = gaussian<T>(B, Hq, q, D, rng);
      const auto ks = gaussian<T>(B, Hkv, q, D, rng);
      const auto vs = gaussian<T>(B, Hkv, q, D, rng);
      const auto out = kvc::attend(cache, layer, qs, ks, vs);
      all_k[std::size_t(layer)] = kvc_test::cat(all_k[std::size_t(layer)], ks);
      all_v[std::size_t(layer)] = kvc_test::cat(all_v[std::size_t(layer)], vs);
      const std::int64_t window =
          (*c.layer_types)[std::size_t(layer)] == "sliding_attention" ? c.sliding_window.value_or(0) : 0;
      const auto want =
          kvc_test::reference_attention(qs, all_k[std::size_t(layer)], all_v[std::size_t(layer)], pos, 0, window);
      CAPTURE(layer);
      CAPTURE(pos);
      REQUIRE(max_diff<T>(kvc_test::flatten(kvc::detail::tensor_input<kvc::HostTensor<T>>::view(out)), want) <
              tolerance<T>());
    }
    pos += q;
  }
}

}  // namespace

TEST_CASE_TEMPLATE_DEFINE("every ready-made cache gives the no-cache result (causal + sliding, GQA)", T,
                          through_caches) {
  std::mt19937 rng(42);
  for (const std::int64_t kv_heads : {8, 2, 1}) {  // MHA, GQA, MQA
    CAPTURE(kv_heads);
    const auto c = gemma_like(kv_heads);
    auto dynamic = kvc::make_dynamic_cache<T>(c);
    check_cache<T>(dynamic, c, rng);
    kvc::StaticCache<T> fixed(c, 32);
    check_cache<T>(fixed, c, rng);
  }
}
TEST_CASE_TEMPLATE_APPLY(through_caches, kvc_test::element_types);

TEST_CASE("a replicated DynamicCache and recorded sliding layers also match") {
  std::mt19937 rng(8);
  auto c = gemma_like(2);
  c.layer_types = std::vector<std::string>{"full_attention", "full_attention"};
  kvc::DynamicCache<float> cache;
  check_cache<float>(cache, c, rng);
  auto recorded = kvc::make_dynamic_cache<float>(gemma_like(2));
  recorded.activate_past_recording();
  check_cache<float>(recorded, gemma_like(2), rng);
}

TEST_CASE("the mask follows kv_offset and the window") {
  const kvc::AttentionMask m{4, 3, 6, 3, true};
  CHECK(m.visible(6, 6));
  CHECK(m.visible(6, 4));
  CHECK_FALSE(m.visible(6, 3));  // 3 <= 6 - 3: outside the window
  CHECK_FALSE(m.visible(6, 7));  // the future
  const kvc::AttentionMask full{4, 0, 0, std::nullopt, true};
  CHECK(full.visible(9, 0));
  const kvc::AttentionMask bidirectional{4, 0, 0, std::nullopt, false};
  CHECK(bidirectional.visible(0, 3));
}

TEST_CASE("explicit masks: static buffer zeros are never attended") {
  std::mt19937 rng(1);
  const auto q = gaussian<float>(1, 2, 1, 8, rng);
  const auto k = gaussian<float>(1, 1, 5, 8, rng);
  const auto v = gaussian<float>(1, 1, 5, 8, rng);
  auto kv = kvc::detail::tensor_input<kvc::HostTensor<float>>::view(k);
  auto vv = kvc::detail::tensor_input<kvc::HostTensor<float>>::view(v);
  // Query at position 2 over a 5-slot buffer starting at 0: slots 3, 4 are in the future.
  const auto out = kvc::scaled_dot_product_attention(q, kv, vv, {5, 0, 2, std::nullopt, true});
  kvc::HostTensor<float> k3 =
      k.slice(Eigen::array<Eigen::Index, 4>{0, 0, 0, 0}, Eigen::array<Eigen::Index, 4>{1, 1, 3, 8});
  kvc::HostTensor<float> v3 =
      v.slice(Eigen::array<Eigen::Index, 4>{0, 0, 0, 0}, Eigen::array<Eigen::Index, 4>{1, 1, 3, 8});
  CHECK(max_diff<float>(kvc_test::flatten(kvc::detail::tensor_input<kvc::HostTensor<float>>::view(out)),
                        kvc_test::reference_attention(q, k3, v3, 2, 0, 0)) < 1e-5);
  // A custom scale.
  const auto scaled = kvc::scaled_dot_product_attention(q, kv, vv, {5, 0, 4, std::nullopt, true}, 0.0);
  for (std::int64_t d = 0; d < 8; ++d) {  // scale 0: uniform weights, the mean of the values
    double mean = 0;
    for (std::int64_t j = 0; j < 5; ++j) mean += v(0, 0, j, d) / 5.0;
    CHECK(scaled(0, 1, 0, d) == doctest::Approx(mean).epsilon(1e-5));
  }
}

TEST_CASE("shape errors are ValueErrors") {
  std::mt19937 rng(2);
  const auto q = gaussian<float>(1, 3, 1, 8, rng);
  const auto k = gaussian<float>(1, 2, 4, 8, rng);
  const auto kv = kvc::detail::tensor_input<kvc::HostTensor<float>>::view(k);
  CHECK_THROWS_WITH_AS(kvc::scaled_dot_product_attention(q, kv, kv, {4, 0, 3, std::nullopt, true}),
                       "scaled_dot_product_attention: 3 query heads are not a multiple of 2 key/value heads",
                       kvc::ValueError);
  const auto q2 = gaussian<float>(1, 4, 1, 8, rng);
  CHECK_THROWS_WITH_AS(kvc::scaled_dot_product_attention(q2, kv, kv, {5, 0, 3, std::nullopt, true}),
                       "scaled_dot_product_attention: keys hold 4 positions but the mask's kv_length is 5",
                       kvc::ValueError);
  const auto q3 = gaussian<float>(2, 4, 1, 8, rng);
  CHECK_THROWS_WITH_AS(
      kvc::scaled_dot_product_attention(q3, kv, kv, {4, 0, 3, std::nullopt, true}),
      "scaled_dot_product_attention: queries of shape [2, 4, 1, 8] and keys of shape [1, 2, 4, 8] "
      "(values [1, 2, 4, 8]) must agree on batch and head_dim, and keys and values on heads and length",
      kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::scaled_dot_product_attention(q2, kv, kv, {4, 0, 3, 0, true}),
                       "scaled_dot_product_attention: sliding_window must be positive, got 0", kvc::ValueError);
  kvc::TensorView<float> strided = kv;
  strided.strides[2] = 16;
  CHECK_THROWS_WITH_AS(kvc::scaled_dot_product_attention(q2, strided, kv, {4, 0, 3, std::nullopt, true}),
                       "scaled_dot_product_attention: tensors must have contiguous [seq, head_dim] blocks",
                       kvc::ValueError);
}

TEST_CASE("a DynamicCache() keeps every token; the model's window masks the old ones") {
  std::mt19937 rng(21);
  kvc::DynamicCache<float> cache;
  kvc::HostTensor<float> all_k(1, 2, 0, 8), all_v(1, 2, 0, 8);
  std::int64_t pos = 0;
  for (const std::int64_t q : {6, 1, 1, 4, 1}) {
    const auto qs = gaussian<float>(1, 4, q, 8, rng), ks = gaussian<float>(1, 2, q, 8, rng),
               vs = gaussian<float>(1, 2, q, 8, rng);
    const auto out = kvc::attend(cache, 0, qs, ks, vs, {.sliding_window = 3});
    all_k = kvc_test::cat(all_k, ks);
    all_v = kvc_test::cat(all_v, vs);
    CHECK(max_diff<float>(kvc_test::flatten(kvc::detail::tensor_input<kvc::HostTensor<float>>::view(out)),
                          kvc_test::reference_attention(qs, all_k, all_v, pos, 0, 3)) < 1e-5);
    pos += q;
  }
  CHECK(cache.get_seq_length() == 13);
}

TEST_CASE("chunked attention: a query sees the keys of its own chunk") {
  const kvc::AttentionMask m{8, 0, 0, std::nullopt, true, 4};
  CHECK(m.visible(5, 4));
  CHECK(m.visible(5, 5));
  CHECK_FALSE(m.visible(5, 3));
  CHECK(m.visible(3, 0));
  std::mt19937 rng(4);
  kvc::ModelConfig c;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.head_dim = 8;
  c.attention_chunk_size = 4;
  auto cache = kvc::make_dynamic_cache<float>(c);  // chunked layers hold chunk - 1 past tokens
  kvc::HostTensor<float> all_k(1, 1, 0, 8), all_v(1, 1, 0, 8);
  std::int64_t pos = 0;
  for (const std::int64_t q : {3, 1, 1, 1, 2, 1, 1, 3}) {
    const auto qs = gaussian<float>(1, 2, q, 8, rng), ks = gaussian<float>(1, 1, q, 8, rng),
               vs = gaussian<float>(1, 1, q, 8, rng);
    const auto out = kvc::attend(cache, 0, qs, ks, vs, {.attention_chunk_size = 4});
    all_k = kvc_test::cat(all_k, ks);
    all_v = kvc_test::cat(all_v, vs);
    CAPTURE(pos);
    CHECK(max_diff<float>(kvc_test::flatten(kvc::detail::tensor_input<kvc::HostTensor<float>>::view(out)),
                          kvc_test::reference_attention(qs, all_k, all_v, pos, 0, 0, 4)) < 1e-5);
    pos += q;
  }
  const auto q = gaussian<float>(1, 2, 1, 8, rng);
  const auto k = kvc::detail::tensor_input<kvc::HostTensor<float>>::view(all_k);
  CHECK_THROWS_WITH_AS(kvc::scaled_dot_product_attention(q, k, k, {k.extent(2), 0, 3, std::nullopt, true, 0}),
                       "scaled_dot_product_attention: attention_chunk_size must be positive, got 0", kvc::ValueError);
}

TEST_CASE("ragged batches: a padded key drops out of its row's attention") {
  std::mt19937 rng(11);
  // Row 0 is left-padded by 2 positions, row 1 is not: a prompt of 7 positions, then 3 decode steps.
  const std::int64_t Hq = 4, Hkv = 2, D = 8, prompt = 7, pad = 2, steps = 3, width = prompt + steps;
  std::vector<std::uint8_t> padding(static_cast<std::size_t>(2 * width), 1);
  padding[0] = padding[1] = 0;
  // Row b's tokens [from, from + len) as a batch of one.
  const auto slice = [](const kvc::HostTensor<float>& t, Eigen::Index b, Eigen::Index from, Eigen::Index len) {
    kvc::HostTensor<float> out(1, t.dimension(1), len, t.dimension(3));
    for (Eigen::Index h = 0; h < t.dimension(1); ++h)
      for (Eigen::Index i = 0; i < len; ++i)
        for (Eigen::Index d = 0; d < t.dimension(3); ++d) out(0, h, i, d) = t(b, h, from + i, d);
    return out;
  };
  kvc::DynamicCache<float> batch, row0, row1;
  for (std::int64_t s = 0; s <= steps; ++s) {
    CAPTURE(s);
    const std::int64_t q = s == 0 ? prompt : 1;
    const auto queries = gaussian<float>(2, Hq, q, D, rng);
    const auto keys = gaussian<float>(2, Hkv, q, D, rng), values = gaussian<float>(2, Hkv, q, D, rng);
    const auto out = kvc::attend(batch, 0, queries, keys, values, {.key_padding_mask = padding});
    // Row 0 alone holds only its real tokens; row 1 alone is the same as in the batch.
    const std::int64_t skip = s == 0 ? pad : 0;
    const auto out0 = kvc::attend(row0, 0, slice(queries, 0, skip, q - skip), slice(keys, 0, skip, q - skip),
                                  slice(values, 0, skip, q - skip));
    const auto out1 = kvc::attend(row1, 0, slice(queries, 1, 0, q), slice(keys, 1, 0, q), slice(values, 1, 0, q));
    double worst = 0;
    for (Eigen::Index h = 0; h < Hq; ++h)
      for (Eigen::Index d = 0; d < D; ++d) {
        for (Eigen::Index i = 0; i < q; ++i) {
          worst = std::max(worst, std::abs(double(out(1, h, i, d)) - double(out1(0, h, i, d))));
          if (i < skip)  // a padded query sees no key: a zero row
            worst = std::max(worst, std::abs(double(out(0, h, i, d))));
          else
            worst = std::max(worst, std::abs(double(out(0, h, i, d)) - double(out0(0, h, i - skip, d))));
        }
      }
    CHECK(worst < 1e-5);
  }
  // Without the mask row 0 would see its padding: the check above is not vacuous.
  kvc::DynamicCache<float> plain;
  const auto queries = gaussian<float>(2, Hq, prompt, D, rng), keys = gaussian<float>(2, Hkv, prompt, D, rng);
  const auto masked = kvc::attend(batch = {}, 0, queries, keys, keys, {.key_padding_mask = padding});
  const auto unmasked = kvc::attend(plain, 0, queries, keys, keys);
  CHECK(std::abs(double(masked(0, 0, 3, 0)) - double(unmasked(0, 0, 3, 0))) > 1e-6);

  const std::vector<std::uint8_t> short_mask(10, 1);
  kvc::DynamicCache<float> fresh;
  CHECK_THROWS_WITH_AS(kvc::attend(fresh, 0, queries, keys, keys, {.key_padding_mask = short_mask}),
                       "scaled_dot_product_attention: key_padding_mask has 10 entries; it needs one row per batch "
                       "row (2) of at least kv_offset + kv_length = 7 positions",
                       kvc::ValueError);
  CHECK(fresh.get_seq_length(0) == 0);  // refused before the update
}

TEST_CASE_TEMPLATE("prefill tiles: odd sizes and every mask against attention in double", T, float, double,
                   Eigen::bfloat16, Eigen::half) {
  // Prefill tiles (more than 16 query rows per KV head) cut the rows into strips of whole vector
  // packets (the last one padded), the keys into blocks of 256 and the block's last panel of 4
  // keys past the causal edge; a prompt (keys no more than queries) packs each key block once for
  // every tile. Sizes here are off every one of those multiples.
  // Under the sanitizers, float and double only: half and bfloat16 run float's tiles (they
  // accumulate in float), after a conversion the other cases check under the sanitizers too.
  if (kvc_test::sanitized && (std::is_same_v<T, Eigen::half> || std::is_same_v<T, Eigen::bfloat16>)) return;
  struct shape {
    std::int64_t B, Hq, Hkv, Q, S, D, Dv, window, chunk;
    bool causal;
  };
  std::mt19937 rng(21);
  for (const shape& s : {shape{1, 4, 2, 300, 300, 16, 16, 0, 0, true},    // a prompt over two key blocks
                         shape{1, 3, 1, 77, 77, 20, 13, 0, 0, true},      // padded strips, a single value column
                         shape{2, 4, 2, 100, 357, 16, 16, 0, 0, true},    // a chunk after 257 cached tokens
                         shape{1, 4, 1, 300, 300, 8, 8, 50, 0, true},     // a sliding prompt: tiles start mid-block
                         shape{1, 2, 2, 300, 700, 8, 8, 100, 0, true},    // a sliding chunk
                         shape{1, 2, 1, 130, 130, 16, 16, 0, 64, true},   // chunked attention
                         shape{2, 2, 1, 90, 90, 24, 24, 0, 0, false}}) {  // an encoder (bidirectional)
    CAPTURE(s.Q);
    CAPTURE(s.S);
    CAPTURE(s.D);
    const auto q = gaussian<T>(s.B, s.Hq, s.Q, s.D, rng);
    const auto k = gaussian<T>(s.B, s.Hkv, s.S, s.D, rng);
    const auto v = gaussian<T>(s.B, s.Hkv, s.S, s.Dv, rng);
    kvc::AttentionMask mask{s.S, 0, s.S - s.Q};
    mask.causal = s.causal;
    if (s.window > 0) mask.sliding_window = s.window;
    if (s.chunk > 0) mask.attention_chunk_size = s.chunk;
    const double scale = 1.0 / std::sqrt(double(s.D));
    const auto flat = [](const kvc::HostTensor<T>& t) {
      return kvc_test::flatten(kvc::detail::tensor_input<kvc::HostTensor<T>>::view(t));
    };
    CHECK(max_diff<T>(flat(kvc::scaled_dot_product_attention(q, k, v, mask)),
                      kvc_test::reference_attention(q, k, v, mask, scale)) < tolerance<T>());
    // Batch row 0 padded at every fifth key and at its first 40 (queries that see no key get zeros).
    std::vector<std::uint8_t> pad(static_cast<std::size_t>(s.B * s.S), 1);
    for (std::int64_t j = 0; j < s.S; ++j) pad[static_cast<std::size_t>(j)] = j % 5 != 0 && j >= 40;
    mask.key_padding_mask = pad;
    CHECK(max_diff<T>(flat(kvc::scaled_dot_product_attention(q, k, v, mask)),
                      kvc_test::reference_attention(q, k, v, mask, scale)) < tolerance<T>());
  }
}
