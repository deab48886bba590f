#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs every test: the GoogleTest
# suites through CTest (multi-rank ones under mpirun included) with the best
# code paths this CPU has, then, on a CPU with AVX-512, again capped at AVX2
# through ONEDNN_MAX_CPU_ISA (zinc's kernels and oneDNN together), so that a
# machine with AVX-512 also proves the paths of a CPU without it. On a CPU with
# AVX512-BF16 the suites whose paths depend on the ISA (CTest label "isa":
# kernels, optimizer, models, engine, the shared-memory sums) run a third
# time capped at AVX512_CORE: AVX-512 without bf16 arithmetic, the commonest
# cloud CPU (issue 28). The Python module's pytest suite (python/tests) is one
# of the CTest tests (python_test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
unset ONEDNN_MAX_CPU_ISA DNNL_MAX_CPU_ISA
echo "== tests, native paths: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) =="
ctest --test-dir build --output-on-failure -j1 --timeout 600
# Capped at AVX2 only where that changes something: on a CPU without AVX-512
# the native pass already ran the AVX2 paths (and the cap would run the same
# code again, half of CI's time).
if grep -qw avx512f /proc/cpuinfo; then
  echo "== tests again, capped at AVX2 (ONEDNN_MAX_CPU_ISA=AVX2) =="
  ONEDNN_MAX_CPU_ISA=AVX2 ctest --test-dir build --output-on-failure -j1 --timeout 600
else
  echo "== no AVX-512 on this CPU: the native pass ran the AVX2 paths; no capped pass =="
fi
if grep -qw avx512_bf16 /proc/cpuinfo; then
  echo "== the ISA-dependent suites again, capped at AVX512_CORE (AVX-512 without bf16 arithmetic) =="
  ONEDNN_MAX_CPU_ISA=AVX512_CORE ctest --test-dir build --output-on-failure -j1 --timeout 600 -L isa
fi
