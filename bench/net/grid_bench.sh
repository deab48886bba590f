#!/usr/bin/env bash
# bench/net/grid_bench.sh: issue 54's measured grid. Two "nodes" of two
# ranks each (bench/net/throttled_net.sh --per-node 2: a network namespace
# per node, 1 gbit/s between them, the node's own loopback inside), the
# ~94M Llama of bench/net/llama_grid.json, one global batch of 32 sequences
# of 128 in every case, ZeRO-1 (the 1-bit case: stage 0, as 1-bit Adam
# needs), and the compute-only bound: four one-rank runs at once on this
# machine's cores with no communication (net_bench.py's compute4).
# Needs root. Usage: bench/net/grid_bench.sh [STEPS]
set -u
cd "$(dirname "$0")/../.."
STEPS=${1:-4}
B=(python3 bench/net/net_bench.py --config bench/net/llama_grid.json --steps "$STEPS" --warmup 1 --per-node 2
   --quiet-wait 60 --max-foreign 0.2)
run() {  # NAME CASE SETS...
  local name=$1 case=$2; shift 2
  echo "=== $name"
  "${B[@]}" --case "$case" -- "$@"
}
run "compute-only bound (4 one-rank runs at once, micro 2 x accumulation 4)" compute4
run "DP 4" 4:1:1gbit
run "DP 4, 1-bit Adam" 4:0:1gbit --set optimizer.type=OneBitAdam --set optimizer.params.freeze_step=1
run "PP 2 (across the nodes) x DP 2" 4:1:1gbit --set pipeline.stages=2 --set gradient_accumulation_steps=8
run "TP 2 (inside the nodes) x DP 2" 4:1:1gbit --set tensor_parallel.autotp_size=2 --set gradient_accumulation_steps=8
run "TP 2 x PP 2" 4:1:1gbit --set tensor_parallel.autotp_size=2 --set pipeline.stages=2 --set gradient_accumulation_steps=16
