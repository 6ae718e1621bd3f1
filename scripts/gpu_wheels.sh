#!/usr/bin/env bash
# Wheels for a GPU host that reaches no package registry (this project's lent GPU machines: Python 3.12, x86-64, an
# image with CUDA torch, triton, transformers, onnx and onnxruntime but no pydantic, gguf or polygraphy): downloaded
# here, where pip works, into .whl/ (git-ignored; a few tens of MB), which scripts/gpu_install.sh installs from when
# it finds no registry. Dependencies come along; those the host already has are left alone by pip there.
#   bash scripts/gpu_wheels.sh            # WHEEL_PYTHON=3.11 for another interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
"$PY" -m pip download --disable-pip-version-check --quiet --only-binary=:all: \
  --python-version "${WHEEL_PYTHON:-3.12}" --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d .whl "pydantic>=2.5" "gguf>=0.10" "polygraphy>=0.49"
ls .whl
du -sh .whl
