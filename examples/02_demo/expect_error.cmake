# cmake -DDEMO=<kvc_demo> -DARGS=<arg|arg|...> -P expect_error.cmake
# Runs the demo with ARGS ('|'-separated) and checks the error contract: exit code exactly 2,
# nothing on stdout, exactly one line on stderr starting "kvc_demo: error: ". Prints
# "expect_error: OK" on success, else FATAL_ERROR naming what differs.
cmake_minimum_required(VERSION 3.21)
string(REPLACE "|" ";" args "${ARGS}")
execute_process(COMMAND "${DEMO}" ${args}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(problems "")
if(NOT rc STREQUAL "2")
  string(APPEND problems "exit code '${rc}', expected 2. ")
endif()
if(NOT out STREQUAL "")
  string(APPEND problems "stdout not empty: '${out}'. ")
endif()
if(NOT err MATCHES "^kvc_demo: error: [^\n]+\n$")
  string(APPEND problems "stderr is not one 'kvc_demo: error: ...' line: '${err}'. ")
endif()
if(problems)
  message(FATAL_ERROR "expect_error: ${DEMO} ${args}: ${problems}")
endif()
string(STRIP "${err}" err)
message("expect_error: OK (${err})")
