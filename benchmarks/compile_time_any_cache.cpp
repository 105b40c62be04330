// Compile-time probe (benchmarks/compile_time.sh): a ready-made cache put in an AnyCache, from
// <kvc/kvc.hpp> alone. compile_time.sh times it header-only and with -DKVC_RUNTIME_LIBRARY, as
// linking kvc::runtime compiles it (AnyCache's model of the cache is then an extern template).
#include <kvc/kvc.hpp>

kvc::AnyCache kvc_compile_time_any_cache(const kvc::ModelConfig& model) {
  return kvc::AnyCache(kvc::make_dynamic_cache<float>(model));
}
