"""Tiny GGUF files written with gguf-py's writer, shaped as the real Qwen files are: a qwen2 decoder with q/k/v
biases, an untied head and K-quants beside Q5_0 and Q8_0 (Qwen's Q4_K_M mix), optionally with its tokenizer in the
metadata as the real files carry it. The GGUF build's tests (tests/test_gguf_build.py), the serving-from-files tests
(tests/test_serve_from_files.py) and research/gpu/pair_session.py's smoke pair (through tests/test_gguf_build.py)
write their files with it."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.test_gguf_kinds import gguf_blocks

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 256
# Q4_K_M's mix: K-quant projections, a Q6_K v / head, and the draft file's Q5_0 / Q8_0
KINDS = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_K",
         "ffn_up": "Q4_K", "ffn_down": "Q8_0"}

# the chat template's shape in Qwen's files (ChatML), tokenized here as plain bytes
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet (each byte as the printable character its BPE vocabularies use)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_tiny_qwen2(path: Path, kinds: dict[str, str] = KINDS, seed: int = 0, with_tokenizer: bool = False,
                     tokens: list[str] | None = None, eos_token_id: int = 2,
                     chat_template: str | None = None) -> Path:
    """``with_tokenizer``: also the tokenizer in the metadata, as the real files carry it (gpt2 byte-level BPE over
    the 256 bytes, no merges), from which transformers reads the vocabulary and the build the tokenizer; ``tokens``:
    another vocabulary instead of the bytes' (a draft whose tokenizer is not the target's); ``chat_template``: one in the
    metadata too (``CHATML``: the real files' kind)."""
    import gguf
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for key, value in (("block_count", LAYERS), ("context_length", 512), ("embedding_length", HIDDEN),
                       ("feed_forward_length", FFN), ("head_count", HEADS), ("head_count_kv", KV_HEADS)):
        getattr(writer, f"add_{key}")(value)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if with_tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        tokens = byte_tokens()[:VOCAB] if tokens is None else tokens
        writer.add_token_list(tokens)
        writer.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
        writer.add_token_scores([0.0] * len(tokens))   # no merges: transformers derives them from the vocabulary (none)
        if chat_template is not None:
            writer.add_chat_template(chat_template)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(eos_token_id)
    quant = gguf.GGMLQuantizationType

    def blocks(name: str, kind: str, rows: int, k: int) -> None:
        writer.add_tensor(name, gguf_blocks(kind, rows, k, rng), raw_dtype=quant[kind])

    def floats(name: str, value: np.ndarray) -> None:
        writer.add_tensor(name, value.astype(np.float32))

    blocks("token_embd.weight", "Q8_0", VOCAB, HIDDEN)
    outputs = {"attn_q": HEADS * head_dim, "attn_k": KV_HEADS * head_dim, "attn_v": KV_HEADS * head_dim,
               "attn_output": HIDDEN, "ffn_gate": FFN, "ffn_up": FFN, "ffn_down": HIDDEN}
    for layer in range(LAYERS):
        floats(f"blk.{layer}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
        floats(f"blk.{layer}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN))
        for part, rows in outputs.items():
            blocks(f"blk.{layer}.{part}.weight", kinds[part], rows, FFN if part == "ffn_down" else HIDDEN)
            if part in ("attn_q", "attn_k", "attn_v"):
                floats(f"blk.{layer}.{part}.bias", 0.1 * rng.standard_normal(rows))
    floats("output_norm.weight", np.ones(HIDDEN))
    blocks("output.weight", "Q6_K", VOCAB, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
