#!/usr/bin/env bash
# make test's spec run: every spec file under tests/ in its own busted process, TEST_JOBS of them at
# a time (default: the number of cores), the slow files first so that the processes end together;
# then the files whose checks measure time (SERIAL), one at a time with the machine to themselves.
# A line per file as it ends (its time and busted's counts), then the totals, then the whole output
# of every file that did not pass; exit 1 when one did not. Each spec still runs alone as
# `busted tests/<group>/<name>_spec.lua`, and all of them in one process as `busted tests`.
#   tools/run_specs.sh [spec files...]      (default: every tests/**/*_spec.lua)
set -uo pipefail
cd "$(dirname "$0")/.."
jobs=${TEST_JOBS:-$(env -u OMP_NUM_THREADS nproc)}  # (nproc alone obeys OMP_NUM_THREADS)
busted=${BUSTED:-$(command -v busted)}
luajit=${LUAJIT:-luajit}

# The slowest files, slowest first (seconds each when two files run at once on a 2-core AMD EPYC
# Zen 1: 189, 160, 103, 39, 34, 32, 28, 25, 19; the other 57 take 0.1-14): started first, they
# overlap the many short ones.
SLOW=(
  tests/fsdp/grad_accum_spec.lua
  tests/fsdp/fsdp_spec.lua
  tests/backends/cudaemu_spec.lua
  tests/tools/examples_spec.lua
  tests/backends/portable_spec.lua
  tests/tools/readme_spec.lua
  tests/fsdp/comm_spec.lua
  tests/tools/launch_spec.lua
  tests/ops/ops_spec.lua
)
# Files that assert a bound on elapsed time: they run after the others, one at a time.
SERIAL=(
  tests/fsdp/comm_stall_spec.lua
)

if [ $# -gt 0 ]; then
  all=("$@")
else
  mapfile -t all < <(find tests -name '*_spec.lua' | LC_ALL=C sort)
fi
for f in "${SLOW[@]}" "${SERIAL[@]}"; do
  [ -f "$f" ] || { echo "tools/run_specs.sh: $f (in SLOW or SERIAL) does not exist" >&2; exit 2; }
done
member() { local x=$1; shift; for y in "$@"; do [ "$x" = "$y" ] && return 0; done; return 1; }
parallel=() serial=()
for f in "${SLOW[@]}"; do member "$f" "${all[@]}" && parallel+=("$f"); done
for f in "${all[@]}"; do
  if member "$f" "${SERIAL[@]}"; then serial+=("$f")
  elif ! member "$f" "${SLOW[@]}"; then parallel+=("$f"); fi
done

logs=$(mktemp -d /tmp/fsdp_specs.XXXXXX)
trap 'rm -rf "$logs"' EXIT
export logs busted luajit
# one spec file: its output into $logs, its line on stdout (one write: lines of parallel files do
# not mix), its exit status into $logs/<name>.rc
run_one() {
  local f=$1 name log t0 t1 rc counts
  name=$(echo "$f" | tr / _)
  log="$logs/$name.log"
  t0=$(date +%s.%N)
  OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 "$luajit" "$busted" "$f" >"$log" 2>&1
  rc=$?
  t1=$(date +%s.%N)
  echo "$rc" >"$logs/$name.rc"
  counts=$(grep -E '^[0-9]+ success' "$log" | tail -1 | sed 's/ : .*//')
  printf '%-46s %6.1f s  %s%s\n' "$f" "$(echo "$t1 - $t0" | bc)" "${counts:-no summary}" \
    "$([ "$rc" = 0 ] || echo "  (exit $rc)")"
}
export -f run_one

t0=$(date +%s)
printf '%s\n' "${parallel[@]}" | xargs -P "$jobs" -I{} bash -c 'run_one "$1"' _ {}
for f in "${serial[@]}"; do run_one "$f"; done
t1=$(date +%s)

# the totals over every file's summary line, and the files that did not pass
sum() { cat "$logs"/*.log | grep -E '^[0-9]+ success' | sed 's/ : .*//' |
  awk -F' / ' -v k="$1" '{ for (i = 1; i <= NF; i++) if ($i ~ k) { split($i, a, " "); n += a[1] } } END { print n + 0 }'; }
failed=()
for f in "${parallel[@]}" "${serial[@]}"; do
  rc=$(cat "$logs/$(echo "$f" | tr / _).rc" 2>/dev/null || echo missing)
  [ "$rc" = 0 ] || failed+=("$f")
done
for f in "${failed[@]}"; do
  echo
  echo "==== $f did not pass; its output:"
  cat "$logs/$(echo "$f" | tr / _).log"
done
echo
echo "${#all[@]} spec files, $jobs at a time: $(sum success) successes / $(sum failure) failures /" \
  "$(sum error) errors / $(sum pending) pending in $((t1 - t0)) s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "did not pass: ${failed[*]}"
  exit 1
fi
