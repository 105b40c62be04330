#pragma once
// The cache configurations the benchmarks use. Each is explicitly instantiated once, in its own
// inst_*.cpp (STYLE.md section 6), and declared `extern` here for the bench_*.cpp files.
// `update` is a member template, which `template class` does not cover, so it is named too.
// kvc::scaled_dot_product_attention<T> (what kvc::attend calls) is instantiated once per element
// type, in inst_attention.cpp.
//
// Note: every Cache member is defined in the class body, hence inline, and an explicit
// instantiation declaration does not suppress the instantiation of inline functions
// ([temp.explicit]): the compiler still instantiates them in bench_*.cpp for inlining; what
// `extern` saves is emitting their out-of-line copies there. scaled_dot_product_attention is not
// inline, so the benchmarks call the one copy in inst_attention.cpp.

#include <cstdint>
#include <optional>

#include <kvc/kvc.hpp>

namespace kvc_bench {
using bf16 = Eigen::bfloat16;
using Input = kvc::HostTensor<float>;
using InputBf16 = kvc::HostTensor<bf16>;
using Storage = kvc::HostStorage<float>;
// DynamicCache<float>'s base.
using DynamicBase = kvc::Cache<kvc::Replicate<kvc::DynamicLayer>, Storage, kvc::NoOffload>;
// What make_dynamic_cache<float> returns (kvc::ConfiguredDynamicCache<float>).
using ConfiguredDynamic = kvc::Cache<kvc::ConfiguredDynamicLayers, Storage, kvc::NoOffload>;
// StaticCache<float>'s base.
using StaticBase = kvc::Cache<kvc::StaticCacheLayers, Storage, kvc::NoOffload>;
}  // namespace kvc_bench

// EXTERN is `extern` (declaration) or empty (definition); T the element type; the rest are
// Cache's template arguments (an explicit instantiation must spell the template-id, not an alias).
#define KVC_BENCH_INSTANTIATE(EXTERN, T, ...)                                                        \
  EXTERN template class kvc::Cache<__VA_ARGS__>;                                                     \
  EXTERN template kvc::Cache<__VA_ARGS__>::kv_type                                                   \
  kvc::Cache<__VA_ARGS__>::update<kvc::HostTensor<T>, kvc::HostTensor<T>>(const kvc::HostTensor<T>&, \
                                                                          const kvc::HostTensor<T>&, std::int64_t);

#define KVC_BENCH_ATTENTION(EXTERN, T)                                                                            \
  EXTERN template kvc::HostTensor<T> kvc::scaled_dot_product_attention<T>(                                        \
      const kvc::TensorView<T>&, const kvc::TensorView<T>&, const kvc::TensorView<T>&, const kvc::AttentionMask&, \
      std::optional<double>);

#define KVC_BENCH_DYNAMIC(T) kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<T>, kvc::NoOffload
#define KVC_BENCH_CONFIGURED(T) kvc::ConfiguredDynamicLayers, kvc::HostStorage<T>, kvc::NoOffload
#define KVC_BENCH_STATIC(T) kvc::StaticCacheLayers, kvc::HostStorage<T>, kvc::NoOffload

KVC_BENCH_INSTANTIATE(extern, float, KVC_BENCH_DYNAMIC(float))
KVC_BENCH_INSTANTIATE(extern, float, KVC_BENCH_CONFIGURED(float))
KVC_BENCH_INSTANTIATE(extern, float, KVC_BENCH_STATIC(float))
KVC_BENCH_INSTANTIATE(extern, kvc_bench::bf16, KVC_BENCH_DYNAMIC(kvc_bench::bf16))
KVC_BENCH_INSTANTIATE(extern, kvc_bench::bf16, KVC_BENCH_CONFIGURED(kvc_bench::bf16))
KVC_BENCH_INSTANTIATE(extern, kvc_bench::bf16, KVC_BENCH_STATIC(kvc_bench::bf16))
extern template class kvc::DynamicCache<float>;
extern template class kvc::StaticCache<float>;
extern template class kvc::DynamicCache<kvc_bench::bf16>;
extern template class kvc::StaticCache<kvc_bench::bf16>;
KVC_BENCH_ATTENTION(extern, float)
KVC_BENCH_ATTENTION(extern, kvc_bench::bf16)
