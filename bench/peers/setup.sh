#!/usr/bin/env bash
# The heavy peers' virtual environment: PyTorch, Hugging Face transformers,
# DeepSpeed and Intel MKL, for the scripts that produce reference data from
# the real libraries (tests/fixtures/hf/make_fixtures.py,
# tests/deepspeed_parity/make_expected.py) and the peer benchmarks
# (bench/peers/*_peer.py, bench/torch_gpt_peer.py; MKL for gemm_peer.py). The test command never uses it: the
# committed fixtures are read with numpy and safetensors only, so CI passes
# without torch and without network. Pinned to the versions that produced the
# committed fixtures (tests/fixtures/hf/README.md).
#   bash bench/peers/setup.sh            # venv at bench/peers/.venv, or $ZINC_PEERS_VENV
#   bench/peers/.venv/bin/python tests/fixtures/hf/make_fixtures.py
#   DS_ACCELERATOR=cpu bench/peers/.venv/bin/python tests/deepspeed_parity/make_expected.py
# DeepSpeed installs with DS_BUILD_OPS=0 (no extension built at install time;
# make_expected.py builds its CPU Adam just in time, with ninja, where it can).
# Idempotent: does nothing where the venv already holds these versions. From
# the Python package index, torch brings its CUDA libraries (several GB); a
# CPU-only build of the same version satisfies the pin too, where an index
# that serves one is reachable (not here).
set -euo pipefail
cd "$(dirname "$0")/../.."
venv="${ZINC_PEERS_VENV:-bench/peers/.venv}"
python="${PYTHON:-python3}"
pins=(torch==2.15.0 transformers==5.24.0 peft==0.21.2 safetensors==0.8.0 numpy==2.4.6 deepspeed==0.19.8 mkl==2026.2.0)

installed() {
  [ -x "$venv/bin/python" ] || return 1
  "$venv/bin/python" - "${pins[@]}" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        sys.exit(1)
    if have.split("+")[0] != want:  # torch 2.15.0+cpu is 2.15.0
        sys.exit(1)
PY
}

# DeepSpeed's NVMe offload JIT-builds its async_io op against libaio; without
# the headers it refuses nvme ("Unable to JIT load the async_io op"). zinc
# itself uses io_uring (liburing), not libaio.
if ! [ -e /usr/include/libaio.h ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get install -y -q libaio-dev >/dev/null
  else
    echo "peers venv: DeepSpeed's nvme offload needs libaio-dev (apt-get install libaio-dev, as root)" >&2
  fi
fi

if installed; then
  echo "peers venv $venv: up to date (${pins[*]})"
  exit 0
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
DS_BUILD_OPS=0 "$venv/bin/python" -m pip install --disable-pip-version-check --quiet "${pins[@]}"
installed || { echo "peers venv $venv: the pinned versions did not install" >&2; exit 1; }
echo "peers venv $venv: installed ${pins[*]}"
