// EXPECT-ERROR: kvc::paged_attention: an NVFP4 pool needs its tensor scales: pass kvc::Nvfp4TensorScales
// NVFP4 rows (<kvc/row_codes.hpp>) are encoded with a tensor scale the pool does not hold: reading
// them without it would give values off by that factor. docs/errors.md lists the fix.
#include <kvc/paged/paged_attention.hpp>
#include <kvc/policies/storage/host.hpp>
#include <kvc/row_codes.hpp>

#include <string>
#include <vector>

int main() {
  kvc::ModelConfig m;
  m.num_hidden_layers = 1;
  m.num_attention_heads = 1;
  m.head_dim = 16;
  m.hidden_size = 16;
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 2;
  const kvc::PagedCache<kvc::HostStorage<kvc::nvfp4_row>> cache(m, cb);
  const kvc::HostTensor<float> q(1, 1, 0, 16);
  const kvc::HostTensor<kvc::nvfp4_row> kv(1, 1, 0, cache.row_width());
  const std::vector<std::string> ids;
  const std::vector<std::int64_t> cu{0}, past;
  const kvc::PagedAttentionStep step{ids, cu, past};
#ifdef KVC_SHOULD_FAIL
  return kvc::paged_attention(cache, 0, step, q, kv, kv).size() == 0 ? 0 : 1;
#else
  return kvc::paged_attention(cache, 0, step, q, kv, kv, kvc::Nvfp4TensorScales{1.0f, 1.0f}).size() == 0 ? 0 : 1;
#endif
}
