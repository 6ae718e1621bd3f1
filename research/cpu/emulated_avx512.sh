#!/usr/bin/env bash
# The kernel tests on the avx512vnni path without an AVX-512 CPU: avx512.c compiled against SIMDe's portable
# AVX-512 intrinsics (https://github.com/simd-everywhere/simde, MIT; headers only, not part of this project), the
# library's CPU check forced to report AVX-512, and tests/test_kernels.py run against that library, so every path
# is held to the scalar specification on any machine. A development check (slow to emulate, not in CI).
#   bash research/cpu/emulated_avx512.sh /path/to/simde-checkout
set -euo pipefail
SIMDE=${1:?the folder holding simde/x86/avx512.h}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
S=$ROOT/ssd_trt/kernels/csrc
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
sed 's@#include <immintrin.h>@#define SIMDE_ENABLE_NATIVE_ALIASES\n#include <simde/x86/avx512.h>\n#include <simde/x86/f16c.h>@' \
    "$S/avx512.c" > "$WORK/avx512_emulated.c"
sed 's@^int ssd_cpu_features(void) {@int ssd_cpu_features(void) { return 3; }\nint ssd_cpu_features_of_this_cpu(void) {@' \
    "$S/dispatch.c" > "$WORK/dispatch_emulated.c"
C="gcc -O2 -std=gnu11 -fPIC -fno-strict-aliasing -w -I$SIMDE -I$S"
$C -ffp-contract=off -c "$S/scalar.c" -o "$WORK/scalar.o"
$C -mavx2 -mfma -mf16c -c "$S/avx2.c" -o "$WORK/avx2.o"
$C -mavx2 -mfma -mf16c -c "$WORK/avx512_emulated.c" -o "$WORK/avx512.o"
$C -c "$WORK/dispatch_emulated.c" -o "$WORK/dispatch.o"
$C -c "$S/pool.c" -o "$WORK/pool.o"
$C -mavx2 -mfma -mf16c -c "$S/step.c" -o "$WORK/step.o"
HASH=$(cd "$ROOT" && python -c "from ssd_trt.kernels.build import source_hash; print(source_hash())")
mkdir -p "$WORK/cache/$HASH"
gcc -shared -o "$WORK/cache/$HASH/libssd_kernels.so" "$WORK"/*.o -lpthread -lm
cd "$ROOT" && SSD_TRT_KERNEL_CACHE="$WORK/cache" python -m pytest -q tests/test_kernels.py
