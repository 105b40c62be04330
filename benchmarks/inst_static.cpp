// Explicit instantiation: Cache<Layers<StaticLayer, StaticSlidingWindowLayer>, HostStorage<float>, NoOffload>
// (StaticCache<float>).
#include "instantiations.hpp"

KVC_BENCH_STATIC_MEMBERS(, kvc_bench::StaticBase)
template class kvc::StaticCache<float>;
