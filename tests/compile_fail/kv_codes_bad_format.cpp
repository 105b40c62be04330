// EXPECT-ERROR: kvc::kv_codes<K, V>: K and V must each be a row format: kvc::int8_row, int4_row, int2_row, nvfp4_row, fp8_row<F8>, bfloat16_row or kvc::rotated<one>
// A kv_codes pool stores each side as rows of codes; a plain element type (float here) is a pool
// of its own, not a side of a pair. docs/errors.md lists the fix.
#include <kvc/paged/paged_cache.hpp>
#include <kvc/policies/storage/host.hpp>
#include <kvc/row_codes.hpp>

int main() {
  kvc::ModelConfig m;
  m.num_hidden_layers = 1;
  m.num_attention_heads = 1;
  m.head_dim = 4;
  m.hidden_size = 4;
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 2;
#ifdef KVC_SHOULD_FAIL
  const kvc::PagedCache<kvc::HostStorage<kvc::kv_codes<float, kvc::int4_row>>> cache(m, cb);
#else
  const kvc::PagedCache<kvc::HostStorage<kvc::kv_codes<kvc::bfloat16_row, kvc::int4_row>>> cache(m, cb);
#endif
  return cache.value_row_width() == 6 ? 0 : 1;
}
