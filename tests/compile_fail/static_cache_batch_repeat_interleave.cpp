// EXPECT-ERROR: kvc::StaticCache::batch_repeat_interleave: a StaticCache keeps a fixed batch; use a dynamic cache
// batch_repeat_interleave on a StaticCache (its linear-attention kinds have batch operations, its
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
  fixed.batch_repeat_interleave(2);
#else
  fixed.reorder_cache({1, 0});
#endif
  return fixed.batch_size() == 2 ? 0 : 1;
}
