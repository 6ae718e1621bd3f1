#!/usr/bin/env bash
# The one-GPU session, from a fresh clone: what a lent GPU runs (one NVIDIA GPU, torch + triton, no TensorRT).
#
#   bash scripts/gpu_session.sh            # on the GPU host: writes docs/bench/gpu/session.json
#   bash scripts/gpu_session.sh --smoke    # every part on CPU at toy sizes (CI): writes $OUT/session.json
#   options: --no-install (use the Python as it is)
#
# Parts, each under its own time limit (a hang in one leaves the others' results; the GPU limits add up to 8 min 50 s,
# so the session fits one 10-minute run), each saying why when it cannot run:
#   install     scripts/gpu_install.sh: CUDA torch, this package with its gpu extra (plugins/ is ssd_trt_plugins)
#   kernel      research/gpu/gpu_check.py: the tree-attention Triton kernel against the reference math, speed, CUDA graph
#   runtime     research/gpu/gpu_runtime_check.py: the step runtime's parity, greedy SD/SSD == AR, step timings
#   pytest_gpu  the gpu-marked tests
#   fetch       python -m ssd_trt.models.fetch qwen2.5-coder (kept when already there; --smoke: --check only)
#   build       python -m ssd_trt.build recipes/qwen2.5-coder-1.5b-torch.yaml (--smoke: a tiny GGUF pair)
#   pair        research/gpu/pair_session.py: the real 1.5B / 0.5B pair through the torch backend, draft and target on
#               two streams of GPU 0 (target prioritized), CUDA graphs: AR, SD, SSD tokens/s, acceptance, hit rate,
#               greedy exactness against AR, step times
# Then research/gpu/session_report.py writes the one JSON (every part's status and results) and prints a summary.
# Part logs go to gpu_results/ (--smoke: a temporary folder); where $OUT is set (the lent machine's return folder),
# the JSON, the summary and the logs (one archive) are copied there.
# Exit 0 when no part failed (a part that cannot run here says why; with --smoke every part must run).
# On a host with TP + 1 GPUs (TP=2 by default; TP=4 is the paper's 70B layout) it then also runs
# research/gpu/tp_bench.py (the target split over GPUs 0 .. TP-1, the draft on GPU TP): 15 more minutes at most, outside
# the one-GPU budget (its CPU code path is tests/test_tensor_parallel.py's).
set -uo pipefail
cd "$(dirname "$0")/.."
SMOKE=0
INSTALL=1
for arg in "$@"; do
  case $arg in
    --smoke) SMOKE=1 ;;
    --no-install) INSTALL=0 ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "gpu_session: unknown option $arg (see --help)" >&2; exit 2 ;;
  esac
done
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
STARTED=$SECONDS

if [ "$SMOKE" = 1 ]; then
  RESULTS=$(mktemp -d "${TMPDIR:-/tmp}/gpu_session_smoke.XXXXXX")
  JSON=${OUT:-$RESULTS}/session.json
  # CI's time guards, not a budget: a fresh virtualenv's install takes minutes on 2 cores
  declare -A LIMIT=([install]=900 [kernel]=180 [runtime]=240 [pytest_gpu]=240 [fetch]=60 [build]=180 [pair]=240)
else
  RESULTS=gpu_results
  rm -rf "$RESULTS"
  JSON=docs/bench/gpu/session.json
  # the GPU session's budget: 60 + 60 + 75 + 40 + 45 + 70 + 180 = 530 s (the pair's load alone, two GGUF files
  # dequantized on the host, took 76 s on 2 busy CPU cores; a fetch into an empty cache needs a fast link: 1.6 GB)
  declare -A LIMIT=([install]=60 [kernel]=60 [runtime]=75 [pytest_gpu]=40 [fetch]=45 [build]=70 [pair]=180)
fi
mkdir -p "$RESULTS" "$(dirname "$JSON")"
PARTS=$RESULTS/parts.tsv
: > "$PARTS"

# record NAME STATUS RC SECONDS WHY: one row of parts.tsv (what session_report.py reads)
record() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${LIMIT[$1]}" "$5" >> "$PARTS"; }

# last_line LOG: the last non-empty line a part printed (its reason when it stops)
last_line() { grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 1 | cut -c1-300; }

# part NAME "RC..." CMD...: run CMD under NAME's limit, logging to $RESULTS/NAME.log; exit codes in the second
# argument mean "cannot run here" (the part says why), 0 passed, 124/137 timed out, anything else failed
part() {
  local name=$1 cannot_run=$2 started=$SECONDS rc status
  shift 2
  echo "== $name (limit ${LIMIT[$name]} s): $*"
  timeout --kill-after=10 "${LIMIT[$name]}" "$@" 2>&1 | tee "$RESULTS/$name.log"
  rc=${PIPESTATUS[0]}
  case " $cannot_run " in
    *" $rc "*) status="not run" ;;
    *) case $rc in 0) status=passed ;; 124|137) status="timed out" ;; *) status=failed ;; esac ;;
  esac
  local why=""
  [ "$status" != passed ] && why=$(last_line "$RESULTS/$name.log")
  [ "$status" = "timed out" ] && why="stopped at its ${LIMIT[$name]} s limit; last output: $why"
  record "$name" "$status" "$rc" "$((SECONDS - started))" "$why"
  return "$rc"
}

skip() { echo "== $1: not run: $2"; record "$1" "not run" "" 0 "$2"; }

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "no NVIDIA GPU (no nvidia-smi)" > "$RESULTS/device.txt"
elif ! nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$RESULTS/device.txt" 2>&1; then
  echo "no NVIDIA GPU (nvidia-smi: $(head -n 1 "$RESULTS/device.txt"))" > "$RESULTS/device.txt"
fi

if [ "$INSTALL" = 1 ]; then
  part install "" bash scripts/gpu_install.sh
else
  skip install "--no-install: the Python as it is"
fi

if [ "$SMOKE" = 1 ]; then
  part kernel "" "$PY" research/gpu/gpu_check.py --device cpu --smoke --iters 1 --json "$RESULTS/kernel.json"
  part runtime "" "$PY" research/gpu/gpu_runtime_check.py --device cpu --smoke --json "$RESULTS/runtime.json"
else
  part kernel "2" "$PY" research/gpu/gpu_check.py --iters 20 --json "$RESULTS/kernel.json"
  part runtime "2" "$PY" research/gpu/gpu_runtime_check.py --json "$RESULTS/runtime.json"
fi
# without a GPU the gpu-marked tests skip (collected and imported all the same); 5: none collected
part pytest_gpu "5" "$PY" -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_trt_plugin.py \
  tests/test_device_step_engine.py

if [ "$SMOKE" = 1 ]; then
  # the fetch's own checks on an empty cache (downloading 1.6 GB is not a smoke test): exit 1 = files missing
  part fetch "" bash -c "'$PY' -m ssd_trt.models.fetch qwen2.5-coder --check --dest '$RESULTS/no-models'; [ \$? -le 1 ]"
  WORK=$RESULTS/pair
  if part build "" bash -c "'$PY' research/gpu/pair_session.py --write-smoke-pair '$WORK' >/dev/null \
      && '$PY' -m ssd_trt.build '$WORK/tiny-gguf-torch.yaml'"; then
    part pair "" "$PY" research/gpu/pair_session.py --smoke --build "$WORK/build/tiny-gguf-torch" --new-tokens 12 \
      --json "$RESULTS/pair.json"
  else
    skip pair "the smoke pair did not build (see build)"
  fi
else
  BUILD=build/qwen2.5-coder-1.5b-torch
  if part fetch "" "$PY" -m ssd_trt.models.fetch qwen2.5-coder; then
    if part build "" "$PY" -m ssd_trt.build recipes/qwen2.5-coder-1.5b-torch.yaml --if-stale; then
      part pair "2 3" "$PY" research/gpu/pair_session.py --build "$BUILD" --budget-s $((LIMIT[pair] - 30)) \
        --json "$RESULTS/pair.json"
    else
      skip pair "the pair did not build (see build)"
    fi
  else
    why="the pair's GGUF files are not here and the fetch did not bring them (fetch: $(last_line "$RESULTS/fetch.log"))"
    skip build "$why"
    skip pair "$why"
  fi
  TP=${TP:-2}
  LIMIT[tp_bench]=900
  gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  if [ "$gpus" -ge $((TP + 1)) ]; then
    part tp_bench "2" "$PY" research/gpu/tp_bench.py --tensor-parallel "$TP" --json "$RESULTS/tp_bench.json"
  else
    skip tp_bench "$gpus GPU(s) here; a target over TP=$TP GPUs and its draft need $((TP + 1))"
  fi
fi

"$PY" research/gpu/session_report.py --results "$RESULTS" --json "$JSON" $([ "$SMOKE" = 1 ] && echo --smoke) \
  --elapsed $((SECONDS - STARTED)) | tee "$RESULTS/summary.txt"
status=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ] && [ "$SMOKE" = 0 ]; then
  mkdir -p "$OUT"
  cp "$JSON" "$RESULTS/summary.txt" "$OUT/"
  tar czf "$OUT/gpu_logs.tar.gz" -C "$RESULTS" . 2>/dev/null
fi
echo "gpu_session: wrote $JSON; part logs in $RESULTS; exit $status"
exit "$status"
