// EXPECT-ERROR: kvc::StaticCache::crop: a StaticCache cannot be cropped. Its static layers keep a fixed buffer; use a dynamic cache to roll back
// crop on a StaticCache: its kinds include linear-attention layers (which can be cropped), but its
// static attention layers cannot. docs/errors.md lists the fix.
#include <kvc/caches.hpp>

int main() {
  kvc::ModelConfig config;
  config.num_hidden_layers = 2;
  config.num_attention_heads = 2;
  config.head_dim = 4;
  kvc::HostTensor<float> k(1, 2, 3, 4);
  k.setConstant(0.5f);

  kvc::StaticCache<float> fixed(config, 16);
  fixed.update(k, k, 0);
#ifdef KVC_SHOULD_FAIL
  fixed.crop(-1);
#else
  fixed.reset();
#endif
  return fixed.get_seq_length() == 0 ? 0 : 1;
}
