#!/usr/bin/env bash
# Every GPU check in one go (one NVIDIA GPU, torch + triton, no TensorRT), results under ${OUT:-gpu_results}:
# the kernel table (research/gpu/gpu_check.py), the runtime check (research/gpu/gpu_runtime_check.py) and the
# gpu-marked tests; on a host with TP + 1 GPUs (TP=2 by default: TP=4 is the paper's 70B layout) also the target split
# over GPUs 0 .. TP-1 with the draft on GPU TP (research/gpu/tp_bench.py).
# Each part has its own time limit so that a hang in one still leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee "$OUT/device.txt"
$PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
  2>&1 | tee -a "$OUT/device.txt"
status=0
timeout 180 $PY research/gpu/gpu_check.py --json "$OUT/gpu_check.json" --iters 30 2>&1 | tee "$OUT/gpu_check.log" || status=1
timeout 240 $PY research/gpu/gpu_runtime_check.py --json "$OUT/gpu_runtime.json" 2>&1 | tee "$OUT/gpu_runtime.log" || status=1
timeout 150 $PY -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_trt_plugin.py tests/test_device_step_engine.py \
  2>&1 | tee "$OUT/pytest_gpu.log" || status=1
TP=${TP:-2}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -ge $((TP + 1)) ]; then
  timeout 900 $PY research/gpu/tp_bench.py --tensor-parallel "$TP" --json "$OUT/tp_bench.json" 2>&1 \
    | tee "$OUT/tp_bench.log" || status=1
else
  echo "tp_bench: skipped, $gpus GPU(s) here; a target over TP=$TP GPUs and its draft need $((TP + 1))" \
    | tee "$OUT/tp_bench.log"
fi
echo "gpu_session: exit $status"
exit $status
