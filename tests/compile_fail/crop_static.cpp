// EXPECT-ERROR: kvc::Cache::crop: no layer kind of this cache can be cropped. Static layers keep a fixed buffer; use a dynamic cache to roll back
// crop on a cache whose layer kinds are all static. docs/errors.md lists the fix.
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
  dynamic.crop(-1);

  kvc::Cache<kvc::Layers<kvc::StaticLayer, kvc::StaticSlidingWindowLayer>> fixed(kvc::StaticLayer{16});
  fixed.update(k, k, 0);
#ifdef KVC_SHOULD_FAIL
  fixed.crop(-1);
#endif
  return dynamic.get_seq_length() == 2 && fixed.get_seq_length() == 3 ? 0 : 1;
}
