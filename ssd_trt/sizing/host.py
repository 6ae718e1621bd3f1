"""Host memory a recipe's build needs, from the configs alone: ``export/host_memory.py``'s estimates, applied as
``export/streamed_build.py``'s ``plan_exports`` applies them (which measures the same from the checkpoints' headers
when the build starts)."""
from __future__ import annotations

from dataclasses import replace

from ssd_trt.export import host_memory
from ssd_trt.export.streamed_build import STREAM_ABOVE_BYTES
from ssd_trt.models.sharding import rank_split
from ssd_trt.recipe import Recipe
from ssd_trt.sizing.configs import SizedModel
from ssd_trt.sizing.formats import FLOAT_BYTES, runtime_backend
from ssd_trt.sizing.memory import DeviceMemory
from ssd_trt.sizing.shards import rank_params


def build_host_memory(recipe: Recipe, models: dict[str, SizedModel], devices: list[DeviceMemory]) -> dict:
    """Each model's export path and peak, the TensorRT builder's peak for the largest plan (one target rank's, or
    the draft's), and what the build needs: in-memory exports stay loaded for the whole build, a streamed one holds
    its peak only while it is exported, the TensorRT builder comes after both."""
    backend = runtime_backend(recipe)
    exports = {}
    for role, model in models.items():
        spec, config = getattr(recipe, role), model.config
        whole = rank_params(rank_split(config, 1))
        checked = rank_params(rank_split(replace(config, num_layers=min(spec.check_layers, config.num_layers)),
                                         1)).total
        largest = max(whole.embedding, whole.head, *(p.numel for p in whole.projections))
        if backend == "torch":      # no export: the checkpoint is opened and its first layers checked
            path, peak = "checks only (torch backend)", host_memory.streamed_peak(0, checked)
        elif model.gguf is None and (spec.export == "streamed" or
                                     (spec.export == "auto" and 4 * whole.total > STREAM_ABOVE_BYTES)):
            path, peak = "streamed", host_memory.streamed_peak(largest, checked)
        else:
            path, peak = "in_memory", host_memory.in_memory_peak(whole.total)
        exports[role] = {"path": path, "params": whole.total, "peak_bytes": peak}
    export_peak = sum(e["peak_bytes"] for e in exports.values() if e["path"] == "in_memory") + \
        max((e["peak_bytes"] for e in exports.values() if e["path"] != "in_memory"), default=0)
    tensorrt = 0
    if backend == "trt":            # TensorRT's builder holds a plan's weights about 3.5 times (host_memory.py)
        precision = recipe.engine.trt_precision
        params = max(d.weights for d in devices) // FLOAT_BYTES[precision]
        tensorrt = host_memory.tensorrt_peak(params, precision)
    return {"exports": exports, "export_peak_bytes": export_peak, "tensorrt_peak_bytes": tensorrt,
            "needed_bytes": max(export_peak, tensorrt)}
