#!/usr/bin/env bash
# Fetch a real target/draft GGUF pair into the cache (default build/models/, or --dest DIR / $SSD_TRT_MODELS),
# checked by size and sha256: `bash scripts/fetch_pair.sh [PAIR] [--dest DIR] [--check]` (PAIR: qwen2.5-coder).
# No cd: a relative --dest stays relative to where it is run; the repo goes on PYTHONPATH instead.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec ${PYTHON:-python3} -m ssd_trt.models.fetch "$@"
