#!/usr/bin/env bash
# kvc's GPU check, for a machine with a CUDA device (an H200 in the project): builds the CUDA
# conformance tests (twice: as they are, and with PyTorch's __CUDA_NO_HALF_* macros) and the CUDA
# benchmark (Release, nvcc, sm_90 + PTX), runs them, and prints a summary. Estimated 3-4 minutes on
# 16 cores (never timed on the GPU machine yet); every step has a time limit so that the whole run
# stays under 8 minutes. What the summary holds, for the issue note: the test counts of every gpu
# test (the storage scenarios, device attention and the paged cache on the device among them) and
# the benchmark's SUMMARY lines: append vs device-to-device copy, decode attention bytes/s vs copy
# bandwidth at 8k and 32k tokens (contiguous and paged), paged append (write_all_layers) vs copy,
# the offload step vs no offload, and the quantized codecs.
#
#   bash tools/device-check.sh            build-device/, -j$(nproc)
#   BUILD=dir JOBS=n bash tools/device-check.sh
#
# Logs go to $BUILD/device-logs/ and, when $OUT is set (the device tool's output folder), are
# copied there too. Exits non-zero if a step fails, or if the tests were skipped: on the GPU
# machine, "no CUDA device" is a failure.
set -uo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build-device}
JOBS=${JOBS:-$(nproc)}
NVCC=${NVCC:-}
if [[ -z $NVCC ]]; then
  if command -v nvcc >/dev/null 2>&1; then NVCC=$(command -v nvcc); else NVCC=/usr/local/cuda/bin/nvcc; fi
fi
logs=$BUILD/device-logs
mkdir -p "$logs"
start=$(date +%s)
failures=()
summary=()

stage() { printf '\n==== %s (%ds) ====\n' "$*" $(( $(date +%s) - start )); }
elapsed() { echo $(( $(date +%s) - start )); }
finish() {
  if [[ -n ${OUT:-} && -d ${OUT:-} ]]; then cp -r "$logs" "$OUT/" 2>/dev/null || true; fi
  echo
  echo "==== device-check summary ($(elapsed)s) ===="
  for line in "${summary[@]}"; do echo "  $line"; done
  if [[ ${#failures[@]} -eq 0 ]]; then
    echo "DEVICE CHECK PASSED"
    exit 0
  fi
  echo "DEVICE CHECK FAILED: ${failures[*]}"
  exit 1
}

stage "environment"
if ! bash tools/setup.sh; then
  echo "setup.sh failed (continuing: the packages may already be there)"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee "$logs/nvidia-smi.txt" || true
"$NVCC" --version | tail -n 2
echo "cores: $(nproc), jobs: $JOBS"

stage "configure"
if ! timeout 120 cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_COMPILER="$NVCC" \
      -DKVC_ENABLE_CUDA=ON -DKVC_CUDA_PLAIN_CONFORMANCE=ON -DKVC_BUILD_TESTS=ON -DKVC_BUILD_BENCHMARKS=ON -DKVC_BUILD_EXAMPLES=OFF \
      -DKVC_WARNINGS=ON -DKVC_INSTALL=OFF >"$logs/configure.log" 2>&1; then
  tail -n 40 "$logs/configure.log"
  failures+=(configure)
  summary+=("configure: FAILED (see $logs/configure.log)")
  finish
fi
grep -E '^-- kvc:' "$logs/configure.log" || true
if ! grep -q 'kvc: CUDA enabled' "$logs/configure.log"; then
  failures+=(cuda-not-enabled)
  summary+=("configure: CUDA was not enabled (no nvcc at $NVCC?)")
  finish
fi
summary+=("configure: ok")

stage "build (CUDA tests and benchmark, -j$JOBS)"
build_start=$(date +%s)
if timeout 360 cmake --build "$BUILD" -j "$JOBS" --target test_cuda_conformance test_cuda_conformance_plain kvc_bench_cuda \
      test_conformance_host \
      >"$logs/build.log" 2>&1; then
  summary+=("build: ok in $(( $(date +%s) - build_start ))s")
else
  grep -E 'error|Error' "$logs/build.log" | head -n 40
  tail -n 20 "$logs/build.log"
  failures+=(build)
  summary+=("build: FAILED (see $logs/build.log)")
  finish
fi

stage "tests: ctest -L gpu and unit.conformance_host"
timeout 300 ctest --test-dir "$BUILD" -R '^(gpu\.|unit\.conformance_host$)' --output-on-failure -V \
  >"$logs/ctest.log" 2>&1
ctest_rc=$?
grep -E 'CUDA device 0|SKIPPED|test cases:|assertions:|Test +#|tests passed|ERROR|FAILED|ailed' "$logs/ctest.log" | head -n 60
if grep -q '\*\*\*Skipped' "$logs/ctest.log"; then
  failures+=(tests-skipped)
  summary+=("tests: SKIPPED -- the binaries saw no CUDA device on the GPU machine")
elif [[ $ctest_rc -ne 0 ]]; then
  failures+=(tests)
  summary+=("tests: FAILED (see $logs/ctest.log)")
else
  summary+=("tests: $(grep -E 'tests passed' "$logs/ctest.log" | tail -n 1)")
fi

stage "benchmark: kvc_bench_cuda"
if timeout 180 "$BUILD/benchmarks/cuda/kvc_bench_cuda" 2>&1 | tee "$logs/bench_cuda.txt"; then
  summary+=("benchmark: $(grep -E '^SUMMARY' "$logs/bench_cuda.txt" | sed 's/^SUMMARY: //' | paste -sd ';' - | sed 's/;/; /g')")
else
  failures+=(benchmark)
  summary+=("benchmark: FAILED or skipped (see $logs/bench_cuda.txt)")
fi

finish
