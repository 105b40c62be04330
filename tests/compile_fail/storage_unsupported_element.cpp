// EXPECT-ERROR: kvc::Cache: the StoragePolicy does not support this element type. Use float, double, Eigen::half, Eigen::bfloat16 or an 8-bit float (kvc::float8_e4m3, float8_e5m2) with HostStorage; float, __half, __nv_bfloat16 or an 8-bit float with CudaStorage
// kvc::HostStorage<int> is a storage policy, but int is not an element type it can hold.
// docs/errors.md lists the fix.
#include <kvc/cache.hpp>

#ifdef KVC_SHOULD_FAIL
[[maybe_unused]] kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<int>> misuse;
#endif

int main() {
  kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<Eigen::bfloat16>> cache;
  return cache.size() == 0 ? 0 : 1;
}
