// EXPECT-ERROR: kvc::PagedBatchCache: keys and values share one row width here; a kvc::kv_codes pool is read by kvc::paged_attention over a PagedCache
// PagedBatchCache returns keys and values as one dense batch of one width; a kv_codes pool's key
// and value rows differ. docs/errors.md lists the fix.
#include <kvc/paged/paged_batch_cache.hpp>
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
  const kvc::PagedBatchCache<kvc::HostStorage<kvc::kv_codes<kvc::int8_row, kvc::int4_row>>> cache(m, cb);
#else
  const kvc::PagedBatchCache<kvc::HostStorage<kvc::int4_row>> cache(m, cb);
#endif
  return cache.get_seq_length(0) == 0 ? 0 : 1;
}
