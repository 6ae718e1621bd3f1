#!/usr/bin/env bash
# Installs what the tests need (TensorRT for RTX included), then runs the whole suite (CPU; tests that
# need a GPU skip with the reason).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
# TensorRT for RTX (95 MB): the tests build real plans of the embedded default with it, on this CPU
$PY -m pip install --quiet --disable-pip-version-check -e ".[rtx]"
echo "set-up took ${SECONDS} s" >&2    # (CI's budget is 30 minutes, set-up and tests together)
exec $PY -m pytest -q --durations=15 "$@"
