// Explicit instantiation: Cache<StaticCacheLayers, HostStorage<float>, NoOffload>
// (StaticCache<float>).
#include "instantiations.hpp"

KVC_BENCH_INSTANTIATE(, float, KVC_BENCH_STATIC(float))
template class kvc::StaticCache<float>;
