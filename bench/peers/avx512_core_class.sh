#!/usr/bin/env bash
# The AVX-512-without-BF16 class (Skylake-SP to Ice Lake) on a bigger x86
# CPU: oneDNN and zinc's kernels capped at AVX512_CORE, MKL at AVX512, 2
# threads. Times the GEMM bound (oneDNN against PyTorch's GEMM, which is
# MKL's SGEMM for fp32: MKL_VERBOSE shows it), train-step's bf16 against
# fp32, and the default experiment. Run where python3 (or $PYTHON) has
# torch, e.g. PYTHON=bench/peers/.venv/bin/python; BIN is a
# folder with zinc-bench and zinc-train (a build's, or the GPU bundle's bin
# with its lib beside it), results also go to OUT.
#   bash bench/peers/avx512_core_class.sh BIN [OUT]
# bench/RESULTS.md, "the Intel AVX-512 class without BF16, on a capped
# Intel Xeon", ran it from the GPU bundle on the GPU machine's CPU.
set -o pipefail
bin="$(cd "${1:?usage: avx512_core_class.sh BIN [OUT]}" && pwd)"
out="${2:-$(mktemp -d)}"
mkdir -p "$out"
cd "$(dirname "$0")/../.."
py="${PYTHON:-python3}"
find_tool() { for f in "$bin/$1" "$bin/bench/$1" "$bin/tools/$1"; do [ -x "$f" ] && { echo "$f"; return; }; done
              echo "avx512_core_class.sh: no $1 in $bin" >&2; exit 1; }
zb="$(find_tool zinc-bench)"; zt="$(find_tool zinc-train)"
lib="$(dirname "$bin")/lib"
wrap="$out/zinc-bench.sh"  # zinc-bench with the bundle's libraries, torch without them
printf '#!/bin/sh\nLD_LIBRARY_PATH=%s${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} exec %s "$@"\n' "$lib" "$zb" > "$wrap"
chmod +x "$wrap"
export OMP_NUM_THREADS=2 ONEDNN_MAX_CPU_ISA=AVX512_CORE MKL_ENABLE_INSTRUCTIONS=AVX512
{ lscpu | grep -E "Model name|MHz|L1d|L2|L3|^CPU\(s\)"
  grep -m1 flags /proc/cpuinfo | tr ' ' '\n' | grep -E "^(avx2|fma|avx512f|avx512_bf16|amx_bf16)$" | tr '\n' ' '; echo
  MKL_VERBOSE=1 "$py" -c "import torch;torch.set_num_threads(2);print('torch', torch.__version__);torch.mm(torch.rand(512,512),torch.rand(512,512))" 2>&1 | head -3
} 2>&1 | tee "$out/cpu.txt"
echo "== gemm gpt fp32"
"$py" bench/peers/gemm_peer.py --zinc-bench "$wrap" --mkl "" --rounds 3 2>&1 | grep -v "^zinc\[" | tee "$out/gemm_gpt.txt"
echo "== train-step bf16 against fp32"
"$wrap" train-step --json 2>&1 | tail -1 | tee "$out/train_step.json"
echo "== zinc-train configs/default.json"
LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$zt" configs/default.json 2>&1 | grep -v "^step " | tee "$out/train.txt"
echo "== gemm llama fp32"
"$py" bench/peers/gemm_peer.py --zinc-bench "$wrap" --mkl "" --rounds 2 --model llama 2>&1 | grep -v "^zinc\[" | tee "$out/gemm_llama.txt"
echo "results in $out"
