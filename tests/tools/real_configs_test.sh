#!/usr/bin/env bash
# Every config in tests/configs/real/ (real ds_configs, sources in its
# README) trains 2 steps on 1 and on 2 ranks, with zinc's experiment
# sections added by --set, and says where each "auto" value came from.
# Usage: real_configs_test.sh ZINC_TRAIN REPO_ROOT
set -u
ZT="$1"
ROOT="$2"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
MPIRUN=(mpirun --oversubscribe -np 2 -x OMP_NUM_THREADS=1)
[ "$(id -u)" -eq 0 ] && MPIRUN+=(--allow-run-as-root)
SETS=(--set 'model={"type":"gpt","n_layer":2,"n_head":4,"n_embd":64}'
      --set 'data={"type":"synthetic","vocab_size":32,"seq_len":32}'
      --set run.steps=2 --set 'trainer={"per_device_train_batch_size":4,"learning_rate":0.001}' --json)
pass=0
fail=0
for cfg in "$ROOT"/tests/configs/real/*.json; do
  for np in 1 2; do
    if [ "$np" -eq 1 ]; then cmd=("$ZT"); else cmd=("${MPIRUN[@]}" "$ZT"); fi
    if OMP_NUM_THREADS=1 "${cmd[@]}" "$cfg" "${SETS[@]}" >"$TMP/out" 2>"$TMP/err" &&
       python3 - "$TMP/out" "$np" <<'PY'
import json, sys
events = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
np = int(sys.argv[2])
steps = [e for e in events if e["event"] == "step"]
assert steps and steps[-1]["step"] == 2, events
s = events[-1]
assert s["event"] == "summary" and s["world_size"] == np and s["final_loss"] > 0, s
auto = [e for e in events if e["event"] == "auto"]
assert len(auto) == 1 and all(v["source"] for v in auto[0]["values"]), auto
PY
    then
      pass=$((pass + 1))
    else
      fail=$((fail + 1))
      echo "FAIL $(basename "$cfg") on $np rank(s)"; tail -5 "$TMP/out"; tail -5 "$TMP/err"
    fi
  done
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
