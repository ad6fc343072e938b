#!/usr/bin/env bash
# `make demo`: install what is missing (Debian packages), build, then the main job:
# FSDP pretraining of a conv net on Fashion-MNIST on 2 ranks, a checkpoint every epoch, and a
# linear evaluation of the frozen trunk (examples/train.lua). 2-6 minutes on 2 CPU cores, depending on the CPU.
#
#   bash examples/demo.sh [train.lua flags...]      e.g. --epochs 2, --ckpt DIR (see --help)
#   DEMO_RANKS=4 bash examples/demo.sh              another number of ranks (default 2)
#   DEMO_SCRIPT=gpt.lua bash examples/demo.sh       `make demo-gpt`: the second job, a character-level
#                                                   GPT on the fortunes text (examples/gpt.lua)
set -euo pipefail
cd "$(dirname "$0")/.."

bash tools/deps.sh demo   # installs what is missing (root), else names the apt-get line and exits 1
make
ranks="${DEMO_RANKS:-2}"
script="${DEMO_SCRIPT:-train.lua}"
echo "make demo: bin/fsdprun -n $ranks examples/$script $*"
start=$(date +%s)
status=0
bin/fsdprun -n "$ranks" "examples/$script" "$@" || status=$?
end=$(date +%s)
echo "make demo: wall time $((end - start)) s ($(( (end - start) / 60 )) min $(( (end - start) % 60 )) s), exit status $status"
exit "$status"
