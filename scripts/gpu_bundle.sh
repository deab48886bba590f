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
#   tar -xJf OUT.tar.xz && bash OUT/run.sh [RESULTS_DIR] [PART]   # on the GPU machine
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
cp bench/torch_gpt_peer.py bench/gpu_compare.sh bench/deepspeed_gpu_peer.py bench/gpu_summary.py scripts/install_wheels.py \
  "$out/bench/"
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
# run.sh: scripts/gpu_run.sh, which runs all of it there.
cp scripts/gpu_run.sh "$out/run.sh"
chmod +x "$out/run.sh"
strip --strip-unneeded "$out"/bin/* 2>/dev/null || true
tar -cJf "$out.tar.xz" -C "$(dirname "$out")" "$(basename "$out")"
echo "gpu_bundle: $(du -sh "$out" | cut -f1) in $out, $(du -sh "$out.tar.xz" | cut -f1) in $out.tar.xz"
