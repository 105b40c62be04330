// EXPECT-ERROR: kvc::Cache: the LayerPolicy's `layers` list is empty. Name at least one layer kind in kvc::Layers
// kvc::Layers<> names no layer kind, so the Cache could hold no layer. docs/errors.md lists the fix.
#include <kvc/cache.hpp>

#ifdef KVC_SHOULD_FAIL
[[maybe_unused]] kvc::Cache<kvc::Layers<>> misuse;
#endif

int main() {
  kvc::Cache<kvc::Layers<kvc::DynamicLayer>> cache(kvc::DynamicLayer{}, kvc::DynamicLayer{});
  return cache.size() == 2 ? 0 : 1;
}
