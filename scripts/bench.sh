#!/usr/bin/env bash
# Reproduce the benchmark tables (README, docs/benchmarks.md) on the embedded default (2-core CPU, batch 1, 128 tokens):
# greedy, T=0.7 top-p 0.9 and T=1 top-k 50; SD and SSD at the build's decoding defaults, which `--tune` chose
# by measurement on the tuning split (tuning.jsonl), reported on the measured prompts (default.jsonl, 2 per
# category). llama.cpp rows need `bash scripts/install_llama_cpp.sh` (its own llama-bench / llama-lookup binaries
# and its Python binding); without it they are skipped with the reason.
# Run on an otherwise idle machine: every number is a ratio measured side by side in this one run.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m ssd_trt.build recipes/smollm2-135m.yaml --if-stale --tune   # rebuilds when the recipe or a model changed;
# --tune: K and fan-out chosen by measurement on this machine (once per build, ~2 min)
# the fp32 reference build of the same pair: its greedy AR runs side by side as row ar_fp32
$PY -m ssd_trt.build recipes/smollm2-135m-fp32.yaml --if-stale
exec $PY -m ssd_trt.bench build/smollm2-135m --chat --limit-per-category ${PER_CATEGORY:-2} \
  --ar-builds ar_fp32=build/smollm2-135m-fp32 \
  --max-new-tokens 128 --sampling ${SAMPLING:-greedy,t0.7-p0.9,t1-k50} --build-defaults \
  --out ${OUT:-runs/bench} "$@"
