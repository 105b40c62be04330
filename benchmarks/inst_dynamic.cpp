// Explicit instantiation: Cache<Replicate<DynamicLayer>, HostStorage<float>, NoOffload> (DynamicCache<float>).
#include "instantiations.hpp"

KVC_BENCH_INSTANTIATE(, KVC_BENCH_DYNAMIC)
template class kvc::DynamicCache<float>;
