#pragma once
// The string/JSON runtime on top of <kvc/kvc.hpp>: ModelConfig::from_json / from_file
// (config_json.hpp), GenerationConfig (generation.hpp), make_cache, make_encoder_decoder_cache and
// prepare_cache_for_generation (make_cache.hpp) and StaticCacheExport (export.hpp). It brings in
// nlohmann/json. cache_from_description (<kvc/cache_description.hpp>, which builds every layer
// kind for every element type) is included on demand.
//
// Header-only use works as it is. A program that links the CMake target kvc::runtime gets the
// runtime's instantiations for float, double, Eigen::half and Eigen::bfloat16 compiled once in
// that library (KVC_RUNTIME_LIBRARY makes them extern templates here), which takes most of the
// compile time off each translation unit that calls them (docs/benchmarks.md).

#include <kvc/kvc.hpp>
#include <kvc/config_json.hpp>
#include <kvc/export.hpp>
#include <kvc/generation.hpp>
#include <kvc/make_cache.hpp>
#include <kvc/detail/runtime_instantiations.hpp>
