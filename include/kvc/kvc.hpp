#pragma once
// The host umbrella header: every cache, layer kind, policy and the attention, without the
// string/JSON runtime. <kvc/runtime.hpp> adds that (ModelConfig::from_json / from_file,
// GenerationConfig, make_cache and prepare_cache_for_generation, StaticCacheExport,
// cache_from_description); <kvc/cuda.hpp> adds the CUDA storage and offload policies.

#include <kvc/cache.hpp>
#include <kvc/any_cache.hpp>
#include <kvc/attention.hpp>
#include <kvc/caches.hpp>
#include <kvc/config.hpp>
#include <kvc/encoder_decoder_cache.hpp>
#include <kvc/errors.hpp>
#include <kvc/limits.hpp>
#include <kvc/policies/offload/file.hpp>
#include <kvc/policies/offload/pinned_host.hpp>
#include <kvc/quantized_cache.hpp>
#include <kvc/speculative_caches.hpp>
#include <kvc/tensor.hpp>
#include <kvc/version.hpp>
#include <kvc/warnings.hpp>
#include <kvc/detail/runtime_caches.hpp>  // extern templates when kvc::runtime is linked
