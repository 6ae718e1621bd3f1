"""A Llama-family decoder whose only attention is ``ssd::tree_attention``.

One forward serves prefill, decode, chain verification and tree decoding: the caller gives the new
tokens, their rotary positions (tree siblings share a position), a packed tree mask over the new
tokens and the KV caches with their lengths. Supports Llama/SmolLM2/Mistral, Qwen2 (q/k/v biases)
and Qwen3 (per-head q/k RMSNorm), and a reduced draft head (``lm_head_token_ids``).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

from ssd_trt.models.config import DecoderConfig
from ssd_trt.models.tree_attention_op import tree_attention

# (query, key_new, value_new, key_cache, value_cache, cache_lengths, tree_mask, scale) -> (out, key_cache, value_cache)
AttentionFn = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rope_inverse_frequencies(config: DecoderConfig) -> torch.Tensor:
    """theta^(-2i/D), with Llama-3's long-context rescaling when the config asks for it."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    s = config.rope_scaling
    if s:
        # Llama 3.1: wavelengths longer than original_ctx/low_freq_factor are divided by `factor`,
        # shorter than original_ctx/high_freq_factor are kept, and the band between is interpolated.
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        original = s["original_max_position_embeddings"]
        wavelength = 2 * math.pi / inv
        smooth = ((original / wavelength) - low) / (high - low)
        scaled = torch.where(wavelength > original / low, inv / factor, inv)
        between = (wavelength <= original / low) & (wavelength >= original / high)
        inv = torch.where(between, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.float()


def rotary_tables(position_ids: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [B, 1, T, D] of each token's rotary angles (fp32 angles, cast to the model's type)."""
    angles = position_ids.to(torch.float32)[..., None] * inv_freq  # [B, T, D/2]
    angles = torch.cat((angles, angles), dim=-1)[:, None, :, :]          # [B, 1, T, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


class RotaryModule(nn.Module):
    """A module with an ``inv_freq`` buffer for ``rotary_config``, kept fp32 whatever the module is cast to."""
    rotary_config: DecoderConfig

    def _apply(self, fn, recurse=True):
        """As nn.Module's (``.to``, ``.half``, ``.cuda``), but the rotary frequencies stay fp32: a half-precision
        theta^(-2i/D) is off by up to 5e-4 relative, i.e. by whole radians of rotary angle at positions in the
        thousands (a 2048-token fp16 model's keys were wrong by 0.4 before this)."""
        super()._apply(fn, recurse)
        self.inv_freq = rope_inverse_frequencies(self.rotary_config).to(self.inv_freq.device)
        return self


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: DecoderConfig, input_size: int | None = None) -> None:
        """``input_size``: width of what the q/k/v projections read (default hidden_size; EAGLE-3's layer
        reads [embedding ; features], twice that)."""
        super().__init__()
        c = config
        width = input_size or c.hidden_size
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.q_proj = nn.Linear(width, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(width, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(width, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.scale = c.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_lengths: torch.Tensor,
                tree_mask: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                attention: AttentionFn = tree_attention):
        batch, num_new, _ = x.shape
        q = self.q_proj(x).view(batch, num_new, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, num_new, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, num_new, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out, key_cache, value_cache = attention(q, k, v, key_cache, value_cache, cache_lengths, tree_mask,
                                                self.scale)
        out = out.transpose(1, 2).reshape(batch, num_new, self.num_heads * self.head_dim)
        return self.o_proj(out), key_cache, value_cache


class MLP(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, cache_lengths, tree_mask, key_cache, value_cache,
                attention: AttentionFn = tree_attention):
        attn, key_cache, value_cache = self.self_attn(self.input_layernorm(x), cos, sin, cache_lengths,
                                                      tree_mask, key_cache, value_cache, attention)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), key_cache, value_cache


class Decoder(RotaryModule):
    """The step graph: (input_ids, position_ids, tree_mask, cache_lengths, *caches) -> (logits, *caches).

    ``logit_indices`` [B, L] (keyword) picks the new tokens whose logits are computed (None: all of them);
    the exported graph takes it as an input (``export/onnx_export.py``).

    ``caches`` alternates key/value per layer: past_key_0, past_value_0, past_key_1, ...

    ``feature_layers`` (empty by default; :func:`with_target_features`): the layers whose input residual
    stream every new token also returns, concatenated, as a last output ``features`` [B, T, n*H] (what an
    EAGLE-3 draft reads, ``models/eagle3.py``).
    """
    feature_layers: tuple[int, ...] = ()

    def __init__(self, config: DecoderConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        head_rows = c.head_vocab_size or c.vocab_size
        self.lm_head = None if (c.tie_word_embeddings and c.head_vocab_size is None) else \
            nn.Linear(c.hidden_size, head_rows, bias=False)
        if c.head_vocab_size is not None:
            self.register_buffer("lm_head_token_ids", torch.zeros(c.head_vocab_size, dtype=torch.int64))
        else:
            self.lm_head_token_ids = None
        self.register_buffer("inv_freq", rope_inverse_frequencies(c), persistent=False)

    @property
    def rotary_config(self) -> DecoderConfig:
        return self.config

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden @ self.embed_tokens.weight.t() if self.lm_head is None else self.lm_head(hidden)
        if self.lm_head_token_ids is None:
            return logits
        # Reduced draft head: tokens outside the subset get -inf, i.e. q = 0. Lossless, because
        # verification only ever evaluates p/q at proposed tokens and the residual there is p.
        full = torch.full(logits.shape[:-1] + (self.config.vocab_size,), float("-inf"), dtype=logits.dtype,
                          device=logits.device)
        index = self.lm_head_token_ids.expand(logits.shape[:-1] + (-1,))
        return full.scatter(-1, index, logits)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, tree_mask: torch.Tensor,
                cache_lengths: torch.Tensor, *caches: torch.Tensor, attention: AttentionFn = tree_attention,
                logit_indices: torch.Tensor | None = None):
        """``attention`` runs ``ssd::tree_attention``: the custom op by default (what the exporters trace);
        the GPU runtime passes the Triton kernel updating the caches in place (``engines/device_step.py``)."""
        if len(caches) != 2 * self.config.num_layers:
            raise ValueError(f"expected {2 * self.config.num_layers} cache tensors, got {len(caches)}")
        x = self.embed_tokens(input_ids)
        cos, sin = rotary_tables(position_ids, self.inv_freq, x.dtype)
        new_caches: list[torch.Tensor] = []
        features: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            if i in self.feature_layers:
                features.append(x)
            x, key_cache, value_cache = layer(x, cos, sin, cache_lengths, tree_mask,
                                              caches[2 * i], caches[2 * i + 1], attention)
            new_caches += [key_cache, value_cache]
        if logit_indices is not None:   # only these tokens pay the final norm and the LM head
            x = torch.gather(x, 1, logit_indices[..., None].expand(-1, -1, x.shape[-1]))
        outputs = (self.head(self.norm(x)), *new_caches)
        return outputs + (torch.cat(features, dim=-1),) if self.feature_layers else outputs

    def empty_caches(self, batch: int, capacity: int) -> list[torch.Tensor]:
        c = self.config
        shape = (batch, c.num_kv_heads, capacity, c.head_dim)
        dtype = self.embed_tokens.weight.dtype
        return [torch.zeros(shape, dtype=dtype) for _ in range(2 * c.num_layers)]


class TransposedLinear(nn.Module):
    """y = x @ weight_t (+ bias): a linear layer whose weight, stored [in, out], exports as a graph
    initializer named ``<module>.weight_t`` (torch's Linear exports an anonymous transposed copy), so the
    build can find each layer's weight in the traced graph (``export/block_weights.py``)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(weight.detach().t().contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def with_named_weights(model: Decoder) -> Decoder:
    """A copy of ``model`` computing the same function with every linear layer, the LM head included (a
    tied head becomes its own copy of the embedding), as a :class:`TransposedLinear`."""
    import copy
    named = copy.deepcopy(model)
    for module in list(named.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, TransposedLinear(child.weight, child.bias))
    if named.lm_head is None:
        named.lm_head = TransposedLinear(named.embed_tokens.weight)
    return named


def with_target_features(model: Decoder, layers: tuple[int, ...]) -> Decoder:
    """A copy of ``model`` that also returns the residual stream entering each of ``layers`` (see Decoder)."""
    import copy
    if not layers or len(set(layers)) != len(layers) or not all(0 <= i < model.config.num_layers for i in layers):
        raise ValueError(f"feature layers {layers} must be distinct layers of a {model.config.num_layers}-layer model")
    featured = copy.deepcopy(model)
    featured.feature_layers = tuple(sorted(layers))
    return featured
