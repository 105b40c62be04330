# kvcCompileFailRun.cmake -- builds one compile-fail case (cmake/kvcCompileFail.cmake):
#   cmake -DBUILD_DIR=<dir> -DTARGET=<target> -DCONFIG=<config> -P kvcCompileFailRun.cmake
# Prints the build's output (the case passes if it holds the expected message), then, if the
# output holds more than one `error:` (g++ and clang++ start every error with it, `fatal error:`
# included), the line "kvc-compile-fail: <n> errors, one expected", which fails the case.
# Counted here rather than by a ctest regex, which backtracks for minutes over a long output.
cmake_minimum_required(VERSION 3.21)
execute_process(COMMAND "${CMAKE_COMMAND}" --build "${BUILD_DIR}" --target "${TARGET}" --config "${CONFIG}"
                OUTPUT_VARIABLE out ERROR_VARIABLE out)
message("${out}")
string(REGEX MATCHALL "error:" errors "${out}")
list(LENGTH errors n)
if(n GREATER 1)
  message("kvc-compile-fail: ${n} errors, one expected")
endif()
