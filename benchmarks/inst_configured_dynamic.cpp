// Explicit instantiation: Cache<ConfiguredDynamicLayers, HostStorage<float>, NoOffload>
// (what make_dynamic_cache<float> returns).
#include "instantiations.hpp"

KVC_BENCH_INSTANTIATE(, float, KVC_BENCH_CONFIGURED(float))
