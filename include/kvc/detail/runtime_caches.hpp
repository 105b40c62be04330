#pragma once
// The ready-made caches' share of the kvc::runtime library (cmake/kvcRuntimeTarget.cmake):
// make_dynamic_cache and AnyCache's model of every cache make_cache builds, for each element type
// of KVC_ELEMENT_TYPES (<kvc/element_types.hpp>). <kvc/kvc.hpp> includes this, so that a program which links kvc::runtime and
// puts a ready-made cache in an AnyCache compiles none of the model's virtual functions itself.
// The string/JSON runtime's share is detail/runtime_instantiations.hpp.
//
// KVC_RUNTIME_CACHE_INSTANTIATIONS(extern, T) declares them (active when KVC_RUNTIME_LIBRARY is
// defined, which linking kvc::runtime does); KVC_RUNTIME_CACHE_INSTANTIATIONS(, T) defines them
// (src/runtime.cpp). Without KVC_RUNTIME_LIBRARY every header stays header-only.

#include <kvc/any_cache.hpp>
#include <kvc/caches.hpp>
#include <kvc/element_types.hpp>
#include <kvc/policies/offload/file.hpp>
#include <kvc/quantized_cache.hpp>

#define KVC_RUNTIME_MODEL(EXTERN, ...) EXTERN template class kvc::detail::any_cache_model<__VA_ARGS__>;

#define KVC_RUNTIME_CACHE_INSTANTIATIONS(EXTERN, T)                                                         \
  EXTERN template kvc::ConfiguredDynamicCache<T> kvc::make_dynamic_cache<T>(const kvc::ModelConfig&);       \
  KVC_RUNTIME_MODEL(EXTERN, kvc::DynamicCache<T>)                                                           \
  KVC_RUNTIME_MODEL(EXTERN, kvc::ConfiguredDynamicCache<T>)                                                 \
  KVC_RUNTIME_MODEL(EXTERN, kvc::ConfiguredDynamicCache<T, kvc::HostStorage<T>, kvc::OffloadToFile<false>>) \
  KVC_RUNTIME_MODEL(EXTERN, kvc::StaticCache<T>)                                                            \
  KVC_RUNTIME_MODEL(EXTERN, kvc::StaticCache<T, kvc::HostStorage<T>, kvc::OffloadToFile<true>>)             \
  KVC_RUNTIME_MODEL(EXTERN, kvc::QuantizedCache<T>)                                                         \
  KVC_RUNTIME_MODEL(EXTERN, kvc::PerLayerQuantizedCache<T>)

#if defined(KVC_RUNTIME_LIBRARY)
#define KVC_RUNTIME_EXTERN_CACHES(T, NAME, TORCH) KVC_RUNTIME_CACHE_INSTANTIATIONS(extern, T)
KVC_ELEMENT_TYPES(KVC_RUNTIME_EXTERN_CACHES)
#undef KVC_RUNTIME_EXTERN_CACHES
#endif
