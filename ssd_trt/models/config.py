"""Decoder hyper-parameters, read once from an HF ``config.json`` dictionary and validated."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ssd_trt.errors import RecipeError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
SUPPORTED_DECODERS = f"Llama-family decoders ({', '.join(SUPPORTED_MODEL_TYPES)})"   # what an error says ssd-trt builds


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False          # Qwen2: biases on q/k/v projections
    qk_norm: bool = False                 # Qwen3: RMSNorm over q and k per head
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)  # Llama-3 frequency scaling
    head_vocab_size: int | None = None    # reduced draft head (lm_head_token_ids), None = full vocab
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_MODEL_TYPES)} (Llama-family decoders)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], head_vocab_size: int | None = None) -> "DecoderConfig":
        """Build from an HF config dict (transformers 4.x and 5.x spellings)."""
        model_type = hf.get("model_type", "llama")
        heads = hf["num_attention_heads"]
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "default", None):
            raise ValueError(f"rope scaling {scaling!r} is not supported (supported: default, llama3)")
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            rope_scaling=dict(scaling) if scaling and scaling.get("rope_type") == "llama3" else None,
            head_vocab_size=head_vocab_size,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def kv_bytes_per_token(self) -> int:
        """fp32 bytes of K and V one token adds to the cache (all layers)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * 4


def decoder_config(hf: dict[str, Any], where: str, head_vocab_size: int | None = None) -> DecoderConfig:
    """The decoder an HF config dict describes; a RecipeError naming ``where`` and what ssd-trt builds when it
    describes none (a missing key, an unsupported model_type or rope scaling, a malformed value)."""
    try:
        return DecoderConfig.from_hf_dict(hf, head_vocab_size)
    except (KeyError, ValueError, TypeError) as exc:
        detail = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        raise RecipeError(f"{where} does not describe a supported decoder ({detail}); ssd-trt builds "
                          f"{SUPPORTED_DECODERS}") from None
