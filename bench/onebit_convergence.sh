#!/usr/bin/env bash
# The 1-bit optimizers on the default experiment (configs/default.json: the
# reference GPT's small sibling, 800 steps, its loss floor in the header),
# against uncompressed Adam on the same global batches, at 2 and 4 ranks:
# the final evaluation loss (32 held-out batches), the mean of the last 100
# steps' training losses, and the wall time of each run.
#
#   bash bench/onebit_convergence.sh [ZINC_TRAIN] [RANKS...]
#
# Each optimizer keeps the default's lr, betas, eps, weight decay and
# schedule; the 1-bit ones freeze after 200 steps (a quarter of the run):
#   AdamW               the default (bias correction on)
#   AdamW-nobc          AdamW with bias_correction false: the 1-bit
#                       optimizers' warm-up rule
#   OneBitAdam          freeze_step 200
#   ZeroOneAdam         var_freeze_step 200 (DeepSpeed's other defaults)
#   OneBitLamb          freeze_step 200, max_coeff 10 (Lamb: lr x 10)
#   Lamb                the same without compression (bias_correction false)
set -euo pipefail
ZT="${1:-build/tools/zinc-train}"
shift || true
RANKS=("$@")
[ ${#RANKS[@]} -eq 0 ] && RANKS=(2 4)
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
MPI=(mpirun --oversubscribe -x OMP_NUM_THREADS=1)
[ "$(id -u)" -eq 0 ] && MPI+=(--allow-run-as-root)
grep -m1 -o -w 'avx512_bf16\|avx512f\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ' | sed 's/^/cpu flags: /'
echo
declare -A OPT=(
  [AdamW]='{"type":"AdamW","params":{"lr":0.003,"betas":[0.9,0.95],"eps":1e-8,"weight_decay":0.01}}'
  [AdamW-nobc]='{"type":"AdamW","params":{"lr":0.003,"betas":[0.9,0.95],"eps":1e-8,"weight_decay":0.01,"bias_correction":false}}'
  [OneBitAdam]='{"type":"OneBitAdam","params":{"lr":0.003,"betas":[0.9,0.95],"eps":1e-8,"weight_decay":0.01,"freeze_step":200}}'
  [ZeroOneAdam]='{"type":"ZeroOneAdam","params":{"lr":0.003,"betas":[0.9,0.95],"eps":1e-8,"weight_decay":0.01,"var_freeze_step":200}}'
  [OneBitLamb]='{"type":"OneBitLamb","params":{"lr":0.03,"betas":[0.9,0.95],"eps":1e-8,"weight_decay":0.01,"freeze_step":200}}'
  [Lamb]='{"type":"Lamb","params":{"lr":0.03,"betas":[0.9,0.95],"eps":1e-8,"weight_decay":0.01,"bias_correction":false}}'
)
printf '%-6s %-12s %12s %14s %10s\n' ranks optimizer "eval loss" "last-100 mean" seconds
for np in "${RANKS[@]}"; do
  for name in AdamW AdamW-nobc OneBitAdam ZeroOneAdam Lamb OneBitLamb; do
    t0=$(date +%s.%N)
    out=$("${MPI[@]}" -np "$np" "$ZT" "$ROOT/configs/default.json" --json --set steps_per_print=1 \
          --set "optimizer=${OPT[$name]}" 2>/dev/null)
    t1=$(date +%s.%N)
    python3 - "$np" "$name" "$(echo "$t1 - $t0" | bc)" <<PY
import json, sys
np_, name, secs = sys.argv[1:4]
losses = []
final = None
for line in """$out""".splitlines():
    try:
        e = json.loads(line)
    except ValueError:
        continue
    if e.get("event") == "step" and "loss" in e:
        losses.append(e["loss"])
    if e.get("event") == "summary":
        final = e.get("final_eval_loss")
tail = losses[-100:]
print("%-6s %-12s %12.4f %14.4f %10.1f" % (np_, name, final if final is not None else float("nan"),
                                             sum(tail) / max(len(tail), 1), float(secs)))
PY
  done
done
