#pragma once
// The cache configurations the benchmarks use. Each is explicitly instantiated once, in its own
// inst_*.cpp (STYLE.md section 6), and declared `extern` here for bench_append.cpp.
//
// `template class kvc::Cache<...>;` does not compile for any of them: an explicit instantiation
// definition instantiates every non-template member, and each configuration has members whose
// body is a static_assert for that configuration (set_write_position on dynamic caches; crop,
// batch_repeat_interleave and batch_select_indices on static caches). So we instantiate the
// members the benchmarks call, one by one. `update` is a member template, which `template class`
// would not have covered anyway.
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

// The members the benchmarks call. EXTERN is `extern` (declaration) or empty (definition).
#define KVC_BENCH_COMMON_MEMBERS(EXTERN, C)                                                                   \
  EXTERN template C::kv_type C::update<kvc_bench::Input, kvc_bench::Input>(                                 \
      const kvc_bench::Input&, const kvc_bench::Input&, std::int64_t);                                      \
  EXTERN template std::int64_t C::get_seq_length(std::int64_t) const;                                       \
  EXTERN template std::int64_t C::bytes() const noexcept;                                                   \
  EXTERN template void C::reset() noexcept;                                                                 \
  EXTERN template void C::early_initialization(std::int64_t, kvc::detail::int_or_list, kvc::detail::int_or_list);
#define KVC_BENCH_DYNAMIC_MEMBERS(EXTERN, C) \
  KVC_BENCH_COMMON_MEMBERS(EXTERN, C)        \
  EXTERN template void C::crop(std::int64_t);
#define KVC_BENCH_STATIC_MEMBERS(EXTERN, C) \
  KVC_BENCH_COMMON_MEMBERS(EXTERN, C)       \
  EXTERN template void C::set_write_position(std::int64_t);

KVC_BENCH_DYNAMIC_MEMBERS(extern, kvc_bench::DynamicBase)
KVC_BENCH_DYNAMIC_MEMBERS(extern, kvc_bench::ConfiguredDynamic)
KVC_BENCH_STATIC_MEMBERS(extern, kvc_bench::StaticBase)

// The derived ready-made caches have only constructors: whole-class instantiation works for them.
extern template class kvc::DynamicCache<float>;
extern template class kvc::StaticCache<float>;
