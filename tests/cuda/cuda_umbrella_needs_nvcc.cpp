// EXPECT-ERROR: kvc/cuda.hpp holds CUDA kernels: compile this file with nvcc as CUDA, or include kvc/kvc.hpp for host-only code
// The CUDA umbrella header included by a host compiler (a .cpp file). docs/cuda.md, "Build".
#ifdef KVC_SHOULD_FAIL
#include <kvc/cuda.hpp>
#else
#include <kvc/kvc.hpp>
#endif

int main() { return 0; }
