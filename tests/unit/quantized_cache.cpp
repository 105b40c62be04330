// kvc::QuantizedCache<T>(backend, config, QuantizedOptions): transformers' QuantizedCache and the
// argument checks of QuantoQuantizedLayer, HQQQuantizedLayer and QuantizedCache.__init__
// (src/transformers/cache_utils.py at a597f974); the layer count of docs/differences.md item 29.

#include <limits>
#include <optional>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "../support/kvc_test.hpp"

#include <kvc/cache_traits.hpp>
#include <kvc/caches.hpp>
#include <kvc/quantized_attention.hpp>
#include <kvc/quantized_cache.hpp>

namespace {

kvc::ModelConfig llama_like(std::int64_t layers = 3) {
  kvc::ModelConfig c;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.hidden_size = 64;
  return c;
}

// The ValueError message f throws, or "" when it throws none.
template <class F>
std::string value_error_of(F&& f) {
  try {
    f();
  } catch (const kvc::ValueError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("QuantizedOptions is the layer kinds' option set, without a codec") {
  static_assert(std::is_same_v<kvc::QuantizedOptions, kvc::QuantizedLayer<void>>);
  static_assert(std::is_aggregate_v<kvc::QuantizedOptions>);
  constexpr kvc::QuantizedOptions defaults{};
  static_assert(defaults.nbits == 4 && defaults.axis_key == 0 && defaults.axis_value == 0 &&
                defaults.q_group_size == 64 && defaults.residual_length == 128);
  constexpr kvc::QuantizedOptions opts{
      .nbits = 2, .axis_key = -1, .axis_value = 1, .q_group_size = 8, .residual_length = 3};
  constexpr kvc::HQQQuantizedLayer kind = kvc::detail::with_codec<kvc::HqqCodec>(opts);
  static_assert(kind.nbits == 2 && kind.axis_key == -1 && kind.axis_value == 1 && kind.q_group_size == 8 &&
                kind.residual_length == 3);
  const kvc::QuantizedCache<float> cache("quanto", llama_like(1), {.nbits = 2, .residual_length = 3});
  const kvc::QuantizedOptions layer =
      cache.visit_layer(0, [](const auto& l) { return kvc::detail::with_codec<void>(l.options()); });
  CHECK(layer.nbits == 2);
  CHECK(layer.q_group_size == 64);
  CHECK(layer.residual_length == 3);
}

// One function, detail::validate_quantized_options, checks the options for the layer kinds and for
// QuantizedCache: every bad option gets the same message from all three, for both backends.
TEST_CASE("the layer and the cache reject the same options with the same message") {
  const std::vector<kvc::QuantizedOptions> cases{
      {.nbits = 3},
      {.nbits = 5},
      {.nbits = 0},
      {.axis_key = 1},
      {.axis_key = -1},
      {.axis_value = 2},
      {.axis_value = -1},
      {.q_group_size = 0},
      {.q_group_size = kvc::max_extent + 1},
      {.residual_length = -1},
      {.residual_length = std::numeric_limits<std::int64_t>::max()},
      {.nbits = 2, .q_group_size = 1, .residual_length = 1},
      {},
  };
  auto check = [&]<class Codec>(Codec, const char* backend) {
    using Kind = kvc::QuantizedLayer<Codec>;
    using State = typename Kind::template state<kvc::HostStorage<float>>;
    std::int64_t rejected = 0;
    for (const auto& o : cases) {
      const Kind kind = kvc::detail::with_codec<Codec>(o);
      const std::string direct = value_error_of([&] { kvc::detail::validate_quantized_options(kind); });
      CAPTURE(backend);
      CAPTURE(direct);
      CHECK(value_error_of([&] { State s(kind); }) == direct);
      CHECK(value_error_of([&] { kvc::Cache<kvc::Layers<Kind>> c(kind); }) == direct);
      CHECK(value_error_of([&] { kvc::QuantizedCache<float>(backend, llama_like(2), o); }) == direct);
      CHECK(value_error_of([&] { kvc::QuantizedCache<float>(backend, llama_like(0), o); }) == direct);
      if (!direct.empty()) ++rejected;
    }
    return rejected;
  };
  // quanto accepts nbits 2 and axis -1, HQQ nbits 3 and axis 1.
  CHECK(check(kvc::QuantoCodec{}, "quanto") == 9);
  CHECK(check(kvc::HqqCodec{}, "hqq") == 9);
}

TEST_CASE("backend names: exactly \"quanto\" or \"hqq\" (QuantizedCache.__init__)") {
  const auto config = llama_like();
  CHECK(kvc::QuantizedCache<float>("quanto", config).layer_name(0) == "QuantoQuantizedLayer");
  CHECK(kvc::QuantizedCache<float>("hqq", config).layer_name(2) == "HQQQuantizedLayer");
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("HQQ", config), "Unknown quantization backend `HQQ`",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("", config), "Unknown quantization backend ``", kvc::ValueError);
}

TEST_CASE("only full-attention layers (QuantizedCache.__init__): a Python set repr, elements sorted") {
  auto config = llama_like(4);
  config.layer_types =
      std::vector<std::string>{"full_attention", "sliding_attention", "full_attention", "sliding_attention"};
  config.sliding_window = 16;
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("quanto", config),
                       "`QuantizedCache` is only supported for models with only full attention layers. We found the "
                       "following invalid layer types: {'sliding_attention'}",
                       kvc::ValueError);
  config.layer_types =
      std::vector<std::string>{"sliding_attention", "linear_attention", "chunked_attention", "full_attention"};
  config.attention_chunk_size = 8;
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("hqq", config),
                       "`QuantizedCache` is only supported for models with only full attention layers. We found the "
                       "following invalid layer types: {'chunked_attention', 'linear_attention', 'sliding_attention'}",
                       kvc::ValueError);
  // A model-wide sliding_window without layer_types makes every layer sliding.
  auto sliding = llama_like(2);
  sliding.sliding_window = 32;
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("quanto", sliding),
                       "`QuantizedCache` is only supported for models with only full attention layers. We found the "
                       "following invalid layer types: {'sliding_attention'}",
                       kvc::ValueError);
}

TEST_CASE("checks run in transformers' order: backend, layer types, then the layer's own") {
  auto config = llama_like(2);
  config.sliding_window = 32;
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("nope", config, {3}), "Unknown quantization backend `nope`",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("quanto", config, {3}),
                       "`QuantizedCache` is only supported for models with only full attention layers. We found the "
                       "following invalid layer types: {'sliding_attention'}",
                       kvc::ValueError);
  const auto full = llama_like(2);
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("quanto", full, {3, 1, 1}),
                       "`nbits` for `quanto` backend has to be one of [`2`, `4`] but got 3", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("quanto", full, {4, 1, 1}),
                       "`axis_key` for `quanto` backend has to be one of [`0`, `-1`] but got 1", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("quanto", full, {4, -1, 1}),
                       "`axis_value` for `quanto` backend has to be one of [`0`, `-1`] but got 1", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("hqq", full, {6, 2, 2}),
                       "`nbits` for `HQQ` backend has to be one of [`1`, `2`, `3`, `4`, `8`] but got 6",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("hqq", full, {8, -1, 2}),
                       "`axis_key` for `HQQ` backend has to be one of [`0`, `1`] but got -1", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("hqq", full, {8, 1, -1}),
                       "`axis_value` for `HQQ` backend has to be one of [`0`, `1`] but got -1", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("hqq", full, {4, 0, 0, 0}),
                       "HQQQuantizedLayer: `q_group_size` must be a positive integer, got 0", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("quanto", full, {4, 0, 0, 64, 0}),
                       "QuantoQuantizedLayer: `residual_length` must be a positive integer, got 0", kvc::ValueError);
  // Checked even when the config has no layers.
  CHECK_THROWS_WITH_AS(kvc::QuantizedCache<float>("quanto", llama_like(0), {3}),
                       "`nbits` for `quanto` backend has to be one of [`2`, `4`] but got 3", kvc::ValueError);
}

TEST_CASE("one layer per config layer, after the KV-shared layers (docs/differences.md item 29)") {
  CHECK(kvc::QuantizedCache<float>("quanto", llama_like(3)).size() == 3);
  auto shared = llama_like(4);
  shared.layer_types = std::vector<std::string>(4, "full_attention");
  shared.num_kv_shared_layers = 1;
  CHECK(kvc::QuantizedCache<float>("hqq", shared).size() == 3);  // transformers builds 4
}

TEST_CASE_TEMPLATE("a decode loop over every layer, every element type", T, float, double, Eigen::half,
                   Eigen::bfloat16) {
  std::mt19937 rng(21);
  kvc::QuantizedCache<T> cache("quanto", llama_like(2), {4, 0, -1, 16, 8});
  CHECK_FALSE(cache.is_compileable());
  CHECK(cache.get_max_length() == -1);
  CHECK(cache.is_sliding() == std::vector<bool>{false, false});
  const auto prefill = kvc_test::random_tensor<T>(2, 2, 20, 16, rng);
  for (std::int64_t l = 0; l < 2; ++l) {
    const auto kv = cache.update(prefill, prefill, l);
    CHECK(kvc_test::flatten(kv.keys) == kvc_test::slice_seq(prefill, 0, 20));
  }
  for (std::int64_t step = 1; step <= 20; ++step) {
    const auto tok = kvc_test::random_tensor<T>(2, 2, 1, 16, rng);
    for (std::int64_t l = 0; l < 2; ++l) {
      CHECK(cache.get_mask_sizes(1, l) == std::pair<std::int64_t, std::int64_t>{20 + step, 0});
      const auto kv = cache.update(tok, tok, l);
      CHECK(kv.keys.extent(2) == 20 + step);
      CHECK(cache.get_seq_length(l) == 20 + step);
    }
  }
  CHECK(cache.batch_size() == 2);
  cache.batch_select_indices({1});
  CHECK(cache.batch_size() == 1);
  CHECK(cache.rollback_depth() == 4);  // the residual's tokens: 20 decode steps, residual_length 8
  CHECK_THROWS_AS(cache.crop(-25), kvc::RuntimeError);
  cache.crop(-3);
  CHECK(cache.get_seq_length(1) == 37);
  cache.reset();
  CHECK(cache.get_seq_length() == 0);
  CHECK(cache.bytes() == 0);
}

TEST_CASE("a throwing call changes no layer (strong guarantee)") {
  std::mt19937 rng(22);
  kvc::QuantizedCache<float> cache("hqq", llama_like(2), {4, 1, 1, 8, 4});
  const auto p = kvc_test::random_tensor<float>(1, 2, 9, 16, rng);
  cache.update(p, p, 0);
  cache.update(p, p, 1);
  const auto before = kvc_test::take_snapshot(cache);
  const auto bad = kvc_test::random_tensor<float>(1, 2, 1, 8, rng);
  CHECK_THROWS_AS(cache.update(bad, bad, 1), kvc::ValueError);
  CHECK_THROWS_AS(cache.update(p, p, 2), kvc::IndexError);
  CHECK_THROWS_AS(cache.reorder_cache({1}), kvc::IndexError);
  CHECK(kvc_test::take_snapshot(cache) == before);
}

TEST_CASE("PerLayerQuantizedCache: layers kept in full precision, a bit width per layer") {
  using Cache = kvc::PerLayerQuantizedCache<float>;
  // The first and last layers in full precision (vLLM's skip list, as indices from either end).
  const Cache skipped("quanto", llama_like(4), {.nbits = 2}, {.skip_layers = {0, -1}});
  CHECK(kvc::cache_repr(skipped) ==
        "QuantizedCache(layers=[DynamicLayer, QuantoQuantizedLayer, QuantoQuantizedLayer, DynamicLayer])");
  // One entry per layer: its nbits, or full precision; skip_layers wins over it.
  const Cache listed("hqq", llama_like(4), {.axis_key = 1, .axis_value = 1},
                     {.skip_layers = {2}, .layer_nbits = {8, std::nullopt, 3, 2}});
  const auto nbits_of = [&](std::int64_t i) {
    return listed.visit_layer(i, [](const auto& l) -> std::int64_t {
      if constexpr (requires { l.options(); })
        return l.options().nbits;
      else
        return 0;  // full precision
    });
  };
  CHECK(std::vector<std::int64_t>{nbits_of(0), nbits_of(1), nbits_of(2), nbits_of(3)} ==
        std::vector<std::int64_t>{8, 0, 0, 2});
  CHECK(value_error_of([] { Cache("quanto", llama_like(3), {}, {.skip_layers = {3}}); }) ==
        "QuantizedCache: skip_layers entry 3 is out of range for 3 layers");
  CHECK(value_error_of([] { Cache("quanto", llama_like(3), {}, {.skip_layers = {-4}}); }) ==
        "QuantizedCache: skip_layers entry -4 is out of range for 3 layers");
  CHECK(value_error_of([] {
          Cache("quanto", llama_like(3), {}, {.layer_nbits = {4, 4}});
        }) == "QuantizedCache: layer_nbits has 2 entries for 3 layers");
  // A layer's own nbits gets its codec's check, with the message the options would get.
  CHECK(value_error_of([] {
          Cache("quanto", llama_like(2), {}, {.layer_nbits = {4, 3}});
        }) == value_error_of([] { kvc::QuantizedCache<float>("quanto", llama_like(2), {.nbits = 3}); }));
  CHECK_FALSE(value_error_of([] { kvc::QuantizedCache<float>("quanto", llama_like(2), {.nbits = 3}); }).empty());
}

TEST_CASE("value_nbits: keys at nbits and values at their own width, each as a uniform cache holds it") {
  // HQQ 8-bit keys with 2-bit values against uniform 8-bit and 2-bit caches, through flushes: the
  // keys returned are the 8-bit cache's and the values the 2-bit cache's, bit for bit.
  std::mt19937 rng(29);
  const kvc::QuantizedOptions eight{
      .nbits = 8, .axis_key = 1, .axis_value = 1, .q_group_size = 16, .residual_length = 4};
  kvc::QuantizedOptions two = eight, split = eight;
  two.nbits = 2;
  split.value_nbits = 2;
  CHECK(split.value_bits() == 2);
  CHECK(eight.value_bits() == 8);  // 0: the keys' width
  kvc::QuantizedCache<float> a("hqq", llama_like(1), split), b("hqq", llama_like(1), eight),
      c("hqq", llama_like(1), two);
  const auto flat = [](const kvc::TensorView<float>& t) {
    const auto x = t.to_tensor();
    return std::vector<float>(x.data(), x.data() + x.size());
  };
  bool values_differ = false;
  for (const std::int64_t tokens : {9, 1, 1, 1, 1, 1}) {
    const auto k = kvc_test::random_tensor<float>(1, 2, tokens, 32, rng);
    const auto v = kvc_test::random_tensor<float>(1, 2, tokens, 32, rng);
    const auto got = a.update(k, v, 0), all8 = b.update(k, v, 0), all2 = c.update(k, v, 0);
    CHECK(flat(got.keys) == flat(all8.keys));
    CHECK(flat(got.values) == flat(all2.values));
    values_differ = values_differ || flat(got.values) != flat(all8.values);
  }
  CHECK(values_differ);  // 2-bit values are not 8-bit ones
  CHECK(value_error_of([] { kvc::QuantizedCache<float>("quanto", llama_like(1), {.nbits = 4, .value_nbits = 3}); }) ==
        "QuantoQuantizedLayer: `value_nbits` has to be 0 (the keys' nbits) or one of [`2`, `4`], got 3");
}

TEST_CASE("PerLayerQuantizedCache: attend_quantized reads each layer as it is stored") {
  // Layer 0 in full precision, layer 1 int2, layer 2 int4: each against a cache of that kind alone.
  std::mt19937 rng(23);
  const kvc::QuantizedOptions opts{.nbits = 4, .q_group_size = 16, .residual_length = 4};
  kvc::PerLayerQuantizedCache<float> mixed("quanto", llama_like(3), opts, {.layer_nbits = {std::nullopt, 2, 4}});
  kvc::DynamicCache<float> full;
  kvc::QuantizedCache<float> int2("quanto", llama_like(3), {.nbits = 2, .q_group_size = 16, .residual_length = 4});
  kvc::QuantizedCache<float> int4("quanto", llama_like(3), opts);
  const auto flat = [](const kvc::HostTensor<float>& t) { return std::vector<float>(t.data(), t.data() + t.size()); };
  for (const std::int64_t tokens : {9, 1, 1, 1, 1, 1}) {
    const auto q = kvc_test::random_tensor<float>(1, 4, tokens, 16, rng);
    const auto k = kvc_test::random_tensor<float>(1, 2, tokens, 16, rng);
    const auto v = kvc_test::random_tensor<float>(1, 2, tokens, 16, rng);
    const auto want0 = kvc::attend(full, 0, q, k, v);
    const auto want1 = kvc::attend_quantized(int2, 1, q, k, v);
    const auto want2 = kvc::attend_quantized(int4, 2, q, k, v);
    CHECK(flat(kvc::attend_quantized(mixed, 0, q, k, v)) == flat(want0));
    CHECK(flat(kvc::attend_quantized(mixed, 1, q, k, v)) == flat(want1));
    CHECK(flat(kvc::attend_quantized(mixed, 2, q, k, v)) == flat(want2));
  }
  CHECK(mixed.get_seq_length(0) == 14);
  CHECK(mixed.bytes() < full.bytes() * 3);  // two of three layers quantized
}
