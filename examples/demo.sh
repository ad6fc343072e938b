#!/usr/bin/env bash
# `make demo`: install what is missing (Debian packages), then train on Fashion-MNIST.
set -euo pipefail
cd "$(dirname "$0")/.."

need=""
for p in luajit libopenblas-dev dataset-fashion-mnist; do dpkg -s "$p" >/dev/null 2>&1 || need="$need $p"; done
if [ -n "$need" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing Debian packages:$need -- run: sudo apt-get install$need" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends $need
fi

export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-2} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec luajit examples/mlp.lua "$@"
