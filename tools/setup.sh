#!/usr/bin/env bash
# Installs kvc's build and test dependencies (Debian 12). Idempotent; silent when all is there.
set -euo pipefail

packages=(cmake make g++ clang libclang-rt-14-dev
          libeigen3-dev libboost-dev doctest-dev libbenchmark-dev nlohmann-json3-dev
          valgrind      # the memcheck stage of tools/test-all.sh
          pkgconf       # pkg-config: the package.pkgconfig test (kvc.pc)
          doxygen       # the API reference (kvc_api_reference) and the docs.api_reference test
          clang-format-16  # tools/check-format.sh, the first stage of tools/test-all.sh
          gnuplot-nox   # gnuplot: tools/plot_benchmarks.sh
          openmpi-bin libopenmpi-dev)  # kvc::mpi: examples/07_distributed, kvc_bench_mpi (docs/distributed.md)

if ! command -v dpkg-query >/dev/null 2>&1; then
  echo "setup.sh: no dpkg-query; not a Debian system, install by hand: ${packages[*]}" >&2
  exit 0
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

sudo=()
if [[ $(id -u) -ne 0 ]]; then
  if command -v sudo >/dev/null 2>&1; then
    sudo=(sudo)
  else
    echo "setup.sh: need root or sudo to install: ${missing[*]}" >&2
    exit 1
  fi
fi

echo "setup.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
