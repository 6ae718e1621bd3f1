"""The draft model: a narrow Llama with an optional reduced output head.

Math is standard HF Llama (RMSNorm, non-interleaved "rotate_half" RoPE, grouped-query
attention, SwiGLU MLP, no biases), so the saved checkpoint is read by any Llama loader; the
parameter names are HF's. The one extension is the reduced head: ``lm_head.weight`` has one row
per token in ``lm_head_token_ids`` (sorted, unique) and every other token gets logit -inf, i.e.
probability 0. Speculative decoding stays lossless with such a draft: a token the draft never
proposes simply has q = 0, and verification only ever divides by q of proposed tokens.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class DraftConfig:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 5
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    vocab_size: int = 49152
    max_position_embeddings: int = 8192
    bos_token_id: int = 1
    eos_token_id: int = 2

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

    def hf_config(self, reduced_head: bool) -> dict:
        """The config.json the engine's loader reads (HF LlamaConfig keys)."""
        d = asdict(self)
        d.update(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
                 attention_bias=False, mlp_bias=False, tie_word_embeddings=False, torch_dtype="bfloat16")
        if reduced_head:
            d["reduced_lm_head"] = True  # informational; the tensor lm_head_token_ids is authoritative
        return d

    @classmethod
    def from_hf(cls, d: dict) -> "DraftConfig":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rope(pos: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [..., T, head_dim] for integer positions ``pos`` [..., T]."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    f = pos.float()[..., None] * inv
    emb = torch.cat((f, f), dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: list[torch.Tensor] | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        c = self.c
        q = self.q_proj(x).view(B, T, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        past = 0
        if cache is not None:  # [k, v] lists, extended in place (batch-1 timing / eval use)
            if cache:
                past = cache[0].shape[2]
                k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
                cache[0], cache[1] = k, v
            else:
                cache.extend([k, v])
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if past == 0:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            # new queries sit at positions past..past+T-1 and may see keys up to their own position
            mask = torch.ones(T, past + T, dtype=torch.bool).tril(past)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class DraftModel(nn.Module):
    """Llama decoder whose head covers ``head_ids`` (a subset of the vocabulary) or all of it."""

    def __init__(self, c: DraftConfig, head_ids: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = c
        self.model = Backbone(c)
        if head_ids is not None:
            head_ids = torch.as_tensor(head_ids, dtype=torch.int64)
            if head_ids.ndim != 1 or not bool((head_ids[1:] > head_ids[:-1]).all()):
                raise ValueError("lm_head_token_ids must be a sorted 1-D tensor of unique ids")
            if int(head_ids[0]) < 0 or int(head_ids[-1]) >= c.vocab_size:
                raise ValueError("lm_head_token_ids out of vocabulary range")
        n_out = c.vocab_size if head_ids is None else len(head_ids)
        self.lm_head = nn.Linear(c.hidden_size, n_out, bias=False)
        self.register_buffer("lm_head_token_ids", head_ids, persistent=False)
        self.apply(self._init)
        # GPT-2 style: shrink the residual-branch outputs so a deep random stack starts near identity.
        for layer in self.model.layers:
            for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
                nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * c.num_hidden_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def hidden(self, ids: torch.Tensor, pos: torch.Tensor | None = None,
               cache: list[list[torch.Tensor]] | None = None) -> torch.Tensor:
        """Final normed hidden states [B, T, d]; ``cache`` is one [k, v] list per layer."""
        B, T = ids.shape
        if pos is None:
            past = cache[0][0].shape[2] if cache and cache[0] else 0
            pos = torch.arange(past, past + T)[None].expand(B, T)
        cos, sin = rope(pos, self.config.head_dim, self.config.rope_theta)
        x = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, None if cache is None else cache[i])
        return self.model.norm(x)

    def head_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the head's own rows (the subset when reduced): what training uses."""
        return self.lm_head(h)

    def full_logits(self, h: torch.Tensor) -> torch.Tensor:
        """Logits over the full vocabulary: -inf off the head subset, so q = 0 there."""
        sub = self.lm_head(h)
        if self.lm_head_token_ids is None:
            return sub
        out = torch.full((*sub.shape[:-1], self.config.vocab_size), float("-inf"), dtype=sub.dtype)
        out[..., self.lm_head_token_ids] = sub
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.full_logits(self.hidden(ids))

    def macs_per_token(self) -> int:
        """Multiply-accumulates of one decode step excluding attention over the cache and the
        embedding gather (a lookup, no MACs): all linear layers plus the head."""
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))


def save_draft(model: DraftModel, out_dir: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Write ``config.json`` + ``model.safetensors`` in the engine's documented format."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    reduced = model.lm_head_token_ids is not None
    tensors = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if reduced:
        tensors["lm_head_token_ids"] = model.lm_head_token_ids.to(torch.int64).contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(model.config.hf_config(reduced), indent=2) + "\n")


def load_draft(path: Path) -> DraftModel:
    """Read a directory written by :func:`save_draft` back as an fp32 model."""
    from safetensors.torch import load_file

    cfg_path, w_path = Path(path) / "config.json", Path(path) / "model.safetensors"
    if not cfg_path.exists() or not w_path.exists():
        raise ValueError(f"{path} must contain config.json and model.safetensors")
    c = DraftConfig.from_hf(json.loads(cfg_path.read_text()))
    t = load_file(str(w_path))
    ids = t.pop("lm_head_token_ids", None)
    m = DraftModel(c, ids)
    m.load_state_dict({k: v.float() for k, v in t.items()})
    return m.eval()


def init_from_target(model: DraftModel, target) -> float:
    """Initialise embeddings and head from the target's (tied) embedding matrix.

    The draft width d is smaller than the target's, so the target's embedding E [V, D] is
    projected onto its top-d right singular vectors U [D, d]: E U keeps the directions along
    which token embeddings differ most, and because the target's head is tied to E, the draft
    head rows E_sub U reproduce the target's logit geometry h·e ≈ (hU)·(eU) from step 0.
    Returns the fraction of E's energy the projection keeps.
    """
    E = target.get_input_embeddings().weight.detach().float()
    d = model.config.hidden_size
    if d > E.shape[1]:
        raise ValueError(f"draft width {d} exceeds target width {E.shape[1]}")
    _, S, Vh = torch.linalg.svd(E, full_matrices=False)
    U = Vh[:d].T  # [D, d]
    Ed = E @ U
    # Rescale to the random-init scale (std 0.02). At the target's own scale the tied geometry
    # makes the fresh draft predict "repeat the current token" with high confidence (its random
    # layers barely change the residual stream), which measured worse than random init; at this
    # scale the logits start soft and only the token-similarity structure is inherited.
    Ed = Ed * (0.02 / Ed.std())
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(Ed)
        rows = Ed if model.lm_head_token_ids is None else Ed[model.lm_head_token_ids]
        model.lm_head.weight.copy_(rows)
    return float((S[:d] ** 2).sum() / (S ** 2).sum())


def copy_draft_weights(src: DraftModel, dst: DraftModel) -> int:
    """Copy every weight of ``src`` into ``dst`` (same architecture); head rows are matched by
    token id, so a re-selected head keeps what was learnt for tokens both heads contain (the
    others keep their fresh init). Returns the number of head rows carried over."""
    if src.config != dst.config:
        raise ValueError(f"--init-draft architecture {src.config} differs from the requested {dst.config}")
    dst.model.load_state_dict(src.model.state_dict())
    with torch.no_grad():
        V = dst.config.vocab_size
        src_ids = torch.arange(V) if src.lm_head_token_ids is None else src.lm_head_token_ids
        dst_ids = torch.arange(V) if dst.lm_head_token_ids is None else dst.lm_head_token_ids
        row_of = torch.full((V,), -1, dtype=torch.long)
        row_of[src_ids] = torch.arange(len(src_ids))
        rows = row_of[dst_ids]
        have = rows >= 0
        dst.lm_head.weight[have] = src.lm_head.weight[rows[have]]
    return int(have.sum())
