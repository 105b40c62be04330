#!/usr/bin/env bash
# Turns the benchmarks' JSON output into the PNG plots of docs/benchmarks.md (gnuplot; tools/setup.sh
# installs gnuplot-nox):
#
#   bash tools/plot_benchmarks.sh [json-dir] [png-dir]     (defaults: build/bench/benchmarks docs/plots)
#
# json-dir holds what benchmarks/run.sh writes: append.json (kvc_bench_append), decode.json
# (kvc_bench_decode), threads.json (kvc_bench_threads) and compile_time.json (benchmarks/compile_time.sh); a plot whose input is
# missing is skipped. tools/plot_benchmarks.cmake extracts the tables, gnuplot draws:
#
#   decode_step.png          step time vs sequence length per cache: append only (32 layers, with the
#                            re-concatenation baseline) and append + attention (kvc::attend, 4 layers)
#   attention_bandwidth.png  decode attention: K/V bytes read per second vs context length, with the
#                            memcpy and read-only bandwidths measured in the same run
#   memory_per_token.png     K/V bytes per token after n tokens, per cache, float and bfloat16
#   compile_time.png         compile time of the probe TUs with g++ and clang++
#   serving.png              continuous batching: throughput and peak KV memory vs concurrent requests,
#                            and what prefix sharing saves (serving_*.dat, written by kvc_bench_serving)
#   threads.png              attention on 1 and 2 threads: a decode step vs context length and a
#                            prefill vs prompt length (threads.json, kvc_bench_threads; wall-clock)
#   serving_threads.png      continuous batching's throughput vs the threads it is given, at 1 to
#                            128 concurrent requests (serving_threads.dat, kvc_bench_serving)
set -euo pipefail
cd "$(dirname "$0")/.."

in=${1:-build/bench/benchmarks}
out=${2:-docs/plots}
if ! command -v gnuplot >/dev/null 2>&1; then
  echo "plot_benchmarks.sh: gnuplot not found (bash tools/setup.sh installs gnuplot-nox)" >&2
  exit 1
fi
mkdir -p "$out"
tab=$(mktemp -d)
trap 'rm -rf "$tab"' EXIT
cmake -DIN="$in" -DOUT="$tab" -P tools/plot_benchmarks.cmake

# A reference bandwidth (bytes/s) from a two-column table of quoted names and values.
ref() { awk -v n="\"$2\"" '$1 == n { print $2 }' "$1" 2>/dev/null; }

common='
set terminal pngcairo size 1200,520 font "sans,11" noenhanced
set datafile missing "?"
set key autotitle columnheader
set grid lc rgb "#dddddd"
set border lc rgb "#555555"
set style line 1 lc rgb "#1f77b4" lw 2 pt 7 ps 1.1
set style line 2 lc rgb "#ff7f0e" lw 2 pt 5 ps 1.1
set style line 3 lc rgb "#2ca02c" lw 2 pt 9 ps 1.3
set style line 4 lc rgb "#d62728" lw 2 pt 11 ps 1.3
set style line 5 lc rgb "#9467bd" lw 2 pt 13 ps 1.3
set style line 6 lc rgb "#000000" lw 2 pt 3 ps 1.1 dt 2
'

# ---- step time vs sequence length ------------------------------------------------------------
append_panel='
set title "append only: update() of 1 token in 32 layers (8 KV heads x 128)\nkvc_bench_append; black, dashed: transformers-style torch.cat baseline"
stats "'$tab'/append_step.dat" using 1 nooutput
set xrange [STATS_min / 1.4 : STATS_max * 1.4]
set yrange [10:*]
plot for [i=2:6] "'$tab'/append_step.dat" using 1:i with linespoints ls (i == 6 ? 6 : i - 1)
'
attend_panel='
set title "append + attention: kvc::attend in 4 layers (8 query / 2 KV heads x 128)\nkvc_bench_decode; gray, dotted: proportional to S"
stats "'$tab'/decode_step.dat" using 1 nooutput
set xrange [STATS_min / 1.4 : STATS_max * 1.4]
smax = STATS_max
stats "'$tab'/decode_step.dat" using 2 nooutput
slope = STATS_max / smax
set yrange [*:*]
plot for [i=2:6] "'$tab'/decode_step.dat" using 1:i with linespoints ls (i - 1), \
     slope * x with lines lc rgb "#999999" dt 3 lw 1.5 title "proportional to S"
'
panels=()
[[ -f $tab/append_step.dat ]] && panels+=("$append_panel")
[[ -f $tab/decode_step.dat ]] && panels+=("$attend_panel")
if [[ ${#panels[@]} -gt 0 ]]; then
  gnuplot <<GNUPLOT
$common
set terminal pngcairo size $((620 * ${#panels[@]})),580 font "sans,11" noenhanced
set output "$out/decode_step.png"
set multiplot layout 1,${#panels[@]} title "kvc: time of one decode step vs sequence length (CPU time, one thread, float)"
set logscale x 2
set logscale y 10
set format y "%g"
set xlabel "sequence length S (tokens already cached)"
set ylabel "time per decode step (microseconds, log scale)"
set key top left Left reverse spacing 1.1 font ",9"
${panels[*]}
unset multiplot
GNUPLOT
fi

# ---- attention bandwidth -------------------------------------------------------------------------
if [[ -f $tab/attention.dat ]]; then
  memcpy=$(ref "$tab/decode_refs.dat" memcpy/bulk/MiB:64)
  read=$(ref "$tab/decode_refs.dat" read/MiB:64)
  gnuplot <<GNUPLOT
$common
set terminal pngcairo size 1100,560 font "sans,11" noenhanced
set output "$out/attention_bandwidth.png"
set title "kvc::scaled_dot_product_attention, one decode step (1 query token, 8 query / 2 KV heads, batch 1)\nK/V bytes read per second; K/V come from memory (working set > 160 MiB); one thread"
set logscale x 2
set xlabel "context length S (tokens in the cache)"
set ylabel "K/V bytes read per second (GB/s)"
set xrange [700:48000]
set yrange [0:*]
set key outside right top Left reverse font ",10"
memcpy = ${memcpy:-NaN} / 1e9
rd = ${read:-NaN} / 1e9
plot for [i=2:5] "$tab/attention.dat" using 1:(column(i) / 1e9) with linespoints ls (i - 1) title columnheader(i), \
     memcpy with lines lc rgb "#444444" lw 1.5 title sprintf("memcpy, 64 MiB (%.1f GB/s)", memcpy), \
     0.5 * memcpy with lines lc rgb "#444444" lw 1.5 dt 2 title "target: 50% of memcpy", \
     rd with lines lc rgb "#8c564b" lw 1.5 dt 3 title sprintf("read-only pass, 64 MiB (%.1f GB/s)", rd)
GNUPLOT
fi

# ---- memory per token -------------------------------------------------------------------------------
if [[ -f $tab/memory_float.dat ]]; then
  gnuplot <<GNUPLOT
$common
set terminal pngcairo size 1240,580 font "sans,11" noenhanced
set output "$out/memory_per_token.png"
set multiplot layout 1,2 title "kvc: K/V bytes held per token after n tokens: cache.bytes() / n (4 layers, 2 KV heads x 128; a 128-token prompt, then 1-token steps)"
set logscale xy 2
set format y "%g"
set xlabel "tokens n"
set ylabel "bytes per token (log scale)"
set xrange [200:10500]
set yrange [300:400000]
set key top right font ",9"
set title "float (ideal: 8192 B/token)\nStaticCache: max_cache_len 8448; sliding: window 512 in a 2W-slot buffer\n(the two sliding caches hold the same: their lines coincide)"
plot for [i=2:6] "$tab/memory_float.dat" using 1:i with linespoints ls (i - 1), \
     8192 with lines lc rgb "#999999" dt 3 lw 1.5 title "ideal: K and V of every token"
set title "bfloat16 (ideal: 4096 B/token)\nDynamicCache: capacity doubles, so 1x to 2x the ideal"
plot for [i=2:6] "$tab/memory_bf16.dat" using 1:i with linespoints ls (i - 1), \
     4096 with lines lc rgb "#999999" dt 3 lw 1.5 title "ideal: K and V of every token"
unset multiplot
GNUPLOT
fi

# ---- compile time -------------------------------------------------------------------------------------
if [[ -f $tab/compile_time.dat ]]; then
  n=$(head -n1 "$tab/compile_time.dat" | awk '{ print NF - 1 }')  # compilers: no spaces in their names
  gnuplot <<GNUPLOT
$common
set terminal pngcairo size 1200,540 font "sans,11" noenhanced
set output "$out/compile_time.png"
set title "compile time of one translation unit (-O2 -DNDEBUG -std=gnu++20; CPU time of the compiler)\nfloor: the headers kvc.hpp includes; include: <kvc/kvc.hpp> alone; all: + every ready-made cache and the attention;\nany_cache / make_cache: AnyCache(make_dynamic_cache) / one make_cache call, header-only and linking kvc::runtime"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.85 border -1
set ylabel "seconds"
set yrange [0:*]
set offsets 0, 0, graph 0.08, 0
set key top left
set xtics nomirror
n = $n
plot for [i=2:n+1] "$tab/compile_time.dat" using i:xtic(1) title columnheader(i) ls (i - 1), \
     for [i=2:n+1] "$tab/compile_time.dat" using (\$0 + (i - 2 - (n - 1) / 2.0) / (n + 1)):i:(sprintf("%.1f s", column(i))) \
         with labels offset 0,0.7 font ",9" notitle
GNUPLOT
fi

# ---- continuous batching (kvc_bench_serving writes its tables itself) -----------------------------
if [[ -f $in/serving_throughput.dat && -f $in/serving_memory.dat && -f $in/serving_prefix.dat ]]; then
  gnuplot <<GNUPLOT
$common
set terminal pngcairo size 1860,580 font "sans,11" noenhanced
set output "$out/serving.png"
set multiplot layout 1,3 title "kvc continuous batching (kvc_bench_serving): the examples' decoder (4 layers, hidden 768, 105 MB of float weights), blocks of 16 tokens\nrequests: prompts of 8..40 tokens, half behind a 32-token system prompt, 32..96 new tokens each"
set logscale x 2
set xlabel "concurrent requests"
set key top left Left reverse font ",9"
set title "throughput: generated tokens per second"
set ylabel "tokens/s"
set yrange [0:*]
plot for [i=2:3] "$in/serving_throughput.dat" using 1:i with linespoints ls (i - 1)
set title "peak KV memory"
set logscale y 2
set ylabel "MiB (log scale)"
set yrange [*:*]
plot for [i=2:5] "$in/serving_memory.dat" using 1:i with linespoints ls (i - 1)
unset logscale
set title "prefix sharing: 64 requests arriving 4 per step,\na fraction behind a 256-token system prompt"
set xlabel "fraction of requests sharing the system prompt"
set ylabel "saved, against block sharing off"
set yrange [0:100]
set format y "%.0f%%"
plot for [i=2:3] "$in/serving_prefix.dat" using 1:(100 * column(i)) with linespoints ls (i - 1) title columnheader(i)
unset multiplot
GNUPLOT
fi

# ---- continuous batching vs threads (kvc_bench_serving built with OpenMP) ---------------------------
if [[ -f $in/serving_threads.dat ]]; then
  gnuplot <<GNUPLOT
$common
set terminal pngcairo size 760,520 font "sans,11" noenhanced
set output "$out/serving_threads.png"
set title "kvc continuous batching vs threads (kvc_bench_serving; OpenMP: the decoder,\nkvc::paged_attention and the sampling), best of 3 runs"
set xlabel "threads"
set ylabel "generated tokens/s"
set xtics 1
set yrange [0:*]
set key top left Left reverse font ",9"
plot for [i=2:5] "$in/serving_threads.dat" using 1:i with linespoints ls (i - 1) title columnheader(i)
GNUPLOT
fi

# ---- attention on 1 and 2 threads -------------------------------------------------------------------
if [[ -f $tab/threads_decode.dat && -f $tab/threads_prefill.dat ]]; then
  gnuplot <<GNUPLOT
$common
set terminal pngcairo size 1240,560 font "sans,11" noenhanced
set output "$out/threads.png"
set multiplot layout 1,2 title "kvc host attention on 1 and 2 threads (kvc::OpenMPExecutor; 8 query / 2 KV heads x 128, float; wall-clock)"
set logscale xy 2
set format y "%g"
set key top left Left reverse font ",10"
set title "one decode step (1 query token; K/V from memory)\nkvc_bench_threads decode/threads:t/S:s"
set xlabel "context length S (tokens)"
set ylabel "time per step (microseconds)"
plot for [i=2:3] "$tab/threads_decode.dat" using 1:i with linespoints ls (i - 1)
set title "causal prefill of n tokens\nkvc_bench_threads prefill/threads:t/tokens:n"
set xlabel "prompt length n (tokens)"
set ylabel "time per prefill (milliseconds)"
plot for [i=2:3] "$tab/threads_prefill.dat" using 1:(column(i) / 1000) with linespoints ls (i - 1) title columnheader(i)
unset multiplot
GNUPLOT
fi

ls -1 "$out"/*.png
