#!/usr/bin/env bash
# Installs what the tests need, then runs the whole suite (CPU; GPU/TensorRT tests skip with a reason).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
exec $PY -m pytest -q "$@"
