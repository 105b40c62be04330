#pragma once
// The host umbrella header: everything kvc offers without CUDA (cache_description.hpp, which
// instantiates every layer kind for every element type, is included on demand).

#include <kvc/cache.hpp>
#include <kvc/any_cache.hpp>
#include <kvc/attention.hpp>
#include <kvc/caches.hpp>
#include <kvc/config.hpp>
#include <kvc/encoder_decoder_cache.hpp>
#include <kvc/errors.hpp>
#include <kvc/export.hpp>
#include <kvc/generation.hpp>
#include <kvc/limits.hpp>
#include <kvc/make_cache.hpp>
#include <kvc/policies/offload/host.hpp>
#include <kvc/quantized_cache.hpp>
#include <kvc/speculative_caches.hpp>
#include <kvc/tensor.hpp>
#include <kvc/warnings.hpp>
