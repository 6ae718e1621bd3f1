"""Opening engines: one factory turns (build, role, placement) into an :class:`~ssd_trt.engines.base.Engine`.

Backends: ``ort`` (ONNX Runtime, CPU: the embedded default), ``trt`` (the build's TensorRT plans, on a GPU)
and ``torch`` (the torch decoder with the Triton tree-attention kernel and CUDA graphs, on a GPU without
TensorRT; weights reloaded from the sources the manifest records and checked against their sha256).
The draft is wrapped in its copy component when its config carries one (``copy_mixture.py``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ssd_trt.engines.base import Engine, EngineSpec
from ssd_trt.engines.copy_mixture import CopyMixture, CopyMixtureEngine
from ssd_trt.engines.placement import ModelPlacement
from ssd_trt.errors import ArtifactError, SsdTrtError
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
                 backend: str | None = None, draft_copy: bool = True) -> None:
        self.root, self.manifest, self.placements = Path(root), manifest, placements
        self.wanted = backend or manifest.recipe.engine.backend
        self.copy_mixture = copy_mixture_of(manifest, root) if draft_copy else None
        self.opened: dict[str, Engine] = {}
        self._tensorrt: tuple[bool, str] | None = None

    def get(self, role: str) -> Engine:
        if role not in self.opened:
            engine = open_engine(self.root, self.manifest, role, self.placements[role], self.backend(role))
            if role == "draft" and self.copy_mixture is not None:
                engine = CopyMixtureEngine(engine, self.copy_mixture)
            self.opened[role] = engine
        return self.opened[role]

    def backend(self, role: str) -> str:
        """``torch`` or ``ort`` when asked; else ``trt`` when the recipe allows it, an engine.plan exists and
        TensorRT + a GPU are usable (probed once, in a subprocess); else ``ort``."""
        if self.wanted in ("torch", "ort"):
            return self.wanted
        if not (self.root / role / "engine.plan").is_file():
            if self.wanted == "trt":
                raise ArtifactError(f"{self.root / role} has no TensorRT engine (engine.plan); build on a GPU "
                                    f"host with TensorRT, or set engine.backend to 'auto' or 'ort'")
            return "ort"
        if self._tensorrt is None:
            from ssd_trt.engines.availability import probe_tensorrt
            self._tensorrt = probe_tensorrt()
        if not self._tensorrt[0] and self.wanted == "trt":
            raise ArtifactError(f"recipe asks for TensorRT but it cannot run here: {self._tensorrt[1]}")
        return "trt" if self._tensorrt[0] else "ort"

    def free_slots(self) -> None:
        """Give back every engine's KV slots (lengths -> 0); buffers stay allocated for the next request."""
        for engine in self.opened.values():
            try:
                lengths = engine.lengths
            except AttributeError:          # never reset: holds nothing
                continue
            engine.rollback(np.zeros_like(lengths))

    def retire(self, role: str) -> None:
        """Never reuse this engine (e.g. a draft that may still be running after a hang)."""
        self.opened.pop(role, None)


def open_engine(root: Path, manifest: Manifest, role: str, placement: ModelPlacement, backend: str) -> Engine:
    """The role's engine on ``backend`` (ort | trt | torch), placed as asked."""
    spec = engine_spec(manifest, role)
    if backend == "torch":
        return _torch_engine(manifest, role)
    if backend == "trt":
        from ssd_trt.engines.tensorrt import TensorRTEngine
        return TensorRTEngine(Path(root) / role / "engine.plan", spec, name=role, placement=_gpu_placement(role))
    from ssd_trt.engines.ort import OrtEngine
    return OrtEngine(Path(root) / role / "model.ort.onnx", spec, placement.threads, placement.cores,
                     spin=placement.spin,
                     int8_activations=getattr(manifest.recipe, role).activations == "int8")


def _torch_engine(manifest: Manifest, role: str) -> Engine:
    """The role's model as a TorchDeviceEngine, reloaded from the source the build recorded."""
    import torch

    from ssd_trt.engines.device_step import Placement
    from ssd_trt.engines.torch_device import TorchDeviceEngine
    from ssd_trt.models.loading import load_decoder
    from ssd_trt.models.sources import resolve_source, source_fingerprint

    entry = manifest.model(role)
    try:
        source = resolve_source(entry.source)
    except SsdTrtError as exc:
        raise ArtifactError(f"the torch backend reloads the {role} weights from the source the build recorded, "
                            f"and it is not usable: {exc}; restore it or use the ort backend") from None
    if source_fingerprint(source) != entry.source_sha256:
        raise ArtifactError(f"the {role} source {source.path} changed since this build was made (sha256 "
                            "differs from the manifest); rebuild, or use the ort backend")
    model, _ = load_decoder(source)
    on_gpu = torch.cuda.is_available()
    dtype = getattr(torch, getattr(manifest.recipe, role).dtype)
    return TorchDeviceEngine(model, manifest.recipe.engine.limits, name=role, device="cuda" if on_gpu else "cpu",
                             dtype=dtype, placement=_gpu_placement(role) if on_gpu else Placement())


def _gpu_placement(role: str):
    """The role's device and stream priority (``place_draft_and_target``: two GPUs, or two streams)."""
    import torch

    from ssd_trt.engines.device_step import place_draft_and_target
    draft_place, target_place = place_draft_and_target(torch.cuda.device_count())
    return target_place if role == "target" else draft_place
