"""Builds of one pair with different weights, side by side: speed, memory and greedy parity.

    python research/cpu/measure_weights.py build/smollm2-135m-fp32 build/smollm2-135m-4bit-fp32act \
        build/smollm2-135m --out docs/bench/weights.json

For each build (the first is the reference): the target's decode (1 token) and verification (K+1 = 3
tokens) step times on 1 and 2 threads (median of repeated steps on a 40-token prefix) and the draft's on
one, the process's resident memory after opening the target (VmRSS; VmHWM the peak while loading), the
target graph's fused-MatMul count in ONNX Runtime's optimized model, the target's logits on a 40-token
prefill against the reference build's (max abs / relative difference, argmax changes), and greedy decoding
on every shipped prompt (chat template, --tokens new tokens): how many AR outputs are identical to the
reference build's and the mean fraction agreeing before the first difference; SD and SSD checked
token-identical to the build's own AR on the same prompts, and SD's mean accepted tokens per round.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
LOGITS = Path("/tmp/measure_weights_logits")
sys.path.insert(0, str(ROOT))
from ssd_trt.bench.runner import agreement  # noqa: E402

STEP_SCRIPT = r"""
import json, sys, time, numpy as np
from pathlib import Path
from ssd_trt.engines.affinity import pinned
from ssd_trt.engines.factory import EngineSet
from ssd_trt.manifest import read_manifest
from ssd_trt.options import RuntimeOptions
build, threads, role, logits_out = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
cores = (0,) if threads == 1 else (0, 1)
options = RuntimeOptions(target_threads=threads, draft_threads=threads, target_cores=cores, draft_cores=cores,
                         spin=True)   # one model alone
engine = EngineSet(build, read_manifest(build), {role: options.placement(role)}).get(role)
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
rss_mb, peak_mb = (int(status[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM"))
with pinned(cores):
    engine.reset(1)
    logits = engine.forward(np.arange(40)[None] + 5, np.arange(40)[None], logit_indices=np.arange(40)[None])
    if logits_out != "-":
        np.save(logits_out, np.asarray(logits, dtype=np.float32))
    decode, verify = [], []
    for _ in range(40):
        t = time.perf_counter(); engine.forward(np.array([[7]]), engine.lengths[:, None]); decode.append(time.perf_counter() - t)
    for _ in range(20):
        t = time.perf_counter(); engine.forward(np.array([[5, 6, 7]]), engine.lengths[:, None] + np.arange(3))
        verify.append(time.perf_counter() - t); engine.rollback(engine.lengths - 3)
print(json.dumps({"decode_ms": 1e3 * float(np.median(decode)), "verify3_ms": 1e3 * float(np.median(verify)),
                  "rss_mb_after_open": rss_mb, "peak_rss_mb": peak_mb}))
"""


def step_times(build: Path, threads: int, role: str = "target", logits_out: Path | None = None) -> dict:
    """Measured in a fresh process (so resident memory is this build's alone)."""
    out = subprocess.run([sys.executable, "-c", STEP_SCRIPT, str(build), str(threads), role,
                          str(logits_out) if logits_out else "-"], cwd=ROOT, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def logit_difference(ours: np.ndarray, reference: np.ndarray) -> dict:
    """Max |difference| of the target's logits on a 40-token prefill (all positions), absolute and relative
    to the reference's largest |logit|, and how many positions' argmax differ."""
    diff = np.abs(ours - reference)
    return {"max_abs": float(diff.max()), "max_rel": float(diff.max() / np.abs(reference).max()),
            "argmax_differs": int((ours.argmax(-1) != reference.argmax(-1)).sum()), "positions": int(ours.shape[-2])}


def fused_matmuls(build: Path) -> int:
    import onnx
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(Path("/tmp") / f"{build.name}-optimized.onnx")
    options.log_severity_level = 3
    ort.InferenceSession(str(build / "target" / "model.ort.onnx"), options, providers=["CPUExecutionProvider"])
    model = onnx.load(options.optimized_model_filepath, load_external_data=False)
    return sum(node.op_type == "MatMulNBits" for node in model.graph.node)


def greedy_outputs(build: Path, tokens: int) -> dict[str, dict[str, list[int]]]:
    import ssd_trt
    from ssd_trt.bench.prompts import load_prompts
    gen = ssd_trt.load(build)
    params = ssd_trt.SamplingParams(max_new_tokens=tokens)
    modes = ("ar", "sd", "ssd")
    out = {}
    for prompt in load_prompts():
        ids = gen.encode(prompt.prompt, chat=True)
        results = {mode: gen.generate_ids([ids], params, mode=mode)[0] for mode in modes}
        out[prompt.id] = {mode: r.token_ids for mode, r in results.items()}
        if "sd" in results:
            out[prompt.id]["sd_accepted"] = results["sd"].stats["mean_accepted"]
    return out


def table(report: dict) -> str:
    """The "4-bit weights" table (docs/weights.md), rendered from weights.json (nothing typed by hand)."""
    head = ("| build | target weights / activations | draft | decode ms (1 thr / 2 thr) | verify 3 tokens ms "
            "(1 / 2) | draft decode ms | resident MB | fused 4/8-bit MatMuls | logits vs fp32: max abs (argmax "
            "changes / positions) | greedy AR = fp32 build | SD & SSD = own AR | SD accepted/round |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for name, b in report["builds"].items():
        steps, logits, greedy = b["steps"], b["target_logits_vs_reference"], b["greedy_vs_reference"]
        lines.append(
            f"| `{Path(name).name}` | {b['target_weights']} / {b['target_activations']} | {b['draft_weights']} / "
            f"{b['draft_activations']} | {steps['1']['decode_ms']:.1f} / {steps['2']['decode_ms']:.1f} | "
            f"{steps['1']['verify3_ms']:.1f} / {steps['2']['verify3_ms']:.1f} | "
            f"{b['draft_steps_1_thread']['decode_ms']:.2f} | {steps['1']['rss_mb_after_open']:.0f} | "
            f"{b['fused_4_8_bit_matmuls']} | {logits['max_abs']:.3g} ({logits['argmax_differs']}/{logits['positions']}) | "
            f"{greedy['identical_prompts']}/{greedy['prompts']} (prefix {greedy['mean_agreeing_prefix']:.2f}) | "
            f"{b['sd_ssd_identical_to_own_ar']}/{greedy['prompts']} | {b['sd_mean_accepted']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("builds", nargs="*", type=Path)
    parser.add_argument("--table", type=Path, help="print the markdown table of this weights.json and exit")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "bench" / "weights.json")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(args.table.read_text())))
        return 0
    from ssd_trt.manifest import read_manifest
    report = {"date": time.strftime("%Y-%m-%d"), "tokens": args.tokens, "reference": str(args.builds[0]), "builds": {}}
    outputs = {}
    LOGITS.mkdir(exist_ok=True)
    for build in args.builds:
        manifest = read_manifest(build)
        entry = {"recipe": manifest.recipe_path, "target_weights": manifest.recipe.target.weights,
                 "draft_weights": manifest.recipe.draft.weights,
                 "target_activations": manifest.recipe.target.activations,
                 "draft_activations": manifest.recipe.draft.activations,
                 "target_quantization": manifest.model("target").quantization,
                 "fused_4_8_bit_matmuls": fused_matmuls(build),
                 "steps": {threads: step_times(build, threads, logits_out=LOGITS / f"{build.name}.npy" if threads == 1
                                               else None) for threads in (1, 2)},
                 "draft_steps_1_thread": step_times(build, 1, role="draft")}
        entry["target_logits_vs_reference"] = logit_difference(np.load(LOGITS / f"{build.name}.npy"),
                                                                np.load(LOGITS / f"{args.builds[0].name}.npy"))
        print(build, json.dumps(entry["steps"]), flush=True)
        outputs[build] = greedy_outputs(build, args.tokens)
        entry["sd_ssd_identical_to_own_ar"] = sum(o.get("sd") == o["ar"] and o.get("ssd") == o["ar"]
                                                  for o in outputs[build].values()) if "sd" in next(
            iter(outputs[build].values())) else None
        reference = outputs[args.builds[0]]
        entry["greedy_vs_reference"] = agreement([outputs[build][k]["ar"] for k in reference],
                                                 [reference[k]["ar"] for k in reference])
        accepted = [o["sd_accepted"] for o in outputs[build].values() if o.get("sd_accepted") is not None]
        entry["sd_mean_accepted"] = float(np.mean(accepted)) if accepted else None
        print(build, entry["greedy_vs_reference"], "sd/ssd == own ar:", entry["sd_ssd_identical_to_own_ar"], flush=True)
        report["builds"][str(build)] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
