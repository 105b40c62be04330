// kvc's size limits (<kvc/limits.hpp>, docs/limits.md) where values enter: the checked element
// counts of every buffer, the layer kinds' options, Cache's arguments, views and attention masks.
// Each case is a hostile input that once overflowed, wrapped or reached an allocator unchecked;
// each now throws a ValueError/IndexError naming the value and the limit, and changes nothing.

#include <limits>

#include "../support/kvc_test.hpp"

using kvc_test::take_snapshot;

namespace {
constexpr std::int64_t i64_max = std::numeric_limits<std::int64_t>::max();
constexpr std::int64_t i64_min = std::numeric_limits<std::int64_t>::min();
constexpr std::int64_t two_62 = std::int64_t{1} << 62;

kvc::HostTensor<float> ones(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d) {
  kvc::HostTensor<float> t(b, h, s, d);
  t.setConstant(1.f);
  return t;
}

// Restores the allocation limit when it goes out of scope.
struct allocation_limit_guard {
  std::int64_t saved;
  explicit allocation_limit_guard(std::int64_t bytes) : saved(kvc::set_allocation_limit(bytes)) {}
  ~allocation_limit_guard() { kvc::set_allocation_limit(saved); }
};
}  // namespace

TEST_CASE("checked element counts: overflow, negative factors and the allocation limit") {
  CHECK(kvc::allocation_limit() == kvc::default_allocation_limit);
  CHECK(kvc::detail::checked_elements({2, 3, 4, 5}, 4) == 120);
  CHECK(kvc::detail::checked_elements({0, 3, two_62, 5}, 4) == 0);  // an empty buffer is fine
  CHECK_THROWS_WITH_AS(kvc::detail::checked_elements({1, 1, two_62 + 1, 4}, 4),
                       "kvc: a buffer of [1, 1, 4611686018427387905, 4] elements of 4 bytes is larger than kvc's "
                       "allocation limit of 1099511627776 bytes (kvc::set_allocation_limit)",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::detail::checked_elements({2, -3}, 4),
                       "kvc: a buffer of [2, -3] elements has a negative dimension", kvc::ValueError);
  CHECK(kvc::detail::checked_elements({std::int64_t{1} << 38}, 4) == std::int64_t{1} << 38);  // 2^40 bytes: the limit
  CHECK_THROWS_AS(kvc::detail::checked_elements({(std::int64_t{1} << 38) + 1}, 4), kvc::ValueError);
  {
    allocation_limit_guard limit(1024);
    CHECK(kvc::allocation_limit() == 1024);
    CHECK(kvc::detail::checked_elements({256}, 4) == 256);
    CHECK_THROWS_WITH_AS(kvc::detail::host_buffer<float>(257),
                         "kvc: a buffer of [257] elements of 4 bytes is larger than kvc's allocation limit of 1024 "
                         "bytes (kvc::set_allocation_limit)",
                         kvc::ValueError);
  }
  CHECK(kvc::allocation_limit() == kvc::default_allocation_limit);
  CHECK_THROWS_WITH_AS(kvc::set_allocation_limit(0),
                       "set_allocation_limit: the limit must be a positive number of bytes, got 0", kvc::ValueError);
}

TEST_CASE("layer kinds refuse sizes above max_extent") {
  using Host = kvc::HostStorage<float>;
  CHECK_THROWS_WITH_AS(kvc::StaticLayer::state<Host>(kvc::StaticLayer{two_62 + 1}),
                       "StaticLayer: max_cache_len is 4611686018427387905, above kvc's limit of 1099511627776",
                       kvc::ValueError);
  // 2 * window used to overflow.
  CHECK_THROWS_WITH_AS(kvc::StaticSlidingWindowLayer::state<Host>(kvc::StaticSlidingWindowLayer{two_62 + 1, 4}),
                       "StaticSlidingWindowLayer: max_cache_len is 4611686018427387905, above kvc's limit of "
                       "1099511627776",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::DynamicSlidingWindowLayer::state<Host>(kvc::DynamicSlidingWindowLayer{i64_max}),
                       "DynamicSlidingWindowLayer: sliding_window is 9223372036854775807, above kvc's limit of "
                       "1099511627776",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::LinearAttentionLayer::state<Host>(kvc::LinearAttentionLayer{i64_max}),
                       "LinearAttentionLayer: number_of_states is 9223372036854775807, above kvc's limit of 1048576",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(
      kvc::QuantoQuantizedLayer::state<Host>(kvc::QuantoQuantizedLayer{.q_group_size = i64_max}),
      "QuantoQuantizedLayer: `q_group_size` is 9223372036854775807, above kvc's limit of 1099511627776",
      kvc::ValueError);
  CHECK_THROWS_WITH_AS(
      kvc::HQQQuantizedLayer::state<Host>(kvc::HQQQuantizedLayer{.residual_length = i64_max - 2}),
      "HQQQuantizedLayer: `residual_length` is 9223372036854775805, above kvc's limit of 1099511627776",
      kvc::ValueError);
  kvc::ModelConfig config;
  config.num_hidden_layers = 1;
  config.num_attention_heads = 1;
  config.head_dim = 4;
  CHECK_THROWS_WITH_AS(kvc::StaticCache<float>(config, two_62 + 1),
                       "StaticCache: max_cache_len is 4611686018427387905, above kvc's limit of 1099511627776",
                       kvc::ValueError);
}

TEST_CASE("a static buffer above the allocation limit is refused before anything is allocated") {
  // 2^40 slots of 4 floats: before the checks, the product wrapped and the layer wrote past a
  // small allocation.
  kvc::Cache<kvc::Layers<kvc::StaticLayer>> cache(kvc::StaticLayer{kvc::max_extent});
  const auto before = take_snapshot(cache);
  CHECK_THROWS_WITH_AS(cache.update(ones(1, 1, 1, 4), ones(1, 1, 1, 4), 0),
                       "kvc: a buffer of [1, 1, 1099511627776, 4] elements of 4 bytes is larger than kvc's allocation "
                       "limit of 1099511627776 bytes (kvc::set_allocation_limit)",
                       kvc::ValueError);
  CHECK(take_snapshot(cache) == before);
  CHECK(cache.bytes() == 0);
}

TEST_CASE("Cache arguments: layer indices, repeats, batch sizes and query lengths") {
  kvc::DynamicCache<float> dynamic;
  // Used to reserve 2^40 layers (std::length_error / bad_alloc).
  CHECK_THROWS_WITH_AS(dynamic.update(ones(1, 1, 1, 1), ones(1, 1, 1, 1), std::int64_t{1} << 40),
                       "update: layer_idx 1099511627776 is above kvc's limit of 1048576 layers", kvc::IndexError);
  CHECK(dynamic.size() == 0);
  dynamic.update(ones(3, 1, 2, 1), ones(3, 1, 2, 1), 0);
  const auto before = take_snapshot(dynamic);
  CHECK_THROWS_WITH_AS(dynamic.batch_repeat_interleave(two_62),
                       "batch_repeat_interleave: repeats is 4611686018427387904, above kvc's limit of 1048576",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(
      dynamic.batch_repeat_interleave(std::int64_t{1} << 19),
      "batch_repeat_interleave: batch 3 repeated 524288 times is 1572864, above kvc's limit of 1048576",
      kvc::ValueError);
  CHECK_THROWS_WITH_AS(dynamic.get_mask_sizes(i64_max, 0),
                       "get_mask_sizes: query_length is 9223372036854775807, above kvc's limit of 1099511627776",
                       kvc::ValueError);
  CHECK(take_snapshot(dynamic) == before);

  // early_initialization used to succeed with bytes() == 0 and a view of 2^60 elements over null.
  kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::StaticLayer>> cache(kvc::DynamicLayer{}, kvc::StaticLayer{4});
  const auto empty = take_snapshot(cache);
  CHECK_THROWS_WITH_AS(cache.early_initialization(std::int64_t{1} << 40, 1, 1),
                       "early_initialization: batch_size is 1099511627776, above kvc's limit of 1048576",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(cache.early_initialization(std::int64_t{1} << 20, std::int64_t{1} << 20, std::int64_t{1} << 20),
                       "kvc: a buffer of [1048576, 1048576, 1, 1048576] elements of 4 bytes is larger than kvc's "
                       "allocation limit of 1099511627776 bytes (kvc::set_allocation_limit)",
                       kvc::ValueError);
  CHECK(take_snapshot(cache) == empty);
  CHECK_FALSE(cache.is_initialized());
}

TEST_CASE("views whose sizes overflow are refused, and a static position cannot overflow") {
  const float data[4] = {1, 2, 3, 4};
  // seq extent INT64_MAX used to pass the input checks (their product overflowed) and push
  // StaticLayer's position negative.
  const kvc::TensorView<float> huge{data, {1, 1, i64_max, 1}, {i64_max, i64_max, 1, 1}};
  kvc::Cache<kvc::Layers<kvc::StaticLayer>> cache(kvc::StaticLayer{8});
  cache.update(ones(1, 1, 2, 1), ones(1, 1, 2, 1), 0);
  const auto before = take_snapshot(cache);
  CHECK_THROWS_WITH_AS(cache.update(huge, huge, 0),
                       "update: keys of shape [1, 1, 9223372036854775807, 1] and values of shape [1, 1, "
                       "9223372036854775807, 1]: a dimension is above kvc's limit of 1099511627776 or their product "
                       "overflows",
                       kvc::ValueError);
  // Each dimension within the limit, their product past 2^63; then a product that fits but whose
  // bytes are above the allocation limit (no layer could hold it).
  const kvc::TensorView<float> product{data, {std::int64_t{1} << 40, std::int64_t{1} << 40, 1 << 20, 1}, {1, 1, 1, 1}};
  CHECK_THROWS_WITH_AS(cache.update(product, product, 0),
                       "update: keys of shape [1099511627776, 1099511627776, 1048576, 1] and values of shape "
                       "[1099511627776, 1099511627776, 1048576, 1]: a dimension is above kvc's limit of 1099511627776 "
                       "or their product overflows",
                       kvc::ValueError);
  const kvc::TensorView<float> big{
      data, {1, 1, std::int64_t{1} << 39, 1}, {std::int64_t{1} << 39, std::int64_t{1} << 39, 1, 1}};
  CHECK_THROWS_WITH_AS(cache.update(big, big, 0),
                       "kvc: a buffer of [1, 1, 549755813888, 1] elements of 4 bytes is larger than kvc's allocation "
                       "limit of 1099511627776 bytes (kvc::set_allocation_limit)",
                       kvc::ValueError);
  CHECK(take_snapshot(cache) == before);
  CHECK(cache.get_seq_length() == 2);
}

TEST_CASE("crop(INT64_MIN) on a recording sliding layer past its window removes everything") {
  kvc::Cache<kvc::Layers<kvc::DynamicSlidingWindowLayer>> cache(kvc::DynamicSlidingWindowLayer{3});
  cache.activate_past_recording();
  cache.update(ones(1, 1, 5, 1), ones(1, 1, 5, 1), 0);  // past the window
  cache.crop(i64_min);                                  // -INT64_MIN used to overflow: seq length -9223372036854775803
  CHECK(cache.get_seq_length() == 0);
  CHECK(cache.stored(0).keys.extent(2) == 0);
  cache.update(ones(1, 1, 2, 1), ones(1, 1, 2, 1), 0);
  CHECK(cache.get_seq_length() == 2);
}

TEST_CASE("linear states: a conv kernel size above max_extent") {
  kvc::Cache<kvc::Layers<kvc::LinearAttentionLayer>> cache(kvc::LinearAttentionLayer{1});
  Eigen::Tensor<float, 3, Eigen::RowMajor> x(1, 2, 3);
  x.setConstant(1.f);
  // Used to compute a negative width and memset it.
  CHECK_THROWS_WITH_AS(cache.update_conv_state(x, 0, 0, two_62),
                       "update_conv_state: conv_kernel_size is 4611686018427387904, above kvc's limit of 1099511627776",
                       kvc::ValueError);
  CHECK_FALSE(cache.has_previous_state(0));
  // A state view whose extents overflow is refused before any layer reads it.
  const kvc::StateView<float> huge{x.data(), 3, {1, 2, std::int64_t{1} << 41, 0}};
  CHECK_THROWS_WITH_AS(cache.update_conv_state(huge, 0),
                       "kvc::Cache: a state of shape [1, 2, 2199023255552] has a negative dimension, one above kvc's "
                       "limit of 1099511627776, or a product of dimensions that overflows",
                       kvc::ValueError);
  CHECK_FALSE(cache.has_previous_state(0));
}

TEST_CASE("quantized layers: a group far larger than the tensor, and a huge residual_length") {
  // q_group_size 2^40 used to size a scratch vector of 2^40 floats (std::length_error).
  kvc::Cache<kvc::Layers<kvc::QuantoQuantizedLayer>> grouped(
      kvc::QuantoQuantizedLayer{.q_group_size = kvc::max_extent});
  const auto prompt = ones(1, 2, 5, 4), token = ones(1, 2, 1, 4);
  const auto kv = grouped.update(prompt, prompt, 0);
  CHECK(kv.keys.extent(2) == 5);
  // residual_length near the limit: the workspace grows with the sequence, not with the option.
  kvc::Cache<kvc::Layers<kvc::HQQQuantizedLayer>> residual(kvc::HQQQuantizedLayer{.residual_length = kvc::max_extent});
  residual.update(prompt, prompt, 0);
  for (int step = 0; step < 18; ++step) residual.update(token, token, 0);
  CHECK(residual.get_seq_length() == 23);
  CHECK(residual.bytes() < 64 * 1024);
}

TEST_CASE("attention: negative extents and extreme mask fields are ValueErrors") {
  const auto k = ones(1, 1, 4, 2);
  const auto kv = kvc::detail::tensor_input<kvc::HostTensor<float>>::view(k);
  kvc::TensorView<float> q = kv;
  q.extents[2] = -3;  // a negative query length used to reach the output tensor's constructor
  CHECK_THROWS_WITH_AS(kvc::scaled_dot_product_attention(q, kv, kv, kvc::AttentionMask{4, 0, 0}),
                       "scaled_dot_product_attention: queries of shape [1, 1, -3, 2] and keys of shape [1, 1, 4, 2] "
                       "(values [1, 1, 4, 2]) must have dimensions between 0 and kvc's limit of 1099511627776",
                       kvc::ValueError);
  const auto query = ones(1, 1, 1, 2);
  CHECK_THROWS_WITH_AS(kvc::scaled_dot_product_attention(query, kv, kv, kvc::AttentionMask{4, i64_min, 0}),
                       "scaled_dot_product_attention: the mask's kv_offset must be 0 or more, got -9223372036854775808",
                       kvc::ValueError);
  CHECK_THROWS_WITH_AS(kvc::scaled_dot_product_attention(query, kv, kv, kvc::AttentionMask{4, 0, i64_max}),
                       "scaled_dot_product_attention: the mask's query_position is 9223372036854775807, above kvc's "
                       "limit of 1099511627776",
                       kvc::ValueError);
  kvc::AttentionMask wide{4, 0, 3};
  wide.sliding_window = i64_max;
  CHECK_THROWS_WITH_AS(kvc::scaled_dot_product_attention(query, kv, kv, wide),
                       "scaled_dot_product_attention: sliding_window is 9223372036854775807, above kvc's limit of "
                       "1099511627776",
                       kvc::ValueError);
  kvc::AttentionMask chunked{4, 0, 3};
  chunked.attention_chunk_size = i64_max;
  CHECK_THROWS_AS(kvc::scaled_dot_product_attention(query, kv, kv, chunked), kvc::ValueError);
}

TEST_CASE("attend refuses bad queries before it updates the cache") {
  kvc::DynamicCache<float> cache;
  const auto prompt = ones(1, 2, 3, 4), step = ones(1, 2, 1, 4), three_heads = ones(1, 3, 1, 4),
             wide = ones(1, 2, 1, 8), two = ones(1, 2, 2, 4);
  cache.update(prompt, prompt, 0);
  const auto before = take_snapshot(cache);
  // 3 query heads over 2 key/value heads, then a head_dim that differs from the keys': attention
  // used to throw only after the update had stored the new token.
  CHECK_THROWS_WITH_AS(kvc::attend(cache, 0, three_heads, step, step),
                       "scaled_dot_product_attention: 3 query heads are not a multiple of 2 key/value heads",
                       kvc::ValueError);
  CHECK(take_snapshot(cache) == before);
  CHECK_THROWS_AS(kvc::attend(cache, 0, wide, step, step), kvc::ValueError);
  CHECK_THROWS_AS(kvc::attend(cache, 0, step, step, step, {.sliding_window = 0}), kvc::ValueError);
  // One query for two new tokens: the mask sizes were asked for one.
  CHECK_THROWS_WITH_AS(kvc::attend(cache, 0, step, two, two),
                       "attend: queries of shape [1, 2, 1, 4] and new keys of shape [1, 2, 2, 4] must have the same "
                       "seq length",
                       kvc::ValueError);
  CHECK(take_snapshot(cache) == before);
  CHECK(cache.get_seq_length() == 3);
}

TEST_CASE("a ModelConfig filled in code is range-checked like one read from a file") {
  kvc::ModelConfig config;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 2;
  config.head_dim = -4;  // used to come back from get_head_shapes
  CHECK_THROWS_WITH_AS(kvc::get_head_shapes(config), "ModelConfig: head_dim must be a positive integer, got -4",
                       kvc::ValueError);
  config.head_dim = 4;
  config.sliding_window = 0;
  CHECK_THROWS_WITH_AS(kvc::make_dynamic_cache<float>(config),
                       "ModelConfig: sliding_window must be a positive integer, got 0", kvc::ValueError);
  config.sliding_window.reset();
  config.num_hidden_layers = i64_max;
  CHECK_THROWS_WITH_AS(kvc::layer_specs(config),
                       "ModelConfig: num_hidden_layers is 9223372036854775807, above kvc's limit of 1048576",
                       kvc::ValueError);
}

TEST_CASE("conformance: is_initialized and get_max_length of caches without attention layers") {
  // transformers asks only the layers that support early initialization (none here): False; and
  // the max over layers that all report -1.
  kvc::ModelConfig config;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 1;
  config.head_dim = 2;
  config.layer_types = std::vector<std::string>{"linear_attention", "linear_attention"};
  auto linear = kvc::make_dynamic_cache<float>(config);
  CHECK_FALSE(linear.is_initialized());
  CHECK(linear.get_max_length() == -1);
  Eigen::Tensor<float, 3, Eigen::RowMajor> x(1, 2, 3);
  x.setConstant(1.f);
  linear.update_conv_state(x, 0);
  CHECK_FALSE(linear.is_initialized());
  CHECK(linear.get_max_length() == -1);
  config.layer_types = std::vector<std::string>{"hybrid", "hybrid"};
  auto hybrid = kvc::make_dynamic_cache<float>(config);
  hybrid.update(ones(1, 1, 2, 2), ones(1, 1, 2, 2), 0);
  CHECK_FALSE(hybrid.is_initialized());  // hybrids do not support early initialization either
  // One attention layer among linear ones: its own answers.
  config.layer_types = std::vector<std::string>{"linear_attention", "full_attention"};
  auto mixed = kvc::StaticCache<float>(config, 8);
  CHECK_FALSE(mixed.is_initialized());
  CHECK(mixed.get_max_length() == 8);
  mixed.update(ones(1, 1, 2, 2), ones(1, 1, 2, 2), 1);
  CHECK(mixed.is_initialized());
}
