#!/usr/bin/env bash
# Builds the benchmarks (Release), runs them, times the compile-time probes and regenerates the
# plots of docs/benchmarks.md:
#
#   bash benchmarks/run.sh [build-dir]        (default: build/bench)
#
# Writes <build-dir>/benchmarks/{append,decode,threads,compile_time}.json (google benchmark's
# JSON) and .txt (the console output with its summary), serving_*.dat and serving.txt
# (kvc_bench_serving's tables), then docs/plots/*.png (tools/plot_benchmarks.sh). About 4 minutes
# on 2 cores once built: kvc_bench_append ~50 s, kvc_bench_decode ~30 s, kvc_bench_threads ~40 s,
# kvc_bench_serving ~45 s, the compile-time probes ~50 s (g++ and clang++). Environment: JOBS
# (build parallelism, default 2), BENCH_ARGS (extra arguments to the google benchmarks, e.g.
# --benchmark_filter=...), COMPILERS and REPEAT (benchmarks/compile_time.sh), SKIP_COMPILE_TIME=1
# (keep the last compile_time.json).
set -euo pipefail
cd "$(dirname "$0")/.."

bash tools/setup.sh
build=${1:-build/bench}
out=$build/benchmarks
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DKVC_BUILD_TESTS=OFF -DKVC_BUILD_EXAMPLES=OFF \
  -DKVC_BUILD_BENCHMARKS=ON >/dev/null
cmake --build "$build" -j "${JOBS:-2}" --target kvc_bench_append kvc_bench_decode kvc_bench_serving kvc_bench_threads

run() {  # run <name>: one benchmark, JSON to <name>.json, console and summary to <name>.txt
  "$out/kvc_bench_$1" --benchmark_out="$out/$1.json" --benchmark_out_format=json ${BENCH_ARGS:-} | tee "$out/$1.txt"
}
run append
run decode
run threads
"$out/kvc_bench_serving" --out "$out" | tee "$out/serving.txt"
if [[ ${SKIP_COMPILE_TIME:-0} != 1 ]]; then
  bash benchmarks/compile_time.sh "$out/compile_time.json" | tee "$out/compile_time.txt"
fi
bash tools/plot_benchmarks.sh "$out" docs/plots
