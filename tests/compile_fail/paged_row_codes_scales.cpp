// EXPECT-ERROR: kvc::paged_attention: row codes other than NVFP4 keep their scales in the rows: call it without scales
// An int8 or int4 row carries its own scale (<kvc/row_codes.hpp>): a scale list would scale the
// values twice. docs/errors.md lists the fix.
#include <kvc/paged/paged_attention.hpp>
#include <kvc/policies/storage/host.hpp>
#include <kvc/row_codes.hpp>

#include <string>
#include <vector>

int main() {
  kvc::ModelConfig m;
  m.num_hidden_layers = 1;
  m.num_attention_heads = 1;
  m.head_dim = 4;
  m.hidden_size = 4;
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 2;
  const kvc::PagedCache<kvc::HostStorage<kvc::int8_row>> cache(m, cb);
  const kvc::HostTensor<float> q(1, 1, 0, 4);
  const kvc::HostTensor<kvc::int8_row> kv(1, 1, 0, cache.row_width());
  const std::vector<std::string> ids;
  const std::vector<std::int64_t> cu{0}, past;
  const kvc::PagedAttentionStep step{ids, cu, past};
#ifdef KVC_SHOULD_FAIL
  return kvc::paged_attention(cache, 0, step, q, kv, kv, kvc::Nvfp4TensorScales{}).size() == 0 ? 0 : 1;
#else
  return kvc::paged_attention(cache, 0, step, q, kv, kv).size() == 0 ? 0 : 1;
#endif
}
