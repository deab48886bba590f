#!/usr/bin/env bash
# Packs what a GPU machine without this project's Debian packages needs to
# run zinc's GPU tests and benchmarks: the GPU test binaries, zinc-train and
# zinc-bench from BUILD (a CUDA build: scripts/setup.sh where nvcc is found),
# the shared libraries they load that are not part of the C runtime or the
# CUDA toolkit (oneDNN, Open MPI's libraries, liburing, ...), the configs, the
# PyTorch peer, the DeepSpeed peer with DeepSpeed and its dependencies as
# wheels (fetched from the package index here, when it answers: the GPU
# machine reaches none), and run.sh, which runs all of it with the libraries
# found beside it; then OUT.tar.xz of it (about 33 MB, 17 MB of it the
# wheels: the folder is near 100 MB, over the 64 MiB a device machine's
# working tree may carry).
#   bash scripts/gpu_bundle.sh BUILD OUT      # e.g. build gpu-bundle
#   tar -xJf OUT.tar.xz && bash OUT/run.sh [RESULTS_DIR]   # on the GPU machine
# The multi-rank NCCL tests need mpirun and Open MPI's plugins and are left
# out; nccl_test np 1 runs (MPI as a singleton).
set -euo pipefail
build="${1:?usage: scripts/gpu_bundle.sh BUILD OUT}"
out="${2:?usage: scripts/gpu_bundle.sh BUILD OUT}"
cd "$(dirname "$0")/.."
for t in tests/cuda_kernels_test tests/cuda_optim_test tests/cuda_engine_test bench/zinc-bench tools/zinc-train; do
  [ -x "$build/$t" ] || { echo "gpu_bundle: $build/$t is missing: build with CUDA first (scripts/setup.sh)" >&2; exit 1; }
done
rm -rf "$out"
mkdir -p "$out/bin" "$out/lib" "$out/configs" "$out/bench"
bins=(tests/cuda_kernels_test tests/cuda_optim_test tests/cuda_engine_test bench/zinc-bench tools/zinc-train)
[ -x "$build/tests/nccl_test" ] && bins+=(tests/nccl_test)
for t in "${bins[@]}"; do cp "$build/$t" "$out/bin/"; done
# Every library a binary loads, less the C runtime, the compiler's runtime
# and anything of the CUDA toolkit or driver (the GPU machine has its own).
for b in "$out"/bin/*; do
  ldd "$b" | awk '/=> \//{print $3}'
done | sort -u | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libstdc++.so*|libgcc_s.so*|libcuda*|libnvidia*|libnccl*|libcublas*) ;;
    *) cp -L "$lib" "$out/lib/" ;;
  esac
done
cp configs/*.json "$out/configs/"
cp bench/torch_gpt_peer.py bench/gpu_compare.sh bench/deepspeed_gpu_peer.py scripts/install_wheels.py "$out/bench/"
# DeepSpeed (the version the CPU peers pin, bench/peers/setup.sh) as a wheel
# built from its source release without its extensions (its CPU Adam is
# built on the GPU machine, just in time), and its dependencies, the
# compiled ones for CPython 3.10-3.14 (the GPU machine's Python is unknown
# here). torch and numpy are the machine's own. Optional: without the
# index the bundle has no DeepSpeed peer, and run.sh says so.
ds_wheels() {
  local w="$1" v
  mkdir -p "$w"
  DS_BUILD_OPS=0 python3 -m pip wheel --quiet --no-deps -w "$w" deepspeed==0.19.8 || return 1
  for v in 3.10 3.11 3.12 3.13 3.14; do
    python3 -m pip download --quiet --only-binary=:all: --python-version "$v" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$w" \
      einops hjson msgpack ninja psutil py-cpuinfo 'pydantic>=2' packaging tqdm || return 1
  done
}
if ! ds_wheels "$out/wheels" >"$out/wheels.log" 2>&1; then
  echo "gpu_bundle: no DeepSpeed peer in the bundle: fetching its wheels failed ($(tail -1 "$out/wheels.log"))" >&2
  rm -rf "$out/wheels"
fi
rm -f "$out/wheels.log"
cat > "$out/run.sh" <<'RUN'
#!/usr/bin/env bash
# zinc's GPU checks on a machine with a GPU: the GPU tests, ZeRO-Offload
# training runs, the benchmarks with the PyTorch peer, a profile, and the
# DeepSpeed peer. Results go to stdout and, with a first argument, into
# that folder. A second argument picks one part (tests, train, bench,
# profile or deepspeed; default all, in that order), so that the parts can
# go in separate calls where a call's time is limited.
#   bash run.sh [RESULTS_DIR] [tests|train|bench|profile|deepspeed|all]
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
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
case "$part" in tests|train|bench|profile|deepspeed|all) ;; *) echo "run.sh: unknown part '$part' (tests, train, bench, profile, deepspeed or all)" >&2; exit 2 ;; esac
want() { [ "$part" = all ] || [ "$part" = "$1" ]; }
[ -n "$res" ] && mkdir -p "$res"
nvidia-smi -L || true
rc=0
SECONDS=0
if want tests; then
for t in cuda_kernels_test cuda_optim_test cuda_engine_test; do
  echo "== $t"
  "$here/bin/$t" ${res:+--gtest_output=xml:$res/$t.xml} || rc=1
done
if [ -x "$here/bin/nccl_test" ]; then echo "== nccl_test (1 rank)"; "$here/bin/nccl_test" || rc=1; fi
echo "== tests done at ${SECONDS} s"
fi
if want train; then
echo "== zinc-train, ZeRO-Offload on the GPU"
"$here/bin/zinc-train" "$here/configs/default.json" --set device=cuda \
  --set zero_optimization.stage=2 --set zero_optimization.offload_optimizer.device=cpu --set run.steps=200 || rc=1
echo "== zinc-train, stage 3 on the GPU (parameters in page-locked RAM)"
"$here/bin/zinc-train" "$here/configs/zero3_offload.json" --set device=cuda --set run.steps=100 || rc=1
echo "== training runs done at ${SECONDS} s"
fi
if want bench; then
echo "== benchmarks"
ZINC_BENCH="$here/bin/zinc-bench"
"$ZINC_BENCH" gpu-train-step --json | tee ${res:+$res/gpu-train-step.jsonl}
"$ZINC_BENCH" gpu-train-step --json --large | tee -a ${res:+$res/gpu-train-step.jsonl}
ZINC_GPU_UPDATE_BEHIND=0 "$ZINC_BENCH" gpu-train-step --json --large | tee -a ${res:+$res/gpu-train-step.jsonl}
"$ZINC_BENCH" gpu-train-step --json --large --ratio 0.5 | tee -a ${res:+$res/gpu-train-step.jsonl}
"$ZINC_BENCH" gpu-train-step --json --large --resident | tee -a ${res:+$res/gpu-train-step.jsonl}
ZINC_CUDA_MATMUL_BIAS=separate "$ZINC_BENCH" gpu-train-step --json --large --resident | tee -a ${res:+$res/gpu-train-step.jsonl}
"$ZINC_BENCH" gpu-train-step --json --large --stage 3 | tee -a ${res:+$res/gpu-train-step.jsonl}
# The ~1B Llama (TinyLlama 1.1B's shape), fewer rounds: its steps are longer.
"$ZINC_BENCH" gpu-train-step --json --model llama --rounds 3 --steps 2 | tee -a ${res:+$res/gpu-train-step.jsonl}
"$ZINC_BENCH" gpu-train-step --json --model llama --ratio 0.5 --rounds 3 --steps 2 | tee -a ${res:+$res/gpu-train-step.jsonl}
"$ZINC_BENCH" gpu-train-step --json --model llama --resident --rounds 3 --steps 2 | tee -a ${res:+$res/gpu-train-step.jsonl}
"$ZINC_BENCH" gpu-train-step --json --model llama --stage 3 --rounds 3 --steps 2 | tee -a ${res:+$res/gpu-train-step.jsonl}
python3 "$here/bench/torch_gpt_peer.py" --json --offload | tee ${res:+$res/torch-peer.jsonl}
python3 "$here/bench/torch_gpt_peer.py" --json --large --offload | tee -a ${res:+$res/torch-peer.jsonl}
python3 "$here/bench/torch_gpt_peer.py" --json --large | tee -a ${res:+$res/torch-peer.jsonl}
python3 "$here/bench/torch_gpt_peer.py" --json --model llama --offload --rounds 3 --steps 2 | tee -a ${res:+$res/torch-peer.jsonl}
python3 "$here/bench/torch_gpt_peer.py" --json --model llama --rounds 3 --steps 2 | tee -a ${res:+$res/torch-peer.jsonl}
echo "== benchmarks done at ${SECONDS} s"
fi
if want profile; then
# Where the host launches and waits in a step: the offloaded step of the
# large GPT under Nsight Systems, where the machine has it (the CUDA
# toolkit's nsys); the summaries of CUDA API calls (the host's time in
# launches and synchronisations), kernels and copies go to RESULTS_DIR.
nsys_bin="$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)"
if [ -n "$nsys_bin" ]; then
  echo "== profile: two offloaded steps of the large GPT under $nsys_bin"
  prof="$(mktemp -d)"
  if timeout 240 "$nsys_bin" profile -t cuda,osrt -o "$prof/step" --force-overwrite true \
       "$here/bin/zinc-bench" gpu-train-step --large --rounds 1 --steps 2 >/dev/null; then
    timeout 120 "$nsys_bin" stats -q -r cuda_api_sum,cuda_gpu_kern_sum,cuda_gpu_mem_time_sum "$prof/step.nsys-rep" \
      | tee ${res:+$res/gpu-step-profile.txt} || rc=1
  else
    echo "profile: nsys did not finish" && rc=1
  fi
  rm -rf "$prof"
else
  echo "== profile: skipped, no nsys (Nsight Systems) on this machine"
fi
echo "== profile done at ${SECONDS} s"
fi
if want deepspeed; then
# DeepSpeed's ZeRO-Offload on this GPU (bench/deepspeed_gpu_peer.py), the
# peer of the offload cases, installed from the bundle's wheels into a
# private folder (bench/install_wheels.py; nothing of the machine's Python
# changes). Last, since a machine without a compiler or numpy cannot run
# it, and its CPU Adam is built first (a minute or two).
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
  for args in "--large" "--large --stage 3" "--model llama --rounds 3 --steps 2"; do
    # shellcheck disable=SC2086
    PYTHONPATH="$ds/site${PYTHONPATH:+:$PYTHONPATH}" PATH="$ds/site/bin:$PATH" TORCH_EXTENSIONS_DIR="$ds/ext" \
      timeout 420 python3 "$here/bench/deepspeed_gpu_peer.py" --json $args 2>&1 | tee "$ds/out" \
      || echo "deepspeed peer ($args): failed (above)"
    [ -n "$res" ] && grep '^{' "$ds/out" >> "$res/deepspeed-peer.jsonl"  # the result lines, without the build's
  done
fi
rm -rf "$ds"
echo "== deepspeed done at ${SECONDS} s"
fi
exit $rc
RUN
chmod +x "$out/run.sh"
strip --strip-unneeded "$out"/bin/* 2>/dev/null || true
tar -cJf "$out.tar.xz" -C "$(dirname "$out")" "$(basename "$out")"
echo "gpu_bundle: $(du -sh "$out" | cut -f1) in $out, $(du -sh "$out.tar.xz" | cut -f1) in $out.tar.xz"
