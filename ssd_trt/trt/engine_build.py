"""Build a TensorRT plan from a step-graph ONNX, with either edition (``editions.py``).

Steps: check the ONNX on CPU (binding layout, the flavour the edition needs, precision, that the
optimisation profiles cover every step shape the runtime issues), then with TensorRT: (data-centre:
register the tree-attention plugin for the build GPU's SM) parse, (RTX fp32: mark attention
decomposable), one optimisation profile per step kind (``profiles.py``), the edition's settings (RTX:
the recipe's compute capabilities and user-allocated memory, which stream capture needs; data-centre:
in-place plugin I/O and a persistent timing cache), build, write the plan and return its manifest entry
(``manifest.PlanEntry``). Everything before the TensorRT import is plain Python exercised by the CPU tests;
:func:`build_engine` raises :class:`TensorRTUnavailable` with the probe's reason when the edition cannot build here
(data-centre: TensorRT or a GPU missing; RTX: ``tensorrt_rtx`` not installed).

Precision. Both editions build strongly typed networks, so the plan computes in the types the graph
declares: the TensorRT flavours are exported in the recipe's precision (fp16 / bf16 weights and caches).
``check_precision`` refuses a mismatch instead of silently building an fp32 engine.
"""
from __future__ import annotations

import time
from pathlib import Path

import onnx

from ssd_trt_plugins.tree_attention.trt_plugin import PLUGIN_NAME, validate_onnx_node
from ssd_trt.manifest import sha256_file
from ssd_trt.engines.availability import probe_tensorrt
from ssd_trt.engines.bindings import BindingLayout
from ssd_trt.engines.limits import EngineLimits
from ssd_trt.engines.profiles import Profile, derive_profiles, select_profile
from ssd_trt.engines.editions import DATACENTER, RTX, Edition, configure, network_flags, prepare_network

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


def check_native_nodes(model: onnx.ModelProto) -> int:
    """Check the graph is the ``rtx`` flavour (native attention, no plugin node); return its attention count."""
    if any(node.op_type in (PLUGIN_NAME, "tree_attention_masked") for node in model.graph.node):
        raise ValueError(f"the graph has {PLUGIN_NAME} nodes (the data-centre plugin or ONNX Runtime flavour); "
                         "TensorRT for RTX takes no plugins: build from the rtx flavour, model.rtx.onnx "
                         "(export/native_graph.py)")
    count = sum(node.op_type == "Attention" for node in model.graph.node)
    if count == 0:
        raise ValueError("the graph has no ONNX Attention node: is it the rtx flavour of a step graph?")
    return count


def check_graph(edition: Edition, model: onnx.ModelProto) -> None:
    """The flavour each edition builds from: the plugin node (data-centre) or native attention (RTX)."""
    if edition is DATACENTER:
        check_plugin_nodes(model)
    else:
        check_native_nodes(model)


def runtime_step_shapes(limits: EngineLimits) -> list[tuple[str, int, int]]:
    """(kind, batch, new tokens) of every step shape the runtime can issue, at the batch extremes."""
    shapes = []
    for batch in sorted({1, limits.max_batch}):
        shapes += [("decode", batch, 1)]
        shapes += [("verify", batch, k + 1) for k in range(1, limits.max_draft_len + 1)]
        shapes += [("tree", batch, n) for n in range(2, limits.max_tree_size + 1)]
        shapes += [("prefill", batch, t) for t in (1, limits.max_context)]
    return shapes


def check_coverage(profiles: tuple[Profile, ...], limits: EngineLimits) -> None:
    """ValueError naming the first runtime step shape no optimisation profile accepts."""
    for kind, batch, tokens in runtime_step_shapes(limits):
        try:
            select_profile(profiles, batch, tokens)
        except ValueError:
            ranges = ", ".join(f"{p.name} batch {p.batch[0]}-{p.batch[2]} x T {p.tokens[0]}-{p.tokens[2]}"
                               for p in profiles)
            raise ValueError(f"the optimisation profiles ({ranges}) do not cover a {kind} step of batch {batch} x "
                             f"{tokens} new tokens, which the runtime issues under engine limits {limits}: the "
                             "plan could not run it; derive the profiles from the recipe's limits "
                             "(engines/profiles.py)") from None


def profile_table(layout: BindingLayout, limits: EngineLimits, profiles: tuple[Profile, ...] | None = None,
                  ) -> list[tuple[Profile, dict[str, tuple[tuple[int, ...], ...]]]]:
    """Each optimisation profile (derived from the limits unless given) with the (min, opt, max) shape of
    every graph input."""
    profiles = derive_profiles(limits) if profiles is None else profiles
    check_coverage(profiles, limits)
    return [(profile, layout.input_ranges(profile, limits)) for profile in profiles]



def manifest_entry(edition: Edition, role: str, root: Path, out_path: Path, onnx_path: Path, table,
                   precision: str, trt_version: str, capabilities: tuple[str, ...], seconds: float,
                   recipe_sha256: str, log_path: Path, decomposable: int = 0, rank: int | None = None,
                   collectives: int = 0) -> dict:
    """The manifest record of a built plan (``manifest.PlanEntry``); a tensor-parallel rank's says which rank and
    how many all-reduce layers it holds."""
    ranked = {} if rank is None else {"rank": rank, "collective_layers": collectives}
    return {
        "role": role, "edition": edition.name, "tensorrt_version": trt_version,
        "path": out_path.relative_to(root).as_posix(), "sha256": sha256_file(out_path),
        "bytes": out_path.stat().st_size, "onnx": onnx_path.relative_to(root).as_posix(), "precision": precision,
        "compute_capabilities": list(capabilities), "recipe_sha256": recipe_sha256,
        "build_seconds": round(seconds, 3), "decomposable_attention_layers": decomposable,
        "log": log_path.relative_to(root).as_posix(),
        "profiles": [{"name": profile.name, "batch": list(profile.batch), "tokens": list(profile.tokens),
                      "shapes": {name: [list(shape) for shape in shapes] for name, shapes in ranges.items()}}
                     for profile, ranges in table],
        **ranked,
    }


def check_markers(model: onnx.ModelProto, num_ranks: int) -> int:
    """The all-reduce markers the graph must have for ``num_ranks`` (none for a whole model; two per attention
    layer for a rank's: after o_proj and after down_proj); returns how many. ValueError otherwise."""
    from ssd_trt.models.sharding import marker_nodes
    markers = len(marker_nodes(model))
    layers = sum(node.op_type in ("Attention", PLUGIN_NAME) for node in model.graph.node)
    if num_ranks == 1 and markers:
        raise ValueError(f"the graph is a tensor-parallel rank's ({markers} all-reduce markers) but the plan is built "
                         "for one rank: its markers would pass partial sums on as if whole")
    if num_ranks > 1 and markers != 2 * layers:
        raise ValueError(f"a rank graph for {num_ranks} ranks needs 2 all-reduce markers per decoder layer "
                         f"({2 * layers}), the graph has {markers}: export it with export/tensor_parallel.py")
    return markers


def build_engine(edition: Edition, role: str, root: Path, limits: EngineLimits, precision: str,
                 capabilities: tuple[str, ...], recipe_sha256: str,
                 profiles: tuple[Profile, ...] | None = None, rank: int | None = None, num_ranks: int = 1) -> dict:
    """Build ``<root>/<role>/<edition.plan_file>`` from the edition's flavour and return its manifest entry; with
    ``rank``, tensor-parallel rank ``rank`` of ``num_ranks``'s plan from ``<root>/<role>/rank<rank>/``, its
    all-reduce markers replaced by the native collective (``collectives.py``).

    Raises TensorRTUnavailable (the edition cannot build here), ValueError (graph or recipe mismatch,
    profiles that miss a runtime step shape) or RuntimeError (parse or build failure; details in the log).
    """
    root = Path(root)
    folder = root / role if rank is None else root / role / f"rank{rank}"
    onnx_path = folder / f"model.{edition.flavour}.onnx"
    out_path, log_path = folder / edition.plan_file, folder / f"build.{edition.name}.log"
    model = onnx.load(str(onnx_path), load_external_data=False)
    layout = BindingLayout.from_onnx(model)
    check_precision(layout, precision)
    check_graph(edition, model)
    markers = check_markers(model, num_ranks)
    table = profile_table(layout, limits, profiles)
    if edition is RTX:
        from ssd_trt.engines.availability import probe_tensorrt_rtx
        probe = probe_tensorrt_rtx()
        available, reason = probe["build"], probe["reason"]
    else:
        available, reason = probe_tensorrt()
        capabilities = ()          # the build GPU's own, read below
    if not available:
        raise TensorRTUnavailable(f"cannot build a {edition.name} TensorRT plan here: {reason}")
    return _build_with_tensorrt(edition, role, root, onnx_path, out_path, log_path, table, precision, capabilities,
                                recipe_sha256, rank, num_ranks, markers)


def _build_with_tensorrt(edition: Edition, role: str, root: Path, onnx_path: Path, out_path: Path, log_path: Path,
                         table, precision: str, capabilities: tuple[str, ...], recipe_sha256: str,
                         rank: int | None = None, num_ranks: int = 1, markers: int = 0) -> dict:
    trt = edition.import_module()
    timing_cache = root / "timing.cache"
    if edition is DATACENTER:
        import torch

        from ssd_trt_plugins.tree_attention import trt_plugin
        major, minor = torch.cuda.get_device_capability(0)
        capabilities = (f"sm{major}{minor}",)
        trt_plugin.register(major * 10 + minor)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log_file:
        logger = _file_logger(trt, log_file)
        builder = trt.Builder(logger)
        network = builder.create_network(network_flags(trt))
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(onnx_path)):
            errors = "; ".join(str(parser.get_error(i)).splitlines()[0] for i in range(parser.num_errors))
            raise RuntimeError(f"{edition.module} could not parse {onnx_path}: {errors} (log: {log_path})")
        decomposable = prepare_network(edition, trt, network, precision)
        collectives = 0
        if num_ranks > 1:      # the same rewiring for both editions: one network API
            from ssd_trt.trt.collectives import count_collectives, insert_all_reduces
            insert_all_reduces(trt, network, num_ranks)
            collectives = count_collectives(trt, network)
            if collectives != markers:
                raise RuntimeError(f"{onnx_path} has {markers} all-reduce markers but its parsed network got "
                                   f"{collectives} all-reduce layers (log: {log_path})")
            log_file.write(f"[ssd-trt] rank {rank} of {num_ranks}: {collectives} all-reduce layers in place of the "
                           "graph's markers\n")
        config = builder.create_builder_config()
        configure(edition, trt, config, capabilities)
        require_user_allocation(edition, trt, config)
        for _, ranges in table:
            profile = builder.create_optimization_profile()
            for name, (low, opt, high) in ranges.items():
                profile.set_shape(name, low, opt, high)
            config.add_optimization_profile(profile)
        if edition is DATACENTER:     # tactics are timed on the build GPU; RTX builds choose without timing
            cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.exists() else b"")
            config.set_timing_cache(cache, ignore_mismatch=False)
        log_file.write(f"[ssd-trt] building {onnx_path} -> {out_path}: {edition.module} {trt.__version__}, "
                       f"{', '.join(capabilities)}, {precision}, {len(table)} profiles "
                       f"({', '.join(p.name for p, _ in table)})\n")
        log_file.flush()
        start = time.perf_counter()
        serialized = builder.build_serialized_network(network, config)
        seconds = time.perf_counter() - start
        if serialized is None:
            raise RuntimeError(f"{edition.module} failed to build {out_path}; see {log_path}")
        del parser, network         # the parsed weights: not needed to write the plan
        with open(out_path, "wb") as plan_file:
            plan_file.write(memoryview(serialized))     # no bytes() copy of a plan as large as the weights
        del serialized
        if edition is DATACENTER:
            timing_cache.write_bytes(bytes(config.get_timing_cache().serialize()))
        log_file.write(f"[ssd-trt] built in {seconds:.1f} s\n")
    return manifest_entry(edition, role, root, out_path, onnx_path, table, precision, trt.__version__,
                          tuple(capabilities), seconds, recipe_sha256, log_path, decomposable, rank, collectives)


def require_user_allocation(edition: Edition, trt, config) -> None:
    """An RTX plan uses the application's device memory wherever it can (``BuilderFlag.REQUIRE_USER_ALLOCATION``),
    which CUDA stream capture needs: "This is required when using CUDA stream capture" (TensorRT-RTX 1.2 release
    notes, https://docs.nvidia.com/deeplearning/tensorrt-rtx/latest/getting-started/release-notes-1/1.2.html; the
    flag is in tensorrt_rtx 1.7). The runtime gives every context that memory (``engines/tensorrt.py``) and captures a
    graph per step shape. Data-centre TensorRT has no such flag (11.4's bindings): its contexts take user-managed
    memory without it."""
    if edition is RTX:
        config.set_flag(trt.BuilderFlag.REQUIRE_USER_ALLOCATION)


def _file_logger(trt, stream):
    """An ``ILogger`` of either edition that writes INFO and above to ``stream`` (defined lazily: needs TensorRT)."""

    class FileLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)

        def log(self, severity, msg) -> None:
            if int(severity) <= int(trt.ILogger.Severity.INFO):
                stream.write(f"[{severity.name}] {msg}\n")

    return FileLogger()
