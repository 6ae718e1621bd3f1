"""A model named on the command line: a GGUF file or a Hugging Face checkpoint folder, checked before any build.

Two readings, cheap first. :func:`locate` only looks at the path (it exists; a file starts with GGUF's magic; a
folder is a checkpoint), so that a start from the cache costs nothing more. :func:`inspect` reads what a recipe needs
and what a build would stop on later: the context length and embedding rows, the tokenizer (``tokenizers.py``), and
for a GGUF every tensor's block type against those the build reads (``models/gguf_blocks.py``), so that a file the
engine cannot read is refused in one line before minutes of building, not in the middle of them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ssd_trt.errors import ConfigError, SsdTrtError
from ssd_trt.from_files.tokenizers import TokenizerFacts, gguf_tokenizer, hf_tokenizer
from ssd_trt.models.sources import ResolvedSource, resolve_source

GGUF_MAGIC = b"GGUF"    # the first four bytes of every GGUF file (ggml's gguf.h: GGUF_MAGIC)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the recipe is written from."""
    source: ResolvedSource
    context_length: int        # the longest context the model was made for (its metadata)
    embedding_rows: int        # the vocabulary the weights cover
    tokenizer: TokenizerFacts


def display_name(source: ResolvedSource) -> str:
    """The model's name as its file or folder says it (``qwen2.5-coder-1.5b-instruct-q4_k_m``)."""
    return source.path.stem if source.kind == "gguf" else source.path.name


def locate(text: str, role: str) -> ResolvedSource:
    """The model at ``text``, checked as a path only: a ConfigError in one line for a missing path, a file that is not
    GGUF, or a folder that is not a checkpoint."""
    path = Path(text).expanduser()
    if not path.exists():
        raise ConfigError(f"the {role} {text} does not exist; give a .gguf file or a Hugging Face checkpoint folder")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"the {role} {path} is a folder without config.json: give a .gguf file, a Hugging Face "
                              f"checkpoint folder (config.json, *.safetensors) or a build directory (manifest.json)")
        return resolve_source(str(path.resolve()))        # it checks the folder's weights
    with open(path, "rb") as handle:
        head = handle.read(len(GGUF_MAGIC))
    if head != GGUF_MAGIC:
        raise ConfigError(f"the {role} {path} is not a GGUF file (it starts with {head!r}, a GGUF file with "
                          f"{GGUF_MAGIC!r}); give a .gguf file or a Hugging Face checkpoint folder")
    if path.suffix != ".gguf":
        raise ConfigError(f"the {role} {path} is a GGUF file without the .gguf suffix; rename it {path.name}.gguf")
    return ResolvedSource("gguf", path.resolve())


def inspect(source: ResolvedSource, role: str) -> ModelFacts:
    """The model's facts, read from its metadata (no weights): a ConfigError or RecipeError, one line, for a file the
    build could not read."""
    return _inspect_gguf(source, role) if source.kind == "gguf" else _inspect_hf(source, role)


def _inspect_gguf(source: ResolvedSource, role: str) -> ModelFacts:
    import gguf

    from ssd_trt.models.gguf_checkpoint import hf_config_from_gguf
    try:
        reader = gguf.GGUFReader(str(source.path))
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise ConfigError(f"the {role} {source.path} is not a readable GGUF file ({type(exc).__name__}: {exc}); "
                          f"re-download it") from None
    hf = hf_config_from_gguf(reader, source.path)      # refuses an architecture the decoder does not implement
    check_block_types(reader, source.path, role)
    return ModelFacts(source, int(hf["max_position_embeddings"]), int(hf["vocab_size"]), gguf_tokenizer(reader))


def check_block_types(reader, path: Path, role: str) -> None:
    """Every tensor the decoder reads is a float or a block type the build carries (``gguf_blocks.KINDS``)."""
    from ssd_trt.models.gguf_blocks import FLOAT_KINDS, KINDS
    from ssd_trt.models.gguf_checkpoint import hf_tensor_name
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if hf_tensor_name(tensor.name) is not None and kind not in FLOAT_KINDS and kind not in KINDS:
            raise ConfigError(f"the {role} {path}: tensor {tensor.name} is {kind}, a GGUF block type the engine "
                              f"cannot read (it reads {', '.join(KINDS)} and float tensors); use a file quantized "
                              f"to those, such as a Q4_K_M or Q8_0 one")


def _inspect_hf(source: ResolvedSource, role: str) -> ModelFacts:
    config_path = source.path / "config.json"
    try:
        config = json.loads(config_path.read_text())
        context, rows = int(config["max_position_embeddings"]), int(config["vocab_size"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"the {role} {config_path} is not a decoder's config.json ({type(exc).__name__}: {exc})") \
            from None
    try:
        tokenizer = hf_tokenizer(source)
    except SsdTrtError as exc:
        raise ConfigError(f"the {role}: {exc}") from None
    return ModelFacts(source, context, rows, tokenizer)
