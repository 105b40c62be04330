#!/usr/bin/env bash
# Checks that every C++ and CUDA source tracked by git is formatted by .clang-format:
#   bash tools/check-format.sh          lists the files clang-format would change; exit 1 if any
#   bash tools/check-format.sh --fix    formats them in place
# Needs clang-format 16 (Debian 12: apt-get install clang-format-16; tools/setup.sh installs it):
# other versions format some constructs differently.
set -euo pipefail
cd "$(dirname "$0")/.."

cf=${CLANG_FORMAT:-}
if [[ -z $cf ]]; then
  for c in clang-format-16 clang-format; do
    if command -v "$c" >/dev/null 2>&1 && [[ $("$c" --version) =~ version\ 16\. ]]; then cf=$c; break; fi
  done
fi
if [[ -z $cf ]]; then
  echo "check-format: clang-format 16 not found (apt-get install clang-format-16, or set CLANG_FORMAT)" >&2
  exit 2
fi

mapfile -d '' files < <(git ls-files -z -- '*.hpp' '*.cpp' '*.cuh' '*.cu' '*.h')
if [[ ${1:-} == --fix ]]; then
  # Writes a file only if formatting changed nothing but whitespace (the text with every blank and
  # every line continuation removed is the same), so that a format commit cannot change what
  # compiles.
  blankless() { perl -0pe 's/\\\n//g; s/\s+//g' | md5sum; }
  tmp=$(mktemp)
  trap 'rm -f "$tmp"' EXIT
  changed=0
  for f in "${files[@]}"; do
    "$cf" --style=file "$f" >"$tmp"
    cmp -s "$f" "$tmp" && continue
    if [[ $(blankless <"$f") != $(blankless <"$tmp") ]]; then
      echo "check-format: $f: formatting would change more than whitespace; left as it is" >&2
      exit 1
    fi
    cat "$tmp" >"$f"
    changed=$((changed + 1))
  done
  echo "check-format: formatted $changed of ${#files[@]} files (whitespace only)"
  exit 0
fi
bad=()
for f in "${files[@]}"; do
  if ! "$cf" --style=file --dry-run --Werror "$f" >/dev/null 2>&1; then bad+=("$f"); fi
done
if [[ ${#bad[@]} -gt 0 ]]; then
  printf 'check-format: not formatted (bash tools/check-format.sh --fix):\n'
  printf '  %s\n' "${bad[@]}"
  exit 1
fi
echo "check-format: ${#files[@]} files formatted"
