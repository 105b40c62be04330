# kvcCuda.cmake -- optional CUDA support (docs/cuda.md). Included once from the root CMakeLists.
#
# When kvc is the top-level project and a CUDA compiler is found (check_language: nvcc on PATH,
# $CUDACXX, or -DCMAKE_CUDA_COMPILER), KVC_ENABLE_CUDA defaults to ON and kvc builds its CUDA
# tests (tests/cuda) and benchmarks (benchmarks/cuda) with nvcc for sm_90 plus PTX
# (CMAKE_CUDA_ARCHITECTURES "90-real;90-virtual").
# Without one, or with -DKVC_ENABLE_CUDA=OFF, nothing here changes the host-only build.
#
# Sets KVC_CUDA_ENABLED, and when it is ON, the target kvc::cuda (kvcCudaTarget.cmake: kvc::kvc +
# CUDA::cudart, C++20 and the nvcc flags kvc's device headers need) and
# kvc_cuda_target_warnings(<target>). Installed packages define kvc::cuda too, on request
# (find_package(kvc COMPONENTS cuda), kvcConfig.cmake.in), whether or not this build used CUDA.
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

  include(kvcCudaTarget)
  kvc_teach_cuda_std_20()
  add_library(kvc_cuda INTERFACE)
  add_library(kvc::cuda ALIAS kvc_cuda)
  kvc_set_cuda_usage(kvc_cuda)
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
