#!/usr/bin/env bash
# `make demo`: install what is missing (Debian packages), build, then the main job:
# FSDP pretraining of a conv net on Fashion-MNIST on 2 ranks, a checkpoint every epoch, and a
# linear evaluation of the frozen trunk (examples/train.lua). About 10 minutes on 2 CPU cores.
#
#   bash examples/demo.sh [train.lua flags...]      e.g. --epochs 2, --ckpt DIR (see --help)
#   DEMO_RANKS=4 bash examples/demo.sh              another number of ranks (default 2)
set -euo pipefail
cd "$(dirname "$0")/.."

pkgs="gcc make pkg-config luajit libopenblas-dev libopenmpi-dev openmpi-bin dataset-fashion-mnist gnuplot-nox"
need=""
for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || need="$need $p"; done
if [ -n "$need" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "make demo: missing Debian packages:$need" >&2
    echo "install them with:  sudo apt-get install$need" >&2
    exit 1
  fi
  echo "make demo: installing$need"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends $need
fi

make
ranks="${DEMO_RANKS:-2}"
echo "make demo: bin/fsdprun -n $ranks examples/train.lua $*"
start=$(date +%s)
status=0
bin/fsdprun -n "$ranks" examples/train.lua "$@" || status=$?
end=$(date +%s)
echo "make demo: wall time $((end - start)) s ($(( (end - start) / 60 )) min $(( (end - start) % 60 )) s), exit status $status"
exit "$status"
