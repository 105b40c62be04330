# package.pkgconfig: install the current kvc build tree into a scratch prefix, then build and run
# tests/package/pkgconfig_consumer/main.cpp with the compiler and pkg-config alone (no CMake
# package), as a Makefile or a build system without CMake support would.
# Run with cmake -P: -DKVC_BINARY_DIR, -DKVC_PREFIX, -DCONSUMER (main.cpp), -DWORK (a scratch
# folder), -DCXX, -DCONFIG, -DVERSION (the project version kvc.pc must report).
foreach(v KVC_BINARY_DIR KVC_PREFIX CONSUMER WORK CXX CONFIG VERSION)
  if(NOT DEFINED ${v})
    message(FATAL_ERROR "pkgconfig_test.cmake: -D${v}=... is required")
  endif()
endforeach()
find_program(PKG_CONFIG NAMES pkg-config pkgconf)
if(NOT PKG_CONFIG)
  message(FATAL_ERROR "package.pkgconfig: pkg-config not found (apt-get install pkg-config)")
endif()

file(REMOVE_RECURSE "${KVC_PREFIX}" "${WORK}")
file(MAKE_DIRECTORY "${WORK}")
execute_process(
  COMMAND "${CMAKE_COMMAND}" --install "${KVC_BINARY_DIR}" --prefix "${KVC_PREFIX}" --config "${CONFIG}"
  RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install of ${KVC_BINARY_DIR} failed (${rc})")
endif()

# pkg-config as a user runs it: the scratch prefix's folder first, the system's after it.
set(ENV{PKG_CONFIG_PATH} "${KVC_PREFIX}/share/pkgconfig")
function(pkg_config out)
  execute_process(COMMAND "${PKG_CONFIG}" ${ARGN} kvc RESULT_VARIABLE rc OUTPUT_VARIABLE text
                  ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "pkg-config ${ARGN} kvc failed (${rc}): ${err}")
  endif()
  set(${out} "${text}" PARENT_SCOPE)
endfunction()
pkg_config(version --modversion)
if(NOT version STREQUAL VERSION)
  message(FATAL_ERROR "kvc.pc reports version ${version}, the project is ${VERSION}")
endif()
pkg_config(cflags --cflags)
pkg_config(libs --libs)
# The include folder it gives is the scratch prefix's (a relocated install finds itself).
string(FIND "${cflags}" "-I${KVC_PREFIX}/share/pkgconfig/../../include" at)
if(at EQUAL -1)
  message(FATAL_ERROR "kvc.pc's --cflags (${cflags}) do not name ${KVC_PREFIX}'s include folder")
endif()
separate_arguments(cflags UNIX_COMMAND "${cflags}")
separate_arguments(libs UNIX_COMMAND "${libs}")

execute_process(
  COMMAND "${CXX}" -std=c++20 ${cflags} "${CONSUMER}" -o "${WORK}/consumer" ${libs}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "building the consumer with kvc.pc's flags failed (${rc})")
endif()
execute_process(COMMAND "${WORK}/consumer" "${VERSION}" RESULT_VARIABLE rc OUTPUT_VARIABLE out)
message(STATUS "${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the pkg-config consumer failed (${rc})")
endif()
message(STATUS "package.pkgconfig: OK")
