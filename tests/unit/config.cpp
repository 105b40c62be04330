// kvc::ModelConfig, layer_specs (transformers' get_layer_types_and_kwargs) and the layer-type
// mappings (DYNAMIC/STATIC_LAYER_TYPE_MAPPING, src/transformers/cache_utils.py at a597f974) behind
// make_dynamic_cache and StaticCache.

#include "../support/kvc_test.hpp"

namespace {
kvc::ModelConfig base(std::int64_t layers) {
  kvc::ModelConfig c;
  c.num_hidden_layers = layers;
  c.num_attention_heads = 4;
  c.hidden_size = 64;
  return c;
}
std::vector<std::string> types_of(const std::vector<kvc::LayerSpec>& specs) {
  std::vector<std::string> out;
  for (const auto& s : specs) out.push_back(s.type);
  return out;
}
template <class C>
std::vector<std::string> names_of(const C& cache) {
  std::vector<std::string> out;
  for (std::int64_t i = 0; i < cache.size(); ++i) out.emplace_back(cache.layer_name(i));
  return out;
}
using S = std::vector<std::string>;
}  // namespace

TEST_CASE("layer types derived when the config has none") {
  auto c = base(3);
  CHECK(types_of(kvc::layer_specs(c)) == S(3, "full_attention"));
  c.attention_chunk_size = 8;
  CHECK(types_of(kvc::layer_specs(c)) == S(3, "chunked_attention"));
  c.sliding_window = 4;  // sliding wins over chunked
  const auto specs = kvc::layer_specs(c);
  CHECK(types_of(specs) == S(3, "sliding_attention"));
  CHECK(specs[0].sliding_window == 4);
}

TEST_CASE("explicit layer types, num_kv_shared_layers and each layer's own window") {
  auto c = base(4);
  c.sliding_window = 4;
  c.attention_chunk_size = 16;
  c.layer_types = S{"sliding_attention", "chunked_attention", "full_attention", "full_attention"};
  auto specs = kvc::layer_specs(c);
  CHECK(types_of(specs) == *c.layer_types);
  CHECK(specs[0].sliding_window == 4);  // transformers: 16 for every layer (docs/differences.md item 8)
  CHECK(specs[1].sliding_window == 16);
  CHECK_FALSE(specs[2].sliding_window.has_value());
  c.num_kv_shared_layers = 2;
  CHECK(types_of(kvc::layer_specs(c)) == S{"sliding_attention", "chunked_attention"});
  c.num_kv_shared_layers = 9;
  CHECK(kvc::layer_specs(c).empty());
}

TEST_CASE("per-layer sliding windows in a DynamicCache (test_dynamic_cache_uses_per_layer_sliding_windows)") {
  auto c = base(4);
  c.num_key_value_heads = 4;
  c.per_layer_config[0].sliding_window = 32;
  c.per_layer_config[2].sliding_window = 16;
  const auto cache = kvc::make_dynamic_cache<float>(c);
  CHECK(names_of(cache) == S{"DynamicSlidingWindowLayer", "DynamicLayer", "DynamicSlidingWindowLayer", "DynamicLayer"});
  CHECK(cache.get_max_length(0) == 32);
  CHECK(cache.get_max_length(2) == 16);
  CHECK(cache.is_sliding() == std::vector<bool>{true, false, true, false});
}

TEST_CASE("per-layer sliding windows in a StaticCache (test_static_cache_uses_per_layer_sliding_windows)") {
  auto c = base(4);
  c.per_layer_config[1].sliding_window = 24;
  c.per_layer_config[3].sliding_window = 48;
  const kvc::StaticCache<float> cache(c, 64);
  CHECK(names_of(cache) == S{"StaticLayer", "StaticSlidingWindowLayer", "StaticLayer", "StaticSlidingWindowLayer"});
  CHECK(cache.get_max_length(1) == 24);
  CHECK(cache.get_max_length(3) == 48);
  CHECK(cache.get_max_length(0) == 64);
}

TEST_CASE("head shapes: fallbacks and per-layer overrides") {
  auto c = base(2);
  CHECK(c.layer_head_dim(0) == 16);
  CHECK(c.layer_num_key_value_heads(0) == 4);
  c.num_key_value_heads = 2;
  c.per_layer_config[1].head_dim = 32;
  c.per_layer_config[1].num_attention_heads = 2;
  CHECK(c.layer_head_dim(1) == 32);
  CHECK(c.layer_num_attention_heads(1) == 2);
  CHECK(c.layer_num_key_value_heads(1) == 2);
  c.per_layer_config[0].num_attention_heads = 8;  // head_dim follows hidden_size / heads
  CHECK(c.layer_head_dim(0) == 8);
  kvc::ModelConfig empty;
  CHECK_THROWS_WITH_AS(
      empty.layer_head_dim(0),
      "ModelConfig: head_dim is not set and cannot be derived from hidden_size 0 and num_attention_heads 0",
      kvc::ValueError);
}

TEST_CASE("an unknown layer type is a KeyError naming it and the known ones") {
  auto c = base(2);
  c.layer_types = S{"full_attention", "mamba"};
  const char* message =
      "'mamba' is not a known layer type. Known layer types: ('full_attention', 'sliding_attention', "
      "'chunked_attention', 'conv', 'linear_attention', 'hybrid', 'hybrid_sliding', 'deepseek_sparse_attention', "
      "'moe', 'mlp')";
  CHECK_THROWS_WITH_AS(kvc::make_dynamic_cache<float>(c), message, kvc::KeyError);
  CHECK_THROWS_WITH_AS(kvc::StaticCache<float>(c, 8), message, kvc::KeyError);
}

TEST_CASE("configuration errors") {
  auto c = base(1);
  c.layer_types = S{"sliding_attention"};
  CHECK_THROWS_WITH_AS(kvc::make_dynamic_cache<float>(c),
                       "layer 0 is 'sliding_attention' but the config sets no sliding_window", kvc::ValueError);
  c.layer_types = S{"chunked_attention"};
  CHECK_THROWS_WITH_AS(kvc::StaticCache<float>(c, 4),
                       "layer 0 is 'chunked_attention' but the config sets no attention_chunk_size", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::StaticCache<float>(base(1), 0),
                       "StaticCache: max_cache_len must be a positive integer, got 0", kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::layer_specs(base(-1)), "ModelConfig: num_hidden_layers must be 0 or more, got -1",
                       kvc::ValueError);
}

TEST_CASE_TEMPLATE_DEFINE("the ready-made caches exist for every element type", T, ready_made) {
  auto c = base(2);
  c.sliding_window = 3;
  c.layer_types = S{"sliding_attention", "full_attention"};
  kvc::DynamicCache<T> dynamic;
  auto configured = kvc::make_dynamic_cache<T>(c);
  kvc::StaticCache<T> fixed(c, 5);
  kvc::HostTensor<T> t(1, 4, 4, 16);
  t.setConstant(T(0.5f));
  CHECK(dynamic.update(t, t, 0).keys.extent(2) == 4);
  CHECK(configured.update(t, t, 0).keys.extent(2) == 4);
  CHECK(configured.stored(0).keys.extent(2) == 2);
  CHECK(fixed.update(t, t, 1).keys.extent(2) == 5);
  CHECK(static_cast<float>(fixed.stored(1).keys(0, 3, 3, 15)) == 0.5f);
  CHECK(static_cast<float>(fixed.stored(1).keys(0, 3, 4, 15)) == 0.0f);
}
TEST_CASE_TEMPLATE_APPLY(ready_made, kvc_test::element_types);

TEST_CASE("the layer-type table: names, kinds, windows and the caches' layer policies all come from it") {
  using namespace kvc;
  // The derived lists are the ones transformers' mappings name, in their order.
  static_assert(
      std::is_same_v<
          ConfiguredDynamicLayers,
          Layers<DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer, LinearAttentionAndFullAttentionLayer,
                 LinearAttentionAndSlidingWindowAttentionLayer, DynamicIndexedLayer>>);
  static_assert(std::is_same_v<StaticCacheLayers,
                               Layers<StaticLayer, StaticSlidingWindowLayer, LinearAttentionLayer,
                                      LinearAttentionAndStaticFullAttentionLayer,
                                      LinearAttentionAndStaticSlidingWindowAttentionLayer, StaticIndexedLayer>>);
  static_assert(std::is_same_v<DynamicLayerKind, ConfiguredDynamicCache<float>::kind_variant>);
  static_assert(std::is_same_v<StaticLayerKind, StaticCache<float>::kind_variant>);
  CHECK(std::vector<std::string_view>(known_layer_types.begin(), known_layer_types.end()) ==
        std::vector<std::string_view>{"full_attention", "sliding_attention", "chunked_attention", "conv",
                                      "linear_attention", "hybrid", "hybrid_sliding", "deepseek_sparse_attention",
                                      "moe", "mlp"});
  CHECK(detail::window_field_of("sliding_attention") == window_field::sliding_window);
  CHECK(detail::window_field_of("hybrid_sliding") == window_field::sliding_window);
  CHECK(detail::window_field_of("chunked_attention") == window_field::attention_chunk_size);
  CHECK(detail::window_field_of("full_attention") == window_field::none);
  CHECK(detail::window_field_of("not a type") == window_field::none);

  // Every row builds, in both mappings, the kind it names, with the window and sizes of its spec.
  ModelConfig c = base(0);
  c.layer_types = S(known_layer_types.begin(), known_layer_types.end());
  c.num_hidden_layers = static_cast<std::int64_t>(known_layer_types.size());
  c.sliding_window = 3;
  c.attention_chunk_size = 5;
  c.number_of_conv_states = 2;
  const auto dynamic = dynamic_layer_kinds(c);
  const auto fixed = static_layer_kinds(c, 16);
  REQUIRE(dynamic.size() == known_layer_types.size());
  REQUIRE(fixed.size() == known_layer_types.size());
  std::size_t i = 0;
  boost::mp11::mp_for_each<layer_type_table>([&](auto row) {
    using R = decltype(row);
    CAPTURE(R::name);
    CHECK(std::holds_alternative<typename R::dynamic_kind>(dynamic[i]));
    CHECK(std::holds_alternative<typename R::static_kind>(fixed[i]));
    ++i;
  });
  CHECK(std::get<DynamicSlidingWindowLayer>(dynamic[1]).sliding_window == 3);
  CHECK(std::get<DynamicSlidingWindowLayer>(dynamic[2]).sliding_window == 5);
  CHECK(std::get<StaticSlidingWindowLayer>(fixed[2]).max_cache_len == 16);
  CHECK(std::get<StaticSlidingWindowLayer>(fixed[2]).sliding_window == 5);
  CHECK(std::get<LinearAttentionLayer>(dynamic[3]).number_of_states == 2);
  CHECK(std::get<LinearAttentionAndSlidingWindowAttentionLayer>(dynamic[6]).attention.sliding_window == 3);
  CHECK(std::get<LinearAttentionAndStaticSlidingWindowAttentionLayer>(fixed[6]).attention.max_cache_len == 16);
  CHECK(std::get<LinearAttentionAndStaticFullAttentionLayer>(fixed[5]).number_of_states == 2);
  CHECK(std::get<StaticIndexedLayer>(fixed[7]).max_cache_len == 16);
}
