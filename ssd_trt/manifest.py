"""``manifest.json``: what a build produced, with checksums, read back and verified at load time."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ssd_trt.errors import ArtifactError

MANIFEST_NAME = "manifest.json"
SCHEMA_VERSION = 1


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
        raise ArtifactError(f"{path} has schema version {version!r}, this ssd-trt reads {SCHEMA_VERSION}"
                            + ("; it was built by a newer ssd-trt: upgrade ssd-trt or rebuild" if newer
                               else "; rebuild with `python -m ssd_trt.build`"))
    for key in ("recipe", "models", "artifacts"):
        if key not in manifest:
            raise ArtifactError(f"{path} lacks '{key}'; rebuild with `python -m ssd_trt.build`")
    return manifest


def verify_artifacts(root: Path, manifest: dict[str, Any], roles: tuple[str, ...]) -> None:
    """Check size and sha256 of every artifact the given roles need (and the tokenizer)."""
    for entry in manifest["artifacts"]:
        if entry.get("role") not in roles + ("tokenizer",):
            continue
        path = Path(root) / entry["path"]
        fix = "rebuild with `python -m ssd_trt.build " + manifest["recipe"].get("_path", "<recipe.yaml>") + "`"
        if not path.is_file():
            raise ArtifactError(f"artifact {path} listed in the manifest is missing; {fix}")
        if path.stat().st_size != entry["bytes"]:
            raise ArtifactError(f"artifact {path} has {path.stat().st_size} bytes, the manifest says "
                                f"{entry['bytes']} (truncated or replaced); {fix}")
        if sha256_file(path) != entry["sha256"]:
            raise ArtifactError(f"artifact {path} does not match its sha256 in the manifest (edited, "
                                f"corrupt or swapped); {fix}")
