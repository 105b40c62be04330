# kvcCudaTarget.cmake -- the target kvc::cuda, written once for the build tree (kvcCuda.cmake)
# and for the installed package (kvcConfig.cmake, find_package(kvc COMPONENTS cuda)).
# The caller has enabled CUDA and found CUDAToolkit.
#
# kvc::cuda = kvc::kvc + CUDA::cudart, C++20 for CUDA sources, and the nvcc flags kvc's device
# headers need:
#   --expt-relaxed-constexpr  the views' accessors (std::array, constexpr) are called in kernels
#   -diag-suppress=20012      Eigen's defaulted __host__ __device__ members ("annotation is
#                             ignored"), not kvc's

# CMake < 3.26 does not know that nvcc >= 12 takes -std=c++20. A macro, so that the variables
# CMake itself sets for newer versions land in the caller's scope and cuda_std_20 /
# CUDA_STANDARD 20 work there.
macro(kvc_teach_cuda_std_20)
  if(NOT "cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES
     AND CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA" AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
    list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
  endif()
endmacro()

# kvc_set_cuda_usage(<target>): the usage requirements of kvc::cuda on an INTERFACE target.
function(kvc_set_cuda_usage target)
  target_link_libraries(${target} INTERFACE kvc::kvc CUDA::cudart)
  target_compile_features(${target} INTERFACE cuda_std_20)
  target_compile_options(${target} INTERFACE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -diag-suppress=20012>)
endfunction()
