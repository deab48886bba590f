#!/usr/bin/env bash
# Sets everything up (scripts/setup.sh) and runs an experiment with
# zinc-train; default: configs/default.json. Extra arguments go to zinc-train.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh zinc-train
config="${1:-configs/default.json}"
shift || true
exec ./build/tools/zinc-train "$config" "$@"
