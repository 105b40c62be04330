// EXPECT-ERROR: kvc::Cache::set_write_position: no layer kind of this cache has a write position. Only StaticLayer has one
// set_write_position on a DynamicCache, whose only layer kind is DynamicLayer.
// docs/errors.md lists the fix.
#include <kvc/caches.hpp>

int main() {
  kvc::ModelConfig config;
  config.num_hidden_layers = 1;
  config.num_attention_heads = 2;
  config.head_dim = 4;
  kvc::HostTensor<float> k(1, 2, 3, 4);
  k.setConstant(0.5f);

  kvc::StaticCache<float> fixed(config, 16);
  fixed.update(k, k, 0);
  fixed.set_write_position(1);

  kvc::DynamicCache<float> dynamic;
  dynamic.update(k, k, 0);
#ifdef KVC_SHOULD_FAIL
  dynamic.set_write_position(1);
#endif
  return fixed.get_seq_length() == 1 && dynamic.get_seq_length() == 3 ? 0 : 1;
}
