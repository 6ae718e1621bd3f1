"""``python -m ssd_trt.build recipe.yaml``: export draft and target, validate, write the manifest.

Steps (each shown on the progress bar): load weights -> check the pair shares a tokenizer -> compare
logits with transformers -> trace the step graph -> write ONNX (ORT and TensorRT flavours) -> validate
the ORT flavour with Polygraphy -> build TensorRT engines when TensorRT and a GPU are present.
"""
from __future__ import annotations

import json
import platform
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from ssd_trt.arguments import ArgumentParser
from ssd_trt.errors import RecipeError, SsdTrtError
from ssd_trt.kernels.artifact import CPU_TILES_FLAVOUR
from ssd_trt.manifest import MANIFEST_NAME, ROLES, SCHEMA_VERSION, Manifest, artifact_entry, write_manifest
from ssd_trt.recipe import Recipe, load_recipe

TOOLS = ("torch", "onnx", "onnxruntime", "onnxscript", "polygraphy", "transformers", "numpy")


def tool_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {"python": platform.python_version()}
    for tool in TOOLS + ("tensorrt", "tensorrt-rtx-cu13"):
        try:
            versions[tool] = metadata.version(tool)
        except metadata.PackageNotFoundError:
            versions[tool] = None
    return versions


def check_same_tokenizer(target_tok, draft_tok, target_vocab: int, draft_vocab: int) -> None:
    if target_vocab != draft_vocab:
        raise RecipeError(f"draft and target have different vocabularies ({draft_vocab} vs {target_vocab} "
                          f"tokens); speculative decoding needs a draft that shares the target's tokenizer")
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise RecipeError("draft and target tokenizers differ (same size, different token ids); use a draft "
                          "trained with the target's tokenizer")


def role_tokenizer(recipe: Recipe, role: str, sources: dict, bases: tuple, target_tokenizer=None):
    """The role's tokenizer: the target's when the draft declares it shared (``tokenizer: target``) or is a feature
    draft (it reads the target's embedding); else loaded from the recipe's tokenizer source or the model's."""
    from ssd_trt.models.loading import load_tokenizer
    from ssd_trt.models.sources import resolve_source
    from ssd_trt.export.model_kinds import model_kind
    named = getattr(recipe, role).tokenizer
    if role == "draft" and (named == "target" or model_kind(recipe, role).shares_target_tokenizer):
        return target_tokenizer       # declared shared; vocab sizes are still checked (write_tokenizer)
    return load_tokenizer(resolve_source(named, bases) if named else sources[role])


def write_tokenizer(tokenizers: dict, configs: dict, out: Path) -> tuple[list[dict], dict]:
    """Check the pair shares one tokenizer and save the target's as ``out/tokenizer``: (its artifacts, the
    manifest's tokenizer entry)."""
    check_same_tokenizer(tokenizers["target"], tokenizers["draft"], configs["target"].vocab_size,
                         configs["draft"].vocab_size)
    tokenizer_dir = out / "tokenizer"
    tokenizers["target"].save_pretrained(tokenizer_dir)
    artifacts = [{"role": "tokenizer", **artifact_entry(out, p)} for p in sorted(tokenizer_dir.iterdir())]
    return artifacts, {"dir": "tokenizer", "vocab_size": configs["target"].vocab_size,
                       "chat_template": getattr(tokenizers["target"], "chat_template", None) is not None}


BUILDING_MARKER = ".building"   # names the recipe of a build in progress (or interrupted)


def _owner(out: Path) -> str | None:
    """The recipe whose artifacts ``out`` holds: from the manifest, else an in-progress marker."""
    manifest, marker = out / MANIFEST_NAME, out / BUILDING_MARKER
    if manifest.is_file():     # a name, even from a manifest this version cannot read (so it is rebuilt)
        try:
            return json.loads(manifest.read_text()).get("recipe", {}).get("name")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            return "<unreadable manifest>"
    if marker.is_file():
        return marker.read_text().strip() or "<unknown>"
    if out.is_dir() and any(out.iterdir()):
        return "<unknown: files without a manifest>"
    return None


def prepare_output_dir(out: Path, recipe: Recipe, force: bool) -> None:
    """Refuse to mix artifacts of two recipes in one directory unless --force (which clears it)."""
    previous = _owner(out)
    if previous is not None and previous != recipe.name and not force:
        raise RecipeError(f"{out} holds artifacts of recipe {previous!r}, not {recipe.name!r}; choose "
                          f"another output_dir or pass --force to replace them")
    if out.exists() and force:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / BUILDING_MARKER).write_text(recipe.name)
    (out / MANIFEST_NAME).unlink(missing_ok=True)  # a half-finished build never looks complete


def stale_reason(recipe_path: Path, root: Path | None = None) -> str | None:
    """Why the recipe's build dir does not match the recipe and its model files (None: it does).

    Compares the recipe as validated now and a fingerprint of each model source with what the
    manifest recorded, so a retrained draft or an edited recipe is never run from an old build.
    """
    from ssd_trt.manifest import read_manifest
    from ssd_trt.models.sources import resolve_source, source_fingerprint

    recipe = load_recipe(recipe_path)
    root = root or Path.cwd()
    out = recipe.resolved_output_dir(root)
    if _owner(out) is None:
        return f"nothing has been built in {out} yet"
    if not (out / MANIFEST_NAME).is_file():
        return f"{out} holds an unfinished build (interrupted before its manifest.json was written)"
    try:
        manifest = read_manifest(out)
    except SsdTrtError as error:
        return str(error)
    if manifest.recipe != recipe:
        return f"{out} was built from a different version of recipe {recipe.name!r}"
    bases = (recipe_path.parent.resolve(), root)
    for role in ROLES:
        fingerprint = source_fingerprint(resolve_source(getattr(recipe, role).source, bases))
        if manifest.model(role).source_sha256 != fingerprint:
            return f"the {role} model files changed since {out} was built"
    return _missing_plans(recipe, manifest)


def _missing_plans(recipe: Recipe, manifest) -> str | None:
    """Why a build made without TensorRT for RTX is stale once it is installed (its plans need no GPU)."""
    from ssd_trt.engines.editions import RTX, editions_for
    if recipe.engine.backend in ("ort", "torch") or RTX not in editions_for(recipe.engine.tensorrt) \
            or manifest.tensorrt.plans:
        return None
    if RTX.installed():
        return (f"TensorRT for RTX ({RTX.module}) is installed now and the build has no plans "
                f"({manifest.tensorrt.status}: {manifest.tensorrt.reason})")
    return None


def build(recipe_path: Path, force: bool = False, root: Path | None = None, host_bytes: int | None = None) -> Path:
    """Export, validate and (where TensorRT can) compile the recipe's pair; returns the build directory.

    ``host_bytes``: plan against this much host memory instead of what the machine has available now."""
    from tqdm import tqdm

    recipe = load_recipe(recipe_path)    # a bad recipe is told at once, before seconds of importing torch
    from ssd_trt.models.loading import transformers_progress_bars_off
    bar = tqdm(BUILD_STEPS, desc="build", unit="step", file=sys.stderr)   # made before third-party bars go quiet
    with transformers_progress_bars_off():
        try:
            return _build(recipe, recipe_path, force, root, bar, host_bytes)
        finally:
            bar.close()


BUILD_STEPS = ["load target", "load draft", "tokenizer", "parity target", "parity draft", "export target",
               "export draft", "validate target", "validate draft", "tensorrt"]


def _build(recipe: Recipe, recipe_path: Path, force: bool, root: Path | None, bar,
           host_bytes: int | None = None) -> Path:

    from ssd_trt.export.block_weights import apply_block_weights, model_block_weights
    from ssd_trt.export.host_memory import peak_rss_bytes, release_freed_memory
    from ssd_trt.export.fused_graph import fused_step_graph, unsupported_reason
    from ssd_trt.export.native_graph import native_flavour
    from ssd_trt.export.model_kinds import model_kind
    from ssd_trt.export.onnx_export import save_flavours
    from ssd_trt.models.sources import resolve_source, source_fingerprint
    from ssd_trt.trt.build_step import maybe_build_engines
    from ssd_trt.engines.editions import DATACENTER, RTX, editions_for

    root = root or Path.cwd()
    out = recipe.resolved_output_dir(root)
    bases = (recipe_path.parent.resolve(), root)
    sources = {role: resolve_source(getattr(recipe, role).source, bases) for role in ROLES}
    if recipe.engine.backend == "torch":
        return build_for_torch(recipe, recipe_path, sources, out, force, bases, bar)
    from ssd_trt.export.streamed_build import export_streamed_role, export_tensor_parallel_role, plan_exports
    streamed, host_memory = plan_exports(recipe, sources, host_bytes)
    prepare_output_dir(out, recipe, force)
    started = time.time()
    models, hf_configs, tokenizers, parity, validation, artifacts = {}, {}, {}, {}, {}, []
    quantization: dict[str, dict] = {}
    tensor_parallel = None                # the target's split over ranks (engine.tensor_parallel > 1)
    native_twins: dict[str, Any] = {}     # the rtx flavour's fp32 twin per role, for validation
    ort_graph: dict[str, str] = {}        # per role: "fused", or why the ort flavour is the traced graph

    def step(name: str) -> None:
        bar.set_postfix_str(name)

    kinds = {role: model_kind(recipe, role) for role in ROLES}
    for role in ROLES:
        step(f"load {role}")
        if role in streamed:   # nothing is loaded: the checkpoint is read tensor by tensor at export
            models[role], hf_configs[role] = None, streamed[role].hf_config
        else:
            models[role], hf_configs[role] = kinds[role].load(sources[role], models.get("target"))
        if role == "draft" and role not in streamed:
            models["target"] = kinds[role].with_target(models["target"], models[role])
        if role == "draft":   # a malformed copy component fails the build, not the first request
            from ssd_trt.engines.copy_mixture import CopyMixture
            CopyMixture.from_config(hf_configs[role], where=f"{sources[role].path}/config.json")
        tokenizers[role] = role_tokenizer(recipe, role, sources, bases, tokenizers.get("target"))
        bar.update()
    configs = {role: streamed[role].config if role in streamed else decoder_config(models[role]) for role in ROLES}
    step("tokenizer")
    tokenizer_artifacts, tokenizer_entry = write_tokenizer(tokenizers, configs, out)
    artifacts += tokenizer_artifacts
    bar.update()
    for role in streamed:   # parity, export and validation, bounded, in one pass per model
        split = role == "target" and recipe.engine.tensor_parallel > 1
        export = export_tensor_parallel_role if split else export_streamed_role
        done = export(recipe, role, streamed[role], out, step, TWIN_CAPACITY)
        parity[role], quantization[role] = done["parity"], done["quantization"]
        validation.update(done["validation"])
        tensor_parallel = done.get("tensor_parallel", tensor_parallel)
        artifacts += [{"role": role, "flavour": flavour, **artifact_entry(out, path)} for flavour, path in done["files"]]
        bar.update(3)
    in_memory = [role for role in ROLES if role not in streamed]
    for role in in_memory:
        step(f"parity {role}")
        parity[role] = kinds[role].parity(models[role], sources[role])
        bar.update()
    for role in in_memory:
        step(f"export {role}")
        trace = kinds[role].trace
        blocks = model_block_weights(getattr(recipe, role).weights, sources[role], models[role],
                                     keep_8bit=getattr(recipe, role).activations == "int8")
        traced = trace(models[role])
        if blocks:
            traced, quantization[role] = apply_block_weights(traced, blocks)
        precision, editions = recipe.engine.trt_precision, editions_for(recipe.engine.tensorrt)
        trt_traced = None if precision == "fp32" or not editions else trace(half_copy(models[role], precision))
        native = None
        if RTX in editions:   # plain weights in the engine precision (block weights are ONNX Runtime's)
            capacity, vocab = recipe.engine.max_context, decoder_config(models[role]).vocab_size
            plain = trace(models[role]) if blocks else traced
            native_twins[role] = native_flavour(plain, min(capacity, TWIN_CAPACITY), vocab)
            native = native_flavour(plain if trt_traced is None else trt_traced, capacity, vocab)
        # the ort flavour on fused ops where they cover the model; rotary rows for every position + 1 spare
        ort_graph[role] = unsupported_reason(models[role]) or "fused"
        fused = fused_step_graph(models[role], blocks, recipe.engine.max_context + 1) \
            if ort_graph[role] == "fused" else None
        paths = save_flavours(traced, out / role, trt_traced, datacenter=DATACENTER in editions, native=native,
                              fused=fused)
        del fused
        for flavour, path in paths.items():
            artifacts.append({"role": role, "flavour": flavour, **artifact_entry(out, path)})
        bar.update()
    for role in in_memory:
        step(f"validate {role}")
        validate = kinds[role].validate
        shapes = [tuple(s) for s in recipe.validate_shapes]
        # the decoder graphs checked as the engine runs them: caches written in place
        in_place = {"in_place": True} if kinds[role].validate_in_place else {}
        validation[role] = {**validate(models[role], out / role / "model.ort.onnx", shapes, **in_place),
                            "ort_graph": ort_graph[role]}
        if not validation[role]["passed"]:
            raise SsdTrtError(f"{role} ONNX graph disagrees with the torch model "
                              f"(max abs error {validation[role]['max_abs_error']:.3g}); see {out}")
        if role in native_twins:
            validation[f"{role}_rtx"] = validate_native(models[role], native_twins.pop(role),
                                                        out / role / "model.rtx.onnx", recipe, validate)
        bar.update()
    for role in ROLES:
        step(f"cpu tiles {role}")
        files, validation[f"{role}_cpu_tiles"] = cpu_tiles(recipe, role, sources[role], configs[role], out)
        artifacts += [{"role": role, "flavour": CPU_TILES_FLAVOUR, **artifact_entry(out, path)} for path in files]
    step("tensorrt")
    reduced_heads = {role: _reduced_head(models[role], configs[role]) for role in ROLES}
    del models, native_twins
    release_freed_memory()      # TensorRT's builder holds the weights twice: start it from a trimmed heap
    tensorrt = maybe_build_engines(recipe, out)
    artifacts += tensorrt.pop("artifacts", [])
    bar.update()
    manifest = Manifest(
        schema_version=SCHEMA_VERSION, recipe=recipe, recipe_path=str(recipe_path),
        models={role: {"config": configs[role], "hf_config": _jsonable(hf_configs[role]),
                       "source": str(sources[role].path), "source_sha256": source_fingerprint(sources[role]),
                       "parity_vs_transformers": parity[role], "quantization": quantization.get(role),
                       "head_token_ids": "embedded in weights" if reduced_heads[role] else None}
                for role in ROLES},
        tokenizer=tokenizer_entry, artifacts=artifacts, validation=validation, tensorrt=tensorrt, tools=tool_versions(),
        build_seconds=round(time.time() - started, 1),
        host_memory={**host_memory, "peak_rss_bytes": peak_rss_bytes()}, tensor_parallel=tensor_parallel)
    write_manifest(out, manifest)
    (out / BUILDING_MARKER).unlink(missing_ok=True)
    return out


def cpu_tiles(recipe: Recipe, role: str, source, config, out: Path) -> tuple[list[Path], dict]:
    """The CPU kernel's artifact of a ``weights: gguf`` / ``activations: int8`` model (``kernels/artifact.py``), and
    what the build says of it: written, checked against the ONNX Runtime graph, or why not."""
    from ssd_trt.kernels.artifact import unsupported_reason, write_cpu_tiles
    spec = getattr(recipe, role)
    if spec.weights != "gguf" or spec.activations != "int8" or source.kind != "gguf":
        return [], {"written": False, "reason": "the CPU kernel reads a GGUF file's blocks with int8 activations "
                                                "(weights: gguf, activations: int8)"}
    reason = unsupported_reason(config, feature_layers=role == "target" and recipe.draft.kind == "eagle3")
    if reason:
        return [], {"written": False, "reason": f"the native step does not cover {reason}"}
    try:
        files = write_cpu_tiles(source.path, config, out / role, recipe.engine.max_context + 1)
    except ValueError as exc:
        return [], {"written": False, "reason": str(exc)}
    return files, {"written": True, **check_cpu_tiles(out / role, config, recipe.engine.max_context)}


def check_cpu_tiles(folder: Path, config, max_context: int) -> dict:
    """The native step against the role's ONNX Runtime graph (int8 activations both, quantized differently) on one
    fixed sequence: the largest logit difference and how often the two agree on the top token. A wrong tile (a
    permuted head, a misread field) shows as disagreement on most tokens: the build stops then."""
    from ssd_trt.engines.base import EngineSpec
    from ssd_trt.engines.kernel_engine import KernelEngine
    from ssd_trt.engines.ort import OrtEngine
    from ssd_trt.kernels.artifact import load_cpu_tiles
    from ssd_trt.kernels.build import KernelBuildError
    spec = EngineSpec(name=folder.name, vocab_size=config.vocab_size, num_layers=config.num_layers,
                      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, max_batch=1, max_context=max_context)
    try:
        native = KernelEngine(load_cpu_tiles(folder), spec)
    except (KernelBuildError, ValueError) as exc:
        return {"checked": False, "reason": f"the kernel cannot run here: {exc}"}
    import numpy as np
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (1, 32))
    logits = []
    for engine in (native, OrtEngine(folder / "model.ort.onnx", spec, int8_activations=True)):
        engine.reset(1)
        logits.append(engine.forward(ids, np.arange(ids.shape[1])[None])[0])
    native.close()
    agree = float((logits[0].argmax(-1) == logits[1].argmax(-1)).mean())
    result = {"checked": True, "max_abs_difference_vs_ort": float(np.abs(logits[0] - logits[1]).max()),
              "top1_agreement_vs_ort": round(agree, 3)}
    if agree < 0.5:
        raise SsdTrtError(f"{folder}: the CPU kernel's logits disagree with the ONNX Runtime graph's on "
                          f"{1 - agree:.0%} "
                          f"of the check's tokens ({result}); the GGUF's layout is not one the tiles read right")
    return result


def build_for_torch(recipe: Recipe, recipe_path: Path, sources: dict, out: Path, force: bool, bases: tuple,
                    bar) -> Path:
    """A build for the torch GPU runtime, which runs the checkpoints themselves: no ONNX, no plans. Each
    checkpoint (HF safetensors, or a GGUF file: the runtime dequantizes it to the recipe's dtype as it loads) is
    opened and checked (shards, dtypes, names and shapes against its config), its first layers compared with
    transformers (``bounded_checks``), the tokenizers checked as for any build, and every model file recorded with
    its sha256 (the runtime refuses a file that changed)."""
    from ssd_trt.export.bounded_checks import bounded_parity
    from ssd_trt.export.host_memory import peak_rss_bytes
    from ssd_trt.models.checkpoint import Checkpoint
    from ssd_trt.models.sources import source_file_hashes, source_fingerprint

    if recipe.draft.kind == "eagle3":
        raise RecipeError("engine.backend: torch builds from the checkpoints of two independent models, but the "
                          "draft is an EAGLE-3 head; use engine.backend: auto for this pair")

    def open_checkpoint(source) -> Checkpoint:
        if source.kind == "gguf":
            from ssd_trt.models.gguf_checkpoint import GGUFCheckpoint
            return GGUFCheckpoint.open(source.path)
        return Checkpoint.open(source.path)
    checkpoints = {role: open_checkpoint(sources[role]) for role in ROLES}
    if recipe.engine.tensor_parallel > 1:   # the runtime splits the target as it loads it: the split must exist
        from ssd_trt.models.sharding import rank_split
        rank_split(checkpoints["target"].config, recipe.engine.tensor_parallel, f"the target {sources['target'].path}")
    prepare_output_dir(out, recipe, force)
    started = time.time()
    tokenizers, models = {}, {}
    for role in ROLES:
        bar.set_postfix_str(f"check {role}")
        tokenizers[role] = role_tokenizer(recipe, role, sources, bases, tokenizers.get("target"))
        hashes = source_file_hashes(sources[role])
        models[role] = {"config": checkpoints[role].config, "hf_config": _jsonable(checkpoints[role].hf_config),
                        "source": str(sources[role].path), "source_sha256": source_fingerprint(sources[role], hashes),
                        "source_files": hashes,
                        "parity_vs_transformers": bounded_parity(checkpoints[role], getattr(recipe, role).check_layers),
                        "head_token_ids": "embedded in weights" if checkpoints[role].config.head_vocab_size else None}
        bar.update(4)
    from ssd_trt.engines.copy_mixture import CopyMixture   # a malformed copy component fails here, not at a request
    CopyMixture.from_config(checkpoints["draft"].hf_config, where=f"{sources['draft'].path}/config.json")
    artifacts, tokenizer_entry = write_tokenizer(tokenizers, {role: checkpoints[role].config for role in ROLES}, out)
    bar.update(bar.total - bar.n)
    write_manifest(out, Manifest(
        schema_version=SCHEMA_VERSION, recipe=recipe, recipe_path=str(recipe_path), models=models,
        tokenizer=tokenizer_entry, artifacts=artifacts, validation={},
        tensorrt={"status": "skipped", "reason": "engine.backend: torch (the checkpoints run as they are)",
                  "plans": []},
        tools=tool_versions(), build_seconds=round(time.time() - started, 1),
        host_memory={"exports": {role: {"path": "none (torch backend)"} for role in ROLES},
                     "peak_rss_bytes": peak_rss_bytes()}))
    (out / BUILDING_MARKER).unlink(missing_ok=True)
    return out


def _reduced_head(model, config) -> bool:
    """Whether the model's head covers a subset of the vocabulary (its token ids are in the weights)."""
    if model is None:     # streamed: the config says
        return config.head_vocab_size is not None
    return getattr(model, "lm_head_token_ids", None) is not None


def decoder_config(model):
    """The decoder config the manifest records: a feature draft's is its one layer's (same vocabulary)."""
    layer = getattr(model.config, "layer", None)
    return model.config if layer is None else layer


# The fp32 twin is checked at a short cache: the rewrite does not depend on the capacity (only a static
# dimension changes, and the node sequence is compared with the saved graph's); a max_context-long random
# cache would only make each checked step slower.
TWIN_CAPACITY = 64


def validate_native(model, twin, saved: Path, recipe: Recipe, validate) -> dict:
    """The rtx flavour (native attention) checked in ONNX Runtime against the torch model (``twin``: an
    onnx.ModelProto).

    Checked through its fp32 twin (the same rewrite of the fp32 trace, at a short static capacity) with the
    ORT flavour's tolerance, and the saved graph in the engine precision must have the twin's exact node
    sequence. The engine precision's own rounding is not what this checks: fp16 overflows on models with
    large activations (SmolLM2's residual stream reaches 2.5e4, so x^2 in RMSNorm exceeds fp16's 6.6e4:
    docs/tensorrt.md), which is why the embedded default's plans are bf16.
    """
    import tempfile

    import onnx
    engine_graph = onnx.load(str(saved), load_external_data=False)
    same_nodes = [n.op_type for n in engine_graph.graph.node] == [n.op_type for n in twin.graph.node]
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "model.rtx.fp32.onnx"
        onnx.save_model(twin, path, save_as_external_data=True, location="weights.bin")
        result = validate(model, path, [tuple(s) for s in recipe.validate_shapes],
                          capacity=min(recipe.engine.max_context, TWIN_CAPACITY))
    if not (result["passed"] and same_nodes):
        raise SsdTrtError(f"the TensorRT for RTX flavour {saved} is wrong for this model: its fp32 twin disagrees "
                          f"with the torch model in ONNX Runtime (max abs error {result['max_abs_error']:.3g})"
                          + ("" if same_nodes else " and the saved graph's nodes differ from the twin's")
                          + ": see export/native_graph.py")
    return {**result, "checked_as": "fp32 twin of the same rewrite", "same_nodes_as_twin": same_nodes}


def half_copy(model, precision: str):
    """The model in the TensorRT precision (TensorRT 10+/11 builds strongly typed from the ONNX types)."""
    import copy

    import torch
    return copy.deepcopy(model).to({"fp16": torch.float16, "bf16": torch.bfloat16}[precision])


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def main(argv: list[str] | None = None) -> int:
    from ssd_trt.sizing.cli import CONFIGS_HELP, EPILOG, GPU_MEMORY_HELP
    parser = ArgumentParser(prog="python -m ssd_trt.build", description=__doc__.splitlines()[0],
                            epilog=f"--plan's {EPILOG}")
    parser.add_argument("recipe", type=Path, help="recipe YAML, e.g. recipes/smollm2-135m.yaml")
    parser.add_argument("--force", action="store_true", help="replace an output dir built from another recipe")
    parser.add_argument("--if-stale", action="store_true",
                        help="build only when the output dir is missing or does not match the recipe and its "
                             "model files (what scripts use, so a retrained draft is always rebuilt)")
    parser.add_argument("--host-memory", type=float, metavar="GIB",
                        help="plan against this much host memory (GiB) instead of what this machine has available "
                             "now: checks before any work whether a recipe fits a build host")
    parser.add_argument("--tune", action="store_true",
                        help="then choose the build's decoding defaults by measurement on this machine (python -m "
                             "ssd_trt.tune --if-missing: a few minutes; recorded in the manifest)")
    parser.add_argument("--plan", action="store_true",
                        help="read no weights and build nothing: print each GPU's memory (every target rank, the "
                             "draft) from the recipe and the models' config.json, whether it fits, and the recipe "
                             "changes that would (docs/tensor_parallel.md)")
    parser.add_argument("--gpu-memory", type=float, metavar="GIB", help=f"with --plan: {GPU_MEMORY_HELP}")
    parser.add_argument("--configs", type=Path, metavar="DIR", help=f"with --plan: {CONFIGS_HELP}")
    parser.add_argument("--json", action="store_true", help="with --plan: print the plan as JSON")
    args = parser.parse_args(argv)
    if args.plan:
        from ssd_trt.sizing.cli import run
        return run([args.recipe], args.gpu_memory, args.configs, args.json)
    if args.gpu_memory is not None or args.configs is not None or args.json:
        parser.error("--gpu-memory, --configs and --json go with --plan")
    host_bytes = None if args.host_memory is None else int(args.host_memory * (1 << 30))
    try:
        if args.if_stale:
            target = load_recipe(args.recipe).resolved_output_dir(Path.cwd())
            if _owner(target) is None:
                print(f"building {target}: first build of this recipe here (takes a few minutes)", file=sys.stderr)
            elif (reason := stale_reason(args.recipe)) is None:
                print(f"{target} is up to date")
                return _tune(target) if args.tune else 0
            else:
                print(f"rebuilding: {reason}", file=sys.stderr)
        out = build(args.recipe, force=args.force, host_bytes=host_bytes)
    except SsdTrtError as error:
        print(f"ssd_trt.build: error: {error}", file=sys.stderr)
        return 2
    from ssd_trt.manifest import read_manifest
    manifest = read_manifest(out)
    print(f"built {out}")
    for role in ROLES:
        p, v = manifest.model(role).parity_vs_transformers, manifest.validation.get(role)
        parity = (f"logits vs {p['reference']}: max |diff| {p['max_abs_diff']:.2e}" if p.get("max_abs_diff") is not None
                  else f"no transformers reference ({p.get('reason', 'not measured')})")
        q = manifest.model(role).quantization
        built = q and any(kind.endswith("(built)") for kind in q["kinds"])
        weights = (f"; {q['layers']} layers as {', '.join(q['kinds'])} blocks"
                   + (" (the parity above is of the float weights, before quantization)" if built else "")) if q else ""
        graph = ("no ONNX graph (torch backend)" if v is None else f"ONNX vs torch ({len(v['shapes'])} step shapes): "
                 f"{'passed' if v['passed'] else 'FAILED'}, max abs err {v['max_abs_error']:.2e}"
                 + (f"; ort graph: {v['ort_graph']}" if v.get("ort_graph") else ""))
        print(f"  {role}: {parity}{weights}; {graph}")
    print(f"  tensorrt: {manifest.tensorrt.status}: {manifest.tensorrt.reason}")
    for plan in manifest.tensorrt.plans:
        print(f"    {plan.role}: {plan.path} ({plan.bytes / 2**20:.0f} MiB, {plan.edition} {plan.tensorrt_version}, "
              f"{plan.precision}, {', '.join(plan.compute_capabilities)}, {len(plan.profiles)} profiles, "
              f"built in {plan.build_seconds:.1f} s)")
    return _tune(out) if args.tune else 0


def _tune(out: Path) -> int:
    from ssd_trt.tune import main as tune
    return tune([str(out), "--if-missing"])


if __name__ == "__main__":
    sys.exit(main())
