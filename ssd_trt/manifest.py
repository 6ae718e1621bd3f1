"""``manifest.json``: the typed contract between a build and the runtime, verified at load time.

The build writes a :class:`Manifest`; the runtime reads one back (schema version first, then every field
with its type, strictly: a hand-edited or truncated manifest fails here with one paragraph naming the
field and the fix) and checks every artifact's size and sha256 before loading it. Nothing outside this
module reads the JSON.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from ssd_trt.errors import ArtifactError
from ssd_trt.models.config import DecoderConfig
from ssd_trt.recipe import DecodingDefaults, Recipe

MANIFEST_NAME = "manifest.json"
# 2: the step graph takes logit_indices (which new tokens get logits); the manifest is typed (pydantic),
#    the recipe's path is a top-level field
# 3: TensorRT plans typed (edition, version, compute capabilities, profiles, the recipe they were built from)
SCHEMA_VERSION = 3
ROLES = ("target", "draft")
REQUIRED_FILES = ("model.ort.onnx",)                     # per role: the runtime cannot run without these
# per role: read when present (cpu_tiles.*: the CPU kernel's artifact, kernels/artifact.py)
LOADED_FILES = REQUIRED_FILES + ("weights.bin", "engine.plan", "engine.rtx.plan", "cpu_tiles.bin", "cpu_tiles.json")
RANK_LOADED_FILES = ("engine.plan", "engine.rtx.plan")      # per tensor-parallel rank folder: read when present


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def artifact_entry(root: Path, path: Path) -> dict[str, Any]:
    return {"path": str(path.relative_to(root)), "sha256": sha256_file(path), "bytes": path.stat().st_size}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Artifact(_Strict):
    """One file the build wrote, with what the runtime checks before loading it."""
    role: Literal["target", "draft", "tokenizer"]
    path: str
    sha256: str
    bytes: int
    flavour: str | None = None            # ort | trt | rtx | weights | trt_weights | rtx_weights | engine | cpu_tiles


class ProfileEntry(_Strict):
    """One optimisation profile of a plan: its step kind, (min, opt, max) batch and new tokens, input shapes."""
    name: str
    batch: list[int]
    tokens: list[int]
    shapes: dict[str, list[list[int]]]


class PlanEntry(_Strict):
    """A TensorRT plan as built; checked at load against the file, the recipe and the GPU (engines/plans.py)."""
    role: Literal["target", "draft"]
    edition: Literal["datacenter", "rtx"]
    tensorrt_version: str
    path: str                              # relative to the build directory
    sha256: str
    bytes: int
    onnx: str                              # the step-graph flavour it was built from
    precision: Literal["fp32", "fp16", "bf16"]
    compute_capabilities: list[str]        # e.g. ["sm86", "sm89"]: the GPUs it has kernels for
    profiles: list[ProfileEntry]
    recipe_sha256: str                     # recipe_fingerprint of the recipe it was built from
    build_seconds: float
    decomposable_attention_layers: int = 0  # fp32 RTX: attentions split into matmul/softmax (no fp32 kernel)
    log: str
    rank: int | None = None                # a tensor-parallel rank's plan (TensorParallelBuild); None: the whole model
    collective_layers: int = 0             # its native all-reduce layers: 2 per decoder layer


class TensorRTBuild(_Strict):
    """What the build's TensorRT step did: plans built, or why not."""
    status: Literal["built", "stopped at ONNX", "skipped"]
    reason: str
    plans: list[PlanEntry] = []

    def plan(self, role: str, edition: str) -> PlanEntry | None:
        """The role's whole-model plan of ``edition`` (a tensor-parallel build has rank plans instead)."""
        return next((p for p in self.plans if p.role == role and p.edition == edition and p.rank is None), None)

    def rank_plans(self, role: str, edition: str) -> list[PlanEntry]:
        """The role's tensor-parallel rank plans of ``edition``, by rank."""
        return sorted((p for p in self.plans if p.role == role and p.edition == edition and p.rank is not None),
                      key=lambda p: p.rank)


class TensorParallelRank(_Strict):
    """One rank's share of a tensor-parallel model: its folder, its step graphs and weights (flavour -> path; their
    size and sha256 are in the manifest's artifacts), and the all-reduce markers in each graph."""
    rank: int
    dir: str
    files: dict[str, str]
    all_reduce_markers: int


class TensorParallelBuild(_Strict):
    """How the target was split over ``engine.tensor_parallel`` ranks (``export/tensor_parallel.py``)."""
    role: Literal["target"]
    num_ranks: int
    marker_prefix: str
    query_heads_per_rank: int
    kv_heads_per_rank: int
    kv_head_replicas: int                 # ranks holding each key/value head (> 1: fewer KV heads than ranks)
    mlp_columns_per_rank: int
    replicated: str
    all_reduce_points: str
    ranks: list[TensorParallelRank]

    def rank_of(self, path: str) -> int | None:
        """The rank whose folder holds ``path`` (relative to the build), else None."""
        return next((r.rank for r in self.ranks if Path(path).as_posix().startswith(r.dir + "/")), None)


class BuiltModel(_Strict):
    """One model of the pair as built: its decoder config, where its weights came from, how it was checked."""
    config: DecoderConfig
    hf_config: dict[str, Any]
    source: str
    source_sha256: str
    parity_vs_transformers: dict[str, Any]
    quantization: dict[str, Any] | None = None      # block weights in the graph (layers, kinds, bytes)
    head_token_ids: str | None = None
    source_files: dict[str, str] | None = None      # file name -> sha256 (a torch-backend build: what it runs)


class TokenizerEntry(_Strict):
    dir: str
    vocab_size: int
    chat_template: bool


class TunedDecoding(_Strict):
    """The decoding defaults ``python -m ssd_trt.tune`` measured as fastest on this build, per regime, and how."""
    greedy: DecodingDefaults
    sampled: DecodingDefaults
    measurement: dict[str, Any]           # prompts, placement, every point's tokens/s and speedup over AR

    def for_params(self, greedy: bool) -> DecodingDefaults:
        return self.greedy if greedy else self.sampled


class Manifest(_Strict):
    """What a build produced. ``recipe`` is the validated recipe itself (one definition of the limits)."""
    schema_version: Literal[3]
    recipe: Recipe
    recipe_path: str
    models: dict[Literal["target", "draft"], BuiltModel]
    tokenizer: TokenizerEntry
    artifacts: list[Artifact]
    validation: dict[str, dict[str, Any]]
    tensorrt: TensorRTBuild
    tools: dict[str, str | None]
    build_seconds: float
    # the export path of each model, the memory estimated for it before the build and the peak it reached
    # (export/host_memory.py); absent from manifests written before it was recorded
    host_memory: dict[str, Any] | None = None
    # decoding defaults chosen by measurement on this build (ssd_trt/tune.py); None: the recipe's decoding
    tuned_decoding: TunedDecoding | None = None
    # the target's split over engine.tensor_parallel ranks (ONNX / TensorRT builds); None: one whole target
    tensor_parallel: TensorParallelBuild | None = None

    @model_validator(mode="after")
    def _a_speculative_pair(self) -> "Manifest":
        missing = [role for role in ROLES if role not in self.models]
        if missing:
            raise ValueError(f"models lacks {missing}")
        target, draft = (self.models[role].config.vocab_size for role in ROLES)
        if target != draft:
            raise ValueError(f"the draft vocabulary ({draft}) differs from the target's ({target})")
        return self

    def artifact(self, role: str, flavour: str) -> Artifact | None:
        """The role's first artifact of this flavour (None: the build wrote none)."""
        return next((a for a in self.artifacts if a.role == role and a.flavour == flavour), None)

    def model(self, role: str) -> BuiltModel:
        return self.models[role]

    @property
    def rebuild_hint(self) -> str:
        return f"rebuild with `python -m ssd_trt.build {self.recipe_path} --force`"


def recipe_fingerprint(recipe: Recipe) -> str:
    """sha256 of the validated recipe: what a plan records so a plan from another recipe is refused."""
    return hashlib.sha256(recipe.model_dump_json().encode()).hexdigest()


def write_manifest(root: Path, manifest: Manifest) -> Path:
    path = Path(root) / MANIFEST_NAME
    path.write_text(manifest.model_dump_json(indent=2) + "\n")
    return path


def read_manifest(root: Path) -> Manifest:
    """Read and validate a manifest (schema version, every field, strictly); no checksums yet."""
    path = Path(root) / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"{root} is not an ssd-trt build (no {MANIFEST_NAME}); build it with "
                            f"`python -m ssd_trt.build <recipe.yaml>`")
    try:
        text = path.read_text()
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is corrupt ({exc}); rebuild with `python -m ssd_trt.build`") from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version != SCHEMA_VERSION:
        raise ArtifactError(_version_message(path, version, data))
    try:
        return Manifest.model_validate_json(text, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "(top level)"
        recipe = _recipe_path(data)
        raise ArtifactError(f"{path} is malformed (field '{where}': {first['msg']}); rebuild with "
                            f"`python -m ssd_trt.build {recipe} --force`") from None


def _recipe_path(data: Any) -> str:
    """The recipe a manifest was built from, as well as a damaged or older manifest still says it."""
    if not isinstance(data, dict):
        return "<recipe.yaml>"
    recipe = data.get("recipe") if isinstance(data.get("recipe"), dict) else {}
    return str(data.get("recipe_path") or recipe.get("_path") or "<recipe.yaml>")


def _version_message(path: Path, version: Any, data: Any) -> str:
    newer = isinstance(version, int) and version > SCHEMA_VERSION
    recipe = _recipe_path(data)
    return (f"{path} was written by {'a newer' if newer else 'an older'} ssd-trt (schema version {version!r}; this "
            f"ssd-trt reads version {SCHEMA_VERSION}), and its engines do not match this runtime's step graph: "
            + ("upgrade ssd-trt, or rebuild it" if newer else "rebuild it")
            + f" with `python -m ssd_trt.build {recipe} --force` (scripts run `--if-stale`, "
              f"which rebuilds it)")


def verify_artifacts(root: Path, manifest: Manifest, roles: tuple[str, ...]) -> None:
    """Check size and sha256 of every artifact the given roles need (and the tokenizer), and that every
    file the runtime will load is one the manifest lists (nothing left over from another build)."""
    fix = manifest.rebuild_hint
    listed = {Path(entry.path).as_posix() for entry in manifest.artifacts}
    loaded = [f"{role}/{name}" for role in roles for name in LOADED_FILES]
    split = manifest.tensor_parallel
    if split is not None and split.role in roles:      # each rank's plans are loaded from its folder
        loaded += [f"{rank.dir}/{name}" for rank in split.ranks for name in RANK_LOADED_FILES]
    tokenizer_dir = Path(root) / "tokenizer"
    if tokenizer_dir.is_dir():
        loaded += [p.relative_to(root).as_posix() for p in sorted(tokenizer_dir.iterdir())]
    for relative in loaded:
        # a tensor-parallel model has no ONNX Runtime graph: its ranks' graphs are TensorRT's only
        whole = split is None or not relative.startswith(f"{split.role}/")
        required = Path(relative).name in REQUIRED_FILES and manifest.recipe.engine.backend != "torch" and whole
        if relative not in listed and (required or (Path(root) / relative).exists()):
            raise ArtifactError(f"{Path(root) / relative} is not among the manifest's artifacts (missing, left "
                                f"over from another build, or added by hand); {fix}")
    for entry in manifest.artifacts:
        if entry.role not in roles + ("tokenizer",):
            continue
        rank = None if split is None else split.rank_of(entry.path)
        what = "artifact" if rank is None else f"tensor-parallel rank {rank} (of {split.num_ranks})'s file"
        verify_file(Path(root) / entry.path, entry.bytes, entry.sha256, fix, what)


def verify_file(path: Path, size: int, sha256: str, fix: str, what: str = "artifact") -> None:
    """ArtifactError naming ``path`` and ``fix`` unless the file exists with the size and sha256 recorded."""
    if not path.is_file():
        raise ArtifactError(f"{what} {path} listed in the manifest is missing; {fix}")
    if path.stat().st_size != size:
        raise ArtifactError(f"{what} {path} has {path.stat().st_size} bytes, the manifest says {size} (truncated "
                            f"or replaced); {fix}")
    if sha256_file(path) != sha256:
        raise ArtifactError(f"{what} {path} does not match its sha256 in the manifest (edited, corrupt or swapped); "
                            f"{fix}")
