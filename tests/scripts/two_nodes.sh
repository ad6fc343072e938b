#!/bin/sh
# Two "machines" on this one: network namespaces joined by a veth pair (10.77.N.1 and 10.77.N.2),
# each with a hostname of its own (a UTS namespace per process tree), so OpenMPI sees two nodes and
# carries the ranks between them over TCP, as between real hosts. Root only.
#
#   two_nodes.sh up N          create the namespaces fsdpnA<N>, fsdpnB<N> (N: a small number)
#   two_nodes.sh run N CMD...  run CMD on node A (mpirun there starts node B's daemon through a
#                              link to this script, TMPDIR/fsdp_two_nodes_agent_N, OpenMPI's
#                              plm_rsh_agent, in place of ssh: called as AGENT HOST CMD)
#   two_nodes.sh down N        remove them
set -eu
op="$1"
shift
case "$op" in
  up)
    n="$1"
    ip netns add "fsdpnA$n"
    ip netns add "fsdpnB$n"
    ip link add "fsdpvA$n" type veth peer name "fsdpvB$n"
    ip link set "fsdpvA$n" netns "fsdpnA$n"
    ip link set "fsdpvB$n" netns "fsdpnB$n"
    ip -n "fsdpnA$n" addr add "10.77.$n.1/24" dev "fsdpvA$n"
    ip -n "fsdpnB$n" addr add "10.77.$n.2/24" dev "fsdpvB$n"
    for s in A B; do
      ip -n "fsdpn$s$n" link set lo up
      ip -n "fsdpn$s$n" link set "fsdpv$s$n" up
    done
    ;;
  down)
    n="$1"
    ip netns del "fsdpnA$n" 2>/dev/null || true
    ip netns del "fsdpnB$n" 2>/dev/null || true
    rm -f "${TMPDIR:-/tmp}/fsdp_two_nodes_agent_$n"
    ;;
  run)
    n="$1"
    shift
    agent="${TMPDIR:-/tmp}/fsdp_two_nodes_agent_$n"
    ln -sf "$(readlink -f "$0")" "$agent"
    export FSDPRUN_MPIRUN_ARGS="--mca plm_rsh_agent $agent --mca btl self,vader,tcp \
--mca btl_tcp_if_include 10.77.$n.0/24 --mca oob_tcp_if_include 10.77.$n.0/24"
    exec ip netns exec "fsdpnA$n" unshare --uts /bin/sh -c 'hostname "nodeA$0" && exec "$@"' "$n" "$@"
    ;;
  *)
    # called as fsdp_two_nodes_agent_<N> HOST CMD...: OpenMPI starting its daemon on HOST
    n="${0##*_agent_}"
    host="$op"
    case "$host" in
      "10.77.$n.1") s=A ;;
      "10.77.$n.2") s=B ;;
      *) echo "two_nodes.sh: unknown host $host" >&2; exit 1 ;;
    esac
    exec ip netns exec "fsdpn$s$n" unshare --uts /bin/sh -c "hostname node$s$n && $*"
    ;;
esac
