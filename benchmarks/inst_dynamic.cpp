// Explicit instantiation: Cache<Replicate<DynamicLayer>, HostStorage<float>, NoOffload> (DynamicCache<float>).
#include "instantiations.hpp"

KVC_BENCH_DYNAMIC_MEMBERS(, kvc_bench::DynamicBase)
template class kvc::DynamicCache<float>;
