// Explicit instantiation: Cache<StaticCacheLayers, HostStorage<Eigen::bfloat16>,
// NoOffload> (StaticCache<Eigen::bfloat16>).
#include "instantiations.hpp"

KVC_BENCH_INSTANTIATE(, kvc_bench::bf16, KVC_BENCH_STATIC(kvc_bench::bf16))
template class kvc::StaticCache<kvc_bench::bf16>;
