#!/bin/sh
# The API reference's input filter (cmake/kvcApiReference.cmake): kvc's headers document a
# declaration with the plain `//` comment block directly above it, or a member with a `//` comment
# at the end of its line; Doxygen reads only `///` and `///<`. A block of line comments followed by
# code becomes `///`; one followed by a blank line or a preprocessor line (a file's opening
# comment, a section rule) stays as it is. A comment after a declaration ending in `;` or `,`
# becomes `///<`, and the comment lines under it at its column with it.
exec awk '
  function flush(doc,   i, line) {
    for (i = 1; i <= n; i++) {
      line = held[i]
      if (doc) sub(/\/\//, "///", line)
      print line
    }
    n = 0
  }
  # A comment line under an end-of-line comment, at its column, continues it.
  trail > 0 && n == 0 && index($0, "//") == trail && $0 ~ /^[[:space:]]*\/\/ / {
    line = $0
    sub(/\/\/ /, "///< ", line)
    print line
    next
  }
  /^[[:space:]]*\/\/([^\/]|$)/ { held[++n] = $0; trail = 0; next }
  {
    flush($0 !~ /^[[:space:]]*($|#)/)
    line = $0
    trail = 0
    if (line ~ /^[^"\/]*[;,][[:space:]]+\/\/ /) {
      trail = index(line, "//")
      sub(/[[:space:]]\/\/ /, " ///< ", line)
    }
    print line
  }
  END { flush(0) }
' "$1"
