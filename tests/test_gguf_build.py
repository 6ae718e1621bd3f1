"""A GGUF file built streamed, as the real Qwen pair is (recipes/qwen2.5-coder-1.5b.yaml): architecture and shapes
from its metadata, each linear layer's own blocks of mixed kinds in the graph, and decoding exact.

The file is a tiny qwen2 written with gguf-py's writer (tests/gguf_files.py: q/k/v biases, an untied head, K-quants
beside Q5_0 and Q8_0, as Qwen's Q4_K_M files mix them); the tokenizer is a real word-level one beside it (the recipe
names it)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml

import ssd_trt
from ssd_trt.errors import RecipeError
from tests.gguf_files import HIDDEN, HEADS, KINDS, KV_HEADS, LAYERS, VOCAB, write_tiny_qwen2
from tests.helpers import random_decoder, save_hf_checkpoint, tiny_config

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
