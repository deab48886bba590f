#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs every test: the GoogleTest
# suites through CTest (multi-rank ones under mpirun included) with the best
# code paths this CPU has. Then the suites whose paths depend on the ISA
# (CTest label "isa": kernels, optimizer, models, engine, the Hugging Face
# models, the 1-bit packing, the shared-memory sums) run again capped through
# ONEDNN_MAX_CPU_ISA (zinc's kernels and oneDNN together) at each lower class
# this CPU has: AVX2 on a CPU with AVX-512, so that a machine with AVX-512
# also proves the paths of one without it, and AVX512_CORE on a CPU with
# AVX512-BF16 (AVX-512 without bf16 arithmetic, the commonest cloud CPU,
# issue 28). The other tests (command lines, crash tests, the emulated GPU,
# multi-rank agreement) check what no ISA changes, and run once: rerunning
# them capped doubled the test command's time (issue 50). The Python
# module's pytest suite (python/tests) is one of the CTest tests (python_test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
unset ONEDNN_MAX_CPU_ISA DNNL_MAX_CPU_ISA
echo "== tests, native paths: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) =="
# Two at a time where each keeps one core busy (the emulated GPU's tests,
# CTest's PROCESSORS 1); every other test says PROCESSORS 2 and runs alone.
ctest --test-dir build --output-on-failure -j2 --timeout 600
# Capped at AVX2 only where that changes something: on a CPU without AVX-512
# the native pass already ran the AVX2 paths.
if grep -qw avx512f /proc/cpuinfo; then
  echo "== the ISA-dependent suites again, capped at AVX2 (ONEDNN_MAX_CPU_ISA=AVX2) =="
  ONEDNN_MAX_CPU_ISA=AVX2 ctest --test-dir build --output-on-failure -j1 --timeout 600 -L isa
else
  echo "== no AVX-512 on this CPU: the native pass ran the AVX2 paths; no capped pass =="
fi
if grep -qw avx512_bf16 /proc/cpuinfo; then
  echo "== the ISA-dependent suites again, capped at AVX512_CORE (AVX-512 without bf16 arithmetic) =="
  ONEDNN_MAX_CPU_ISA=AVX512_CORE ctest --test-dir build --output-on-failure -j1 --timeout 600 -L isa
fi
