#!/usr/bin/env bash
# bench/net/throttled_net.sh: a throttled network between MPI ranks on one
# machine (issue 34, part).
#
# Each rank gets its own network namespace (zincnet<pid>_r<i>) with one veth
# whose peer sits on a bridge in a namespace of its own (zincnet<pid>_br);
# nothing is created in, or changed on, the host's namespace except the
# namespace files themselves. tc tbf caps every veth's egress on both ends
# (the rank's egress on its own side, its ingress on the bridge side), so
# each rank has a full-duplex link of --rate, like a switch port. mpirun runs
# in a launcher namespace (zincnet<pid>_la) on the same bridge, unthrottled,
# and starts each rank as `ip netns exec <ns> CMD`: Open MPI 4.1's PMIx 4 has
# no unix-socket transport and listens on 127.0.0.1 unless told to accept
# remote connections on the veth subnet, which the script does. The ranks'
# MPI traffic goes over Open MPI's TCP BTL on that subnet only (no vader, no
# UCX, ZINC_COMM_BACKEND=mpi). The veth byte counters before and after give
# the bytes each rank put on the wire (GSO super-packets: payload plus
# headers once per ~64 KiB).
#
# --per-node K puts K consecutive ranks in each namespace: a "node" of K
# ranks that reach each other over the namespace's own loopback (Open MPI's
# TCP BTL to the node's address, routed locally: not capped), with the
# capped veth between nodes only; the byte counters are then per node.
# (zinc's shared-memory transport is not used: set up across network
# namespaces its window creation hangs, not diagnosed yet.)
#
# Open MPI's defaults are kept; pass e.g. --mpirun-arg --mca --mpirun-arg
# coll_tuned_use_dynamic_rules --mpirun-arg 1 (see bench/RESULTS.md, "a
# throttled network", for why the reduce-scatter algorithm matters).
#
#   bench/net/throttled_net.sh [--ranks 2|4] [--per-node K] [--rate 1gbit|none] [--delay 0.1ms]
#       [--mpirun-arg ARG]... [--env NAME=VALUE]... -- CMD [ARG...]
#   bench/net/throttled_net.sh --check [--ranks N] [--rate R]
#   bench/net/throttled_net.sh --cleanup [--force]
#
# --delay needs the netem qdisc (then netem does rate and delay); a kernel
# without CONFIG_NET_SCH_NETEM (this machine's) refuses a non-zero delay
# rather than silently dropping it. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN).
set -u -o pipefail

PREFIX=zincnet
RANKS=2
PER_NODE=1
RATE=1gbit
DELAY=0
MTU=1500
MODE=run
FORCE=0
MPIRUN_ARGS=()
ENV_ARGS=()
SUBNET=10.213.0   # /24 inside this run's own namespaces only: runs cannot collide
CMD=()

usage() { sed -n '2,36p' "$0" | sed 's/^# \{0,1\}//'; }
die() { echo "throttled_net: $*" >&2; exit 2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --ranks) RANKS=$2; shift 2 ;;
    --per-node) PER_NODE=$2; shift 2 ;;
    --rate) RATE=$2; shift 2 ;;
    --delay) DELAY=$2; shift 2 ;;
    --mtu) MTU=$2; shift 2 ;;
    --mpirun-arg) MPIRUN_ARGS+=("$2"); shift 2 ;;
    --env) ENV_ARGS+=("$2"); shift 2 ;;
    --check) MODE=check; shift ;;
    --cleanup) MODE=cleanup; shift ;;
    --force) FORCE=1; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; CMD=("$@"); break ;;
    *) die "unknown argument '$1' (--help)" ;;
  esac
done

[ "$(id -u)" = 0 ] || die "needs root (network namespaces, tc)"
case "$RANKS" in ''|*[!0-9]*) die "--ranks must be a number" ;; esac
[ "$RANKS" -ge 2 ] && [ "$RANKS" -le 16 ] || die "--ranks must be 2..16"
case "$PER_NODE" in ''|*[!0-9]*) die "--per-node must be a number" ;; esac
[ "$PER_NODE" -ge 1 ] && [ $(( RANKS % PER_NODE )) -eq 0 ] || die "--per-node $PER_NODE must divide --ranks $RANKS"
NODES=$(( RANKS / PER_NODE ))
[ "$NODES" -ge 2 ] || die "--ranks / --per-node must give 2 nodes or more"

TAG="${PREFIX}$$_"
BR_NS="${TAG}br"
LA_NS="${TAG}la"
LA_IP="${SUBNET}.254"
ns_of() { echo "${TAG}r$1"; }
ip_of() { echo "${SUBNET}.$(( $1 + 1 ))"; }
RANK_IF=eth0       # the rank's side of its veth, inside its namespace
MPIRUN_PID=""
CREATED=()

delay_is_zero() { case "$DELAY" in 0|0ms|0us|0s|none|'') return 0 ;; *) return 1 ;; esac; }

cleanup() {
  local rc=$?
  trap - EXIT INT TERM
  if [ -n "$MPIRUN_PID" ] && kill -0 "$MPIRUN_PID" 2>/dev/null; then
    kill -TERM "$MPIRUN_PID" 2>/dev/null
    for _ in 1 2 3 4 5 6 7 8 9 10; do kill -0 "$MPIRUN_PID" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$MPIRUN_PID" 2>/dev/null
    wait "$MPIRUN_PID" 2>/dev/null
  fi
  local ns pids
  for ns in "${CREATED[@]}"; do   # anything of this run still inside them
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    [ -n "${pids// /}" ] && kill -KILL $pids 2>/dev/null
  done
  for ns in "${CREATED[@]}"; do
    # qdiscs and veths go with the namespace; delete them first anyway
    tc -n "$ns" qdisc del dev "$RANK_IF" root 2>/dev/null
    ip netns del "$ns" 2>/dev/null || echo "throttled_net: could not delete namespace $ns" >&2
  done
  [ ${#CREATED[@]} -gt 0 ] && echo "throttled_net: removed ${#CREATED[@]} namespaces (${TAG}*)" >&2
  exit "$rc"
}

cleanup_leftovers() {
  local ns pid n=0
  for ns in $(ip netns list | awk '{print $1}' | grep "^${PREFIX}[0-9]*_"); do
    pid=${ns#"$PREFIX"}; pid=${pid%%_*}
    if [ "$FORCE" = 0 ] && [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
      echo "skip $ns: its run (pid $pid) is still alive (--force deletes it anyway)"
      continue
    fi
    # processes still running inside it (an orphaned mpirun, its ranks)
    local pids; pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')
    if [ -n "${pids// /}" ]; then
      echo "$ns: ending processes $pids"
      kill -TERM $pids 2>/dev/null; sleep 1; kill -KILL $pids 2>/dev/null
    fi
    ip netns del "$ns" && { echo "deleted $ns"; n=$((n + 1)); }
  done
  echo "throttled_net: deleted $n leftover namespaces"
}

# tc qdisc for one veth end in namespace $1, device $2
shape() {
  local ns=$1 dev=$2
  if [ "$RATE" = none ] && delay_is_zero; then return 0; fi
  if ! delay_is_zero; then
    local rate_args=()
    [ "$RATE" != none ] && rate_args=(rate "$RATE")
    tc -n "$ns" qdisc add dev "$dev" root netem delay "$DELAY" "${rate_args[@]}" limit 100000 2>/dev/null \
      || die "--delay $DELAY needs the netem qdisc, which this kernel lacks (CONFIG_NET_SCH_NETEM); use --delay 0"
    return 0
  fi
  # tbf: burst of 1 ms at the rate (at least 64 KiB, so a GSO super-packet
  # fits and tbf need not segment it), a queue of 50 ms
  local bps
  bps=$(rate_bps "$RATE") || die "cannot parse --rate $RATE (use e.g. 100mbit, 1gbit, 10gbit, or none)"
  local burst=$(( bps / 8 / 1000 ))
  [ "$burst" -lt 65536 ] && burst=65536
  tc -n "$ns" qdisc add dev "$dev" root tbf rate "$RATE" burst "$burst" latency 50ms \
    || die "tc tbf on $ns/$dev failed"
}

# bits per second of a tc rate (kbit, mbit, gbit, bit; k/m/g multipliers of 1000)
rate_bps() {
  local r=${1,,} n u
  n=${r%%[a-z]*}; u=${r#"$n"}
  case "$n" in ''|*[!0-9.]*) return 1 ;; esac
  case "$u" in
    bit|'') awk -v n="$n" 'BEGIN{printf "%d\n", n}' ;;
    kbit) awk -v n="$n" 'BEGIN{printf "%d\n", n*1e3}' ;;
    mbit) awk -v n="$n" 'BEGIN{printf "%d\n", n*1e6}' ;;
    gbit) awk -v n="$n" 'BEGIN{printf "%d\n", n*1e9}' ;;
    *) return 1 ;;
  esac
}

setup() {
  ip netns add "$BR_NS" || die "ip netns add $BR_NS failed"; CREATED+=("$BR_NS")
  ip -n "$BR_NS" link set lo up
  ip -n "$BR_NS" link add br0 type bridge || die "no bridge"
  # no STP, no forwarding delay: the ports forward at once
  ip -n "$BR_NS" link set br0 type bridge stp_state 0 forward_delay 0 2>/dev/null
  ip -n "$BR_NS" link set br0 up
  local r ns
  for ((r = 0; r < NODES; r++)); do   # one namespace per node (per rank without --per-node)
    ns=$(ns_of "$r")
    ip netns add "$ns" || die "ip netns add $ns failed"; CREATED+=("$ns")
    ip -n "$ns" link set lo up
    # the pair is born inside the rank's namespace, its peer moved straight
    # into the bridge's: neither end ever exists in the host namespace
    ip -n "$ns" link add "$RANK_IF" mtu "$MTU" type veth peer name "v$r" mtu "$MTU" netns "$BR_NS" \
      || die "veth for rank $r failed"
    ip -n "$ns" addr add "$(ip_of "$r")/24" dev "$RANK_IF"
    ip -n "$BR_NS" link set "v$r" master br0
    shape "$ns" "$RANK_IF"      # rank r's egress
    shape "$BR_NS" "v$r"        # rank r's ingress
    ip -n "$BR_NS" link set "v$r" up
    ip -n "$ns" link set "$RANK_IF" up
  done
  # wait for every node to reach node 0 (bridge learning, link up)
  local ok
  for ((r = 1; r < NODES; r++)); do
    ok=0
    for _ in $(seq 1 50); do
      if ip netns exec "$(ns_of "$r")" python3 -c "
import socket,sys
s=socket.socket(); s.settimeout(0.2)
try: s.connect(('$(ip_of 0)', 9))
except ConnectionRefusedError: sys.exit(0)
except Exception: sys.exit(1)
" 2>/dev/null; then ok=1; break; fi
      sleep 0.1
    done
    [ "$ok" = 1 ] || die "rank $r cannot reach rank 0 over the bridge"
  done
  # the launcher: mpirun runs here, on the bridge, unthrottled, so that its
  # PMIx server (TCP only in PMIx 4: no usock) is reachable from every rank
  ip netns add "$LA_NS" || die "ip netns add $LA_NS failed"; CREATED+=("$LA_NS")
  ip -n "$LA_NS" link set lo up
  ip -n "$LA_NS" link add "$RANK_IF" mtu "$MTU" type veth peer name vla mtu "$MTU" netns "$BR_NS" \
    || die "veth for the launcher failed"
  ip -n "$LA_NS" addr add "$LA_IP/24" dev "$RANK_IF"
  ip -n "$BR_NS" link set vla master br0
  ip -n "$BR_NS" link set vla up
  ip -n "$LA_NS" link set "$RANK_IF" up
  echo "throttled_net: $RANKS ranks, $PER_NODE per namespace, in ${TAG}r0..$((NODES - 1)), bridge in $BR_NS, subnet ${SUBNET}.0/24, rate $RATE, delay $DELAY, mtu $MTU" >&2
  for ((r = 0; r < NODES; r++)); do
    echo "throttled_net: rank $r $(ip_of "$r") qdisc: $(tc -n "$(ns_of "$r")" qdisc show dev "$RANK_IF" | head -1)" >&2
  done
}

counters() {   # "tx_bytes rx_bytes tx_packets" of rank $1's veth
  local ns; ns=$(ns_of "$1")
  ip netns exec "$ns" sh -c "cat /sys/class/net/$RANK_IF/statistics/tx_bytes /sys/class/net/$RANK_IF/statistics/rx_bytes /sys/class/net/$RANK_IF/statistics/tx_packets" | tr '\n' ' '
}

# ---------------------------------------------------------------- --check
PY_SERVER='
import socket, sys, time
mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((host, port)); ls.listen(1)
print("ready", flush=True)
c, _ = ls.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
if mode == "echo":
    while True:
        b = c.recv(64)
        if not b: break
        c.sendall(b)
else:
    n = 0; t0 = None; buf = bytearray(1 << 20)
    while True:
        k = c.recv_into(buf)
        if not k: break
        if t0 is None: t0 = time.perf_counter()
        n += k
    t = time.perf_counter() - t0
    print("recv %d bytes in %.3f s: %.1f Mbit/s" % (n, t, n * 8 / t / 1e6), flush=True)
'
PY_CLIENT='
import socket, sys, time, statistics
mode, host, port, arg = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
for _ in range(100):
    try:
        s = socket.create_connection((host, port)); break
    except OSError: time.sleep(0.05)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
if mode == "echo":
    rtts = []
    for i in range(arg):
        t = time.perf_counter(); s.sendall(b"x")
        s.recv(64); rtts.append(time.perf_counter() - t)
    rtts = rtts[10:]
    print("rtt_us median %.1f min %.1f p90 %.1f over %d round trips" % (statistics.median(rtts) * 1e6, min(rtts) * 1e6, sorted(rtts)[int(len(rtts) * 0.9)] * 1e6, len(rtts)), flush=True)
else:
    chunk = b"\0" * (1 << 20); left = arg
    while left > 0:
        m = min(left, len(chunk)); s.sendall(chunk[:m]); left -= m
s.close()
'

check() {
  local bps=0 total_ok=1 r
  [ "$RATE" != none ] && bps=$(rate_bps "$RATE")
  # 2 s worth at the rate, 1 GB unthrottled
  local bytes=1000000000
  [ "$bps" -gt 0 ] && bytes=$(( bps / 8 * 2 ))
  echo "== latency: TCP ping-pong of 1 byte, rank 0 -> rank 1 (no ping binary needed)"
  ip netns exec "$(ns_of 1)" python3 -c "$PY_SERVER" echo "$(ip_of 1)" 5201 >/dev/null &
  local spid=$!
  ip netns exec "$(ns_of 0)" python3 -c "$PY_CLIENT" echo "$(ip_of 1)" 5201 510
  wait "$spid"

  echo "== bandwidth: one stream rank 0 -> rank 1, $bytes bytes"
  local before after
  before=($(counters 0))
  local out
  out=$( { ip netns exec "$(ns_of 1)" python3 -c "$PY_SERVER" sink "$(ip_of 1)" 5202 | grep recv & } ;
         ip netns exec "$(ns_of 0)" python3 -c "$PY_CLIENT" sink "$(ip_of 1)" 5202 "$bytes"; wait )
  after=($(counters 0))
  echo "$out"
  echo "rank 0 veth tx: $(( after[0] - before[0] )) bytes in $(( after[2] - before[2] )) packets (payload $bytes: overhead $(awk -v a=$(( after[0] - before[0] )) -v b="$bytes" 'BEGIN{printf "%.2f%%", (a-b)*100/b}'))"
  local mbit; mbit=$(echo "$out" | sed -n 's/.*: \([0-9.]*\) Mbit\/s/\1/p')
  if [ "$bps" -gt 0 ]; then
    local ratio; ratio=$(awk -v m="$mbit" -v b="$bps" 'BEGIN{printf "%.3f", m*1e6/b}')
    echo "goodput / rate = $ratio (TCP payload over the tbf rate, which counts Ethernet frames: 1448/1514 = 0.956 at most)"
    awk -v x="$ratio" 'BEGIN{exit !(x >= 0.80 && x <= 1.05)}' && echo "PASS: within the 0.80-1.05 band" || { echo "FAIL: outside 0.80-1.05"; total_ok=0; }
  fi

  echo "== bandwidth: both directions at once (full duplex), $bytes bytes each way"
  out=$( { ip netns exec "$(ns_of 1)" python3 -c "$PY_SERVER" sink "$(ip_of 1)" 5203 | sed 's/^/0->1 /' | grep recv & } ;
         { ip netns exec "$(ns_of 0)" python3 -c "$PY_SERVER" sink "$(ip_of 0)" 5204 | sed 's/^/1->0 /' | grep recv & } ;
         sleep 0.3
         ip netns exec "$(ns_of 0)" python3 -c "$PY_CLIENT" sink "$(ip_of 1)" 5203 "$bytes" &
         ip netns exec "$(ns_of 1)" python3 -c "$PY_CLIENT" sink "$(ip_of 0)" 5204 "$bytes"; wait )
  echo "$out"
  if [ "$bps" -gt 0 ]; then
    for mbit in $(echo "$out" | sed -n 's/.*: \([0-9.]*\) Mbit\/s/\1/p'); do
      awk -v m="$mbit" -v b="$bps" 'BEGIN{x=m*1e6/b; printf "goodput / rate = %.3f ", x; exit !(x >= 0.80 && x <= 1.05)}' && echo PASS || { echo FAIL; total_ok=0; }
    done
  fi
  if [ "$NODES" -ge 3 ]; then
    echo "== ingress cap: ranks 1 and 2 both send to rank 0 at once (rank 0's port caps the sum)"
    out=$( { ip netns exec "$(ns_of 0)" python3 -c "$PY_SERVER" sink "$(ip_of 0)" 5205 | sed 's/^/1->0 /' | grep recv & } ;
           { ip netns exec "$(ns_of 0)" python3 -c "$PY_SERVER" sink "$(ip_of 0)" 5206 | sed 's/^/2->0 /' | grep recv & } ;
           sleep 0.3
           ip netns exec "$(ns_of 1)" python3 -c "$PY_CLIENT" sink "$(ip_of 0)" 5205 "$(( bytes / 2 ))" &
           ip netns exec "$(ns_of 2)" python3 -c "$PY_CLIENT" sink "$(ip_of 0)" 5206 "$(( bytes / 2 ))"; wait )
    echo "$out"
  fi
  [ "$total_ok" = 1 ] && echo "check: PASS" || { echo "check: FAIL"; return 1; }
}

# ---------------------------------------------------------------- run
run_cmd() {
  [ ${#CMD[@]} -gt 0 ] || die "no command after -- (see --help)"
  local mpiargs=(--allow-run-as-root --oversubscribe
    --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include "${SUBNET}.0/24"
    --mca coll ^sm,hcoll --mca oob_tcp_if_include "${SUBNET}.0/24"
    -x ZINC_COMM_BACKEND=mpi)
  local e
  for e in "${ENV_ARGS[@]}"; do mpiargs+=(-x "$e"); done
  mpiargs+=("${MPIRUN_ARGS[@]}")
  local app=() r
  for ((r = 0; r < RANKS; r++)); do
    [ "$r" -gt 0 ] && app+=(:)
    app+=(-np 1 ip netns exec "$(ns_of $(( r / PER_NODE )))" "${CMD[@]}")
  done
  local before=() after=()
  local what=rank
  [ "$PER_NODE" -gt 1 ] && what=node
  for ((r = 0; r < NODES; r++)); do before[r]=$(counters "$r"); done
  echo "throttled_net: mpirun ${mpiargs[*]} ${app[*]}" >&2
  local t0 t1 rc
  t0=$(date +%s.%N)
  # mpirun in the launcher namespace; its PMIx server listens on the veth
  # subnet (remote connections) instead of 127.0.0.1, which a rank's
  # namespace cannot reach
  ip netns exec "$LA_NS" env PMIX_MCA_ptl_tcp_remote_connections=1 \
    PMIX_MCA_ptl_tcp_if_include="${SUBNET}.0/24" \
    mpirun "${mpiargs[@]}" "${app[@]}" &
  MPIRUN_PID=$!
  wait "$MPIRUN_PID"; rc=$?
  MPIRUN_PID=""
  t1=$(date +%s.%N)
  for ((r = 0; r < NODES; r++)); do after[r]=$(counters "$r"); done
  local tx=0 rx=0
  for ((r = 0; r < NODES; r++)); do
    local b=(${before[r]}) a=(${after[r]})
    local dtx=$(( a[0] - b[0] )) drx=$(( a[1] - b[1] ))
    tx=$(( tx + dtx )); rx=$(( rx + drx ))
    echo "throttled_net: $what $r veth tx_bytes $dtx rx_bytes $drx"
  done
  echo "throttled_net: total tx_bytes $tx rx_bytes $rx wall_s $(awk -v a="$t0" -v b="$t1" 'BEGIN{printf "%.2f", b-a}') rate $RATE delay $DELAY ranks $RANKS per_node $PER_NODE rc $rc"
  return "$rc"
}

case "$MODE" in
  cleanup) cleanup_leftovers; exit 0 ;;
esac
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
setup
case "$MODE" in
  check) check ;;
  run) run_cmd ;;
esac
