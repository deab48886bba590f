#!/usr/bin/env bash
# Records what a training run computes, bit for bit, over the matrix of ways
# to run it: 1, 2 and 4 ranks; ZeRO stages 0, 1, 2; optimizer states in RAM,
# pinned RAM and on NVMe (stages 1, 2); fp32 and bf16. Each case trains the
# default experiment for a few steps and keeps its per-step loss, gradient
# norm and learning rate and the digest of the final weights (timings
# dropped). Two recordings of the same code must be identical; a refactor
# that claims "no change of behaviour" compares before and after:
#   bash scripts/fingerprint.sh /tmp/before     # on the old commit
#   bash scripts/fingerprint.sh /tmp/after      # on the new one
#   diff -r /tmp/before /tmp/after
# Needs a build (scripts/setup.sh). NVMe files go under $ZINC_FINGERPRINT_NVME
# (default /tmp).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: scripts/fingerprint.sh OUT_DIR [STEPS]}"
steps="${2:-6}"
nvme="${ZINC_FINGERPRINT_NVME:-/tmp}"
mkdir -p "$out"
mpi=(mpirun --oversubscribe)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
export OMP_NUM_THREADS=1
n=0
for np in 1 2 4; do
  for stage in 0 1 2; do
    for offload in none cpu nvme; do
      [ "$stage" -eq 0 ] && [ "$offload" != none ] && continue
      for bf16 in false true; do
        name="np${np}-stage${stage}-${offload}-bf16_${bf16}"
        args=(configs/default.json --steps "$steps" --json --weights-digest --set steps_per_print=1
              --set run.eval_interval=0 --set zero_optimization.stage="$stage" --set bf16.enabled="$bf16"
              --set zero_optimization.offload_optimizer.device="$offload")
        [ "$offload" = nvme ] && args+=(--set "zero_optimization.offload_optimizer.nvme_path=$nvme")
        if [ "$np" -eq 1 ]; then
          ./build/tools/zinc-train "${args[@]}" >"$out/$name.raw" 2>"$out/$name.err"
        else
          "${mpi[@]}" -np "$np" ./build/tools/zinc-train "${args[@]}" >"$out/$name.raw" 2>"$out/$name.err"
        fi
        python3 - "$out/$name.raw" >"$out/$name.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    e = json.loads(line)
    if e["event"] == "step":
        print(json.dumps({k: e[k] for k in ("step", "loss", "grad_norm", "lr")}))
    elif e["event"] == "summary":
        print(json.dumps({k: e[k] for k in ("final_loss", "weights_digest", "skipped_steps")}))
PY
        rm -f "$out/$name.raw" "$out/$name.err"
        n=$((n + 1))
      done
    done
  done
done
echo "fingerprint: $n cases in $out"
