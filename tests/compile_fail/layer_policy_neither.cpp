// EXPECT-ERROR: You should provide exactly one of `layers` or `layer_class_to_replicate` to initialize a Cache. In kvc: use kvc::Layers<Kinds...> (a fixed list of layer kinds) or kvc::Replicate<Kind> (a layer appended for each new layer index) as the LayerPolicy.
// A layer policy names neither `layers` nor `layer_class_to_replicate` (transformers' Cache.__init__
// raises the same message). docs/errors.md lists the fix.
#include <kvc/cache.hpp>

#ifdef KVC_SHOULD_FAIL
struct NoLayerMembers {
  using layer = kvc::DynamicLayer;  // a typo for `layer_class_to_replicate`
};
[[maybe_unused]] kvc::Cache<NoLayerMembers> misuse;
#endif

int main() {
  kvc::Cache<kvc::Replicate<kvc::DynamicLayer>> cache;
  return cache.size() == 0 ? 0 : 1;
}
