// Explicit instantiation: Cache<Replicate<DynamicLayer>, HostStorage<float>, NoOffload> (DynamicCache<float>).
#include "instantiations.hpp"

KVC_BENCH_INSTANTIATE(, float, KVC_BENCH_DYNAMIC(float))
template class kvc::DynamicCache<float>;
