// EXPECT-ERROR: kvc::paged_attention: pools of row codes are read in float: the queries must be float, Eigen::half or Eigen::bfloat16
// A pool of row codes (<kvc/row_codes.hpp>) widens its rows to float as it reads them: double
// queries would be scored against float values. docs/errors.md lists the fix.
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
  const kvc::PagedCache<kvc::HostStorage<kvc::int4_row>> cache(m, cb);
#ifdef KVC_SHOULD_FAIL
  kvc::HostTensor<double> q(1, 1, 0, 4);
#else
  kvc::HostTensor<float> q(1, 1, 0, 4);
#endif
  const kvc::HostTensor<kvc::int4_row> kv(1, 1, 0, cache.row_width());
  const std::vector<std::string> ids;
  const std::vector<std::int64_t> cu{0}, past;
  return kvc::paged_attention(cache, 0, kvc::PagedAttentionStep{ids, cu, past}, q, kv, kv).size() == 0 ? 0 : 1;
}
