"""The build's steps for a model exported by streaming (``export/streamed.py``), and the choice of which are.

:func:`plan_exports` runs before any long work: it opens every HF checkpoint (a missing or corrupt shard fails
there), picks each model's export path and checks the host has the memory for both
(``export/host_memory.py``). :func:`export_streamed_role` is one streamed model's parity, export and
validation, all bounded (``export/bounded_checks.py``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ssd_trt.errors import RecipeError, SsdTrtError
from ssd_trt.manifest import ROLES
from ssd_trt.recipe import Recipe

STREAM_ABOVE_BYTES = 256 << 20   # export: auto streams an HF checkpoint larger than this in fp32 (64M parameters)
# ... and a GGUF file larger than this (256M parameters): a smaller one (the embedded default's 135M target) stays
# on the in-memory path, whose parity check runs the whole model against transformers' own GGUF loader
STREAM_GGUF_ABOVE_BYTES = 1 << 30


def plan_exports(recipe: Recipe, sources: dict, host_bytes: int | None) -> tuple[dict, dict]:
    """Open each HF checkpoint (a missing or corrupt shard fails here), choose each model's export path and
    check the host has the memory both need, all before any long work. Returns (checkpoints of the streamed
    models, the memory record for the manifest)."""
    from ssd_trt.export import host_memory
    from ssd_trt.models.checkpoint import Checkpoint, count_params

    checkpoints, plans = {}, []
    ranks = recipe.engine.tensor_parallel
    if ranks > 1:
        check_tensor_parallel_recipe(recipe, sources)
    split = None
    for role in ROLES:
        spec, source = getattr(recipe, role), sources[role]
        feature_pair = recipe.draft.kind == "eagle3"
        if feature_pair:
            if spec.export == "streamed":
                raise RecipeError(f"{role}.export: streamed reads a checkpoint layer by layer, but {source.path}: "
                                  "the pair has an EAGLE-3 draft (its target's graph also returns features); use "
                                  "export: in_memory (or auto)")
            params = count_params(source)
            plans.append(host_memory.MemoryPlan(role, "in_memory", params, host_memory.in_memory_peak(params)))
            continue
        if source.kind == "gguf":     # its reader parses the whole header (~9 s for a 152k-token vocabulary): once
            from ssd_trt.models.gguf_checkpoint import GGUFCheckpoint
            checkpoint = GGUFCheckpoint.open(source.path)
            params = checkpoint.num_params
            if spec.export == "in_memory" or (spec.export == "auto" and 4 * params <= STREAM_GGUF_ABOVE_BYTES):
                plans.append(host_memory.MemoryPlan(role, "in_memory", params, host_memory.in_memory_peak(params)))
                continue
        else:
            checkpoint = Checkpoint.open(source.path)
        if role == "target" and ranks > 1:     # from the config alone: before any weight is read or file written
            from ssd_trt.models.sharding import rank_split
            split = rank_split(checkpoint.config, ranks, f"the target {source.path}")
        # a tensor-parallel target is always streamed: its rank graphs are written from the checkpoint's tensors
        auto = spec.export == "auto" and 4 * checkpoint.num_params > STREAM_ABOVE_BYTES
        streamed = spec.export == "streamed" or auto or (role == "target" and split is not None)
        if not streamed:
            plans.append(host_memory.MemoryPlan(role, "in_memory", checkpoint.num_params,
                                                host_memory.in_memory_peak(checkpoint.num_params)))
            continue
        if spec.weights == "gguf" and source.kind != "gguf":
            raise RecipeError(f"{role}: weights: gguf keeps a GGUF file's own blocks, but {source.path} is not a .gguf "
                              f"file; use weights: float, int8 or int4 for this model")
        from ssd_trt.export.bounded_checks import checked_cut
        checked = checked_cut(checkpoint, spec.check_layers).num_params
        plans.append(host_memory.MemoryPlan(role, "streamed", checkpoint.num_params,
                                            host_memory.streamed_peak(checkpoint.largest_tensor_numel, checked)))
        checkpoints[role] = checkpoint
    # in-memory models stay loaded for the whole build; a streamed one holds its peak only while it is exported;
    # a TensorRT builder, when one builds plans here, comes after all of it (the heap trimmed in between)
    exports = sum(p.peak_bytes for p in plans if p.path == "in_memory") + \
        max((p.peak_bytes for p in plans if p.path == "streamed"), default=0)
    plans_here = _builds_plans_here(recipe)
    plan_params = {p.role: p.params for p in plans}
    if split is not None:      # one rank's plan is built at a time: its share, and the whole embedding and head
        plan_params["target"] = _rank_plan_params(checkpoints["target"], split)
    tensorrt = host_memory.tensorrt_peak(max(plan_params.values()), recipe.engine.trt_precision) if plans_here else 0
    needed = max(exports, tensorrt)
    available = host_bytes if host_bytes is not None else host_memory.available_bytes()
    if needed > available:
        gib = host_memory.GIB
        advice = ("export: streamed (HF safetensors checkpoints) keeps host memory near one tensor"
                  if any(p.path == "in_memory" for p in plans) else
                  "lower check_layers, or build on a host with more memory")
        if tensorrt > exports:
            advice = (f"the TensorRT builder alone needs ~{tensorrt / gib:.1f} GiB for the largest model: build its "
                      "plans on a bigger host, or set engine.tensorrt: none here")
        raise RecipeError(f"recipe {recipe.name!r} needs an estimated {needed / gib:.1f} GiB of host memory to build "
                          f"({'; '.join(p.describe() for p in plans)}) but {available / gib:.1f} GiB is available; "
                          f"{advice} (estimates: ssd_trt/export/host_memory.py)")
    record = {"estimate_bytes": needed, "available_bytes": available, "tensorrt_estimate_bytes": tensorrt,
              "exports": {p.role: {"path": p.path, "params": p.params, "peak_estimate_bytes": p.peak_bytes}
                          for p in plans}}
    if split is not None:
        record["exports"]["target"].update(tensor_parallel_ranks=split.ranks, rank_params=plan_params["target"])
    return checkpoints, record


def check_tensor_parallel_recipe(recipe: Recipe, sources: dict) -> None:
    """What an ONNX / TensorRT build with ``engine.tensor_parallel`` > 1 needs, from the recipe alone: rank graphs
    run only as TensorRT plans (ONNX Runtime has no all-reduce), written from an HF safetensors checkpoint, of an
    independent target (an EAGLE-3 target also returns features)."""
    ranks, engine, target = recipe.engine.tensor_parallel, recipe.engine, recipe.target
    why = None
    if engine.backend == "ort" or engine.tensorrt == "none":
        setting = "engine.backend: ort" if engine.backend == "ort" else "engine.tensorrt: none"
        why = (f"the recipe asks for ONNX Runtime only ({setting}), which cannot run a split target: ONNX Runtime has "
               "no all-reduce to add the ranks' partial sums; set engine.tensorrt to rtx, datacenter or auto (rank "
               "plans) or engine.backend to torch")
    elif sources["target"].kind != "hf":
        why = (f"the target {sources['target'].path} is a .gguf file, and rank graphs are written from an HF "
               "safetensors checkpoint tensor by tensor; convert it, or use engine.tensor_parallel: 1")
    elif target.export == "in_memory":
        why = ("target.export is in_memory, and rank graphs are written by the streamed export (each checkpoint tensor "
               "sliced for every rank as it is read); use export: auto or streamed")
    elif recipe.draft.kind == "eagle3":
        why = ("the draft is an EAGLE-3 head, whose target graph also returns features; tensor-parallel targets take "
               "independent drafts")
    if why is not None:
        raise RecipeError(f"recipe {recipe.name!r} sets engine.tensor_parallel: {ranks}, but {why}")


def _rank_plan_params(checkpoint, split) -> int:
    """Parameters in one rank's plan: its share of the layers, the whole embedding and head (a tied head's copy too:
    the graph holds it as its own weight)."""
    shapes = {name: info.shape for name, info in checkpoint.tensors.items() if info.dtype != "I64"}
    tied = checkpoint.config.tie_word_embeddings and "lm_head.weight" not in checkpoint.tensors
    return split.shard_numel(shapes) + (checkpoint.tensors["model.embed_tokens.weight"].numel if tied else 0)


def _builds_plans_here(recipe: Recipe) -> bool:
    """Whether the build's TensorRT step will run a TensorRT builder in this process (an edition is installed)."""
    from ssd_trt.engines.editions import editions_for
    return recipe.engine.backend != "ort" and any(edition.installed() for edition in editions_for(recipe.engine.tensorrt))


def export_streamed_role(recipe: Recipe, role: str, checkpoint, out: Path, step, twin_capacity: int) -> dict[str, Any]:
    """A streamed model's build: bounded parity, the graphs of every flavour written tensor by tensor, the
    bounded validation (the rtx rewrite's at ``twin_capacity`` cache slots). Returns what the manifest and the
    artifacts list need."""
    import torch

    from ssd_trt.engines.editions import DATACENTER, RTX, editions_for
    from ssd_trt.export.block_weights import built_bits
    from ssd_trt.export.bounded_checks import bounded_parity, bounded_validation
    from ssd_trt.export.host_memory import release_freed_memory
    from ssd_trt.export.native_graph import native_flavour
    from ssd_trt.export.onnx_export import save_flavours
    from ssd_trt.export.streamed import export_streamed
    from ssd_trt.export.streamed_fused import export_ort_graph
    from ssd_trt.trt.engine_build import PRECISION_DTYPES

    spec, editions = getattr(recipe, role), editions_for(recipe.engine.tensorrt)
    keep_8bit = spec.activations == "int8"
    bits = built_bits(spec.weights, keep_8bit=keep_8bit)
    file_blocks = spec.weights == "gguf"      # the GGUF file's own blocks (a GGUFCheckpoint)
    step(f"parity {role} (first {spec.check_layers} layers)")
    parity = bounded_parity(checkpoint, spec.check_layers)
    step(f"export {role} (streamed)")
    # rotary rows for every position + 1 spare, as the in-memory build writes them
    max_positions = recipe.engine.max_context + 1
    ort_graph, binding, form = export_ort_graph(checkpoint, out / role, bits, max_positions, file_blocks=file_blocks,
                                                keep_8bit=keep_8bit)
    engine_graph, native = None, None
    if editions:   # the TensorRT flavours: plain weights in the engine precision, in their own file
        dtype = getattr(torch, PRECISION_DTYPES[recipe.engine.trt_precision])
        engine_graph, _ = export_streamed(checkpoint, out / role, "weights.trt.bin", dtype)
        if RTX in editions:
            native = native_flavour(engine_graph, recipe.engine.max_context, checkpoint.config.vocab_size)
    if form == "fused":   # the TensorRT flavours read the traced graph in its own weight file
        paths = save_flavours(engine_graph, out / role, datacenter=DATACENTER in editions, native=native,
                              fused=ort_graph)
    else:
        paths = save_flavours(ort_graph, out / role, engine_graph, datacenter=DATACENTER in editions, native=native)
    del ort_graph, engine_graph, native
    release_freed_memory()
    step(f"validate {role} (first {spec.check_layers} layers)")
    checks = bounded_validation(checkpoint, spec.check_layers, bits, [tuple(s) for s in recipe.validate_shapes],
                                max_positions, min(recipe.engine.max_context, twin_capacity) if RTX in editions else None,
                                file_blocks=file_blocks, keep_8bit=keep_8bit)
    release_freed_memory()
    for name, result in checks.items():
        if not result["passed"]:
            raise SsdTrtError(f"{role}'s streamed {name} graph disagrees with the torch model on its first "
                              f"{spec.check_layers} layers (max abs error {result['max_abs_error']:.3g}); see {out}")
    return {"files": list(paths.items()), "parity": parity, "quantization": binding.quantization,
            "validation": {role: {**checks["ort"], "ort_graph": form},
                           **({f"{role}_rtx": checks["rtx"]} if "rtx" in checks else {})}}


def export_tensor_parallel_role(recipe: Recipe, role: str, checkpoint, out: Path, step, twin_capacity: int
                                ) -> dict[str, Any]:
    """A tensor-parallel model's build: bounded parity, every rank's TensorRT flavours written from the checkpoint
    (``export/tensor_parallel.py``: no ``ort`` flavour, ONNX Runtime having no all-reduce), and the bounded check of
    the rank graphs joined (``export/tensor_parallel_check.py``). Returns what the manifest and the artifacts need."""
    import torch

    from ssd_trt.engines.editions import DATACENTER, RTX, editions_for
    from ssd_trt.export.bounded_checks import bounded_parity
    from ssd_trt.export.host_memory import release_freed_memory
    from ssd_trt.export.native_graph import native_flavour
    from ssd_trt.export.onnx_export import save_engine_flavours
    from ssd_trt.export.tensor_parallel import export_rank_graphs, rank_dir, rank_record
    from ssd_trt.export.tensor_parallel_check import bounded_rank_validation
    from ssd_trt.models.sharding import rank_split
    from ssd_trt.trt.engine_build import PRECISION_DTYPES

    spec, editions, engine = getattr(recipe, role), editions_for(recipe.engine.tensorrt), recipe.engine
    split = rank_split(checkpoint.config, engine.tensor_parallel, f"the {role} {checkpoint.directory}")
    step(f"parity {role} (first {spec.check_layers} layers)")
    parity = bounded_parity(checkpoint, spec.check_layers)
    step(f"export {role} ({split.ranks} tensor-parallel ranks, streamed)")
    dtype = getattr(torch, PRECISION_DTYPES[engine.trt_precision])
    exported = export_rank_graphs(checkpoint, split, out / role, "weights.trt.bin", dtype)
    rank_files = []
    for rank, graph in enumerate(exported.graphs):
        native = native_flavour(graph, engine.max_context, checkpoint.config.vocab_size) if RTX in editions else None
        rank_files.append(save_engine_flavours(graph, rank_dir(out / role, rank), datacenter=DATACENTER in editions,
                                               native=native))
        del native
    markers = exported.markers
    del exported
    release_freed_memory()
    step(f"validate {role} (first {spec.check_layers} layers, {split.ranks} ranks joined)")
    checks = bounded_rank_validation(checkpoint, spec.check_layers, split.ranks,
                                     [tuple(s) for s in recipe.validate_shapes],
                                     min(engine.max_context, twin_capacity) if RTX in editions else None,
                                     traced=DATACENTER in editions)
    release_freed_memory()
    for name, result in checks.items():
        if not result["passed"]:
            raise SsdTrtError(f"{role}'s {split.ranks} tensor-parallel {name} rank graphs, joined with each all-reduce "
                              f"as a sum, disagree with the whole torch model on its first {spec.check_layers} layers "
                              f"(max abs error {result['max_abs_error']:.3g}, ranks agree: {result['ranks_agree']}); "
                              f"see {out}")
    first = checks["rtx"] if "rtx" in checks else checks["trt"]
    return {"files": [(flavour, path) for files in rank_files for flavour, path in files.items()],
            "parity": parity, "quantization": None,
            "validation": {role: {**first, "ort_graph": f"none: {split.ranks} tensor-parallel ranks (TensorRT only)"},
                           **{f"{role}_{name}": result for name, result in checks.items()}},
            "tensor_parallel": rank_record(split, role, rank_files, out, markers)}
