// Compile-time probe (benchmarks/compile_time.sh): the umbrella header alone, nothing instantiated.
#include <kvc/kvc.hpp>

// Something to compile, so that the object file is not empty.
int kvc_compile_time_include(const kvc::ModelConfig& c) { return static_cast<int>(c.num_hidden_layers); }
