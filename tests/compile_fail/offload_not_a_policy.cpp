// EXPECT-ERROR: kvc::Cache: the OffloadPolicy does not model kvc::concepts::OffloadPolicy. Use kvc::NoOffload or see docs/concepts/offload_policy.md
// An offload policy that says it serves every storage but has no `engine<S>`.
// docs/errors.md lists the fix.
#include <kvc/cache.hpp>

#ifdef KVC_SHOULD_FAIL
struct OffloadWithoutEngine {
  template <class S>
  static constexpr bool serves = true;
};
[[maybe_unused]] kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<float>, OffloadWithoutEngine> misuse;
#endif

int main() {
  kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<float>, kvc::NoOffload> cache;
  return cache.size() == 0 ? 0 : 1;
}
