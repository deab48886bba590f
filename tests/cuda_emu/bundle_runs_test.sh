#!/usr/bin/env bash
# What gpu-bundle/run.sh runs on a GPU machine (its "train" and "bench"
# parts), shortened, under kernel emulation (Note [kernel emulation] in
# cuda_emu.h): zinc-train on the GPU path with the bundle's two configs, and
# zinc-bench gpu-train-step on a tiny GPT in each of its modes, with the
# GPU profile's round. Each run must
# end with status 0 and print what a user reads; the figures mean nothing.
# usage: bundle_runs_test.sh ZINC_TRAIN_EMU ZINC_BENCH_EMU SOURCE_DIR
set -u
train=$1 bench=$2 src=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
expect() {  # expect NAME PATTERN FILE
  if ! grep -q -- "$2" "$3"; then
    echo "FAIL: $1: no line matching '$2' in its output:"
    sed 's/^/  | /' "$3" | tail -20
    fail=1
  fi
}
run() {  # run NAME CMD...: status 0 wanted
  local name=$1
  shift
  echo "== $name"
  if ! "$@" >"$tmp/out" 2>&1; then
    echo "FAIL: $name: exit status $?"
    sed 's/^/  | /' "$tmp/out" | tail -30
    fail=1
  fi
  cp "$tmp/out" "$tmp/last"
}

run "zinc-train, ZeRO-Offload on the GPU (stage 2)" "$train" "$src/configs/default.json" --set device=cuda \
  --set zero_optimization.stage=2 --set zero_optimization.offload_optimizer.device=cpu --set run.steps=3 \
  --set steps_per_print=1 --set run.eval_interval=0 --set run.output_dir="$tmp/default"
expect "zinc-train stage 2" "GPU model state peak" "$tmp/last"
gpu_loss=$(sed -n 's/.*final loss \([0-9.]*\).*/\1/p' "$tmp/last")
run "zinc-train, the same on the CPU" "$train" "$src/configs/default.json" --set device=cpu \
  --set zero_optimization.stage=2 --set zero_optimization.offload_optimizer.device=cpu --set run.steps=3 \
  --set steps_per_print=1 --set run.eval_interval=0 --set run.output_dir="$tmp/default_cpu"
cpu_loss=$(sed -n 's/.*final loss \([0-9.]*\).*/\1/p' "$tmp/last")
# bf16 on both; the GPU's GEMMs add in another order: the same loss to 1e-2.
if ! awk -v g="$gpu_loss" -v c="$cpu_loss" 'BEGIN { d = g - c; if (d < 0) d = -d; exit !(g != "" && c != "" && d < 1e-2) }'; then
  echo "FAIL: final loss on the GPU path '$gpu_loss' and on the CPU '$cpu_loss' differ by 1e-2 or more"
  fail=1
else
  echo "   final loss: GPU path $gpu_loss, CPU $cpu_loss"
fi

# --check weighs the estimate's GPU memory against the GPU's: a GPU of 1 MB
# (the emulated one's ZINC_EMU_GPU_BYTES) is refused with one line, before
# anything runs (a 3496 GiB estimate once passed as "ok").
echo "== zinc-train --check on a GPU too small"
if ZINC_EMU_GPU_BYTES=1000000 "$train" "$src/configs/default.json" --set device=cuda --check >"$tmp/out" 2>&1; then
  echo "FAIL: --check passed a run whose estimate is past the GPU's memory"
  fail=1
fi
expect "--check on a small GPU" "GPU: this rank will need .* of GPU memory (--estimate: .* per rank, before the CUDA context), but the GPU has .* free of .*; lower the model" "$tmp/out"

run "zinc-train, stage 3 on the GPU" "$train" "$src/configs/zero3_offload.json" --set device=cuda --set run.steps=2 \
  --set steps_per_print=1 --set run.eval_interval=0 --set run.output_dir="$tmp/zero3"
expect "zinc-train stage 3" "loss" "$tmp/last"

for mode in "" "--ratio 0.5" "--resident" "--stage 3"; do
  # shellcheck disable=SC2086
  run "zinc-bench gpu-train-step --tiny $mode" "$bench" gpu-train-step --tiny --rounds 1 --steps 1 --gas 2 --profile $mode
  expect "gpu-train-step $mode" "gpu-train-step (tiny: zinc kernel emulation" "$tmp/last"
  expect "gpu-train-step $mode" "ratio:" "$tmp/last"
  # The GPU profile's round (Note [the GPU profile]): the kinds every step has.
  expect "gpu-train-step --profile $mode" "GPU time a step by kind: matmul .*attention .*layernorm" "$tmp/last"
  expect "gpu-train-step --profile $mode" "main stream: .* ms in the calls" "$tmp/last"
  case "$mode" in
  --resident) expect "gpu-train-step --profile $mode" "| optimizer " "$tmp/last" ;;
  *) expect "gpu-train-step --profile $mode" "another stream: copy .* of the step" "$tmp/last" ;;  # the engine's copies
  esac
  case "$mode" in  # the offloaded modes' update runs behind the forward
  "") expect "gpu-train-step" "the CPU update behind the next forward" "$tmp/last" ;;
  --ratio*) expect "gpu-train-step $mode" "ZeRO-Offload (offload ratio 0.5)" "$tmp/last" ;;
  esac
  # The Llama case's code, at a toy size.
  # shellcheck disable=SC2086
  run "zinc-bench gpu-train-step --tiny --model llama $mode" "$bench" gpu-train-step --tiny --model llama --rounds 1 \
    --steps 1 --gas 2 $mode
  expect "gpu-train-step llama $mode" "gpu-train-step (llama-tiny: zinc kernel emulation" "$tmp/last"
  expect "gpu-train-step llama $mode" "ratio:" "$tmp/last"
done
expect "gpu-train-step --stage 3" "stage 3: " "$tmp/last"
expect "gpu-train-step --stage 3" "uploaded a step; at the measured .* GB/s from page-locked memory" "$tmp/last"
# "device": "auto" with a GPU visible stays on the CPU, saying why, where
# only the model can refuse the GPU path (it stopped the run before), and
# --check refuses what the run would refuse with "cuda" (a tied head over
# pipeline stages: --check said ok, the run refused).
run "zinc-train, device auto with a CPU-only model" "$train" "$src/configs/mlp.json" --set device=auto \
  --set run.steps=1 --set run.eval_interval=0 --set run.output_dir="$tmp/auto_mlp"
expect "device auto, mlp" "\"auto\" stays on the CPU: device: model \"mlp\" computes on the CPU only" "$tmp/last"
echo "== zinc-train --check, a tied head over 2 pipeline stages on the GPU"
if "$train" "$src/configs/pipeline.json" --set device=cuda --set model.tie_word_embeddings=true --check --ranks 2 \
  >"$tmp/out" 2>&1; then
  echo "FAIL: --check accepted a tied head over pipeline stages on the GPU path"
  fail=1
fi
expect "--check, tied head" "does not sum between stages yet" "$tmp/out"
run "zinc-train --check, the same with device auto" "$train" "$src/configs/pipeline.json" --set device=auto \
  --set model.tie_word_embeddings=true --check --ranks 2
expect "--check, tied head, auto" "\"auto\" stays on the CPU" "$tmp/last"
expect "--check, tied head, auto" "ok: the run would start" "$tmp/last"
# "device": "auto" is decided on each rank: a rank without a GPU
# (ZINC_EMU_GPUS=0) and one with must be refused at start with one line,
# not wait on each other's different collectives until the timeout.
echo "== zinc-train, device auto on two ranks, one of them without a GPU"
MPMD=(mpirun --oversubscribe -x OMP_NUM_THREADS=1)
[ "$(id -u)" -eq 0 ] && MPMD+=(--allow-run-as-root)
small=(--set run.steps=2 --set model.n_layer=1 --set model.n_embd=32 --set model.n_head=2 --set data.seq_len=16
       --set train_micro_batch_size_per_gpu=2 --set train_batch_size=4 --set run.eval_interval=0 --set device=auto
       --set zero_optimization.stage=2 --set comm.timeout_seconds=60 --set run.output_dir="$tmp/mixed")
if timeout 120 "${MPMD[@]}" -np 1 env ZINC_EMU_GPUS=0 "$train" "$src/configs/default.json" "${small[@]}" : \
  -np 1 env ZINC_EMU_GPUS=1 "$train" "$src/configs/default.json" "${small[@]}" >"$tmp/out" 2>&1; then
  echo "FAIL: two ranks on different devices trained"
  fail=1
fi
expect "device auto, mixed ranks" "device: the ranks compute on different devices: rank 1 on \"cuda\", rank 0 on \"cpu\"" "$tmp/out"
# gpu-train-step's flags that it would drop without a word are refused.
for flags in "--resident --ratio 0.5" "--tiny --large" "--fp16" "--ratio 0"; do
  # shellcheck disable=SC2086
  if "$bench" gpu-train-step --tiny $flags --rounds 1 --steps 1 >"$tmp/out" 2>&1; then
    echo "FAIL: gpu-train-step $flags: accepted"
    fail=1
  fi
done
exit $fail
