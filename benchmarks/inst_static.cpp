// Explicit instantiation: Cache<Layers<StaticLayer, StaticSlidingWindowLayer>, HostStorage<float>, NoOffload>
// (StaticCache<float>).
#include "instantiations.hpp"

KVC_BENCH_INSTANTIATE(, KVC_BENCH_STATIC)
template class kvc::StaticCache<float>;
