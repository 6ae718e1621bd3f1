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
if [ "${1:-}" = "--pair" ]; then
  # The real pair (docs/real_pair.md): `bash scripts/bench.sh --pair qwen2.5-coder` fetches Qwen's own Q4_K_M GGUFs
  # (sha256-checked), builds them, and compares AR, SD and SSD with llama.cpp's AR (llama-bench) and its own
  # speculative decoding (llama-speculative, the 0.5B as draft) on the same files, paper-style and at equal cores,
  # on code and chat prompts (ssd_trt/bench/prompts/pair.jsonl; tuning split pair_tuning.jsonl): JSON + PNGs in
  # docs/bench/real_pair/. llama.cpp rows need `SKIP_BINDING=1 bash scripts/install_llama_cpp.sh`. ~12 min on 2
  # idle cores once built (the sweep that chose the defaults: research/real_pair/sweep_pair.py).
  case "${2:-}" in
    qwen2.5-coder) ;;
    *) echo "bench.sh: --pair takes qwen2.5-coder (the pair python -m ssd_trt.models.fetch knows)" >&2; exit 2 ;;
  esac
  shift 2
  OUT=${OUT:-docs/bench/real_pair}
  $PY -m ssd_trt.models.fetch qwen2.5-coder
  $PY -m ssd_trt.build recipes/qwen2.5-coder-1.5b.yaml --if-stale
  $PY -m ssd_trt.bench build/qwen2.5-coder-1.5b --chat --prompts ssd_trt/bench/prompts/pair.jsonl \
    --tuning-prompts ssd_trt/bench/prompts/pair_tuning.jsonl --baselines llama_bench,llama_speculative \
    --max-new-tokens ${NEW_TOKENS:-64} --sampling ${SAMPLING:-greedy} --build-defaults --out "$OUT" "$@"
  exit 0
fi
$PY -m ssd_trt.build recipes/smollm2-135m.yaml --if-stale --tune   # rebuilds when the recipe or a model changed;
# --tune: K and fan-out chosen by measurement on this machine (once per build, ~2 min)
# the fp32 reference build of the same pair: its greedy AR runs side by side as row ar_fp32
$PY -m ssd_trt.build recipes/smollm2-135m-fp32.yaml --if-stale
exec $PY -m ssd_trt.bench build/smollm2-135m --chat --limit-per-category ${PER_CATEGORY:-2} \
  --ar-builds ar_fp32=build/smollm2-135m-fp32 \
  --max-new-tokens 128 --sampling ${SAMPLING:-greedy,t0.7-p0.9,t1-k50} --build-defaults \
  --out ${OUT:-runs/bench} "$@"
