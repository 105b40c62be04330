# kvcCuda.cmake -- optional CUDA support (docs/cuda.md). Included once from the root CMakeLists.
#
# When kvc is the top-level project and a CUDA compiler is found (check_language: nvcc on PATH,
# $CUDACXX, or -DCMAKE_CUDA_COMPILER), KVC_ENABLE_CUDA defaults to ON and kvc builds its CUDA
# tests (tests/cuda) and benchmarks (benchmarks/cuda) with nvcc for sm_90 plus PTX
# (CMAKE_CUDA_ARCHITECTURES "90-real;90-virtual").
# Without one, or with -DKVC_ENABLE_CUDA=OFF, nothing here changes the host-only build.
#
# Sets KVC_CUDA_ENABLED, and when it is ON, the build-tree target kvc::cuda (kvc::kvc + CUDA::cudart,
# C++20 and the nvcc flags kvc's device headers need) and kvc_cuda_target_warnings(<target>).
include_guard(GLOBAL)

include(CheckLanguage)
# Only kvc's own CUDA tests and benchmarks need nvcc, so a project that adds kvc with
# add_subdirectory is never switched to CUDA unless it asks (-DKVC_ENABLE_CUDA=ON).
if(DEFINED KVC_ENABLE_CUDA)
  set(kvc_cuda_wanted ${KVC_ENABLE_CUDA})
elseif(PROJECT_IS_TOP_LEVEL AND (KVC_BUILD_TESTS OR KVC_BUILD_BENCHMARKS))
  set(kvc_cuda_wanted ON)
else()
  set(kvc_cuda_wanted OFF)
endif()
if(kvc_cuda_wanted) # an explicit OFF skips the compiler probe
  check_language(CUDA)
endif()
if(kvc_cuda_wanted AND CMAKE_CUDA_COMPILER)
  set(kvc_cuda_default ON)
else()
  set(kvc_cuda_default OFF)
endif()
option(KVC_ENABLE_CUDA "Build kvc's CUDA tests and benchmarks with nvcc (ON when nvcc is found)" ${kvc_cuda_default})

set(KVC_CUDA_ENABLED OFF)
if(KVC_ENABLE_CUDA AND NOT CMAKE_CUDA_COMPILER)
  message(WARNING "kvc: KVC_ENABLE_CUDA is ON but no CUDA compiler was found; building without CUDA. "
                  "Pass -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc.")
elseif(KVC_ENABLE_CUDA)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
    set(CMAKE_CUDA_ARCHITECTURES "90-real;90-virtual") # H200 (sm_90) + PTX for newer GPUs
  endif()
  if(NOT DEFINED CMAKE_CUDA_HOST_COMPILER AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
    set(CMAKE_CUDA_HOST_COMPILER "${CMAKE_CXX_COMPILER}")
  endif()
  enable_language(CUDA)
  find_package(CUDAToolkit REQUIRED)

  # CMake < 3.26 does not know that nvcc >= 12 takes -std=c++20: teach it (the variables CMake
  # itself sets for newer versions), so that cuda_std_20 and CUDA_STANDARD 20 work.
  if(NOT "cuda_std_20" IN_LIST CMAKE_CUDA_COMPILE_FEATURES
     AND CMAKE_CUDA_COMPILER_ID STREQUAL "NVIDIA" AND CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
    list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
  endif()

  add_library(kvc_cuda INTERFACE)
  add_library(kvc::cuda ALIAS kvc_cuda)
  target_link_libraries(kvc_cuda INTERFACE kvc::kvc CUDA::cudart)
  target_compile_features(kvc_cuda INTERFACE cuda_std_20)
  # --expt-relaxed-constexpr: the views' accessors (std::array, constexpr) are called in kernels.
  # 20012: Eigen's defaulted __host__ __device__ members ("annotation is ignored"), not kvc's.
  target_compile_options(kvc_cuda INTERFACE
    $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -diag-suppress=20012>)
  set(KVC_CUDA_ENABLED ON)
  message(STATUS "kvc: CUDA enabled (${CMAKE_CUDA_COMPILER_ID} ${CMAKE_CUDA_COMPILER_VERSION}, "
                 "architectures ${CMAKE_CUDA_ARCHITECTURES})")
endif()

# kvc_cuda_target_warnings(<target>)
#   kvc_target_warnings for a target with .cu sources: the host compiler's -Wall -Wextra -Werror
#   reach nvcc through -Xcompiler (nvcc's own -Werror takes an argument). nvcc's front-end
#   warnings stay warnings: Eigen's headers produce some that kvc cannot fix.
function(kvc_cuda_target_warnings target)
  if(NOT KVC_WARNINGS)
    return()
  endif()
  set(host_flags -Wall -Wextra -Werror)
  if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12
     AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 14)
    list(APPEND host_flags -Wno-restrict) # GCC bugs 105329/105651, as in kvc_target_warnings
  endif()
  string(REPLACE ";" "," host_csv "${host_flags}")
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:${host_flags}>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=${host_csv}>)
endfunction()
