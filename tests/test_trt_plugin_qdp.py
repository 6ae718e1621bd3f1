"""The tree-attention plugin's definitions through TensorRT 11.4's own ``tensorrt.plugin`` package, without a GPU.

The data-centre TensorRT 11.4 bindings wheel cannot be imported here (its libraries are a download stub), but its
``tensorrt.plugin`` package is pure Python: it is loaded from the wheel over a stub of the compiled core module
(``tests/fakes/tensorrt_core_stub.py``: enums, empty base classes, a recording registry). What runs is the wheel's
own code: the ``register`` / ``autotune`` / ``aot_impl`` decorators and their validators on
``ssd_trt_plugins.tree_attention.trt_plugin``'s definitions, the registration of the creator, and the AOT plugin
class TensorRT drives at build time (output types, aliasing, output shapes, type/format combinations, tactics,
the launch parameters). The kernel itself is compiled and checked elsewhere (``test_trt_plugin.py``); here a
stand-in PTX keeps the test fast.

Skips, saying why, when the wheel cannot be fetched (``tests/tensorrt_wheel.py`` downloads it into build/wheels/).
"""
from __future__ import annotations

import importlib
import sys
import warnings

import numpy as np
import pytest

from ssd_trt_plugins.tree_attention import trt_plugin
from ssd_trt_plugins.tree_attention.ptx import PtxKernel
from tests.fakes import tensorrt_core_stub
from tests.fakes.tensorrt_core_stub import IDimensionExpr, IExprBuilder, stub_tensorrt_core
from tests.tensorrt_wheel import bindings_wheel, extract_plugin_package, library_strings, registered

SM = 90
Q_HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 4, 2, 16, 128


@pytest.fixture
def trtp(tmp_path):
    """The wheel's ``tensorrt.plugin`` over a fresh stub core, removed from ``sys.modules`` afterwards."""
    wheel, why = bindings_wheel()
    if wheel is None:
        pytest.skip(f"the TensorRT 11.4 bindings wheel is not here: {why}")
    core = stub_tensorrt_core()
    core.__path__ = [str(extract_plugin_package(wheel, tmp_path))]
    saved = {name: module for name, module in sys.modules.items() if name == "tensorrt" or name.startswith("tensorrt.")}
    for name in saved:
        del sys.modules[name]
    sys.modules["tensorrt"] = core
    try:
        with warnings.catch_warnings():           # the wheel's docstrings have "\\s" escapes (its own, not ours)
            warnings.simplefilter("ignore", DeprecationWarning)
            plugin = importlib.import_module("tensorrt.plugin")
        yield plugin
    finally:
        for name in [name for name in sys.modules if name == "tensorrt" or name.startswith("tensorrt.")]:
            del sys.modules[name]
        sys.modules.update(saved)


@pytest.fixture
def defined(trtp, monkeypatch):
    """The plugin defined through the wheel's decorators, its kernel a stand-in."""
    compiled = []

    def fake_compile(spec, sm):
        compiled.append((spec, sm))
        return PtxKernel(name=f"tree_attention_{spec.dtype}", ptx=".version 8.0\n.target sm_90\n", sm=sm,
                         ptx_version=80, num_warps=4, shared_mem=4096, params=())

    monkeypatch.setattr(trt_plugin, "compile_ptx", fake_compile)
    core = sys.modules["tensorrt"]
    trt_plugin._define_plugin(core, trtp, SM)
    return core, trtp, compiled


def test_the_stub_core_only_names_what_tensorrt_11_4_has():
    wheel, why = bindings_wheel()
    if wheel is None:
        pytest.skip(f"the TensorRT 11.4 bindings wheel is not here: {why}")
    strings = library_strings(wheel)
    core = stub_tensorrt_core()
    names = [name for name in vars(core) if not name.startswith("_") and name[0].isupper()]
    assert not [name for name in names if not registered(name, strings)], "the stub has classes TensorRT 11.4 lacks"
    for enum in tensorrt_core_stub.ENUMS.values():
        missing = [member for member in enum if not registered(member, strings)]
        assert not missing, f"the stub's enum members {missing} are not in TensorRT 11.4"


def test_the_wheels_validators_accept_the_plugin_and_register_it(defined):
    core, trtp, _ = defined
    creator = core.get_plugin_registry().get_creator(trt_plugin.PLUGIN_NAME, trt_plugin.PLUGIN_VERSION,
                                                     trt_plugin.PLUGIN_NAMESPACE)
    assert creator is not None, "ssd::tree_attention version 1 is not in TensorRT's plugin registry"
    assert [(field.name, field.type.name) for field in creator.field_names] == [("scale", "FLOAT32")]
    definition = getattr(getattr(trtp.op, trt_plugin.PLUGIN_NAMESPACE), trt_plugin.PLUGIN_NAME)
    assert definition.num_outputs == trt_plugin.NUM_OUTPUTS
    assert len(definition.input_tensor_names) == trt_plugin.NUM_INPUTS
    assert list(definition.input_attrs) == ["scale"]
    assert definition.aot_impl_func is not None and definition.impl_func is None   # AOT only: runs without Python
    assert definition.autotune_func is not None


def make_plugin(core):
    creator = core.get_plugin_registry().get_creator("tree_attention", "1", "ssd")
    fields = core.PluginFieldCollection([core.PluginField("scale", np.array([0.25], dtype=np.float32),
                                                          core.PluginFieldType.FLOAT32)])
    return creator.create_plugin("tree_attention", "ssd", fields, core.TensorRTPhase.BUILD,
                                 core.QuickPluginCreationRequest.STRICT_AOT)


def input_dims():
    """query [B,Hq,T,D], key/value new [B,Hkv,T,D], key/value cache [B,Hkv,S,D], lengths [B], mask [B,T,W]."""
    batch, tokens, words = IDimensionExpr(None, "B"), IDimensionExpr(None, "T"), IDimensionExpr(None, "W")

    def const(value):
        return IDimensionExpr(value)

    return [[batch, const(Q_HEADS), tokens, const(HEAD_DIM)],
            [batch, const(KV_HEADS), tokens, const(HEAD_DIM)], [batch, const(KV_HEADS), tokens, const(HEAD_DIM)],
            [batch, const(KV_HEADS), const(CAPACITY), const(HEAD_DIM)],
            [batch, const(KV_HEADS), const(CAPACITY), const(HEAD_DIM)], [batch], [batch, tokens, words]]


def test_the_built_plugin_aliases_its_cache_outputs_and_keeps_shapes(defined):
    core, _, _ = defined
    plugin = make_plugin(core)
    half, int32 = core.DataType.HALF, core.DataType.INT32
    dims = input_dims()
    types = plugin.get_output_data_types([half] * 5 + [int32] * 2, [len(d) for d in dims])
    assert types == [half, half, half]
    aliased = {output: plugin.get_aliased_input(output) for output in range(trt_plugin.NUM_OUTPUTS)}
    assert aliased == {0: -1, **trt_plugin.ALIASED_OUTPUTS}, "the cache outputs must alias the cache inputs"
    shapes = plugin.get_output_shapes(dims, [], IExprBuilder())
    assert [[d.symbol for d in shape] for shape in shapes] == [[d.symbol for d in dims[i]] for i in (0, 3, 4)]


def test_the_autotune_combinations_and_tactics_reach_tensorrt(defined):
    core, _, _ = defined
    plugin = make_plugin(core)
    dims = input_dims()
    plugin.get_output_data_types([core.DataType.HALF] * 5 + [core.DataType.INT32] * 2, [len(d) for d in dims])
    plugin.get_output_shapes(dims, [], IExprBuilder())
    in_out = [described(core, core.DataType.HALF, len(d)) for d in dims] + \
        [described(core, core.DataType.HALF, 4) for _ in range(3)]
    offered = plugin.get_supported_format_combinations(in_out, trt_plugin.NUM_INPUTS)
    width = trt_plugin.NUM_INPUTS + trt_plugin.NUM_OUTPUTS
    combos = [tuple(desc.type.name for desc in offered[i:i + width]) for i in range(0, len(offered), width)]
    assert {combo[0] for combo in combos} == {"HALF", "BF16", "FLOAT"}
    assert all(combo[5] == combo[6] == "INT32" for combo in combos)
    for dtype, tactics in (("HALF", trt_plugin.LOW_PRECISION_TACTICS), ("FLOAT", trt_plugin.FP32_TACTICS)):
        chosen = [described(core, getattr(core.DataType, dtype if i not in trt_plugin.INT_POSITIONS else "INT32"), 4)
                  for i in range(width)]
        plugin.configure_plugin(chosen[:trt_plugin.NUM_INPUTS], chosen[trt_plugin.NUM_INPUTS:])
        assert sorted(plugin.get_valid_tactics()) == sorted(tactics)


def test_the_aot_implementation_gives_tensorrt_a_kernel_and_its_launch(defined):
    core, _, compiled = defined
    plugin = make_plugin(core)
    dims = input_dims()
    half, int32 = core.DataType.HALF, core.DataType.INT32
    plugin.get_output_data_types([half] * 5 + [int32] * 2, [len(d) for d in dims])
    plugin.get_output_shapes(dims, [], IExprBuilder())
    in_out = [described(core, int32 if i in trt_plugin.INT_POSITIONS else half, 4) for i in range(10)]
    plugin.set_tactic(1)

    class Launch:
        pass

    class Setter(dict):
        nbSymExprs = 0

    launch, setter = Launch(), Setter()
    plugin.get_launch_params(dims, in_out, trt_plugin.NUM_INPUTS, launch, setter, IExprBuilder())
    assert compiled and compiled[-1][1] == SM and compiled[-1][0].dtype == "fp16"
    assert launch.block_x.expr.get_constant_value() == 128 and launch.shared_mem.expr.get_constant_value() == 4096
    assert "B" in repr(launch.grid_x.expr) + repr(launch.grid_y.expr) + repr(launch.grid_z.expr)   # rows of the batch
    assert setter.nbSymExprs == 2                     # T and the cache capacity S, as the kernel takes them
    assert setter[1].expr.get_constant_value() == CAPACITY
    descs = [entry.desc for entry in in_out]
    name, ptx = plugin.get_kernel(descs[:trt_plugin.NUM_INPUTS], descs[trt_plugin.NUM_INPUTS:])
    assert name == "tree_attention_fp16" and ptx.startswith(b".version")


def described(core, dtype, rank: int):
    desc = core.DynamicPluginTensorDesc()
    desc.desc.type, desc.desc.format, desc.desc.dims = dtype, core.TensorFormat.LINEAR, core.Dims((1,) * rank)
    return desc
