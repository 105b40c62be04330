// EXPECT-ERROR: kvc::Cache::batch_repeat_interleave: no layer kind of this cache supports batch operations. Static layers keep a fixed batch; use a dynamic cache
// batch_repeat_interleave on a cache whose layer kinds are all static.
// docs/errors.md lists the fix.
#include <kvc/caches.hpp>

int main() {
  kvc::ModelConfig config;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 2;
  config.head_dim = 4;
  kvc::HostTensor<float> k(1, 2, 3, 4);
  k.setConstant(0.5f);

  kvc::DynamicCache<float> dynamic;
  dynamic.update(k, k, 0);
  dynamic.batch_repeat_interleave(2);

  kvc::Cache<kvc::Layers<kvc::StaticLayer, kvc::StaticSlidingWindowLayer>> fixed(kvc::StaticLayer{16});
  fixed.update(k, k, 0);
#ifdef KVC_SHOULD_FAIL
  fixed.batch_repeat_interleave(2);
#endif
  return dynamic.batch_size() == 2 && fixed.batch_size() == 1 ? 0 : 1;
}
