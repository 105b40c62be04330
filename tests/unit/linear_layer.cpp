// LinearAttentionLayer and the hybrids, the Cache's linear-attention methods and their redirection
// rules (transformers' classes of the same names and Cache, src/transformers/cache_utils.py at
// a597f974), and the tests of tests/utils/test_cache_utils.py that involve linear layers.
#include <random>
#include <string>
#include <vector>

#include "../support/kvc_test.hpp"

namespace {

using Conv = Eigen::Tensor<float, 3, Eigen::RowMajor>;
using kvc_test::random_tensor;

// A [batch, channels, time] conv input whose element (b, c, t) is 1000*b + 100*c + first + t.
Conv conv_input(std::int64_t batch, std::int64_t channels, std::int64_t time, float first = 0) {
  Conv x(batch, channels, time);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t c = 0; c < channels; ++c)
      for (std::int64_t t = 0; t < time; ++t) x(b, c, t) = 1000.0f * b + 100.0f * c + first + t;
  return x;
}

// The time axis of (b, c) of a [batch, channels, time] state.
std::vector<float> columns(const kvc::StateView<float>& v, std::int64_t b = 0, std::int64_t c = 0) {
  std::vector<float> out;
  for (std::int64_t t = 0; t < v.extent(2); ++t) out.push_back(v[(b * v.extent(1) + c) * v.extent(2) + t]);
  return out;
}

using LinearOnly = kvc::Cache<kvc::Layers<kvc::LinearAttentionLayer>>;
using Mixed = kvc::Cache<
    kvc::Layers<kvc::LinearAttentionLayer, kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer,
                kvc::LinearAttentionAndFullAttentionLayer, kvc::LinearAttentionAndSlidingWindowAttentionLayer>>;

template <class C, class F>
std::string message_of(C& cache, F&& f) {
  try {
    f(cache);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "<no exception>";
}

}  // namespace

TEST_CASE("update_conv_state: the first call left-pads to the kernel size and returns the padded input") {
  LinearOnly cache(kvc::LinearAttentionLayer{});
  const auto full = cache.update_conv_state(conv_input(1, 2, 2), 0, 0, 4);
  REQUIRE(full.rank == 3);
  CHECK(full.extent(2) == 4);
  CHECK(columns(full, 0, 1) == std::vector<float>{0, 0, 100, 101});
  CHECK(cache.has_previous_state());
  cache.visit_layer(0, [](const auto& l) {
    if constexpr (requires { l.conv_state(0); }) {
      CHECK(columns(l.conv_state(0), 0, 1) == std::vector<float>{0, 0, 100, 101});
      CHECK(l.conv_kernel_size(0) == 4);
    }
  });
}

TEST_CASE("update_conv_state: later calls return the stored columns followed by the new ones; k columns are kept") {
  LinearOnly cache(kvc::LinearAttentionLayer{});
  cache.update_conv_state(conv_input(2, 3, 5), 0);  // kernel size from the time axis: 5
  const auto full = cache.update_conv_state(conv_input(2, 3, 1, 50), 0);
  CHECK(full.extent(2) == 6);
  CHECK(columns(full, 1, 2) == std::vector<float>{1200, 1201, 1202, 1203, 1204, 1250});
  cache.visit_layer(0, [](const auto& l) {
    if constexpr (requires { l.conv_state(0); })
      CHECK(columns(l.conv_state(0), 1, 2) == std::vector<float>{1201, 1202, 1203, 1204, 1250});
  });
}

TEST_CASE("update_recurrent_state overwrites and returns the stored state; shapes are checked") {
  LinearOnly cache(kvc::LinearAttentionLayer{});
  Eigen::Tensor<float, 4, Eigen::RowMajor> r(1, 2, 3, 4);
  r.setConstant(1.5f);
  auto out = cache.update_recurrent_state(r, 0);
  CHECK(out.rank == 4);
  CHECK(out.size() == 24);
  CHECK(out.data() != r.data());
  r.setConstant(-2.0f);
  out = cache.update_recurrent_state(r, 0);
  CHECK(out[23] == -2.0f);
  CHECK_FALSE(cache.has_previous_state());  // only conv updates set it
  Eigen::Tensor<float, 4, Eigen::RowMajor> wrong(1, 2, 3, 5);
  wrong.setZero();
  CHECK_THROWS_AS(cache.update_recurrent_state(wrong, 0), kvc::ValueError);
  CHECK(cache.update_recurrent_state(r, 0)[0] == -2.0f);
}

TEST_CASE("several state indices are independent; has_previous_state per state and for all") {
  LinearOnly cache(kvc::LinearAttentionLayer{2});
  cache.update_conv_state(conv_input(1, 1, 3), 0, 1);
  CHECK(cache.has_previous_state(0, 1));
  CHECK_FALSE(cache.has_previous_state(0, 0));
  CHECK_FALSE(cache.has_previous_state(0));
  cache.update_conv_state(conv_input(1, 1, 3), 0, 0);
  CHECK(cache.has_previous_state(0));
  CHECK_THROWS_AS(cache.update_conv_state(conv_input(1, 1, 3), 0, 2), kvc::KeyError);
  CHECK_THROWS_AS(cache.update_conv_state(conv_input(2, 1, 3), 0, 0), kvc::ValueError);  // batch differs
  CHECK_FALSE(cache.has_previous_state(5));                                              // past the last layer
  cache.reset();
  CHECK_FALSE(cache.has_previous_state(0, 1));
}

TEST_CASE("crop of linear layers: both RuntimeError texts, crop(0) shrinks to the kernel, crop(-n) rolls back") {
  LinearOnly cache(kvc::LinearAttentionLayer{});
  cache.update_conv_state(conv_input(1, 1, 6), 0, 0, 4);
  CHECK(message_of(cache, [](auto& c) { c.crop(-1); }) ==
        "`crop` was called, but the current layer does not track past states. Call `activate_past_recording` before "
        "`crop` to be able to rollback the cache.");
  cache.activate_past_recording();
  CHECK(message_of(cache, [](auto& c) { c.crop(2); }) ==
        "Linear attention layers can only be cropped by passing a negative int, to specify how many tokens to remove");

  LinearOnly rec(kvc::LinearAttentionLayer{});
  rec.activate_past_recording();
  rec.update_conv_state(conv_input(1, 1, 6), 0, 0, 4);
  const auto full = rec.update_conv_state(conv_input(1, 1, 2, 6), 0);
  CHECK(columns(full) == std::vector<float>{0, 1, 2, 3, 4, 5, 6, 7});  // recording keeps every column
  rec.crop(-3);
  rec.visit_layer(0, [](const auto& l) {
    if constexpr (requires { l.conv_state(0); }) CHECK(columns(l.conv_state(0)) == std::vector<float>{1, 2, 3, 4});
  });
  rec.crop(0);
  rec.visit_layer(0, [](const auto& l) {
    if constexpr (requires { l.conv_state(0); }) CHECK(columns(l.conv_state(0)) == std::vector<float>{1, 2, 3, 4});
  });
  // The first crop kept only the kernel's columns before its cut: nothing recorded since can be
  // taken back, and the layer cannot tell a crop past everything it saw (docs/rollback.md).
  CHECK(rec.rollback_depth() == 0);
  CHECK_THROWS_AS(rec.crop(-10), kvc::RuntimeError);
  rec.update_conv_state(conv_input(1, 1, 2, 8), 0);  // 2 more columns: those 2 can go again
  CHECK(rec.rollback_depth() == 2);
  rec.crop(-2);
  rec.visit_layer(0, [](const auto& l) {
    if constexpr (requires { l.conv_state(0); }) CHECK(columns(l.conv_state(0)) == std::vector<float>{1, 2, 3, 4});
  });
}

TEST_CASE("Cache redirection rules for length queries and has_previous_state, with their messages") {
  using kvc::LinearAttentionLayer;
  Mixed cache(LinearAttentionLayer{}, kvc::DynamicLayer{}, LinearAttentionLayer{});
  std::mt19937 rng(1);
  const auto k = random_tensor<float>(1, 2, 3, 4, rng);
  cache.update(k, k, 1);
  CHECK(cache.get_seq_length(0) == 3);  // index 0 answers for the first attention layer
  CHECK(cache.get_mask_sizes(2, 0) == std::pair<std::int64_t, std::int64_t>{5, 0});
  CHECK(message_of(cache, [](auto& c) { c.get_seq_length(2); }) ==
        "You called `get_seq_length` on layer index 2, but this layer is a LinearAttention layer, which does not track "
        "sequence length.");
  CHECK(message_of(cache, [](auto& c) { c.get_mask_sizes(1, 2); }) ==
        "You called `get_mask_sizes` on layer index 2, but this layer is a LinearAttention layer, which does not track "
        "sequence length.");
  CHECK(
      message_of(cache, [](auto& c) { c.has_previous_state(1); }) ==
      "You called `has_previous_state` on layer index 1, but this layer is an Attention layer, which does not support "
      "calling it.");
  CHECK_THROWS_AS(cache.has_previous_state(1), kvc::ValueError);
  cache.update_conv_state(conv_input(1, 2, 4), 2);
  CHECK(cache.has_previous_state());  // the last linear layer: 2
  CHECK_FALSE(cache.has_previous_state(0));

  LinearOnly only(LinearAttentionLayer{});
  CHECK(message_of(only, [](auto& c) { c.get_seq_length(0); }) ==
        "`get_seq_length` can only be called on Attention layers, and the current Cache seem to only contain "
        "LinearAttention layers.");
  CHECK(message_of(only, [](auto& c) { c.get_mask_sizes(1, 0); }) ==
        "`get_mask_sizes` can only be called on Attention layers, and the current Cache seem to only contain "
        "LinearAttention layers.");
  CHECK_THROWS_AS(only.get_seq_length(0), kvc::ValueError);

  kvc::DynamicCache<float> attention_only;
  attention_only.update(k, k, 0);
  CHECK(message_of(attention_only, [](auto& c) { c.has_previous_state(); }) ==
        "`has_previous_state` can only be called on LinearAttention layers, and the current Cache seem to only contain "
        "Attention layers.");
}

TEST_CASE("update_conv_state / update_recurrent_state on an attention layer, update on a linear layer") {
  Mixed cache(kvc::LinearAttentionLayer{}, kvc::DynamicLayer{});
  const auto conv = conv_input(1, 1, 2);
  CHECK(message_of(cache, [&](auto& c) { c.update_conv_state(conv, 1); }) ==
        "Cannot call `update_conv_state` on a non-LinearAttention layer!");
  // transformers names update_conv_state here too (docs/differences.md item 26); kvc names the
  // method called.
  CHECK(message_of(cache, [&](auto& c) { c.update_recurrent_state(conv, 1); }) ==
        "Cannot call `update_recurrent_state` on a non-LinearAttention layer!");
  CHECK_THROWS_AS(cache.update_conv_state(conv, 1), kvc::ValueError);
  CHECK_THROWS_AS(cache.update_conv_state(conv, 2), kvc::IndexError);
  std::mt19937 rng(2);
  const auto k = random_tensor<float>(1, 1, 1, 2, rng);
  CHECK(message_of(cache, [&](auto& c) { c.update(k, k, 0); }) ==
        "'LinearAttentionLayer' object has no attribute 'update'");
  CHECK_THROWS_AS(cache.update(k, k, 0), kvc::AttributeError);
  CHECK(cache.is_linear() == std::vector<bool>{true, false});
}

TEST_CASE("reorder_cache and batch operations act on linear states and on both parts of hybrids") {
  Mixed cache(kvc::LinearAttentionLayer{}, kvc::LinearAttentionAndFullAttentionLayer{});
  const auto conv = conv_input(3, 2, 4);
  cache.update_conv_state(conv, 0);
  cache.update_conv_state(conv, 1);
  std::mt19937 rng(3);
  const auto k = random_tensor<float>(3, 1, 2, 2, rng);
  cache.update(k, k, 1);
  cache.reorder_cache({2, 0, 1});
  for (std::int64_t layer = 0; layer < 2; ++layer)
    cache.visit_layer(layer, [](const auto& l) {
      if constexpr (requires { l.conv_state(0); })
        CHECK(columns(l.conv_state(0), 0, 1) == std::vector<float>{2100, 2101, 2102, 2103});
      else if constexpr (requires { l.linear_part(); })
        CHECK(columns(l.linear_part().conv_state(0), 1, 0) == std::vector<float>{0, 1, 2, 3});
    });
  CHECK(cache.stored(1).keys(0, 0, 1, 1) == k(2, 0, 1, 1));
  cache.batch_repeat_interleave(2);
  CHECK(cache.stored(1).keys.extent(0) == 6);
  cache.visit_layer(0, [](const auto& l) {
    if constexpr (requires { l.conv_state(0); }) CHECK(l.conv_state(0).extent(0) == 6);
  });
  cache.batch_select_indices({5});
  cache.visit_layer(0, [](const auto& l) {
    if constexpr (requires { l.conv_state(0); })
      CHECK(columns(l.conv_state(0), 0, 0) == std::vector<float>{1000, 1001, 1002, 1003});
  });
  CHECK(cache.stored(1).keys(0, 0, 0, 0) == k(1, 0, 0, 0));
  // The selected states go on where they were: seen, with their kernel (the stored columns, then
  // the new one).
  CHECK(cache.has_previous_state(0));
  CHECK(columns(cache.update_conv_state(conv_input(1, 2, 1, 7), 0), 0, 0) ==
        std::vector<float>{1000, 1001, 1002, 1003, 7});
  CHECK_THROWS_AS(cache.reorder_cache({3}), kvc::IndexError);
}

TEST_CASE("hybrids: lengths and max length from the attention part, crop of both parts") {
  Mixed cache(kvc::LinearAttentionAndSlidingWindowAttentionLayer{{4}, 1}, kvc::LinearAttentionAndFullAttentionLayer{});
  CHECK(cache.get_max_length(0) == 4);  // transformers reports -1 through the MRO (docs/differences.md item 24)
  CHECK(cache.get_max_length(1) == -1);
  CHECK(cache.layer_name(0) == "LinearAttentionAndSlidingWindowAttentionLayer");
  CHECK(cache.is_sliding() == std::vector<bool>{true, false});
  CHECK(cache.is_linear() == std::vector<bool>{false, false});
  cache.activate_past_recording();
  std::mt19937 rng(4);
  const auto k = random_tensor<float>(1, 1, 6, 2, rng);
  for (std::int64_t layer = 0; layer < 2; ++layer) {
    cache.update(k, k, layer);
    cache.update_conv_state(conv_input(1, 1, 6), layer, 0, 3);
  }
  CHECK(cache.get_seq_length(1) == 6);
  cache.crop(-2);
  CHECK(cache.get_seq_length(1) == 4);
  CHECK(cache.get_seq_length(0) == 4);
  cache.visit_layer(1, [](const auto& l) {
    if constexpr (requires { l.linear_part(); })
      CHECK(columns(l.linear_part().conv_state(0)) == std::vector<float>{1, 2, 3});
  });
}

TEST_CASE("static hybrids cannot be cropped (AttributeError before anything changes)") {
  using C = kvc::Cache<kvc::Layers<kvc::LinearAttentionLayer, kvc::LinearAttentionAndStaticFullAttentionLayer>>;
  C cache(kvc::LinearAttentionLayer{}, kvc::LinearAttentionAndStaticFullAttentionLayer{{8}, 1});
  cache.activate_past_recording();
  cache.update_conv_state(conv_input(1, 1, 5), 0, 0, 2);
  CHECK(message_of(cache, [](auto& c) { c.crop(-1); }) ==
        "'LinearAttentionAndStaticFullAttentionLayer' object has no attribute 'crop'");
  cache.visit_layer(0, [](const auto& l) {
    if constexpr (requires { l.conv_state(0); }) CHECK(l.conv_state(0).extent(2) == 5);
  });
  CHECK(cache.get_max_length() == 8);
}

TEST_CASE("a StaticCache with a linear layer: early initialization and max length ignore it") {
  // transformers' test_early_initialization_does_not_corrupt_linear_attention_layers and
  // test_max_cache_len_ignores_linear_attention_layers.
  kvc::ModelConfig config;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 4;
  config.num_key_value_heads = 2;
  config.hidden_size = 32;
  config.layer_types = std::vector<std::string>{"full_attention", "linear_attention"};
  kvc::StaticCache<float> cache(config, 8);
  CHECK(cache.layer_name(0) == "StaticLayer");
  CHECK(cache.layer_name(1) == "LinearAttentionLayer");
  CHECK(cache.get_max_length() == 8);
  cache.early_initialization(1, 2, 8);
  const auto out = cache.update_conv_state(conv_input(1, 8, 4), 1);
  CHECK(out.extent(0) == 1);
  CHECK(out.extent(1) == 8);
  CHECK(out.extent(2) == 4);
  CHECK(cache.is_initialized());
}

TEST_CASE("every layer type of the mappings builds its kind; unknown types list all ten") {
  kvc::ModelConfig config;
  config.num_hidden_layers = 8;
  config.num_attention_heads = 2;
  config.hidden_size = 8;
  config.sliding_window = 4;
  config.number_of_conv_states = 2;
  config.layer_types =
      std::vector<std::string>{"conv",           "linear_attention",         "hybrid", "hybrid_sliding", "moe", "mlp",
                               "full_attention", "deepseek_sparse_attention"};
  auto dynamic = kvc::make_dynamic_cache<float>(config);
  kvc::StaticCache<float> fixed(config, 16);
  const std::vector<std::string> dynamic_names{"LinearAttentionLayer",
                                               "LinearAttentionLayer",
                                               "LinearAttentionAndFullAttentionLayer",
                                               "LinearAttentionAndSlidingWindowAttentionLayer",
                                               "LinearAttentionLayer",
                                               "LinearAttentionLayer",
                                               "DynamicLayer",
                                               "DynamicIndexedLayer"};
  const std::vector<std::string> static_names{"LinearAttentionLayer",
                                              "LinearAttentionLayer",
                                              "LinearAttentionAndStaticFullAttentionLayer",
                                              "LinearAttentionAndStaticSlidingWindowAttentionLayer",
                                              "LinearAttentionLayer",
                                              "LinearAttentionLayer",
                                              "StaticLayer",
                                              "StaticIndexedLayer"};
  for (std::int64_t i = 0; i < 8; ++i) {
    CHECK(std::string(dynamic.layer_name(i)) == dynamic_names[static_cast<std::size_t>(i)]);
    CHECK(std::string(fixed.layer_name(i)) == static_names[static_cast<std::size_t>(i)]);
  }
  CHECK(dynamic.get_max_length(3) == 4);
  CHECK(fixed.get_max_length(3) == 4);  // the static sliding window: min(window, max_cache_len)
  dynamic.visit_layer(0, [](const auto& l) {
    if constexpr (requires { l.number_of_states(); }) CHECK(l.number_of_states() == 2);
  });
  config.layer_types = std::vector<std::string>{"mamba"};
  config.num_hidden_layers = 1;
  try {
    (void)kvc::make_dynamic_cache<float>(config);
    FAIL("no exception");
  } catch (const kvc::KeyError& e) {
    CHECK(std::string(e.what()) ==
          "'mamba' is not a known layer type. Known layer types: ('full_attention', 'sliding_attention', "
          "'chunked_attention', 'conv', 'linear_attention', 'hybrid', 'hybrid_sliding', 'deepseek_sparse_attention', "
          "'moe', 'mlp')");
  }
}

TEST_CASE("a throwing linear-state update leaves the layer unchanged") {
  LinearOnly cache(kvc::LinearAttentionLayer{});
  cache.update_conv_state(conv_input(1, 2, 4), 0);
  const auto before = columns(cache.update_conv_state(conv_input(1, 2, 1, 9), 0), 0, 1);
  CHECK_THROWS_AS(cache.update_conv_state(conv_input(1, 3, 1), 0), kvc::ValueError);  // channels differ
  Eigen::Tensor<float, 2, Eigen::RowMajor> flat(1, 4);
  flat.setZero();
  CHECK_THROWS_AS(cache.update_conv_state(flat, 0), kvc::ValueError);  // not [batch, channels, time]
  cache.visit_layer(0, [&](const auto& l) {
    if constexpr (requires { l.conv_state(0); })
      CHECK(columns(l.conv_state(0), 0, 1) == std::vector<float>(before.end() - 4, before.end()));
  });
}

TEST_CASE("stored() on a pure linear layer and a kind without states: the messages") {
  LinearOnly cache(kvc::LinearAttentionLayer{});
  CHECK(message_of(cache, [](auto& c) { (void)c.stored(0); }) ==
        "'LinearAttentionLayer' object has no attribute 'keys'");
  CHECK_THROWS_AS((void)cache.stored(0), kvc::AttributeError);
  try {
    LinearOnly none(kvc::LinearAttentionLayer{0});
    FAIL("no exception");
  } catch (const kvc::ValueError& e) {
    CHECK(std::string(e.what()) == "LinearAttentionLayer: number_of_states must be a positive integer, got 0");
  }
}

// Regression: a hybrid whose parts held different batch sizes (the attention part reset and
// refilled with another batch, the linear states kept) let a batch operation read past the
// linear states' buffers. Both parts now keep one batch size.
TEST_CASE("hybrids keep one batch size in both parts: the messages, and nothing changes") {
  Mixed cache(kvc::LinearAttentionAndFullAttentionLayer{});
  std::mt19937 rng(6);
  cache.update_conv_state(conv_input(1, 2, 3), 0);
  cache.reset();  // the attention part drops its keys; the linear states are zeroed and keep batch 1
  const auto k2 = random_tensor<float>(2, 1, 2, 2, rng);
  const auto before = kvc_test::take_snapshot(cache);
  CHECK(message_of(cache, [&](auto& c) { c.update(k2, k2, 0); }) ==
        "update: keys of shape [2, 1, 2, 2] do not match the layer's linear-attention states, which have batch "
        "size 1");
  CHECK(kvc_test::take_snapshot(cache) == before);
  CHECK_THROWS_AS(cache.update(k2, k2, 0), kvc::ValueError);

  // The Cache never lazily initializes a hybrid early (supports_early_init is false); the state's
  // own lazy_initialization applies the same rule.
  using Hybrid = kvc::LinearAttentionAndFullAttentionLayer::state<kvc::HostStorage<float>>;
  Hybrid state{kvc::LinearAttentionAndFullAttentionLayer{}};
  const auto x = conv_input(1, 2, 3);
  state.update_conv_state(kvc::HostStorage<float>::state_input_view(x), 0, 0);
  try {
    state.lazy_initialization({2, 1, 2, 2});
    FAIL("no exception");
  } catch (const kvc::ValueError& e) {
    CHECK(std::string(e.what()) ==
          "lazy_initialization: batch size 2 does not match the layer's linear-attention states, which have batch "
          "size 1");
  }
  CHECK_FALSE(state.is_initialized());

  Mixed other(kvc::LinearAttentionAndFullAttentionLayer{});
  other.update(k2, k2, 0);
  const auto held = kvc_test::take_snapshot(other);
  CHECK(message_of(other, [](auto& c) { c.update_conv_state(conv_input(1, 2, 3), 0); }) ==
        "update_conv_state: states of shape [1, 2, 3] do not match the layer's keys of shape [2, 1, 2, 2]: the "
        "batch sizes differ");
  Conv rec(3, 2, 2);
  rec.setZero();
  CHECK(message_of(other, [&](auto& c) { c.update_recurrent_state(rec, 0); }) ==
        "update_recurrent_state: states of shape [3, 2, 2] do not match the layer's keys of shape [2, 1, 2, 2]: the "
        "batch sizes differ");
  CHECK(kvc_test::take_snapshot(other) == held);
  other.update_conv_state(conv_input(2, 2, 3), 0);  // the same batch is fine
  other.batch_repeat_interleave(2);
  CHECK(other.stored(0).keys.extent(0) == 4);
  other.visit_layer(0, [](const auto& l) {
    if constexpr (requires { l.linear_part(); }) {
      CHECK(l.linear_part().conv_state(0).extent(0) == 4);
      CHECK(columns(l.linear_part().conv_state(0), 3, 1) == std::vector<float>{1100, 1101, 1102});
    }
  });
}
