// EXPECT-ERROR: You can construct a Cache either from a list `layers` of all the predefined `CacheLayer`, or from a `layer_class_to_replicate`, in which case the Cache will append a new layer corresponding to `layer_class_to_replicate` for each new call to `update` with an idx not already in the Cache. In kvc: a LayerPolicy with `layers` only is kvc::Layers<Kinds...>, one with `layer_class_to_replicate` only is kvc::Replicate<Kind>; use one of them.
// A layer policy names both `layers` and `layer_class_to_replicate` (transformers' Cache.__init__
// raises the same message). docs/errors.md lists the fix.
#include <kvc/cache.hpp>

#include <boost/mp11/list.hpp>

// A policy with exactly one of the two members is what the Cache expects.
struct ReplicateOnly {
  using layer_class_to_replicate = kvc::DynamicLayer;
};

#ifdef KVC_SHOULD_FAIL
struct BothMembers {
  using layers = boost::mp11::mp_list<kvc::DynamicLayer>;
  using layer_class_to_replicate = kvc::DynamicLayer;
};
[[maybe_unused]] kvc::Cache<BothMembers> misuse;
#endif

int main() {
  kvc::Cache<ReplicateOnly> cache;
  return cache.size() == 0 ? 0 : 1;
}
