// kvc::StaticCacheExport (transformers' TorchExportableModuleWithStaticCache) and get_head_shapes.

#include <kvc/export.hpp>

#include "../support/kvc_test.hpp"

using kvc_test::seq;
using kvc_test::values_of;
using V = std::vector<float>;

namespace {
kvc::ModelConfig gemma_like() {
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 1;
  c.head_dim = 1;
  c.sliding_window = 2;
  c.layer_types = std::vector<std::string>{"sliding_attention", "full_attention"};
  return c;
}
kvc::GenerationConfig static_generation() {
  kvc::GenerationConfig g;
  g.use_cache = true;
  g.cache_implementation = "static";
  return g;
}
}  // namespace

TEST_CASE("the three assertions, verbatim") {
  const auto c = gemma_like();
  CHECK_THROWS_WITH_AS(kvc::StaticCacheExport<float>(c, std::nullopt, 1, 8),
                       "The model must have a generation config to be exported with static caching. Please set "
                       "`generation_config` in `model`.",
                       kvc::AssertionError);
  auto g = static_generation();
  g.use_cache = false;
  CHECK_THROWS_WITH_AS(kvc::StaticCacheExport<float>(c, g, 1, 8),
                       "The model must have caching enabled to be exported with static caching. Please set "
                       "`generation_config.use_cache=True`.",
                       kvc::AssertionError);
  g = static_generation();
  g.cache_implementation = "dynamic";
  const char* not_static =
      "The model must use a 'static' caching implementation to be exported with static caching. Please set "
      "`generation_config.cache_implementation='static'`.";
  CHECK_THROWS_WITH_AS(kvc::StaticCacheExport<float>(c, g, 1, 8), not_static, kvc::AssertionError);
  g.cache_implementation.reset();
  CHECK_THROWS_WITH_AS(kvc::StaticCacheExport<float>(c, g, 1, 8), not_static, kvc::AssertionError);
}

TEST_CASE("batch_size and max_cache_len come from the arguments, else cache_config") {
  const auto c = gemma_like();
  auto g = static_generation();
  CHECK_THROWS_WITH_AS(kvc::StaticCacheExport<float>(c, g, std::nullopt, 8),
                       "batch_size must be provided, either as an argument or in cache_config.", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::StaticCacheExport<float>(c, g, 1, std::nullopt),
                       "max_cache_len must be provided, either as an argument or in cache_config.", kvc::ValueError);
  g.cache_config = {{"batch_size", 3}, {"max_cache_len", 6}};
  kvc::StaticCacheExport<float> from_config(c, g);
  CHECK(from_config.batch_size() == 3);
  CHECK(from_config.max_cache_len() == 6);
  kvc::StaticCacheExport<float> from_arguments(c, g, 2, 5);  // arguments win
  CHECK(from_arguments.batch_size() == 2);
  CHECK(from_arguments.max_cache_len() == 5);
  g.cache_config = {{"batch_size", "two"}};
  CHECK_THROWS_WITH_AS(kvc::StaticCacheExport<float>(c, g, std::nullopt, 4),
                       "cache_config: `batch_size` must be an integer, got \"two\"", kvc::ValueError);
}

TEST_CASE("sliding layers become full static layers, allocated with the model's head shapes") {
  auto c = gemma_like();
  c.per_layer_config[1].head_dim = 4;
  kvc::StaticCacheExport<Eigen::bfloat16> exported(c, static_generation(), 2, 8);
  const auto& cache = exported.cache();
  REQUIRE(cache.size() == 2);
  CHECK(cache.layer_name(0) == "StaticLayer");
  CHECK(cache.layer_name(1) == "StaticLayer");
  CHECK(cache.get_max_length(0) == 8);  // the window of 2 no longer limits layer 0
  CHECK(cache.is_initialized());
  const auto buffers = exported.buffers();
  REQUIRE(buffers.size() == 4);
  CHECK(buffers[0].name == "key_cache_0");
  CHECK(buffers[1].name == "value_cache_0");
  CHECK(buffers[3].name == "value_cache_1");
  CHECK(buffers[0].shape == std::array<std::int64_t, 4>{2, 1, 8, 1});
  CHECK(buffers[2].shape == std::array<std::int64_t, 4>{2, 1, 8, 4});
  CHECK(buffers[2].dtype == "bfloat16");
  CHECK(buffers[2].data == cache.stored(1).keys.data());
}

TEST_CASE("begin_step writes at cache_position[0], so one program serves every position") {
  auto c = gemma_like();
  c.num_key_value_heads = 1;
  kvc::StaticCacheExport<float> exported(c, static_generation(), 1, 4);
  auto& cache = exported.cache();
  exported.begin_step({0, 1});
  cache.update(seq({1, 2}), seq({1, 2}), 0);
  exported.begin_step({2});
  cache.update(seq({3}), seq({3}), 0);
  CHECK(values_of(cache.stored(0).keys) == V{1, 2, 3, 0});
  exported.begin_step({1});  // rewrite from position 1
  cache.update(seq({9}), seq({9}), 0);
  CHECK(values_of(cache.stored(0).keys) == V{1, 9, 3, 0});
  const void* before = exported.buffers()[0].data;
  CHECK(before == cache.stored(0).keys.data());  // never reallocated
  CHECK_THROWS_WITH_AS(exported.begin_step(std::span<const std::int64_t>{}),
                       "begin_step: cache_position must hold at least one position", kvc::ValueError);
  CHECK_THROWS_AS(exported.begin_step({5}), kvc::IndexError);
}

TEST_CASE("get_head_shapes: one entry per cache layer, never an empty list") {
  auto c = gemma_like();
  c.num_key_value_heads = 2;
  c.per_layer_config[1].head_dim = 16;
  c.per_layer_config[1].num_key_value_heads = 4;
  auto shapes = kvc::get_head_shapes(c);
  CHECK(shapes.num_heads == std::vector<std::int64_t>{2, 4});
  CHECK(shapes.head_dim == std::vector<std::int64_t>{1, 16});
  c.num_kv_shared_layers = 1;
  shapes = kvc::get_head_shapes(c);
  CHECK(shapes.num_heads == std::vector<std::int64_t>{2});
  c.num_kv_shared_layers = 0;  // transformers: layer_types[:-0] == [] (docs/differences.md item 20)
  CHECK(kvc::get_head_shapes(c).num_heads.size() == 2);
}

TEST_CASE("hostile export sizes: cache_config and positions past the limits") {
  auto g = static_generation();
  // cache_config.max_cache_len 2^62 + 1 used to build a cache whose buffers' sizes wrapped around.
  g.cache_config = nlohmann::ordered_json{{"batch_size", 1}, {"max_cache_len", (std::int64_t{1} << 62) + 1}};
  CHECK_THROWS_WITH_AS(kvc::StaticCacheExport<float>(gemma_like(), g),
                       "StaticCache: max_cache_len is 4611686018427387905, above kvc's limit of 1099511627776",
                       kvc::ValueError);
  g.cache_config = nlohmann::ordered_json::parse(R"({"batch_size": 18446744073709551615, "max_cache_len": 8})");
  CHECK_THROWS_WITH_AS(kvc::StaticCacheExport<float>(gemma_like(), g),
                       "cache_config: `batch_size` must be an integer that fits in 64 bits, got 18446744073709551615",
                       kvc::ValueError);
  g.cache_config = nlohmann::ordered_json{{"batch_size", std::int64_t{1} << 40}, {"max_cache_len", 8}};
  CHECK_THROWS_WITH_AS(kvc::StaticCacheExport<float>(gemma_like(), g),
                       "early_initialization: batch_size is 1099511627776, above kvc's limit of 1048576",
                       kvc::ValueError);
  g.cache_config = nlohmann::ordered_json{{"batch_size", 1}, {"max_cache_len", 8}};
  kvc::StaticCacheExport<float> exported(gemma_like(), g);
  CHECK_THROWS_WITH_AS(
      exported.begin_step({std::int64_t{1} << 40}),
      "set_write_position: position 1099511627776 is out of range for a StaticLayer with max_cache_len 8",
      kvc::IndexError);
  CHECK(exported.cache().get_seq_length() == 0);
}
