"""Each model's decoder config for sizing: its config.json only (or a GGUF's header), no weights read.

A recipe's source resolves as the build resolves it (``models/sources.py``: relative to the recipe's folder, then
the working directory; ``pkg:`` files), except that an HF directory needs only its config.json here. Models not
downloaded yet can be sized from their config.json alone: ``configs_dir``/<the source's last path component>/
config.json is looked at first (e.g. ``tests/data/configs/Llama-3.1-70B-Instruct/config.json`` for a source
``/models/Llama-3.1-70B-Instruct``).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ssd_trt.errors import RecipeError
from ssd_trt.models.config import DecoderConfig, decoder_config
from ssd_trt.models.sources import PACKAGE_PREFIX, resolve_source
from ssd_trt.recipe import Recipe

ROLES = ("target", "draft")


@dataclass(frozen=True)
class SizedModel:
    """One model of the pair as sizing sees it."""
    role: str
    config: DecoderConfig
    origin: str                 # where the config came from (a config.json, or a GGUF's header)
    gguf: Path | None = None    # the GGUF file, when the source is one


def model_configs(recipe: Recipe, recipe_path: Path, configs_dir: Path | None = None,
                  root: Path | None = None) -> dict[str, SizedModel]:
    """Both models' configs. RecipeError when a config is missing or does not describe a supported decoder."""
    if recipe.draft.kind != "eagle3":
        bases = (recipe_path.parent.resolve(), root or Path.cwd())
        return {role: _sized(role, getattr(recipe, role).source, bases, configs_dir) for role in ROLES}
    raise RecipeError(f"recipe {recipe.name!r}: sizing covers independent drafts; an EAGLE-3 head "
                      "(draft.kind: eagle3) is not sized yet")


def _sized(role: str, source: str, bases: tuple[Path, ...], configs_dir: Path | None) -> SizedModel:
    listed = None if configs_dir is None else \
        Path(configs_dir) / Path(source.removeprefix(PACKAGE_PREFIX).rstrip("/")).name / "config.json"
    if listed is not None and listed.is_file():
        return SizedModel(role, _read_config(listed), str(listed))
    if source.startswith(PACKAGE_PREFIX) or source.endswith(".gguf"):
        resolved = resolve_source(source, bases)      # a file that must exist, as for the build
        if resolved.kind != "gguf":
            raise RecipeError(f"{role} source {source!r} is neither an HF checkpoint directory nor a .gguf file")
        return SizedModel(role, _gguf_config(resolved.path), f"the GGUF header of {resolved.path}", resolved.path)
    path = Path(source).expanduser()
    candidates = [path] if path.is_absolute() else [base / source for base in bases] + [path]
    for directory in candidates:
        if (directory / "config.json").is_file():
            return SizedModel(role, _read_config(directory / "config.json"), str(directory / "config.json"))
    tried = ", ".join(str(c / "config.json") for c in candidates)
    hint = (f"; nor is there {listed}" if listed is not None else
            "; sizing needs only the model's config.json: put it in DIR/<model folder name>/ and pass --configs DIR")
    raise RecipeError(f"{role} source {source!r}: no config.json (looked at: {tried}){hint}")


def _read_config(path: Path) -> DecoderConfig:
    from ssd_trt.models.checkpoint import read_config_json
    return decoder_config(read_config_json(path.parent), str(path))


def _gguf_config(path: Path) -> DecoderConfig:
    """The decoder config transformers derives from a GGUF's metadata (its header; no tensor is read)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    try:
        hf = load_gguf_checkpoint(str(path), return_tensors=False)["config"]
    except (ValueError, KeyError, OSError) as exc:
        raise RecipeError(f"GGUF {path}: its header does not describe a model transformers reads ({exc})") from None
    return decoder_config(hf, f"the GGUF header of {path}")
