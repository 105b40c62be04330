// kvc::make_cache (the cache generate() builds for each cache_implementation) and
// kvc::prepare_cache_for_generation (transformers' _prepare_cache_for_generation and its messages,
// generation/utils.py).

#include <limits>

#include <kvc/runtime.hpp>

#include "../support/kvc_test.hpp"

namespace {
kvc::ModelConfig gemma_like() {
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.sliding_window = 4;
  c.layer_types = std::vector<std::string>{"sliding_attention", "full_attention"};
  return c;
}
kvc::GenerationConfig with(std::optional<std::string> impl) {
  kvc::GenerationConfig g;
  g.cache_implementation = std::move(impl);
  return g;
}
}  // namespace

TEST_CASE("None, 'dynamic' and 'hybrid' build the config's dynamic cache") {
  for (const auto& impl : std::vector<std::optional<std::string>>{std::nullopt, "dynamic", "hybrid"}) {
    auto cache = kvc::make_cache(with(impl), gemma_like());
    REQUIRE(cache.get<kvc::ConfiguredDynamicCache<float>>() != nullptr);
    CHECK(cache.layer_name(0) == "DynamicSlidingWindowLayer");
    CHECK(cache.layer_name(1) == "DynamicLayer");
  }
  auto bf16 = kvc::make_cache<Eigen::bfloat16>(with("dynamic"), gemma_like());
  CHECK(bf16.element_type_name() == "bfloat16");
  // "hybrid" is None by the time generate() validates: a max_cache_len next to it is ignored.
  kvc_test::captured_warnings w;
  auto hybrid = with("hybrid");
  hybrid.max_cache_len = 64;
  CHECK(kvc::make_cache(hybrid, gemma_like()).get<kvc::ConfiguredDynamicCache<float>>() != nullptr);
  REQUIRE(w.messages.size() == 1);
  CHECK(w.messages[0] ==
        "`max_cache_len` is only used with static caches (('static', 'offloaded_static')); it will be ignored with "
        "`cache_implementation=None`.");
}

TEST_CASE("'static': max(max_length - 1, max_cache_len), eager for a chunked prefill") {
  auto g = with("static");
  g.max_length = 33;
  auto cache = kvc::make_cache(g, gemma_like());
  REQUIRE(cache.get<kvc::StaticCache<float>>() != nullptr);
  CHECK(cache.get_max_length(1) == 32);
  CHECK(cache.get_max_length(0) == 4);
  CHECK_FALSE(cache.is_initialized());
  g.max_cache_len = 100;
  CHECK(kvc::make_cache(g, gemma_like()).get_max_length(1) == 100);
  CHECK(kvc::make_cache(g, gemma_like(), {1, 200}).get_max_length(1) == 200);
  g.prefill_chunk_size = 8;
  g.num_beams = 3;
  g.num_return_sequences = 2;
  auto eager = kvc::make_cache(g, gemma_like(), {2, -1});
  CHECK(eager.is_initialized());
  CHECK(eager.batch_size() == 6);  // batch × max(num_beams, num_return_sequences)
  CHECK(eager.stored<float>(1).keys.extents == std::array<std::int64_t, 4>{6, 2, 100, 8});
}

TEST_CASE("deprecated static names build a StaticCache and warn once") {
  kvc_test::captured_warnings w;
  for (const char* impl : {"sliding_window", "hybrid_chunked", "sliding_window"}) {
    auto g = with(impl);
    auto cache = kvc::make_cache(g, gemma_like());
    CHECK(cache.get<kvc::StaticCache<float>>() != nullptr);
  }
  REQUIRE(w.messages.size() == 2);
  CHECK(w.messages[0] ==
        "Using `cache_implementation='sliding_window' is deprecated and will be removed in v5.13. Please only use one "
        "of ('static', 'offloaded_static'), and the layer structure will be inferred automatically.");
}

TEST_CASE("'paged' builds a paged cache; unknown names and a zero length are refused") {
  // The paged cache itself: tests/unit/paged_batch_cache.cpp.
  CHECK(kvc::make_cache(with("paged"), gemma_like()).get<kvc::PagedBatchCache<kvc::HostStorage<float>>>() != nullptr);
  CHECK_THROWS_AS(kvc::make_cache(with("mamba"), gemma_like()), kvc::ValueError);  // validate's message
  auto g = with("static");
  g.max_length = 1;
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, gemma_like()),
                       "make_cache: a static cache needs a positive max_cache_len, got 0 (from max_length 1 and "
                       "max_cache_len)",
                       kvc::ValueError);
}

TEST_CASE("prepare_cache_for_generation: the user's cache, use_cache, unsupported models, assistants") {
  const auto m = gemma_like();
  SUBCASE("a user cache together with cache_implementation") {
    CHECK_THROWS_WITH_AS(
        kvc::prepare_cache_for_generation(with("static"), m, "LlamaForCausalLM", kvc::DynamicCache<float>()),
        "Passing both `cache_implementation` (used to initialize certain caches) and `past_key_values` "
        "(a Cache object) is unsupported. Please use only one of the two.",
        kvc::ValueError);
    CHECK_THROWS_WITH_AS(
        kvc::prepare_cache_for_generation(with("static"), m, "FalconMambaForCausalLM", kvc::DynamicCache<float>()),
        "Passing both `cache_implementation` (used to initialize certain caches) and `cache_params` "
        "(a Cache object) is unsupported. Please use only one of the two.",
        kvc::ValueError);
  }
  SUBCASE("a user cache alone is used as is") {
    auto cache = kvc::prepare_cache_for_generation(with(std::nullopt), m, "llama", kvc::DynamicCache<float>());
    REQUIRE(cache);
    CHECK(cache->get<kvc::DynamicCache<float>>() != nullptr);
  }
  SUBCASE("raw per-layer tensors are refused") {
    std::vector<std::pair<kvc::HostTensor<float>, kvc::HostTensor<float>>> legacy(1);
    CHECK_THROWS_WITH_AS(
        kvc::prepare_cache_for_generation(with(std::nullopt), m, "llama", legacy),
        "Passing a tuple of `past_key_values` is not supported anymore. Please use a `Cache` instance.",
        kvc::ValueError);
  }
  SUBCASE("use_cache false builds nothing") {
    auto g = with("static");
    g.use_cache = false;
    kvc_test::captured_warnings w;  // validate's use_cache notice goes through the handler
    CHECK_FALSE(kvc::prepare_cache_for_generation(g, m, "llama").has_value());
  }
  SUBCASE("models without Cache support") {
    kvc_test::captured_warnings w;
    CHECK_FALSE(kvc::prepare_cache_for_generation(with("static"), m, "RwkvForCausalLM").has_value());
    REQUIRE(w.messages.size() == 1);
    CHECK(w.messages[0] ==
          "This model does not support `Cache` instances. `cache_implementation` (set to static) will be ignored.");
    CHECK(kvc::prepare_cache_for_generation(with(std::nullopt), m, "MiniMaxM2ForCausalLM").has_value());
    CHECK_FALSE(kvc::prepare_cache_for_generation(with(std::nullopt), m, "MiniMaxForCausalLM").has_value());
  }
  SUBCASE("an assistant records its sliding past") {
    auto g = with(std::nullopt);
    g.is_assistant = true;
    auto cache = kvc::prepare_cache_for_generation(g, m, "gemma2");
    REQUIRE(cache);
    kvc::HostTensor<float> t(1, 2, 6, 8);
    t.setConstant(1.f);
    cache->update(t, t, 0);
    CHECK(cache->stored<float>(0).keys.extent(2) == 6);  // all 6 kept, not the window's 3
  }
}

namespace {
kvc::ModelConfig llama_like() {
  kvc::ModelConfig c;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  return c;
}
}  // namespace

TEST_CASE("'quantized': QuantizedCache from cache_config, which is never changed (docs/differences.md item 19)") {
  auto g = with("quantized");
  g.cache_config = nlohmann::ordered_json{{"backend", "hqq"}, {"nbits", 8}, {"axis_key", 1}, {"residual_length", 4}};
  const auto before = g.cache_config;
  for (int call = 0; call < 2; ++call) {  // transformers' second call silently falls back to quanto
    auto cache = kvc::make_cache(g, llama_like());
    REQUIRE(cache.get<kvc::QuantizedCache<float>>() != nullptr);
    CHECK(cache.layer_name(0) == "HQQQuantizedLayer");
    CHECK(cache.size() == 2);
    CHECK(g.cache_config == before);
  }
  auto cache = kvc::make_cache(g, llama_like());
  cache.get<kvc::QuantizedCache<float>>()->visit_layer(1, [](const auto& l) {
    CHECK(l.options().nbits == 8);
    CHECK(l.options().axis_key == 1);
    CHECK(l.options().residual_length == 4);
  });
  CHECK(kvc::make_cache(with("quantized"), llama_like()).layer_name(0) == "QuantoQuantizedLayer");  // the default
  // kvc's own options, booleans.
  g.cache_config = nlohmann::ordered_json{
      {"append_only", true}, {"rotate_keys", true}, {"rotate_values", false}, {"value_nbits", 2}};
  kvc::make_cache(g, llama_like()).get<kvc::QuantizedCache<float>>()->visit_layer(0, [](const auto& l) {
    CHECK(l.options().append_only);
    CHECK(l.options().rotate_keys);
    CHECK(!l.options().rotate_values);
    CHECK(l.options().value_nbits == 2);
    CHECK(l.options().value_bits() == 2);
  });
  g.cache_config = nlohmann::ordered_json{{"value_nbits", 3}};
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, llama_like()),
                       "QuantoQuantizedLayer: `value_nbits` has to be 0 (the keys' nbits) or one of [`2`, `4`], got 3",
                       kvc::ValueError);
}

TEST_CASE("'quantized': the messages of the quantized path") {
  auto g = with("quantized");
  auto t5 = llama_like();
  t5.is_encoder_decoder = true;
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, t5),
                       "This model does not support the quantized cache. If you want your model to support quantized "
                       "cache, please open an issue and tag @zucchini-nlp.",
                       kvc::ValueError);
  g.cache_config = nlohmann::ordered_json{{"backend", "HQQ"}};
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, llama_like()), "Unknown quantization backend `HQQ`", kvc::ValueError);
  g.cache_config = nlohmann::ordered_json{{"nbits", 3}};
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, llama_like()),
                       "`nbits` for `quanto` backend has to be one of [`2`, `4`] but got 3", kvc::ValueError);
  g.cache_config = nlohmann::ordered_json{{"group_size", 32}};
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, llama_like()),
                       "QuantizedCache.__init__() got an unexpected keyword argument 'group_size'", kvc::TypeError);
  g.cache_config = nlohmann::ordered_json{{"nbits", "4"}};
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, llama_like()),
                       "make_cache: `cache_config.nbits` must be an integer, got \"4\"", kvc::ValueError);
  g.cache_config = nlohmann::ordered_json{{"rotate_keys", 1}};
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, llama_like()),
                       "make_cache: `cache_config.rotate_keys` must be true or false, got 1", kvc::ValueError);
  g.cache_config = nullptr;
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, gemma_like()),
                       "`QuantizedCache` is only supported for models with only full attention layers. We found the "
                       "following invalid layer types: {'sliding_attention'}",
                       kvc::ValueError);
}

TEST_CASE("'quantized' with skip_layers or layer_nbits: PerLayerQuantizedCache, formats per layer") {
  auto g = with("quantized");
  auto four = llama_like();
  four.num_hidden_layers = 4;
  g.cache_config = nlohmann::ordered_json{{"backend", "hqq"},
                                          {"axis_key", 1},
                                          {"axis_value", 1},
                                          {"skip_layers", {0, -1}},
                                          {"layer_nbits", {8, 2, nullptr, 4}}};
  auto cache = kvc::make_cache(g, four);
  REQUIRE(cache.get<kvc::PerLayerQuantizedCache<float>>() != nullptr);
  std::vector<std::string> names;
  for (std::int64_t l = 0; l < 4; ++l) names.emplace_back(cache.layer_name(l));
  CHECK(names == std::vector<std::string>{"DynamicLayer", "HQQQuantizedLayer", "DynamicLayer", "DynamicLayer"});
  cache.get<kvc::PerLayerQuantizedCache<float>>()->visit_layer(1, [](const auto& l) {
    if constexpr (requires { l.options(); }) {
      CHECK(l.options().nbits == 2);
      CHECK(l.options().axis_key == 1);
    } else {
      FAIL("layer 1 is quantized");
    }
  });
  // Without the two keys (or with empty lists), transformers' QuantizedCache.
  g.cache_config = nlohmann::ordered_json{{"skip_layers", nlohmann::ordered_json::array()}};
  CHECK(kvc::make_cache(g, four).get<kvc::QuantizedCache<float>>() != nullptr);
  // Their messages.
  g.cache_config = nlohmann::ordered_json{{"skip_layers", 0}};
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, four),
                       "make_cache: `cache_config.skip_layers` must be a list of integers, got 0", kvc::ValueError);
  g.cache_config = nlohmann::ordered_json{{"skip_layers", {0, nullptr}}};
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, four),
                       "make_cache: `cache_config.skip_layers` must be a list of integers, got [0,null]",
                       kvc::ValueError);
  g.cache_config = nlohmann::ordered_json{{"layer_nbits", {4, "2"}}};
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, four),
                       "make_cache: `cache_config.layer_nbits` must be a list of integers or nulls, got [4,\"2\"]",
                       kvc::ValueError);
  g.cache_config = nlohmann::ordered_json{{"skip_layers", {4}}};
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, four), "QuantizedCache: skip_layers entry 4 is out of range for 4 layers",
                       kvc::ValueError);
  g.cache_config = nlohmann::ordered_json{{"layer_nbits", {4, 4}}};
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, four), "QuantizedCache: layer_nbits has 2 entries for 4 layers",
                       kvc::ValueError);
  g.cache_config = nlohmann::ordered_json{{"layer_nbits", {4, 4, 3, 4}}};
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, four), "`nbits` for `quanto` backend has to be one of [`2`, `4`] but got 3",
                       kvc::ValueError);
}

TEST_CASE("offloaded names: the dynamic or static cache with OffloadToFile, same results as in memory") {
  using Offloaded = kvc::ConfiguredDynamicCache<float, kvc::HostStorage<float>, kvc::OffloadToFile<false>>;
  using OffloadedStatic = kvc::StaticCache<float, kvc::HostStorage<float>, kvc::OffloadToFile<true>>;
  auto offloaded = kvc::make_cache(with("offloaded"), gemma_like());
  CHECK(offloaded.get<Offloaded>() != nullptr);
  kvc_test::captured_warnings warnings;
  for (const std::string impl : {"offloaded_static", "offloaded_hybrid", "offloaded_hybrid_chunked"}) {
    auto g = with(impl);
    g.max_length = 9;
    auto cache = kvc::make_cache(g, gemma_like());
    CHECK(cache.get<OffloadedStatic>() != nullptr);
    CHECK(cache.get_max_length(1) == 8);
  }
  CHECK(warnings.messages.size() == 2);  // the two deprecated names, once each
  // Decoding through the offloaded cache returns what the in-memory one does.
  auto plain = kvc::make_cache(with("dynamic"), gemma_like());
  std::mt19937 rng(5);
  for (int step = 0; step < 6; ++step)
    for (std::int64_t layer = 0; layer < 2; ++layer) {
      const auto k = kvc_test::random_tensor<float>(1, 2, step == 0 ? 3 : 1, 8, rng);
      const auto a = offloaded.update(k, k, layer);
      const auto b = plain.update(k, k, layer);
      CHECK(kvc_test::flatten(a.keys) == kvc_test::flatten(b.keys));
    }
}

TEST_CASE("encoder-decoder models: a self-attention cache paired with a cross-attention cache") {
  auto t5 = llama_like();
  t5.is_encoder_decoder = true;
  CHECK_THROWS_WITH_AS(kvc::prepare_cache_for_generation(with(std::nullopt), t5, "T5ForConditionalGeneration"),
                       "prepare_cache_for_generation: 'T5ForConditionalGeneration' is an encoder-decoder model; use "
                       "prepare_encoder_decoder_cache_for_generation, which pairs the self-attention cache with a "
                       "cross-attention cache",
                       kvc::ValueError);
  // Dynamic: both halves are the config's dynamic cache; crop reaches the self-attention half only.
  auto dynamic = kvc::prepare_encoder_decoder_cache_for_generation(with(std::nullopt), t5, "t5");
  REQUIRE(dynamic.has_value());
  CHECK(dynamic->self_attention_cache().get<kvc::ConfiguredDynamicCache<float>>() != nullptr);
  CHECK(dynamic->cross_attention_cache().get<kvc::ConfiguredDynamicCache<float>>() != nullptr);
  std::mt19937 rng(9);
  const auto k = kvc_test::random_tensor<float>(1, 2, 4, 8, rng);
  dynamic->self_attention_cache().update(k, k, 0);
  dynamic->cross_attention_cache().update(k, k, 0);
  dynamic->crop(-1);
  CHECK(dynamic->get_seq_length() == 3);
  CHECK(dynamic->cross_attention_cache().get_seq_length() == 4);
  CHECK(dynamic->self_attention_cache().repr() == "DynamicCache(layers=[DynamicLayer, DynamicLayer])");

  // Static: the cross-attention cache holds the encoder output's length.
  auto g = with("static");
  g.max_length = 17;
  CHECK_THROWS_WITH_AS(kvc::make_encoder_decoder_cache(g, t5),
                       "make_encoder_decoder_cache: a static cross-attention cache needs the encoder output's length "
                       "(CacheRequest::encoder_length), got -1",
                       kvc::ValueError);
  kvc::CacheRequest request;
  request.encoder_length = 6;
  auto fixed = kvc::prepare_encoder_decoder_cache_for_generation(g, t5, "t5", {}, request);
  REQUIRE(fixed.has_value());
  CHECK(fixed->get_max_length() == 16);
  CHECK(fixed->cross_attention_cache().get_max_length() == 6);
  try {
    fixed->crop(-1);
    FAIL("no exception");
  } catch (const kvc::TypeError& e) {
    CHECK(std::string(e.what()) ==
          "`crop` is only defined for dynamic cache, got StaticCache(layers=[StaticLayer, StaticLayer]) for the self "
          "attention cache and StaticCache(layers=[StaticLayer, StaticLayer]) for the cross attention cache.");
  }
  auto offloaded = kvc::make_encoder_decoder_cache(with("offloaded"), t5);
  CHECK(offloaded.cross_attention_cache()
            .get<kvc::ConfiguredDynamicCache<float, kvc::HostStorage<float>, kvc::OffloadToFile<false>>>() != nullptr);
  // The caller's pair is used as is; with a cache_implementation too it is the usual ValueError.
  auto mine = kvc::make_encoder_decoder_cache(with(std::nullopt), t5);
  mine.self_attention_cache().update(k, k, 1);
  auto used = kvc::prepare_encoder_decoder_cache_for_generation(with(std::nullopt), t5, "t5", std::move(mine));
  CHECK(used->get_seq_length(1) == 4);
  CHECK_THROWS_AS(kvc::prepare_encoder_decoder_cache_for_generation(with("static"), t5, "t5", std::move(*used)),
                  kvc::ValueError);
  auto off = with(std::nullopt);
  off.use_cache = false;
  CHECK_FALSE(kvc::prepare_encoder_decoder_cache_for_generation(off, t5, "t5").has_value());
  auto assistant = with(std::nullopt);
  assistant.is_assistant = true;
  CHECK(kvc::prepare_encoder_decoder_cache_for_generation(assistant, t5, "t5").has_value());
}

TEST_CASE("'quantized': cache_config of the wrong JSON types") {
  auto g = with("quantized");
  g.cache_config = nlohmann::ordered_json::array({1, 2});
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, llama_like()), "make_cache: `cache_config` must be an object, got [1,2]",
                       kvc::ValueError);
  g.cache_config = nlohmann::ordered_json{{"backend", 4}};
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, llama_like()), "make_cache: `cache_config.backend` must be a string, got 4",
                       kvc::ValueError);
}

TEST_CASE("hostile model files: sizes that overflowed reach no cache") {
  // config.json with 1 layer, 1 head, head_dim 4, and a generation_config.json asking for a static
  // cache of 2^62 + 1 slots: update used to write past a 32-byte buffer.
  const auto config = kvc::ModelConfig::from_json(
      R"({"model_type": "llama", "num_hidden_layers": 1, "num_attention_heads": 1, "hidden_size": 4})");
  CHECK_THROWS_WITH_AS(
      kvc::GenerationConfig::from_json(R"({"cache_implementation": "static", "max_cache_len": 4611686018427387905})"),
      "GenerationConfig: `max_cache_len` is 4611686018427387905, above kvc's limit of 1099511627776", kvc::ValueError);
  auto g = with("static");
  g.max_cache_len = (std::int64_t{1} << 62) + 1;  // filled in code: make_cache validates it
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, config),
                       "GenerationConfig: `max_cache_len` is 4611686018427387905, above kvc's limit of 1099511627776",
                       kvc::ValueError);
  g.max_cache_len.reset();
  g.max_length = std::numeric_limits<std::int64_t>::max();  // used to end in SIGSEGV
  CHECK_THROWS_AS(kvc::make_cache(g, config), kvc::ValueError);
  // A static cache as large as the limits allow is refused by the allocation limit, not written past.
  g.max_length = 20;
  g.max_cache_len = kvc::max_extent;
  auto huge = kvc::make_cache(g, config);
  kvc::HostTensor<float> k(1, 1, 1, 4);
  k.setZero();
  CHECK_THROWS_AS(huge.update(k, k, 0), kvc::ValueError);
  CHECK(huge.bytes() == 0);
  // Beams times the batch: each factor bounded, the product checked.
  g.max_cache_len = 16;
  g.prefill_chunk_size = 4;
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, config, {std::int64_t{1} << 40, -1}),
                       "make_cache: CacheRequest::batch_size is 1099511627776, above kvc's limit of 1048576",
                       kvc::ValueError);
  g.num_beams = std::int64_t{1} << 11;
  CHECK_THROWS_WITH_AS(kvc::make_cache(g, config, {std::int64_t{1} << 10, -1}),
                       "early_initialization: batch_size is 2097152, above kvc's limit of 1048576", kvc::ValueError);
  // quantized: residual_length near INT64_MAX used to corrupt the heap at decode step 16.
  auto q = with("quantized");
  q.cache_config = nlohmann::ordered_json{{"residual_length", std::numeric_limits<std::int64_t>::max() - 1}};
  CHECK_THROWS_WITH_AS(kvc::make_cache(q, config),
                       "QuantoQuantizedLayer: `residual_length` is 9223372036854775806, above kvc's limit of "
                       "1099511627776",
                       kvc::ValueError);
  q.cache_config = nlohmann::ordered_json::parse(R"({"q_group_size": 18446744073709551615})");
  CHECK_THROWS_WITH_AS(kvc::make_cache(q, config),
                       "make_cache: `cache_config.q_group_size` must be an integer that fits in 64 bits, got "
                       "18446744073709551615",
                       kvc::ValueError);
}
