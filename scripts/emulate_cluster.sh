#!/usr/bin/env bash
# Emulate an N-node cluster on one Linux machine with network namespaces.
#
# Topology (one run):
#
#   ns mmoe-<pid>-n0        ns mmoe-<pid>-hub          ns mmoe-<pid>-n1
#   veth0 10.77.0.1 <-----> hub0 -- br0 -- hub1 <-----> veth1 10.77.0.2
#   (tbf egress)            (tbf egress)  (tbf egress)  (tbf egress)
#
# Each node is a namespace with its own loopback, so processes of one node talk
# over `lo` (unshaped), while traffic between nodes crosses two veth links and
# a bridge. A token-bucket filter on the node side limits what a node sends and
# one on the hub side limits what it receives: every node gets a full-duplex
# link of --inter-node-rate, like a NIC on a non-blocking switch.
#
# The namespace names carry this script's PID, so concurrent runs never share
# a name; the subnet can be the same in every run because each run's bridge
# lives in its own hub namespace and is unreachable from any other run.
#
# See docs/CLUSTER.md for what is and is not modelled.
set -euo pipefail

readonly PROG=emulate_cluster.sh
readonly SUBNET_PREFIX=10.77.0     # node i gets $SUBNET_PREFIX.(i+1)/24
readonly NS_PREFIX="mmoe-$$"
readonly TBF_LATENCY=50ms          # tbf queue limit, not a delay

usage() {
    cat <<EOF
usage: $PROG [options] -- COMMAND [ARGS...]

Run COMMAND on N emulated nodes (network namespaces joined by a shaped bridge).

options:
  --nodes N                 number of nodes (default 2, at most 250)
  --procs-per-node G        processes per node, passed to torchrun (default 1)
  --inter-node-rate R       per-node link rate in tc units, e.g. 1gbit, 200mbit;
                            'none' leaves links unshaped (default 1gbit)
  --inter-node-delay D      one-way inter-node delay, e.g. 0.1ms, 50us, 0; needs
                            tc netem, which many kernels lack: then it is
                            ignored with a warning (default 0)
  --burst B                 tbf bucket size (default 64kb)
  --mtu N                   MTU of the inter-node links, 576..65535 (default
                            9000, jumbo frames; see docs/CLUSTER.md)
  --master-port P           rendezvous port on node 0 (default 29500)
  --timeout S               stop all nodes after S seconds, exit 124 (default: none)
  --grace S                 once a node fails, give the others S seconds to
                            finish before stopping them (default 10)
  --no-torchrun             run COMMAND directly once per node, with NODE_RANK,
                            NNODES, NPROC_PER_NODE, MASTER_ADDR, MASTER_PORT set
  -h, --help                show this help

COMMAND is started as 'torchrun --nnodes N --nproc-per-node G --node-rank i
--master-addr <node 0 ip> --master-port P COMMAND...' in node i when it is a
.py file ('-m module' works too); any other executable gets torchrun --no-python.
Every node sees GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME=<its veth> and
OMP_NUM_THREADS=\${OMP_NUM_THREADS:-1}. Needs root and iproute2 (ip, tc).
Exit status: 0 if all nodes succeed, else the first failing node's status;
2 for usage or environment errors; 124 on --timeout; 130/143 on INT/TERM.
EOF
}

die() { echo "$PROG: error: $*" >&2; exit 2; }
log() { echo "[emulate] $*" >&2; }

# ---------------------------------------------------------------- arguments
NODES=2
PROCS=1
RATE=1gbit
DELAY=0
BURST=64kb
MTU=9000
PORT=29500
TIMEOUT=0
GRACE=10
USE_TORCHRUN=1
CMD=()

need_value() { [[ $# -ge 2 && $2 != --* ]] || die "$1 needs a value"; }

while [[ $# -gt 0 ]]; do
    arg=$1
    if [[ $arg == --*=* ]]; then          # accept --flag=value as well
        set -- "${arg%%=*}" "${arg#*=}" "${@:2}"
        arg=$1
    fi
    case $arg in
        --nodes) need_value "$@"; NODES=$2; shift 2 ;;
        --procs-per-node|--nproc-per-node) need_value "$@"; PROCS=$2; shift 2 ;;
        --inter-node-rate) need_value "$@"; RATE=$2; shift 2 ;;
        --inter-node-delay) need_value "$@"; DELAY=$2; shift 2 ;;
        --burst) need_value "$@"; BURST=$2; shift 2 ;;
        --mtu) need_value "$@"; MTU=$2; shift 2 ;;
        --master-port) need_value "$@"; PORT=$2; shift 2 ;;
        --timeout) need_value "$@"; TIMEOUT=$2; shift 2 ;;
        --grace) need_value "$@"; GRACE=$2; shift 2 ;;
        --no-torchrun) USE_TORCHRUN=0; shift ;;
        -h|--help) usage; exit 0 ;;
        --) shift; CMD=("$@"); break ;;
        *) die "unknown option '$arg' (put the command after '--'; see --help)" ;;
    esac
done

is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }
in_range() { is_uint "$1" && ((10#$1 >= $2 && 10#$1 <= $3)); }
in_range "$NODES" 1 250 || die "--nodes must be an integer in 1..250, got '$NODES'"
in_range "$PROCS" 1 4096 || die "--procs-per-node must be a positive integer, got '$PROCS'"
in_range "$PORT" 1 65535 || die "--master-port must be in 1..65535, got '$PORT'"
in_range "$MTU" 576 65535 || die "--mtu must be an integer in 576..65535, got '$MTU'"
is_uint "$TIMEOUT" || die "--timeout must be a whole number of seconds, got '$TIMEOUT'"
is_uint "$GRACE" || die "--grace must be a whole number of seconds, got '$GRACE'"
NODES=$((10#$NODES)) PROCS=$((10#$PROCS)) PORT=$((10#$PORT)) MTU=$((10#$MTU)) TIMEOUT=$((10#$TIMEOUT)) GRACE=$((10#$GRACE))
shopt -s nocasematch
[[ $RATE == none || $RATE =~ ^[0-9]+(\.[0-9]+)?([kmgt]i?)?(bit|bps)$ ]] \
    || die "--inter-node-rate must look like 1gbit, 200mbit, 12.5mbps or none, got '$RATE'"
[[ $DELAY =~ ^[0-9]+(\.[0-9]+)?(s|ms|us|msec|usec)?$ ]] \
    || die "--inter-node-delay must look like 0.1ms, 50us or 0, got '$DELAY'"
[[ $BURST =~ ^[0-9]+([kmg]b?|b)?$ ]] || die "--burst must look like 64kb, got '$BURST'"
shopt -u nocasematch
[[ ${#CMD[@]} -gt 0 ]] || die "no command given; usage: $PROG [options] -- COMMAND [ARGS...]"

# ---------------------------------------------------------------- preflight
[[ $(id -u) -eq 0 ]] || die "must run as root: creating network namespaces needs CAP_NET_ADMIN (try sudo -E $PROG ...)"
command -v ip >/dev/null || die "'ip' (iproute2) not found on PATH"
command -v tc >/dev/null || die "'tc' (iproute2) not found on PATH"
ip netns list >/dev/null 2>&1 || die "'ip netns' is not available here (no network-namespace support?)"
if ((USE_TORCHRUN)); then
    command -v torchrun >/dev/null || die "torchrun not found on PATH (activate the virtualenv, or pass --no-torchrun)"
fi
for ns in "$NS_PREFIX-hub" $(seq -f "$NS_PREFIX-n%g" 0 $((NODES - 1))); do
    [[ ! -e /var/run/netns/$ns ]] || die "namespace $ns already exists (stale run?); remove it with: ip netns del $ns"
done

# ---------------------------------------------------------------- cleanup
CREATED_NS=()   # namespaces to delete, hub first
NODE_PIDS=()    # one process group per node (setsid), indexed by node
CLEANED=0

# shellcheck disable=SC2317  # the functions below run from traps only
# Stop every process of this run: first each node's process group, then
# anything still living in our namespaces (e.g. a process that left its group).
# shellcheck disable=SC2329  # invoked from a trap
stop_nodes() {
    local pid ns tries
    for pid in "${NODE_PIDS[@]}"; do kill -TERM -- "-$pid" 2>/dev/null || true; done
    for ((tries = 0; tries < 50; tries++)); do
        local alive=0
        for pid in "${NODE_PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        ((alive)) || break
        sleep 0.1
    done
    for pid in "${NODE_PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
    for ns in "${CREATED_NS[@]}"; do
        for pid in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$pid" 2>/dev/null || true; done
    done
}

# shellcheck disable=SC2317
# shellcheck disable=SC2329  # invoked from a trap
cleanup() {
    set +e   # best effort: one failed step must not skip the rest
    ((CLEANED)) && return
    CLEANED=1
    stop_nodes
    # Deleting a namespace destroys its interfaces; a veth pair dies with
    # either end, so the bridge ports and node links all go.
    local ns
    for ns in "${CREATED_NS[@]}"; do
        [[ ! -e /var/run/netns/$ns ]] || ip netns del "$ns" || log "could not delete namespace $ns"
    done
    wait 2>/dev/null || true   # let the output prefixers flush
}

# shellcheck disable=SC2317
# shellcheck disable=SC2329  # invoked from a trap
on_signal() { log "caught $1, stopping nodes and removing namespaces"; exit "$2"; }
trap cleanup EXIT
trap 'on_signal SIGINT 130' INT
trap 'on_signal SIGTERM 143' TERM

# ---------------------------------------------------------------- network
HUB="$NS_PREFIX-hub"
node_ns() { echo "$NS_PREFIX-n$1"; }
node_ip() { echo "$SUBNET_PREFIX.$(($1 + 1))"; }

shape() {  # shape NS DEV: token bucket on DEV's egress
    [[ $RATE == none ]] && return
    tc -n "$1" qdisc add dev "$2" root handle 1: tbf rate "$RATE" burst "$BURST" latency "$TBF_LATENCY" \
        || die "tc tbf failed on $2 in $1 (bad --inter-node-rate '$RATE' or --burst '$BURST'?)"
}

DELAY_APPLIED=0
add_delay() {  # add_delay NS DEV: netem delay under the tbf, on the node side only
    [[ $DELAY =~ ^0+(\.0+)?[a-z]*$ ]] && return
    local parent=(root)
    [[ $RATE == none ]] || parent=(parent 1:1)
    if tc -n "$1" qdisc add dev "$2" "${parent[@]}" handle 10: netem delay "$DELAY" 2>/dev/null; then
        DELAY_APPLIED=1
    elif ((DELAY_APPLIED == 0)); then
        DELAY_APPLIED=-1
    fi
}

trap 'die "network setup failed (see the ip/tc message above)"' ERR
CREATED_NS+=("$HUB")      # recorded first: an interrupt right after the add still cleans it
ip netns add "$HUB"
ip -n "$HUB" link set lo up
ip -n "$HUB" link add br0 type bridge
ip -n "$HUB" link set br0 up
for ((i = 0; i < NODES; i++)); do
    ns=$(node_ns "$i")
    CREATED_NS+=("$ns")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # Create the pair inside the hub and push the peer into the node, so no
    # interface name is ever visible in (or can collide in) the root namespace.
    ip -n "$HUB" link add "hub$i" type veth peer name "veth$i" netns "$ns"
    ip -n "$HUB" link set "hub$i" mtu "$MTU" || die "cannot set --mtu $MTU on the node links"
    ip -n "$ns" link set "veth$i" mtu "$MTU" || die "cannot set --mtu $MTU on the node links"
    ip -n "$HUB" link set "hub$i" master br0 up
    ip -n "$ns" addr add "$(node_ip "$i")/24" dev "veth$i"
    ip -n "$ns" link set "veth$i" up
    shape "$ns" "veth$i"      # node -> switch (what node i sends)
    shape "$HUB" "hub$i"      # switch -> node (what node i receives)
    add_delay "$ns" "veth$i"
done
trap - ERR
if ((DELAY_APPLIED < 0)); then
    log "WARNING: --inter-node-delay $DELAY ignored: tc netem is not available in this kernel;"
    log "         inter-node latency is the veth/bridge latency only (tens of microseconds)"
fi

MASTER_ADDR=$(node_ip 0)
log "$NODES nodes x $PROCS procs, rate ${RATE} per direction, MTU $MTU, namespaces $NS_PREFIX-{hub,n0..n$((NODES - 1))}, master $MASTER_ADDR:$PORT"

# ---------------------------------------------------------------- launch
launcher_for() {  # launcher_for NODE_RANK -> fills LAUNCH with the per-node command
    LAUNCH=()
    if ((USE_TORCHRUN == 0)); then
        LAUNCH=("${CMD[@]}")
        return
    fi
    LAUNCH=(torchrun --nnodes "$NODES" --nproc-per-node "$PROCS" --node-rank "$1"
        --master-addr "$MASTER_ADDR" --master-port "$PORT")
    if [[ ${CMD[0]} == *.py || ${CMD[0]} == -m ]]; then
        LAUNCH+=("${CMD[@]}")
    else
        LAUNCH+=(--no-python "${CMD[@]}")
    fi
}

for ((i = 0; i < NODES; i++)); do
    launcher_for "$i"
    # setsid: each node is its own process group, so one kill stops torchrun
    # and all its workers, and a terminal Ctrl-C reaches only this script.
    setsid ip netns exec "$(node_ns "$i")" env \
        GLOO_SOCKET_IFNAME="veth$i" NCCL_SOCKET_IFNAME="veth$i" \
        OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
        NODE_RANK="$i" NNODES="$NODES" NPROC_PER_NODE="$PROCS" \
        MASTER_ADDR="$MASTER_ADDR" MASTER_PORT="$PORT" \
        "${LAUNCH[@]}" > >(sed -u "s/^/[node $i] /") 2>&1 &
    NODE_PIDS[i]=$!
done

# ---------------------------------------------------------------- wait
# Poll instead of `wait -n -p` so bash 4.x works too. Once a node fails the
# others get --grace seconds to report, then are stopped: a peer that lost its
# partner would otherwise hang until a collective timeout.
START=$SECONDS
STATUS=0
FAILED_AT=-1
declare -A LIVE=()
for ((i = 0; i < NODES; i++)); do LIVE[$i]=1; done
while ((${#LIVE[@]} > 0)); do
    for i in "${!LIVE[@]}"; do
        kill -0 "${NODE_PIDS[i]}" 2>/dev/null && continue
        st=0
        wait "${NODE_PIDS[i]}" || st=$?
        unset "LIVE[$i]"
        if ((st != 0)); then
            log "node $i exited with status $st"
            if ((STATUS == 0)); then STATUS=$st; FAILED_AT=$SECONDS; fi
        fi
    done
    if ((${#LIVE[@]} > 0 && FAILED_AT >= 0 && SECONDS - FAILED_AT >= GRACE)); then
        log "stopping nodes ${!LIVE[*]} after a node failed"
        break
    fi
    if ((TIMEOUT > 0 && SECONDS - START >= TIMEOUT)); then
        log "timeout after ${TIMEOUT}s, stopping nodes ${!LIVE[*]}"
        STATUS=124
        break
    fi
    sleep 0.2
done
exit "$STATUS"
