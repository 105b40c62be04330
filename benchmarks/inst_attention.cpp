// Explicit instantiation: kvc::scaled_dot_product_attention<T> for float and Eigen::bfloat16 (what
// kvc::attend calls after the cache's update).
#include "instantiations.hpp"

KVC_BENCH_ATTENTION(, float)
KVC_BENCH_ATTENTION(, kvc_bench::bf16)
