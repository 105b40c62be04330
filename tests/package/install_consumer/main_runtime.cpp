// Package smoke test of the runtime component: find_package(kvc COMPONENTS runtime) and
// kvc::runtime. make_cache<float> is an extern template here (KVC_RUNTIME_LIBRARY comes with the
// target), so this links the library's instantiation.
#include <kvc/runtime.hpp>

#ifndef KVC_RUNTIME_LIBRARY
#error "linking kvc::runtime defines KVC_RUNTIME_LIBRARY"
#endif

int main() {
  const kvc::ModelConfig model =
      kvc::ModelConfig::from_json(R"({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8})");
  kvc::GenerationConfig generation;
  generation.cache_implementation = "static";
  generation.max_length = 9;
  const kvc::AnyCache cache = kvc::make_cache<float>(generation, model);
  return cache.get<kvc::StaticCache<float>>() != nullptr && cache.get_max_length(0) == 8 ? 0 : 1;
}
