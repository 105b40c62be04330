# kvcApiReference.cmake -- the API reference (Doxygen) and its check.
#   cmake -DROOT=<kvc source dir> -DOUT=<output dir> [-DDOXYGEN=doxygen] [-DCHECK=ON] -P cmake/kvcApiReference.cmake
#
# Generates HTML for the public names of kvc (namespace kvc and kvc::paged, kvc::concepts; not
# kvc::detail) from the headers under include/, policies/ and concepts/, into OUT/html. The
# headers document a declaration with the `//` comment directly above it
# (tools/doxygen-filter.sh hands those to Doxygen). With CHECK=ON it fails when Doxygen warns of
# a public name with no comment beyond the count below, or of anything else, and says by how much
# the count can come down when there are fewer.
if(NOT DEFINED ROOT OR NOT DEFINED OUT)
  message(FATAL_ERROR "usage: cmake -DROOT=<kvc source dir> -DOUT=<output dir> -P kvcApiReference.cmake")
endif()
if(NOT DEFINED DOXYGEN OR DOXYGEN STREQUAL "" OR DOXYGEN MATCHES "-NOTFOUND$")
  find_program(DOXYGEN doxygen)
  if(NOT DOXYGEN)
    message(FATAL_ERROR "api.reference: doxygen not found (Debian: apt-get install doxygen; tools/setup.sh does)")
  endif()
endif()
# Public names Doxygen finds without a comment. Only ever lowered: document the names, then set it
# to the count the check reports.
set(kvc_api_undocumented_limit 0)

file(STRINGS "${ROOT}/include/kvc/version.hpp" version_line REGEX "define KVC_VERSION_STRING")
string(REGEX MATCH "\"([^\"]+)\"" _ "${version_line}")
set(version "${CMAKE_MATCH_1}")
file(MAKE_DIRECTORY "${OUT}")
set(warnings "${OUT}/warnings.log")
# The main page and the namespaces: documented here, so that Doxygen also reports the namespaces'
# undocumented free functions, variables and aliases (it reports members of documented scopes only).
file(WRITE "${OUT}/namespaces.dox" "/**
\\mainpage kvc ${version}

KV caches for transformer inference as C++20 policies: kvc::Cache and the ready-made caches, the
attention over them, the paged cache and scheduler of continuous batching (kvc::PagedCache,
kvc::ContinuousBatchingScheduler), save/load and the run-time cache choice (kvc::AnyCache,
kvc::make_cache). The user guide is docs/README.md in the source tree.

\\namespace kvc
The library: caches, layer kinds, policies, attention, the paged cache and its scheduler.

\\namespace kvc::paged
The paged cache's parts: block manager, allocators, block tables, page and swap pools, memory planner.

\\namespace kvc::concepts
The requirements of kvc's policies and layer kinds, as C++20 concepts.
*/
")
file(WRITE "${OUT}/Doxyfile" "
PROJECT_NAME = kvc
PROJECT_NUMBER = ${version}
PROJECT_BRIEF = \"KV caches for transformer inference, as C++20 policies\"
OUTPUT_DIRECTORY = ${OUT}
INPUT = ${ROOT}/include ${ROOT}/policies ${ROOT}/concepts ${OUT}/namespaces.dox
FILE_PATTERNS = *.hpp *.cuh *.dox
RECURSIVE = YES
EXCLUDE_PATTERNS = */detail/*
EXCLUDE_SYMBOLS = detail kvc::detail kvc::detail::* *::detail::*
STRIP_FROM_PATH = ${ROOT}/include ${ROOT}/policies ${ROOT}/concepts
STRIP_FROM_INC_PATH = ${ROOT}/include ${ROOT}/policies ${ROOT}/concepts
INPUT_FILTER = \"${ROOT}/tools/doxygen-filter.sh\"
JAVADOC_AUTOBRIEF = YES
MARKDOWN_SUPPORT = YES
EXTRACT_ALL = NO
EXTRACT_PRIVATE = NO
EXTRACT_STATIC = YES
WARN_IF_UNDOCUMENTED = YES
WARN_IF_DOC_ERROR = YES
WARN_NO_PARAMDOC = NO
WARN_LOGFILE = ${warnings}
QUIET = YES
ENABLE_PREPROCESSING = YES
MACRO_EXPANSION = YES
PREDEFINED = KVC_HOST_DEVICE= __host__= __device__= __global__=
HAVE_DOT = NO
GENERATE_HTML = YES
GENERATE_LATEX = NO
SEARCHENGINE = NO
")
execute_process(COMMAND "${DOXYGEN}" "${OUT}/Doxyfile" RESULT_VARIABLE rc OUTPUT_QUIET ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "api.reference: doxygen failed (${rc}): ${err}")
endif()
message(STATUS "api.reference: ${OUT}/html/index.html")
if(NOT CHECK)
  return()
endif()

file(STRINGS "${warnings}" lines)
set(undocumented 0)
set(other "")
foreach(line IN LISTS lines)
  if(line MATCHES "is not documented\\.$")
    math(EXPR undocumented "${undocumented} + 1")
  elseif(line MATCHES "warning:|error:")
    string(APPEND other "${line}\n")
  endif()
endforeach()
if(NOT other STREQUAL "")
  message(FATAL_ERROR "api.reference: Doxygen warns of the comments themselves:\n${other}")
endif()
if(undocumented GREATER kvc_api_undocumented_limit)
  math(EXPR more "${undocumented} - ${kvc_api_undocumented_limit}")
  message(FATAL_ERROR "api.reference: ${more} more public name(s) without a comment than the "
                      "${kvc_api_undocumented_limit} allowed (${warnings} lists every one): document them")
endif()
if(undocumented LESS kvc_api_undocumented_limit)
  message(STATUS "api.reference: ${undocumented} public names without a comment: lower "
                 "kvc_api_undocumented_limit in cmake/kvcApiReference.cmake to ${undocumented}")
else()
  message(STATUS "api.reference: ${undocumented} public names without a comment (the limit)")
endif()
