#pragma once
// The cache configurations the benchmarks use. Each is explicitly instantiated once, in its own
// inst_*.cpp (STYLE.md section 6), and declared `extern` here for bench_append.cpp.
// `update` is a member template, which `template class` does not cover, so it is named too.
//
// Note: every Cache member is defined in the class body, hence inline, and an explicit
// instantiation declaration does not suppress the instantiation of inline functions
// ([temp.explicit]): the compiler still instantiates them in bench_append.cpp for inlining; what
// `extern` saves is emitting their out-of-line copies there.

#include <cstdint>

#include <kvc/kvc.hpp>

namespace kvc_bench {
using Input = kvc::HostTensor<float>;
using Storage = kvc::HostStorage<float>;
// DynamicCache<float>'s base.
using DynamicBase = kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, Storage, kvc::NoOffload>;
// What make_dynamic_cache<float> returns (kvc::ConfiguredDynamicCache<float>).
using ConfiguredDynamic = kvc::Cache<kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer>, Storage, kvc::NoOffload>;
// StaticCache<float>'s base.
using StaticBase = kvc::Cache<kvc::Layers<kvc::StaticLayer, kvc::StaticSlidingWindowLayer>, Storage, kvc::NoOffload>;
}  // namespace kvc_bench

// EXTERN is `extern` (declaration) or empty (definition); the rest are Cache's template arguments
// (an explicit instantiation must spell the template-id, not an alias).
#define KVC_BENCH_INSTANTIATE(EXTERN, ...)                                                          \
  EXTERN template class kvc::Cache<__VA_ARGS__>;                                                    \
  EXTERN template kvc::Cache<__VA_ARGS__>::kv_type kvc::Cache<__VA_ARGS__>::update<kvc_bench::Input, \
                                                                                   kvc_bench::Input>( \
      const kvc_bench::Input&, const kvc_bench::Input&, std::int64_t);

#define KVC_BENCH_DYNAMIC kvc::Replicate<kvc::DynamicLayer>, kvc_bench::Storage, kvc::NoOffload
#define KVC_BENCH_CONFIGURED \
  kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer>, kvc_bench::Storage, kvc::NoOffload
#define KVC_BENCH_STATIC kvc::Layers<kvc::StaticLayer, kvc::StaticSlidingWindowLayer>, kvc_bench::Storage, kvc::NoOffload

KVC_BENCH_INSTANTIATE(extern, KVC_BENCH_DYNAMIC)
KVC_BENCH_INSTANTIATE(extern, KVC_BENCH_CONFIGURED)
KVC_BENCH_INSTANTIATE(extern, KVC_BENCH_STATIC)
extern template class kvc::DynamicCache<float>;
extern template class kvc::StaticCache<float>;
