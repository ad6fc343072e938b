#!/usr/bin/env bash
# One stalled-rank trial: comm_stall.sh DIR VICTIM MODE STEP [DELAY [NP [LATE0]]]
# Runs tests/scripts/comm_stall.lua on NP ranks (default 2; output in DIR/out; LATE0: see there); for MODE "ext" sends SIGSTOP
# to the victim DELAY seconds after both ranks wrote their pids. Appends "rc=<status>" and
# "end=<epoch>" to DIR/out, then kills whatever is left of the job's ranks (by their pids).
set -u
dir=$1 victim=$2 mode=$3 step=$4 delay=${5:-0} np=${6:-2} late0=${7:-0}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# MODE "data<K>": the victim's comm thread stops itself right after agreeing on collective #K (and
# prints when: "FSDP_COMM_STALL_AT: rank R stops at <epoch>")
stall=""
case "$mode" in data*) stall="FSDP_COMM_STALL_AT=$victim:${mode#data}" ;; esac
env $stall timeout -k 2 30 "$here/../../bin/fsdprun" -n "$np" "$here/comm_stall.lua" "$dir" "$victim" "$mode" "$step" "$late0" >"$dir/out" 2>&1 &
job=$!
if [ "$mode" = ext ]; then
  for _ in $(seq 200); do [ "$(ls "$dir" | grep -c '^pid[0-9]*$')" -ge "$np" ] && break; sleep 0.05; done
  sleep "$delay"
  date +%s.%N >"$dir/stopped"
  kill -STOP "$(cat "$dir/pid$victim")" 2>/dev/null
fi
wait $job
rc=$?
echo "rc=$rc" >>"$dir/out"
echo "end=$(date +%s.%N)" >>"$dir/out"
for f in "$dir"/pid[0-9]*; do [ -f "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null; done
exit 0
