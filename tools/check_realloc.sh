#!/usr/bin/env bash
# check_realloc.sh DIR... -- every realloc() result is checked before use (`make lint`).
# A call must assign to a pointer other than the one it grows (p = realloc(p, n) loses p when it
# fails), and the next three lines must test that pointer (if (!q ...), CHECK...(q ...) or q ?).
# Growable arrays should use fsdp_grow (src/core/tensor.c), which does this once.
set -u
status=0
while IFS=: read -r file line text; do
  lhs="$(echo "$text" | sed -nE 's/.*[^A-Za-z0-9_>.]([A-Za-z_][A-Za-z0-9_]*) *= *realloc *\(.*/\1/p')"
  arg="$(echo "$text" | sed -nE 's/.*realloc *\( *([^,]*),.*/\1/p' | tr -d ' ')"
  if [ -z "$lhs" ]; then
    echo "$file:$line: realloc result not assigned to a named pointer: $text" >&2; status=1; continue
  fi
  if [ "$lhs" = "$arg" ]; then
    echo "$file:$line: '$lhs = realloc($arg, ...)' loses the block when realloc fails" >&2; status=1; continue
  fi
  next="$(sed -n "$((line + 1)),$((line + 3))p" "$file")"
  if ! printf '%s\n' "$text" "$next" | grep -qE "(!|\( *)$lhs\b|\b$lhs *\?|CHECK[A-Z_]*\( *$lhs\b"; then
    echo "$file:$line: the result of realloc ('$lhs') is not checked in the next lines" >&2; status=1
  fi
done < <(grep -rnE --include='*.c' --include='*.h' '\brealloc *\(' "$@" | grep -v '^[^:]*:[0-9]*: *//')
[ "$status" -eq 0 ] && echo "check_realloc: every realloc result is checked"
exit "$status"
