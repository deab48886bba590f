#!/usr/bin/env bash
# zinc's ZeRO-Offload step on the GPU and its PyTorch peer, in one job:
# zinc-bench gpu-train-step, then PyTorch on the same GPT with the optimizer
# on the CPU (the same split) and on the GPU (PyTorch's usual setup), then
# zinc again, so that a drift of the machine between the runs shows.
#   bash bench/gpu_compare.sh BUILD_DIR [--large] [--gas N]
# One JSON line per run. Has never run: no machine of this project had a GPU.
set -euo pipefail
build="${1:?usage: bench/gpu_compare.sh BUILD_DIR [--large] [--gas N]}"
shift
here="$(cd "$(dirname "$0")" && pwd)"
if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_compare: skipped: PyTorch sees no GPU here"
  exit 0
fi
"$build/bench/zinc-bench" gpu-train-step --json "$@"
python3 "$here/torch_gpt_peer.py" --json --offload "$@"
python3 "$here/torch_gpt_peer.py" --json "$@"
"$build/bench/zinc-bench" gpu-train-step --json "$@"
