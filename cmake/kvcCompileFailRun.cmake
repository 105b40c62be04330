# kvcCompileFailRun.cmake -- compiles one compile-fail case (cmake/kvcCompileFail.cmake):
#   cmake -DBUILD_DIR=<dir> -DTARGET=<target> [-DEXPECT_SUCCESS=ON] -P kvcCompileFailRun.cmake
# Runs the compiler on the case's source with exactly the command the build would use: the entry
# of <dir>/compile_commands.json whose output is an object of <target>. Calling the compiler
# directly, rather than `cmake --build` on the build tree, lets the cases run in parallel (two
# build tool instances must not share one tree).
# Prints the compiler's output. With EXPECT_SUCCESS the case fails on a non-zero exit; otherwise it
# passes if the output holds the expected message (the test's PASS_REGULAR_EXPRESSION), and if the
# output holds more than one `error:` (g++ and clang++ start every error with it, `fatal error:`
# included) this prints "kvc-compile-fail: <n> errors, one expected", which fails the case.
# Counted here rather than by a ctest regex, which backtracks for minutes over a long output.
cmake_minimum_required(VERSION 3.21)
set(db "${BUILD_DIR}/compile_commands.json")
if(NOT EXISTS "${db}")
  message(FATAL_ERROR "kvc-compile-fail: ${db} is missing (the compile_fail targets export their commands)")
endif()
file(READ "${db}" text)
# Find the entry whose object lies in <target>'s folder (CMakeFiles/<target>.dir/).
string(FIND "${text}" "/${TARGET}.dir/" at)
if(at LESS 0)
  message(FATAL_ERROR "kvc-compile-fail: no compile command for ${TARGET} in ${db}")
endif()
string(SUBSTRING "${text}" 0 ${at} head)
string(FIND "${head}" "{" begin REVERSE)
string(SUBSTRING "${text}" ${begin} -1 tail)
string(FIND "${tail}" "}" length)
math(EXPR length "${length} + 1")
string(SUBSTRING "${tail}" 0 ${length} entry)
string(JSON dir GET "${entry}" directory)
string(JSON command GET "${entry}" command)
separate_arguments(args UNIX_COMMAND "${command}")
# The object's folder (the `-o` argument; not every generator writes an "output" field) exists
# only once the build tool has made it.
list(FIND args "-o" o)
if(o GREATER_EQUAL 0)
  math(EXPR o "${o} + 1")
  list(GET args ${o} output)
  if(NOT IS_ABSOLUTE "${output}")
    set(output "${dir}/${output}")
  endif()
  get_filename_component(output_dir "${output}" DIRECTORY)
  file(MAKE_DIRECTORY "${output_dir}")
endif()
# A case that must compile is checked by the front end alone (-fsyntax-only, with g++ and clang++:
# templates are still instantiated, every static_assert evaluated), which saves the optimizer's
# third of the time; the build's own targets check code generation.
list(GET args 0 compiler)
if(EXPECT_SUCCESS AND compiler MATCHES "(^|/)(g|clang|c)\\+\\+(-[0-9.]+)?$")
  list(APPEND args -fsyntax-only)
endif()
execute_process(COMMAND ${args} WORKING_DIRECTORY "${dir}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")
if(EXPECT_SUCCESS)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "kvc-compile-fail: ${TARGET} does not compile (exit ${rc})")
  endif()
  return()
endif()
string(REGEX MATCHALL "error:" errors "${out}")
list(LENGTH errors n)
if(n GREATER 1)
  message("kvc-compile-fail: ${n} errors, one expected")
endif()
