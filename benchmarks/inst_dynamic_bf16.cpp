// Explicit instantiation: Cache<Replicate<DynamicLayer>, HostStorage<Eigen::bfloat16>, NoOffload>
// (DynamicCache<Eigen::bfloat16>).
#include "instantiations.hpp"

KVC_BENCH_INSTANTIATE(, kvc_bench::bf16, KVC_BENCH_DYNAMIC(kvc_bench::bf16))
template class kvc::DynamicCache<kvc_bench::bf16>;
