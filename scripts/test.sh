#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs every test: the GoogleTest
# suites through CTest (multi-rank ones under mpirun included, once they
# exist) and the pytest suite when the Python module is present.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
ctest --test-dir build --output-on-failure -j1 --timeout 600
if [ -d python/tests ] && ls python/tests/test_*.py >/dev/null 2>&1; then
  python3 -m pytest -q python/tests
fi
