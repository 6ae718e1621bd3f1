"""An EAGLE-3 draft: a decoder layer that reads the target's own hidden states (Li et al., "EAGLE-3:
Scaling up Inference Acceleration of Large Language Models via Training-Time Test", arXiv 2503.01840),
optionally followed by more plain decoder layers (a larger draft for the size/cost frontier, issue 19 item 5).

The target exposes, for every token it computes, the residual stream entering three of its layers (a low,
a middle and a high one; ``feature_layers``, by default 2, L/2 and L-3 of an L-layer target, the released
checkpoints' choice). For a new token j at rotary position p_j the draft computes

    g_j = fc([f_low ; f_mid ; f_high])        the token carries the target's features (3H -> H), or
    g_j = h'_{j-1}                             it carries the draft's own predicted features (its last output)
    x_j = [input_layernorm(embed(t_j)) ; hidden_norm(g_j)]                 (2H wide)
    h_j = g_j + o_proj(attention(q/k/v_proj(x), RoPE at p_j, the draft's own KV cache, tree mask))
    h'_j = h_j + mlp(post_attention_layernorm(h_j))
    h'_j = layer_i(h'_j)                       for each extra decoder layer i (none in the released heads)
    logits_j = lm_head(norm(h'_j))            over the draft vocabulary: draft id d is target token d + d2t[d]

Features lag tokens by one, as in EAGLE: the token at position i+1 is fed with the features of position i
(what the target computed *for* the token it is conditioned on), and the output predicts position i+2.
``h'`` is returned with the logits: it is the predicted feature of the next token's step. Which tokens
carry which features in SD, SD trees and SSD is the decoding layer's business (issue 19, item 3); this
module only takes, per token, whether it carries the target's (``from_target``) or the draft's.

Attention is ``ssd::tree_attention``, as in :class:`~ssd_trt.models.decoder.Decoder`, so the layer exports
to the same step-graph flavours. The embedding is the target's (frozen; released checkpoints usually do
not ship it). The logits are over the target's vocabulary with -inf off the draft vocabulary, the
reduced-head convention of ``Decoder.head`` (lossless: verification evaluates q only at proposed tokens).

:func:`load_eagle3_checkpoint` reads the released layout (the one published for Llama-3.1-8B-Instruct and
Llama-3.3-70B-Instruct): ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` (+ optional
``embed_tokens``), from ``model.safetensors`` or ``pytorch_model.bin`` next to its ``config.json``. A draft
with ``num_hidden_layers`` = n > 1 (this project's extension; the released heads have 1) adds n - 1 plain
Llama decoder layers ``extra_layers.{i}.*`` after ``midlayer``, each with its own KV cache; its output hidden
(the carried feature) is the last layer's.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ssd_trt.errors import RecipeError
from ssd_trt.models.config import DecoderConfig
from ssd_trt.models.decoder import MLP, Attention, AttentionFn, DecoderLayer, RMSNorm, RotaryModule, \
    rope_inverse_frequencies, rotary_tables
from ssd_trt.models.tree_attention_op import tree_attention


def default_feature_layers(target_layers: int) -> tuple[int, int, int]:
    """The released EAGLE-3 heads' choice: the inputs of layers 2, L/2 and L-3."""
    return 2, target_layers // 2, target_layers - 3


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    """The draft layers' shape (a Llama config at the target's width; ``layer.num_layers`` counts the midlayer and
    the extra layers), its vocabulary, its features."""
    layer: DecoderConfig
    draft_vocab_size: int
    feature_layers: tuple[int, int, int]

    def __post_init__(self) -> None:
        if not 0 < self.draft_vocab_size <= self.layer.vocab_size:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) must be in 1..vocab_size "
                             f"({self.layer.vocab_size})")
        if self.layer.num_layers < 1:
            raise ValueError(f"an EAGLE-3 draft has at least one layer, got num_hidden_layers {self.layer.num_layers}")
        if len(self.feature_layers) != 3 or len(set(self.feature_layers)) != 3 or min(self.feature_layers) < 0:
            raise ValueError(f"feature_layers must be three distinct target layer indices, got {self.feature_layers}")

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], target_layers: int) -> "Eagle3Config":
        """From a released head's config.json (``LlamaForCausalLMEagle3``), for a target of ``target_layers``."""
        layer = DecoderConfig.from_hf_dict({**hf, "model_type": "llama",
                                            "num_hidden_layers": int(hf.get("num_hidden_layers") or 1),
                                            "tie_word_embeddings": False})
        eagle = hf.get("eagle_config") or {}
        layers = eagle.get("eagle_aux_hidden_state_layer_ids") or default_feature_layers(target_layers)
        if max(layers) >= target_layers:
            raise ValueError(f"feature layer {max(layers)} does not exist in a {target_layers}-layer target")
        return cls(layer=layer, draft_vocab_size=int(hf.get("draft_vocab_size") or hf["vocab_size"]),
                   feature_layers=tuple(int(i) for i in layers))


class Eagle3Layer(nn.Module):
    """The decoder layer reading [embedding ; features] (2H) with its own norms for each half."""

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, input_size=2 * config.hidden_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, embeds, hidden, cos, sin, cache_lengths, tree_mask, key_cache, value_cache,
                attention: AttentionFn = tree_attention):
        both = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        attn, key_cache, value_cache = self.self_attn(both, cos, sin, cache_lengths, tree_mask, key_cache,
                                                      value_cache, attention)
        hidden = hidden + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), key_cache, value_cache


class Eagle3Draft(RotaryModule):
    """(input_ids, position_ids, tree_mask, cache_lengths, features [B,T,3H], hidden [B,T,H],
    from_target [B,T] bool, *caches) -> (logits [B,L,V], hidden' [B,T,H], *caches); ``caches`` is
    (key, value) per layer, the midlayer's first."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        c = config.layer
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.fc = nn.Linear(3 * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(c)
        self.extra_layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers - 1))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("inv_freq", rope_inverse_frequencies(c), persistent=False)

    @property
    def rotary_config(self) -> DecoderConfig:
        return self.config.layer

    @property
    def draft_token_ids(self) -> torch.Tensor:
        """The target token id of each draft-vocabulary entry."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def forward(self, input_ids, position_ids, tree_mask, cache_lengths, features, hidden, from_target,
                *caches: torch.Tensor, attention: AttentionFn = tree_attention,
                logit_indices: torch.Tensor | None = None):
        embeds = self.embed_tokens(input_ids)
        # each token carries the target's fused features or the draft's own prediction (its last output)
        carried = torch.where(from_target[..., None], self.fc(features), hidden)
        cos, sin = rotary_tables(position_ids, self.inv_freq, embeds.dtype)
        out, new_caches = self.layers_forward(embeds, carried, cos, sin, cache_lengths, tree_mask, list(caches),
                                              [attention] * self.config.layer.num_layers)
        picked = out
        if logit_indices is not None:
            picked = torch.gather(out, 1, logit_indices[..., None].expand(-1, -1, out.shape[-1]))
        draft_logits = self.lm_head(self.norm(picked))
        full = torch.full(draft_logits.shape[:-1] + (self.config.layer.vocab_size,), float("-inf"),
                          dtype=draft_logits.dtype, device=draft_logits.device)
        index = self.draft_token_ids.expand(draft_logits.shape[:-1] + (-1,))
        return (full.scatter(-1, index, draft_logits), out, *new_caches)

    def layers_forward(self, embeds, carried, cos, sin, cache_lengths, tree_mask, caches: list[torch.Tensor],
                       attentions: list[AttentionFn]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The midlayer on [embeds ; carried], then each extra layer; ``caches`` and ``attentions`` per layer."""
        if len(caches) != 2 * self.config.layer.num_layers:
            raise ValueError(f"an EAGLE-3 draft of {self.config.layer.num_layers} layers takes "
                             f"{2 * self.config.layer.num_layers} caches, got {len(caches)}")
        x, key_cache, value_cache = self.midlayer(embeds, carried, cos, sin, cache_lengths, tree_mask, caches[0],
                                                  caches[1], attentions[0])
        new_caches = [key_cache, value_cache]
        for i, layer in enumerate(self.extra_layers, start=1):
            x, key_cache, value_cache = layer(x, cos, sin, cache_lengths, tree_mask, caches[2 * i],
                                              caches[2 * i + 1], attentions[i])
            new_caches += [key_cache, value_cache]
        return x, new_caches

    def empty_caches(self, batch: int, capacity: int) -> list[torch.Tensor]:
        c = self.config.layer
        shape = (batch, c.num_kv_heads, capacity, c.head_dim)
        return [torch.zeros(shape, dtype=self.embed_tokens.weight.dtype) for _ in range(2 * c.num_layers)]


# ---- the released checkpoint layout ----------------------------------------------------------------------------

def released_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of a released EAGLE-3 head and its shape (``embed_tokens.weight`` is optional)."""
    c, h = config.layer, config.layer.hidden_size
    # the midlayer is a decoder layer whose attention reads [embedding ; feature] (2H), with a second input norm
    midlayer = {**_decoder_layer_shapes(c, attention_input=2 * h), "hidden_norm.weight": (h,)}
    return {"fc.weight": (h, 3 * h),
            **{f"midlayer.{name}": shape for name, shape in midlayer.items()},
            **{f"extra_layers.{i}.{name}": shape for i in range(c.num_layers - 1)
               for name, shape in _decoder_layer_shapes(c, attention_input=h).items()},
            "norm.weight": (h,), "lm_head.weight": (config.draft_vocab_size, h),
            "d2t": (config.draft_vocab_size,), "t2d": (c.vocab_size,)}


def _decoder_layer_shapes(c: DecoderConfig, attention_input: int) -> dict[str, tuple[int, ...]]:
    """The tensors of one Llama decoder layer whose q/k/v projections read ``attention_input`` features."""
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, attention_input),
            "self_attn.k_proj.weight": (kv, attention_input), "self_attn.v_proj.weight": (kv, attention_input),
            "self_attn.o_proj.weight": (h, q), "post_attention_layernorm.weight": (h,),
            "mlp.gate_proj.weight": (c.intermediate_size, h), "mlp.up_proj.weight": (c.intermediate_size, h),
            "mlp.down_proj.weight": (h, c.intermediate_size)}


def _read_state(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        return state
    binary = directory / "pytorch_model.bin"
    if binary.is_file():
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise RecipeError(f"EAGLE-3 head {directory} has no model.safetensors or pytorch_model.bin")


def load_eagle3_checkpoint(directory: str | Path, target_layers: int,
                           target_embeddings: torch.Tensor | None = None) -> Eagle3Draft:
    """A released EAGLE-3 head (config.json + weights), its embedding from the checkpoint or the target's.

    Every tensor is checked by name and shape against the layout (``released_shapes``) and the vocabulary
    maps against each other; a mismatch is a RecipeError naming the tensor and what was expected.
    """
    directory = Path(directory)
    where = f"EAGLE-3 head {directory}"
    try:
        hf = json.loads((directory / "config.json").read_text())
        config = Eagle3Config.from_hf_dict(hf, target_layers)
    except FileNotFoundError:
        raise RecipeError(f"{where} has no config.json") from None
    except (KeyError, ValueError, TypeError) as error:
        raise RecipeError(f"{where}: config.json is not an EAGLE-3 head config ({error})") from None
    state = _read_state(directory)
    expected = released_shapes(config)
    missing = sorted(set(expected) - set(state))
    unknown = sorted(set(state) - set(expected) - {"embed_tokens.weight"})
    if missing or unknown:
        raise RecipeError(f"{where} does not have the EAGLE-3 layout: missing {missing}, unexpected {unknown}")
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise RecipeError(f"{where}: {name} has shape {list(state[name].shape)}, expected {list(shape)} for "
                              f"hidden_size {config.layer.hidden_size}, draft_vocab_size {config.draft_vocab_size}")
    embeddings = state.pop("embed_tokens.weight", None)
    if embeddings is None:
        embeddings = target_embeddings
    if embeddings is None:
        raise RecipeError(f"{where} ships no embed_tokens.weight: pass the target's embedding")
    if tuple(embeddings.shape) != (config.layer.vocab_size, config.layer.hidden_size):
        raise RecipeError(f"{where}: the embedding is {list(embeddings.shape)}, expected "
                          f"[{config.layer.vocab_size}, {config.layer.hidden_size}] (the target's)")
    d2t, t2d = state.pop("d2t").to(torch.int64), state.pop("t2d").to(torch.bool)
    target_ids = torch.arange(config.draft_vocab_size) + d2t
    if target_ids.min() < 0 or target_ids.max() >= config.layer.vocab_size or \
            len(set(target_ids.tolist())) != config.draft_vocab_size:
        raise RecipeError(f"{where}: d2t does not map the draft vocabulary to distinct target token ids")
    if int(t2d.sum()) != config.draft_vocab_size or not bool(t2d[target_ids].all()):
        raise RecipeError(f"{where}: t2d and d2t disagree on which target tokens the draft vocabulary holds")
    model = Eagle3Draft(config)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(embeddings.float())
        model.d2t.copy_(d2t)
        model.load_state_dict({name: tensor.float() for name, tensor in state.items()}, strict=False)
    loaded = set(state) | {"embed_tokens.weight", "d2t"}
    left = sorted(set(model.state_dict()) - loaded)
    if left:
        raise RecipeError(f"{where}: no weights for {left}")
    return model
