"""Opening engines: one factory turns (build, role, placement) into an :class:`~ssd_trt.engines.base.Engine`.

Backends: ``ort`` (ONNX Runtime, CPU: the embedded default), ``trt`` (the build's TensorRT plans, on a GPU:
data-centre TensorRT or TensorRT for RTX, whichever plan can run here, checked by ``plans.check_plan``; a target split
over tensor-parallel ranks: its rank plans, one GPU each, ``engines/tensor_parallel.py``)
and ``torch`` (the torch decoder with the Triton tree-attention kernel and CUDA graphs, on a GPU without
TensorRT; weights reloaded from the sources the manifest records and checked against their sha256).
The draft is wrapped in its copy component when its config carries one (``copy_mixture.py``), and a feature
(EAGLE-3) draft's engine of any backend in ``FeatureDraftEngine`` (``feature_draft.py``).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from ssd_trt.engines.base import Engine, EngineSpec
from ssd_trt.engines.copy_mixture import CopyMixture, CopyMixtureEngine
from ssd_trt.engines.placement import ModelPlacement
from ssd_trt.errors import ArtifactError, ConfigError, SsdTrtError
from ssd_trt.kernels.artifact import CPU_TILES_FLAVOUR
from ssd_trt.manifest import Manifest


def engine_spec(manifest: Manifest, role: str) -> EngineSpec:
    config, limits = manifest.model(role).config, manifest.recipe.engine
    return EngineSpec(name=role, vocab_size=config.vocab_size, num_layers=config.num_layers,
                      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                      max_batch=limits.max_batch, max_context=limits.max_context)


def copy_mixture_of(manifest: Manifest, root: Path) -> CopyMixture | None:
    """The draft's copy component, from its config as the build recorded it (None: it has none)."""
    return CopyMixture.from_config(manifest.model("draft").hf_config,
                                   where=f"draft config in {Path(root) / 'manifest.json'}")


class EngineSet:
    """The engines of one build, opened on first use and kept (one per role), and how they were chosen."""

    def __init__(self, root: Path, manifest: Manifest, placements: dict[str, ModelPlacement],
                 backend: str | None = None, draft_copy: bool = True, rank_timeout_s: float = 30.0,
                 cpu_kernel: bool = True) -> None:
        """``rank_timeout_s``: how long a tensor-parallel target's ranks may take to answer one call; ``cpu_kernel``:
        on the ort backend, run a model whose build has CPU tiles on ssd-trt's own kernels (``kernel_engine.py``)."""
        self.root, self.manifest, self.placements = Path(root), manifest, placements
        self.cpu_kernel = cpu_kernel
        self.rank_timeout_s = rank_timeout_s
        self.wanted = backend or manifest.recipe.engine.backend
        self.copy_mixture = copy_mixture_of(manifest, root) if draft_copy else None
        self.opened: dict[str, Engine] = {}
        self.editions: dict[str, tuple[str | None, str]] = {}     # role -> (TensorRT edition to run, why not)
        self._probes: dict[str, tuple[bool, str, str | None]] = {}

    def get(self, role: str) -> Engine:
        if role not in self.opened:
            backend = self.backend(role)
            self.opened[role] = open_engine(self.root, self.manifest, role, self.placements[role], backend,
                                            self.editions.get(role, (None, ""))[0], self.copy_mixture,
                                            self.rank_timeout_s, self.cpu_kernel)
        return self.opened[role]

    def backend(self, role: str) -> str:
        """``torch`` or ``ort`` when asked; else ``trt`` when the recipe allows it and one of the role's plans can
        run here (its edition's TensorRT and a GPU it has kernels for, probed once in a subprocess, and the
        plan passes ``plans.check_plan``); else ``ort``."""
        if self.manifest.recipe.engine.backend == "torch" and self.wanted != "torch":
            raise ArtifactError(f"{self.root} was built for the torch backend (engine.backend: torch): it has no ONNX "
                                f"graphs or TensorRT plans for the {self.wanted} backend; run it with "
                                "RuntimeOptions(backend='torch') (the default), or rebuild with engine.backend: auto")
        split = self.manifest.tensor_parallel
        if split is not None and role == split.role and self.wanted != "torch":
            return self._split_backend(role, split.num_ranks)
        if self.wanted in ("torch", "ort"):
            return self.wanted
        if role not in self.editions:
            self.editions[role] = self._runnable_plan(role)
        if self.editions[role][0] is None:
            if self.wanted == "trt":
                raise ArtifactError(f"recipe asks for TensorRT but no {role} plan can run here: {self.editions[role][1]}")
            return "ort"
        return "trt"

    def _split_backend(self, role: str, ranks: int) -> str:
        """``trt`` for a role split over tensor-parallel ranks when its rank plans can run here (``ranks`` GPUs for
        them and one more for the draft); the torch backend only when asked (it reloads the checkpoint); never
        ONNX Runtime, which has no all-reduce (each rank graph alone passes its partial sums on as whole)."""
        why_not = ("ONNX Runtime has no all-reduce, so it cannot run the rank graphs (run alone, each would pass its "
                   "partial sums on as whole)")
        if self.wanted != "ort":
            if role not in self.editions:
                self.editions[role] = self._runnable_plan(role, ranks)
            if self.editions[role][0] is not None:
                return "trt"
            why_not += f"; its TensorRT rank plans cannot run here: {self.editions[role][1]}"
        raise ArtifactError(
            f"{self.root} splits the {role} over {ranks} tensor-parallel ranks (engine.tensor_parallel: {ranks}): "
            "each rank's step graph ends its attention and MLP with partial sums that only the all-reduce layers of "
            f"its TensorRT plan complete, running one engine per GPU joined by an NCCL communicator. {why_not}. The "
            "torch backend runs a split target from its checkpoint (RuntimeOptions(backend='torch'), `--backend "
            f"torch`); or rebuild with engine.tensor_parallel: 1 to run the {role} on ONNX Runtime or one GPU")

    def _runnable_plan(self, role: str, ranks: int = 1) -> tuple[str | None, str]:
        """(edition, "") of the first of the role's plans that can run here, else (None, why not); a role split
        over ``ranks`` > 1 needs every rank's plan, and ``ranks`` + 1 GPUs (the draft takes GPU ``ranks``)."""
        from ssd_trt.engines.plans import check_plan, check_rank_plans
        built = self.manifest.tensorrt
        reasons = []
        for edition in dict.fromkeys(p.edition for p in built.plans if p.role == role):
            usable, reason, capability = self._runtime(edition)
            if not usable:
                reasons.append(f"{edition}: {reason}")
                continue
            try:
                if ranks > 1:
                    check_rank_plans(self.root, self.manifest, role, edition, capability)
                    from ssd_trt.engines.tensor_parallel import check_ranks_fit
                    check_ranks_fit(self.manifest, on_gpu=True)
                else:
                    check_plan(self.root, self.manifest, role, edition, capability)
            except (ArtifactError, ConfigError) as error:
                if self.wanted == "trt":
                    raise
                reasons.append(str(error))
                continue
            return edition, ""
        return None, "; ".join(reasons) or f"the build has no TensorRT plans ({built.status}: {built.reason})"

    def _runtime(self, edition: str) -> tuple[bool, str, str | None]:
        """(usable, reason, the GPU's compute capability) for running ``edition``'s plans, probed once."""
        if edition not in self._probes:
            from ssd_trt.engines.availability import probe_tensorrt, probe_tensorrt_rtx
            if edition == "rtx":
                probe = probe_tensorrt_rtx()
                capability = probe["capabilities"][0] if probe["capabilities"] else None
                self._probes[edition] = (probe["run"], probe["reason"], capability)
            else:
                usable, reason = probe_tensorrt()
                capability = None
                if usable:
                    import torch
                    capability = "sm{}{}".format(*torch.cuda.get_device_capability(0))
                self._probes[edition] = (usable, reason, capability)
        return self._probes[edition]

    def free_slots(self) -> None:
        free_slots(self.opened.values())

    def retire(self, role: str) -> None:
        """Never reuse this engine (e.g. a draft that may still be running after a hang)."""
        self.opened.pop(role, None)


def free_slots(engines) -> None:
    """Give back every engine's KV slots (lengths -> 0); buffers stay allocated for the next request."""
    for engine in engines:
        try:
            lengths = engine.lengths
        except AttributeError:          # never reset: holds nothing
            continue
        engine.rollback(np.zeros_like(lengths))


def open_engine(root: Path, manifest: Manifest, role: str, placement: ModelPlacement, backend: str,
                edition: str | None = None, copy_mixture: CopyMixture | None = None,
                rank_timeout_s: float = 30.0, cpu_kernel: bool = True) -> Engine:
    """The role's engine on ``backend`` (ort | trt | torch), placed as asked; ``edition``: which TensorRT plan.
    The one place engine wrappers are stacked: a feature (EAGLE-3) draft's backend engine inside
    ``FeatureDraftEngine`` (which features each token carries), then the draft's copy component around it."""
    engine = _backend_engine(root, manifest, role, placement, backend, edition, rank_timeout_s, cpu_kernel)
    if role != "draft":
        return engine
    if manifest.recipe.draft.kind == "eagle3":
        engine = feature_draft_engine(engine, root)
    return engine if copy_mixture is None else CopyMixtureEngine(engine, copy_mixture)


def _backend_engine(root: Path, manifest: Manifest, role: str, placement: ModelPlacement, backend: str,
                    edition: str | None, rank_timeout_s: float = 30.0, cpu_kernel: bool = True) -> Engine:
    spec = engine_spec(manifest, role)
    if backend == "torch":
        return _torch_engine(manifest, role, rank_timeout_s)
    if backend == "trt":
        from ssd_trt.engines.tensorrt import TensorRTEngine
        split = manifest.tensor_parallel
        if split is not None and split.role == role:
            from ssd_trt.engines.tensor_parallel import open_split_plans
            return open_split_plans(manifest, spec, root, edition or "datacenter", rank_timeout_s)
        plan = manifest.tensorrt.plan(role, edition or "datacenter")
        if plan is None:
            raise ArtifactError(f"the build in {root} has no {edition or 'datacenter'} TensorRT plan for the {role}; "
                                f"{manifest.rebuild_hint}")
        return TensorRTEngine(Path(root) / plan.path, spec, name=role, placement=_gpu_placement(manifest, role),
                              edition=plan.edition)
    if cpu_kernel and manifest.artifact(role, CPU_TILES_FLAVOUR) is not None:
        engine = _kernel_engine(root, role, spec, placement)
        if engine is not None:
            return engine
    from ssd_trt.engines.ort import OrtEngine
    return OrtEngine(Path(root) / role / "model.ort.onnx", spec, placement.threads, placement.cores,
                     spin=placement.spin,
                     int8_activations=getattr(manifest.recipe, role).activations == "int8",
                     alone_threads=placement.alone_threads, alone_cores=placement.alone_cores)


def _kernel_engine(root: Path, role: str, spec: EngineSpec, placement: ModelPlacement) -> Engine | None:
    """The role on ssd-trt's CPU kernels (``kernel_engine.py``), or None with one line on stderr saying why it keeps
    ONNX Runtime's MatMulNBits (the library cannot be built here, or this CPU cannot run it)."""
    from ssd_trt.engines.kernel_engine import KernelEngine
    from ssd_trt.kernels.artifact import load_cpu_tiles
    from ssd_trt.kernels.build import KernelBuildError
    tiles = load_cpu_tiles(Path(root) / role)
    try:
        return KernelEngine(tiles, spec, placement.threads, placement.cores, spin=placement.spin,
                            alone_threads=placement.alone_threads, alone_cores=placement.alone_cores)
    except (KernelBuildError, ValueError) as exc:
        print(f"ssd-trt: the {role} runs on ONNX Runtime's MatMulNBits, not the CPU kernel: {exc}", file=sys.stderr)
        return None


def feature_draft_engine(engine, root: Path) -> Engine:
    """An EAGLE-3 draft's engine (any backend) behind ``FeatureDraftEngine``: which features each token carries."""
    from ssd_trt.engines.feature_draft import FeatureDraftEngine
    widths = engine.extra_widths
    if set(widths) != {"features", "draft_hidden"}:
        raise ArtifactError(f"the draft in {root} is an eagle3 draft but its engine takes no static features / "
                            f"draft_hidden inputs ({sorted(widths)}); rebuild")
    return FeatureDraftEngine(engine, widths["features"], widths["draft_hidden"])


def _torch_engine(manifest: Manifest, role: str, rank_timeout_s: float = 30.0) -> Engine:
    """The role's model as a TorchDeviceEngine, reloaded from the source the build recorded; a target split over
    ``engine.tensor_parallel`` ranks as a TensorParallelEngine (``engines/tensor_parallel.py``: rank r on GPU r, the
    draft whole on GPU N)."""
    import torch

    from ssd_trt.engines.torch_device import TorchDeviceEngine
    from ssd_trt.models.sources import resolve_source, source_fingerprint

    ranks = manifest.recipe.engine.tensor_parallel
    on_gpu = torch.cuda.is_available()
    if ranks > 1:
        from ssd_trt.engines.tensor_parallel import check_ranks_fit
        check_ranks_fit(manifest, on_gpu)         # before any weight is read
    entry = manifest.model(role)
    try:
        source = resolve_source(entry.source)
    except SsdTrtError as exc:
        raise ArtifactError(f"the torch backend reloads the {role} weights from the source the build recorded, "
                            f"and it is not usable: {exc}; restore it or use the ort backend") from None
    if source_fingerprint(source) != entry.source_sha256:
        raise ArtifactError(f"the {role} source {source.path} changed since this build was made (sha256 "
                            "differs from the manifest); rebuild, or use the ort backend")
    if ranks > 1 and role == "target":
        from ssd_trt.engines.tensor_parallel import open_split_target
        return open_split_target(manifest, engine_spec(manifest, role), source.path, on_gpu, rank_timeout_s)
    dtype = getattr(torch, getattr(manifest.recipe, role).dtype)
    model = _reload(manifest, role, source, dtype)
    if not on_gpu:
        # a split target's ranks run the reference attention on CPU (engines/tensor_parallel.py); its draft does too
        kernel = "reference" if ranks > 1 else "triton"
        return TorchDeviceEngine(model, manifest.recipe.engine.limits, name=role, device="cpu", dtype=dtype,
                                 kernel=kernel)
    return TorchDeviceEngine(model, manifest.recipe.engine.limits, name=role, device="cuda", dtype=dtype,
                             placement=_gpu_placement(manifest, role))


def _reload(manifest: Manifest, role: str, source, dtype):
    """The role's torch model as the build made it, its weights read straight into ``dtype`` (no fp32 copy of a
    bf16 checkpoint): with a feature (EAGLE-3) draft, the target returns the features the draft reads and the
    draft is the head on the target's embedding."""
    from ssd_trt.models.loading import load_decoder
    if manifest.recipe.draft.kind != "eagle3":
        return load_decoder(source, dtype)[0]
    from ssd_trt.models.decoder import with_target_features
    from ssd_trt.models.eagle3 import Eagle3Config, load_eagle3_checkpoint
    from ssd_trt.models.sources import resolve_source
    target, _ = load_decoder(source if role == "target" else resolve_source(manifest.model("target").source))
    if role == "draft":
        return load_eagle3_checkpoint(source.path, target.config.num_layers, target.embed_tokens.weight.detach())
    layers = Eagle3Config.from_hf_dict(manifest.model("draft").hf_config, target.config.num_layers).feature_layers
    return with_target_features(target, layers)


def _gpu_placement(manifest: Manifest, role: str):
    """The role's device and stream priority: beside a target split over N ranks (GPUs 0 .. N-1) the draft has GPU N
    to itself; else ``place_draft_and_target`` (two GPUs, or two streams of one)."""
    import torch

    from ssd_trt.engines.device_step import Placement, place_draft_and_target
    ranks = manifest.recipe.engine.tensor_parallel
    if ranks > 1 and role == "draft":
        return Placement(device=ranks)
    draft_place, target_place = place_draft_and_target(torch.cuda.device_count())
    return target_place if role == "target" else draft_place
