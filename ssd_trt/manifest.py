"""``manifest.json``: what a build produced, with checksums, read back and verified at load time."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ssd_trt.errors import ArtifactError

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 2   # 2: the step graph takes logit_indices (which new tokens get logits)
LIMITS = ("max_batch", "max_context", "max_draft_len")
CONFIG_INTS = ("vocab_size", "num_layers", "num_kv_heads", "head_dim")
REQUIRED_FILES = ("model.ort.onnx",)                     # per role: the runtime cannot run without these
LOADED_FILES = REQUIRED_FILES + ("weights.bin", "engine.plan")   # per role: read when present


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def artifact_entry(root: Path, path: Path) -> dict[str, Any]:
    return {"path": str(path.relative_to(root)), "sha256": sha256_file(path), "bytes": path.stat().st_size}


def write_manifest(root: Path, manifest: dict[str, Any]) -> Path:
    manifest = {"schema_version": SCHEMA_VERSION, **manifest}
    path = root / MANIFEST_NAME
    path.write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return path


def read_manifest(root: Path) -> dict[str, Any]:
    """Read and sanity-check a manifest (schema version, required keys); no checksums yet."""
    path = Path(root) / MANIFEST_NAME
    if not path.is_file():
        raise ArtifactError(f"{root} is not an ssd-trt build (no {MANIFEST_NAME}); build it with "
                            f"`python -m ssd_trt.build <recipe.yaml>`")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path} is corrupt ({exc}); rebuild with `python -m ssd_trt.build`") from None
    version = manifest.get("schema_version") if isinstance(manifest, dict) else None
    if version != SCHEMA_VERSION:
        newer = isinstance(version, int) and version > SCHEMA_VERSION
        recipe = manifest.get("recipe", {}).get("_path", "<recipe.yaml>") if isinstance(manifest, dict) else \
            "<recipe.yaml>"
        raise ArtifactError(
            f"{path} was written by {'a newer' if newer else 'an older'} ssd-trt (schema version "
            f"{version!r}; this ssd-trt reads version {SCHEMA_VERSION}), and its engines do not match this runtime's "
            + ("step graph: upgrade ssd-trt, or rebuild it" if newer else "step graph: rebuild it")
            + f" with `python -m ssd_trt.build {recipe} --force` (scripts run `--if-stale`, which rebuilds it)")
    for key in ("recipe", "models", "artifacts"):
        if key not in manifest:
            raise ArtifactError(f"{path} lacks '{key}'; rebuild with `python -m ssd_trt.build`")
    check_structure(path, manifest)
    return manifest


def check_structure(path: Path, manifest: dict[str, Any]) -> None:
    """The fields the runtime reads, with their types: a hand-edited manifest fails here, not later."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ArtifactError(f"{path} is malformed ({what}); rebuild with `python -m ssd_trt.build`")

    recipe, models, artifacts = manifest["recipe"], manifest["models"], manifest["artifacts"]
    engine = recipe.get("engine") if isinstance(recipe, dict) else None
    need(isinstance(engine, dict) and all(isinstance(engine.get(k), int) for k in LIMITS),
         f"recipe.engine needs integer {', '.join(LIMITS)}")
    for role in ("target", "draft"):
        config = models.get(role, {}).get("config") if isinstance(models, dict) else None
        need(isinstance(config, dict) and all(isinstance(config.get(k), int) for k in CONFIG_INTS),
             f"models.{role}.config needs integer {', '.join(CONFIG_INTS)}")
    need(isinstance(artifacts, list) and all(
        isinstance(a, dict) and isinstance(a.get("path"), str) and isinstance(a.get("sha256"), str)
        and isinstance(a.get("bytes"), int) for a in artifacts), "every artifact needs path, sha256 and bytes")


def verify_artifacts(root: Path, manifest: dict[str, Any], roles: tuple[str, ...]) -> None:
    """Check size and sha256 of every artifact the given roles need (and the tokenizer), and that every
    file the runtime will load is one the manifest lists (nothing left over from another build)."""
    fix = "rebuild with `python -m ssd_trt.build " + str(manifest["recipe"].get("_path", "<recipe.yaml>")) + "`"
    listed = {Path(entry["path"]).as_posix() for entry in manifest["artifacts"]}
    loaded = [f"{role}/{name}" for role in roles for name in LOADED_FILES]
    tokenizer_dir = Path(root) / "tokenizer"
    if tokenizer_dir.is_dir():
        loaded += [p.relative_to(root).as_posix() for p in sorted(tokenizer_dir.iterdir())]
    for relative in loaded:
        required = Path(relative).name in REQUIRED_FILES
        if relative not in listed and (required or (Path(root) / relative).exists()):
            raise ArtifactError(f"{Path(root) / relative} is not among the manifest's artifacts (missing, left "
                                f"over from another build, or added by hand); {fix}")
    for entry in manifest["artifacts"]:
        if entry.get("role") not in roles + ("tokenizer",):
            continue
        path = Path(root) / entry["path"]
        if not path.is_file():
            raise ArtifactError(f"artifact {path} listed in the manifest is missing; {fix}")
        if path.stat().st_size != entry["bytes"]:
            raise ArtifactError(f"artifact {path} has {path.stat().st_size} bytes, the manifest says "
                                f"{entry['bytes']} (truncated or replaced); {fix}")
        if sha256_file(path) != entry["sha256"]:
            raise ArtifactError(f"artifact {path} does not match its sha256 in the manifest (edited, "
                                f"corrupt or swapped); {fix}")
