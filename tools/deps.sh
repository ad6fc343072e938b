#!/usr/bin/env bash
# deps.sh -- the Debian packages each entry point needs, in one place, and the one step that
# installs them. Called first by `make demo`, `make test` and `.ci/run`, before anything compiles
# (never as a prerequisite of a target that needs the packages: make would build first).
#
#   tools/deps.sh SET            install what SET lacks (as root), or print the one
#                                `apt-get install ...` line and exit 1 (not root)
#   tools/deps.sh --check SET    never install: print the line and exit 1 when something lacks
#   tools/deps.sh --list SET     print SET's packages
#
# Sets (each includes the one before):
#   build   compile libfsdp.so and libfsdp_mpi.so and run scripts (`make`)
#   demo    + the data sets (Fashion-MNIST, the fortunes text) and the plot tool (`make demo`,
#           `make demo-gpt`)
#   test    + busted, luarocks and g++ (`make test`; g++ builds the CUDA executor, tests/cudaemu)
#   ci      + the guardrail tools and git (`.ci/run`: lint, format check, valgrind) and doc's
#
# and beside them:
#   doc     LDoc (`make doc`: the API reference)
#   emu     Bochs, its BIOS, busybox, isolinux, xorriso and cpio (`make isa-emu-check`: the AVX-512
#           copy on an emulated CPU, tools/isa_emu.sh)
#
# On a machine without dpkg (not Debian), or with DEPS=skip, nothing is checked: the compiler's
# errors speak then.
set -euo pipefail

build="gcc make pkg-config luajit libopenblas-dev libdnnl-dev libopenmpi-dev openmpi-bin"
demo="$build dataset-fashion-mnist gnuplot-nox fortunes"
test="$demo libluajit-5.1-dev lua-busted luarocks g++"
doc="lua-ldoc"
emu="bochs bochs-term bochsbios vgabios busybox-static isolinux syslinux-common xorriso cpio"
ci="$test $doc git cppcheck valgrind clang-format iproute2"

mode=install
case "${1:-}" in
  --check) mode=check; shift ;;
  --list) mode=list; shift ;;
esac
set_name="${1:-}"
case "$set_name" in
  build) pkgs="$build" ;;
  demo) pkgs="$demo" ;;
  test) pkgs="$test" ;;
  ci) pkgs="$ci" ;;
  doc) pkgs="$doc" ;;
  emu) pkgs="$emu" ;;
  *) echo "usage: tools/deps.sh [--check|--list] build|demo|test|ci|doc|emu" >&2; exit 2 ;;
esac

if [ "$mode" = list ]; then echo "$pkgs"; exit 0; fi
# DEPS=skip (e.g. `make DEPS=skip`): the libraries come from elsewhere than Debian's packages
[ "${DEPS:-}" = skip ] && exit 0
command -v dpkg-query >/dev/null 2>&1 || exit 0

missing=""
for p in $pkgs; do
  # "install ok installed" only: a removed package leaves "deinstall ok config-files" behind
  [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing="$missing $p"
done
[ -z "$missing" ] && exit 0

if [ "$mode" = check ] || [ "$(id -u)" -ne 0 ]; then
  echo "fsdp: missing Debian packages:$missing" >&2
  echo "install them with:  sudo apt-get install$missing" >&2
  exit 1
fi
echo "fsdp: installing$missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $missing
