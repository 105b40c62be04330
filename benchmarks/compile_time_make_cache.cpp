// Compile-time probe (benchmarks/compile_time.sh): a research program's use of the string/JSON
// runtime, one call to make_cache<float>. compile_time.sh times it header-only and with
// -DKVC_RUNTIME_LIBRARY, as linking kvc::runtime compiles it (the runtime's instantiations are then
// extern templates, compiled once in that library).
#include <kvc/runtime.hpp>

kvc::AnyCache kvc_compile_time_make_cache(const kvc::GenerationConfig& generation, const kvc::ModelConfig& model) {
  return kvc::make_cache<float>(generation, model);
}
