#!/usr/bin/env bash
# The optional llama.cpp baselines of the benchmark, both from llama-cpp-python 0.3.36's sdist (no prebuilt
# downloads):
#   1. llama.cpp's own binaries, compiled from the sdist's vendored source (vendor/llama.cpp) into
#      .llama_cpp/bin: llama-bench (the yardstick users run), llama-lookup (its n-gram speculative decoding),
#      llama-speculative and llama-speculative-simple (its draft-model speculative decoding, target + draft GGUF);
#   2. the Python binding, compiled from the same sdist (its Python generate loop: a slower row, labelled so).
# ~9 min on 2 cores. AMX is switched off: on the machines this project runs on, llama.cpp's AMX int8 matmul
# segfaults on the embedded model (ggml_backend_amx_mul_mat); AVX-512 (VNNI, BF16) stays on where the CPU has it.
# SKIP_BINDING=1 builds the binaries only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VERSION=0.3.36
CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON)
if grep -q avx512f /proc/cpuinfo 2>/dev/null; then
  CPU_FLAGS+=(-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
fi
COMMON_ARGS="${CPU_FLAGS[*]} -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
JOBS=${CMAKE_BUILD_PARALLEL_LEVEL:-2}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
$PY -m pip download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
  "llama-cpp-python==$VERSION" -d "$work"
tar xzf "$work/llama_cpp_python-$VERSION.tar.gz" -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"

# 1. the binaries
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release $COMMON_ARGS -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=ON > "$work/configure.log"
BINARIES=(llama-bench llama-lookup llama-speculative llama-speculative-simple)
cmake --build "$work/build" --target "${BINARIES[@]}" -j "$JOBS" > "$work/build.log" 2>&1 \
  || { tail -n 40 "$work/build.log" >&2; exit 1; }
mkdir -p .llama_cpp/bin
for exe in "${BINARIES[@]}"; do cp "$work/build/bin/$exe" .llama_cpp/bin/; done
echo "llama.cpp $VERSION (vendored in llama-cpp-python's sdist): $(ls .llama_cpp/bin | tr '\n' ' ')in .llama_cpp/bin"

# 2. the Python binding
if [ "${SKIP_BINDING:-0}" != 1 ]; then
  export CMAKE_ARGS="$COMMON_ARGS -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
  export CMAKE_BUILD_PARALLEL_LEVEL=$JOBS
  $PY -m pip install --quiet --disable-pip-version-check --no-binary llama-cpp-python \
    "$work/llama_cpp_python-$VERSION.tar.gz"
fi
