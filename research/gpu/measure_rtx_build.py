"""What the TensorRT for RTX build of a recipe produced, and why its plans are bf16, as an artifact.

    python -m ssd_trt.build recipes/smollm2-135m.yaml --force     # with pip install -e '.[rtx]'
    python research/gpu/measure_rtx_build.py build/smollm2-135m --out docs/bench/tensorrt_rtx.json

Records, from the build's manifest: each plan's size, build time, compute capabilities, precision and
profiles, the total build time, and the ONNX Runtime check of the native-attention graph; from TensorRT
for RTX's parser: the layer kinds the rtx flavour maps to (attention, KV-cache update, rotary: native, no
plugin); fp32 plans of both models (attention marked decomposable: no fp32 kernel) for comparison. Then
the precision question on the tuning prompts (not the measured ones): the largest value
entering an RMSNorm in fp32 (x^2 must stay below fp16's 65504), and how often the fp16 and bf16 models'
next-token argmax agrees with fp32's.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def layer_kinds(onnx_path: Path) -> dict[str, int]:
    import tensorrt_rtx as trt
    logger = trt.Logger(trt.Logger.ERROR)
    network = trt.Builder(logger).create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise SystemExit(f"could not parse {onnx_path}")
    kinds = Counter(network.get_layer(i).type.name for i in range(network.num_layers))
    return {kind: kinds[kind] for kind in ("ATTENTION_INPUT", "KV_CACHE_UPDATE", "ROTARY_EMBEDDING", "PLUGIN_V3")}


def precision_check(build: Path, prompts: list[str]) -> dict:
    """Max |input| of every RMSNorm in fp32, and next-token argmax agreement of fp16 / bf16 with fp32."""
    import torch

    from ssd_trt_plugins.tree_attention.reference import causal_tree_mask
    from ssd_trt.manifest import read_manifest
    from ssd_trt.models.loading import load_decoder
    from ssd_trt.models.sources import resolve_source
    manifest = read_manifest(build)
    source = resolve_source(manifest.model("target").source)
    model, _ = load_decoder(source)
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(build / "tokenizer")
    largest = [0.0]

    def record(_module, inputs, _output):
        largest[0] = max(largest[0], float(inputs[0].abs().max()))

    def argmax(decoder, ids, dtype):
        caches = [c.to(dtype) for c in decoder.empty_caches(1, ids.shape[1])]
        with torch.no_grad():
            return decoder(ids, torch.arange(ids.shape[1])[None], torch.from_numpy(causal_tree_mask(1, ids.shape[1])),
                           torch.zeros(1, dtype=torch.int32), *caches)[0].float().argmax(-1)

    hooks = [m.register_forward_hook(record) for n, m in model.named_modules()
             if type(m).__name__ == "RMSNorm" and not n.endswith(("q_norm", "k_norm"))]
    halves = {name: copy.deepcopy(model).to(dtype) for name, dtype in (("fp16", torch.float16),
                                                                      ("bf16", torch.bfloat16))}
    agree, positions = Counter(), 0
    for prompt in prompts:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        reference = argmax(model, ids, torch.float32)
        positions += ids.shape[1]
        for name, half in halves.items():
            agree[name] += int((argmax(half, ids, half.embed_tokens.weight.dtype) == reference).sum())
    for hook in hooks:
        hook.remove()
    return {"prompts": len(prompts), "positions": positions, "max_abs_rmsnorm_input_fp32": round(largest[0], 1),
            "fp16_max": 65504.0,
            "argmax_agreement_with_fp32": {name: round(agree[name] / positions, 4) for name in halves}}


def fp32_plans(build: Path, capability: str) -> dict:
    """fp32 plans of both models (one compute capability): TensorRT for RTX has no fp32 attention kernel, so
    the build marks each attention decomposable. Size and build time next to the bf16 plans'."""
    import tempfile

    from ssd_trt.engines.editions import RTX
    from ssd_trt.export.native_graph import native_flavour
    from ssd_trt.export.onnx_export import trace_step_graph
    from ssd_trt.manifest import read_manifest, recipe_fingerprint
    from ssd_trt.models.loading import load_decoder
    from ssd_trt.models.sources import resolve_source
    from ssd_trt.trt.engine_build import build_engine
    manifest = read_manifest(build)
    limits = manifest.recipe.engine.limits
    out = {}
    with tempfile.TemporaryDirectory() as scratch:
        for role in ("target", "draft"):
            model, _ = load_decoder(resolve_source(manifest.model(role).source))
            (Path(scratch) / role).mkdir()
            graph = native_flavour(trace_step_graph(model), limits.max_context, model.config.vocab_size)
            import onnx
            onnx.save_model(graph, Path(scratch) / role / "model.rtx.onnx", save_as_external_data=True,
                            location="weights.rtx.bin")
            entry = build_engine(RTX, role, Path(scratch), limits, "fp32", (capability,),
                                 recipe_fingerprint(manifest.recipe))
            out[role] = {"mib": round(entry["bytes"] / 2**20, 1), "build_seconds": entry["build_seconds"],
                         "compute_capabilities": entry["compute_capabilities"],
                         "decomposable_attention_layers": entry["decomposable_attention_layers"]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--prompts", type=int, default=12, help="tuning prompts for the precision check")
    args = parser.parse_args()
    from ssd_trt.manifest import read_manifest
    manifest = read_manifest(args.build)
    if not manifest.tensorrt.plans:
        raise SystemExit(f"{args.build} has no TensorRT plans ({manifest.tensorrt.status}: {manifest.tensorrt.reason})")
    result = {"build": str(args.build), "recipe": manifest.recipe.name, "status": manifest.tensorrt.status,
              "reason": manifest.tensorrt.reason, "build_seconds_total": manifest.build_seconds,
              "tools": {k: manifest.tools.get(k) for k in ("tensorrt-rtx-cu13", "onnxruntime", "torch")}, "plans": {}}
    for plan in manifest.tensorrt.plans:
        validation = manifest.validation.get(f"{plan.role}_rtx", {})
        result["plans"][plan.role] = {
            "path": plan.path, "edition": plan.edition, "tensorrt_version": plan.tensorrt_version,
            "mib": round(plan.bytes / 2**20, 1), "build_seconds": plan.build_seconds,
            "precision": plan.precision, "compute_capabilities": plan.compute_capabilities,
            "profiles": {p.name: {"batch": p.batch, "tokens": p.tokens} for p in plan.profiles},
            "onnx_bytes": (args.build / plan.onnx).stat().st_size,
            "layers_parsed": layer_kinds(args.build / plan.onnx),
            "ort_check_of_native_graph": {k: validation.get(k) for k in
                                          ("checked_as", "max_abs_error", "same_nodes_as_twin", "passed")}}
    prompts = [json.loads(line)["prompt"] for line in
               (Path(__file__).resolve().parents[2] / "ssd_trt/bench/prompts/tuning.jsonl").read_text().splitlines()
               if line.strip()][: args.prompts]
    result["precision"] = precision_check(args.build, prompts)
    result["fp32_plans"] = fp32_plans(args.build, "sm89")
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
