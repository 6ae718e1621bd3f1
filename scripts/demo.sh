#!/usr/bin/env bash
# The main job on the embedded default, end to end: install, build, generate with ar / sd / ssd.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
$PY -m ssd_trt.build recipes/smollm2-135m.yaml --if-stale --tune   # rebuilds when the recipe or a model changed;
# --tune: K and fan-out chosen by measurement on this machine (once per build, ~2 min)
PROMPT=${PROMPT:-"Write a short poem about the sea."}
# streams each mode's text, then a table: tok/s, accepted tokens per round, cache hit rate, cores used
$PY -m ssd_trt.demo build/smollm2-135m --prompt "$PROMPT" --max-new-tokens 64
