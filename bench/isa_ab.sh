#!/usr/bin/env bash
# bench/isa_ab.sh A_DIR B_DIR [ROUNDS] [MODELS] [ITERS]: paired A/B of two builds' training steps.
#
# Each of A_DIR and B_DIR is a checkout with its libfsdp.so built (for issue 40's portable build:
# A the -march=native build, B the default x86-64-v2 one with its AVX2/AVX-512 copies). Per round
# and model, bench/step.lua runs once on each side (each side its own lua/, bench/ and libfsdp.so),
# the order A B in odd rounds and B A in even ones, so a machine's drift and its other load hit
# both sides alike. A side's figure is its min wall ms per step over ITERS steps; the table shows
# each side's median over the rounds, B/A of the medians, and the lowest and highest round's B/A
# (the noise). Below 1.00: B is faster. The model conv_floor is bench/conv_floor.lua instead: the
# convolution layers of `conv` and `resnet`, each pass alone on one thread, summed (ms).
#   bash bench/isa_ab.sh ../fsdp-native . 5 mlp,conv,transformer,small,resnet,gpt,conv_floor 10
# THREADS (default 2) sets OMP_NUM_THREADS for both.
set -euo pipefail
a=${1:?usage: bench/isa_ab.sh A_DIR B_DIR [ROUNDS] [MODELS] [ITERS]}
b=${2:?usage: bench/isa_ab.sh A_DIR B_DIR [ROUNDS] [MODELS] [ITERS]}
rounds=${3:-5}
models=${4:-mlp,conv,transformer,small,resnet,gpt,conv_floor}
iters=${5:-10}
for d in "$a" "$b"; do [ -f "$d/libfsdp.so" ] || { echo "isa_ab: $d/libfsdp.so is missing (build it first)" >&2; exit 2; }; done
export OMP_NUM_THREADS=${THREADS:-2} OPENBLAS_NUM_THREADS=1
out=$(mktemp)
trap 'rm -f "$out"' EXIT

step() {  # side dir model round: appends "model side round ms" lines
  if [ "$3" = conv_floor ]; then  # each conv layer alone on one thread, summed: "conv_floor:MODEL side round ms"
    (cd "$2" && luajit bench/conv_floor.lua --models conv,resnet --peak 1 --threads "$OMP_NUM_THREADS") |
      awk -v s="$1" -v r="$4" '/GFLOP of convolutions per step/ { for (i = 1; i <= NF; i++) if ($i == "on" && $(i + 1) == "one") print "conv_floor:" $1, s, r, $(i - 2) }' >> "$out"
  else
    echo "$3 $1 $4 $(cd "$2" && luajit bench/step.lua "$3" "$iters" 3 | awk '{print $4}')" >> "$out"
  fi
}
echo "A: $a  ($(cd "$a" && luajit -e 'package.path="lua/?.lua;lua/?/init.lua;"..package.path; local f=require "fsdp"; io.write(require("ffi").string(f.C.fsdp_cpu_isa()))'))"
echo "B: $b  ($(cd "$b" && luajit -e 'package.path="lua/?.lua;lua/?/init.lua;"..package.path; local f=require "fsdp"; io.write(require("ffi").string(f.C.fsdp_cpu_isa()))'))"
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), family $(grep -m1 'cpu family' /proc/cpuinfo | awk '{print $NF}') model $(grep -m1 '^model\s' /proc/cpuinfo | awk '{print $NF}'), $(getconf _NPROCESSORS_ONLN) cores; threads $OMP_NUM_THREADS, $rounds rounds of $iters steps"
for r in $(seq 1 "$rounds"); do
  for m in ${models//,/ }; do
    if [ $((r % 2)) = 1 ]; then step A "$a" "$m" "$r"; step B "$b" "$m" "$r"
    else step B "$b" "$m" "$r"; step A "$a" "$m" "$r"; fi
  done
done
luajit - "$out" <<'EOF'
local rows, order = {}, {}
for line in io.lines(arg[1]) do
  local m, side, r, ms = line:match("^(%S+) (%S+) (%S+) (%S+)$")
  if m and tonumber(ms) then
    if not rows[m] then order[#order + 1] = m; rows[m] = { A = {}, B = {} } end
    rows[m][side][tonumber(r)] = tonumber(ms)
  end
end
local function med(t)
  local s = {}
  for _, v in pairs(t) do s[#s + 1] = v end
  table.sort(s)
  local n = #s
  return n % 2 == 1 and s[(n + 1) / 2] or (s[n / 2] + s[n / 2 + 1]) / 2
end
print(("| %-18s | %10s | %10s | %6s | %-13s |"):format("model", "A ms", "B ms", "B/A", "round range"))
print("|--------------------|------------|------------|--------|---------------|")
for _, m in ipairs(order) do
  local a, b = rows[m].A, rows[m].B
  local lo, hi = math.huge, 0
  for r, va in pairs(a) do
    if b[r] then lo, hi = math.min(lo, b[r] / va), math.max(hi, b[r] / va) end
  end
  print(("| %-18s | %10.2f | %10.2f | %6.3f | %5.3f-%5.3f   |"):format(m, med(a), med(b), med(b) / med(a), lo, hi))
end
EOF
