#!/usr/bin/env bash
# fresh_debian_check.sh -- the first-contact check on a fresh Debian 12: a debootstrap chroot
# (minbase: none of the project's packages) gets only `make` and `git`, clones this repository's
# main branch, and runs, timing each and checking `git status` after each:
#   make demo                 (installs its packages first, builds, trains)
#   CI=true bash .ci/run      (installs the rest, make test, the README's commands, guardrails)
# Root only (debootstrap, chroot, mounts). The chroot lives in tmp/debian12 (ignored by git); the
# untouched base system is kept as tmp/debian12-base.tar, so each run starts from a fresh copy.
#   sudo tools/fresh_debian_check.sh [both|demo|ci]     (default both: make demo, then .ci/run in the
#                                                       same clone; demo or ci: one of them alone)
set -euo pipefail
cd "$(dirname "$0")/.."
repo="$(pwd)"
what="${1:-both}"
[ "$(id -u)" -eq 0 ] || { echo "fresh_debian_check.sh: needs root (debootstrap, chroot)" >&2; exit 1; }
mirror="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
base="$repo/tmp/debian12-base.tar"
root="$repo/tmp/debian12"
mkdir -p "$repo/tmp"

if [ ! -f "$base" ]; then
  command -v debootstrap >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap; }
  rm -rf "$root.build"
  debootstrap --variant=minbase bookworm "$root.build" "$mirror"
  tar -C "$root.build" -cf "$base" .
  rm -rf "$root.build"
fi

mounts=()
cleanup() {
  for ((i = ${#mounts[@]} - 1; i >= 0; i--)); do umount -l "${mounts[i]}" 2>/dev/null || true; done
}
trap cleanup EXIT
# removes the chroot, never while anything is still mounted inside it (the repository is)
remove_root() {
  if grep -q " $root/" /proc/mounts; then
    echo "fresh_debian_check.sh: still mounted under $root, not removing it:" >&2
    grep " $root/" /proc/mounts >&2
    exit 1
  fi
  rm -rf --one-file-system "$root"
}
fresh_root() {
  cleanup; mounts=()
  remove_root
  mkdir -p "$root"
  tar -C "$root" -xf "$base"
  for m in proc sys dev dev/pts dev/shm; do
    mkdir -p "$root/$m"
    case "$m" in
      proc) mount -t proc proc "$root/proc" ;;
      *) mount --bind "/$m" "$root/$m" ;;
    esac
    mounts+=("$root/$m")
  done
  mkdir -p "$root/mnt/src"
  mount --bind -o ro "$repo" "$root/mnt/src"
  mounts+=("$root/mnt/src")
  # what an installed machine has: name servers, and its own host name in /etc/hosts (without
  # it every mpirun waits ~5 s on DNS for the host name)
  cp /etc/resolv.conf "$root/etc/resolv.conf"
  cp /etc/hosts "$root/etc/hosts"
}

# runs one scenario in a fresh chroot; the commands' output goes to tmp/fresh-NAME.log
scenario() {
  local name="$1" cmds="$2"
  fresh_root
  echo "== fresh Debian 12 chroot: $name (log: tmp/fresh-$name.log)"
  chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    TERM=dumb LANG=C.UTF-8 bash -c "
    set -euo pipefail
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends make git ca-certificates >/dev/null
    git config --global --add safe.directory '*'
    git clone -q /mnt/src /root/fsdp
    cd /root/fsdp
    bash tools/deps.sh --check ci 2>&1 | sed -n 's/^fsdp: missing/project packages before: missing/p' || true
    timed() {
      local t0=\$(date +%s)
      local rc=0
      \"\$@\" || rc=\$?
      echo \"== \$* : exit \$rc after \$(( \$(date +%s) - t0 )) s\"
      local dirty=\$(git status --porcelain --untracked-files=all)
      [ -z \"\$dirty\" ] && echo \"== git status clean after: \$*\" || { echo \"== git status NOT clean after \$*:\"; echo \"\$dirty\"; rc=1; }
      return \$rc
    }
    $cmds
  " > "$repo/tmp/fresh-$name.log" 2>&1 || { echo "   FAILED:"; grep '^== ' "$repo/tmp/fresh-$name.log" || tail -20 "$repo/tmp/fresh-$name.log"; return 1; }
  grep '^== \|project packages before\|test accuracy:' "$repo/tmp/fresh-$name.log"
}

status=0
case "$what" in
  both) scenario demo-then-ci 'timed make demo; timed env CI=true bash .ci/run' || status=1 ;;
  demo) scenario demo 'timed make demo' || status=1 ;;
  ci) scenario ci 'timed env CI=true bash .ci/run' || status=1 ;;
  *) echo "usage: tools/fresh_debian_check.sh [both|demo|ci]" >&2; exit 2 ;;
esac
cleanup; mounts=()
remove_root
exit "$status"
