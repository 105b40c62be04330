// Compile-time probe (benchmarks/compile_time.sh): the umbrella header and every ready-made cache
// (DynamicCache, make_dynamic_cache, StaticCache), each for float and Eigen::bfloat16 (the element
// types the benchmarks use; every further type adds about as much again), with the member template a
// decode loop calls (update of a HostTensor) and the attention over the cache's views. Its compile time, minus
// that of compile_time_floor.cpp (Eigen alone), is what kvc adds to a translation unit that uses
// all of it. Self-contained on purpose: it does not include instantiations.hpp.
#include <cstdint>
#include <optional>

#include <kvc/kvc.hpp>

#define KVC_PROBE_CACHE(T, ...)                                                                                      \
  template class kvc::Cache<__VA_ARGS__>;                                                                            \
  template kvc::Cache<__VA_ARGS__>::kv_type kvc::Cache<__VA_ARGS__>::update<kvc::HostTensor<T>, kvc::HostTensor<T>>( \
      const kvc::HostTensor<T>&, const kvc::HostTensor<T>&, std::int64_t);

#define KVC_PROBE_TYPE(T)                                                                                         \
  KVC_PROBE_CACHE(T, kvc::Replicate<kvc::DynamicLayer>, kvc::HostStorage<T>, kvc::NoOffload)                      \
  KVC_PROBE_CACHE(T, kvc::Layers<kvc::DynamicLayer, kvc::DynamicSlidingWindowLayer>, kvc::HostStorage<T>,         \
                  kvc::NoOffload)                                                                                 \
  KVC_PROBE_CACHE(T, kvc::Layers<kvc::StaticLayer, kvc::StaticSlidingWindowLayer>, kvc::HostStorage<T>,           \
                  kvc::NoOffload)                                                                                 \
  template class kvc::DynamicCache<T>;                                                                            \
  template class kvc::StaticCache<T>;                                                                             \
  template kvc::ConfiguredDynamicCache<T> kvc::make_dynamic_cache<T>(const kvc::ModelConfig&);                    \
  template kvc::HostTensor<T> kvc::scaled_dot_product_attention<T>(                                               \
      const kvc::TensorView<T>&, const kvc::TensorView<T>&, const kvc::TensorView<T>&, const kvc::AttentionMask&, \
      std::optional<double>);

KVC_PROBE_TYPE(float)
KVC_PROBE_TYPE(Eigen::bfloat16)
