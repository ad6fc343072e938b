#!/usr/bin/env bash
# tools/gpu_check.sh: the one prepared GPU run (issue 15 item 7). At most 5 minutes on one H100 or H200
# (each stage under its own timeout), every stage writing its full output to $GPU_CHECK_WORK
# (/tmp/fsdp-gpu-check), packed after each stage into $OUT/details.tar.gz (default OUT
# tmp/gpu-check), with a one-line verdict per stage in $OUT/summary.txt -- two files, where the
# device tool returns at most 8:
#   env      the GPU, driver, CPU, glibc, PyTorch with its CUDA/cuDNN/NCCL, where its CUDA libraries are
#   setup    unpacks tmp/gpu-kit (tools/gpu_kit.sh, made on a development machine: LuaJIT, OpenBLAS,
#            oneDNN and busted as .deb files, libfsdp.so and libfsdp_cuda.so built for x86-64-v3) with
#            Python alone (no dpkg, no package manager); the CUDA libraries come from PyTorch's wheels
#   load     fsdp.cuda.is_available(), why_not(), the device, the versions
#   specs    tests/backends/cuda_spec.lua on the real device, then every op case CUDA against the CPU
#            (tests/ops/ops_spec.lua, "cuda:" cases) with each case's largest errors in ops_report.tsv,
#            the FSDP matrix on the GPU, and every collective on GPU tensors through NCCL (one rank)
#   sanitize compute-sanitizer (memcheck) over the CUDA spec, where the machine has it
#   demo     examples/train.lua --device cuda (make demo's job on one GPU rank), its accuracies
#   ours     our GPT-2 124M on this GPU (bench/gpu_gpt.lua): FSDP mixed precision and plain bf16;
#            the 1.3 B configuration under FSDP, and with CPU offload
#   torch    PyTorch's, eager and FSDP2 (bench/torch_gpt2.py): the targets (tokens/s, MFU, memory),
#            the same two 1.3 B runs under FSDP2 (CPUOffloadPolicy for the second)
# The stage limits add up to 300 s, leaving room in a 15-minute lease for the machine's start and a
# rerun. `bash tools/gpu_check.sh --dry-run` writes each stage's command instead of running it: the
# stages, the limits and the archive, checked on any machine (tests/tools/gpu_check_spec.lua).
# The GPU machine has PyTorch but no LuaJIT; nothing here needs a package manager or the network.
#   OUT=/path bash tools/gpu_check.sh          (the device tool sets OUT)
set -uo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
OUT="${OUT:-$repo/tmp/gpu-check}"
KIT="${GPU_KIT:-$repo/tmp/gpu-kit}"
ROOT="${GPU_KIT_ROOT:-/tmp/fsdp-gpu-kit}"  # where the .deb files are unpacked
WORK="${GPU_CHECK_WORK:-/tmp/fsdp-gpu-check}"  # every stage's full output; $OUT gets one archive of it
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
mkdir -p "$OUT"
rm -rf "$WORK" && mkdir -p "$WORK"
: > "$OUT/summary.txt"
PY="$(command -v python3 || command -v python)"
t_start=$(date +%s)

say() { echo "[$(date +%T) +$(($(date +%s) - t_start))s] $*" | tee -a "$OUT/summary.txt"; }
# $OUT holds two files (the device tool returns at most 8): summary.txt and details.tar.gz, the
# archive of $WORK, packed again after every stage so a run cut short still returns what it did
pack() {
  cp "$OUT/summary.txt" "$WORK/summary.txt"
  tar -czf "$OUT/.details.part" -C "$WORK" . && mv -f "$OUT/.details.part" "$OUT/details.tar.gz"
}
# stage NAME LIMIT_SECONDS COMMAND...: runs COMMAND (a bash string) under its limit, output to
# $WORK/NAME.txt, the verdict and the output's last lines into the summary (--dry-run: the
# command is written there instead, so the stages, limits and archive are checked on any machine)
LIMITS=0
stage() {
  local name=$1 limit=$2 rc t0
  shift 2
  LIMITS=$((LIMITS + limit))
  say "stage $name (limit ${limit}s)"
  t0=$(date +%s)
  if [ "$DRY" = 1 ]; then
    printf 'dry run: would run, under %ss:\n%s\n' "$limit" "$*" > "$WORK/$name.txt"
    rc=0
  else
    timeout -k 5 "$limit" bash -c "$*" > "$WORK/$name.txt" 2>&1
    rc=$?
  fi
  say "stage $name: exit $rc$([ $rc -eq 124 ] && echo ' (TIMED OUT)') in $(($(date +%s) - t0))s"
  tail -n 6 "$WORK/$name.txt" | sed 's/^/    /' | tee -a "$OUT/summary.txt"
  pack
  return 0
}

# ---- env ------------------------------------------------------------------------------------------------
stage env 10 '
  echo "== nvidia-smi"; nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap,clocks.max.sm --format=csv || true
  nvidia-smi || true
  echo "== host"; uname -a; (ldd --version | head -1) || true; (lscpu | grep -E "Model name|^CPU\(s\)") || true
  free -g || true; df -h /tmp || true
  echo "== tools"; for t in nvcc compute-sanitizer gcc cc dpkg xz tar; do printf "%s: %s\n" $t "$(command -v $t || echo -)"; done
  echo "== python: '"$PY"'"
  '"$PY"' - <<PYEOF
import glob, os, sys
print("python", sys.version.split()[0])
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
          "nccl", ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-")
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        print("device", p.name, "sm_%d%d" % (p.major, p.minor), "%.1f GiB" % (p.total_memory / 2**30), "SMs", p.multi_processor_count)
except Exception as e:
    print("torch: not importable:", e)
for d in sys.path:
    for lib in ("libcublasLt.so*", "libcudnn.so*", "libnccl.so*", "libcudart.so*"):
        for f in glob.glob(os.path.join(d, "nvidia", "*", "lib", lib)):
            print("lib", f)
PYEOF
'

# ---- setup: the kit, unpacked with Python -----------------------------------------------------------------
stage setup 40 '
  set -e
  [ -d "'"$KIT"'/debs" ] || { echo "no kit at '"$KIT"': run tools/gpu_kit.sh on a development machine and carry tmp/gpu-kit"; exit 1; }
  echo "kit built from $(cat "'"$KIT"'/commit" 2>/dev/null), this tree at $(git -C "'"$repo"'" rev-parse HEAD 2>/dev/null || echo "?")"
  rm -rf "'"$ROOT"'" && mkdir -p "'"$ROOT"'"
  '"$PY"' - "'"$KIT"'/debs" "'"$ROOT"'" <<PYEOF
import glob, io, lzma, os, sys, tarfile
debs, root = sys.argv[1], sys.argv[2]
for deb in sorted(glob.glob(os.path.join(debs, "*.deb"))):
    with open(deb, "rb") as f:
        data = f.read()
    assert data[:8] == b"!<arch>\n", deb
    pos = 8
    while pos < len(data):  # ar members: 60-byte header, then the body, padded to even
        name = data[pos:pos + 16].decode().strip().rstrip("/")
        size = int(data[pos + 48:pos + 58].decode().strip())
        body = data[pos + 60:pos + 60 + size]
        pos += 60 + size + (size & 1)
        if name.startswith("data.tar"):
            mode = "r:xz" if name.endswith(".xz") else "r:gz" if name.endswith(".gz") else "r:"
            if name.endswith(".zst"):
                sys.exit("zstd data in " + deb)
            with tarfile.open(fileobj=io.BytesIO(body), mode=mode) as t:
                t.extractall(root)
    print("unpacked", os.path.basename(deb))
PYEOF
  # the kit'"'"'s build beside the packages, found through LUA_CPATH/LUA_PATH (a build in the checkout
  # itself, ./libfsdp.so, comes first: a dry run on a development machine tests that one)
  mkdir -p "'"$ROOT"'/fsdp/lib" "'"$ROOT"'/fsdp/lua/fsdp"
  cp "'"$KIT"'/lib/libfsdp.so" "'"$KIT"'/lib/libfsdp_cuda.so" "'"$ROOT"'/fsdp/lib/"
  cp "'"$KIT"'/lib/libfsdp_nccl.so" "'"$ROOT"'/fsdp/lib/" 2>/dev/null || echo "(no libfsdp_nccl.so in the kit)"
  cp "'"$KIT"'/lib/cdef.lua" "'"$ROOT"'/fsdp/lua/fsdp/cdef.lua"
  # the CUDA libraries libfsdp_cuda.so links (cuBLASLt 13, cuDNN 9): PyTorch'"'"'s wheels, else the system
  libdirs=$('"$PY"' -c "
import glob, os, sys
seen = []
for d in sys.path:
    for f in glob.glob(os.path.join(d, \"nvidia\", \"*\", \"lib\", \"lib*.so*\")):
        if os.path.dirname(f) not in seen: seen.append(os.path.dirname(f))
print(\":\".join(seen))")
  L="'"$ROOT"'/usr/lib/x86_64-linux-gnu"
  {
    echo "export PATH=\"'"$ROOT"'/usr/bin:\$PATH\""
    echo "export LD_LIBRARY_PATH=\"$L:$L/openblas-pthread:$libdirs:/usr/local/cuda/lib64:\${LD_LIBRARY_PATH:-}\""
    echo "export LUA_PATH=\"'"$repo"'/lua/?.lua;'"$repo"'/lua/?/init.lua;'"$ROOT"'/usr/share/lua/5.1/?.lua;'"$ROOT"'/usr/share/lua/5.1/?/init.lua;'"$ROOT"'/fsdp/lua/?.lua;;\""
    echo "export LUA_CPATH=\"$L/lua/5.1/?.so;'"$ROOT"'/fsdp/lib/?.so;;\""
    echo "export OPENBLAS_NUM_THREADS=4 OMP_NUM_THREADS=4"
  } > "'"$WORK"'/env.sh"
  cat "'"$WORK"'/env.sh"
  . "'"$WORK"'/env.sh"
  luajit -v
  ldd "'"$ROOT"'/fsdp/lib/"libfsdp*.so | grep -E "not found|=>" || true
'
[ "$DRY" = 1 ] && : > "$WORK/env.sh"
[ -f "$WORK/env.sh" ] || { say "no environment: stopping"; pack; exit 1; }

# ---- load -----------------------------------------------------------------------------------------------
stage load 10 '
  . "'"$WORK"'/env.sh"; cd "'"$repo"'"
  luajit -e "
package.path = \"lua/?.lua;lua/?/init.lua;\" .. package.path
package.cpath = \"./?.so;\" .. package.cpath
local fsdp = require \"fsdp\"
print(\"available\", fsdp.cuda.is_available(), \"why_not\", fsdp.cuda.why_not())
print(\"devices\", fsdp.cuda.device_count(), fsdp.cuda.get_device_name(), fsdp.cuda.versions())
print(\"cpu\", require(\"ffi\").string(fsdp.C.fsdp_cpu_isa()), require(\"ffi\").string(fsdp.C.fsdp_cpu_gemm_backend()))
local x = fsdp.randn(4, 5)
local d = x:cuda()
print(\"round trip max error\", ((d:cpu() - x):abs():max()):item())
print(\"matmul max error\", ((d:matmul(d:t())):cpu() - x:matmul(x:t())):abs():max():item())
fsdp.cuda.synchronize()"
'

# ---- specs: the CUDA spec and every op case against the CPU ------------------------------------------------
stage specs 75 '
  . "'"$WORK"'/env.sh"; cd "'"$repo"'"
  B="'"$ROOT"'/usr/bin/busted"
  rm -f "'"$WORK"'/ops_report.tsv"
  # TAP: one line per spec; the failures with their messages, then the counts
  tap() { luajit "$B" -o TAP "$@" > "'"$WORK"'/tap.txt" 2>&1; local rc=$?
    grep -A8 "^not ok" "'"$WORK"'/tap.txt" | head -60
    echo "$* -> $(grep -c "^ok" "'"$WORK"'/tap.txt") ok, $(grep -c "^not ok" "'"$WORK"'/tap.txt") not ok (exit $rc)"
    cat "'"$WORK"'/tap.txt" >> "'"$WORK"'/specs_tap.txt"; }
  : > "'"$WORK"'/specs_tap.txt"
  tap tests/backends/cuda_spec.lua
  FSDP_OP_REPORT="'"$WORK"'/ops_report.tsv" tap --filter="cuda:" tests/ops/ops_spec.lua
  # the FSDP matrix with the wrapped side on the GPU (one rank: no MPI on this machine)
  FSDP_MATRIX_DEVICE=cuda luajit tests/scripts/fsdp_matrix.lua > "'"$WORK"'/matrix.txt" 2>&1
  echo "fsdp matrix on the GPU: exit $?"; grep -E "^(SUMMARY|FAILED|DETAIL)" "'"$WORK"'/matrix.txt" | head -20
  # every collective on GPU tensors through the NCCL plane (one rank: real NCCL kernels, one
  # communicator per stream), against the closed forms of tests/scripts/comm_values.lua
  FSDP_VALUES_DEVICE=cuda FSDP_DEVICE_COMM=nccl timeout 60 luajit tests/scripts/comm_values.lua self \
    > "'"$WORK"'/nccl_values.txt" 2>&1
  echo "collectives through NCCL on the GPU: exit $?"; tail -n 5 "'"$WORK"'/nccl_values.txt"
'
if [ -f "$WORK/ops_report.tsv" ]; then
  # the largest errors per dtype, and the five worst cases (columns: backend, case, dtype, output
  # abs/rel, gradient abs/rel)
  awk -F'\t' '{k=$3; n[k]++; if ($5+0 > mo[k]) mo[k] = $5+0; if ($7+0 > mg[k]) mg[k] = $7+0}
    END {for (k in n) printf "  %s: %d cases, max rel error: outputs %.3g, gradients %.3g\n", k, n[k], mo[k], mg[k]}' \
    "$WORK/ops_report.tsv" | tee -a "$OUT/summary.txt"
  awk -F'\t' '{r = $5 > $7 ? $5 : $7; print r "\t" $0}' "$WORK/ops_report.tsv" | sort -gr | head -5 |
    cut -f2- | sed 's/^/  worst: /' | tee -a "$OUT/summary.txt"
fi

# ---- sanitize -------------------------------------------------------------------------------------------
stage sanitize 25 '
  . "'"$WORK"'/env.sh"; cd "'"$repo"'"
  S=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
  [ -n "$S" ] || { echo "compute-sanitizer: not on this machine (skipped)"; exit 0; }
  "$S" --tool memcheck --error-exitcode 9 luajit "'"$ROOT"'/usr/bin/busted" -o TAP tests/backends/cuda_spec.lua
'

# ---- demo: the main job on the GPU (one rank), its accuracies against make demo's -------------------------------
stage demo 40 '
  . "'"$WORK"'/env.sh"; cd /tmp
  FSDP_STDOUT_TTY=0 luajit "'"$repo"'/examples/train.lua" --device cuda --data "'"$KIT"'/data" --ckpt /tmp/fsdp-gpu-demo
'

# ---- ours and torch: GPT-2 124M on this GPU (the targets) -------------------------------------------------------
stage ours 50 '
  . "'"$WORK"'/env.sh"; cd "'"$repo"'"
  luajit bench/gpu_gpt.lua --mode fsdp --batch 8 --steps 5
  luajit bench/gpu_gpt.lua --mode bf16 --batch 8 --steps 5
  luajit bench/gpu_gpt.lua --mode fsdp --config 1b --batch 4 --steps 3
  luajit bench/gpu_gpt.lua --mode fsdp --config 1b --batch 4 --steps 2 --offload
'
stage torch 50 "$PY bench/torch_gpt2.py --batch 8 --steps 10 --fsdp2
  $PY bench/torch_gpt2.py --config 1b --batch 4 --steps 3 --fsdp2 --no-eager
  $PY bench/torch_gpt2.py --config 1b --batch 4 --steps 2 --fsdp2 --no-eager --offload"

say "done in $(($(date +%s) - t_start))s (stage limits: ${LIMITS}s); results in $OUT: summary.txt, details.tar.gz"
pack
