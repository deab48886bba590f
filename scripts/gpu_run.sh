#!/usr/bin/env bash
# The GPU bundle's run.sh (scripts/gpu_bundle.sh copies it in beside bin/,
# lib/, configs/, bench/ and wheels/; tests/cuda_emu/run_sh_test.sh runs it
# under kernel emulation). zinc's GPU checks on a machine with a GPU: the GPU tests, the benchmarks
# with the PyTorch peer (the acceptance cases first), the training runs,
# the DeepSpeed peer and, where Nsight Systems runs, a profile. Results go
# to stdout and, with a first argument, into that folder: run.log (all of
# stdout), gpu-train-step.jsonl, torch-peer.jsonl, deepspeed-peer.jsonl and
# gpu-step-profile.txt, five files at most; at the end, the table of issue
# 53's aims from them (bench/gpu_summary.py). A second argument picks parts,
# comma-separated (tests, bench, train, deepspeed, profile; default all),
# which run in that order.
#   bash run.sh [RESULTS_DIR] [PART[,PART...]|all]
# ZINC_BUNDLE_BUDGET_S=N: no item starts once N seconds have passed, and
# each is cut at what is left, so that a call with a time limit ends inside
# it with what it measured (and says what it skipped).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
export PYTHONUNBUFFERED=1
export ZINC_EXPECT_GPU=1  # a GPU test that finds no GPU fails here instead of skipping
[ -d /usr/local/cuda/lib64 ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:/usr/local/cuda/lib64"  # cuBLAS, NCCL
# Where the toolkit has no cuBLAS or NCCL, the Python packages' copies
# (nvidia-cublas, nvidia-nccl beside PyTorch) are searched after it.
pylibs="$(python3 -c '
import glob, os, site
dirs = []
for sp in site.getsitepackages():
    for d in sorted(glob.glob(os.path.join(sp, "nvidia", "**", "lib"), recursive=True)):
        if glob.glob(os.path.join(d, "libcublas.so*")) + glob.glob(os.path.join(d, "libnccl.so*")):
            dirs.append(d)
print(":".join(dirs))' 2>/dev/null || true)"
[ -n "$pylibs" ] && export LD_LIBRARY_PATH="$LD_LIBRARY_PATH:$pylibs"
res="${1:-}"
part="${2:-all}"
for p in ${part//,/ }; do
  case "$p" in tests|train|bench|profile|deepspeed|all) ;; *) echo "run.sh: unknown part '$p' (tests, bench, train, deepspeed, profile or all)" >&2; exit 2 ;; esac
done
budget="${ZINC_BUNDLE_BUDGET_S:-0}"
case "$budget" in ''|*[!0-9]*) echo "run.sh: ZINC_BUNDLE_BUDGET_S must be whole seconds, got '$budget'" >&2; exit 2 ;; esac
want() { [[ ",$part," == *",all,"* || ",$part," == *",$1,"* ]]; }
if [ -n "$res" ]; then
  mkdir -p "$res" || exit 1
  exec > >(tee -a "$res/run.log") 2>&1
fi
nvidia-smi -L || true
rc=0
skips="$(mktemp)"  # a line per item skipped (items run in pipelines, so no counter variable)
trap 'rm -f "$skips"' EXIT
SECONDS=0
# item LIMIT_S CMD...: CMD under `timeout`, at most LIMIT_S seconds and at
# most what the budget has left; not started once it is spent.
item() {
  local limit=$1 status
  shift
  if [ "$budget" -gt 0 ]; then
    local left=$((budget - SECONDS))
    if [ "$left" -lt 15 ]; then
      echo "skipped, the ${budget} s budget is spent: $*" >&2  # not into a result file the item pipes to
      echo "$*" >>"$skips"
      return 0
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  timeout "$limit" "$@"
  status=$?
  [ "$status" -eq 124 ] && echo "cut at ${limit} s: $*" >&2
  return "$status"
}
zinc_bench() {  # zinc_bench LIMIT_S [VAR=VALUE...] ARGS...: a gpu-train-step line
  local limit=$1
  shift
  local envs=()
  while [ $# -gt 0 ] && [[ "$1" == *=* ]]; do envs+=("$1"); shift; done
  echo "== zinc gpu-train-step ${envs[*]} $*"
  item "$limit" env "${envs[@]}" "$here/bin/zinc-bench" gpu-train-step --json "$@" \
    | tee -a ${res:+"$res/gpu-train-step.jsonl"} || rc=1
}
torch_peer() {  # torch_peer LIMIT_S ARGS...: a PyTorch peer line
  local limit=$1
  shift
  echo "== PyTorch peer $*"
  item "$limit" python3 "$here/bench/torch_gpt_peer.py" --json "$@" | tee -a ${res:+"$res/torch-peer.jsonl"} || rc=1
}
if want tests; then
for t in cuda_kernels_test cuda_optim_test cuda_engine_test; do
  echo "== $t"
  item 300 "$here/bin/$t" || rc=1
done
if [ -x "$here/bin/nccl_test" ]; then echo "== nccl_test (1 rank)"; item 120 "$here/bin/nccl_test" || rc=1; fi
echo "== tests done at ${SECONDS} s"
fi
if want bench; then
# The acceptance cases first (issue 53: GPU-resident against PyTorch's
# fused AdamW, ZeRO-Offload against PyTorch's CPU-AdamW loop and against
# zinc's resident step, stage 3 against stage 2), the 355M GPT and then the
# ~1B Llama (TinyLlama 1.1B's shape, fewer rounds: its steps are longer);
# the GPU profile on in zinc's (one more round, outside the figures);
# five rounds of the large GPT (the cuBLAS bound alternates with them).
zinc_bench 200 --large --rounds 5 --resident --profile
torch_peer 200 --large
zinc_bench 200 --large --rounds 5 --profile
torch_peer 200 --large --offload
zinc_bench 200 --large --rounds 5 --stage 3 --profile
zinc_bench 300 --model llama --resident --rounds 3 --steps 2 --profile
torch_peer 300 --model llama --rounds 3 --steps 2
zinc_bench 300 --model llama --rounds 3 --steps 2 --profile
torch_peer 300 --model llama --offload --rounds 3 --steps 2
zinc_bench 300 --model llama --stage 3 --rounds 3 --steps 2
# Then the variants: half the states on the GPU, the update in place, the
# update on more cores, the bias in a separate pass, LoRA, and the small
# reference GPT.
zinc_bench 200 --large --rounds 5 --ratio 0.5
zinc_bench 300 --model llama --ratio 0.5 --rounds 3 --steps 2
zinc_bench 200 ZINC_GPU_UPDATE_BEHIND=0 --large --rounds 5
# The CPU update on every core but the one that drives the GPU (the others
# run on OMP_NUM_THREADS, 8 unless set).
cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
zinc_bench 200 OMP_NUM_THREADS=$((cores > 2 ? cores - 1 : 1)) --large --rounds 5
zinc_bench 200 ZINC_CUDA_MATMUL_BIAS=separate --large --rounds 5 --resident
# LoRA adapters on the ~1B Llama (r 16, every linear layer) beside the
# full model, states on the GPU, in the same rounds: LoRA step / full step.
zinc_bench 300 --model llama --resident --lora --rounds 3 --steps 2
zinc_bench 120
torch_peer 120 --offload
echo "== benchmarks done at ${SECONDS} s"
fi
if want train; then
echo "== zinc-train, ZeRO-Offload on the GPU"
item 180 "$here/bin/zinc-train" "$here/configs/default.json" --set device=cuda \
  --set zero_optimization.stage=2 --set zero_optimization.offload_optimizer.device=cpu --set run.steps=200 || rc=1
echo "== zinc-train, stage 3 on the GPU (parameters in page-locked RAM)"
item 180 "$here/bin/zinc-train" "$here/configs/zero3_offload.json" --set device=cuda --set run.steps=100 || rc=1
echo "== training runs done at ${SECONDS} s"
fi
if want deepspeed; then
# DeepSpeed's ZeRO-Offload on this GPU (bench/deepspeed_gpu_peer.py), the
# peer of the offload cases, installed from the bundle's wheels into a
# private folder (bench/install_wheels.py; nothing of the machine's Python
# changes). Its CPU Adam is built first (a minute or two), so its first run
# takes longer.
echo "== DeepSpeed peer"
ds="$(mktemp -d)"
if [ ! -d "$here/wheels" ]; then
  echo "deepspeed peer: skipped: the bundle carries no DeepSpeed wheels (scripts/gpu_bundle.sh could not fetch them)"
elif ! python3 -c 'import torch, numpy' 2>/dev/null; then
  echo "deepspeed peer: skipped: DeepSpeed needs torch and numpy, and this machine's python3 lacks one of them"
elif ! command -v c++ >/dev/null; then
  echo "deepspeed peer: skipped: no C++ compiler (c++) here, which DeepSpeed needs to build its CPU Adam"
elif ! python3 "$here/bench/install_wheels.py" "$here/wheels" "$ds/site" deepspeed pydantic pydantic-core \
       annotated-types typing-inspection typing-extensions einops hjson msgpack ninja psutil py-cpuinfo packaging \
       tqdm >"$ds/install.log" 2>&1; then
  echo "deepspeed peer: skipped: $(tail -1 "$ds/install.log")"
else
  for args in "--large" "--model llama --rounds 3 --steps 2" "--large --stage 3"; do
    echo "== DeepSpeed peer $args"
    # shellcheck disable=SC2086
    PYTHONPATH="$ds/site${PYTHONPATH:+:$PYTHONPATH}" PATH="$ds/site/bin:$PATH" TORCH_EXTENSIONS_DIR="$ds/ext" \
      item 420 python3 "$here/bench/deepspeed_gpu_peer.py" --json $args 2>&1 | tee "$ds/out" \
      || echo "deepspeed peer ($args): failed (above)"
    [ -n "$res" ] && grep '^{' "$ds/out" >> "$res/deepspeed-peer.jsonl"  # the result lines, without the build's
  done
fi
rm -rf "$ds"
echo "== deepspeed done at ${SECONDS} s"
fi
if want profile; then
# Nsight Systems, where the machine runs it: the host's time in CUDA calls,
# the kernels and the copies of two offloaded steps of the large GPT. The
# bench lines' --profile (CUDA events, Note [the GPU profile]) need no
# such tool.
nsys_bin="$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)"
if [ -n "$nsys_bin" ]; then
  echo "== profile: two offloaded steps of the large GPT under $nsys_bin"
  prof="$(mktemp -d)"
  if item 240 "$nsys_bin" profile -t cuda,osrt -o "$prof/step" --force-overwrite true \
       "$here/bin/zinc-bench" gpu-train-step --large --rounds 1 --steps 2 >/dev/null; then
    item 120 "$nsys_bin" stats -q -r cuda_api_sum,cuda_gpu_kern_sum,cuda_gpu_mem_time_sum "$prof/step.nsys-rep" \
      | tee ${res:+"$res/gpu-step-profile.txt"} || rc=1
  else
    echo "profile: nsys did not finish"
  fi
  rm -rf "$prof"
else
  echo "== profile: skipped, no nsys (Nsight Systems) on this machine"
fi
echo "== profile done at ${SECONDS} s"
fi
# Issue 53's aims against what this call and earlier ones into the same
# folder measured (bench/gpu_summary.py).
if [ -n "$res" ]; then
  echo "== the aims"
  python3 "$here/bench/gpu_summary.py" "$res" || true
fi
[ -s "$skips" ] && echo "run.sh: $(wc -l <"$skips") item(s) skipped for the time budget"
echo "run.sh: done at ${SECONDS} s, status $rc"
exit $rc
