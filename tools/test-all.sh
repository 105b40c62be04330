#!/usr/bin/env bash
# Full kvc check, as CI runs it (.ci/run):
#   format       tools/check-format.sh: every C++/CUDA source as .clang-format formats it
#   build/gcc    g++ Release at -O1: everything (tests, examples, benchmarks built: at -O0, since CI
#                runs no benchmark), full ctest; with
#                nvcc (on PATH or /usr/local/cuda/bin) also the CUDA tests and benchmark, whose
#                tests report themselves skipped where there is no GPU (there, the host half of
#                the .cu files is compiled at -O0: nvcc's -O sets the host compiler's level only,
#                so the device code is compiled as for a GPU run, and nothing runs it)
#   memcheck     valgrind over build/gcc's unit tests (tools/valgrind.supp)
#   build/asan   clang++ -O0 -gline-tables-only + ASan/UBSan: the compile_fail .ko cases, the unit
#                tests, and the fuzz target (-O1) from three seed sets (fuzz.json: the JSON readers;
#                fuzz.e2e: model files to caches and attention; fuzz.state: saved cache states through
#                kvc::load), KVC_FUZZ_SECONDS (default 30)
#                seconds each, side by side
# Each stage prints its elapsed time.
# Ends with "N passed, N failed" summed over the format check, the two ctest runs and the
# memcheck stage (skipped tests, such as the gpu tests without a GPU, are counted apart); a failed
# build counts as one failed test. Exits non-zero on any failure.
set -euo pipefail
cd "$(dirname "$0")/.."

bash tools/setup.sh
PWD_ROOT=$PWD

JOBS=${JOBS:-2}
total_pass=0
total_fail=0
total_skip=0
log_dir=build/logs
mkdir -p "$log_dir"

stage_start=$SECONDS
run_start=$SECONDS
# stage <title>: ends the previous stage (its elapsed time) and starts the next.
stage() {
  [[ -n ${stage_name:-} ]] && printf -- '-- %s: %d s\n' "$stage_name" $((SECONDS - stage_start))
  stage_name=$*
  stage_start=$SECONDS
  printf '\n==== %s ====\n' "$*"
}

# run_ctest <name> <ctest args...>: runs ctest, tees its output, adds to the totals.
run_ctest() {
  local name=$1; shift
  local log="$log_dir/ctest-$name.log" rc=0
  ctest "$@" 2>&1 | tee "$log" || rc=$?
  local line
  line=$(grep -E 'tests passed, [0-9]+ tests? failed out of [0-9]+' "$log" | tail -n1 || true)
  if [[ $line =~ ([0-9]+)\ tests?\ failed\ out\ of\ ([0-9]+) ]]; then
    local failed=${BASH_REMATCH[1]} total=${BASH_REMATCH[2]} skipped
    skipped=$(grep -c '\*\*\*Skipped' "$log" || true)
    total_pass=$((total_pass + total - failed - skipped))
    total_fail=$((total_fail + failed))
    total_skip=$((total_skip + skipped))
    echo "-- $name: $((total - failed - skipped)) passed, $skipped skipped, $failed failed"
  elif grep -q 'No tests were found' "$log"; then
    echo "-- $name: no tests found"
  else
    echo "-- $name: could not parse the ctest summary (rc=$rc); counting one failure"
    total_fail=$((total_fail + 1))
  fi
}

# build <dir> <cmake --build args...>: keep going past errors; a failed build = one failure.
build() {
  local dir=$1; shift
  local keep_going=(-k)
  [[ -f $dir/build.ninja ]] && keep_going=(-k 0)
  if ! cmake --build "$dir" -j "$JOBS" "$@" -- "${keep_going[@]}"; then
    echo "-- BUILD FAILED in $dir $*"
    total_fail=$((total_fail + 1))
  fi
}

configure() {
  local dir=$1; shift
  if ! cmake -S . -B "$dir" "$@"; then
    echo "-- CONFIGURE FAILED: $dir"
    total_fail=$((total_fail + 1))
    return 1
  fi
}

common=(-DKVC_BUILD_TESTS=ON -DKVC_WARNINGS=ON)

# CUDA (docs/cuda.md): the gcc stage compiles and links the CUDA code with nvcc when there is one;
# the asan stage leaves it out to save time.
cuda=(-DKVC_ENABLE_CUDA=OFF)
if command -v nvcc >/dev/null 2>&1; then
  cuda=(-DKVC_ENABLE_CUDA=ON -DCMAKE_CUDA_COMPILER="$(command -v nvcc)")
elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
  cuda=(-DKVC_ENABLE_CUDA=ON -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
else
  echo "-- no nvcc: the gcc stage builds without CUDA"
fi
if [[ ${cuda[0]} == -DKVC_ENABLE_CUDA=ON ]] && ! nvidia-smi -L >/dev/null 2>&1; then
  cuda+=(-DCMAKE_CUDA_FLAGS_RELEASE="-O0 -DNDEBUG")
  echo "-- no GPU: the host half of the CUDA tests and benchmark is compiled at -O0"
fi

stage "format: tools/check-format.sh (clang-format 16, .clang-format)"
if bash tools/check-format.sh; then
  total_pass=$((total_pass + 1))
else
  echo "-- format: FAILED"
  total_fail=$((total_fail + 1))
fi

# -O1, not Release's -O3: it compiles the tests in 0.6 of the time and runs them in 1.2, and the
# warnings kvc promises are the front end's (tests/CMakeLists.txt, "a user's program"), not the
# optimizer's. Optimized builds are the benchmarks' (benchmarks/run.sh: Release, -O3).
stage "g++ Release at -O1: everything"
if configure build/gcc -DCMAKE_CXX_COMPILER=g++ -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" \
     "${common[@]}" \
     -DKVC_BUILD_EXAMPLES=ON -DKVC_BUILD_BENCHMARKS=ON -DKVC_BENCH_EXTRA_FLAGS=-O0 -DKVC_INSTALL=ON \
     "${cuda[@]}"; then
  build build/gcc
  run_ctest gcc --test-dir build/gcc --output-on-failure -j "$JOBS"
fi

# valgrind memcheck over the g++ build's unit tests. The ASan stage checks clang's build, and a
# test can take another path there (clang evaluates call arguments in another order than g++):
# a g++-only out-of-bounds read once passed ASan and failed CI. Each test binary counts as one
# test; tools/valgrind.supp lists the one accepted report.
stage "valgrind memcheck: the g++ unit tests"
if command -v valgrind >/dev/null 2>&1 && [[ -f build/gcc/CTestTestfile.cmake ]]; then
  # memcheck <key> <test command...>: one test command under valgrind; its log and its verdict
  # (memcheck-<key>.ok or .failed) go to $log_dir. The commands run JOBS at a time (valgrind runs
  # each on one core); the verdicts are printed in ctest's order once all are done.
  memcheck() {
    local key=$1
    shift
    rm -f "$log_dir/memcheck-$key".{ok,failed}
    if (cd "$(dirname "$1")" && timeout 900 valgrind -q --error-exitcode=99 \
          --soname-synonyms=somalloc=nouserintercepts \
          --suppressions="$PWD_ROOT/tools/valgrind.supp" "$@") >"$log_dir/memcheck-$key.log" 2>&1; then
      : >"$log_dir/memcheck-$key.ok"
    else
      : >"$log_dir/memcheck-$key.failed"
    fi
  }
  mc_pass=0
  mc_fail=0
  mc_keys=()
  while read -r -a cmd; do
    [[ ${#cmd[@]} -gt 0 ]] || continue
    name=$(basename "${cmd[0]}")
    # test_alloc_failure replaces operator new/delete to fail allocations on purpose; memcheck
    # replaces them too (its delete then frees what the test's new allocated), so that one test
    # runs in the other three stages only (ASan and UBSan check its memory).
    if [[ $name == test_alloc_failure ]]; then
      echo "memcheck $name: not run (it replaces the allocator memcheck replaces)"
      continue
    fi
    # nouserintercepts: a test that replaces operator new/delete (execution's allocation counts)
    # keeps its own; memcheck replacing them too, where the compiler did not inline them, paired its
    # new with the test's inlined free ("mismatched free", depending on inlining).
    while [[ $(jobs -rp | wc -l) -ge $JOBS ]]; do wait -n || true; done
    # The key tells apart two tests of one binary (unit.execution and unit.execution.one_thread).
    key="$name.${#mc_keys[@]}"
    memcheck "$key" "${cmd[@]}" &
    mc_keys+=("$key")
  done < <(ctest --test-dir build/gcc -N -V -L '^unit$' | sed -n 's/^[0-9]*: Test command: //p')
  wait
  for key in "${mc_keys[@]}"; do
    if [[ -f $log_dir/memcheck-$key.ok ]]; then
      mc_pass=$((mc_pass + 1))
      echo "memcheck ${key%.*}: clean"
    else
      mc_fail=$((mc_fail + 1))
      echo "memcheck ${key%.*}: FAILED"
      grep -E '^==[0-9]+== ' "$log_dir/memcheck-$key.log" | head -n 40 || true
      tail -n 5 "$log_dir/memcheck-$key.log"
    fi
  done
  echo "-- memcheck: $mc_pass passed, $mc_fail failed"
  total_pass=$((total_pass + mc_pass))
  total_fail=$((total_fail + mc_fail))
else
  echo "-- memcheck: no valgrind or no g++ build; counting one failure"
  total_fail=$((total_fail + 1))
fi

stage "clang++ -O0 + ASan/UBSan: compile_fail, unit, fuzz (json, e2e, state)"
# One clang build for the three: -O0 with line tables compiles in 40% of the time of -O2 -g and
# still gives file:line in every report (the fuzz target alone is built at -O1, KVC_FUZZ_OPTIMIZE).
# The compile_fail suite builds its .ko cases here, so clang's diagnostics are checked as g++'s are;
# the .ok cases (the same sources without the misuse, so a .ko cannot pass on an unrelated error)
# build in the g++ stage only (they would only repeat, at -O0, what the g++ stage checks).
if configure build/asan -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo "${common[@]}" \
     -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O0 -gline-tables-only -DNDEBUG" \
     -DKVC_SANITIZE=ON -DKVC_BUILD_EXAMPLES=OFF -DKVC_BUILD_BENCHMARKS=OFF -DKVC_ENABLE_CUDA=OFF \
     -DKVC_BUILD_FUZZERS=ON -DKVC_FUZZ_SECONDS="${KVC_FUZZ_SECONDS:-30}"; then
  build build/asan --target kvc_unit_and_fuzz_tests
  ASAN_OPTIONS=${ASAN_OPTIONS:-strict_string_checks=1:detect_stack_use_after_return=1} \
  UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1} \
    run_ctest asan --test-dir build/asan --output-on-failure -j "$JOBS" -L '^(unit|compile_fail|fuzz)$' \
      -E '^compile_fail\..*\.ok$'
fi
printf -- '-- %s: %d s\n' "$stage_name" $((SECONDS - stage_start))

echo
[[ $total_skip -gt 0 ]] && echo "$total_skip skipped (gpu tests: no CUDA device here; tools/device-check.sh runs them on a GPU)"
echo "$total_pass passed, $total_fail failed ($((SECONDS - run_start)) s)"
[[ $total_fail -eq 0 ]]
