// Explicit instantiation: Cache<Layers<DynamicLayer, DynamicSlidingWindowLayer>, HostStorage<float>, NoOffload>
// (what make_dynamic_cache<float> returns).
#include "instantiations.hpp"

KVC_BENCH_INSTANTIATE(, KVC_BENCH_CONFIGURED)
