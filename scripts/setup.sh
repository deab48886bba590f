#!/usr/bin/env bash
# Installs what a fresh Debian machine lacks to build and test zinc, then
# configures and builds it in ./build. Safe to rerun: installs only missing
# packages and rebuilds incrementally.
#   bash scripts/setup.sh              build everything (tests, benchmarks)
#   bash scripts/setup.sh zinc-train   build only the named targets
#
# ocl-icd-opencl-dev: Debian's libdnnl-dev is built with oneDNN's OpenCL GPU
# runtime, and its CMake package (dnnl-config.cmake) runs
# find_package(OpenCL REQUIRED); the OpenCL headers and loader are only a
# Recommends of libdnnl-dev, which --no-install-recommends skips.
#
# A first build that names its targets (scripts/train.sh: zinc-train) is the
# first thing a new user waits for, so it does less: it skips the packages
# that only the tests use, and on a machine where no NVIDIA GPU is visible it
# leaves out the CUDA kernels (nvcc's share of the build). The next full build
# puts them back (one rebuild of the libraries); ZINC_CUDA=ON|OFF|AUTO in the
# environment chooses instead.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  cmake ninja-build g++ make pkg-config
  nlohmann-json3-dev libdnnl-dev ocl-icd-opencl-dev liburing-dev libopenmpi-dev openmpi-bin
  libgtest-dev libgmock-dev libcli11-dev libxxhash-dev
  libprotobuf-dev protobuf-compiler libisal-dev  # the tensorboard monitor: event records and their CRC-32C
)
# What only the tests run (a build that names its targets skips them).
if [ $# -eq 0 ]; then
  packages+=(
    fio
    e2fsprogs util-linux  # disk_full_test: mkfs.ext4 and mountpoint for a small loop filesystem
    fortunes wordnet-base  # the fine-tuning walk-through's corpora (scripts/finetune_demo.sh and its test)
  )
fi
# The Python module (ZINC_PYTHON, full builds) compiles against the headers
# of the python3 on PATH; a Debian system python3 has them in python3-dev.
if [ $# -eq 0 ] && ! python3 -c 'import os, sysconfig; raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' 2>/dev/null; then
  packages+=(python3-dev)
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# Python packages of the tests: pytest, the real safetensors package (with
# numpy) that reads zinc-export's files, and tensorboard, whose own reader
# reads the tensorboard monitor's event files; matplotlib, which draws
# scripts/plot_run.py's curves; tokenizers, jinja2 and orjson (its fast JSON
# path) for zinc.prepare; pybind11 for the module `zinc`
# (python/). Only when a full build is asked for (train.sh builds zinc-train
# alone and needs none of them).
cmake_args=()
if [ $# -eq 0 ]; then
  pymissing=()
  for m in pytest numpy safetensors pybind11 tensorboard tokenizers jinja2 orjson matplotlib; do
    python3 -c "import $m" 2>/dev/null || pymissing+=("$m")
  done
  if [ ${#pymissing[@]} -gt 0 ]; then
    echo "setup: installing Python packages ${pymissing[*]}"
    python3 -m pip install --quiet --disable-pip-version-check "${pymissing[@]}" 2>/dev/null ||
      python3 -m pip install --quiet --disable-pip-version-check --break-system-packages "${pymissing[@]}"
  fi
  # The module for the python3 on PATH (a pyenv shim resolves to the real one).
  cmake_args+=(-DZINC_PYTHON=ON "-DPython_EXECUTABLE=$(python3 -c 'import sys; print(sys.executable)')")
fi

# Ninja for a new build folder: it starts each library's compiles as soon as
# their headers exist, where make waits for the libraries they link (about 40
# s less for zinc-train on 2 cores). A folder configured before keeps its
# generator.
if [ ! -f build/CMakeCache.txt ] && command -v ninja >/dev/null; then
  cmake_args+=(-G Ninja)
fi
# CUDA: see the top. A GPU is visible when the NVIDIA driver is loaded.
gpu_visible() { [ -e /proc/driver/nvidia/version ] || ls /dev/nvidia[0-9]* >/dev/null 2>&1; }
if [ -n "${ZINC_CUDA:-}" ]; then
  cmake_args+=("-DZINC_CUDA=$ZINC_CUDA" -DZINC_CUDA_DEFERRED:INTERNAL=OFF)
elif [ $# -gt 0 ]; then
  if [ ! -f build/CMakeCache.txt ] && ! gpu_visible; then
    echo "setup: no NVIDIA GPU visible: building without the CUDA kernels for now (the full build, scripts/setup.sh or scripts/test.sh, adds them)"
    cmake_args+=(-DZINC_CUDA=OFF -DZINC_CUDA_DEFERRED:INTERNAL=ON)
  fi
elif grep -q '^ZINC_CUDA_DEFERRED:INTERNAL=ON' build/CMakeCache.txt 2>/dev/null; then
  echo "setup: adding the CUDA kernels that the first, partial build left out (the libraries rebuild once)"
  cmake_args+=(-DZINC_CUDA=AUTO -DZINC_CUDA_DEFERRED:INTERNAL=OFF)
fi

BUILD_TYPE="${ZINC_BUILD_TYPE:-Release}"
cmake -S . -B build -DCMAKE_BUILD_TYPE="$BUILD_TYPE" ${cmake_args[@]+"${cmake_args[@]}"} >/dev/null
targets=()
for t in "$@"; do targets+=(--target "$t"); done
cmake --build build -j"${ZINC_JOBS:-2}" "${targets[@]}"
