# kvcCuda.cmake -- optional CUDA support (docs/cuda.md). Included once from the root CMakeLists.
#
# KVC_ENABLE_CUDA = AUTO | ON | OFF. When kvc is the top-level project it defaults to AUTO: if a
# CUDA compiler is found (check_language: nvcc on PATH, $CUDACXX, or -DCMAKE_CUDA_COMPILER), kvc
# builds its CUDA tests (tests/cuda) and benchmarks (benchmarks/cuda) with nvcc for sm_90 plus
# PTX (CMAKE_CUDA_ARCHITECTURES "90-real;90-virtual"). ON makes a missing compiler a configure
# error. Without a compiler under AUTO, or with OFF, nothing here changes the host-only build.
#
# Sets KVC_CUDA_ENABLED, and when it is ON, the target kvc::cuda (kvcCudaTarget.cmake: kvc::kvc +
# CUDA::cudart, C++20 and the nvcc flags kvc's device headers need) and
# kvc_cuda_target_warnings(<target>). Installed packages define kvc::cuda too, on request
# (find_package(kvc COMPONENTS cuda), kvcConfig.cmake.in), whether or not this build used CUDA.
include_guard(GLOBAL)

include(CheckLanguage)
# KVC_ENABLE_CUDA: AUTO builds the CUDA tests and benchmarks when a CUDA compiler is found, ON
# requires one (a configure error without), OFF never looks. Only kvc's own CUDA tests and
# benchmarks need nvcc, so a project that adds kvc with add_subdirectory gets OFF unless it asks.
if(PROJECT_IS_TOP_LEVEL AND (KVC_BUILD_TESTS OR KVC_BUILD_BENCHMARKS))
  set(kvc_cuda_default AUTO)
else()
  set(kvc_cuda_default OFF)
endif()
set(KVC_ENABLE_CUDA ${kvc_cuda_default} CACHE STRING
    "Build kvc's CUDA tests and benchmarks with nvcc: AUTO (when nvcc is found), ON (nvcc required), OFF")
set_property(CACHE KVC_ENABLE_CUDA PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${KVC_ENABLE_CUDA}" kvc_cuda_mode)
if(kvc_cuda_mode STREQUAL "AUTO")
elseif(kvc_cuda_mode MATCHES "^(ON|YES|Y|TRUE|1)$")
  set(kvc_cuda_mode ON)
elseif(kvc_cuda_mode MATCHES "^(OFF|NO|N|FALSE|0)$")
  set(kvc_cuda_mode OFF)
else()
  message(FATAL_ERROR "kvc: KVC_ENABLE_CUDA must be AUTO, ON or OFF, got '${KVC_ENABLE_CUDA}'")
endif()
if(NOT kvc_cuda_mode STREQUAL "OFF") # OFF skips the compiler probe
  check_language(CUDA)
endif()
if(kvc_cuda_mode STREQUAL "ON" AND NOT CMAKE_CUDA_COMPILER)
  message(FATAL_ERROR "kvc: KVC_ENABLE_CUDA is ON but no CUDA compiler was found. Pass "
                      "-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc, or -DKVC_ENABLE_CUDA=AUTO to build "
                      "without CUDA where there is none.")
endif()

set(KVC_CUDA_ENABLED OFF)
if(NOT kvc_cuda_mode STREQUAL "OFF" AND CMAKE_CUDA_COMPILER)
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
