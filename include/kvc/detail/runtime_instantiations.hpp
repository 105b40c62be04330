#pragma once
// The string/JSON runtime's share of the kvc::runtime library (cmake/kvcRuntimeTarget.cmake), per
// element type: make_cache, make_encoder_decoder_cache, prepare_cache_for_generation and its
// encoder-decoder twin, and described_cache (cache_from_description's builder, which instantiates
// the caches it describes in the library). The ready-made caches' share is
// detail/runtime_caches.hpp.
//
// KVC_RUNTIME_INSTANTIATIONS(extern, T) declares them (active when KVC_RUNTIME_LIBRARY is
// defined, which linking kvc::runtime does): a translation unit then compiles none of their bodies
// and links the library's. KVC_RUNTIME_INSTANTIATIONS(, T) defines them (src/runtime.cpp).

#include <optional>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

#include <kvc/any_cache.hpp>
#include <kvc/detail/runtime_caches.hpp>
#include <kvc/make_cache.hpp>

namespace kvc::detail {
// Defined in <kvc/cache_description.hpp>.
template <class T>
AnyCache described_cache(const nlohmann::json& doc);
}  // namespace kvc::detail

#define KVC_RUNTIME_INSTANTIATIONS(EXTERN, T)                                                                       \
  EXTERN template kvc::AnyCache kvc::make_cache<T>(const kvc::GenerationConfig&, const kvc::ModelConfig&,           \
                                                   const kvc::CacheRequest&);                                       \
  EXTERN template kvc::AnyCache kvc::make_cache<T>(const kvc::GenerationConfig&, const kvc::ModelConfig&,           \
                                                   const kvc::CacheRequest&, const kvc::ContinuousBatchingConfig&); \
  EXTERN template class kvc::detail::any_cache_model<kvc::PagedBatchCache<kvc::HostStorage<T>>>;                    \
  EXTERN template kvc::AnyEncoderDecoderCache kvc::make_encoder_decoder_cache<T>(                                   \
      const kvc::GenerationConfig&, const kvc::ModelConfig&, const kvc::CacheRequest&);                             \
  EXTERN template std::optional<kvc::AnyCache> kvc::prepare_cache_for_generation<T>(                                \
      const kvc::GenerationConfig&, const kvc::ModelConfig&, std::string_view, kvc::AnyCache,                       \
      const kvc::CacheRequest&);                                                                                    \
  EXTERN template std::optional<kvc::AnyEncoderDecoderCache> kvc::prepare_encoder_decoder_cache_for_generation<T>(  \
      const kvc::GenerationConfig&, const kvc::ModelConfig&, std::string_view, kvc::AnyEncoderDecoderCache,         \
      const kvc::CacheRequest&);                                                                                    \
  EXTERN template kvc::AnyCache kvc::detail::described_cache<T>(const nlohmann::json&);

#if defined(KVC_RUNTIME_LIBRARY)
#define KVC_RUNTIME_EXTERN_ONE(T, NAME, TORCH) KVC_RUNTIME_INSTANTIATIONS(extern, T)
KVC_ELEMENT_TYPES(KVC_RUNTIME_EXTERN_ONE)
#undef KVC_RUNTIME_EXTERN_ONE
#endif
