// EXPECT-ERROR: kvc::Cache: a layer kind given to the constructor is not in the LayerPolicy's `layers` list. Add it to kvc::Layers
// The constructor gets a DynamicSlidingWindowLayer, but the policy lists only DynamicLayer.
// docs/errors.md lists the fix.
#include <kvc/cache.hpp>

int main() {
  using Listed = kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer>;
  kvc::Cache<Listed> cache(kvc::DynamicLayer{}, kvc::DynamicSlidingWindowLayer{4});
#ifdef KVC_SHOULD_FAIL
  kvc::Cache<kvc::Layers<kvc::DynamicLayer>> misuse(kvc::DynamicLayer{}, kvc::DynamicSlidingWindowLayer{4});
#endif
  return cache.size() == 2 ? 0 : 1;
}
