// EXPECT-ERROR: kvc::Cache: a layer kind of the LayerPolicy does not model kvc::concepts::CacheLayer (nor LinearCacheLayer) for this storage. Use the kvc layer kinds, e.g. DynamicLayer or StaticLayer. The kind is the first argument of kvc::detail::layer_kind_check<Kind, Storage> in this error's instantiation context
// kvc::Layers<DynamicLayer, int>: int is not a layer kind (it has no `state<S>`), and the error's
// context names it (the compile_fail.layer_kind_named case). docs/errors.md lists the fix.
#include <kvc/cache.hpp>

#ifdef KVC_SHOULD_FAIL
[[maybe_unused]] kvc::Cache<kvc::Layers<kvc::DynamicLayer, int>> misuse;
#endif

int main() {
  kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::StaticLayer>> cache(kvc::DynamicLayer{}, kvc::StaticLayer{8});
  return cache.size() == 2 ? 0 : 1;
}
