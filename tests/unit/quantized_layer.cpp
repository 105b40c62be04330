// QuantizedLayer<QuantoCodec> and QuantizedLayer<HqqCodec>: transformers' QuantizedLayer and the
// argument checks of QuantoQuantizedLayer and HQQQuantizedLayer (src/transformers/cache_utils.py
// at a597f974), the later transformers tests test_quantized_layer_beam_reorder and
// test_quantized_layer_reset, docs/differences.md item 28; the codecs of
// <kvc/policies/quantization/codecs.hpp>.

#include <cmath>
#include <random>

#include "../support/kvc_test.hpp"

#include <kvc/quantized_cache.hpp>
#include <kvc/rotation.hpp>

namespace {

using kvc_test::flatten;

template <class Kind, class T = float>
using LayerCache = kvc::Cache<kvc::Layers<Kind>, kvc::HostStorage<T>>;

template <class T>
kvc::HostTensor<T> gaussian(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d, std::mt19937& rng,
                            std::int64_t outlier_channels = 0) {
  std::normal_distribution<float> dist(0.f, 1.f);
  kvc::HostTensor<T> t(b, h, s, d);
  for (std::int64_t i = 0; i < t.size(); ++i) {
    const std::int64_t ch = i % d;
    t.data()[i] = T(dist(rng) * (ch < outlier_channels ? 20.f : 1.f));
  }
  return t;
}

// Relative RMS error of the first `len` tokens of a view against a tensor.
template <class View, class T>
double rel_rms(const View& got, const kvc::HostTensor<T>& want, std::int64_t len) {
  const auto a = flatten(got);
  double num = 0, den = 0;
  std::size_t i = 0;
  for (std::int64_t b = 0; b < want.dimension(0); ++b)
    for (std::int64_t h = 0; h < want.dimension(1); ++h)
      for (std::int64_t s = 0; s < got.extent(2); ++s)
        for (std::int64_t d = 0; d < want.dimension(3); ++d, ++i) {
          if (s >= len) continue;
          const double w = static_cast<double>(want(b, h, s, d));
          num += (a[i] - w) * (a[i] - w);
          den += w * w;
        }
  return std::sqrt(num / den);
}

template <class C>
std::int64_t residual_tokens(const C& c, std::int64_t layer = 0) {
  return c.visit_layer(layer, [](const auto& l) { return l.residual_tokens(); });
}
template <class C>
std::int64_t quantized_tokens(const C& c, std::int64_t layer = 0) {
  return c.visit_layer(layer, [](const auto& l) { return l.quantized_tokens(); });
}

// [B, H, S, D] with every position of batch row r equal to values[r] (transformers' states()).
kvc::HostTensor<float> rows(const std::vector<float>& values, std::int64_t h, std::int64_t s, std::int64_t d) {
  kvc::HostTensor<float> t(static_cast<std::int64_t>(values.size()), h, s, d);
  for (std::int64_t b = 0; b < t.dimension(0); ++b)
    for (std::int64_t i = 0; i < h * s * d; ++i) t.data()[b * h * s * d + i] = values[static_cast<std::size_t>(b)];
  return t;
}

// Values exactly on an nbits grid in every group of either grouping (G = 2^nbits, head_dim a
// multiple of G): 3 + 0.5 * ((s + d) mod 2^nbits).
template <class T>
kvc::HostTensor<T> grid(std::int64_t b, std::int64_t h, std::int64_t s0, std::int64_t s, std::int64_t d, int nbits) {
  const std::int64_t levels = std::int64_t{1} << nbits;
  kvc::HostTensor<T> t(b, h, s, d);
  for (std::int64_t i = 0; i < b; ++i)
    for (std::int64_t j = 0; j < h; ++j)
      for (std::int64_t k = 0; k < s; ++k)
        for (std::int64_t c = 0; c < d; ++c)
          t(i, j, k, c) = T(3.0f + 0.5f * static_cast<float>((s0 + k + c + i + j) % levels));
  return t;
}

// Batch entry i of t, as a tensor of batch 1.
template <class T>
kvc::HostTensor<T> batch_entry(const kvc::HostTensor<T>& t, std::int64_t i) {
  kvc::HostTensor<T> out(1, t.dimension(1), t.dimension(2), t.dimension(3));
  const std::int64_t n = out.size();
  std::copy_n(t.data() + i * n, n, out.data());
  return out;
}

}  // namespace

// ---- argument checks ----------------------------------------------------------------------------

TEST_CASE("quanto argument checks: messages verbatim, in transformers' order (QuantoQuantizedLayer.__init__)") {
  using St = kvc::QuantoQuantizedLayer::state<kvc::HostStorage<float>>;
  CHECK_THROWS_WITH_AS(St(kvc::QuantoQuantizedLayer{3}),
                       "`nbits` for `quanto` backend has to be one of [`2`, `4`] but got 3", kvc::ValueError);
  CHECK_THROWS_WITH_AS(St(kvc::QuantoQuantizedLayer{8, 5, 7}),
                       "`nbits` for `quanto` backend has to be one of [`2`, `4`] but got 8", kvc::ValueError);
  CHECK_THROWS_WITH_AS(St(kvc::QuantoQuantizedLayer{4, 1, 7}),
                       "`axis_key` for `quanto` backend has to be one of [`0`, `-1`] but got 1", kvc::ValueError);
  CHECK_THROWS_WITH_AS(St(kvc::QuantoQuantizedLayer{2, -1, 1}),
                       "`axis_value` for `quanto` backend has to be one of [`0`, `-1`] but got 1", kvc::ValueError);
  CHECK_THROWS_WITH_AS(St(kvc::QuantoQuantizedLayer{4, 0, 0, 0}),
                       "QuantoQuantizedLayer: `q_group_size` must be a positive integer, got 0", kvc::ValueError);
  CHECK_THROWS_WITH_AS(St(kvc::QuantoQuantizedLayer{4, 0, 0, 64, 0}),
                       "QuantoQuantizedLayer: `residual_length` must be a positive integer, got 0", kvc::ValueError);
  CHECK_NOTHROW(St(kvc::QuantoQuantizedLayer{2, -1, 0, 1, 1}));
  // Through a cache's constructor too.
  CHECK_THROWS_WITH_AS(LayerCache<kvc::QuantoQuantizedLayer>(kvc::QuantoQuantizedLayer{1}),
                       "`nbits` for `quanto` backend has to be one of [`2`, `4`] but got 1", kvc::ValueError);
}

TEST_CASE("HQQ argument checks: messages verbatim, in transformers' order (HQQQuantizedLayer.__init__)") {
  using St = kvc::HQQQuantizedLayer::state<kvc::HostStorage<float>>;
  CHECK_THROWS_WITH_AS(St(kvc::HQQQuantizedLayer{5, 2, 2}),
                       "`nbits` for `HQQ` backend has to be one of [`1`, `2`, `3`, `4`, `8`] but got 5",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(St(kvc::HQQQuantizedLayer{0}),
                       "`nbits` for `HQQ` backend has to be one of [`1`, `2`, `3`, `4`, `8`] but got 0",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(St(kvc::HQQQuantizedLayer{4, -1, 2}),
                       "`axis_key` for `HQQ` backend has to be one of [`0`, `1`] but got -1", kvc::ValueError);
  CHECK_THROWS_WITH_AS(St(kvc::HQQQuantizedLayer{8, 1, 2}),
                       "`axis_value` for `HQQ` backend has to be one of [`0`, `1`] but got 2", kvc::ValueError);
  CHECK_THROWS_WITH_AS(St(kvc::HQQQuantizedLayer{4, 0, 0, -3}),
                       "HQQQuantizedLayer: `q_group_size` must be a positive integer, got -3", kvc::ValueError);
  CHECK_THROWS_WITH_AS(St(kvc::HQQQuantizedLayer{4, 0, 0, 64, -1}),
                       "HQQQuantizedLayer: `residual_length` must be a positive integer, got -1", kvc::ValueError);
  for (const std::int64_t nbits : {1, 2, 3, 4, 8}) CHECK_NOTHROW(St(kvc::HQQQuantizedLayer{nbits, 1, 0}));
}

TEST_CASE("layer traits") {
  using Q = kvc::QuantoQuantizedLayer::state<kvc::HostStorage<float>>;
  using H = kvc::HQQQuantizedLayer::state<kvc::HostStorage<Eigen::half>>;
  CHECK(kvc::concepts::CacheLayer<kvc::QuantoQuantizedLayer, kvc::HostStorage<float>>);
  CHECK(kvc::concepts::CacheLayer<kvc::HQQQuantizedLayer, kvc::HostStorage<Eigen::bfloat16>>);
  CHECK(kvc::concepts::supports_crop<Q>);
  CHECK(kvc::concepts::supports_batch_ops<H>);
  CHECK(Q::name == "QuantoQuantizedLayer");
  CHECK(H::name == "HQQQuantizedLayer");
  CHECK_FALSE(Q::is_sliding);
  CHECK_FALSE(Q::is_compileable);
  CHECK(Q::supports_early_init);
  CHECK(std::is_same_v<H::meta_type, Eigen::half>);
  CHECK(std::is_same_v<kvc::detail::quant_meta_t<double>, float>);
  const kvc::QuantoQuantizedLayer defaults{};
  CHECK(defaults.nbits == 4);
  CHECK(defaults.axis_key == 0);
  CHECK(defaults.axis_value == 0);
  CHECK(defaults.q_group_size == 64);
  CHECK(defaults.residual_length == 128);
}

// ---- the update schedule ----------------------------------------------------------------------

TEST_CASE_TEMPLATE("flush schedule with residual_length 4 (QuantizedLayer.update), every element type", T, float,
                   double, Eigen::half, Eigen::bfloat16) {
  std::mt19937 rng(7);
  LayerCache<kvc::QuantoQuantizedLayer, T> cache(kvc::QuantoQuantizedLayer{4, 0, 0, 16, 4});
  const auto prefill = gaussian<T>(2, 3, 5, 16, rng);
  const auto kv0 = cache.update(prefill, prefill, 0);
  // The first update returns the inputs themselves.
  CHECK(flatten(kv0.keys) == kvc_test::slice_seq(prefill, 0, 5));
  CHECK(flatten(kv0.values) == kvc_test::slice_seq(prefill, 0, 5));
  CHECK(residual_tokens(cache) == 0);
  CHECK(quantized_tokens(cache) == 5);
  const std::int64_t expected_residual[] = {1, 2, 3, 0, 1, 2, 3, 0, 1};
  for (std::int64_t step = 0; step < 9; ++step) {
    const auto tok = gaussian<T>(2, 3, 1, 16, rng);
    CHECK(cache.get_mask_sizes(1, 0) == std::pair<std::int64_t, std::int64_t>{5 + step + 1, 0});
    const auto kv = cache.update(tok, tok, 0);
    CHECK(kv.keys.extent(2) == 5 + step + 1);
    CHECK(kv.values.extent(2) == 5 + step + 1);
    CHECK(cache.get_seq_length() == 5 + step + 1);
    CHECK(residual_tokens(cache) == expected_residual[step]);
    CHECK(quantized_tokens(cache) + residual_tokens(cache) == 5 + step + 1);
    // The new token comes back exactly, the history within the 4-bit error.
    CHECK(kvc_test::flatten(kv.keys).back() == static_cast<double>(tok(1, 2, 0, 15)));
    CHECK(rel_rms(kv.keys, prefill, 5) < 0.15);
  }
  CHECK(quantized_tokens(cache) == 13);
  CHECK(cache.get_max_length(0) == -1);
  CHECK_FALSE(cache.is_compileable());
  // stored() is transformers' layer.keys: the residual.
  CHECK(cache.stored(0).keys.extent(2) == 1);
}

TEST_CASE("a multi-token update is checked against the existing residual only") {
  std::mt19937 rng(8);
  LayerCache<kvc::HQQQuantizedLayer> cache(kvc::HQQQuantizedLayer{4, 1, 1, 8, 4});
  cache.update(gaussian<float>(1, 1, 3, 8, rng), gaussian<float>(1, 1, 3, 8, rng), 0);
  // Empty residual: 10 tokens join it (transformers' 1-D empty residual never triggers a flush).
  cache.update(gaussian<float>(1, 1, 10, 8, rng), gaussian<float>(1, 1, 10, 8, rng), 0);
  CHECK(residual_tokens(cache) == 10);
  auto kv = cache.update(gaussian<float>(1, 1, 2, 8, rng), gaussian<float>(1, 1, 2, 8, rng), 0);
  CHECK(kv.keys.extent(2) == 15);
  CHECK(residual_tokens(cache) == 0);
  CHECK(quantized_tokens(cache) == 15);
}

TEST_CASE("residual_length 1: quantize on every update once the residual holds a token") {
  std::mt19937 rng(9);
  LayerCache<kvc::QuantoQuantizedLayer> cache(kvc::QuantoQuantizedLayer{4, 0, 0, 8, 1});
  cache.update(gaussian<float>(1, 1, 4, 8, rng), gaussian<float>(1, 1, 4, 8, rng), 0);
  const std::int64_t expected[] = {1, 0, 1, 0};
  for (const std::int64_t r : expected) {
    cache.update(gaussian<float>(1, 1, 1, 8, rng), gaussian<float>(1, 1, 1, 8, rng), 0);
    CHECK(residual_tokens(cache) == r);
  }
}

TEST_CASE("early_initialization then the first update still returns the inputs") {
  std::mt19937 rng(10);
  LayerCache<kvc::QuantoQuantizedLayer> cache(kvc::QuantoQuantizedLayer{}, kvc::QuantoQuantizedLayer{});
  cache.early_initialization(2, 4, 32);
  CHECK(cache.is_initialized());
  CHECK(cache.bytes() == 0);
  const auto k = gaussian<float>(2, 4, 7, 32, rng);
  CHECK(flatten(cache.update(k, k, 1).keys) == kvc_test::slice_seq(k, 0, 7));
  CHECK_THROWS_AS(cache.update(gaussian<float>(1, 4, 7, 32, rng), gaussian<float>(1, 4, 7, 32, rng), 0),
                  kvc::ValueError);
}

// ---- numbers ----------------------------------------------------------------------------------

TEST_CASE("bit packing round trip is exact for every width and start") {
  std::mt19937 rng(11);
  for (const int nbits : {1, 2, 3, 4, 8}) {
    std::uniform_int_distribution<int> dist(0, (1 << nbits) - 1);
    std::vector<std::uint8_t> codes(1000);
    for (auto& c : codes) c = static_cast<std::uint8_t>(dist(rng));
    std::vector<std::uint8_t> packed(static_cast<std::size_t>(kvc::detail::packed_bytes(1000, nbits)));
    CHECK(static_cast<std::int64_t>(packed.size()) == (1000 * nbits + 7) / 8);
    kvc::detail::pack_codes(codes.data(), 1000, nbits, packed.data());
    for (const std::int64_t first : {0, 1, 3, 8, 13, 64}) {
      for (const std::int64_t count : {0, 1, 7, 100, 1000 - 64}) {
        std::vector<std::uint8_t> out(static_cast<std::size_t>(count));
        kvc::detail::unpack_codes(packed.data(), first, count, nbits, out.data());
        CHECK(std::equal(out.begin(), out.end(), codes.begin() + first));
      }
    }
  }
  // The documented layout: two 4-bit codes per byte, the first in the low nibble; 3-bit codes
  // run across bytes.
  const std::uint8_t c4[] = {0x3, 0xA, 0xF};
  std::uint8_t p4[2];
  kvc::detail::pack_codes(c4, 3, 4, p4);
  CHECK(p4[0] == 0xA3);
  CHECK(p4[1] == 0x0F);
  const std::uint8_t c3[] = {5, 6, 7};  // bits 101 110 111 -> 0b1'110'101, 0b1'1
  std::uint8_t p3[2];
  kvc::detail::pack_codes(c3, 3, 3, p3);
  CHECK(p3[0] == 0xF5);
  CHECK(p3[1] == 0x01);
}

namespace {
// What the CUDA kernels compute (cuda_codecs.cuh): the per-item steps fit_group_at,
// packed_byte_at and decode_at over every item, serially, on strided input; decode_run_at with
// head_dim at run time and, when Dim > 0 (then dim == Dim), at compile time too.
template <class Codec, class T, std::int64_t Dim = 0>
void device_steps_match_host(int nbits, kvc::detail::quant_grouping grouping, std::int64_t group_size,
                             std::int64_t tokens, std::int64_t dim) {
  using M = kvc::detail::quant_meta_t<T>;
  std::mt19937 rng(static_cast<unsigned>(nbits * 1000 + group_size * 10 + tokens + dim));
  std::normal_distribution<float> dist(0.f, 1.f);
  const std::int64_t batch = 2, heads = 3, cap = tokens + 3;  // blocks of `tokens` rows in a larger buffer
  const std::int64_t stride_h = cap * dim, stride_b = heads * stride_h;
  std::vector<T> src(static_cast<std::size_t>(batch * stride_b));
  for (std::size_t i = 0; i < src.size(); ++i) src[i] = T(dist(rng) * (i % 17 == 0 ? 9.f : 1.f));
  const auto host = kvc::detail::quantized_tensor<M>::template encode<Codec>(
      nbits, grouping, group_size, src.data(), batch, heads, tokens, dim, stride_b, stride_h);
  const kvc::detail::quant_layout l(nbits, grouping, group_size, batch, heads, tokens, dim);
  REQUIRE((Dim == 0 || Dim == dim));
  std::vector<M> scale(static_cast<std::size_t>(l.blocks() * l.groups)), offset(scale.size());
  std::vector<std::uint8_t> codes(static_cast<std::size_t>(l.blocks() * l.elements()));
  for (std::int64_t m = 0; m < l.blocks() * l.groups; ++m)
    kvc::detail::fit_group_at<Codec>(m, src.data(), stride_b, stride_h, l, scale.data(), offset.data(), codes.data());
  std::vector<std::uint8_t> packed(static_cast<std::size_t>(l.blocks() * l.block_bytes));
  for (std::int64_t t = 0; t < static_cast<std::int64_t>(packed.size()); ++t)
    packed[static_cast<std::size_t>(t)] = kvc::detail::packed_byte_at(t, codes.data(), l);
  CHECK(packed == host.packed());
  std::vector<T> want(src.size(), T(-99.f)), got(src.size(), T(-99.f));
  host.decode(want.data(), stride_b, stride_h);
  for (std::int64_t e = 0; e < l.blocks() * l.elements(); ++e)
    kvc::detail::decode_at(e, got.data(), stride_b, stride_h, l, packed.data(), scale.data(), offset.data());
  CHECK(got == want);  // the padding rows (-99) untouched by both
  // The vectorised form: runs of 16 bytes of output (the device's aligned path).
  constexpr int V = static_cast<int>(16 / sizeof(T));
  const auto check_runs = [&]<std::int64_t D>() {
    std::vector<T> runs(static_cast<std::size_t>(l.blocks() * l.elements()));
    for (std::int64_t e = 0; e < l.blocks() * l.elements(); e += V)
      kvc::detail::decode_run_at<V, D>(e, runs.data() + e, l, packed.data(), scale.data(), offset.data());
    for (std::int64_t blk = 0; blk < l.blocks(); ++blk)
      for (std::int64_t i = 0; i < l.elements(); ++i)
        REQUIRE(runs[static_cast<std::size_t>(blk * l.elements() + i)] ==
                want[static_cast<std::size_t>((blk / l.heads) * stride_b + (blk % l.heads) * stride_h + i)]);
  };
  if (l.elements() % V == 0) {
    check_runs.template operator()<0>();
    if constexpr (Dim > 0) check_runs.template operator()<Dim>();
  }
}
}  // namespace

TEST_CASE_TEMPLATE("the device codec's per-item steps give the host codec's bytes and values", T, float, Eigen::half,
                   Eigen::bfloat16) {
  using kvc::detail::quant_grouping;
  for (const auto grouping : {quant_grouping::along_head_dim, quant_grouping::along_seq})
    for (const std::int64_t group_size : {1, 5, 8, 64})
      for (const std::int64_t tokens : {1, 8, 33}) {
        CAPTURE(group_size);
        CAPTURE(tokens);
        for (const int nbits : {2, 4})
          device_steps_match_host<kvc::QuantoCodec, T>(nbits, grouping, group_size, tokens, 12);
        for (const int nbits : {1, 3, 8})
          device_steps_match_host<kvc::HqqCodec, T>(nbits, grouping, group_size, tokens, 6);
      }
  // head_dim 64 (a multiple of every V), at run time and at compile time: the runs that share a
  // group or a token row, and those that do not.
  for (const auto grouping : {quant_grouping::along_head_dim, quant_grouping::along_seq})
    for (const std::int64_t group_size : {5, 8, 64})
      for (const std::int64_t tokens : {1, 9}) {
        CAPTURE(group_size);
        CAPTURE(tokens);
        device_steps_match_host<kvc::QuantoCodec, T, 64>(4, grouping, group_size, tokens, 64);
        device_steps_match_host<kvc::HqqCodec, T, 64>(3, grouping, group_size, tokens, 64);
      }
}

TEST_CASE_TEMPLATE("values on the code grid come back exactly (both codecs, both groupings)", T, float, Eigen::half) {
  for (const int nbits : {1, 2, 3, 4, 8}) {
    const std::int64_t g = std::int64_t{1} << nbits;
    const std::int64_t d = std::max<std::int64_t>(16, g);
    for (const std::int64_t axis : {0, 1}) {
      CAPTURE(nbits);
      CAPTURE(axis);
      const auto prefill = grid<T>(2, 2, 0, g * 2, d, nbits);
      LayerCache<kvc::HQQQuantizedLayer, T> hqq(kvc::HQQQuantizedLayer{nbits, axis, axis, g, 64});
      hqq.update(prefill, prefill, 0);
      const auto next = grid<T>(2, 2, g * 2, 1, d, nbits);
      auto kv = hqq.update(next, next, 0);
      CHECK(flatten(kv.keys) == kvc_test::slice_seq(kvc_test::cat(prefill, next), 0, g * 2 + 1));
      if (nbits == 2 || nbits == 4) {
        LayerCache<kvc::QuantoQuantizedLayer, T> quanto(kvc::QuantoQuantizedLayer{nbits, -axis, -axis, g, 64});
        quanto.update(prefill, prefill, 0);
        kv = quanto.update(next, next, 0);
        CHECK(flatten(kv.values) == kvc_test::slice_seq(kvc_test::cat(prefill, next), 0, g * 2 + 1));
      }
    }
  }
}

TEST_CASE(
    "constant rows reconstruct within 1e-2, every codec, width and axis (the tolerance of test_quantized_layer_beam_reorder)") {
  struct Case {
    bool hqq;
    std::int64_t nbits, axis;
  };
  const Case cases[] = {{false, 2, 0}, {false, 2, -1}, {false, 4, 0}, {false, 4, -1}, {true, 1, 0},
                        {true, 1, 1},  {true, 2, 0},   {true, 2, 1},  {true, 3, 0},   {true, 3, 1},
                        {true, 4, 0},  {true, 4, 1},   {true, 8, 0},  {true, 8, 1}};
  const auto prefill = rows({1, 2, 3, 4}, 2, 5, 8);
  const auto next = rows({1, 2, 3, 4}, 2, 1, 8);
  for (const Case& c : cases) {
    CAPTURE(c.hqq);
    CAPTURE(c.nbits);
    CAPTURE(c.axis);
    auto check = [&](auto& cache) {
      cache.update(prefill, prefill, 0);
      const auto kv = cache.update(next, next, 0);
      for (std::int64_t b = 0; b < 4; ++b)
        for (std::int64_t s = 0; s < 6; ++s) CHECK(std::fabs(kv.keys(b, 1, s, 7) - static_cast<float>(b + 1)) <= 1e-2);
    };
    if (c.hqq) {
      LayerCache<kvc::HQQQuantizedLayer> cache(kvc::HQQQuantizedLayer{c.nbits, c.axis, c.axis, 16, 4});
      check(cache);
    } else {
      LayerCache<kvc::QuantoQuantizedLayer> cache(kvc::QuantoQuantizedLayer{c.nbits, c.axis, c.axis, 16, 4});
      check(cache);
    }
  }
}

TEST_CASE("gaussian reconstruction: relative RMS bounds per codec, width and axis") {
  std::mt19937 rng(12);
  const auto k = gaussian<float>(1, 4, 256, 128, rng);
  const auto tok = gaussian<float>(1, 4, 1, 128, rng);
  struct Case {
    bool hqq;
    std::int64_t nbits, axis;
    double bound;
  };
  // Uniform rounding of a gaussian group of 64 over its min..max range gives about
  // range / (2^nbits - 1) / sqrt(12) ~ 0.09 (4 bits) and 0.005 (8 bits) of the RMS. One bit with
  // min/max would give ~1.7 (every value becomes the group's min or max); HQQ's zero does better.
  const Case cases[] = {{false, 4, 0, 0.12}, {false, 4, -1, 0.12}, {false, 2, 0, 0.60}, {false, 2, -1, 0.60},
                        {true, 4, 1, 0.12},  {true, 4, 0, 0.12},   {true, 8, 1, 0.01},  {true, 8, 0, 0.01},
                        {true, 3, 1, 0.25},  {true, 2, 1, 0.60},   {true, 1, 1, 1.60}};
  for (const Case& c : cases) {
    CAPTURE(c.hqq);
    CAPTURE(c.nbits);
    CAPTURE(c.axis);
    double err = 0;
    if (c.hqq) {
      LayerCache<kvc::HQQQuantizedLayer> cache(kvc::HQQQuantizedLayer{c.nbits, c.axis, c.axis, 64, 128});
      cache.update(k, k, 0);
      err = rel_rms(cache.update(tok, tok, 0).keys, k, 256);
    } else {
      LayerCache<kvc::QuantoQuantizedLayer> cache(kvc::QuantoQuantizedLayer{c.nbits, c.axis, c.axis, 64, 128});
      cache.update(k, k, 0);
      err = rel_rms(cache.update(tok, tok, 0).keys, k, 256);
    }
    MESSAGE("rel RMS ", err);
    CHECK(err < c.bound);
    CHECK(err > 0);
  }
}

TEST_CASE("HQQ's zero refinement does not do worse than min/max on outlier-heavy data") {
  std::mt19937 rng(13);
  const auto k = gaussian<float>(1, 2, 128, 128, rng, 4);
  const auto tok = gaussian<float>(1, 2, 1, 128, rng, 4);
  for (const std::int64_t nbits : {2, 4}) {
    LayerCache<kvc::HQQQuantizedLayer> hqq(kvc::HQQQuantizedLayer{nbits, 1, 1, 64, 128});
    LayerCache<kvc::QuantoQuantizedLayer> quanto(kvc::QuantoQuantizedLayer{nbits, 0, 0, 64, 128});
    hqq.update(k, k, 0);
    quanto.update(k, k, 0);
    const double e_hqq = rel_rms(hqq.update(tok, tok, 0).keys, k, 128);
    const double e_quanto = rel_rms(quanto.update(tok, tok, 0).keys, k, 128);
    MESSAGE("nbits ", nbits, ": hqq ", e_hqq, " quanto ", e_quanto);
    CHECK(e_hqq <= e_quanto * 1.02);
  }
}

// ---- reset, reorder, batch operations, crop -----------------------------------------------------

TEST_CASE("reset drops the quantized states too (test_quantized_layer_reset)") {
  std::mt19937 rng(14);
  LayerCache<kvc::QuantoQuantizedLayer> cache(kvc::QuantoQuantizedLayer{4, 0, 0, 16, 4});
  cache.update(gaussian<float>(4, 2, 5, 8, rng), gaussian<float>(4, 2, 5, 8, rng), 0);
  cache.update(gaussian<float>(4, 2, 1, 8, rng), gaussian<float>(4, 2, 1, 8, rng), 0);
  CHECK(cache.bytes() > 0);
  cache.reset();
  CHECK(cache.get_seq_length() == 0);
  CHECK(cache.bytes() == 0);
  CHECK_FALSE(cache.is_initialized());
  const auto k = gaussian<float>(4, 2, 3, 8, rng);
  const auto kv = cache.update(k, k, 0);
  CHECK(kv.keys.extent(2) == 3);
  CHECK(cache.get_seq_length() == 3);
  CHECK(flatten(kv.keys) == kvc_test::slice_seq(k, 0, 3));
  // Another shape after a reset.
  cache.reset();
  CHECK(cache.update(gaussian<float>(1, 3, 2, 16, rng), gaussian<float>(1, 3, 2, 16, rng), 0).keys.extent(1) == 3);
}

TEST_CASE_TEMPLATE("beam reorder moves the quantized rows too (test_quantized_layer_beam_reorder)", Kind,
                   kvc::QuantoQuantizedLayer, kvc::HQQQuantizedLayer) {
  const std::vector<float> row_values{1, 2, 3, 4};
  auto states = [&](const std::vector<std::int64_t>& order, std::int64_t len) {
    std::vector<float> v;
    for (const std::int64_t o : order) v.push_back(row_values[static_cast<std::size_t>(o)]);
    return rows(v, 2, len, 8);
  };
  LayerCache<Kind> cache(Kind{4, 0, 0, 16, 4});
  std::vector<std::int64_t> order{0, 1, 2, 3};
  cache.update(states(order, 5), states(order, 5), 0);
  const std::vector<std::vector<std::int64_t>> beams{{1, 0, 3, 2}, {2, 2, 0, 1}, {3, 1, 2, 0},
                                                     {0, 1, 2, 3}, {1, 3, 0, 2}, {2, 0, 1, 3}};
  for (const auto& beam : beams) {
    cache.reorder_cache(beam);
    std::vector<std::int64_t> next(4);
    for (std::size_t r = 0; r < 4; ++r) next[r] = order[static_cast<std::size_t>(beam[r])];
    order = next;
    const auto kv = cache.update(states(order, 1), states(order, 1), 0);
    for (std::int64_t r = 0; r < 4; ++r)
      for (std::int64_t s = 0; s < kv.keys.extent(2); ++s)
        for (std::int64_t d = 0; d < 8; ++d) {
          CHECK(std::fabs(kv.keys(r, 1, s, d) -
                          row_values[static_cast<std::size_t>(order[static_cast<std::size_t>(r)])]) <= 1e-2);
          CHECK(std::fabs(kv.values(r, 0, s, d) -
                          row_values[static_cast<std::size_t>(order[static_cast<std::size_t>(r)])]) <= 1e-2);
        }
  }
}

// Two caches fed the same data, one reordered afterwards and one given reordered inputs from the
// start, return identical bytes: the reorder copies packed rows and never quantizes again.
TEST_CASE_TEMPLATE("reorder_cache and batch operations on quantized data are exact", T, float, Eigen::bfloat16) {
  std::mt19937 rng(15);
  const std::int64_t b = 3;
  std::vector<kvc::HostTensor<T>> steps;
  steps.push_back(gaussian<T>(b, 2, 9, 16, rng));
  for (int i = 0; i < 12; ++i) steps.push_back(gaussian<T>(b, 2, 1, 16, rng));
  auto pick = [](const kvc::HostTensor<T>& t, const std::vector<std::int64_t>& idx) {
    kvc::HostTensor<T> out(static_cast<std::int64_t>(idx.size()), t.dimension(1), t.dimension(2), t.dimension(3));
    const std::int64_t n = t.dimension(1) * t.dimension(2) * t.dimension(3);
    for (std::size_t i = 0; i < idx.size(); ++i)
      std::copy_n(t.data() + idx[i] * n, n, out.data() + static_cast<std::int64_t>(i) * n);
    return out;
  };
  const std::vector<std::int64_t> perm{2, 0, 2};
  const std::vector<std::int64_t> repeat{0, 0, 1, 1, 2, 2};
  const std::vector<std::int64_t> select{2, 0};
  // Reorder after `at` updates: right after the first update (workspace holds the inputs), in the
  // middle of a residual (fresh workspace), right after a quantization (stale workspace).
  for (const std::size_t at : {std::size_t{1}, std::size_t{3}, std::size_t{5}, std::size_t{9}}) {
    for (int op = 0; op < 3; ++op) {
      CAPTURE(at);
      CAPTURE(op);
      const auto& idx = op == 0 ? perm : op == 1 ? repeat : select;
      LayerCache<kvc::QuantoQuantizedLayer, T> a(kvc::QuantoQuantizedLayer{4, -1, 0, 4, 4});
      LayerCache<kvc::QuantoQuantizedLayer, T> ref(kvc::QuantoQuantizedLayer{4, -1, 0, 4, 4});
      for (std::size_t i = 0; i < at; ++i) a.update(steps[i], steps[i], 0);
      if (op == 0) a.reorder_cache(idx);
      if (op == 1) a.batch_repeat_interleave(2);
      if (op == 2) a.batch_select_indices(select);
      CHECK(a.batch_size() == static_cast<std::int64_t>(idx.size()));
      for (std::size_t i = 0; i < at; ++i) ref.update(pick(steps[i], idx), pick(steps[i], idx), 0);
      for (std::size_t i = at; i < steps.size(); ++i) {
        const auto s = pick(steps[i], idx);
        const auto ka = a.update(s, s, 0);
        const auto kr = ref.update(s, s, 0);
        CHECK(flatten(ka.keys) == flatten(kr.keys));
        CHECK(flatten(ka.values) == flatten(kr.values));
      }
      // Same quantized payload (the buffers' capacities follow each cache's own history).
      CHECK(a.visit_layer(0, [](const auto& l) { return l.quantized_bytes(); }) ==
            ref.visit_layer(0, [](const auto& l) { return l.quantized_bytes(); }));
    }
  }
}

TEST_CASE("crop: from the residual, positive, and refused past the residual (docs/rollback.md)") {
  // Grid data: keys (groups along head_dim, 16 levels per row) come back exactly, so the outputs
  // can be compared exactly; values use groups along seq (partial groups: 4-bit error).
  const auto prefill = grid<float>(2, 2, 0, 8, 16, 4);
  auto token = [](std::int64_t pos) { return grid<float>(2, 2, pos, 1, 16, 4); };
  auto fresh = [&] {
    LayerCache<kvc::QuantoQuantizedLayer> c(kvc::QuantoQuantizedLayer{4, 0, -1, 16, 4});
    c.update(prefill, prefill, 0);
    c.update(token(8), token(8), 0);
    c.update(token(9), token(9), 0);
    return c;
  };
  const auto all = kvc_test::cat(kvc_test::cat(prefill, token(8)), token(9));
  SUBCASE("within the residual") {
    auto c = fresh();
    REQUIRE(residual_tokens(c) == 2);
    c.crop(-1);
    CHECK(c.get_seq_length() == 9);
    CHECK(residual_tokens(c) == 1);
    const auto kv = c.update(token(9), token(9), 0);
    CHECK(flatten(kv.keys) == kvc_test::slice_seq(all, 0, 10));
  }
  SUBCASE("into the quantized history: refused, nothing changes") {
    auto c = fresh();
    const auto before = kvc_test::take_snapshot(c);
    CHECK_THROWS_WITH_AS(
        c.crop(-5),
        "`crop` would remove 5 tokens, but this QuantoQuantizedLayer can roll back only 2 exactly (the "
        "tokens of its full-precision residual; the quantized history cannot be cut exactly)",
        kvc::RuntimeError);
    CHECK_THROWS_AS(c.crop(-100), kvc::RuntimeError);
    CHECK_THROWS_AS(c.crop(7), kvc::RuntimeError);  // a positive count that keeps 7 removes 3
    CHECK(kvc_test::take_snapshot(c) == before);
    CHECK(c.rollback_depth() == 2);
  }
  SUBCASE("positive: the deprecated absolute length, with DynamicLayer's warning") {
    kvc_test::captured_warnings w;
    auto c = fresh();
    c.crop(9);
    CHECK(c.get_seq_length() == 9);
    REQUIRE(w.messages.size() == 1);
    CHECK(w.messages[0] == kvc::positive_crop_deprecation);
    c.crop(50);  // longer than held: nothing changes
    CHECK(c.get_seq_length() == 9);
  }
  SUBCASE("crop(0) and an uninitialized layer: no-op") {
    auto c = fresh();
    c.crop(0);
    CHECK(c.get_seq_length() == 10);
    LayerCache<kvc::QuantoQuantizedLayer> empty(kvc::QuantoQuantizedLayer{});
    empty.crop(-3);
    CHECK(empty.get_seq_length() == 0);
  }
}

TEST_CASE("a throwing update leaves the layer exactly as it was (strong guarantee)") {
  std::mt19937 rng(16);
  const auto prefill = gaussian<float>(2, 2, 6, 8, rng);
  LayerCache<kvc::HQQQuantizedLayer> a(kvc::HQQQuantizedLayer{4, 1, 0, 8, 3});
  LayerCache<kvc::HQQQuantizedLayer> ref(kvc::HQQQuantizedLayer{4, 1, 0, 8, 3});
  a.update(prefill, prefill, 0);
  ref.update(prefill, prefill, 0);
  for (int step = 0; step < 6; ++step) {
    const auto before = kvc_test::take_snapshot(a);
    const auto bad = gaussian<float>(2, 3, 1, 8, rng);
    CHECK_THROWS_AS(a.update(bad, bad, 0), kvc::ValueError);
    CHECK_THROWS_AS(a.reorder_cache({0, 2}), kvc::IndexError);
    CHECK(kvc_test::take_snapshot(a) == before);
    const auto tok = gaussian<float>(2, 2, 1, 8, rng);
    CHECK(flatten(a.update(tok, tok, 0).keys) == flatten(ref.update(tok, tok, 0).keys));
  }
}

// The workspace is a detail::kv_store: its capacity follows the sequence (docs/quantized.md), it
// keeps its prefix when it grows while fresh and through a batch selection, and is rebuilt from the
// quantized history (decoded into its blocks) when stale or released. Grid data at 2 bits, groups
// along head_dim: every output is exact.
TEST_CASE("the workspace: its capacity, and its contents through a growth, a batch selection and a release") {
  using Kind = kvc::QuantoQuantizedLayer;
  LayerCache<Kind> cache(Kind{2, 0, 0, 4, 4});
  auto keys = [](std::int64_t s0, std::int64_t s) { return grid<float>(2, 2, s0, s, 8, 2); };
  auto values = [](std::int64_t s0, std::int64_t s) { return grid<float>(2, 2, s0, s, 4, 2); };
  auto workspace = [&] { return cache.visit_layer(0, [](const auto& l) { return l.workspace_bytes(); }); };
  // K and V of `batch` entries, 2 heads, head_dims 8 and 4, `capacity` slots.
  auto bytes_of = [](std::int64_t batch, std::int64_t capacity) {
    return static_cast<std::int64_t>(sizeof(float)) * batch * 2 * capacity * (8 + 4);
  };
  cache.update(keys(0, 20), values(0, 20), 0);
  CHECK(workspace() == bytes_of(2, 20));  // the first update: the inputs' length (at least 16)
  // Totals 21..26: grown to 21 + min(4, 21) = 25 (stale, rebuilt), appended, flushed at 24 (in
  // place), rebuilt in place at 25, then grown while fresh to 26 + 4 = 30 (its prefix copied).
  const std::int64_t capacities[] = {25, 25, 25, 25, 25, 30};
  for (std::int64_t s = 20; s < 26; ++s) {
    CAPTURE(s);
    const auto kv = cache.update(keys(s, 1), values(s, 1), 0);
    CHECK(workspace() == bytes_of(2, capacities[s - 20]));
    CHECK(flatten(kv.keys) == kvc_test::slice_seq(keys(0, s + 1), 0, s + 1));
    CHECK(flatten(kv.values) == kvc_test::slice_seq(values(0, s + 1), 0, s + 1));
  }
  REQUIRE(residual_tokens(cache) == 2);
  // Fresh: batch entry 1's first 26 slots go along, in a workspace of the same capacity.
  cache.batch_select_indices({1});
  CHECK(workspace() == bytes_of(1, 30));
  auto kv = cache.update(batch_entry(keys(26, 1), 1), batch_entry(values(26, 1), 1), 0);
  CHECK(workspace() == bytes_of(1, 30));
  CHECK(flatten(kv.keys) == kvc_test::slice_seq(batch_entry(keys(0, 27), 1), 0, 27));
  CHECK(flatten(kv.values) == kvc_test::slice_seq(batch_entry(values(0, 27), 1), 0, 27));
  // Released: the next update (a flush) rebuilds it from the history and the residual.
  cache.visit_layer(0, [](auto& l) { l.release_workspace(); });
  CHECK(workspace() == 0);
  kv = cache.update(batch_entry(keys(27, 1), 1), batch_entry(values(27, 1), 1), 0);
  CHECK(residual_tokens(cache) == 0);
  CHECK(workspace() == bytes_of(1, 32));
  CHECK(flatten(kv.keys) == kvc_test::slice_seq(batch_entry(keys(0, 28), 1), 0, 28));
  CHECK(flatten(kv.values) == kvc_test::slice_seq(batch_entry(values(0, 28), 1), 0, 28));
  CHECK(cache.bytes() == cache.visit_layer(0, [](const auto& l) {
    return l.quantized_bytes() + l.residual_bytes() + l.workspace_bytes();
  }));
}

TEST_CASE("kv_store, as the workspace uses it: key_blocks/value_blocks, gathered with a prefix") {
  using Store = kvc::detail::kv_store<kvc::HostStorage<float>>;
  const kvc::LayerShape shape{3, 2, 4, 2};  // batch, heads, key_head_dim, value_head_dim
  Store store(shape, 5, true);
  auto k = store.key_blocks();
  auto v = store.value_blocks();
  const auto kview = store.keys(0, 5), vview = store.values(0, 5);
  CHECK(k.data == kview.data());
  CHECK(k.stride_b == kview.stride(0));
  CHECK(k.stride_h == kview.stride(1));
  CHECK(v.data == vview.data());
  CHECK(v.stride_b == vview.stride(0));
  CHECK(v.stride_h == vview.stride(1));
  // Element (b, h, t, d) written through the blocks is 1000b + 100h + 10t + d.
  for (std::int64_t b = 0; b < 3; ++b)
    for (std::int64_t h = 0; h < 2; ++h)
      for (std::int64_t t = 0; t < 5; ++t) {
        for (std::int64_t d = 0; d < 4; ++d)
          k.data[b * k.stride_b + h * k.stride_h + t * 4 + d] = static_cast<float>(1000 * b + 100 * h + 10 * t + d);
        for (std::int64_t d = 0; d < 2; ++d)
          v.data[b * v.stride_b + h * v.stride_h + t * 2 + d] = static_cast<float>(-1000 * b - 100 * h - 10 * t - d);
      }
  CHECK(store.keys(2, 1)(1, 1, 0, 3) == 1123.0f);
  CHECK(store.values(4, 1)(2, 0, 0, 1) == -2041.0f);
  const std::vector<std::int64_t> idx{2, 0, 2};
  const Store all = store.gathered(idx);
  const Store prefix = store.gathered(idx, 3);
  CHECK(all.capacity() == 5);
  CHECK(prefix.capacity() == 5);
  CHECK(all.bytes() == prefix.bytes());
  CHECK(all.shape().batch == 3);
  for (std::size_t i = 0; i < idx.size(); ++i) {
    const auto b = static_cast<std::int64_t>(i);
    for (std::int64_t h = 0; h < 2; ++h) {
      for (std::int64_t t = 0; t < 5; ++t)
        for (std::int64_t d = 0; d < 4; ++d) {
          const float want = static_cast<float>(1000 * idx[i] + 100 * h + 10 * t + d);
          CHECK(all.keys(0, 5)(b, h, t, d) == want);
          if (t < 3) CHECK(prefix.keys(0, 3)(b, h, t, d) == want);
        }
      for (std::int64_t t = 0; t < 3; ++t)
        for (std::int64_t d = 0; d < 2; ++d)
          CHECK(prefix.values(0, 3)(b, h, t, d) == static_cast<float>(-1000 * idx[i] - 100 * h - 10 * t - d));
    }
  }
}

// ---- memory --------------------------------------------------------------------------------------

TEST_CASE("int4, group 64: the quantized history is <= 0.30x of fp16 per token (head_dim 128, 4096 tokens)") {
  std::mt19937 rng(17);
  using H = Eigen::half;
  LayerCache<kvc::QuantoQuantizedLayer, H> cache(kvc::QuantoQuantizedLayer{4, 0, 0, 64, 128});
  const std::int64_t heads = 8, dim = 128;
  cache.update(gaussian<H>(1, heads, 4096, dim, rng), gaussian<H>(1, heads, 4096, dim, rng), 0);
  const double fp16_bytes = 2.0 /* K and V */ * heads * 4096 * dim * 2 /* bytes per half */;
  const auto [q, r, w] = cache.visit_layer(0, [](const auto& l) {
    return std::tuple{l.quantized_bytes(), l.residual_bytes(), l.workspace_bytes()};
  });
  CHECK(static_cast<double>(q) / fp16_bytes == doctest::Approx(0.28125));  // (32 + 2 + 2) / 128 per group
  CHECK(static_cast<double>(q) / fp16_bytes <= 0.30);
  CHECK(cache.bytes() == q + r + w);
  CHECK(w >= static_cast<std::int64_t>(fp16_bytes));  // the dequantized workspace is counted too
  // Releasing the workspace leaves the quantized history (and the residual).
  cache.visit_layer(0, [](auto& l) { l.release_workspace(); });
  CHECK(cache.bytes() == q + r);
  // The next update rebuilds it and returns the same numbers as an uninterrupted layer.
  LayerCache<kvc::QuantoQuantizedLayer, H> small(kvc::QuantoQuantizedLayer{4, 0, 0, 64, 128});
  const auto p = gaussian<H>(1, 2, 100, 64, rng);
  const auto t = gaussian<H>(1, 2, 1, 64, rng);
  small.update(p, p, 0);
  const auto before = flatten(small.update(t, t, 0).keys);
  small.crop(-1);
  small.visit_layer(0, [](auto& l) { l.release_workspace(); });
  CHECK(flatten(small.update(t, t, 0).keys) == before);
}

TEST_CASE(
    "no stale quantized data leaks through reset, as in transformers' test_quantized_cache_reset (residual_length 2, group 16)") {
  std::mt19937 rng(10);
  LayerCache<kvc::QuantoQuantizedLayer> cache(kvc::QuantoQuantizedLayer{4, 0, 0, 16, 2});
  cache.update(gaussian<float>(1, 4, 4, 64, rng), gaussian<float>(1, 4, 4, 64, rng), 0);
  cache.reset();
  const auto kv = cache.update(gaussian<float>(1, 4, 2, 64, rng), gaussian<float>(1, 4, 2, 64, rng), 0);
  CHECK(kv.keys.extent(2) == 2);
  CHECK(cache.get_seq_length() == 2);
}

// ---- append_only (KIVI) --------------------------------------------------------------------------

namespace {

// The packed codes of chunk c of layer 0's key (or value) history.
template <class C>
std::vector<std::uint8_t> chunk_codes(const C& c, std::size_t chunk, bool keys = true) {
  return c.visit_layer(0, [&](const auto& l) {
    const auto& h = keys ? l.quantized_keys() : l.quantized_values();
    return chunk < h.chunks() ? h.chunk(chunk).packed() : std::vector<std::uint8_t>{};
  });
}
template <class C>
std::size_t chunk_count(const C& c) {
  return c.visit_layer(0, [](const auto& l) { return l.quantized_keys().chunks(); });
}

// Tokens [from, from + len) of t quantized on their own, as the layer's options say.
std::vector<std::uint8_t> encode_slice(const kvc::HostTensor<float>& t, std::int64_t from, std::int64_t len,
                                       const kvc::QuantoQuantizedLayer& o, std::int64_t axis) {
  const std::int64_t S = t.dimension(2), D = t.dimension(3);
  return kvc::detail::quantized_tensor<float>::encode<kvc::QuantoCodec>(
             static_cast<int>(o.nbits), kvc::QuantoCodec::grouping(axis), o.q_group_size, t.data() + from * D,
             t.dimension(0), t.dimension(1), len, D, t.dimension(1) * S * D, S * D)
      .packed();
}

}  // namespace

TEST_CASE("append_only: each flush quantizes the residual and the new tokens as a chunk of their own") {
  const kvc::QuantoQuantizedLayer kind{
      .nbits = 2, .axis_key = -1, .axis_value = 0, .q_group_size = 4, .residual_length = 5, .append_only = true};
  std::mt19937 rng(21);
  LayerCache<kvc::QuantoQuantizedLayer> c(kind);
  const std::vector<std::int64_t> steps = {7, 1, 1, 1, 1, 1, 1, 3, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1};
  kvc::HostTensor<float> ks, vs;
  std::vector<std::int64_t> chunk_ends;  // what the layer should hold: chunks ending here, then a residual
  std::int64_t total = 0, rlen = 0;
  for (std::size_t s = 0; s < steps.size(); ++s) {
    const std::int64_t q = steps[s];
    const auto k = gaussian<float>(2, 2, q, 8, rng, 2), v = gaussian<float>(2, 2, q, 8, rng);
    ks = s == 0 ? k : kvc_test::cat(ks, k);
    vs = s == 0 ? v : kvc_test::cat(vs, v);
    const std::int64_t history_before = quantized_tokens(c);
    const auto kv = c.update(k, v, 0);
    // The same moments as transformers' update (the first call, then a residual of 4 or more).
    total += q;
    if (s == 0 || (rlen > 0 && rlen + 1 >= kind.residual_length)) {
      chunk_ends.push_back(total);
      rlen = 0;
    } else {
      rlen += q;
    }
    CAPTURE(s);
    REQUIRE(chunk_count(c) == chunk_ends.size());
    REQUIRE(quantized_tokens(c) == chunk_ends.back());
    REQUIRE(residual_tokens(c) == rlen);
    // Every chunk holds the codes of its own tokens quantized alone: earlier ones never change.
    for (std::size_t i = 0; i < chunk_ends.size(); ++i) {
      const std::int64_t from = i == 0 ? 0 : chunk_ends[i - 1];
      CHECK(chunk_codes(c, i) == encode_slice(ks, from, chunk_ends[i] - from, kind, kind.axis_key));
      CHECK(chunk_codes(c, i, false) == encode_slice(vs, from, chunk_ends[i] - from, kind, kind.axis_value));
    }
    // What update returns: the history held before the call dequantized, everything after it exact.
    REQUIRE(kv.keys.extent(2) == total);
    const auto got = flatten(kv.values);
    const auto want = kvc_test::slice_seq(vs, 0, total);
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(got.size()); ++i)
      if (i % (total * 8) >= history_before * 8)
        CHECK(got[static_cast<std::size_t>(i)] == want[static_cast<std::size_t>(i)]);
    if (s > 0) CHECK(rel_rms(kv.keys, ks, history_before) < 0.35);
  }

  const auto first = chunk_codes(c, 0), second = chunk_codes(c, 1);
  REQUIRE(chunk_ends.size() >= 3);
  SUBCASE("crop into the history is refused, at a chunk's start too: the chunks stay as they are") {
    CHECK_THROWS_AS(c.crop(chunk_ends[1] + 2 - c.get_seq_length()), kvc::RuntimeError);
    CHECK_THROWS_AS(c.crop(chunk_ends[0] - c.get_seq_length()), kvc::RuntimeError);
    REQUIRE(chunk_count(c) == chunk_ends.size());
    CHECK(chunk_codes(c, 0) == first);
    CHECK(chunk_codes(c, 1) == second);
  }
  SUBCASE("batch reorder moves every chunk's rows") {
    auto swapped = c;
    swapped.reorder_cache({1, 0});
    const auto k = gaussian<float>(2, 2, 1, 8, rng);
    const auto kv = c.update(k, k, 0);
    kvc::HostTensor<float> ks2(2, 2, 1, 8);
    std::copy_n(k.data() + 16, 16, ks2.data());
    std::copy_n(k.data(), 16, ks2.data() + 16);
    const auto sw = swapped.update(ks2, ks2, 0);
    const auto a = flatten(kv.keys), b = flatten(sw.keys);
    const std::size_t half = a.size() / 2;
    CHECK(std::vector<double>(a.begin(), a.begin() + static_cast<std::ptrdiff_t>(half)) ==
          std::vector<double>(b.begin() + static_cast<std::ptrdiff_t>(half), b.end()));
    CHECK(std::vector<double>(a.begin() + static_cast<std::ptrdiff_t>(half), a.end()) ==
          std::vector<double>(b.begin(), b.begin() + static_cast<std::ptrdiff_t>(half)));
  }
}

TEST_CASE("decode_rows (attention's tiles) gives decode()'s values: every width, grouping, start and length") {
  std::mt19937 rng(23);
  std::normal_distribution<float> dist(0.f, 1.f);
  using QT = kvc::detail::quantized_tensor<float>;
  for (const int nbits : {1, 2, 3, 4, 8})
    for (const auto grouping : {kvc::detail::quant_grouping::along_head_dim, kvc::detail::quant_grouping::along_seq})
      for (const std::int64_t dim : {6, 64, 300})
        for (const std::int64_t group : {5, 32, 64}) {
          const std::int64_t B = 2, H = 2, S = 41;
          std::vector<float> src(static_cast<std::size_t>(B * H * S * dim));
          for (float& x : src) x = dist(rng);
          const QT t =
              QT::encode<kvc::HqqCodec>(nbits, grouping, group, src.data(), B, H, S, dim, H * S * dim, S * dim);
          std::vector<float> all(src.size());
          t.decode(all.data(), H * S * dim, S * dim);
          CAPTURE(nbits);
          CAPTURE(dim);
          CAPTURE(group);
          // Every form: AVX2 where the CPU has it, then SSE2 (and the scalar tail) with AVX2 off.
          const bool had_avx2 = kvc::detail::avx2_enabled();
          for (const bool avx2 : {true, false}) {
            if (avx2 && !had_avx2) continue;
            kvc::detail::avx2_enabled() = avx2;
            for (std::int64_t blk = 0; blk < B * H; ++blk)
              for (const auto& [t0, n] : {std::pair<std::int64_t, std::int64_t>{0, S}, {3, 17}, {40, 1}, {32, 9}}) {
                std::vector<float> rows(static_cast<std::size_t>(n * dim), -99.f);
                t.decode_rows(blk, t0, n, rows.data());
                const auto from = all.begin() + blk * S * dim + t0 * dim;
                CHECK(std::equal(rows.begin(), rows.end(), from));
              }
          }
          kvc::detail::avx2_enabled() = had_avx2;
        }
}

// ---- rotate_keys / rotate_values -----------------------------------------------------------------

TEST_CASE("rotate_keys / rotate_values: codes of rotated rows; update, stored and crop see the rows as given") {
  kvc::QuantoQuantizedLayer kind{.nbits = 4, .q_group_size = 16, .residual_length = 4, .append_only = true};
  kind.rotate_keys = kind.rotate_values = true;
  kvc::QuantoQuantizedLayer plain = kind;
  plain.rotate_keys = plain.rotate_values = false;
  std::mt19937 rng(31);
  LayerCache<kvc::QuantoQuantizedLayer> c(kind), p(plain);
  const std::vector<std::int64_t> steps = {9, 1, 1, 1, 1, 2, 1, 1, 1, 1};
  kvc::HostTensor<float> ks, vs;
  std::vector<std::int64_t> chunk_ends;
  std::int64_t total = 0;
  for (std::size_t s = 0; s < steps.size(); ++s) {
    CAPTURE(s);
    const std::int64_t q = steps[s];
    const auto k = gaussian<float>(2, 2, q, 32, rng, 2), v = gaussian<float>(2, 2, q, 32, rng);
    ks = s == 0 ? k : kvc_test::cat(ks, k);
    vs = s == 0 ? v : kvc_test::cat(vs, v);
    const std::int64_t history_before = quantized_tokens(c);
    const auto kv = c.update(k, v, 0);
    const auto kp = p.update(k, v, 0);
    total += q;
    REQUIRE(quantized_tokens(c) == quantized_tokens(p));  // the same schedule
    if (chunk_count(c) > chunk_ends.size()) chunk_ends.push_back(quantized_tokens(c));
    // Each chunk: the codes of its tokens rotated, then quantized.
    kvc::HostTensor<float> kr = ks, vr = vs;
    kvc::hadamard_rotate(kr.data(), kr.size() / 32, 32);
    kvc::hadamard_rotate(vr.data(), vr.size() / 32, 32);
    for (std::size_t i = 0; i < chunk_ends.size(); ++i) {
      const std::int64_t from = i == 0 ? 0 : chunk_ends[i - 1];
      CHECK(chunk_codes(c, i) == encode_slice(kr, from, chunk_ends[i] - from, kind, kind.axis_key));
      CHECK(chunk_codes(c, i, false) == encode_slice(vr, from, chunk_ends[i] - from, kind, kind.axis_value));
    }
    // update returns the rows as given: the history rotated back (closer to the keys than the
    // unrotated layer's, their two outlier channels 20x the rest), the rest exact.
    REQUIRE(kv.keys.extent(2) == total);
    const auto got = flatten(kv.keys);
    const auto want = kvc_test::slice_seq(ks, 0, total);
    for (std::size_t i = 0; i < got.size(); ++i)
      if (static_cast<std::int64_t>(i) % (total * 32) >= history_before * 32) CHECK(got[i] == want[i]);
    if (history_before > 0) {
      CHECK(rel_rms(kv.keys, ks, history_before) < 0.5 * rel_rms(kp.keys, ks, history_before));
      CHECK(rel_rms(kv.values, vs, history_before) < 0.2);
    }
    // stored(): the residual, as given.
    const auto r = c.visit_layer(0, [](const auto& l) { return l.stored(); });
    CHECK(flatten(r.keys) == kvc_test::slice_seq(ks, total - residual_tokens(c), residual_tokens(c)));
  }
  SUBCASE("crop(-1) drops the residual's last token, as for unrotated layers") {
    REQUIRE(residual_tokens(c) >= 1);
    c.crop(-1);
    CHECK(c.get_seq_length() == total - 1);
    const std::int64_t history = quantized_tokens(c);
    const auto k = gaussian<float>(2, 2, 1, 32, rng);
    const auto a = c.update(k, k, 0);
    REQUIRE(a.keys.extent(2) == total);
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t h = 0; h < 2; ++h)
        for (std::int64_t d = 0; d < 32; ++d) {
          for (std::int64_t t = history; t < total - 1; ++t) CHECK(a.keys(b, h, t, d) == ks(b, h, t, d));
          CHECK(a.keys(b, h, total - 1, d) == k(b, h, 0, d));
        }
  }
  SUBCASE("batch selection keeps rotated codes (copied as they are)") {
    auto one = c;
    one.batch_select_indices({1});
    CHECK(one.visit_layer(0, [](const auto& l) { return l.options().rotate_keys; }));
    const auto k = gaussian<float>(1, 2, 1, 32, rng);
    const auto a = one.update(k, k, 0);
    CHECK(rel_rms(a.keys, batch_entry(ks, 1), quantized_tokens(one)) < 0.2);
  }
}
