// The code blocks of docs/quantized.md, paged.md, state.md, linear_attention.md and runtime.md,
// quoted by docs.snippets and compiled by the build (kvc_docs_examples): each page's block is the
// body of a function whose parameters are the inputs the page leaves to the reader.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include <kvc/fp8_attention.hpp>
#include <kvc/kvc.hpp>
#include <kvc/nvfp4.hpp>
#include <kvc/paged.hpp>
#include <kvc/quantized_attention.hpp>
#include <kvc/quantized_cache.hpp>
#include <kvc/rotation.hpp>
#include <kvc/row_codes.hpp>
#include <kvc/runtime.hpp>
#include <kvc/state.hpp>

namespace docs_examples {

using Half = kvc::HostTensor<Eigen::half>;

void quantized_cache(const Half& keys, const Half& values, std::int64_t layer_idx) {
  // [snippet:quantized_cache]
  // #include <kvc/quantized_cache.hpp> and <kvc/runtime.hpp> (ModelConfig::from_file)
  kvc::ModelConfig config = kvc::ModelConfig::from_file("config.json");  // full attention only
  kvc::QuantizedCache<Eigen::half> cache(
      "quanto", config, {.nbits = 4, .axis_key = 0, .axis_value = 0, .q_group_size = 64, .residual_length = 128});
  auto [k, v] = cache.update(keys, values, layer_idx);  // dequantized history + residual + new
  // [/snippet]
  (void)k;
  (void)v;
}

void kivi(const kvc::ModelConfig& config, const Half& queries, const Half& keys, const Half& values,
          std::int64_t layer_idx) {
  // [snippet:kivi]
  // keys along seq (axis_key -1), values along head_dim (axis_value 0), groups of 32, the last 128
  // tokens in full precision, append-only
  kvc::QuantizedCache<Eigen::half> cache("quanto", config, kvc::kivi_options());
  // #include <kvc/quantized_attention.hpp>: attention from the codes
  auto out = kvc::attend_quantized(cache, layer_idx, queries, keys, values);
  // [/snippet]
  (void)out;
}

void fp8(const Half& calib_keys, const Half& calib_values, const Half& queries, const Half& keys, const Half& values,
         std::int64_t layer_idx) {
  // [snippet:fp8]
  // #include <kvc/fp8_attention.hpp>; queries, keys and values in the model's type (float, half
  // or bfloat16)
  kvc::DynamicCache<kvc::float8_e4m3> cache;
  // per-head scales from calibration K/V: the largest |x| of each head maps to 448
  const kvc::Fp8Scales scales =
      kvc::fp8_scales_for<kvc::float8_e4m3>(calib_keys, calib_values, kvc::Fp8ScaleGranularity::per_head);
  // keys and values are encoded (x / scale, round to nearest even, saturating), stored, and
  // attended over as scale * code
  kvc::HostTensor<Eigen::half> out = kvc::attend_fp8(cache, layer_idx, queries, keys, values, scales);
  // [/snippet]
  (void)out;
  // [snippet:fp8_rotated]
  // keys rotated before they are encoded: the scales calibrated on rotated rows carry the rotation
  const kvc::Fp8Scales rotated_scales = kvc::fp8_scales_for<kvc::float8_e4m3>(
      calib_keys, calib_values, kvc::Fp8ScaleGranularity::per_head, kvc::Fp8Rotation{.keys = true});
  kvc::DynamicCache<kvc::float8_e4m3> rotated_cache;
  kvc::HostTensor<Eigen::half> rotated_out =
      kvc::attend_fp8(rotated_cache, layer_idx, queries, keys, values, rotated_scales);  // queries rotated
  // [/snippet]
  (void)rotated_out;
}

std::vector<float> nvfp4(const std::vector<float>& row) {  // a row of 128 values
  // [snippet:nvfp4]
  // #include <kvc/nvfp4.hpp>
  float amax = 0.0f;
  for (const float x : row) amax = std::max(amax, std::abs(x));
  const float g = kvc::nvfp4_tensor_scale(amax);  // amax / (6 * 448): the tensor scale
  std::vector<std::uint8_t> codes(64);            // two E2M1 codes a byte, value 2i in the low half
  std::vector<kvc::float8_e4m3> scales(8);        // one E4M3 scale per 16 values
  kvc::nvfp4_quantize(row.data(), 128, g, codes.data(), scales.data());
  std::vector<float> back(128);
  kvc::nvfp4_dequantize(codes.data(), scales.data(), 128, g, back.data());
  // [/snippet]
  return back;
}

kvc::HostTensor<float> rotation(kvc::HostTensor<float> queries, kvc::HostTensor<float> keys,
                                kvc::HostTensor<float> values, const kvc::AttentionMask& mask) {
  // [snippet:rotation]
  // #include <kvc/rotation.hpp>; [batch, heads, tokens, head_dim] tensors, rotated in place
  const std::int64_t d = queries.dimension(3);
  kvc::hadamard_rotate(queries.data(), queries.size() / d, d);  // queries as the keys: scores kept
  kvc::hadamard_rotate(keys.data(), keys.size() / d, d);
  kvc::hadamard_rotate(values.data(), values.size() / d, d);
  kvc::HostTensor<float> out = kvc::scaled_dot_product_attention(queries, keys, values, mask);
  kvc::hadamard_rotate(out.data(), out.size() / d, d);  // values were rotated: rotate the output back
  // [/snippet]
  return out;
}

Half rotated_quantized(const kvc::ModelConfig& config, const Half& queries, const Half& keys, const Half& values) {
  // [snippet:rotated_quantized]
  // #include <kvc/quantized_cache.hpp> and <kvc/quantized_attention.hpp>
  kvc::QuantizedOptions opts{.nbits = 4, .q_group_size = 64, .residual_length = 128};
  opts.rotate_keys = opts.rotate_values = true;  // codes of rotated rows
  kvc::QuantizedCache<Eigen::half> cache("quanto", config, opts);
  Half out = kvc::attend_quantized(cache, 0, queries, keys, values);  // queries rotated, output back
  // [/snippet]
  return out;
}

void paged(kvc::PagedCache<kvc::HostStorage<float>>& cache, std::int64_t layer,
           const std::vector<std::string>& request_ids, const std::vector<std::int64_t>& cu_seqlens_q,
           const std::vector<std::int64_t>& past, const kvc::TensorView<float>& queries,
           const kvc::TensorView<float>& keys, const kvc::TensorView<float>& values, const kvc::PagedIndices& no_reads,
           const kvc::PagedIndices& write_index) {
  // [snippet:paged_attention]
  kvc::PagedAttentionStep step{request_ids, cu_seqlens_q, past};  // R ids, R + 1 offsets, R lengths
  kvc::HostTensor<float> out = kvc::paged_attention(cache, layer, step, queries, keys, values);
  cache.update(keys, values, layer, no_reads, write_index);  // store the step: the write-only path
  // [/snippet]
  (void)out;
}

void paged_row_codes(kvc::PagedCache<kvc::HostStorage<kvc::int4_row>>& cache,
                     kvc::PagedCache<kvc::HostStorage<kvc::nvfp4_row>>& nvfp4_cache, std::int64_t layer,
                     const kvc::PagedAttentionStep& step, const Half& queries, const Half& keys, const Half& values,
                     float key_amax, float value_amax, const kvc::PagedIndices& no_reads,
                     const kvc::PagedIndices& write_index) {
  // [snippet:paged_row_codes]
  // kvc::PagedCache<kvc::HostStorage<kvc::int4_row>> cache(config, cb);   (#include <kvc/row_codes.hpp>)
  const auto k = kvc::to_row_codes<kvc::int4_row>(keys);  // [1, Hkv, T, cache.row_width()]: codes + scale
  const auto v = kvc::to_row_codes<kvc::int4_row>(values);
  Half out = kvc::paged_attention(cache, layer, step, queries, k, v);  // read from the codes
  cache.update(k, v, layer, no_reads, write_index);

  // NVFP4: a tensor scale for the keys and one for the values, given to paged_attention too.
  const kvc::Nvfp4TensorScales g{kvc::nvfp4_tensor_scale(key_amax), kvc::nvfp4_tensor_scale(value_amax)};
  const auto k4 = kvc::to_row_codes<kvc::nvfp4_row>(keys, g.keys);
  const auto v4 = kvc::to_row_codes<kvc::nvfp4_row>(values, g.values);
  Half out4 = kvc::paged_attention(nvfp4_cache, layer, step, queries, k4, v4, g);
  nvfp4_cache.update(k4, v4, layer, no_reads, write_index);
  // [/snippet]
  (void)out;
  (void)out4;
}

// fp8 keys with int4 values in one pool, and int8 keys with NVFP4 values.
using Fp8KeysInt4Values = kvc::kv_codes<kvc::fp8_row<kvc::float8_e4m3>, kvc::int4_row>;
using Int8KeysNvfp4Values = kvc::kv_codes<kvc::int8_row, kvc::nvfp4_row>;
void paged_kv_codes(kvc::PagedCache<kvc::HostStorage<Fp8KeysInt4Values>>& cache,
                    kvc::PagedCache<kvc::HostStorage<Int8KeysNvfp4Values>>& mixed, std::int64_t layer,
                    const kvc::PagedAttentionStep& step, const Half& queries, const Half& keys, const Half& values,
                    float value_amax, const kvc::PagedIndices& no_reads, const kvc::PagedIndices& write_index) {
  // [snippet:paged_kv_codes]
  // using Fp8KeysInt4Values = kvc::kv_codes<kvc::fp8_row<kvc::float8_e4m3>, kvc::int4_row>;
  // kvc::PagedCache<kvc::HostStorage<Fp8KeysInt4Values>> cache(config, cb);
  const auto [k, v] = kvc::to_kv_codes<Fp8KeysInt4Values>(keys, values);  // widths: row_width(), value_row_width()
  Half out = kvc::paged_attention(cache, layer, step, queries, k, v);     // each side read from its codes
  cache.update(k, v, layer, no_reads, write_index);

  // One NVFP4 side: its tensor scale, and 1 for the side whose scales are in its rows.
  const kvc::Nvfp4TensorScales g{1.0f, kvc::nvfp4_tensor_scale(value_amax)};
  const auto [k8, v4] = kvc::to_kv_codes<Int8KeysNvfp4Values>(keys, values, g);
  Half out2 = kvc::paged_attention(mixed, layer, step, queries, k8, v4, g);
  // [/snippet]
  (void)out;
  (void)out2;
}

void per_layer_quantized(const kvc::ModelConfig& config, std::int64_t layer_idx, const Half& queries, const Half& keys,
                         const Half& values) {
  // [snippet:per_layer_quantized]
  // Int2 everywhere but the first and last layers, which stay in full precision.
  kvc::PerLayerQuantizedCache<Eigen::half> skipped("quanto", config, {.nbits = 2}, {.skip_layers = {0, -1}});
  // HQQ with a bit width per layer (nullopt: full precision).
  kvc::PerLayerQuantizedCache<Eigen::half> listed("hqq", config, {.axis_key = 1, .axis_value = 1},
                                                  {.layer_nbits = {8, 4, 4, 2, std::nullopt, 8}});
  // One call per layer reads each as it is stored: codes, or full precision through kvc::attend.
  Half out = kvc::attend_quantized(skipped, layer_idx, queries, keys, values);
  // [/snippet]
  (void)out;
}

void value_nbits(const kvc::ModelConfig& config, std::int64_t layer_idx, const Half& queries, const Half& keys,
                 const Half& values) {
  // [snippet:value_nbits]
  // HQQ: 8-bit keys with 2-bit values, each read from its own codes.
  kvc::QuantizedCache<Eigen::half> split("hqq", config, {.nbits = 8, .axis_key = 1, .axis_value = 1, .value_nbits = 2});
  Half out = kvc::attend_quantized(split, layer_idx, queries, keys, values);
  // [/snippet]
  (void)out;
}

void state() {
  // [snippet:save_load]
  // #include <kvc/state.hpp>
  kvc::DynamicCache<float> cache;
  // ... prefill, decode ...
  kvc::save(cache, "session.kvc");  // or kvc::save(cache, std::ostream&)

  kvc::DynamicCache<float> resumed;
  kvc::load(resumed, "session.kvc");  // or kvc::load(resumed, std::istream&)
  // resumed.update(...) now returns exactly what cache.update(...) would
  // [/snippet]
}

void linear_attention(std::int64_t batch, std::int64_t channels, std::int64_t time,
                      const Eigen::Tensor<float, 2, Eigen::RowMajor>& state, const kvc::HostTensor<float>& keys,
                      const kvc::HostTensor<float>& values) {
  // [snippet:linear_hybrid]
  kvc::Cache<kvc::Layers<kvc::LinearAttentionLayer, kvc::DynamicLayer>> cache(kvc::LinearAttentionLayer{},
                                                                              kvc::DynamicLayer{});
  Eigen::Tensor<float, 3, Eigen::RowMajor> conv(batch, channels, time);  // [B, C, T], time last
  auto with_context = cache.update_conv_state(conv, /*layer_idx=*/0, /*state_idx=*/0, /*conv_kernel_size=*/4);
  auto recurrent = cache.update_recurrent_state(state, 0);  // any rank 1..4
  auto [k, v] = cache.update(keys, values, 1);              // the attention layer
  // [/snippet]
  (void)with_context;
  (void)recurrent;
  (void)k;
  (void)v;
}

void rollback(const kvc::HostTensor<float>& prompt, const kvc::HostTensor<float>& draft, std::int64_t accepted) {
  // [snippet:rollback]
  // Gemma-style: a full layer and a sliding layer of window W = 4096 that keeps 4 tokens past it.
  using C = kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::SpeculativeSlidingWindowLayer<4>>>;
  C cache(kvc::DynamicLayer{}, kvc::SpeculativeSlidingWindowLayer<4>{{.sliding_window = 4096}});
  kvc::require_rollback<4>(cache);  // up to 4 draft tokens per step: checked by the compiler
  for (std::int64_t l = 0; l < 2; ++l) cache.update(prompt, prompt, l);
  for (std::int64_t l = 0; l < 2; ++l) cache.update(draft, draft, l);  // verify the draft tokens (at most 4)
  cache.crop(-(draft.dimension(2) - accepted));  // exact: as if the rejected tokens had never been seen
  // [/snippet]
}

using State3 = Eigen::Tensor<float, 3, Eigen::RowMajor>;

void linear_rollback(const kvc::HostTensor<float>& prompt, const kvc::HostTensor<float>& draft,
                     const State3& prompt_columns, const std::vector<State3>& draft_columns, const State3& state,
                     const std::vector<State3>& state_after, std::int64_t accepted) {
  // [snippet:linear_rollback]
  // A hybrid stack: a gated-DeltaNet-style linear layer and a full layer; 4 draft tokens per step.
  using C = kvc::Cache<kvc::Layers<kvc::SpeculativeLinearAttentionLayer<4>, kvc::DynamicLayer>>;
  C cache(kvc::SpeculativeLinearAttentionLayer<4>{}, kvc::DynamicLayer{});
  kvc::require_rollback<4>(cache);  // given one token per step in the linear layer
  cache.update_conv_state(prompt_columns, 0, 0, /*conv_kernel_size=*/4);  // the prefill: one step
  cache.update_recurrent_state(state, 0);
  cache.update(prompt, prompt, 1);
  for (std::size_t t = 0; t < draft_columns.size(); ++t) {  // verify: the linear layer token by token
    cache.update_conv_state(draft_columns[t], 0, 0, 4);
    cache.update_recurrent_state(state_after[t], 0);
  }
  cache.update(draft, draft, 1);                 // the full layer: all draft tokens at once
  cache.crop(-(draft.dimension(2) - accepted));  // the linear state after the last accepted token
  // [/snippet]
}

void runtime(const kvc::GenerationConfig& generation_config, const kvc::ModelConfig& model_config,
             const kvc::CacheRequest& request, const kvc::ContinuousBatchingConfig& cb_config) {
  // [snippet:make_cache]
  // template <class T = float> make_cache(generation_config, model_config, request = {}[, cb_config])
  kvc::AnyCache cache = kvc::make_cache(generation_config, model_config);  // float
  kvc::AnyCache half = kvc::make_cache<Eigen::half>(generation_config, model_config, request);
  kvc::AnyCache paged = kvc::make_cache(generation_config, model_config, request, cb_config);  // "paged"
  // [/snippet]
  (void)cache;
  (void)half;
  (void)paged;
}

void prepare(const kvc::GenerationConfig& generation_config, const kvc::ModelConfig& model_config,
             kvc::AnyCache user_cache, const kvc::CacheRequest& request) {
  // [snippet:prepare_cache_for_generation]
  // template <class T = float>; user_cache and request may be left out ({}: none, defaults)
  std::optional<kvc::AnyCache> cache = kvc::prepare_cache_for_generation(
      generation_config, model_config, /*model_type=*/"llama", std::move(user_cache), request);
  // [/snippet]
  (void)cache;
}

void static_export(const kvc::ModelConfig& config, const std::optional<kvc::GenerationConfig>& generation_config) {
  // [snippet:static_export]
  // batch_size and max_cache_len may be left out (std::nullopt: from the generation config's cache_config)
  kvc::StaticCacheExport<float> exported(config, generation_config, /*batch_size=*/1, /*max_cache_len=*/4096);
  // [/snippet]
  (void)exported;
}

}  // namespace docs_examples
