#!/usr/bin/env bash
# Records what a training run computes, bit for bit, over the matrix of ways
# to run it: 1, 2 and 4 ranks; ZeRO stages 0, 1, 2 (and 3 at 2 and 4 ranks,
# which must equal stage 2); optimizer states in RAM,
# pinned RAM and on NVMe (stages 1, 2); fp32 and bf16; plus, at 2 and 4
# ranks, small buckets with overlap_comm, bf16 on the wire, and gradient
# accumulation with no-sync. Each case trains the
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
# one NAME NP STAGE ARGS...: trains the default experiment on NP ranks at
# STAGE with the extra zinc-train ARGS and keeps NAME.jsonl without timings.
one() {
  local name="$1" np="$2" stage="$3"
  shift 3
  local cmd=(./build/tools/zinc-train configs/default.json --steps "$steps" --json --weights-digest
             --set steps_per_print=1 --set run.eval_interval=0 --set zero_optimization.stage="$stage" "$@")
  [ "$np" -gt 1 ] && cmd=("${mpi[@]}" -np "$np" "${cmd[@]}")
  "${cmd[@]}" >"$out/$name.raw" 2>"$out/$name.err"
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
}
for np in 1 2 4; do
  for stage in 0 1 2; do
    for offload in none cpu nvme; do
      [ "$stage" -eq 0 ] && [ "$offload" != none ] && continue
      for bf16 in false true; do
        extra=(--set bf16.enabled="$bf16" --set zero_optimization.offload_optimizer.device="$offload")
        [ "$offload" = nvme ] && extra+=(--set "zero_optimization.offload_optimizer.nvme_path=$nvme")
        one "np${np}-stage${stage}-${offload}-bf16_${bf16}" "$np" "$stage" "${extra[@]}"
      done
    done
  done
done
# Reduction variants: many small buckets overlapped with backward, bf16 on
# the wire, and 2 accumulated micro-batches per step.
for np in 2 4; do
  for stage in 0 1 2; do
    for variant in buckets wire gas; do
      case "$variant" in
        buckets) extra=(--set zero_optimization.overlap_comm=true --set zero_optimization.reduce_bucket_size=40000) ;;
        wire) extra=(--set communication_data_type=bf16) ;;
        gas) extra=(--set gradient_accumulation_steps=2) ;;
      esac
      one "np${np}-stage${stage}-${variant}" "$np" "$stage" "${extra[@]}"
    done
  done
done
# ZeRO-3 at 2 and 4 ranks, with blocks gathered per use (reuse distance 0),
# a small prefetch window and the final norm persisting; every file must
# equal the stage-2 file of the same name (checked below).
for np in 2 4; do
  for offload in none cpu nvme; do
    for bf16 in false true; do
      extra=(--set bf16.enabled="$bf16" --set zero_optimization.offload_optimizer.device="$offload"
             --set zero_optimization.stage3_max_reuse_distance=0
             --set zero_optimization.stage3_prefetch_bucket_size=300000
             --set zero_optimization.stage3_param_persistence_threshold=1000)
      [ "$offload" = nvme ] && extra+=(--set "zero_optimization.offload_optimizer.nvme_path=$nvme")
      one "np${np}-stage3-${offload}-bf16_${bf16}" "$np" 3 "${extra[@]}"
      if ! cmp -s "$out/np${np}-stage3-${offload}-bf16_${bf16}.jsonl" "$out/np${np}-stage2-${offload}-bf16_${bf16}.jsonl"; then
        echo "fingerprint: stage 3 differs from stage 2 at np${np} ${offload} bf16 ${bf16}" >&2
        exit 1
      fi
    done
  done
done
echo "fingerprint: $n cases in $out"
