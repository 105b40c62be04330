// Compile-time probe, the floor (benchmarks/compile_time.sh): only the Eigen headers kvc's public
// headers include. Nothing kvc adds can make a TU that includes <kvc/kvc.hpp> compile faster.
#include <Eigen/Core>
#include <unsupported/Eigen/CXX11/Tensor>

// Something to compile, so that the object file is not empty.
float kvc_compile_time_floor(const Eigen::Tensor<float, 4, Eigen::RowMajor>& t) { return t.data()[0]; }
