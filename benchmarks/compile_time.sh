#!/usr/bin/env bash
# Times the compilation of the compile-time probes with each compiler and writes JSON in google
# benchmark's layout (tools/plot_benchmarks.sh reads it):
#
#   bash benchmarks/compile_time.sh [out.json]        (default: build/benchmarks/compile_time.json)
#
#   compile/<compiler>/floor               compile_time_floor.cpp: the standard, POSIX, Eigen and
#                                          Mp11 headers kvc.hpp includes, nothing of kvc
#   compile/<compiler>/include             compile_time_include.cpp: <kvc/kvc.hpp>, nothing instantiated
#   compile/<compiler>/all                 compile_time_tu.cpp: <kvc/kvc.hpp> and every ready-made cache
#                                          (DynamicCache, make_dynamic_cache, StaticCache) and the
#                                          attention, for float and Eigen::bfloat16
#   compile/<compiler>/any_cache           compile_time_any_cache.cpp: AnyCache(make_dynamic_cache<float>)
#   compile/<compiler>/any_cache_runtime   the same with -DKVC_RUNTIME_LIBRARY (linking kvc::runtime)
#   compile/<compiler>/make_cache          compile_time_make_cache.cpp: one make_cache<float> call
#   compile/<compiler>/make_cache_runtime  the same with -DKVC_RUNTIME_LIBRARY (linking kvc::runtime)
#
# Each is `$CXX <flags> -c <tu> -o <tmp>.o` with OPT (default -O2) and the warning flags kvc's own
# targets get (-DNDEBUG -std=gnu++20 -Wall -Wextra -Werror, -Wno-restrict on GCC 12-13), kvc's
# include roots, Eigen as a system include. real_time is the wall-clock time, cpu_time the
# compiler's user + sys time; the best of REPEAT runs (default 1) is kept. The probes compile
# one after the other, so on a busy machine cpu_time is the number to read.
#
# Environment: COMPILERS (default "g++ clang++"), REPEAT (default 1), OPT (default -O2),
# EIGEN_INCLUDE (default /usr/include/eigen3), EXTRA_FLAGS (appended to the flags), PROBES (names
# from the list above, default all).
set -euo pipefail
cd "$(dirname "$0")/.."

out=${1:-build/benchmarks/compile_time.json}
compilers=(${COMPILERS:-g++ clang++})
repeat=${REPEAT:-1}
eigen=${EIGEN_INCLUDE:-/usr/include/eigen3}
mkdir -p "$(dirname "$out")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

probes=(floor:benchmarks/compile_time_floor.cpp include:benchmarks/compile_time_include.cpp
        all:benchmarks/compile_time_tu.cpp any_cache:benchmarks/compile_time_any_cache.cpp
        any_cache_runtime:benchmarks/compile_time_any_cache.cpp make_cache:benchmarks/compile_time_make_cache.cpp
        make_cache_runtime:benchmarks/compile_time_make_cache.cpp)
wanted=" ${PROBES:-floor include all any_cache any_cache_runtime make_cache make_cache_runtime} "

entries=()
for cxx in "${compilers[@]}"; do
  if ! command -v "$cxx" >/dev/null 2>&1; then
    echo "compile_time.sh: $cxx not found, skipped" >&2
    continue
  fi
  version=$("$cxx" --version | head -n1)
  flags=(${OPT:--O2} -DNDEBUG -std=gnu++20 -Wall -Wextra -Werror)
  if "$cxx" --version | grep -q -E '^(g\+\+|gcc|c\+\+) .* 1[23]\.'; then flags+=(-Wno-restrict); fi
  flags+=(-Iinclude -Iconcepts -Ipolicies -isystem "$eigen" ${EXTRA_FLAGS:-})
  for probe in "${probes[@]}"; do
    name=${probe%%:*} tu=${probe#*:}
    [[ $wanted == *" $name "* ]] || continue
    probe_flags=()
    [[ $name == *_runtime ]] && probe_flags=(-DKVC_RUNTIME_LIBRARY)
    best_real="" best_cpu=""
    for ((r = 0; r < repeat; r++)); do
      TIMEFORMAT='%R %U %S'
      if ! { time "$cxx" "${flags[@]}" "${probe_flags[@]}" -c "$tu" -o "$tmp/probe.o" 2>"$tmp/log"; } 2>"$tmp/time"; then
        cat "$tmp/log" >&2
        echo "compile_time.sh: $cxx failed on $tu" >&2
        exit 1
      fi
      read -r real user sys <"$tmp/time"
      cpu=$(awk -v u="$user" -v s="$sys" 'BEGIN { printf "%.3f", u + s }')
      if [[ -z $best_cpu ]] || awk -v a="$cpu" -v b="$best_cpu" 'BEGIN { exit !(a < b) }'; then
        best_real=$real best_cpu=$cpu
      fi
    done
    printf '%-10s %-18s %7.2f s wall %7.2f s cpu  (%s)\n' "$cxx" "$name" "$best_real" "$best_cpu" "$tu"
    entries+=("$(printf '    {"name": "compile/%s/%s", "run_name": "compile/%s/%s", "run_type": "iteration", "iterations": %d, "real_time": %s, "cpu_time": %s, "time_unit": "s", "compiler": "%s", "translation_unit": "%s"}' \
      "$cxx" "$name" "$cxx" "$name" "$repeat" "$best_real" "$best_cpu" "$version" "$tu")")
  done
done

{
  printf '{\n  "context": {\n'
  printf '    "date": "%s",\n' "$(date -Iseconds)"
  printf '    "host_name": "%s",\n' "$(hostname)"
  printf '    "num_cpus": %s,\n' "$(nproc)"
  printf '    "flags": "%s -DNDEBUG -std=gnu++20 -Wall -Wextra -Werror (+ -Wno-restrict on GCC 12-13) %s",\n' "${OPT:--O2}" "${EXTRA_FLAGS:-}"
  printf '    "repetitions": %d\n  },\n  "benchmarks": [\n' "$repeat"
  for i in "${!entries[@]}"; do
    printf '%s' "${entries[$i]}"
    [[ $i -lt $((${#entries[@]} - 1)) ]] && printf ','
    printf '\n'
  done
  printf '  ]\n}\n'
} >"$out"
echo "compile_time.sh: wrote $out"
