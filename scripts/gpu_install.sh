#!/usr/bin/env bash
# What scripts/gpu_session.sh needs, installed into the current Python ($PYTHON, else python3; a virtualenv if one
# is active): torch (a CUDA build kept as it is, or installed on a host with an NVIDIA GPU; the CPU wheel elsewhere),
# then this package, editable, with its `gpu` extra (triton, pytest). plugins/ installs as the package
# ssd_trt_plugins, so nothing works from PYTHONPATH alone.
# A host that reaches no package registry (the lent GPU machines) installs from wheels in .whl/ when there are some
# (scripts/gpu_wheels.sh downloads them where pip works), else this package alone (--no-deps). It ends by importing
# every module the session uses and naming the ones missing (exit 1).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --disable-pip-version-check --quiet --retries 1 --timeout 20)
TORCH_RANGE="torch>=2.5,<=2.14.1"      # pyproject's range; PyPI's Linux wheels of it are CUDA builds
TORCH_CPU="torch==2.13.0"              # the CPU wheel CI uses (docs/testing.md)
WHEELS=()
[ -d .whl ] && WHEELS=(--find-links .whl)

gpu_host() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  if gpu_host; then
    echo "gpu_install: no torch; installing a CUDA build ($TORCH_RANGE, several GB)"
    "${PIP[@]}" "${WHEELS[@]}" "$TORCH_RANGE" || echo "gpu_install: could not install torch"
  else
    echo "gpu_install: no torch and no NVIDIA GPU; installing the CPU wheel ($TORCH_CPU)"
    "${PIP[@]}" "${WHEELS[@]}" "$TORCH_CPU" || echo "gpu_install: could not install torch"
  fi
elif gpu_host && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  echo "gpu_install: torch here is a CPU build on a host with an NVIDIA GPU; installing a CUDA build ($TORCH_RANGE)"
  "${PIP[@]}" "${WHEELS[@]}" --upgrade --force-reinstall --no-deps "$TORCH_RANGE" \
    || echo "gpu_install: could not replace the CPU build of torch (the GPU parts will say they found no CUDA)"
fi

if "${PIP[@]}" "${WHEELS[@]}" -e ".[gpu]"; then
  echo "gpu_install: installed ssd-trt[gpu] (editable)"
elif [ -d .whl ] && "${PIP[@]}" --no-index --find-links .whl --no-build-isolation -e ".[gpu]"; then
  echo "gpu_install: no registry; installed ssd-trt[gpu] from the wheels in .whl/"
elif "${PIP[@]}" --no-index --no-build-isolation --no-deps -e .; then
  echo "gpu_install: no registry; installed ssd-trt alone (--no-deps): its dependencies are what this Python has"
else
  echo "gpu_install: could not install ssd-trt (see pip's message above)"
fi

"$PY" - <<'EOF'
import importlib
import sys

missing = []
for name in ("torch", "triton", "numpy", "yaml", "pydantic", "gguf", "transformers", "tokenizers", "safetensors",
             "onnx", "pytest", "ssd_trt_plugins.tree_attention.triton_kernel", "ssd_trt.engines.torch_device", "ssd_trt"):
    try:
        importlib.import_module(name)
    except Exception as exc:      # noqa: BLE001 - every failure is reported, whatever it is
        missing.append(f"{name} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})")
try:
    import torch
    print(f"gpu_install: python {sys.version.split()[0]}, torch {torch.__version__} (CUDA build {torch.version.cuda}, "
          f"CUDA device {'yes' if torch.cuda.is_available() else 'none'})")
except Exception:                 # noqa: BLE001 - listed above
    pass
if missing:
    print("gpu_install: cannot import: " + "; ".join(missing))
    print("gpu_install: on a host with no registry, fetch wheels where pip works (bash scripts/gpu_wheels.sh) and "
          "bring .whl/ along")
    sys.exit(1)
print("gpu_install: every module the session uses imports")
EOF
