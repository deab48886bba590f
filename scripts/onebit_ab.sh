#!/usr/bin/env bash
# The 1-bit optimizers (which scripts/fingerprint.sh does not cover) between
# two zinc-train binaries, for a refactor that claims "no change": for
# OneBitAdam, ZeroOneAdam and OneBitLamb at 1 and 2 ranks, a 10-step run past
# the freeze with each binary (the per-step loss, norm and lr and the final
# weights' digest must be the same), and a checkpoint OLD saves at step 6
# (past the freeze: error feedback, 0/1 Adam's accumulators, 1-bit Lamb's
# state) that NEW resumes to step 10 (the digest must be OLD's).
#   bash scripts/onebit_ab.sh OLD_ZINC_TRAIN NEW_ZINC_TRAIN OUT_DIR
set -u
OLD=${1:?usage: scripts/onebit_ab.sh OLD NEW OUT_DIR}; NEW=${2:?}; out=${3:?}
OLD=$(realpath "$OLD"); NEW=$(realpath "$NEW"); mkdir -p "$out"; out=$(realpath "$out")
cd "$(dirname "$0")/.."
mpi=(mpirun --oversubscribe -x OMP_NUM_THREADS=1)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
for opt in OneBitAdam ZeroOneAdam OneBitLamb; do
  for np in 1 2; do
    params='{"lr": 0.001, "var_freeze_step": 5, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 4}'
    [ $opt = OneBitAdam ] && params='{"lr": 0.001, "freeze_step": 3}'
    [ $opt = OneBitLamb ] && params='{"lr": 0.001, "freeze_step": 3}'
    common=(configs/default.json --json --weights-digest --set steps_per_print=1 --set run.eval_interval=0
            --set zero_optimization.stage=0 --set "optimizer={\"type\": \"$opt\", \"params\": $params}"
            --set model.n_layer=2 --set model.n_embd=64)
    for bin in OLD NEW; do
      b=${!bin}
      "${mpi[@]}" -np $np $b "${common[@]}" --steps 10 --set run.checkpoint_interval=0 --set run.checkpoint_dir=$out/ck_none \
        > $out/$opt-np$np-$bin.raw 2>$out/$opt-np$np-$bin.err
      python3 - $out/$opt-np$np-$bin.raw > $out/$opt-np$np-$bin.jsonl <<'PY'
import json, sys
for line in open(sys.argv[1]):
    try: e = json.loads(line)
    except Exception: continue
    if e.get("event") == "step": print(json.dumps({k: e[k] for k in ("step", "loss", "grad_norm", "lr")}))
    elif e.get("event") == "summary": print(json.dumps({k: e[k] for k in ("final_loss", "weights_digest")}))
PY
    done
    cmp -s $out/$opt-np$np-OLD.jsonl $out/$opt-np$np-NEW.jsonl && echo "$opt np$np run: same ($(wc -l < $out/$opt-np$np-NEW.jsonl) lines)" || echo "$opt np$np run: DIFFER"
    # OLD's checkpoint at step 6 resumed by NEW.
    rm -rf $out/ck_OLD
    "${mpi[@]}" -np $np $OLD "${common[@]}" --steps 6 --set run.checkpoint_interval=6 --set run.checkpoint_dir=$out/ck_OLD > /dev/null 2>$out/$opt-np$np-SAVE.err
    "${mpi[@]}" -np $np $NEW "${common[@]}" --steps 10 --set run.checkpoint_dir=$out/ck_OLD --resume $out/ck_OLD \
      > $out/$opt-np$np-RES.raw 2>$out/$opt-np$np-RES.err
    d_res=$(grep -o '"weights_digest": *"[^"]*"' $out/$opt-np$np-RES.raw | tail -1)
    d_old=$(grep -o '"weights_digest": *"[^"]*"' $out/$opt-np$np-OLD.raw | tail -1)
    [ -n "$d_res" ] && [ "$d_res" = "$d_old" ] && echo "$opt np$np resume OLD->NEW: same digest" || echo "$opt np$np resume: DIFFER ($d_res vs $d_old) $(tail -2 $out/$opt-np$np-RES.err)"
  done
done
