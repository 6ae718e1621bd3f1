#!/usr/bin/env bash
# The main job on the embedded default, end to end: install, build, generate with ar / sd / ssd.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
$PY -m ssd_trt.build recipes/smollm2-135m.yaml --if-stale   # rebuilds when the recipe or a model changed
PROMPT=${PROMPT:-"Write a short poem about the sea."}
for mode in ar sd ssd; do
  echo "== mode $mode =="
  $PY -m ssd_trt.generate build/smollm2-135m --chat --mode "$mode" --max-new-tokens 64 --prompt "$PROMPT"
done
