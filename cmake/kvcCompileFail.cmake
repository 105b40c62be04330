# kvcCompileFail.cmake -- compile-fail tests (STYLE.md section 7).
#
# A compile-fail source starts with the line
#     // EXPECT-ERROR: <message>
# and puts the misuse under `#ifdef KVC_SHOULD_FAIL`. For such a file `x.cpp`,
# kvc_add_compile_fail_test(x x.cpp) creates
#   cf_x_ok, cf_x_ko      EXCLUDE_FROM_ALL executables; _ko has KVC_SHOULD_FAIL defined
#   compile_fail.x.ok     compiles cf_x_ok's source; passes iff the compiler succeeds
#   compile_fail.x.ko     compiles cf_x_ko's source; passes iff the output contains <message>
#                         (PASS_REGULAR_EXPRESSION, never WILL_FAIL; the exit code is ignored)
#                         and no second `error:` (kvcCompileFailRun.cmake counts them: one
#                         misuse, one error)
# Each test runs the compiler itself, with the target's entry in compile_commands.json (the
# targets set EXPORT_COMPILE_COMMANDS), so the cases need no build tool and run in parallel.
# They carry the label `compile_fail`. The source is added to CMAKE_CONFIGURE_DEPENDS, so editing
# the expectation re-runs cmake.
include_guard(GLOBAL)
include(${CMAKE_CURRENT_LIST_DIR}/kvcHelpers.cmake)
set(kvc_compile_fail_run "${CMAKE_CURRENT_LIST_DIR}/kvcCompileFailRun.cmake")

# kvc_read_expected_error(<out-var> <source>)
function(kvc_read_expected_error out src)
  file(READ "${src}" head LIMIT 4096)
  string(REGEX MATCH "^[^\n]*" first "${head}")
  string(REGEX REPLACE "\r$" "" first "${first}")
  if(NOT first MATCHES "^// EXPECT-ERROR: (.+)$")
    message(FATAL_ERROR
      "${src}: the first line must be `// EXPECT-ERROR: <message>` (got `${first}`)")
  endif()
  string(STRIP "${CMAKE_MATCH_1}" msg)
  if(msg STREQUAL "")
    message(FATAL_ERROR "${src}: empty EXPECT-ERROR message")
  endif()
  set(${out} "${msg}" PARENT_SCOPE)
endfunction()

# kvc_add_compile_fail_test(<name> <source> [EXPECT <message>] [RAW_REGEX])
#   EXPECT overrides the message read from the first line; RAW_REGEX uses it unescaped.
function(kvc_add_compile_fail_test name src)
  cmake_parse_arguments(PARSE_ARGV 2 arg "RAW_REGEX" "EXPECT" "")
  get_filename_component(src "${src}" ABSOLUTE)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${src}")
  if(DEFINED arg_EXPECT)
    set(expected "${arg_EXPECT}")
  else()
    kvc_read_expected_error(expected "${src}")
  endif()
  if(arg_RAW_REGEX)
    set(regex "${expected}")
  else()
    kvc_regex_escape(regex "${expected}")
  endif()

  foreach(k ok ko)
    set(tgt cf_${name}_${k})
    add_executable(${tgt} EXCLUDE_FROM_ALL "${src}")
    target_link_libraries(${tgt} PRIVATE kvc::kvc)
    kvc_target_warnings(${tgt})
    set_target_properties(${tgt} PROPERTIES EXPORT_COMPILE_COMMANDS ON)
    set(expect_success OFF)
    if(k STREQUAL "ok")
      set(expect_success ON)
    endif()
    add_test(NAME compile_fail.${name}.${k}
             COMMAND ${CMAKE_COMMAND} -DBUILD_DIR=${CMAKE_BINARY_DIR} -DTARGET=${tgt}
                     -DEXPECT_SUCCESS=${expect_success} -P "${kvc_compile_fail_run}")
    set_tests_properties(compile_fail.${name}.${k} PROPERTIES
      LABELS compile_fail
      TIMEOUT 300)
  endforeach()
  target_compile_definitions(cf_${name}_ko PRIVATE KVC_SHOULD_FAIL)
  # One misuse, one error: kvcCompileFailRun.cmake flags a second `error:` in the output.
  set_tests_properties(compile_fail.${name}.ko PROPERTIES
    PASS_REGULAR_EXPRESSION "${regex}"
    FAIL_REGULAR_EXPRESSION "kvc-compile-fail: [0-9]+ errors, one expected")
endfunction()
