"""A GGUF file built streamed, as the real Qwen pair is (recipes/qwen2.5-coder-1.5b.yaml): architecture and shapes
from its metadata, each linear layer's own blocks of mixed kinds in the graph, and decoding exact.

The file is a tiny qwen2 written here with gguf-py's writer (q/k/v biases, an untied head, K-quants beside Q5_0 and
Q8_0, as Qwen's Q4_K_M files mix them); the tokenizer is a real word-level one beside it (the recipe names it)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

import ssd_trt
from ssd_trt.errors import RecipeError
from tests.helpers import random_decoder, save_hf_checkpoint, tiny_config
from tests.test_gguf_kinds import gguf_blocks

HIDDEN, FFN, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 256
# Q4_K_M's mix: K-quant projections, a Q6_K v / head, and the draft file's Q5_0 / Q8_0
KINDS = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_K",
         "ffn_up": "Q4_K", "ffn_down": "Q8_0"}


def byte_tokens() -> list[str]:
    """GPT-2's byte-level alphabet (each byte as the printable character its BPE vocabularies use)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_tiny_qwen2(path: Path, kinds: dict[str, str] = KINDS, seed: int = 0, with_tokenizer: bool = False) -> Path:
    """``with_tokenizer``: also the tokenizer in the metadata, as the real files carry it (gpt2 byte-level BPE over
    the 256 bytes, no merges), from which transformers reads the vocabulary and the build the tokenizer."""
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
        writer.add_token_list(byte_tokens()[:VOCAB])
        writer.add_token_types([gguf.TokenType.NORMAL] * VOCAB)
        writer.add_token_scores([0.0] * VOCAB)   # no merges: transformers derives them from the vocabulary (none)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
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


def gguf_recipe(folder: Path, gguf_file: Path, **decoding) -> Path:
    # a tokenizer source is a model directory: a tiny checkpoint whose word-level tokenizer has the same vocabulary
    tokenizer = save_hf_checkpoint(random_decoder(tiny_config(vocab=VOCAB), seed=0), folder / "tokenizer")
    model = {"source": str(gguf_file), "weights": "gguf", "activations": "int8", "export": "streamed"}
    recipe = {"name": "tiny-gguf", "output_dir": str(folder / "build"),
              "target": {**model, "tokenizer": str(tokenizer)}, "draft": {**model, "tokenizer": "target"},
              "engine": {"backend": "ort", "tensorrt": "none", "max_batch": 4, "max_context": 256, "max_draft_len": 8,
                         "max_tree_size": 64},
              "decoding": {"sd_draft_len": 3, "ssd_draft_len": 3, "ssd_fan_out_budget": 1, **decoding}}
    path = folder / "tiny-gguf.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def gguf_build(tmp_path_factory) -> Path:
    from ssd_trt.build import build
    folder = tmp_path_factory.mktemp("gguf")
    return build(gguf_recipe(folder, write_tiny_qwen2(folder / "tiny-qwen2.gguf")), root=folder)


def test_a_gguf_file_builds_streamed_from_its_metadata_with_its_own_blocks_of_every_kind(gguf_build):
    from ssd_trt.manifest import read_manifest
    manifest = read_manifest(gguf_build)
    target = manifest.model("target")
    assert manifest.host_memory["exports"]["target"]["path"] == "streamed"
    config = target.config
    assert (config.model_type, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.attention_bias, config.tie_word_embeddings) == ("qwen2", LAYERS, HIDDEN, HEADS, KV_HEADS, True, False)
    kinds = target.quantization["kinds"]
    # every linear layer of both layers and the head as the file's blocks: Q4_K q/k/gate/up, Q6_K v and head, ...
    assert kinds == {"Q4_K": 4 * LAYERS, "Q6_K": LAYERS + 1, "Q5_0": LAYERS, "Q8_0": LAYERS}
    assert manifest.validation["target"]["passed"] and manifest.validation["target"]["ort_graph"] == "fused"


def test_greedy_sd_and_ssd_on_the_gguf_build_equal_its_autoregressive_output(gguf_build):
    gen = ssd_trt.load(gguf_build)
    params = ssd_trt.SamplingParams(max_new_tokens=12, stop_on_eos=False)
    prompts = [[5, 6, 7], [9, 10, 11, 12], [40, 41], [100, 3, 77, 8, 9]]
    expected = [r.token_ids for r in gen.generate_ids(prompts, params, mode="ar")]
    for mode in ("sd", ssd_trt.SSD(draft_len=3, fan_out_budget=1), ssd_trt.SSD(draft_len=2, fan_out_budget=4), "ssd"):
        assert [r.token_ids for r in gen.generate_ids(prompts, params, mode=mode)] == expected, mode


def test_a_gguf_decoder_weight_of_an_unsupported_kind_stops_the_build_naming_it(tmp_path):
    from ssd_trt.build import build
    path = write_tiny_qwen2(tmp_path / "q3k.gguf", {**KINDS, "ffn_up": "Q3_K"})
    with pytest.raises(RecipeError, match=r"blk\.0\.ffn_up\.weight.*Q3_K"):
        build(gguf_recipe(tmp_path, path), root=tmp_path)


def test_a_file_that_is_not_gguf_is_refused_clearly(tmp_path):
    from ssd_trt.models.gguf_checkpoint import GGUFCheckpoint
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(RecipeError, match="not a readable GGUF file"):
        GGUFCheckpoint.open(bad)


def test_a_bounded_check_cut_to_the_first_tokens_reads_the_first_rows_of_the_embedding_and_head(tmp_path):
    # the real pair's build validates on the vocabulary's first tokens (export/bounded_checks.CHECK_TOKENS): the cut
    # must read exactly the full tensors' first rows, as floats and as the head's own blocks
    from ssd_trt.export.streamed import first_tokens
    from ssd_trt.models.gguf_checkpoint import GGUFCheckpoint
    full = GGUFCheckpoint.open(write_tiny_qwen2(tmp_path / "tiny.gguf"))
    cut = first_tokens(full, 64)
    assert (cut.config.vocab_size, cut.hf_config["vocab_size"], full.config.vocab_size) == (64, 64, VOCAB)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert cut.tensors[name].shape == (64, HIDDEN)
        assert np.array_equal(cut.tensor(name).numpy(), full.tensor(name).numpy()[:64]), name
    head = cut.blocks("lm_head.weight")                        # W^T [K, N]: the vocabulary is N
    assert head.kind == "Q6_K" and head.values.shape == (HIDDEN, 64)
    assert np.array_equal(head.dequantize(), full.blocks("lm_head.weight").dequantize()[:, :64])
    assert np.array_equal(cut.tensor("model.layers.0.mlp.down_proj.weight").numpy(),
                          full.tensor("model.layers.0.mlp.down_proj.weight").numpy())   # other tensors whole
    assert first_tokens(full, VOCAB) is full


def test_bounded_validation_on_a_vocabulary_cut_runs_the_file_blocks_graph_and_says_what_it_covered(tmp_path,
                                                                                                  monkeypatch):
    from ssd_trt.export import bounded_checks
    from ssd_trt.models.gguf_checkpoint import GGUFCheckpoint
    checkpoint = GGUFCheckpoint.open(write_tiny_qwen2(tmp_path / "tiny.gguf"))
    monkeypatch.setattr(bounded_checks, "CHECK_TOKENS", 96)
    results = bounded_checks.bounded_validation(checkpoint, 1, None, [(1, 1), (2, 3)], 64, file_blocks=True)
    result = results["ort"]
    assert result["passed"], result
    assert "first 1 of 2 decoder layers" in result["scope"] and f"first 96 of its {VOCAB} tokens" in result["scope"]
