# kvcHelpers.cmake -- small helpers shared by the root project and its subdirectories
# (tests/, examples/, benchmarks/). Included once from the root CMakeLists.txt.
include_guard(GLOBAL)

# kvc_target_warnings(<target>)
#   Turns on -Wall -Wextra -Werror for one of *our own* targets (tests, examples,
#   benchmarks), when KVC_WARNINGS is ON. Never applied to the kvc INTERFACE target,
#   so consumers never inherit our warning flags. Third-party headers (Eigen, Boost,
#   doctest, benchmark) arrive through imported targets and are therefore -isystem.
function(kvc_target_warnings target)
  if(NOT KVC_WARNINGS)
    return()
  endif()
  if(MSVC)
    target_compile_options(${target} PRIVATE /W4 /WX)
  else()
    target_compile_options(${target} PRIVATE -Wall -Wextra -Werror)
    # GCC 12 at -O2/-O3 reports a false -Wrestrict inside libstdc++ for
    # `"literal" + std::string&&` (GCC PR 105651, fixed in 12.3/13): silence that one.
    if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU"
       AND CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12
       AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 12.3)
      target_compile_options(${target} PRIVATE -Wno-restrict)
    endif()
  endif()
endfunction()

# kvc_target_sanitize(<target>)
#   Adds the sanitizer flags to one target when KVC_SANITIZE is ON. The root
#   CMakeLists already applies them directory-wide to tests/ and examples/, so
#   subdirectories only need this for targets created elsewhere.
function(kvc_target_sanitize target)
  if(NOT KVC_SANITIZE)
    return()
  endif()
  target_compile_options(${target} PRIVATE ${KVC_SANITIZE_FLAGS})
  target_link_options(${target} PRIVATE ${KVC_SANITIZE_FLAGS})
endfunction()

# kvc_regex_escape(<out-var> <string>)
#   Escapes every character that is special in a CMake / CTest regular expression
#   ( \ ^ $ . | ? * + ( ) [ ] ), so that <string> matches itself literally, e.g. in
#   PASS_REGULAR_EXPRESSION. A ';' would split a CMake list (and thus the property
#   into two alternatives), so it is replaced by '.', which matches any character.
function(kvc_regex_escape out str)
  string(REGEX REPLACE "([][\\\\^$.|?*+()])" "\\\\\\1" str "${str}")
  string(REPLACE ";" "." str "${str}")
  set(${out} "${str}" PARENT_SCOPE)
endfunction()
