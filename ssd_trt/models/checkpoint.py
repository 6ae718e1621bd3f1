"""An HF safetensors checkpoint read lazily: one shard or many, each tensor read only when asked for.

Opening a checkpoint checks everything that can be checked without reading weights, so a bad checkpoint
fails in seconds, before any long work, with one paragraph saying what is wrong and how to fix it:
config.json (a supported architecture), the shard index (``model.safetensors.index.json``: every listed
shard present, every tensor it maps found in its shard), each shard's header (readable, and the file as long
as its header says: a truncated download is caught here), the dtypes (F32 / F16 / BF16), and the tensor
names and shapes against the decoder the config describes.

Reading is a plain positioned read of one tensor's bytes (:meth:`Checkpoint.tensor`), not a memory map: the
caller holds what it asked for and nothing else (a mapped shard's touched pages count as the process's resident
memory until it is unmapped: 2.2 GB for a 1B checkpoint, measured).
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ssd_trt.errors import RecipeError
from ssd_trt.models.config import DecoderConfig, decoder_config

INDEX_NAME = "model.safetensors.index.json"
FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
OTHER_DTYPES = {"I64": torch.int64}          # a reduced draft head's lm_head_token_ids


@dataclass(frozen=True)
class TensorInfo:
    shard: Path
    dtype: str            # safetensors' name: F32, BF16, ...
    shape: tuple[int, ...]
    offset: int = 0       # where its bytes start in the shard file
    nbytes: int = 0

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


def read_header(path: Path, with_data_start: bool = False):
    """A safetensors file's header, checked against the file's length (a truncated shard fails here); with
    ``with_data_start``, also the file offset its data_offsets count from."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        raw_length = handle.read(8)
        if len(raw_length) < 8:
            raise RecipeError(f"checkpoint shard {path} is not a safetensors file (only {size} bytes); "
                              "re-download or re-save it")
        (length,) = struct.unpack("<Q", raw_length)
        if length > size - 8 or length > 100 << 20:
            raise RecipeError(f"checkpoint shard {path} is corrupt: its header claims {length} bytes but the file "
                              f"has {size}; re-download or re-save it")
        try:
            header = json.loads(handle.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RecipeError(f"checkpoint shard {path} is corrupt: its header is not JSON ({exc}); re-download "
                              "or re-save it") from None
    header.pop("__metadata__", None)
    end = max((int(entry["data_offsets"][1]) for entry in header.values()), default=0)
    if 8 + length + end != size:
        raise RecipeError(f"checkpoint shard {path} is truncated or corrupt: its header describes "
                          f"{8 + length + end} bytes but the file has {size}; re-download or re-save it")
    return (header, 8 + length) if with_data_start else header


def expected_tensors(config: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of every weight a decoder of ``config`` reads (a tied head reads none)."""
    from ssd_trt.models.decoder import Decoder
    with torch.device("meta"):
        model = Decoder(config)
    shapes = {}
    for name, tensor in model.state_dict().items():
        shapes[name if name.startswith("lm_head") else f"model.{name}"] = tuple(tensor.shape)
    return shapes


@dataclass
class Checkpoint:
    """A checked HF checkpoint directory; tensors are read on demand."""
    directory: Path
    hf_config: dict[str, Any]
    config: DecoderConfig
    tensors: dict[str, TensorInfo]

    @classmethod
    def open(cls, directory: Path) -> "Checkpoint":
        directory = Path(directory)
        hf = read_config_json(directory)
        tensors = _index_tensors(directory)
        head_ids = tensors.get("lm_head_token_ids")
        config = decoder_config(hf, f"checkpoint {directory}: config.json",
                                head_vocab_size=None if head_ids is None else head_ids.numel)
        checkpoint = cls(directory, hf, config, tensors)
        checkpoint._check_against_config()
        return checkpoint

    def _check_against_config(self) -> None:
        expected = expected_tensors(self.config)
        # tied checkpoints sometimes carry the head's copy of the embedding anyway; the decoder ignores it
        ignored = {"lm_head.weight"} if "lm_head.weight" not in expected else set()
        missing = sorted(set(expected) - set(self.tensors))
        unexpected = sorted(n for n in set(self.tensors) - set(expected) - ignored
                            if not n.endswith("rotary_emb.inv_freq"))
        if missing or unexpected:
            raise RecipeError(f"checkpoint {self.directory} does not match the {self.config.model_type} decoder its "
                              f"config.json describes: missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, "
                              f"unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}; check that the "
                              "config and the weights belong together")
        wrong = [(n, self.tensors[n].shape, shape) for n, shape in expected.items()
                 if n in self.tensors and self.tensors[n].shape != shape]
        if wrong:
            name, got, want = wrong[0]
            raise RecipeError(f"checkpoint {self.directory}: tensor {name} is {list(got)} but config.json implies "
                              f"{list(want)} ({len(wrong)} tensors differ); the config and the weights do not match")
        for name, info in self.tensors.items():
            allowed = OTHER_DTYPES if name == "lm_head_token_ids" else FLOAT_DTYPES
            if info.dtype not in allowed:
                raise RecipeError(f"checkpoint {self.directory}: tensor {name} has dtype {info.dtype}, which ssd-trt "
                                  f"does not read (supported: {', '.join(allowed)}); convert the checkpoint, e.g. "
                                  "save it in bfloat16")

    @property
    def num_params(self) -> int:
        return sum(info.numel for name, info in self.tensors.items() if info.dtype in FLOAT_DTYPES)

    @property
    def largest_tensor_numel(self) -> int:
        return max(info.numel for info in self.tensors.values())

    @property
    def shards(self) -> list[Path]:
        return sorted({info.shard for info in self.tensors.values()})

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, read from its shard in the checkpoint's own dtype."""
        info = self.tensors[name]
        buffer = bytearray(info.nbytes)
        with open(info.shard, "rb") as handle:
            handle.seek(info.offset)
            if handle.readinto(buffer) != info.nbytes:
                raise RecipeError(f"checkpoint shard {info.shard} ended inside tensor {name}; re-download it")
        dtype = FLOAT_DTYPES.get(info.dtype) or OTHER_DTYPES[info.dtype]
        if not info.nbytes:
            return torch.empty(info.shape, dtype=dtype)
        return torch.frombuffer(buffer, dtype=dtype).reshape(info.shape)


def read_config_json(directory: Path) -> dict[str, Any]:
    """``directory/config.json`` as a dict, or a RecipeError that says what is wrong with it."""
    path = directory / "config.json"
    if not path.is_file():
        raise RecipeError(f"checkpoint {directory} has no config.json; point the source at an HF checkpoint dir")
    try:
        hf = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RecipeError(f"checkpoint {directory}: config.json is not valid JSON ({exc})") from None
    if not isinstance(hf, dict):
        raise RecipeError(f"checkpoint {directory}: config.json must be a JSON object")
    return hf


def _index_tensors(directory: Path) -> dict[str, TensorInfo]:
    """Tensor name -> where it is, from the shard index when there is one, else from every *.safetensors."""
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise RecipeError(f"checkpoint {directory}: {INDEX_NAME} is unreadable ({type(exc).__name__}: {exc}); it "
                              "must be JSON with a 'weight_map' of tensor name -> shard file") from None
        shard_names = sorted(set(weight_map.values()))
        missing = [name for name in shard_names if not (directory / name).is_file()]
        if missing:
            raise RecipeError(f"checkpoint {directory} is incomplete: {INDEX_NAME} lists shard(s) "
                              f"{', '.join(missing)} that are not there ({len(shard_names) - len(missing)} of "
                              f"{len(shard_names)} present); download the missing shard(s)")
        shards = [directory / name for name in shard_names]
    else:
        shards = sorted(directory.glob("*.safetensors"))
        if not shards:
            raise RecipeError(f"checkpoint {directory} has no *.safetensors weights")
        weight_map = None
    tensors: dict[str, TensorInfo] = {}
    for shard in shards:
        header, data_start = read_header(shard, with_data_start=True)
        for name, entry in header.items():
            if name in tensors:
                raise RecipeError(f"checkpoint {directory}: tensor {name} is in both {tensors[name].shard.name} and "
                                  f"{shard.name}; remove the stray file")
            begin, end = (int(x) for x in entry["data_offsets"])
            tensors[name] = TensorInfo(shard, entry["dtype"], tuple(entry["shape"]), data_start + begin, end - begin)
    if weight_map is not None:
        misplaced = [n for n, file in weight_map.items() if n not in tensors or tensors[n].shard.name != file]
        if misplaced:
            raise RecipeError(f"checkpoint {directory}: {INDEX_NAME} maps {misplaced[0]} to "
                              f"{weight_map[misplaced[0]]}, which does not hold it ({len(misplaced)} such tensors); "
                              "the index and the shards do not belong together")
    return tensors


def count_params(source) -> int:
    """Float parameters in a model source (a GGUF file or an HF dir), from headers only (no weights read)."""
    if source.kind == "gguf":
        from gguf import GGUFReader
        return sum(int(tensor.n_elements) for tensor in GGUFReader(str(source.path)).tensors)
    return sum(TensorInfo(shard, entry["dtype"], tuple(entry["shape"])).numel
               for shard in sorted(Path(source.path).glob("*.safetensors"))
               for entry in read_header(shard).values() if entry["dtype"] in FLOAT_DTYPES)
