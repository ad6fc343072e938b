#!/usr/bin/env bash
# tools/gpu_kit.sh [DIR]: packs what tools/gpu_check.sh needs on a GPU machine that has PyTorch and
# its CUDA libraries but no LuaJIT and no package manager to rely on (DIR, default tmp/gpu-kit,
# ignored by git; about 50 MiB, carried to the GPU machine with the working tree, which together
# must stay within the 64 MiB that travel: checked at the end):
#   debs/   Debian's .deb files of LuaJIT, OpenBLAS, oneDNN and their libraries, and busted with its
#           Lua modules (gpu_check.sh unpacks them with Python: no dpkg needed there)
#   lib/    libfsdp.so, libfsdp_cuda.so and libfsdp_nccl.so built from this working tree for any x86-64-v3 CPU
#           (AVX2; oneDNN and the CPU kernels still pick AVX-512 at run time where it is), and the
#           generated lua/fsdp/cdef.lua
#   data/   Fashion-MNIST (the demo's data set)
# Run it on a development machine (Debian, nvcc on PATH) before the GPU run; apt-get download
# needs Debian's mirror.
set -euo pipefail
cd "$(dirname "$0")/.."
kit="${1:-tmp/gpu-kit}"
command -v nvcc >/dev/null || { echo "gpu_kit: nvcc is not on PATH: libfsdp_cuda.so cannot be built" >&2; exit 1; }
rm -rf "$kit" && mkdir -p "$kit/debs" "$kit/lib"
kit="$(cd "$kit" && pwd)"

# the library, from a copy of the working tree (tracked and new files, uncommitted changes too)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$work"
make -C "$work" -j2 DEPS=skip ARCH=-march=x86-64-v3 libfsdp.so libfsdp_cuda.so libfsdp_nccl.so lua/fsdp/cdef.lua >/dev/null
cp "$work/libfsdp.so" "$work/libfsdp_cuda.so" "$work/libfsdp_nccl.so" "$work/lua/fsdp/cdef.lua" "$kit/lib/"

# the packages (apt-get download as root warns that it cannot drop to _apt: harmless)
pkgs=(luajit libluajit-5.1-2 libluajit-5.1-common libopenblas0-pthread libdnnl2 libgfortran5 libquadmath0
      ocl-icd-libopencl1 libgomp1 lua-busted lua-cliargs lua-dkjson lua-filesystem lua-luassert lua-mediator
      lua-penlight lua-say lua-system lua-term)
(cd "$kit/debs" && apt-get download "${pkgs[@]}" 2>&1 | grep -v "^W: Download is performed unsandboxed" >&2 || true)
n=$(ls "$kit/debs"/*.deb | wc -l)
[ "$n" -eq "${#pkgs[@]}" ] || { echo "gpu_kit: got $n of ${#pkgs[@]} packages" >&2; exit 1; }
# Fashion-MNIST for the demo on the GPU (Debian's dataset-fashion-mnist, 30 MB)
data="$(luajit -e 'package.path = "lua/?.lua;lua/?/init.lua;" .. package.path; package.cpath = "./?.so;" .. package.cpath
  io.write(require("fsdp.data.fashion_mnist").find_dir(nil))')"
mkdir -p "$kit/data"
cp -L "$data"/*-ubyte.gz "$kit/data/" || { echo "gpu_kit: no Fashion-MNIST in $data (apt-get install dataset-fashion-mnist)" >&2; exit 1; }
git rev-parse HEAD > "$kit/commit"
# what travels to the GPU machine: the kit and the working tree's files, at most 64 MiB in all
kit_bytes=$(du -sb "$kit" | cut -f1)
tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "gpu_kit: kit $((kit_bytes / 1048576)) MiB + tree $((tree_bytes / 1048576)) MiB = $(((kit_bytes + tree_bytes) / 1048576)) MiB (limit 64 MiB)"
[ $((kit_bytes + tree_bytes)) -le $((64 * 1048576)) ] || { echo "gpu_kit: over the 64 MiB that travel" >&2; exit 1; }
