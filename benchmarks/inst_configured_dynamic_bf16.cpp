// Explicit instantiation: Cache<ConfiguredDynamicLayers, HostStorage<Eigen::bfloat16>,
// NoOffload> (what make_dynamic_cache<Eigen::bfloat16> returns).
#include "instantiations.hpp"

KVC_BENCH_INSTANTIATE(, kvc_bench::bf16, KVC_BENCH_CONFIGURED(kvc_bench::bf16))
