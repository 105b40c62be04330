# package.install: install the current kvc build tree into a scratch prefix, then build and run
# tests/package/install_consumer against it with find_package(kvc 0.1 REQUIRED).
# Run with cmake -P; see tests/CMakeLists.txt for the -D variables. Optional: CUDA_COMPILER
# (and CUDA_HOST_COMPILER) to build the consumer's cuda part too; RUNTIME_BUILD=ON to build and run
# its kvc::runtime part (else that part is only configured and checked).
foreach(v KVC_BINARY_DIR KVC_PREFIX CONSUMER_SOURCE CONSUMER_BINARY GENERATOR CXX CONFIG)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "install_test.cmake: -D${v}=... is required")
  endif()
endforeach()

# Start from scratch, so a stale prefix or consumer cache cannot hide a broken install.
file(REMOVE_RECURSE "${KVC_PREFIX}" "${CONSUMER_BINARY}")

execute_process(
  COMMAND "${CMAKE_COMMAND}" --install "${KVC_BINARY_DIR}" --prefix "${KVC_PREFIX}" --config "${CONFIG}"
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install of ${KVC_BINARY_DIR} failed (${rc})")
endif()
if(NOT EXISTS "${KVC_PREFIX}/include/kvc/kvc.hpp")
  message(FATAL_ERROR "install: ${KVC_PREFIX}/include/kvc/kvc.hpp missing")
endif()

# With a CUDA compiler (kvc built with CUDA), the consumer also builds against the cuda component.
set(cuda_options)
if(CUDA_COMPILER)
  list(APPEND cuda_options "-DKVC_CONSUMER_CUDA=ON" "-DCMAKE_CUDA_COMPILER=${CUDA_COMPILER}")
  if(CUDA_HOST_COMPILER)
    list(APPEND cuda_options "-DCMAKE_CUDA_HOST_COMPILER=${CUDA_HOST_COMPILER}")
  endif()
endif()

execute_process(
  COMMAND "${CMAKE_CTEST_COMMAND}"
          --build-and-test "${CONSUMER_SOURCE}" "${CONSUMER_BINARY}"
          --build-generator "${GENERATOR}"
          --build-config "${CONFIG}"
          --build-options "-DCMAKE_CXX_COMPILER=${CXX}"
                          "-DCMAKE_BUILD_TYPE=${CONFIG}"
                          "-DCMAKE_PREFIX_PATH=${KVC_PREFIX}"
                          "-DKVC_EXPECTED_PREFIX=${KVC_PREFIX}"
                          "-DCMAKE_FIND_PACKAGE_NO_PACKAGE_REGISTRY=ON"
                          "-DKVC_CONSUMER_RUNTIME_BUILD=${RUNTIME_BUILD}"
                          ${cuda_options}
          --test-command "${CMAKE_CTEST_COMMAND}" --output-on-failure -C "${CONFIG}"
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "install consumer failed (${rc})")
endif()
message(STATUS "package.install: OK")
