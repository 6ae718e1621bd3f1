"""The TensorRT plugin's kernel compiles to launchable PTX on CPU; the plugin contract holds.

CPU (always): the AOT kernel for every tactic compiles to PTX for sm_90 and sm_80 (what ``aot_impl``
hands TensorRT), with the kernel name, parameter list, threads per block, shared memory and launch
grid checked, and the PTX assembled by ``ptxas`` when one is on the machine. The ONNX node contract
and the module's laziness about TensorRT are checked too.

GPU / TensorRT (marked, skipped here with the reason): the kernel on CUDA against the reference, and
the plugin inside a real TensorRT network updating the cache in place.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from ssd_trt_plugins.tree_attention.ptx import DEFAULT_PTX_VERSION, NUM_KERNEL_PARAMS, SHARED_MEMORY_LIMIT, compile_ptx, \
    entry_params, strip_unused_trailing_params
from ssd_trt_plugins.tree_attention.reference import causal_tree_mask, pack_tree_mask, tree_attention_reference
from ssd_trt_plugins.tree_attention.trt_plugin import FP32_TACTICS, LOW_PRECISION_TACTICS, PLUGIN_NAME, dtype_name, \
    kernel_spec, launch_plan, validate_onnx_node
from ssd_trt.engines.availability import probe_cuda, probe_tensorrt

ROOT = Path(__file__).resolve().parents[1]
HAS_TRT, TRT_REASON = probe_tensorrt()
HAS_CUDA, CUDA_REASON = probe_cuda()
LLAMA_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)  # also Llama-3.2-1B's attention layout
QWEN3_06B = dict(num_q_heads=16, num_kv_heads=8, head_dim=128)

# (sm, dtype, tactic, heads): every tactic on sm_90, the largest tile on sm_80.
COMPILES = [(90, "fp16", 1, LLAMA_8B), (90, "fp16", 2, LLAMA_8B), (90, "bf16", 1, QWEN3_06B),
            (90, "fp32", 3, LLAMA_8B), (80, "bf16", 2, LLAMA_8B), (80, "fp16", 1, QWEN3_06B),
            # Blackwell: sm_100a needs PTX ISA 8.6 and sm_120a 8.7 (8.0 fails to compile for them)
            (100, "bf16", 1, LLAMA_8B), (120, "fp16", 1, QWEN3_06B)]


def find_ptxas() -> str | None:
    nvcc = shutil.which("nvcc")
    candidates = [shutil.which("ptxas"), str(Path(nvcc).parent / "ptxas") if nvcc else None]
    import triton
    candidates.append(str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"))
    return next((path for path in candidates if path and os.access(path, os.X_OK)), None)


@pytest.fixture(scope="module", params=COMPILES, ids=lambda c: f"sm{c[0]}-{c[1]}-tactic{c[2]}")
def compiled(request):
    sm, dtype, tactic, heads = request.param
    spec = kernel_spec(dtype, heads["num_q_heads"], heads["num_kv_heads"], heads["head_dim"],
                       heads["head_dim"] ** -0.5, tactic)
    return sm, spec, compile_ptx(spec, sm)


def test_ptx_entry_matches_the_tensorrt_calling_convention(compiled):
    sm, spec, kernel = compiled
    assert kernel.name == "_tree_attention_fwd"
    assert re.search(rf"\.visible \.entry {kernel.name}\(", kernel.ptx)
    # inputs (7 pointers), extra scalars (T, S as .u32), outputs (3 pointers): nothing else.
    assert len(kernel.params) == NUM_KERNEL_PARAMS == 12
    declaration = kernel.ptx[kernel.ptx.index(".entry"):kernel.ptx.index(")")]
    kinds = re.findall(r"\.param \.(u64|u32)", declaration)
    assert kinds == ["u64"] * 7 + ["u32"] * 2 + ["u64"] * 3
    version = {100: 86, 120: 87}.get(sm, DEFAULT_PTX_VERSION)      # the oldest ISA each architecture accepts
    assert f".target sm_{sm}" in kernel.ptx and f".version {version // 10}.{version % 10}" in kernel.ptx
    assert f".reqntid {kernel.block_x}" in kernel.ptx and kernel.block_x == spec.num_warps * 32 == 128
    assert 0 < kernel.shared_mem <= SHARED_MEMORY_LIMIT


def test_ptx_assembles_with_ptxas(compiled, tmp_path):
    ptxas = find_ptxas()
    if ptxas is None:
        pytest.skip("no ptxas on this machine (install the CUDA toolkit or triton's bundled ptxas)")
    sm, _, kernel = compiled
    source = tmp_path / "kernel.ptx"
    source.write_text(kernel.ptx)
    arch = f"sm_{sm}a" if sm >= 90 else f"sm_{sm}"
    result = subprocess.run([ptxas, "-v", f"-arch={arch}", str(source), "-o", str(tmp_path / "kernel.cubin")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "0 bytes spill stores" in result.stderr


def test_launch_plan_for_the_runtime_shapes(compiled):
    _, spec, kernel = compiled
    capacity = 4096
    for batch, tokens in ((1, 1), (4, 1), (1, 7), (2, 64), (1, 512)):
        plan = launch_plan(spec, kernel, batch, tokens, capacity)
        grid = plan["grid"]
        assert grid == (-(-tokens // spec.block_t), batch * spec.num_kv_heads, 1)
        assert grid[0] * spec.block_t >= tokens > (grid[0] - 1) * spec.block_t
        assert plan["block"] == (128, 1, 1) and plan["extra_args"] == (tokens, capacity)
        assert plan["kernel_name"] == kernel.name and plan["shared_mem"] == kernel.shared_mem


def test_tactics_cover_every_dtype():
    assert kernel_spec("fp16", 32, 8, 128, 0.1, 0).block_m == LOW_PRECISION_TACTICS[1].block_m  # default tactic
    assert kernel_spec("fp32", 32, 8, 128, 0.1, 3).block_s == FP32_TACTICS[3].block_s
    with pytest.raises(ValueError, match="unknown tactic"):
        kernel_spec("fp32", 32, 8, 128, 0.1, 1)
    with pytest.raises(ValueError, match="not 'int8'"):
        kernel_spec("int8", 32, 8, 128, 0.1, 1)


def test_dtype_names_follow_tensorrt_enum_names():
    class FakeDataType:  # stands in for a tensorrt.DataType member: only its .name is read
        def __init__(self, name):
            self.name = name
    assert [dtype_name(FakeDataType(n)) for n in ("FLOAT", "HALF", "BF16")] == ["fp32", "fp16", "bf16"]
    with pytest.raises(ValueError, match="INT8"):
        dtype_name(FakeDataType("INT8"))


def test_trailing_params_are_only_dropped_when_unused():
    ptx = (".visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u64 k_param_1,\n\t.param .u64 k_param_2\n)\n"
           "{\n\tld.param.b64 %rd1, [k_param_0];\n}\n")
    stripped = strip_unused_trailing_params(ptx, "k", 1)
    assert entry_params(stripped, "k") == ["k_param_0"]
    with pytest.raises(ValueError, match="k_param_1 is used"):
        strip_unused_trailing_params(ptx.replace("[k_param_0]", "[k_param_1]"), "k", 1)


def plugin_node(**attrs) -> onnx.NodeProto:
    inputs = ["q", "k", "v", "kc", "vc", "len", "mask"]
    defaults = dict(plugin_namespace="ssd", plugin_version="1", scale=0.125)
    defaults.update(attrs)
    return helper.make_node(PLUGIN_NAME, inputs, ["out", "kc_out", "vc_out"], name="attn0", domain="ssd",
                            **{k: v for k, v in defaults.items() if v is not None})


def test_onnx_node_contract():
    assert validate_onnx_node(plugin_node()) == pytest.approx(0.125)
    with pytest.raises(ValueError, match="plugin_namespace"):
        validate_onnx_node(plugin_node(plugin_namespace=None))
    with pytest.raises(ValueError, match="plugin_version"):
        validate_onnx_node(plugin_node(plugin_version="2"))
    with pytest.raises(ValueError, match="scale"):
        validate_onnx_node(plugin_node(scale=None))


def test_importing_the_plugin_module_does_not_import_tensorrt():
    code = ("import sys; import ssd_trt_plugins.tree_attention.trt_plugin, ssd_trt.engines.tensorrt, ssd_trt.trt.engine_build; "
            "print('tensorrt' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed here; this checks the error without it")
def test_register_without_tensorrt_says_what_is_missing():
    from ssd_trt_plugins.tree_attention import trt_plugin
    with pytest.raises(RuntimeError, match="TensorRT >= 10.9"):
        trt_plugin.register(90)


# ---- hardware tests: run only where a GPU (and TensorRT) exist ------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=f"needs a CUDA GPU: {CUDA_REASON}")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_kernel_on_gpu_matches_reference(dtype, tolerance):
    from ssd_trt_plugins.tree_attention.triton_kernel import tree_attention
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch, q_heads, kv_heads, tokens, capacity, dim = 2, 32, 8, 24, 600, 128

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").to(dtype)
    tensors = (randn(batch, q_heads, tokens, dim), randn(batch, kv_heads, tokens, dim),
               randn(batch, kv_heads, tokens, dim), randn(batch, kv_heads, capacity, dim),
               randn(batch, kv_heads, capacity, dim))
    lengths = torch.tensor([0, 500], dtype=torch.int32, device="cuda")
    mask = torch.from_numpy(causal_tree_mask(batch, tokens)).cuda()
    out, keys, _ = tree_attention(*tensors, lengths, mask, dim ** -0.5)
    ref, ref_keys, _ = tree_attention_reference(*tensors, lengths, mask, dim ** -0.5)
    error = (out.double() - ref.double()).abs().max().item() / ref.double().abs().max().item()
    assert error < tolerance
    assert torch.equal(keys, ref_keys)


@pytest.mark.trt
@pytest.mark.skipif(not HAS_TRT, reason=f"needs TensorRT >= 10.9 and a GPU: {TRT_REASON}")
def test_plugin_in_a_tensorrt_network_updates_the_cache_in_place(tmp_path):
    """One tree_attention node parsed from ONNX, built, run with the cache bound in place."""
    import tensorrt as trt

    from ssd_trt_plugins.tree_attention import trt_plugin

    batch, q_heads, kv_heads, tokens, capacity, dim = 2, 4, 2, 5, 64, 32
    major, minor = torch.cuda.get_device_capability(0)
    trt_plugin.register(major * 10 + minor)
    shapes = {"q": [batch, q_heads, tokens, dim], "k": [batch, kv_heads, tokens, dim],
              "v": [batch, kv_heads, tokens, dim], "kc": [batch, kv_heads, capacity, dim],
              "vc": [batch, kv_heads, capacity, dim], "len": [batch], "mask": [batch, tokens, 1]}
    types = {name: TensorProto.FLOAT16 for name in shapes} | {"len": TensorProto.INT32, "mask": TensorProto.INT32}
    graph = helper.make_graph(
        [plugin_node(scale=dim ** -0.5)], "one_node",
        [helper.make_tensor_value_info(name, types[name], shape) for name, shape in shapes.items()],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT16, shapes["q"]),
         helper.make_tensor_value_info("kc_out", TensorProto.FLOAT16, shapes["kc"]),
         helper.make_tensor_value_info("vc_out", TensorProto.FLOAT16, shapes["vc"])])
    path = tmp_path / "one_node.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ssd", 1)]),
              path)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 0
    if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):
        flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(path)), [str(parser.get_error(i)) for i in range(parser.num_errors)]
    config = builder.create_builder_config()
    config.set_preview_feature(trt.PreviewFeature.ALIASED_PLUGIN_IO_10_03, True)
    engine = trt.Runtime(logger).deserialize_cuda_engine(builder.build_serialized_network(network, config))
    context = engine.create_execution_context()
    gen = torch.Generator(device="cuda").manual_seed(1)
    data = {name: torch.randn(*shape, generator=gen, device="cuda").half() for name, shape in shapes.items()
            if types[name] == TensorProto.FLOAT16}
    data["len"] = torch.tensor([3, 40], dtype=torch.int32, device="cuda")
    tree = np.tril(np.ones((tokens, tokens), dtype=bool))
    tree[4, 2] = False
    data["mask"] = torch.from_numpy(np.stack([pack_tree_mask(tree)] * batch)).cuda()
    reference = tree_attention_reference(*(data[n].clone() for n in ("q", "k", "v", "kc", "vc", "len", "mask")),
                                         dim ** -0.5)
    out = torch.empty_like(data["q"])
    for name, tensor in data.items():
        context.set_tensor_address(name, tensor.data_ptr())
    context.set_tensor_address("out", out.data_ptr())
    context.set_tensor_address("kc_out", data["kc"].data_ptr())  # in place
    context.set_tensor_address("vc_out", data["vc"].data_ptr())
    stream = torch.cuda.Stream()
    assert context.execute_async_v3(stream.cuda_stream)
    stream.synchronize()
    error = (out.double() - reference[0].double()).abs().max().item() / reference[0].double().abs().max().item()
    assert error < 2e-3
    assert torch.equal(data["kc"], reference[1]) and torch.equal(data["vc"], reference[2])
