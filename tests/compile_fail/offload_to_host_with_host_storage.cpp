// EXPECT-ERROR: kvc::Cache: kvc::OffloadToHost moves layers from device memory to pinned host memory
// OffloadToHost is made for device storage; with HostStorage the layers already are in host
// memory. docs/errors.md lists the fix: OffloadToFile for host layers.
#include <kvc/cache.hpp>
#include <kvc/policies/offload/file.hpp>
#include <kvc/policies/offload/pinned_host.hpp>

#include <type_traits>

// The policy is well-formed for host storage, it just does not serve it.
static_assert(kvc::concepts::OffloadPolicy<kvc::OffloadToHost<>, kvc::HostStorage<float>>);
static_assert(!kvc::concepts::serves_storage<kvc::OffloadToHost<>, kvc::HostStorage<float>>);

#ifdef KVC_SHOULD_FAIL
[[maybe_unused]] kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<float>, kvc::OffloadToHost<>> misuse;
#endif

int main() {
  // The fix the message names: spill host layers to a file.
  kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<float>, kvc::OffloadToFile<>> cache;
  kvc::HostTensor<float> k(1, 1, 2, 4);
  k.setConstant(1.0f);
  const auto [keys, values] = cache.update(k, k, 0);
  return keys.extent(2) == 2 && values.extent(2) == 2 ? 0 : 1;
}
