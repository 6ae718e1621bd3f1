"""Build a TensorRT engine from the TensorRT flavour of a step-graph ONNX (GPU host with TensorRT).

Steps: check the ONNX on CPU (binding layout, plugin nodes, precision), register the tree-attention
plugin for the build GPU's SM, parse, add one optimisation profile per step kind (``profiles.py``),
turn on plugin I/O aliasing (in-place caches), build with a persistent timing cache, write the
engine and return its manifest entry. Everything before ``import tensorrt`` is plain Python and is
exercised by the CPU tests; :func:`build_engine` raises :class:`TensorRTUnavailable` with the probe's
reason when TensorRT or a GPU is missing.

Precision. TensorRT >= 11 builds strongly typed networks only (10.x deprecates the weak FP16/BF16
builder flags), so the engine computes in the types the graph declares: the TensorRT-flavour ONNX
must be exported in the recipe's precision (fp16 / bf16 weights and caches). ``check_precision``
refuses a mismatch instead of silently building an fp32 engine.
"""
from __future__ import annotations

import hashlib
import time
from pathlib import Path

import onnx

from plugins.tree_attention.trt_plugin import PLUGIN_ID, PLUGIN_NAME, validate_onnx_node
from ssd_trt.manifest import sha256_file
from ssd_trt.engines.availability import probe_tensorrt
from ssd_trt.engines.bindings import BindingLayout
from ssd_trt.engines.limits import EngineLimits
from ssd_trt.engines.profiles import Profile, derive_profiles

PRECISION_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


class TensorRTUnavailable(RuntimeError):
    """TensorRT or a CUDA device is missing; the message says which."""


def check_precision(layout: BindingLayout, precision: str) -> None:
    """ValueError unless the graph's caches (hence its compute type) match ``precision``."""
    if precision not in PRECISION_DTYPES:
        raise ValueError(f"engine.trt_precision must be one of {sorted(PRECISION_DTYPES)}, got {precision!r}")
    if layout.cache_dtype != PRECISION_DTYPES[precision]:
        raise ValueError(f"the ONNX caches are {layout.cache_dtype} but engine.trt_precision is {precision}: "
                         f"export the TensorRT flavour in {PRECISION_DTYPES[precision]} (TensorRT builds strongly "
                         "typed networks)")


def check_plugin_nodes(model: onnx.ModelProto) -> list[float]:
    """Check every tree_attention node is a bare TensorRT plugin node; return their ``scale`` s.

    The ONNX Runtime flavour (a model-local function named tree_attention) would be inlined by the
    TensorRT parser instead of using the plugin: refuse it with a clear message.
    """
    nodes = [node for node in model.graph.node if node.op_type == PLUGIN_NAME]
    if not nodes:
        raise ValueError(f"the graph has no {PLUGIN_NAME} node: is it a step graph?")
    functions = [f for f in model.functions if f.name == PLUGIN_NAME]
    if functions:
        raise ValueError(f"the graph carries a model-local function {PLUGIN_NAME!r} (the ONNX Runtime flavour); "
                         "TensorRT needs the bare plugin node: export the TensorRT flavour")
    return [validate_onnx_node(node) for node in nodes]


def profile_table(layout: BindingLayout, limits: EngineLimits,
                  ) -> list[tuple[Profile, dict[str, tuple[tuple[int, ...], ...]]]]:
    """Each optimisation profile with the (min, opt, max) shape of every graph input."""
    return [(profile, layout.input_ranges(profile, limits)) for profile in derive_profiles(limits)]



def manifest_entry(out_path: Path, table, precision: str, trt_version: str, sm: int, seconds: float,
                   timing_cache: Path, log_path: Path) -> dict:
    """The manifest record of a built engine."""
    return {
        "path": str(out_path), "sha256": sha256_file(out_path), "bytes": out_path.stat().st_size,
        "precision": precision, "tensorrt_version": trt_version, "sm": sm, "plugin": PLUGIN_ID,
        "build_seconds": round(seconds, 3), "timing_cache": str(timing_cache), "log": str(log_path),
        "profiles": [{"name": profile.name, "batch": list(profile.batch), "tokens": list(profile.tokens),
                      "shapes": {name: [list(shape) for shape in shapes] for name, shapes in ranges.items()}}
                     for profile, ranges in table],
    }


def build_engine(onnx_path: Path, out_path: Path, limits: EngineLimits, precision: str, timing_cache: Path,
                 log_path: Path) -> dict:
    """Build ``out_path`` from the TensorRT-flavour ONNX and return its manifest entry.

    Raises TensorRTUnavailable (no TensorRT / GPU), ValueError (graph or recipe mismatch) or
    RuntimeError (parse or build failure; details in ``log_path``).
    """
    onnx_path, out_path, timing_cache, log_path = map(Path, (onnx_path, out_path, timing_cache, log_path))
    model = onnx.load(str(onnx_path), load_external_data=False)
    layout = BindingLayout.from_onnx(model)
    check_precision(layout, precision)
    check_plugin_nodes(model)
    table = profile_table(layout, limits)
    available, reason = probe_tensorrt()
    if not available:
        raise TensorRTUnavailable(f"cannot build a TensorRT engine here: {reason}")
    return _build_with_tensorrt(onnx_path, out_path, table, precision, timing_cache, log_path)


def _build_with_tensorrt(onnx_path: Path, out_path: Path, table, precision: str, timing_cache: Path,
                         log_path: Path) -> dict:
    import tensorrt as trt
    import torch

    from plugins.tree_attention import trt_plugin

    major, minor = torch.cuda.get_device_capability(0)
    sm = major * 10 + minor
    trt_plugin.register(sm)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log_file:
        logger = _file_logger(trt, log_file)
        builder = trt.Builder(logger)
        flags = 0
        # Strongly typed on 10.x (the flag is deprecated and implied on 11); prefer the AOT plugin path.
        for flag in ("STRONGLY_TYPED", "PREFER_AOT_PYTHON_PLUGINS"):
            if hasattr(trt.NetworkDefinitionCreationFlag, flag):
                flags |= 1 << int(getattr(trt.NetworkDefinitionCreationFlag, flag))
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise RuntimeError(f"TensorRT could not parse {onnx_path}: {errors}")
        config = builder.create_builder_config()
        config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
        for _, ranges in table:
            profile = builder.create_optimization_profile()
            for name, (low, opt, high) in ranges.items():
                profile.set_shape(name, low, opt, high)
            config.add_optimization_profile(profile)
        cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.exists() else b"")
        config.set_timing_cache(cache, ignore_mismatch=False)
        log_file.write(f"[ssd-trt] building {onnx_path} -> {out_path}: sm_{sm}, {precision}, "
                       f"{len(table)} profiles ({', '.join(p.name for p, _ in table)})\n")
        start = time.perf_counter()
        serialized = builder.build_serialized_network(network, config)
        seconds = time.perf_counter() - start
        if serialized is None:
            raise RuntimeError(f"TensorRT failed to build {out_path}; see {log_path}")
        out_path.write_bytes(bytes(serialized))
        timing_cache.parent.mkdir(parents=True, exist_ok=True)
        timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
        log_file.write(f"[ssd-trt] built in {seconds:.1f} s\n")
    return manifest_entry(out_path, table, precision, trt.__version__, sm, seconds, timing_cache, log_path)


def _file_logger(trt, stream):
    """A ``tensorrt.ILogger`` that writes INFO and above to ``stream`` (defined lazily: needs tensorrt)."""

    class FileLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity, msg) -> None:
            if int(severity) <= int(trt.ILogger.Severity.INFO):
                stream.write(f"[{severity.name}] {msg}\n")

    return FileLogger()
