"""Load a :class:`Decoder` (fp32 unless asked otherwise) and its tokenizer from a resolved source."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from ssd_trt.models.checkpoint import Checkpoint
from ssd_trt.models.config import DecoderConfig
from ssd_trt.models.decoder import Decoder
from ssd_trt.models.sources import ResolvedSource


def read_hf_checkpoint(source: ResolvedSource, dtype: torch.dtype = torch.float32
                       ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Return (HF config dict, state dict with HF parameter names, floats in ``dtype``).

    An HF dir is opened as a checked :class:`Checkpoint` (sharded or not: a missing or corrupt shard fails
    before anything is read) and each tensor is converted as it is read, so no second copy of the model in
    the checkpoint's own dtype is held."""
    if source.kind == "gguf":
        from transformers import AutoModelForCausalLM  # GGUF dequantisation lives in transformers+gguf
        model = AutoModelForCausalLM.from_pretrained(source.directory, gguf_file=source.path.name,
                                                     dtype=torch.float32)
        return model.config.to_dict(), {k: v.to(dtype) for k, v in model.state_dict().items()}
    checkpoint = Checkpoint.open(source.path)
    state = {}
    for name in checkpoint.tensors:
        tensor = checkpoint.tensor(name)
        state[name] = tensor if not tensor.is_floating_point() else tensor.to(dtype)
    return checkpoint.hf_config, state


def decoder_from_checkpoint(hf: dict[str, Any], state: dict[str, torch.Tensor],
                            config: DecoderConfig | None = None) -> Decoder:
    """Build a Decoder around HF-named weights (the tensors themselves, no copy); refuses missing or unexpected
    tensors. ``config``: the decoder to build instead of the one ``hf`` describes (a tensor-parallel rank's shard,
    ``models/rank_decoder.py``)."""
    from ssd_trt.models.decoder import rope_inverse_frequencies
    if config is None:
        head_ids = state.get("lm_head_token_ids")
        config = DecoderConfig.from_hf_dict(hf, head_vocab_size=None if head_ids is None else int(head_ids.numel()))
    with torch.device("meta"):      # no random initialisation of weights that are replaced next
        model = Decoder(config)
    renamed = {}
    for name, tensor in state.items():
        if name == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the head is the embedding matrix
        renamed[name.removeprefix("model.")] = tensor
    missing, unexpected = model.load_state_dict(renamed, strict=False, assign=True)
    missing = [m for m in missing if m != "inv_freq"]
    model.inv_freq = rope_inverse_frequencies(config)
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match a {config.model_type} decoder: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    return model.eval()


def load_decoder(source: ResolvedSource, dtype: torch.dtype = torch.float32) -> tuple[Decoder, dict[str, Any]]:
    """The source's decoder with its weights in ``dtype`` (the rotary frequencies stay fp32)."""
    hf, state = read_hf_checkpoint(source, dtype)
    model = decoder_from_checkpoint(hf, state)
    return (model if dtype == torch.float32 else model.to(dtype)), hf


def load_tokenizer(source: ResolvedSource):
    from transformers import AutoTokenizer
    try:
        if source.kind == "gguf":
            return AutoTokenizer.from_pretrained(source.directory, gguf_file=source.path.name)
        return AutoTokenizer.from_pretrained(source.path)
    except (OSError, ValueError, TypeError) as exc:
        from ssd_trt.errors import RecipeError
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RecipeError(f"model source {source.path} has no usable tokenizer ({first_line}); ship the "
                          f"tokenizer files (tokenizer.json, tokenizer_config.json) next to the weights") from None


@contextmanager
def transformers_progress_bars_off() -> Iterator[None]:
    """Silence transformers' own per-load bars inside a caller that shows its own progress (the build);
    restores the previous setting. (Its GGUF dequantisation bar uses tqdm directly and still shows.)"""
    from transformers.utils import logging
    was_on = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            logging.enable_progress_bar()
