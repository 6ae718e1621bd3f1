"""A GGUF file read lazily as a checkpoint: the architecture and shapes from its metadata, each tensor read only
when asked for, under the HF names the rest of the build uses.

A GGUF file carries everything a build needs: the hyper-parameters (``<arch>.block_count``, ...), the tokenizer
and chat template (``tokenizer.*``, read by transformers: ``models/loading.py``) and the weights, quantized in
blocks. :class:`GGUFCheckpoint` is a :class:`~ssd_trt.models.checkpoint.Checkpoint` over such a file, so the
streamed build (``export/streamed_fused.py``, ``export/bounded_checks.py``) reads it exactly as it reads a
safetensors checkpoint: layer by layer, with host memory near one layer. Two readings of a tensor:

* :meth:`GGUFCheckpoint.tensor`: fp32, dequantized by gguf-py as ggml defines each block type (the weights the
  torch reference computes with);
* :meth:`GGUFCheckpoint.blocks`: a quantized linear weight's own blocks (``models/gguf_blocks.py``), which the
  graph keeps as they are (``weights: gguf``).

The file is memory-mapped by gguf-py's reader; touched pages would count toward the process's resident memory until
unmapped, so each read copies what it needs and drops the mapping's pages (they stay in the page cache).
"""
from __future__ import annotations

import dataclasses
import mmap
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ssd_trt.errors import RecipeError
from ssd_trt.models.checkpoint import Checkpoint, TensorInfo
from ssd_trt.models.config import DecoderConfig
from ssd_trt.models.gguf_blocks import FLOAT_KINDS, LAYER_NAMES, PERMUTED_ROPE, BlockWeight, parse_blocks, rope_order

# GGUF architecture -> the HF model_type its tensors map onto (q / k rows stored permuted for PERMUTED_ROPE)
ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# non-layer tensors, GGUF name -> HF name
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
# per-layer tensors beyond the linear layers (gguf_blocks.LAYER_NAMES)
LAYER_EXTRA = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LAYER_TENSOR = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor (``blk.3.attn_q.bias`` -> ``model.layers.3.self_attn.q_proj.bias``), or None
    for a tensor the decoder does not read."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.match(gguf_name)
    if match is None:
        return None
    index, part, kind = match.groups()
    module = LAYER_NAMES.get(part) or LAYER_EXTRA.get(part)
    return None if module is None else f"model.layers.{index}.{module}.{kind}"


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def hf_config_from_gguf(reader, path: Path) -> dict[str, Any]:
    """An HF-style config dict from the GGUF's metadata (what ``DecoderConfig.from_hf_dict`` and transformers'
    ``AutoConfig.for_model`` read); refuses an architecture or a rope scaling the decoder does not implement."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise RecipeError(f"{path}: GGUF architecture {arch!r} is not supported; ssd-trt builds "
                          f"{', '.join(sorted(ARCHITECTURES))} GGUF files")
    if _field(reader, f"{arch}.rope.scaling.type", "none") not in ("none", None) or \
            any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise RecipeError(f"{path}: this GGUF scales its rotary frequencies, which the GGUF reader does not map yet; "
                          "build from the model's HF safetensors checkpoint instead")

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise RecipeError(f"{path}: the GGUF metadata has no {arch}.{key}; the file is incomplete or not a "
                              "decoder model")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    names = {t.name for t in reader.tensors}
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    vocab = int(embedding.shape[1]) if len(embedding.shape) == 2 else len(tokens or ())
    return {"model_type": ARCHITECTURES[arch], "architectures": [f"{ARCHITECTURES[arch].capitalize()}ForCausalLM"],
            "vocab_size": vocab, "hidden_size": hidden,
            "intermediate_size": int(need("feed_forward_length")), "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
            "head_dim": int(_field(reader, f"{arch}.attention.key_length", hidden // heads)),
            "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32"}


@dataclass
class GGUFCheckpoint(Checkpoint):
    """A checked GGUF file; tensors are read (dequantized, or as blocks) on demand. ``sources``: HF name -> the
    reader's tensor."""
    path: Path = Path()
    sources: dict[str, Any] = dataclasses.field(default_factory=dict)
    permuted_rope: bool = False

    @classmethod
    def open(cls, path: Path) -> "GGUFCheckpoint":
        import gguf
        path = Path(path)
        try:
            reader = gguf.GGUFReader(str(path))
        except (ValueError, OSError, KeyError, IndexError) as exc:
            raise RecipeError(f"{path} is not a readable GGUF file ({type(exc).__name__}: {exc}); re-download it "
                              "(e.g. `python -m ssd_trt.models.fetch`)") from None
        hf = hf_config_from_gguf(reader, path)
        try:
            config = DecoderConfig.from_hf_dict(hf)
        except (KeyError, ValueError, TypeError) as exc:
            raise RecipeError(f"{path}: its GGUF metadata does not describe a supported decoder ({exc})") from None
        sources, tensors = {}, {}
        for tensor in reader.tensors:
            name = hf_tensor_name(tensor.name)
            if name is None:
                continue
            # ggml lists dimensions fastest first: (K, N) is N rows of K, HF's [N, K]
            shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
            sources[name] = tensor
            tensors[name] = TensorInfo(path, "F32", shape, int(tensor.data_offset), int(tensor.n_bytes))
        checkpoint = cls(path.parent, hf, config, tensors, path=path, sources=sources,
                         permuted_rope=_field(reader, "general.architecture") in PERMUTED_ROPE)
        checkpoint._check_against_config()
        return checkpoint

    def kind(self, name: str) -> str:
        """The GGUF block type of tensor ``name`` (``Q4_K``, ``F32``, ...)."""
        return self.sources[name].tensor_type.name

    def _rope_rows(self, name: str) -> np.ndarray | None:
        """The row order that undoes llama.cpp's rotary permutation of q / k (None when not permuted)."""
        if not self.permuted_rope or not name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                                        "k_proj.bias")):
            return None
        heads = self.config.num_heads if ".q_proj." in name else self.config.num_kv_heads
        return rope_order(heads, self.config.head_dim)

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` in fp32 (HF orientation), dequantized as ggml defines its block type."""
        import gguf
        source = self.sources[name]
        kind = source.tensor_type
        # the first rows only when the checkpoint is cut to its first tokens (export/streamed.first_tokens): the
        # reader's array is [rows, row bytes] for blocks, [rows, columns] for floats
        raw = np.asarray(source.data)[:self.tensors[name].shape[0]]
        if kind.name in FLOAT_KINDS:
            values = raw.astype(np.float32)
        else:
            values = gguf.quants.dequantize(raw, kind)
        self._drop_pages()
        values = values.reshape(self.tensors[name].shape)
        rows = self._rope_rows(name)
        if rows is not None:
            values = values[rows]
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    def blocks(self, name: str) -> BlockWeight | None:
        """The file's own blocks of linear weight ``name`` (W^T [K, N], HF column order), or None for a float
        tensor. An unsupported block type fails here, naming the tensor and the type."""
        source = self.sources[name]
        kind = source.tensor_type.name
        if kind in FLOAT_KINDS or len(self.tensors[name].shape) != 2:
            return None
        n, k = self.tensors[name].shape
        try:
            weight = parse_blocks(np.asarray(source.data)[:n].reshape(n, -1), kind, k)
        except ValueError as exc:
            raise RecipeError(f"{self.path}: tensor {source.name} ({name}): {exc}") from None
        self._drop_pages()
        rows = self._rope_rows(name)
        return weight if rows is None else weight.permute_columns(rows)

    def _drop_pages(self) -> None:
        """Release the file mapping's resident pages (what was read has been copied out)."""
        mapping = _memmap_of(self.sources)
        if mapping is not None and hasattr(mapping, "madvise"):
            mapping.madvise(mmap.MADV_DONTNEED)


def _memmap_of(sources: dict[str, Any]):
    """The mmap object under the reader's arrays (np.memmap keeps it as ``_mmap`` on the base array)."""
    array = next(iter(sources.values())).data if sources else None
    while array is not None:
        found = getattr(array, "_mmap", None)
        if found is not None:
            return found
        array = getattr(array, "base", None)
    return None
