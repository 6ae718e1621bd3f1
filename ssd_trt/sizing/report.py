"""A memory plan as JSON, and the table printed from that JSON (so a saved plan renders exactly as it printed)."""
from __future__ import annotations

from ssd_trt.models.sharding import rank_split
from ssd_trt.sizing.advice import Suggestion
from ssd_trt.sizing.fit import FitPlan
from ssd_trt.sizing.memory import FIXED_BYTES, GIB, HEADROOM
from ssd_trt.sizing.shards import describe

SCHEMA = 1


def plan_json(plan: FitPlan, advice: list[Suggestion]) -> dict:
    """Everything the table shows, in bytes, plus the breakdowns behind it."""
    recipe, e = plan.recipe, plan.recipe.engine
    return {
        "schema": SCHEMA,
        "recipe": recipe.name,
        "limits": {"max_batch": e.max_batch, "max_context": e.max_context, "max_draft_len": e.max_draft_len,
                   "max_tree_size": e.max_tree_size, "tensor_parallel": e.tensor_parallel},
        "models": {role: {"config": model.origin, "engine": plan.formats[role].label,
                          "split": describe(rank_split(model.config, e.tensor_parallel if role == "target" else 1))}
                   for role, model in plan.models.items()},
        "gpu_memory_bytes": plan.gpu_memory,
        "usable_bytes": plan.usable,
        "headroom": HEADROOM,
        "fixed_bytes_per_gpu": FIXED_BYTES,
        "devices": [{"device": d.device, "role": d.role, "rank": d.rank, "weights_bytes": d.weights,
                     "kv_cache_bytes": d.kv_cache,
                     "activation_bytes": {"graph_buffers": d.graph_buffers, "prefill_logits": d.prefill_logits,
                                          "workspace": d.workspace},
                     "fixed_bytes": d.fixed, "total_bytes": d.total, "fits": d.total <= plan.usable}
                    for d in plan.devices],
        "fits": plan.fits,
        "suggestions": [{"change": s.change, "value": s.value, "peak_bytes": s.peak_bytes, "text": s.text}
                        for s in advice],
        "host_memory": plan.host,
    }


def _gib(value: int) -> str:
    return f"{value / GIB:.2f}"


def _who(device: dict) -> str:
    if device["role"] == "draft":
        return "draft"
    return "target" if device["rank"] is None else f"target rank {device['rank']}"


def render(data: dict) -> str:
    """The readable plan of one recipe (``plan_json``'s dict)."""
    limits, models = data["limits"], data["models"]
    lines = [f"#### {data['recipe']}: {'fits' if data['fits'] else 'does not fit'}", ""]
    for role in ("target", "draft"):
        lines.append(f"- {role}: {models[role]['split']}; {models[role]['engine']}; config {models[role]['config']}")
    lines.append(f"- limits: max_batch {limits['max_batch']}, max_context {limits['max_context']}, max_draft_len "
                 f"{limits['max_draft_len']}, max_tree_size {limits['max_tree_size']}, tensor_parallel "
                 f"{limits['tensor_parallel']}")
    lines.append(f"- budget: {_gib(data['gpu_memory_bytes'])} GiB a GPU, {_gib(data['usable_bytes'])} GiB usable "
                 f"({data['headroom']:.0%} kept free)")
    lines += ["", "Memory per device in GiB (activations: CUDA-graph logits, prefill logits, workspace):", "",
              "| device | holds | weights | KV cache | CUDA-graph logits | prefill logits | workspace | fixed | total "
              "| fits |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for d in data["devices"]:
        a = d["activation_bytes"]
        lines.append(f"| {d['device']} | {_who(d)} | {_gib(d['weights_bytes'])} | {_gib(d['kv_cache_bytes'])} | "
                     f"{_gib(a['graph_buffers'])} | {_gib(a['prefill_logits'])} | {_gib(a['workspace'])} | "
                     f"{_gib(d['fixed_bytes'])} | {_gib(d['total_bytes'])} | {'yes' if d['fits'] else 'NO'} |")
    host = data["host_memory"]
    parts = [f"{role}: {e['path']} ~{_gib(e['peak_bytes'])} GiB" for role, e in host["exports"].items()]
    if host["tensorrt_peak_bytes"]:
        parts.append(f"TensorRT builder for the largest plan ~{_gib(host['tensorrt_peak_bytes'])} GiB")
    lines += ["", f"Build host memory: ~{_gib(host['needed_bytes'])} GiB ({'; '.join(parts)})."]
    if data["suggestions"]:
        lines += ["", "Suggestions (each change alone, planned again):"]
        lines += [f"- {s['text']}" for s in data["suggestions"]]
    return "\n".join(lines)
