"""Check the project's decoder against transformers' implementation of the same checkpoint."""
from __future__ import annotations

import torch

from ssd_trt_plugins.tree_attention.masks import causal_tree_mask
from ssd_trt.models.decoder import Decoder
from ssd_trt.models.sources import ResolvedSource

PARITY_TOKENS = [1, 504, 3458, 282, 4649, 314, 1127, 28, 198, 2683, 30, 42, 7, 100]


def decoder_logits(model: Decoder, ids: torch.Tensor) -> torch.Tensor:
    num = ids.shape[1]
    with torch.no_grad():
        return model(ids, torch.arange(num)[None], torch.from_numpy(causal_tree_mask(1, num)),
                     torch.zeros(1, dtype=torch.int32), *model.empty_caches(1, num))[0]


def transformers_parity(model: Decoder, source: ResolvedSource) -> dict:
    """Max |logit difference| vs transformers (fp32) on a fixed token sequence.

    A full-vocabulary model is compared with transformers' ``AutoModelForCausalLM`` of the same files.
    A reduced draft head (``lm_head_token_ids``) is no transformers architecture, so its body is: the
    checkpoint's decoder weights load into transformers' ``AutoModel`` (embeddings, layers, final norm),
    whose last hidden state times the reduced head is compared on the head's token subset.
    """
    ids = torch.tensor([[t % model.config.vocab_size for t in PARITY_TOKENS]])
    ours = decoder_logits(model, ids)
    if model.lm_head_token_ids is None:
        expected = _causal_lm(source)(ids).logits
        reference = "transformers AutoModelForCausalLM"
    else:
        with torch.no_grad():
            hidden = _body(source)(ids).last_hidden_state
            expected = hidden @ model.lm_head.weight.t()
        ours = ours[..., model.lm_head_token_ids]
        reference = "transformers AutoModel (body) x the reduced head, on its token subset"
    diff = float((ours - expected).abs().max())
    return {"max_abs_diff": diff, "logit_scale": float(expected.abs().max()), "tokens": ids.shape[1],
            "reference": reference}


def _causal_lm(source: ResolvedSource):
    from transformers import AutoModelForCausalLM
    kwargs = {"gguf_file": source.path.name} if source.kind == "gguf" else {}
    model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **kwargs).eval()
    return lambda ids: _no_grad(model, ids)


def _body(source: ResolvedSource):
    """transformers' base model with the checkpoint's non-head weights (strict: every tensor must match)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModel
    config = AutoConfig.from_pretrained(source.path)
    body = AutoModel.from_config(config, dtype=torch.float32).eval()
    state = {}
    for file in sorted(source.path.glob("*.safetensors")):
        state.update({name.removeprefix("model."): tensor.float() for name, tensor in load_file(file).items()
                      if not name.startswith("lm_head")})
    body.load_state_dict(state, strict=True)
    return lambda ids: _no_grad(body, ids)


def _no_grad(model, ids: torch.Tensor):
    with torch.no_grad():
        return model(ids)
