#!/usr/bin/env bash
# zinc-train as a user meets it: bad input ends with one clear line and exit
# code 1 (never a crash or a stack trace); a good run prints well-formed JSON
# lines and writes the csv_monitor files DeepSpeed's layout names.
# Usage: cli_test.sh ZINC_TRAIN REPO_ROOT
set -u
ZT="$1"
ROOT="$2"
CFG="$ROOT/configs/default.json"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
pass=0
fail=0

check_error() {  # name, expected substring, args...
  local name="$1" want="$2"
  shift 2
  "$ZT" "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  last="$(grep -v '^zinc\[' "$TMP/err" | tail -n 1)"
  local lines
  lines="$(grep -vc '^zinc\[' "$TMP/err")"
  if [ "$rc" -eq 1 ] && [ "$lines" -eq 1 ] && grep -qF -- "$want" <<<"$last" &&
     ! grep -qiE 'terminate called|Aborted|Segmentation|core dumped' "$TMP/err"; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    echo "FAIL $name: rc=$rc, want one error line containing '$want'; stderr:"
    cat "$TMP/err"
  fi
}

check_error missing-config "No such file or directory" /nonexistent/config.json
check_error unknown-key "did you mean 'optimizer'" "$CFG" --set optimzer.type=Adam
check_error wrong-type 'optimizer.params.lr: expected a number, got "abc"' "$CFG" --set optimizer.params.lr=abc
check_error fp16-and-bf16 'fp16.enabled: fp16 and bf16 cannot both be enabled' "$CFG" --set fp16.enabled=true
# fp16 with a first loss scale of 2^30 and hysteresis 1: the first steps
# overflow and are skipped while the scale halves; the step events say so.
if "$ZT" "$CFG" --steps 20 --set run.eval_interval=0 --set steps_per_print=1 --set bf16.enabled=false \
     --set 'fp16={"enabled":true,"initial_scale_power":30,"hysteresis":1}' --json >"$TMP/fp16" 2>"$TMP/err" &&
   python3 - "$TMP/fp16" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1])]
steps = [e for e in ev if e["event"] == "step"]
assert len(steps) == 20, len(steps)
scales = [e["loss_scale"] for e in steps]
skipped = [e["skipped_steps"] for e in steps]
assert skipped[0] == 1 and scales[0] == 2.0 ** 29, (skipped[:3], scales[:3])
# every skipped step halves the scale; a clean step keeps it (window 1000)
for prev, cur, sp, sc in zip(scales, scales[1:], skipped, skipped[1:]):
    assert cur == (prev / 2 if sc == sp + 1 else prev), (prev, cur, sp, sc)
assert skipped[:3] == [1, 2, 3] and skipped[-1] < 20, skipped  # 2^30..2^28 cannot hold
summary = [e for e in ev if e["event"] == "summary"][0]
assert summary["skipped_steps"] == skipped[-1]
PY
then
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL fp16 loss scaling"; cat "$TMP/err"
fi
check_error zero-stage "zero_optimization.stage: must be" "$CFG" --set zero_optimization.stage=4
check_error triad "train_batch_size" "$CFG" --set gradient_accumulation_steps=3
check_error missing-data "data.path: cannot open $TMP/none.txt" "$CFG" --set data.type=text --set "data.path=$TMP/none.txt"
check_error bad-override "key.path=value" "$CFG" --set foo
# A plain ds_config (no model, no data section) with a key DeepSpeed does not
# read: zinc-train warns about the key and says in its header that it
# trains its default model on synthetic tokens (issue 32).
echo '{"train_batch_size": 4, "_comment": "a plain ds_config", "zero_optimization": {"stage": 1}}' >"$TMP/plain.json"
if "$ZT" "$TMP/plain.json" --steps 1 >"$TMP/out" 2>"$TMP/err" &&
   grep -qF '_comment: not a DeepSpeed key; ignored' "$TMP/err" &&
   grep -qF 'model: no model section' "$TMP/err" && grep -qF 'data: no data section' "$TMP/err" &&
   grep -q '^zinc-train: .* (the default: the config has no model section), .* (the default: the config has no data section)$' "$TMP/out"; then
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL plain-ds-config"; cat "$TMP/out" "$TMP/err"
fi
# uint32 token files (vocabularies past 65,536): the Llama 3 scripts' header
# states the width and a Llama of that vocabulary trains on it (its first
# loss is about ln 70000 = 11.16, above ln 65536 = 11.09); a config that
# says uint16 for it is one line naming data.token_dtype and the file.
python3 - "$TMP/t32.bin" <<'PY'
import struct, sys
toks = [(i * 7919) % 70000 for i in range(4000)]
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<256i", 20240801, 7, len(toks), *([0] * 253)))
    f.write(struct.pack("<%dI" % len(toks), *toks))
PY
T32=(--set "data={\"type\":\"tokens\",\"path\":\"$TMP/t32.bin\",\"seq_len\":32}" --set run.eval_interval=0 --set steps_per_print=1
     --set 'model={"type":"llama","hidden_size":32,"intermediate_size":64,"num_hidden_layers":1,"num_attention_heads":2,"max_position_embeddings":64}')
if "$ZT" "$CFG" --steps 2 "${T32[@]}" --json >"$TMP/out" 2>"$TMP/err" &&
   python3 -c "import json,sys; s=[json.loads(l) for l in open(sys.argv[1])]; l=[e['loss'] for e in s if e['event']=='step']; assert len(l)==2 and l[0]>11.1, l" "$TMP/out"; then
  pass=$((pass + 1))
else
  fail=$((fail + 1)); echo "FAIL uint32 tokens"; cat "$TMP/err"
fi
check_error uint32-as-uint16 "data.token_dtype: is uint16 but the header of $TMP/t32.bin says uint32" "$CFG" --steps 2 "${T32[@]}" --set data.token_dtype=uint16
ONEDNN_MAX_CPU_ISA=avx3 check_error bad-isa-cap "ONEDNN_MAX_CPU_ISA=avx3: unknown ISA" "$CFG"
check_error heads 'n_head' "$CFG" --set model.n_head=3
# A Hugging Face-style config full of "auto": each value resolved and said
# once, from the trainer section or the rules; --json gives one "auto" event.
if "$ZT" "$ROOT/configs/hf_auto.json" --steps 2 >"$TMP/out" 2>"$TMP/err" &&
   grep -qF 'config: optimizer.params.lr = 0.003 ("auto": trainer.learning_rate)' "$TMP/out" &&
   grep -qF 'config: train_batch_size = 64 ("auto": 1 rank x micro-batch 32 x accumulation 2)' "$TMP/out" &&
   grep -qF 'config: scheduler.params.total_num_steps = 2 ("auto": run.steps)' "$TMP/out" &&
   "$ZT" "$ROOT/configs/hf_auto.json" --steps 2 --json >"$TMP/out.json" 2>"$TMP/err" &&
   python3 - "$TMP/out.json" <<'PY'
import json, sys
events = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
auto = [e for e in events if e["event"] == "auto"]
assert len(auto) == 1, auto
values = {v["path"]: v for v in auto[0]["values"]}
assert values["zero_optimization.reduce_bucket_size"]["value"] == 128 * 128, values
assert values["bf16.enabled"]["value"] is True and values["fp16.enabled"]["value"] is False, values
assert events[-1]["event"] == "summary", events[-1]
PY
then
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL hf_auto"; cat "$TMP/out" "$TMP/err"
fi

# --save-weights is checked before training, not after it (usage error: 2).
for bad in "$TMP/w.bin" "$TMP/no/such/w.safetensors"; do
  "$ZT" "$CFG" --steps 1 --save-weights "$bad" >"$TMP/out" 2>"$TMP/err"
  rc=$?
  if [ "$rc" -eq 2 ] && grep -qF -- "--save-weights $bad: must be a .safetensors file in an existing folder" "$TMP/err" &&
     ! grep -q '^step' "$TMP/out"; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    echo "FAIL save-weights $bad: rc=$rc"; cat "$TMP/out" "$TMP/err"
  fi
done
NV="$ROOT/configs/nvme.json"
check_error nvme-missing-path "zero_optimization.offload_optimizer.nvme_path: nvme_path $TMP/absent does not exist" "$NV" --steps 2 --set "zero_optimization.offload_optimizer.nvme_path=$TMP/absent"
check_error param-missing-path "zero_optimization.offload_param.nvme_path: nvme_path $TMP/absent does not exist" \
  "$ROOT/configs/zero3.json" --steps 2 --set zero_optimization.offload_optimizer.device=none \
  --set "zero_optimization.offload_param.nvme_path=$TMP/absent"
# An I/O error in the middle of a step ends the run naming the file and the
# error, and the rank's swap folder is gone afterwards (nothing half-written
# is left to be taken for state).
mkdir -p "$TMP/nv"
export ZINC_NVME_FAULT=60:5
check_error nvme-eio "Input/output error" "$NV" --steps 3 --set "zero_optimization.offload_optimizer.nvme_path=$TMP/nv"
grep -q "optimizer_states" <<<"$last" || { fail=$((fail + 1)); echo "FAIL nvme-eio: the error does not name the file"; }
unset ZINC_NVME_FAULT
if [ -n "$(ls -A "$TMP/nv")" ]; then
  fail=$((fail + 1)); echo "FAIL nvme-eio: left behind: $(ls "$TMP/nv")"
fi
# ZeRO-3 with its parameter shards on NVMe, on a disk that refuses a write
# (ENOSPC) while a step in the run writes its new shards back: one line naming
# the parameter file and the error, no store left behind, and what was
# written before (the csv_monitor rows of the steps done) is intact.
mkdir -p "$TMP/nv3"
export ZINC_NVME_FAULT=20:28
check_error param-enospc "No space left on device" "$ROOT/configs/zero3.json" --steps 4 \
  --set zero_optimization.offload_optimizer.device=none --set "zero_optimization.offload_param.nvme_path=$TMP/nv3" \
  --set csv_monitor.enabled=true --set "csv_monitor.output_path=$TMP/csv3" --set csv_monitor.job_name=j
unset ZINC_NVME_FAULT
grep -q "write of $TMP/nv3/.*compute_params" <<<"$last" || { fail=$((fail + 1)); echo "FAIL param-enospc: $last"; }
if [ -n "$(ls -A "$TMP/nv3")" ] || [ "$(cat "$TMP/csv3/j/Train_Samples_train_loss.csv" | head -n 1)" != "step,train_loss" ] ||
   ! grep -qE '^64,[0-9.]+$' "$TMP/csv3/j/Train_Samples_train_loss.csv" ||
   [ "$(tail -n +2 "$TMP/csv3/j/Train_Samples_train_loss.csv" | grep -cvE '^[0-9]+,[0-9.]+$')" -ne 0 ]; then
  fail=$((fail + 1)); echo "FAIL param-enospc: left $(ls -A "$TMP/nv3"); csv:"; cat "$TMP/csv3/j/Train_Samples_train_loss.csv"
fi
printf '{"train_batch_size": 4,' >"$TMP/broken.json"
check_error syntax "JSON syntax error" "$TMP/broken.json"

# wall_clock_breakdown: each step event carries the seconds so far in the
# forward, backward and optimizer-step phases, growing, within the elapsed
# time; without it the step events do not.
if "$ZT" "$CFG" --steps 3 --set steps_per_print=1 --set wall_clock_breakdown=true --json >"$TMP/wcb" 2>"$TMP/err" &&
   "$ZT" "$CFG" --steps 1 --json >"$TMP/nowcb" 2>>"$TMP/err" &&
   python3 - "$TMP/wcb" "$TMP/nowcb" <<'PY'
import json, sys
steps = [e for e in map(json.loads, open(sys.argv[1])) if e["event"] == "step"]
keys = ("forward_s", "backward_s", "optimizer_step_s")
for a, b in zip(steps, steps[1:]):
    assert all(0 < a[k] < b[k] for k in keys), (a, b)
assert len(steps) == 3, steps
for s in steps:
    assert sum(s[k] for k in keys) <= s["elapsed_s"] + 1e-6, s
plain = [e for e in map(json.loads, open(sys.argv[2])) if e["event"] == "step"]
assert plain and not any(k in plain[0] for k in keys), plain
PY
then
  pass=$((pass + 1))
else
  fail=$((fail + 1)); echo "FAIL wall_clock_breakdown step events"; cat "$TMP/err" | tail -5
fi

# A good run: JSON lines with the documented fields, and csv_monitor files.
if "$ZT" "$CFG" --steps 4 --set steps_per_print=2 --set csv_monitor.enabled=true \
     --set "csv_monitor.output_path=$TMP/csv" --set csv_monitor.job_name=job --json >"$TMP/out" 2>"$TMP/err" &&
   python3 - "$TMP/out" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1])]
steps = [l for l in lines if l["event"] == "step"]
assert [s["step"] for s in steps] == [2, 4], steps
for s in steps:
    assert set(s) >= {"loss", "lr", "grad_norm", "tokens_per_s", "elapsed_s", "eta_s"}, s
summary = lines[-1]
assert summary["event"] == "summary" and summary["steps"] == 4, summary
# Note [training time]: the rate counts the steps' time alone, without the
# evaluation (the last step's) and the saves.
assert summary["eval_s"] > 0 and summary["checkpoint_s"] >= 0, summary
training = summary["elapsed_s"] - summary["eval_s"] - summary["checkpoint_s"]
config = next(l for l in lines if l["event"] == "config")["config"]
tokens = 4 * config["train_batch_size"] * config["data"]["seq_len"]
assert training > 0 and abs(summary["tokens_per_s"] * training - tokens) <= 1e-6 * tokens, (summary, tokens)
assert summary["loss_floor"] is not None and summary["peak_rss_bytes"] > 0, summary
# The code paths chosen for this CPU: the ISA level, both matmul dtypes, the optimizer.
paths = summary["kernel_paths"]
assert paths.startswith("cpu: ") and "matmul fp32: " in paths and "matmul bf16: " in paths, paths
assert "optimizer: " in paths, paths
PY
then
  if [ "$(head -n 1 "$TMP/csv/job/Train_Samples_train_loss.csv")" = "step,train_loss" ] &&
     [ "$(wc -l <"$TMP/csv/job/Train_Samples_train_loss.csv")" -eq 5 ] &&
     [ -f "$TMP/csv/job/Train_Samples_lr.csv" ]; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    echo "FAIL csv_monitor files"
    ls -R "$TMP/csv"
  fi
else
  fail=$((fail + 1))
  echo "FAIL json run"
  cat "$TMP/out" "$TMP/err"
fi

# The human header names the paths too; capped at AVX2 they are AVX2's and
# bf16 runs (natively, or via fp32 where oneDNN has no bf16 kernel).
if ONEDNN_MAX_CPU_ISA=AVX2 "$ZT" "$CFG" --steps 2 >"$TMP/out" 2>"$TMP/err" &&
   grep -q '^cpu: avx2 kernels' "$TMP/out" &&
   grep -q 'matmul bf16: via fp32 (oneDNN [^)]*), no native bf16' "$TMP/out" &&
   grep -q '^done: 2 steps' "$TMP/out"; then
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL capped header"
  cat "$TMP/out" "$TMP/err"
fi

# Checkpoints: 3 steps, a checkpoint, and --resume to 6 give the weights of
# 6 straight steps bit for bit, and the same JSON loss lines; keep_last
# keeps the newest tags only.
CK=(--set run.eval_interval=0 --set steps_per_print=1 --set "run.checkpoint_dir=$TMP/ck" --json --weights-digest)
"$ZT" "$CFG" --steps 6 "${CK[@]}" >"$TMP/straight" 2>/dev/null
"$ZT" "$CFG" --steps 3 "${CK[@]}" --set run.checkpoint_interval=1 --set run.keep_last=2 >"$TMP/seg1" 2>/dev/null
kept="$(ls "$TMP/ck" | tr '\n' ' ')"
"$ZT" "$CFG" --steps 6 "${CK[@]}" --resume >"$TMP/seg2" 2>"$TMP/err"
if python3 - "$TMP/straight" "$TMP/seg1" "$TMP/seg2" <<'PY' && [ "$kept" = "global_step2 global_step3 latest " ]; then
import json, sys
def lines(p): return [json.loads(l) for l in open(p)]
a, b, c = (lines(p) for p in sys.argv[1:])
steps = lambda ls: [(l["step"], l["loss"], l["grad_norm"], l["lr"]) for l in ls if l["event"] == "step"]
assert steps(b) + steps(c) == steps(a), (steps(a), steps(b), steps(c))
assert [l for l in c if l["event"] == "resume"][0]["step"] == 3
assert c[-1]["weights_digest"] == a[-1]["weights_digest"], (a[-1], c[-1])
assert [l["step"] for l in b if l["event"] == "checkpoint"] == [1, 2, 3], b
PY
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL resume (kept: $kept)"; cat "$TMP/seg2" "$TMP/err"
fi
# kill -9 at each phase of the second save (while writing shards, with the
# tag complete but not renamed, renamed but `latest` not moved): `latest`
# names step 1, which resumes to the weights of 2 straight steps; the next
# save clears what the killed one left.
"$ZT" "$CFG" --steps 2 "${CK[@]}" >"$TMP/two" 2>/dev/null
want="$(tail -n 1 "$TMP/two" | python3 -c 'import json,sys; print(json.load(sys.stdin)["weights_digest"])')"
for phase in shards before_rename before_latest; do
  rm -rf "$TMP/ck"
  ZINC_CHECKPOINT_FAULT=$phase:2 "$ZT" "$CFG" --steps 3 "${CK[@]}" --set run.checkpoint_interval=1 >/dev/null 2>&1
  rc=$?
  latest="$(cat "$TMP/ck/latest" 2>/dev/null)"
  "$ZT" "$CFG" --steps 2 "${CK[@]}" --set run.checkpoint_interval=1 --resume >"$TMP/res" 2>"$TMP/err"
  got="$(tail -n 1 "$TMP/res" | python3 -c 'import json,sys; print(json.load(sys.stdin)["weights_digest"])' 2>/dev/null)"
  if [ "$rc" -eq 137 ] && [ "$latest" = "global_step1" ] && [ "$got" = "$want" ] &&
     [ -z "$(ls -A "$TMP/ck" | grep partial)" ] && [ "$(cat "$TMP/ck/latest")" = "global_step2" ]; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1)); echo "FAIL kill at $phase: rc=$rc latest=$latest digest $got vs $want; $(ls -A "$TMP/ck")"; cat "$TMP/err"
  fi
done

# SIGTERM stops a run at the next step boundary with a checkpoint (exit
# 143); resuming it to step N+2 gives the weights of N+2 straight steps.
rm -rf "$TMP/ck"
"$ZT" "$CFG" --steps 100000 "${CK[@]}" >"$TMP/long" 2>"$TMP/err" &
pid=$!
for _ in $(seq 200); do grep -q '"step":2,' "$TMP/long" 2>/dev/null && break; sleep 0.05; done
kill -TERM "$pid"
wait "$pid"
rc=$?
n="$(sed -n 's/^global_step//p' "$TMP/ck/latest" 2>/dev/null)"
# Its --json summary says it was stopped, and the steps asked for.
if [ "$rc" -eq 143 ] && [ -n "$n" ] && grep -q "stopped by signal 15 after step $n" "$TMP/err" &&
   tail -n 1 "$TMP/long" | python3 -c 'import json,sys; s=json.load(sys.stdin); n=int(sys.argv[1])
assert (s["event"], s["steps"], s["run_steps"], s["stopped_by"]) == ("summary", n, 100000, 15), s' "$n"; then
  "$ZT" "$CFG" --steps $((n + 2)) "${CK[@]}" --resume >"$TMP/after" 2>/dev/null
  "$ZT" "$CFG" --steps $((n + 2)) "${CK[@]}" >"$TMP/ref" 2>/dev/null
  if [ "$(tail -n 1 "$TMP/after" | python3 -c 'import json,sys; print(json.load(sys.stdin)["weights_digest"])')" = \
       "$(tail -n 1 "$TMP/ref" | python3 -c 'import json,sys; print(json.load(sys.stdin)["weights_digest"])')" ]; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1)); echo "FAIL SIGTERM resume digest"; tail -n 1 "$TMP/after" "$TMP/ref"
  fi
else
  fail=$((fail + 1)); echo "FAIL SIGTERM: rc=$rc latest=$n"; cat "$TMP/err"
fi

# --estimate: the human table, and JSON whose RAM is near the peak RSS a
# real run of the same config measures (zinc-bench estimate measures how
# near; here only that it is the right figure, not another).
check_error estimate-triad "train_batch_size" "$CFG" --estimate --ranks 3
if "$ZT" "$CFG" --estimate >"$TMP/out" 2>"$TMP/err" &&
   grep -q '^RAM per rank: .* | disk per rank: 0 B' "$TMP/out" &&
   grep -q '^  stage 3 (offload_optimizer none, offload_param none): RAM ' "$TMP/out" &&
   grep -q 'activations ' "$TMP/out"; then
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL estimate table"
  cat "$TMP/out" "$TMP/err"
fi
"$ZT" "$CFG" --steps 2 --set run.eval_interval=0 --json >"$TMP/run" 2>/dev/null
if "$ZT" "$CFG" --estimate --json >"$TMP/est" 2>"$TMP/err" &&
   "$ZT" "$NV" --estimate --json --ranks 2 --set zero_optimization.stage=3 \
     --set zero_optimization.offload_param.device=nvme --set "zero_optimization.offload_param.nvme_path=$TMP" \
     --set "zero_optimization.offload_optimizer.nvme_path=$TMP" >"$TMP/est3" 2>>"$TMP/err" &&
   python3 - "$TMP/est" "$TMP/run" "$TMP/est3" <<'PY'
import json, sys
est = json.loads(open(sys.argv[1]).read())
run = [json.loads(l) for l in open(sys.argv[2])][-1]
ratio = est["ram_bytes"] / run["peak_rss_bytes"]
assert 0.8 < ratio < 1.1, (est["ram_bytes"], run["peak_rss_bytes"])
assert est["disk_bytes"] == 0 and est["model_state_bytes"] > 0, est
assert {p["name"] for p in est["breakdown"]["training"]} >= {"activations", "kernel scratch"}, est
assert [s["zero_stage"] for s in est["other_stages"]] == [1, 2, 3], est
e3 = json.loads(open(sys.argv[3]).read())
assert e3["world_size"] == 2 and e3["zero_stage"] == 3 and e3["disk_bytes"] > 0, e3
names = [p["name"] for p in e3["breakdown"]["disk"]]
assert any(n.startswith("parameter shards") for n in names) and any(n.startswith("optimizer states") for n in names), names
PY
then
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL estimate json"
  cat "$TMP/est" "$TMP/est3" "$TMP/err"
fi
"$ZT" "$CFG" --ranks 2 >"$TMP/out" 2>"$TMP/err"
if [ $? -eq 2 ] && grep -q -- '--ranks needs --estimate or --check' "$TMP/err"; then
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL --ranks without --estimate"
  cat "$TMP/err"
fi

# --check: every key with its value and source, the warnings, and the
# verdict; exit 0 when the run would start, 1 with the refusal otherwise.
HF="$ROOT/configs/hf_auto.json"
"$ZT" "$HF" --check --ranks 2 --set run.steps=10 --set comms_logger.enabled=true \
  --set tensorboard.enabled=true --set "tensorboard.output_path=$TMP/tb" >"$TMP/out" 2>"$TMP/err"
rc=$?
if [ "$rc" -eq 0 ] && grep -qF 'zinc-train --check:' "$TMP/out" && grep -qF 'at 2 ranks' "$TMP/out" &&
   grep -qF 'optimizer.params.lr = 0.003 [auto: trainer.learning_rate]' "$TMP/out" &&
   grep -qF 'train_batch_size = 128 [auto: 2 ranks x micro-batch 32 x accumulation 2]' "$TMP/out" &&
   grep -qF 'zero_optimization.stage = 2 [file]' "$TMP/out" &&
   grep -qF 'run.steps = 10 [--set]' "$TMP/out" &&
   grep -qF 'aio.queue_depth = 8 [default]' "$TMP/out" &&
   grep -qF 'fp16.loss_scale_window = 1000 [file]' "$TMP/out" &&
   grep -qF 'comms_logger: ignored' "$TMP/out" && grep -qF 'tensorboard.enabled = true [--set]' "$TMP/out" &&
   grep -qF 'tensorboard.job_name = "DeepSpeedJobName" [default]' "$TMP/out" && [ ! -e "$TMP/tb" ] &&
   grep -qF 'ok: the run would start' "$TMP/out" && ! grep -q '^step' "$TMP/out" && [ ! -s "$TMP/err" ]; then
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL --check human (rc=$rc)"; cat "$TMP/out" "$TMP/err"
fi
# --steps reaches the config as run.steps: its source is --steps, not a --set.
"$ZT" "$HF" --check --set run.steps=10 --steps 7 >"$TMP/out" 2>"$TMP/err"
rc=$?
if [ "$rc" -eq 0 ] && grep -qF 'run.steps = 7 [--steps]' "$TMP/out"; then
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL --check --steps source (rc=$rc)"; cat "$TMP/out" "$TMP/err"
fi
# A --set of a whole section replaces the file's keys inside it: those the
# run then takes at their defaults are shown so, not as the file's values'
# source, and are not listed as given but unused.
"$ZT" "$CFG" --check --set 'data={"type":"synthetic"}' >"$TMP/out" 2>"$TMP/err"
rc=$?
if [ "$rc" -eq 0 ] && grep -qF 'data.seq_len = 256 [default]' "$TMP/out" &&
   grep -qF 'data.type = "synthetic" [--set]' "$TMP/out" && grep -qF 'model.n_layer = 2 [file]' "$TMP/out" &&
   ! grep -qF 'data.seq_len = 64' "$TMP/out"; then
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL --check sources under a section --set (rc=$rc)"; cat "$TMP/out" "$TMP/err"
fi
# The batch triad's member the file leaves out is derived from the other two.
if "$ZT" "$CFG" --check --json >"$TMP/out" 2>"$TMP/err" && python3 - "$TMP/out" "$CFG" <<'PY'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
assert len(lines) == 1, lines  # one object
r = json.loads(lines[0])
assert r["event"] == "check" and r["ok"] is True and r["refusals"] == [] and r["world_size"] == 1, r
keys = {k["path"]: k for k in r["keys"]}
cfg = json.load(open(sys.argv[2]))
# every leaf of the resolved config has an entry, and the file's values are "file"
assert keys["train_batch_size"]["source"] == "file" and keys["train_batch_size"]["value"] == cfg["train_batch_size"]
assert keys["train_micro_batch_size_per_gpu"]["source"] == "derived", keys["train_micro_batch_size_per_gpu"]
assert keys["zero_optimization.sub_group_size"]["source"] == "default"
assert r["config"]["model"]["n_layer"] == cfg["model"]["n_layer"] and keys["model.n_layer"]["source"] == "file"
assert set(keys) >= {"bf16.enabled", "optimizer.params.betas", "aio.block_size", "run.output_dir", "trainer.learning_rate"}
assert all(k["source"] in ("file", "default", "derived", "auto", "--set") for k in r["keys"])
PY
then
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL --check json"; cat "$TMP/out" "$TMP/err"
fi
# Refusals: exit 1, the ConfigError line, and training refuses the same.
check_refused() {  # name, expected substring, args...
  local name="$1" want="$2"
  shift 2
  "$ZT" "$@" --check >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  "$ZT" "$@" --check --json >"$TMP/out.json" 2>>"$TMP/err"
  local rcj=$?
  "$ZT" "$@" --steps 1 >"$TMP/out.train" 2>>"$TMP/err"
  local rct=$?
  if [ "$rc" -eq 1 ] && [ "$rcj" -eq 1 ] && [ "$rct" -eq 1 ] && grep '^refused: ' "$TMP/out" | grep -qF -- "$want" &&
     python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); assert not r["ok"] and sys.argv[2] in r["refusals"][0] and r["config"] is None, r' "$TMP/out.json" "$want"; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1))
    echo "FAIL --check refuses $name: rc=$rc json rc=$rcj train rc=$rct, want 'refused: $want'"
    cat "$TMP/out" "$TMP/out.json" "$TMP/err"
  fi
}
check_refused misspelt "zero_optimization.stag: unknown key (did you mean 'stage'?)" "$CFG" --set zero_optimization.stag=1
check_refused triad "train_batch_size" "$CFG" --set gradient_accumulation_steps=3
check_refused missing-data "data.path: cannot open $TMP/none.txt" "$CFG" --set data.type=text --set "data.path=$TMP/none.txt"
check_refused nvme-path "zero_optimization.offload_optimizer.nvme_path: nvme_path $TMP/absent does not exist" \
  "$NV" --set "zero_optimization.offload_optimizer.nvme_path=$TMP/absent"
check_refused heads "model.n_embd: must be divisible by n_head 3" "$CFG" --set model.n_head=3
check_refused curriculum "curriculum_learning" "$CFG" --set 'curriculum_learning={"enabled":true}'
touch "$TMP/file"
check_refused csv-folder "csv_monitor.output_path" "$CFG" --set csv_monitor.enabled=true --set "csv_monitor.output_path=$TMP/file/x"
check_refused tb-folder "tensorboard.output_path: $TMP/file/x/DeepSpeedJobName" "$CFG" --set tensorboard.enabled=true \
  --set "tensorboard.output_path=$TMP/file/x"
check_refused wandb "wandb.enabled: wandb logs to a network service" "$CFG" --set wandb.enabled=true
check_refused comet "use tensorboard or csv_monitor" "$CFG" --set comet.enabled=true
printf '{"train_batch_size": 4,}' >"$TMP/bad.json"
check_refused bad-json "JSON syntax error at line 1" "$TMP/bad.json"

# A training run with --json says its whole resolved config once, at the start.
if "$ZT" "$HF" --steps 1 --json >"$TMP/out" 2>"$TMP/err" && python3 - "$TMP/out" <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
cfgs = [e for e in ev if e["event"] == "config"]
assert len(cfgs) == 1 and ev.index(cfgs[0]) < min(i for i, e in enumerate(ev) if e["event"] == "step"), ev
c = cfgs[0]["config"]
assert c["train_batch_size"] == 64 and c["optimizer"]["params"]["lr"] == 0.003 and c["run"]["steps"] == 1, c
assert c["scheduler"]["type"] == "WarmupDecayLR" and c["zero_optimization"]["stage"] == 2 and "trainer" in c, c
PY
then
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL config event"; cat "$TMP/out" "$TMP/err"
fi

# configs/zero3_offload.json: --check accepts it and it trains (stage 3 with
# both offloads to cpu: the summary reports ZeRO-3's gathers).
Z3O="$ROOT/configs/zero3_offload.json"
if "$ZT" "$Z3O" --check --ranks 2 >"$TMP/out" 2>"$TMP/err" &&
   grep -qF 'zero_optimization.offload_param.device = "cpu" [file]' "$TMP/out" &&
   "$ZT" "$Z3O" --steps 2 --set run.eval_interval=0 --set "run.output_dir=$TMP/z3o" --json >"$TMP/out" 2>"$TMP/err" &&
   python3 - "$TMP/out" <<'PY'
import json, math, sys
ev = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
s = ev[-1]
assert s["event"] == "summary" and s["steps"] == 2 and s["zero_stage"] == 3 and math.isfinite(s["final_loss"]), s
assert s["zero3"]["gathers"] > 0, s
c = [e for e in ev if e["event"] == "config"][0]["config"]["zero_optimization"]
assert c["offload_optimizer"]["device"] == "cpu" and c["offload_param"]["device"] == "cpu", c
PY
then
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL zero3_offload"; cat "$TMP/out" "$TMP/err"
fi
# Activation checkpointing: the same losses step by step with it on (from the
# model section or the trainer section); --estimate counts fewer activation
# bytes; the two sections disagreeing is one error naming both.
check_error ckpt-conflict "model.gradient_checkpointing: false conflicts with trainer.gradient_checkpointing true" \
  "$CFG" --set model.gradient_checkpointing=false --set trainer.gradient_checkpointing=true
if "$ZT" "$CFG" --steps 3 --set run.eval_interval=0 --set steps_per_print=1 --json >"$TMP/ck0" 2>"$TMP/err" &&
   "$ZT" "$CFG" --steps 3 --set run.eval_interval=0 --set steps_per_print=1 --set model.gradient_checkpointing=true --json >"$TMP/ck1" 2>>"$TMP/err" &&
   "$ZT" "$CFG" --steps 3 --set run.eval_interval=0 --set steps_per_print=1 --set trainer.gradient_checkpointing=true --json >"$TMP/ck2" 2>>"$TMP/err" &&
   "$ZT" "$CFG" --estimate --json >"$TMP/cke0" 2>>"$TMP/err" &&
   "$ZT" "$CFG" --estimate --json --set model.gradient_checkpointing=true >"$TMP/cke1" 2>>"$TMP/err" &&
   python3 - "$TMP/ck0" "$TMP/ck1" "$TMP/ck2" "$TMP/cke0" "$TMP/cke1" <<'PY'
import json, sys
def losses(path):
    return [e["loss"] for e in map(json.loads, open(path)) if e["event"] == "step"]
plain = losses(sys.argv[1])
assert len(plain) == 3, plain
assert losses(sys.argv[2]) == plain and losses(sys.argv[3]) == plain, (plain, losses(sys.argv[2]), losses(sys.argv[3]))
def act(path):
    e = json.loads(open(path).read())
    return e, {p["name"]: p["bytes"] for p in e["breakdown"]["training"]}["activations"]
e0, a0 = act(sys.argv[4])
e1, a1 = act(sys.argv[5])
assert e0["gradient_checkpointing"] is False and e1["gradient_checkpointing"] is True
assert a1 < a0 and e1["ram_bytes"] < e0["ram_bytes"], (a0, a1)
PY
then
  pass=$((pass + 1))
else
  fail=$((fail + 1))
  echo "FAIL gradient checkpointing"
  cat "$TMP/err"
fi

# Issue 27, through zinc-train.
# keep_last into a folder holding later steps of another run: the new save
# stays and `latest` names it (before, step 4 was pruned at once and
# `latest` dangled); the other run's tags stay.
rm -rf "$TMP/ck"
"$ZT" "$CFG" --steps 2 "${CK[@]}" --set run.checkpoint_interval=1 >/dev/null 2>&1
mv "$TMP/ck/global_step1" "$TMP/ck/global_step38"; mv "$TMP/ck/global_step2" "$TMP/ck/global_step40"
"$ZT" "$CFG" --steps 4 "${CK[@]}" --set run.checkpoint_interval=2 --set run.keep_last=2 >/dev/null 2>"$TMP/err"
if [ "$(cat "$TMP/ck/latest")" = "global_step4" ] && [ -f "$TMP/ck/global_step4/metadata.json" ] &&
   [ -d "$TMP/ck/global_step38" ] && [ -d "$TMP/ck/global_step40" ] && [ -d "$TMP/ck/global_step2" ]; then
  pass=$((pass + 1))
else
  fail=$((fail + 1)); echo "FAIL keep_last beside later steps: $(ls -A "$TMP/ck")"; cat "$TMP/err"
fi
# Two runs on one checkpoint folder: the second is refused at start, naming
# the folder and the first one's pid, and the first one's tags are its own.
rm -rf "$TMP/ck"
"$ZT" "$CFG" --steps 100000 "${CK[@]}" >"$TMP/long" 2>/dev/null &
pid=$!
for _ in $(seq 200); do grep -q '"step":1,' "$TMP/long" 2>/dev/null && break; sleep 0.05; done
check_error second-run "is in use by another run (pid $pid on" "$CFG" --steps 3 "${CK[@]}" --set run.checkpoint_interval=1
kill -KILL "$pid"; wait "$pid" 2>/dev/null
# Two runs exporting to one --save-pretrained folder: the second is refused
# at start, before its training, naming the folder and the first one's pid
# (before, both trained and then wrote their shards over each other's). A
# killed holder leaves its lock file but no lock: the next export goes ahead.
rm -rf "$TMP/hfout"
"$ZT" "$CFG" --steps 100000 --set run.eval_interval=0 --set steps_per_print=1 --json \
  --set "run.checkpoint_dir=$TMP/ck_a" --save-pretrained "$TMP/hfout" >"$TMP/long" 2>/dev/null &
pid=$!
for _ in $(seq 200); do grep -q '"step":1,' "$TMP/long" 2>/dev/null && break; sleep 0.05; done
check_error second-export "--save-pretrained: export folder $TMP/hfout is in use by another run (pid $pid on" \
  "$CFG" --steps 3 --set "run.checkpoint_dir=$TMP/ck_b" --save-pretrained "$TMP/hfout"
kill -KILL "$pid"; wait "$pid" 2>/dev/null
if "$ZT" "$CFG" --steps 1 --set run.eval_interval=0 --set "run.checkpoint_dir=$TMP/ck_b" \
     --save-pretrained "$TMP/hfout" >"$TMP/out" 2>"$TMP/err" && [ -f "$TMP/hfout/config.json" ]; then
  pass=$((pass + 1))
else
  fail=$((fail + 1)); echo "FAIL export after its holder was killed"; cat "$TMP/err"
fi
# An unwritable run.checkpoint_dir fails at start, before any step, naming
# the key (before, at the first save, after checkpoint_interval steps).
start=$(date +%s%N)
check_error unwritable-ckpt-dir "run.checkpoint_dir: checkpoint folder /proc/zinc-nowhere/ck cannot be created" \
  "$CFG" --steps 1000 --set run.checkpoint_dir=/proc/zinc-nowhere/ck --set run.checkpoint_interval=1000
if grep -q '^step' "$TMP/out" || [ $(( ($(date +%s%N) - start) / 1000000 )) -gt 5000 ]; then
  fail=$((fail + 1)); echo "FAIL unwritable checkpoint dir: trained first"; cat "$TMP/out"
fi
# Signals from the first instruction: SIGINT while zinc-train still scans
# its data (an 8 GiB sparse token file) ends it at once with 130 (before,
# the signal was blocked until training began).
truncate -s 8G "$TMP/huge.bin"
"$ZT" "$CFG" --set data.type=tokens --set "data.path=$TMP/huge.bin" >"$TMP/out" 2>"$TMP/err" &
pid=$!
sleep 0.5
t0=$(date +%s%N)
kill -INT "$pid"
wait "$pid"
rc=$?
ms=$(( ($(date +%s%N) - t0) / 1000000 ))
rm -f "$TMP/huge.bin"
if [ "$rc" -eq 130 ] && [ "$ms" -lt 1000 ] && grep -q "signal 2: stopping now" "$TMP/err"; then
  pass=$((pass + 1))
else
  fail=$((fail + 1)); echo "FAIL SIGINT during start: rc=$rc after ${ms} ms"; cat "$TMP/err"
fi
# NVMe scratch: a folder left by a dead process is removed at the next
# start, with a line saying so; a second stop signal during training
# removes the run's own before it ends the process.
mkdir -p "$TMP/nvme"
sh -c 'exit 0' & dead=$!; wait "$dead"
mkdir -p "$TMP/nvme/zinc-rank0-$dead" && touch "$TMP/nvme/zinc-rank0-$dead/0-optimizer_states"
# A folder of that form holding what zinc's scratch does not (<id>-<name>
# files) is the user's: kept, with its file, and said so.
mkdir -p "$TMP/nvme/zinc-rank1-$dead" && echo precious > "$TMP/nvme/zinc-rank1-$dead/important.txt"
NV=(--set "zero_optimization.offload_optimizer.nvme_path=$TMP/nvme" --set run.eval_interval=0)
"$ZT" "$ROOT/configs/nvme.json" --steps 100000 "${NV[@]}" --set steps_per_print=1 >"$TMP/long" 2>"$TMP/err" &
pid=$!
for _ in $(seq 400); do grep -q '^step 1/' "$TMP/long" 2>/dev/null && break; sleep 0.05; done
kill -INT "$pid"; kill -TERM "$pid"  # two signals: the second ends it at once (exit 143), scratch removed first
wait "$pid"
rc=$?
if [ "$rc" -eq 143 ] && grep -q "signal 15: stopping now" "$TMP/err" && [ "$(ls -A "$TMP/nvme")" = "zinc-rank1-$dead" ] &&
   grep -q "zinc-rank0-$dead, scratch left by process $dead" "$TMP/err" &&
   grep -q "kept .*zinc-rank1-$dead (its process $dead is gone): it holds important.txt" "$TMP/err" &&
   [ "$(cat "$TMP/nvme/zinc-rank1-$dead/important.txt")" = precious ]; then
  pass=$((pass + 1))
else
  fail=$((fail + 1)); echo "FAIL NVMe scratch: rc=$rc left: $(ls -A "$TMP/nvme")"; cat "$TMP/err"
fi

# Room for the run (tools/resources.h): a model whose --estimate needs far
# more RAM than this machine has, with its NVMe files larger than the disk,
# is refused by --check and by a run within a second, naming the figures
# (before, --check passed and the run died by the OOM killer).
BIG=(--set model.n_layer=48 --set model.n_embd=8192 --set model.n_head=64)
NVME=(--set zero_optimization.stage=3 --set zero_optimization.offload_optimizer.device=nvme
      --set "zero_optimization.offload_optimizer.nvme_path=$TMP" --set zero_optimization.offload_param.device=nvme
      --set "zero_optimization.offload_param.nvme_path=$TMP")
start=$(date +%s%N)
"$ZT" "$CFG" "${BIG[@]}" "${NVME[@]}" --check >"$TMP/out" 2>"$TMP/err"
rc=$?
ms=$(( ($(date +%s%N) - start) / 1000000 ))
if [ "$rc" -eq 1 ] && grep -q "^refused: RAM: this rank will need .* [GMK]iB more .* but the process may take .* [GMK]iB" "$TMP/out" &&
   grep -q "^refused: disk: zero_optimization.offload_optimizer.nvme_path, zero_optimization.offload_param.nvme_path $TMP: .* [GMK]iB .* has .* [GMK]iB free" "$TMP/out" &&
   [ "$ms" -lt 1000 ]; then
  pass=$((pass + 1))
else
  fail=$((fail + 1)); echo "FAIL no room: rc=$rc ${ms} ms"; cat "$TMP/out" "$TMP/err"
fi
check_error no-room "no room for this run: RAM: this rank will need" "$CFG" "${BIG[@]}" "${NVME[@]}"
grep -q " | disk: zero_optimization" "$TMP/err" || { fail=$((fail + 1)); echo "FAIL no room (run): no disk figure"; }
"$ZT" "$CFG" "${BIG[@]}" --check --ignore-resources >"$TMP/out" 2>&1 && grep -q "^ok: the run would start" "$TMP/out" &&
  pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL --ignore-resources"; cat "$TMP/out"; }
# Past the room check (--ignore-resources), an allocation that fails says
# so, not "std::bad_alloc". Only where the kernel refuses an allocation far
# past RAM (overcommit 0 or 2; with 1 it would be granted and the OOM killer
# would end the test instead).
if [ "$(cat /proc/sys/vm/overcommit_memory 2>/dev/null)" != 1 ]; then
  check_error out-of-memory "out of memory: an allocation failed (std::bad_alloc); \`zinc-train CONFIG --estimate\`" \
    "$CFG" --set model.n_layer=1 --set model.n_embd=65536 --set model.n_head=64 --ignore-resources
fi
# Under a cgroup memory cap (a child of this process's memory cgroup, v1 or
# v2, where this machine lets us make one): GPT-2 small fits the machine but
# not 256 MiB, and the refusal names the cgroup's limit.
cg=""
line="$(grep -E '^[0-9]+:memory:' /proc/self/cgroup | head -n 1)"
if [ -n "$line" ]; then cg="/sys/fs/cgroup/memory${line#*:memory:}"; lim=memory.limit_in_bytes
elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then cg="/sys/fs/cgroup$(sed -n 's/^0:://p' /proc/self/cgroup)"; lim=memory.max; fi
child="${cg%/}/zinc-cli-$$"
if [ -n "$cg" ] && mkdir "$child" 2>/dev/null && echo $((256 << 20)) >"$child/$lim" 2>/dev/null; then
  sh -c 'echo $$ >"$1/cgroup.procs" && shift && exec "$@"' sh "$child" "$ZT" "$CFG" --set model.n_layer=12 \
    --set model.n_embd=768 --set model.n_head=12 --check >"$TMP/out" 2>&1
  rc=$?
  if [ "$rc" -eq 1 ] && grep -q "^refused: RAM: .*(cgroup $child/$lim = 256.0 MiB" "$TMP/out"; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1)); echo "FAIL cgroup cap: rc=$rc"; cat "$TMP/out"
  fi
  rmdir "$child" 2>/dev/null
else
  rmdir "$child" 2>/dev/null
  echo "SKIP cgroup cap: cannot make a memory cgroup here (not counted)"
fi

# Usage errors exit 2 with one line (CLI11's own codes, 105-114, leaked out
# before), a misspelt option names the nearest one, and an empty export path
# (an unset shell variable) is refused rather than writing nothing.
check_usage() {  # name, expected substring, args...
  local name="$1" want="$2"
  shift 2
  "$ZT" "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  if [ "$rc" -eq 2 ] && [ "$(wc -l <"$TMP/err")" -eq 1 ] && grep -qF -- "$want" "$TMP/err"; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1)); echo "FAIL usage $name: rc=$rc"; cat "$TMP/err"
  fi
}
check_usage no-config "zinc-train: error: config is required"
check_usage misspelt "unknown option --stesp (did you mean --steps?)" "$CFG" --stesp 3
check_usage no-value "--steps: 1 required INT missing" "$CFG" --steps
check_usage twice "--steps: At Most 1 required but received 2" "$CFG" --steps 1 --steps 2
for flag in --save-weights --save-adapter --save-pretrained; do
  check_usage "empty $flag" "$flag: an empty path names no" "$CFG" --steps 1 "$flag" ""
done
# An option that would do nothing (it was taken without a word).
check_usage "--max-shard-size alone" "--max-shard-size needs --save-pretrained" "$CFG" --steps 1 \
  --save-weights "$TMP/w.safetensors" --max-shard-size 1MB

# Standard output that cannot be written (a full disk under `> log`): the
# run goes on, says so once naming the reason, and exits 1, not 0 with its
# lines lost.
"$ZT" "$CFG" --steps 3 --set run.eval_interval=0 --json >/dev/full 2>"$TMP/err"
rc=$?
if [ "$rc" -eq 1 ] && [ "$(grep -c 'cannot write standard output: No space left on device' "$TMP/err")" -eq 1 ]; then
  pass=$((pass + 1))
else
  fail=$((fail + 1)); echo "FAIL stdout to /dev/full: rc=$rc"; cat "$TMP/err"
fi
# A reader of standard output that goes away (`| head`): SIGPIPE ended the
# run without a word, with no checkpoint and no export. Now the run goes on,
# says so once, writes both and exits 1.
rm -rf "$TMP/pipe"
mkdir -p "$TMP/pipe"
"$ZT" "$CFG" --steps 20 --set run.eval_interval=0 --set steps_per_print=1 --set run.checkpoint_interval=10 \
  --set "run.checkpoint_dir=$TMP/pipe/ck" --save-weights "$TMP/pipe/w.safetensors" 2>"$TMP/err" | head -n 2 >/dev/null
rc=${PIPESTATUS[0]}
if [ "$rc" -eq 1 ] && [ "$(grep -c 'cannot write standard output: Broken pipe' "$TMP/err")" -eq 1 ] &&
   [ "$(cat "$TMP/pipe/ck/latest" 2>/dev/null)" = "global_step20" ] && [ -s "$TMP/pipe/w.safetensors" ]; then
  pass=$((pass + 1))
else
  fail=$((fail + 1)); echo "FAIL stdout reader gone: rc=$rc $(ls -A "$TMP/pipe" "$TMP/pipe/ck" 2>&1 | tr '\n' ' ')"; cat "$TMP/err"
fi
# Standard error closed (`2>&-`): its number went to the next file opened,
# the checkpoint folder's lock, and the log wrote into it; a second run on
# the folder then named a log line as the holder.
rm -rf "$TMP/pipe/ck2"
"$ZT" "$CFG" --steps 2 --set run.eval_interval=0 --set run.checkpoint_interval=2 \
  --set "run.checkpoint_dir=$TMP/pipe/ck2" >/dev/null 2>&-
rc=$?
if [ "$rc" -eq 0 ] && grep -qE '^pid [0-9]+ on ' "$TMP/pipe/ck2/.zinc.lock" && ! grep -q 'zinc\[' "$TMP/pipe/ck2/.zinc.lock"; then
  pass=$((pass + 1))
else
  fail=$((fail + 1)); echo "FAIL stderr closed: rc=$rc lock: $(head -c 200 "$TMP/pipe/ck2/.zinc.lock")"
fi
# A closed terminal (SIGHUP, an SSH session that dropped) stops the run at
# the next step with a checkpoint, as SIGTERM does (exit 129); it ended the
# run at once, the steps since the last save lost.
rm -rf "$TMP/pipe/ck3"
"$ZT" "$CFG" --steps 100000 --set run.eval_interval=0 --set steps_per_print=1 --json \
  --set "run.checkpoint_dir=$TMP/pipe/ck3" >"$TMP/long" 2>"$TMP/err" &
pid=$!
for _ in $(seq 200); do grep -q '"step":2,' "$TMP/long" 2>/dev/null && break; sleep 0.05; done
kill -HUP "$pid"
wait "$pid"
rc=$?
n="$(sed -n 's/^global_step//p' "$TMP/pipe/ck3/latest" 2>/dev/null)"
if [ "$rc" -eq 129 ] && [ -n "$n" ] && grep -q "stopped by signal 1 after step $n" "$TMP/err"; then
  pass=$((pass + 1))
else
  fail=$((fail + 1)); echo "FAIL SIGHUP: rc=$rc latest=$n"; cat "$TMP/err"
fi
# A signal in the exports at the end: the export under way finishes, those
# after it are skipped and named (the run ended at once, saying "nothing to
# save", one export new and the next one old); without a checkpoint every
# export is written, the run's only copy of its weights. ZINC_EXPORT_FAULT
# stops each export folder at its staged files (SIGSTOP): the signal comes
# in the first, --save-pretrained; --save-adapter comes after it.
for ck in with without; do
  rm -rf "$TMP/sig" && mkdir -p "$TMP/sig"
  ckargs=()
  [ "$ck" = with ] && ckargs=(--set run.checkpoint_interval=1 --set "run.checkpoint_dir=$TMP/sig/ck")
  (cd "$ROOT" && ZINC_EXPORT_FAULT=staged:stop exec "$ZT" configs/finetune_llama.json --steps 1 \
     --set run.eval_interval=0 --set 'model.lora={"r":4,"target_modules":"all-linear"}' "${ckargs[@]}" \
     --save-pretrained "$TMP/sig/hf" --merge --save-adapter "$TMP/sig/ad" >/dev/null 2>"$TMP/err") &
  pid=$!
  stopped() { [ "$(ps -o stat= -p "$pid" 2>/dev/null | cut -c1)" = T ]; }
  for _ in $(seq 600); do stopped && break; sleep 0.05; done
  kill -TERM "$pid"
  for _ in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; stopped && kill -CONT "$pid"; sleep 0.05; done
  wait "$pid"
  rc=$?
  if [ "$ck" = with ]; then
    ok=$([ "$rc" -eq 143 ] && [ -s "$TMP/sig/hf/config.json" ] && [ ! -e "$TMP/sig/ad" ] &&
         grep -q "stopped by signal 15 in the exports: --save-adapter not written" "$TMP/err" && echo y)
  else
    ok=$([ "$rc" -eq 143 ] && [ -s "$TMP/sig/hf/config.json" ] && [ -s "$TMP/sig/ad/adapter_config.json" ] &&
         grep -q "stopping after the exports, the only copy of this run's weights" "$TMP/err" && echo y)
  fi
  if [ "$ok" = y ]; then
    pass=$((pass + 1))
  else
    fail=$((fail + 1)); echo "FAIL signal in the exports ($ck a checkpoint): rc=$rc $(ls -A "$TMP/sig")"; cat "$TMP/err"
  fi
done
# An export that cannot fit on its disk is refused at the start, beside the
# rest that does not fit (it failed after the last step, the weights lost
# where no checkpoint was saved): 12 * 65536^2 * 2000 parameters in fp32.
check_error export-room "disk: --save-weights $TMP/w.safetensors: the run will write" \
  "$CFG" --steps 1 --set model.n_embd=65536 --set model.n_layer=2000 --set model.n_head=64 \
  --save-weights "$TMP/w.safetensors"

# zinc-bench's usage errors: one line and exit 2, as zinc-train's (CLI11's
# own codes 105 and 106, and a 308-digit range, before); --json's skip is a
# JSON line.
ZB="$(dirname "$ZT")/../bench/zinc-bench"
if [ -x "$ZB" ]; then
  ok=y
  for args in "" "adamw --threads 0" "estimate --rounds x" "adamw --thread 2"; do
    # shellcheck disable=SC2086
    "$ZB" $args >"$TMP/out" 2>"$TMP/err"
    rc=$?
    if [ "$rc" -ne 2 ] || [ "$(wc -l <"$TMP/err")" -ne 1 ] || ! grep -q '^zinc-bench: error: ' "$TMP/err"; then
      ok=n; echo "zinc-bench $args: rc=$rc"; cat "$TMP/err"
    fi
  done
  CUDA_VISIBLE_DEVICES= "$ZB" gpu-train-step --json >"$TMP/out" 2>/dev/null  # no GPU seen: the skip
  python3 -c 'import json,sys; l=json.loads(open(sys.argv[1]).read()); assert l["bench"]=="gpu-train-step" and l["skipped"]' \
    "$TMP/out" || { ok=n; echo "zinc-bench gpu-train-step --json: $(cat "$TMP/out")"; }
  if [ "$ok" = y ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL zinc-bench usage"; fi
fi

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
