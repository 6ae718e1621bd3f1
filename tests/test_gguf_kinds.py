"""Every GGUF block type the build carries (gguf_blocks.KINDS), written to a real GGUF file and read back: its
blocks dequantize bit for bit as gguf-py defines them, the ONNX graph of its blocks computes x W to fp32
rounding and runs fused (MatMulNBits); a decoder weight of any other type is refused by name."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from gguf import GGMLQuantizationType as GGML
from onnx import TensorProto, helper

from ssd_trt.errors import RecipeError
from ssd_trt.export.block_weights import OPSET, block_matmul
from ssd_trt.models.gguf_blocks import KINDS, BlockWeight, parse_blocks, read_block_weights

MINIMUM_KINDS = ("Q4_1", "Q5_1", "Q4_K", "Q5_K")            # w = s q + M: carried with offsets
# where each GGUF block keeps its f16 fields (d; m or dmin), as ggml-common.h lays the blocks out
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
              "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q2_K": (80, 82), "Q3_K": (108,), "IQ4_NL": (0,)}
K, N = 512, 48


def packed_blocks(kind: str, rows: int, k: int, rng: np.random.Generator, d_exp: int = -10,
                  m_exp: int = -7) -> np.ndarray:
    """Random valid blocks [rows, bytes per row]: random bytes, the f16 fields set to d ~ 2^d_exp and
    m / dmin ~ 2^m_exp (random sign for Q4_1/Q5_1's m) -- what a real file's K-quants hold (dmin ~ 8 d)."""
    size, nbytes = gguf.GGML_QUANT_SIZES[GGML[kind]]
    raw = rng.integers(0, 256, (rows * k // size, nbytes), dtype=np.uint8)
    for field, exp in zip(F16_FIELDS[kind], (d_exp, m_exp)):
        value = rng.uniform(0.5, 1.0, len(raw)) * 2.0 ** exp
        if field == 2 and kind in ("Q4_1", "Q5_1"):
            value *= rng.choice([-1.0, 1.0], len(raw))
        raw[:, field:field + 2] = value.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, -1)


def gguf_blocks(kind: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A weight's blocks as llama.cpp writes them: gguf-py's quantizer of Gaussian weights where it has one, else
    hand-packed random blocks."""
    try:
        return gguf.quants.quantize(rng.normal(0, 0.02, (rows, k)).astype(np.float32), GGML[kind])
    except NotImplementedError:
        return packed_blocks(kind, rows, k, rng)


def write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, str]]) -> Path:
    """A GGUF file holding ``tensors`` (name -> (data, GGML type name)): quantized ones as their bytes."""
    writer = gguf.GGUFWriter(str(path), "qwen2")
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=None if kind in ("F32", "F16") else GGML[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def read_back(tmp_path: Path, raw: np.ndarray, kind: str) -> tuple[BlockWeight, np.ndarray]:
    """``raw`` written as a decoder weight of a GGUF file and read with the project's reader; and gguf-py's
    dequantization of what the file holds, W [K, N] fp32."""
    path = write_gguf(tmp_path / f"{kind}.gguf", {"blk.0.ffn_up.weight": (raw, kind),
                                                  "blk.0.ffn_norm.weight": (np.ones(K, np.float32), "F32")})
    weights = read_block_weights(path)
    assert list(weights) == ["layers.0.mlp.up_proj"]
    stored = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == "blk.0.ffn_up.weight")
    return weights["layers.0.mlp.up_proj"], gguf.quants.dequantize(np.asarray(stored.data), stored.tensor_type).T


def session(nodes: list, inits: list, outputs: list[str], k: int, folder: Path
            ) -> tuple[ort.InferenceSession, list[str]]:
    """An ONNX Runtime CPU session of x [2, 3, k] -> ``outputs`` at accuracy level 1 (fp32 activations), and
    the op types of the model it optimised."""
    ys = [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2, 3, f"{out}.n"]) for out in outputs]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, k])], ys, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    onnx.checker.check_model(model, full_check=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "1")
    options.optimized_model_filepath = str(folder / "optimized.onnx")
    options.log_severity_level = 3
    runner = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return runner, [node.op_type for node in onnx.load(options.optimized_model_filepath).graph.node]


def assert_matmul_close(y: np.ndarray, x: np.ndarray, w_ref: np.ndarray) -> None:
    """y == x W (float64) to fp32 rounding: within 1e-5 |x| |W_n| per output (a wrong scale, offset or code
    order misses by ~|x| |W_n|)."""
    x64, w64 = x.astype(np.float64), w_ref.astype(np.float64)
    bound = 1e-5 * np.linalg.norm(x64, axis=-1, keepdims=True) * np.linalg.norm(w64, axis=0)
    assert (np.abs(y - x64 @ w64) <= bound).all(), np.max(np.abs(y - x64 @ w64) / bound)


def run_block_matmul(weight: BlockWeight, folder: Path) -> tuple[np.ndarray, np.ndarray, list]:
    """x, block_matmul's graph of ``weight`` on x, and its optimised op types."""
    k = weight.values.shape[0]
    matmul = helper.make_node("MatMul", ["x", "lin.weight_t"], ["y"], name="lin.matmul")
    ahead, behind, inits = block_matmul("lin", matmul, weight)
    runner, ops = session([*ahead, matmul, *behind], inits, ["y"], k, folder)
    x = np.random.default_rng(3).standard_normal((2, 3, k)).astype(np.float32)
    return x, runner.run(None, {"x": x})[0], ops


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_reads_bit_exact_and_runs_fused_as_x_times_the_file_weights(kind, tmp_path):
    weight, reference = read_back(tmp_path, gguf_blocks(kind, N, K, np.random.default_rng(0)), kind)
    assert weight.kind == kind and weight.values.shape == (K, N)
    assert (weight.offsets is not None) == (kind in MINIMUM_KINDS)
    assert weight.bits == (4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8)
    assert weight.block == (16 if kind == "Q6_K" else 32)
    assert weight.values.min() < 0 or kind == "Q8_0"     # centred codes (a real file's offsets are exact)
    assert np.array_equal(weight.dequantize(), reference)
    x, y, ops = run_block_matmul(weight, tmp_path)
    assert_matmul_close(y, x, reference)
    assert ops.count("MatMulNBits") == 1 and "DequantizeLinear" not in ops, ops


@pytest.mark.parametrize("kind", MINIMUM_KINDS)
def test_a_minimum_whose_centred_offset_would_round_keeps_uncentred_codes_exactly(kind, tmp_path):
    """d ~ 1 and m (dmin) ~ 2^-13: c d + m needs more than fp32's 24 bits, so the codes stay q (8-bit) with
    offsets m, still exactly the file's weights."""
    raw = packed_blocks(kind, N, K, np.random.default_rng(1), d_exp=0, m_exp=-13)
    weight, reference = read_back(tmp_path, raw, kind)
    assert weight.bits == 8 and weight.values.min() >= 0
    assert np.array_equal(weight.dequantize(), reference)
    x, y, ops = run_block_matmul(weight, tmp_path)
    assert_matmul_close(y, x, reference)
    assert ops.count("MatMulNBits") == 1


@pytest.mark.parametrize("kind", ["Q2_K", "Q3_K", "IQ4_NL"])
def test_a_decoder_weight_of_an_unsupported_type_is_refused_by_name(kind, tmp_path):
    path = write_gguf(tmp_path / "bad.gguf", {
        "blk.0.attn_norm.weight": (np.ones(K, np.float32), "F32"),
        "blk.0.attn_k.weight": (np.zeros((N, K), np.float16), "F16"),          # a float weight: left out
        "blk.0.attn_q.weight": (packed_blocks(kind, N, K, np.random.default_rng(2)), kind)})
    with pytest.raises(RecipeError, match=rf"blk\.0\.attn_q\.weight .*{kind}.*supported: {', '.join(KINDS)}"):
        read_block_weights(path)
    with pytest.raises(ValueError, match=kind):
        parse_blocks(packed_blocks(kind, N, K, np.random.default_rng(2)), kind, K)


def test_packing_keeps_apart_what_one_dequantize_cannot_hold(tmp_path):
    """q|k|v packs only parts with equal bits and block size: Q4_K q/k beside a Q6_K v run as three MatMuls,
    Q4_K / Q4_0 / Q4_1 pack into one (Q4_0 adding zero offsets); each output is x W of its own file weights."""
    from ssd_trt.export.fused_graph import _Graph, _packed_blocks, _projection
    rng = np.random.default_rng(4)
    widths = {"q": 64, "k": 32, "v": 32}

    def part(kind: str, width: int) -> tuple[BlockWeight, np.ndarray]:
        raw = gguf_blocks(kind, width, K, rng)
        return parse_blocks(raw, kind, K), gguf.quants.dequantize(raw, GGML[kind]).T

    assert _packed_blocks([part("Q5_0", 32)[0], part("Q6_K", 32)[0]]) is None      # both 8-bit: blocks 32 vs 16
    for kinds, groups in ((("Q4_K", "Q4_K", "Q6_K"), 3), (("Q4_K", "Q4_0", "Q4_1"), 1)):
        parts = {name: part(kind, widths[name]) for name, kind in zip(widths, kinds)}
        graph = _Graph()
        modules = [torch.nn.Linear(K, width, bias=False) for width in widths.values()]
        outputs = _projection(graph, "x", "qkv", modules, list(widths), {n: p[0] for n, p in parts.items()})
        assert len(outputs) == groups
        runner, ops = session(graph.nodes, graph.initializers, outputs, K, tmp_path)
        assert ops.count("MatMulNBits") == groups
        x = rng.standard_normal((2, 3, K)).astype(np.float32)
        y = np.concatenate(runner.run(None, {"x": x}), axis=-1)
        assert_matmul_close(y, x, np.concatenate([p[1] for p in parts.values()], axis=1))
