"""Check the project's decoder against transformers' implementation of the same checkpoint."""
from __future__ import annotations

import torch

from plugins.tree_attention.reference import causal_tree_mask
from ssd_trt.models.decoder import Decoder
from ssd_trt.models.sources import ResolvedSource

PARITY_TOKENS = [1, 504, 3458, 282, 4649, 314, 1127, 28, 198, 2683, 30, 42, 7, 100]


def decoder_logits(model: Decoder, ids: torch.Tensor) -> torch.Tensor:
    num = ids.shape[1]
    with torch.no_grad():
        return model(ids, torch.arange(num)[None], torch.from_numpy(causal_tree_mask(1, num)),
                     torch.zeros(1, dtype=torch.int32), *model.empty_caches(1, num))[0]


def transformers_parity(model: Decoder, source: ResolvedSource) -> dict:
    """Max |logit difference| vs transformers (fp32), or the reason it could not be measured."""
    from transformers import AutoModelForCausalLM
    if model.lm_head_token_ids is not None:
        return {"max_abs_diff": None, "reason": "reduced draft head: not a transformers architecture"}
    kwargs = {"gguf_file": source.path.name} if source.kind == "gguf" else {}
    reference = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **kwargs).eval()
    ids = torch.tensor([[t % model.config.vocab_size for t in PARITY_TOKENS]])
    with torch.no_grad():
        expected = reference(ids).logits
    diff = float((decoder_logits(model, ids) - expected).abs().max())
    return {"max_abs_diff": diff, "logit_scale": float(expected.abs().max()), "tokens": ids.shape[1]}
