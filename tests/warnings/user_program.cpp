// A user's program under strict warnings: every public header (kvc_public_headers.hpp, generated
// by tests/CMakeLists.txt) and the common calls of each part instantiated, compiled with
// -Wall -Wextra -Wconversion -Wsign-conversion -Wshadow -Werror by g++ and by clang++ (the two
// builds of tools/test-all.sh). Compiled, never run: a warning from a kvc header fails the build.
#include "kvc_public_headers.hpp"

#include <cstdint>
#include <sstream>
#include <string>
#include <vector>

namespace {

kvc::ModelConfig model() {
  kvc::ModelConfig c;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.hidden_size = 64;
  c.sliding_window = 8;
  c.layer_types =
      std::vector<std::string>{"full_attention", "sliding_attention", "linear_attention", "chunked_attention"};
  return c;
}

template <class T>
void dense_caches() {
  const kvc::HostTensor<T> q(1, 4, 3, 16), k(1, 2, 3, 16), v(1, 2, 3, 16);
  kvc::DynamicCache<T> dynamic;
  (void)kvc::attend(dynamic, 0, q, k, v);
  dynamic.crop(-1);
  kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::SpeculativeSlidingWindowLayer<2>>, kvc::HostStorage<T>> speculative(
      kvc::DynamicLayer{}, kvc::SpeculativeSlidingWindowLayer<2>{{.sliding_window = 4}});
  kvc::require_rollback<2>(speculative);
  (void)speculative.update(k, v, 1);
  if (speculative.rollback_depth() >= 2) speculative.crop(-2);
  kvc::StaticCache<T> fixed(model(), 32);
  (void)fixed.update(k, v, 0);
  auto from_config = kvc::make_dynamic_cache<T>(model());
  (void)from_config.update(k, v, 1);
  std::stringstream layers;
  kvc::save(from_config, layers);
  kvc::load(from_config, layers);
  std::stringstream state;
  kvc::save(dynamic, state);
  kvc::DynamicCache<T> loaded;
  kvc::load(loaded, state);
  kvc::AnyCache any{kvc::DynamicCache<T>{}};
  (void)any.get_seq_length(0);
}

void quantized_and_fp8() {
  const kvc::HostTensor<float> q(1, 4, 3, 16), k(1, 2, 3, 16), v(1, 2, 3, 16);
  kvc::Cache<kvc::Replicate<kvc::QuantoQuantizedLayer>, kvc::HostStorage<float>> quanto(kvc::QuantoQuantizedLayer{});
  const auto view = [](const kvc::HostTensor<float>& t) { return kvc::HostStorage<float>::input_view(t); };
  (void)kvc::attend_quantized(quanto, 0, view(q), view(k), view(v));
  kvc::PerLayerQuantizedCache<float> mixed("quanto", model(), {},
                                           {.skip_layers = {0, -1}, .layer_nbits = {2, 4, 4, 2}});
  (void)kvc::attend_quantized(mixed, 0, view(q), view(k), view(v));
  auto fp8 = kvc::make_dynamic_cache<kvc::float8_e4m3>(model());
  (void)kvc::attend_fp8(fp8, 0, view(q), view(k), view(v), kvc::Fp8Scales{});
}

void paged() {
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 16;
  cb.num_blocks = 64;
  kvc::ModelConfig c = model();
  c.layer_types = std::vector<std::string>{"full_attention", "sliding_attention"};
  c.num_hidden_layers = 2;
  kvc::PagedCache<kvc::HostStorage<float>> cache(c, cb);
  (void)cache.allocate_blocks(1, "r0", 0);
  kvc::PagedIndices writes(static_cast<std::size_t>(cache.num_groups()));
  cache.extend_read_and_write_indices("r0", 0, 3, nullptr, writes);
  const kvc::HostTensor<float> q(1, 4, 3, 16), k(1, 2, 3, 16), v(1, 2, 3, 16);
  const auto view = [](const kvc::HostTensor<float>& t) { return kvc::HostStorage<float>::input_view(t); };
  const std::vector<std::string> ids{"r0"};
  const std::vector<std::int64_t> cu{0, 3}, past{0};
  kvc::HostTensor<float> out;
  kvc::paged_attention(cache, 0, kvc::PagedAttentionStep{ids, cu, past}, view(q), view(k), view(v), out);
  const kvc::PagedIndices none(writes.size());
  cache.update(view(k), view(v), 0, none, writes);
  kvc::PagedCache<kvc::HostStorage<float>> served(c, cb);
  kvc::ContinuousBatchingScheduler<kvc::HostStorage<float>> scheduler(served, cb);
  (void)scheduler;
}

// A pool of keys and values in two row formats, one of them NVFP4 (<kvc/row_codes.hpp>).
void paged_row_codes() {
  using Pool = kvc::kv_codes<kvc::rotated<kvc::fp8_row<kvc::float8_e4m3>>, kvc::nvfp4_row>;
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 16;
  cb.num_blocks = 8;
  kvc::ModelConfig c = model();
  c.layer_types = std::vector<std::string>{"full_attention"};
  c.num_hidden_layers = 1;
  kvc::PagedCache<kvc::HostStorage<Pool>> cache(c, cb);
  (void)cache.allocate_blocks(1, "r0", 0);
  kvc::PagedIndices writes(1);
  cache.extend_read_and_write_indices("r0", 0, 3, nullptr, writes);
  const kvc::HostTensor<float> q(1, 4, 3, 16), k(1, 2, 3, 16), v(1, 2, 3, 16);
  const kvc::Nvfp4TensorScales g{1.0f, 0.01f};
  const auto codes = kvc::to_kv_codes<Pool>(k, v, g);
  const std::vector<std::string> ids{"r0"};
  const std::vector<std::int64_t> cu{0, 3}, past{0};
  (void)kvc::paged_attention(cache, 0, kvc::PagedAttentionStep{ids, cu, past}, q, codes.keys, codes.values, g);
  cache.update(codes.keys, codes.values, 0, kvc::PagedIndices(1), writes);
  (void)kvc::from_kv_codes<Pool>(codes.keys, codes.values, 16, g);
  (void)kvc::from_row_codes<kvc::int4_row>(kvc::to_row_codes<kvc::int4_row>(k), 16);
  (void)kvc::from_row_codes<kvc::int2_row>(kvc::to_row_codes<kvc::int2_row>(k), 16);
}

void runtime() {
  kvc::GenerationConfig generation;
  generation.cache_implementation = "static";
  generation.max_length = 32;
  auto cache = kvc::make_cache(generation, model());
  (void)cache.get_seq_length(0);
}

}  // namespace

// Referenced, so that the templates above are instantiated.
void kvc_user_program() {
  dense_caches<float>();
  dense_caches<Eigen::bfloat16>();
  quantized_and_fp8();
  paged();
  paged_row_codes();
  runtime();
}
