#!/usr/bin/env bash
# The optional llama.cpp baselines of the benchmark: llama-cpp-python 0.3.36 compiled from its sdist
# (~3 min on 2 cores). AMX is switched off: on the machines this project runs on, llama.cpp's AMX int8
# matmul segfaults on the embedded model (ggml_backend_amx_mul_mat); AVX-512 (VNNI, BF16) stays on.
set -euo pipefail
PY=${PYTHON:-python3}
CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
if grep -q avx512f /proc/cpuinfo 2>/dev/null; then
  CPU_FLAGS+=(-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
fi
export CMAKE_ARGS="${CPU_FLAGS[*]} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
$PY -m pip install --quiet --disable-pip-version-check --no-binary llama-cpp-python "llama-cpp-python==0.3.36"
