"""The ort flavour on fused contrib ops (export/fused_graph.py): its shape, and that it computes the traced
graph's function: per output, with the caches written in place as the engine runs it, on random trees over
ragged, partly filled caches; for float weights, 4-bit blocks with Q4_1 offsets, and every family feature
(q/k/v biases, Qwen3's q/k norms, a tied head, a reduced draft head)."""
from __future__ import annotations

import re
from collections import Counter

from dataclasses import replace

import numpy as np
import onnx
import pytest
import torch

from ssd_trt.export.block_weights import model_block_weights
from ssd_trt.export.fused_graph import fused_step_graph, unsupported_reason
from ssd_trt.export.validate import validate_with_polygraphy
from ssd_trt.models.gguf_blocks import BlockWeight
from ssd_trt.models.decoder import Decoder, with_target_features
from tests.helpers import random_decoder, tiny_config

SHAPES = [(1, 1), (1, 2), (1, 7), (2, 5), (3, 9)]


def _save(graph: onnx.ModelProto, path) -> None:
    onnx.save_model(graph, path, save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin",
                    size_threshold=1024)


def _q4_1_blocks(model) -> dict[str, BlockWeight]:
    """Every linear layer as Q4_1-like blocks (scale, and a per-block offset), the model set to their values."""
    blocks = model_block_weights("int4", None, model)
    rng = np.random.default_rng(0)
    out = {}
    for name, block in blocks.items():
        offsets = rng.normal(0, 0.01, block.scales.shape).astype(np.float32)
        out[name] = BlockWeight(block.values, block.scales, offsets, 4, "Q4_1")
        module = model.get_submodule(name)
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(np.ascontiguousarray(out[name].dequantize().T)))
    return out


def _family_model(family: str) -> Decoder:
    """A random tiny model of one family variant."""
    config = replace(tiny_config(), attention_bias=family == "qwen2-bias", qk_norm=family == "qwen3-qk-norm",
                     tie_word_embeddings=family == "tied-head",
                     head_vocab_size=40 if family == "reduced-head" else None)
    torch.manual_seed(3)
    model = Decoder(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.15)
        if model.lm_head_token_ids is not None:
            model.lm_head_token_ids.copy_(torch.randperm(config.vocab_size)[:40].sort().values)
    return model.eval()


@pytest.mark.parametrize("family", ["llama", "qwen2-bias", "qwen3-qk-norm", "tied-head", "reduced-head"])
@pytest.mark.parametrize("weights", ["float", "q4_1"])
def test_fused_graph_computes_the_model(tmp_path, family, weights):
    model = _family_model(family)
    blocks = _q4_1_blocks(model) if weights == "q4_1" else None
    _save(fused_step_graph(model, blocks, max_positions=64), tmp_path / "model.onnx")
    onnx.checker.check_model(str(tmp_path / "model.onnx"), full_check=True)
    result = validate_with_polygraphy(model, tmp_path / "model.onnx", SHAPES, in_place=True)
    assert result["passed"], result
    assert result["max_abs_error"] < 1e-3


def test_a_wrong_fused_graph_fails_validation(tmp_path):
    """The check can fail: a graph whose attention ignores the tree (every bias 0) disagrees on tree steps."""
    model = random_decoder(tiny_config(), seed=4)
    graph = fused_step_graph(model, None, max_positions=64)
    for node in graph.graph.node:
        if node.op_type == "Where" and node.output[0] == "fused.attention_bias":
            node.input[2] = "fused.zero_f"
    _save(graph, tmp_path / "model.onnx")
    assert not validate_with_polygraphy(model, tmp_path / "model.onnx", [(2, 5)], in_place=True)["passed"]


def test_fused_layers_are_small_and_use_the_fused_ops(tmp_path):
    model = random_decoder(tiny_config(), seed=5)
    graph = fused_step_graph(model, _q4_1_blocks(model), max_positions=64)
    # by output name: every node of layer i writes a tensor named layers.<i>.* (unnamed nodes included)
    per_layer = Counter(re.match(r"layers\.(\d+)\.", node.output[0]).group(1) for node in graph.graph.node
                        if node.output[0].startswith("layers."))
    assert len(per_layer) == model.config.num_layers and max(per_layer.values()) <= 40, per_layer
    # Q4_1 offsets included: 4 block MatMuls x (DQ, MatMul, 4 side), and 3 nodes attending a one-token step twice
    assert min(per_layer.values()) == 34, per_layer
    ops = Counter(node.op_type for node in graph.graph.node)
    layers = model.config.num_layers
    assert ops["GroupQueryAttention"] == layers and ops["SkipSimplifiedLayerNormalization"] == 2 * layers
    # packed projections: q|k|v, o, gate|up, down per layer and the head, each one block MatMul
    assert ops["DequantizeLinear"] == 4 * layers + 1
    assert "ScatterElements" not in ops       # the cache is written by the attention op, in place


def test_models_the_fused_form_does_not_cover_keep_the_traced_graph():
    model = random_decoder(tiny_config(), seed=6)
    assert unsupported_reason(model) is None
    assert "multiple of 16" in unsupported_reason(random_decoder(tiny_config(hidden=32), seed=6))   # head_dim 8
    featured = with_target_features(model, (0, 1))
    assert "traced" in unsupported_reason(featured)
    with pytest.raises(ValueError, match="features"):
        fused_step_graph(featured, None, max_positions=64)
