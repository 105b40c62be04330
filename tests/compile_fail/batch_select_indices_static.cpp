// EXPECT-ERROR: kvc::Cache::batch_select_indices: no layer kind of this cache supports batch operations. Static layers keep a fixed batch; use a dynamic cache
// batch_select_indices on a cache whose layer kinds are all static.
// docs/errors.md lists the fix.
#include <kvc/caches.hpp>

int main() {
  kvc::ModelConfig config;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 2;
  config.head_dim = 4;
  kvc::HostTensor<float> k(2, 2, 3, 4);
  k.setConstant(0.5f);

  kvc::DynamicCache<float> dynamic;
  dynamic.update(k, k, 0);
  dynamic.batch_select_indices({1});

  kvc::Cache<kvc::Layers<kvc::StaticLayer, kvc::StaticSlidingWindowLayer>> fixed(kvc::StaticLayer{16});
  fixed.update(k, k, 0);
#ifdef KVC_SHOULD_FAIL
  fixed.batch_select_indices({1});
#endif
  return dynamic.batch_size() == 1 && fixed.batch_size() == 2 ? 0 : 1;
}
