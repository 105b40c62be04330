// EXPECT-ERROR: kvc::Cache: the StoragePolicy does not model kvc::concepts::StoragePolicy. Use kvc::HostStorage or see docs/concepts/storage_policy.md
// The element type is given where the storage policy belongs (float instead of
// kvc::HostStorage<float>). docs/errors.md lists the fix.
#include <kvc/cache.hpp>

#ifdef KVC_SHOULD_FAIL
[[maybe_unused]] kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, float> misuse;
#endif

int main() {
  kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<float>> cache;
  return cache.size() == 0 ? 0 : 1;
}
