// EXPECT-ERROR: kvc::PagedCache: the StoragePolicy does not model kvc::concepts::PagedStoragePolicy (a StoragePolicy with scatter_rows). Use kvc::HostStorage or kvc::CudaStorage, or see docs/concepts/storage_policy.md
// The element type is given where the storage policy belongs (float instead of
// kvc::HostStorage<float>): the policy's message is the only error, the constructor call adds
// none. docs/errors.md lists the fix.
#include <kvc/paged/paged_cache.hpp>
#include <kvc/policies/storage/host.hpp>

int main() {
  kvc::ModelConfig config;
  config.num_hidden_layers = 1;
  config.num_attention_heads = 2;
  config.num_key_value_heads = 2;
  config.head_dim = 4;
  config.hidden_size = 8;
  kvc::ContinuousBatchingConfig cb;
  cb.block_size = 4;
  cb.num_blocks = 8;
#ifdef KVC_SHOULD_FAIL
  kvc::PagedCache<float> cache(config, cb);
  return 0;
#else
  kvc::PagedCache<kvc::HostStorage<float> > cache(config, cb);
  return cache.num_blocks() == 8 ? 0 : 1;
#endif
}
