#!/usr/bin/env bash
# The main job on the embedded default, end to end: install, build, generate with ar / sd / ssd.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
if [ "${1:-}" = "--pair" ]; then
  # the main job on the real pair (docs/real_pair.md): `bash scripts/demo.sh --pair qwen2.5-coder` fetches Qwen's own
  # Q4_K_M GGUFs (~1.6 GB, sha256-checked, cached in build/models), builds them (~2 min) and generates with ar / sd / ssd
  [ "${2:-}" = qwen2.5-coder ] || { echo "demo.sh: --pair takes qwen2.5-coder" >&2; exit 2; }
  $PY -m ssd_trt.models.fetch qwen2.5-coder
  $PY -m ssd_trt.build recipes/qwen2.5-coder-1.5b.yaml --if-stale
  exec $PY -m ssd_trt.demo build/qwen2.5-coder-1.5b --max-new-tokens 64 \
    --prompt "${PROMPT:-Write a Python function that merges two sorted lists into one sorted list.}"
fi
$PY -m ssd_trt.build recipes/smollm2-135m.yaml --if-stale --tune   # rebuilds when the recipe or a model changed;
# --tune: K and fan-out chosen by measurement on this machine (once per build, ~2 min)
PROMPT=${PROMPT:-"Write a short poem about the sea."}
# streams each mode's text, then a table: tok/s, accepted tokens per round, cache hit rate, cores used
$PY -m ssd_trt.demo build/smollm2-135m --prompt "$PROMPT" --max-new-tokens 64
