"""The CPU kernel's build artifact of one model: every linear layer and the head as GGUF tiles, with the float tensors
the step needs, in one file beside an index.

``cpu_tiles.bin`` holds, each at a 64-byte aligned offset, the tiles of every linear layer (``tiles.tile_gguf``: the
file's own blocks repacked, no value changed), the token embedding's and the head's (a tied model's head is its
embedding's tiles, stored once), the RMSNorm weights, Qwen2's q/k/v biases, Qwen3's q/k norms, and the rotary tables
cos / sin [positions, head_dim / 2] as the torch model computes them. ``cpu_tiles.json`` says where each is and the
model's shape. Written by the build for a ``weights: gguf`` / ``activations: int8`` model
(``write_cpu_tiles``); read by the native engine (``load_cpu_tiles``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ssd_trt.errors import ArtifactError
from ssd_trt.kernels.tiles import GGML_TYPE, TiledWeight, tile_gguf

CPU_TILES_FLAVOUR = "cpu_tiles"      # the manifest's flavour of both files
TILES_FILE = "cpu_tiles.bin"
INDEX_FILE = "cpu_tiles.json"
FORMAT = 1
ALIGN = 64
LINEAR = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
          "ffn_down": "down"}
FLOATS = {"attn_norm": "attn_norm", "ffn_norm": "mlp_norm", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}
BIASES = {"attn_q": "q_bias", "attn_k": "k_bias", "attn_v": "v_bias"}
SHAPE = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size", "vocab_size")


def unsupported_reason(config, feature_layers: bool = False) -> str | None:
    """Why the native step cannot run a decoder of this config (None: it can)."""
    if feature_layers:
        return "a target returning features for an EAGLE-3 draft"
    if config.head_vocab_size is not None:
        return "a reduced draft head (lm_head_token_ids)"
    if config.head_dim % 8:
        return f"head_dim {config.head_dim} is not a multiple of 8"
    for name in ("hidden_size", "intermediate_size"):
        if getattr(config, name) % 32:
            return f"{name} {getattr(config, name)} is not a multiple of 32 (the int8 activation blocks)"
    if config.num_heads * config.head_dim % 32:
        return f"heads * head_dim {config.num_heads * config.head_dim} is not a multiple of 32"
    return None


def rotary_tables(config, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos / sin [positions, head_dim / 2]: fp32 angles position * inv_freq, fp32 cos / sin (as the torch model)."""
    import torch

    from ssd_trt.models.decoder import rope_inverse_frequencies
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * rope_inverse_frequencies(config).float()[None]
    return angles.cos().numpy(), angles.sin().numpy()


def write_cpu_tiles(gguf_path: Path, config, out_dir: Path, positions: int) -> list[Path]:
    """The artifact of the GGUF model ``gguf_path`` (``config``: its DecoderConfig) in ``out_dir``; ``positions``: the
    rotary table's length (every position id must be below it). Raises ValueError with the reason when a tensor is
    not a block kind the kernel reads."""
    import gguf

    from ssd_trt.models.gguf_blocks import PERMUTED_ROPE, rope_order
    reason = unsupported_reason(config)
    if reason:
        raise ValueError(reason)
    reader = gguf.GGUFReader(str(gguf_path))
    architecture = reader.fields["general.architecture"].contents()
    tensors = {t.name: t for t in reader.tensors}
    entries: dict[str, dict] = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    tiles_path = out_dir / TILES_FILE
    with open(tiles_path, "wb") as sink:
        def put(name: str, data: np.ndarray, entry: dict) -> None:
            sink.write(b"\0" * (-sink.tell() % ALIGN))
            entries[name] = {**entry, "offset": sink.tell(), "nbytes": int(data.nbytes)}
            sink.write(np.ascontiguousarray(data).tobytes())

        def linear(name: str, gguf_name: str, heads: int | None = None) -> None:
            tensor = tensors.get(gguf_name)
            if tensor is None:
                raise ValueError(f"{gguf_path} has no tensor {gguf_name}")
            kind = tensor.tensor_type.name
            if kind not in GGML_TYPE:
                raise ValueError(f"{gguf_name} is {kind}, which the CPU kernel does not read (it reads "
                                 f"{', '.join(GGML_TYPE)})")
            raw = np.asarray(tensor.data)
            k, n = int(tensor.shape[0]), int(tensor.shape[1])
            raw = raw.reshape(n, -1)
            if heads is not None and architecture in PERMUTED_ROPE:   # undo llama.cpp's interleaved q / k rows
                raw = raw[rope_order(heads, config.head_dim)]
            tiled = tile_gguf(raw, kind, k)
            put(name, tiled.tiles, {"kind": kind, "k": k, "n": n})

        def floats(name: str, gguf_name: str, size: int, required: bool = True) -> None:
            tensor = tensors.get(gguf_name)
            if tensor is None:
                if required:
                    raise ValueError(f"{gguf_path} has no tensor {gguf_name}")
                return
            values = np.asarray(tensor.data).astype(np.float32).reshape(-1)
            if values.size != size:
                raise ValueError(f"{gguf_name} has {values.size} values, the config gives {size}")
            put(name, values, {"shape": [size]})

        c = config
        qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        linear("embed", "token_embd.weight")
        if "output.weight" in tensors:
            linear("head", "output.weight")
        floats("final_norm", "output_norm.weight", c.hidden_size)
        for i in range(c.num_layers):
            for gguf_name, name in LINEAR.items():
                heads = c.num_heads if name == "q" else c.num_kv_heads if name == "k" else None
                linear(f"layers.{i}.{name}", f"blk.{i}.{gguf_name}.weight", heads)
            for gguf_name, name in FLOATS.items():
                size = c.head_dim if name in ("q_norm", "k_norm") else c.hidden_size
                floats(f"layers.{i}.{name}", f"blk.{i}.{gguf_name}.weight", size,
                       required=name in ("attn_norm", "mlp_norm"))
            for gguf_name, name in BIASES.items():
                floats(f"layers.{i}.{name}", f"blk.{i}.{gguf_name}.bias", qd if name == "q_bias" else kd,
                       required=False)
        cos, sin = rotary_tables(c, positions)
        put("cos", cos, {"shape": list(cos.shape)})
        put("sin", sin, {"shape": list(sin.shape)})
    vocab = entries["embed"]["n"]
    if vocab != c.vocab_size or entries["embed"]["k"] != c.hidden_size:
        raise ValueError(f"token_embd is [{entries['embed']['k']}, {vocab}], the config says "
                         f"[{c.hidden_size}, {c.vocab_size}]")
    index = {"format": FORMAT, "source": str(gguf_path), "architecture": architecture,
             "shape": {name: getattr(c, name) for name in SHAPE}, "rms_norm_eps": c.rms_norm_eps,
             "positions": positions, "bytes": tiles_path.stat().st_size, "tensors": entries}
    index_path = out_dir / INDEX_FILE
    index_path.write_text(json.dumps(index, indent=1))
    return [tiles_path, index_path]


@dataclass
class CpuTiles:
    """A loaded artifact: the index and the file's bytes (every tensor a view into them)."""
    index: dict
    data: np.ndarray

    @property
    def shape(self) -> dict[str, int]:
        return self.index["shape"]

    def has(self, name: str) -> bool:
        return name in self.index["tensors"]

    def weight(self, name: str) -> TiledWeight:
        entry = self.index["tensors"][name]
        return TiledWeight(entry["kind"], entry["k"], entry["n"], self._bytes(entry))

    def floats(self, name: str) -> np.ndarray | None:
        entry = self.index["tensors"].get(name)
        return None if entry is None else self._bytes(entry).view(np.float32).reshape(entry["shape"])

    def _bytes(self, entry: dict) -> np.ndarray:
        return self.data[entry["offset"]:entry["offset"] + entry["nbytes"]]


def load_cpu_tiles(folder: Path) -> CpuTiles:
    """The artifact in ``folder`` (ArtifactError naming the file when it is missing or does not fit its index)."""
    index_path, tiles_path = folder / INDEX_FILE, folder / TILES_FILE
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError) as exc:
        raise ArtifactError(f"{index_path}: cannot read the CPU kernel's index ({exc}); rebuild") from None
    if index.get("format") != FORMAT:
        raise ArtifactError(f"{index_path} is format {index.get('format')}, this ssd-trt reads {FORMAT}; rebuild")
    if not tiles_path.is_file() or tiles_path.stat().st_size != index["bytes"]:
        raise ArtifactError(f"{tiles_path} is missing or not the {index['bytes']} bytes its index says; rebuild")
    # read into the process (not mapped): the kernel streams every byte of it each step
    data = np.fromfile(tiles_path, dtype=np.uint8)
    return CpuTiles(index, data)
