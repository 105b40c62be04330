// EXPECT-ERROR: kvc::require_rollback<N>: a layer kind of this cache cannot always roll back N tokens exactly
// A speculative decoder asks for a rollback depth its cache type cannot guarantee: a
// DynamicSlidingWindowLayer's slack is a run-time value, SpeculativeSlidingWindowLayer<R>'s is in
// its type. docs/rollback.md, docs/errors.md.
#include <kvc/cache.hpp>

int main() {
  kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::SpeculativeSlidingWindowLayer<4>>> typed(
      kvc::DynamicLayer{}, kvc::SpeculativeSlidingWindowLayer<4>{{.sliding_window = 16}});
  kvc::require_rollback<4>(typed);

  kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer>> mixed(
      kvc::DynamicLayer{}, kvc::DynamicSlidingWindowLayer{.sliding_window = 16, .rollback_slack = 4});
#ifdef KVC_SHOULD_FAIL
  kvc::require_rollback<4>(mixed);
#else
  kvc::require_rollback<0>(mixed);
#endif
  return mixed.rollback_depth() == kvc::unbounded_rollback && typed.rollback_depth() == kvc::unbounded_rollback ? 0 : 1;
}
