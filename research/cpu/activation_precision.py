"""Logits of the CPU kernel (two source versions), ONNX Runtime int8 and ONNX Runtime with fp32 activations on 128 tokens of
README.md, real target or draft: how much the activation quantization costs (max logit difference, mean KL, top-1).
    python research/cpu/activation_precision.py target OLD_CSRC NEW_CSRC   (two copies of ssd_trt/kernels/csrc)"""
import sys, numpy as np
from pathlib import Path
from kernel_sources import use_sources
from ssd_trt.engines.base import EngineSpec
from ssd_trt.engines.ort import OrtEngine
from ssd_trt.kernels.artifact import load_cpu_tiles
from ssd_trt.engines.kernel_engine import KernelEngine
from transformers import AutoTokenizer
root = Path("build/qwen2.5-coder-1.5b"); role = sys.argv[1]
tok = AutoTokenizer.from_pretrained(root / "tokenizer")
text = (Path(__file__).resolve().parents[2] / "README.md").read_text()[:3000]
ids = np.array([tok(text)["input_ids"][:128]])
folder = root / role
tiles = load_cpu_tiles(folder)
spec = EngineSpec(name=role, vocab_size=tiles.shape["vocab_size"], num_layers=tiles.shape["num_layers"],
                  num_kv_heads=tiles.shape["num_kv_heads"], head_dim=tiles.shape["head_dim"], max_batch=1, max_context=256)
def run(engine):
    engine.reset(1)
    return engine.forward(ids, np.arange(ids.shape[1])[None])[0].astype(np.float64)
ref = run(OrtEngine(folder / "model.ort.onnx", spec, int8_activations=False))
res = {"ort-int8": run(OrtEngine(folder / "model.ort.onnx", spec, int8_activations=True))}
for label, src in (("kernel " + sys.argv[2], sys.argv[2]), ("kernel " + sys.argv[3], sys.argv[3])):
    use_sources(src)
    e = KernelEngine(tiles, spec); res[label] = run(e); e.close()
def logp(x): x = x - x.max(-1, keepdims=True); return x - np.log(np.exp(x).sum(-1, keepdims=True))
lr = logp(ref); pr = np.exp(lr)
for k, v in res.items():
    lv = logp(v)
    kl = (pr * (lr - lv)).sum(-1)
    print(f"{role} {k:15s} vs fp32-activations: max|dlogit| {np.abs(v-ref).max():6.3f}  mean KL {kl.mean():.5f}  top1 {(v.argmax(-1)==ref.argmax(-1)).mean():.3f}")
