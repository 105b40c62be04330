# package.cuda_component_without_cuda: configure ./CMakeLists.txt (find_package(kvc COMPONENTS cuda)
# in a project without CUDA) from scratch against the build-tree package, and pass only when
# configuring fails with kvcConfig.cmake's message. Run with cmake -P.
foreach(v SOURCE BINARY GENERATOR CXX KVC_DIR)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "run.cmake: -D${v}=... is required")
  endif()
endforeach()
file(REMOVE_RECURSE "${BINARY}")
execute_process(
  COMMAND "${CMAKE_COMMAND}" -S "${SOURCE}" -B "${BINARY}" -G "${GENERATOR}" "-DCMAKE_CXX_COMPILER=${CXX}"
          "-Dkvc_DIR=${KVC_DIR}" "-DCMAKE_PREFIX_PATH=${PREFIX_PATH}"
  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
string(REGEX REPLACE "[ \n]+" " " text "${out} ${err}") # CMake wraps long messages
set(want "kvc's 'cuda' component needs CUDA enabled first: project(... LANGUAGES CXX CUDA) or enable_language(CUDA) before find_package(kvc COMPONENTS cuda)")
string(FIND "${text}" "${want}" at)
if(rc EQUAL 0 OR at EQUAL -1)
  message(FATAL_ERROR "expected configuring to fail with\n  ${want}\ngot (exit ${rc}):\n${out}\n${err}")
endif()
message(STATUS "package.cuda_component_without_cuda: the expected message")
