// EXPECT-ERROR: kvc::StaticCache::batch_select_indices: a StaticCache keeps a fixed batch; use a dynamic cache
// batch_select_indices on a StaticCache (its linear-attention kinds have batch operations, its
// static attention layers do not). docs/errors.md lists the fix.
#include <kvc/caches.hpp>

int main() {
  kvc::ModelConfig config;
  config.num_hidden_layers = 1;
  config.num_attention_heads = 2;
  config.head_dim = 4;
  kvc::HostTensor<float> k(2, 2, 3, 4);
  k.setConstant(0.5f);

  kvc::StaticCache<float> fixed(config, 16);
  fixed.update(k, k, 0);
#ifdef KVC_SHOULD_FAIL
  fixed.batch_select_indices({1});
#else
  fixed.reorder_cache({1, 0});
#endif
  return fixed.batch_size() == 2 ? 0 : 1;
}
