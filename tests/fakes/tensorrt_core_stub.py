"""A stub of TensorRT's compiled core module, enough for the real pure-Python ``tensorrt.plugin`` package to run.

The 11.4 wheel's ``tensorrt.plugin`` (``tests/tensorrt_wheel.py``) imports ``tensorrt`` for its enums, base classes,
plugin fields and registry. This module stands in for those, and nothing more: the enums carry the member names of
``tensorrt_rtx`` (``tests/test_trt_plugin_qdp.py`` checks them), the base classes are empty, and the registry and the
shape-expression builder record what the plugin package does with them. The validators, the registration logic and
the plugin classes that run are the wheel's own.
"""
from __future__ import annotations

import operator
import types

import numpy as np


class StubEnumMember:
    def __init__(self, owner: str, name: str, value: int) -> None:
        self.name, self.value, self._owner = name, value, owner

    def __int__(self) -> int:
        return self.value

    def __repr__(self) -> str:
        return f"{self._owner}.{self.name}"


def stub_enum(owner: str, *names: str) -> type:
    members = {name: StubEnumMember(owner, name, value) for value, name in enumerate(names)}
    return type(owner, (), {**members, "__members__": members})


ENUMS = {
    "DataType": ("FLOAT", "HALF", "INT8", "INT32", "BOOL", "UINT8", "FP8", "BF16", "INT64", "INT4", "FP4"),
    "TensorFormat": ("LINEAR", "CHW2", "HWC8", "CHW4", "CHW16", "CHW32", "DHWC8", "CDHW32", "HWC", "DLA_LINEAR",
                     "DLA_HWC4", "HWC16", "DHWC"),
    "PluginFieldType": ("FLOAT16", "FLOAT32", "FLOAT64", "INT8", "INT16", "INT32", "CHAR", "DIMS", "UNKNOWN", "BF16",
                        "INT64", "FP8", "INT4", "FP4"),
    "DimensionOperation": ("SUM", "PROD", "MAX", "MIN", "SUB", "EQUAL", "LESS", "FLOOR_DIV", "CEIL_DIV"),
    "QuickPluginCreationRequest": ("UNKNOWN", "PREFER_JIT", "PREFER_AOT", "STRICT_JIT", "STRICT_AOT"),
    "TensorRTPhase": ("BUILD", "RUNTIME"),
    "PluginArgType": ("INT",),
    "PluginArgDataType": ("INT8", "INT16", "INT32"),
}
_OPERATIONS = {"SUM": operator.add, "PROD": operator.mul, "MAX": max, "MIN": min, "SUB": operator.sub,
               "EQUAL": lambda a, b: int(a == b), "LESS": lambda a, b: int(a < b), "FLOOR_DIV": operator.floordiv,
               "CEIL_DIV": lambda a, b: -(-a // b)}


class IDimensionExpr:
    """A dimension: a constant, or a named symbol (an expression of symbols)."""

    def __init__(self, value: int | None = None, symbol: str = "") -> None:
        self.value, self.symbol = value, symbol or str(value)

    def is_constant(self) -> bool:
        return self.value is not None

    def get_constant_value(self) -> int:
        return self.value

    def is_size_tensor(self) -> bool:
        return False

    def __repr__(self) -> str:
        return self.symbol


class IExprBuilder:
    """Folds constant expressions and spells the rest (``operation`` records what the plugin asked for)."""

    def __init__(self) -> None:
        self.operations: list[str] = []

    def constant(self, value: int) -> IDimensionExpr:
        return IDimensionExpr(int(value))

    def operation(self, op: StubEnumMember, first: IDimensionExpr, second: IDimensionExpr) -> IDimensionExpr:
        self.operations.append(op.name)
        if first.is_constant() and second.is_constant():
            return IDimensionExpr(int(_OPERATIONS[op.name](first.value, second.value)))
        if (op.name, second.value) in (("SUM", 0), ("SUB", 0), ("PROD", 1), ("FLOOR_DIV", 1), ("CEIL_DIV", 1)):
            return first                            # x + 0 (how TensorDesc.like() copies a shape), x * 1, ...
        return IDimensionExpr(None, f"{op.name}({first.symbol}, {second.symbol})")


class DimsExprs(list):
    def __init__(self, length: int) -> None:
        super().__init__([None] * length)


class Dims(tuple):
    MAX_DIMS = 8

    def __new__(cls, shape=()):
        return super().__new__(cls, (shape,) * 0 if isinstance(shape, int) else tuple(shape))


class PluginTensorDesc:
    def __init__(self) -> None:
        self.type = self.format = None
        self.dims, self.scale = Dims(), 1.0


class DynamicPluginTensorDesc:
    def __init__(self) -> None:
        self.desc = PluginTensorDesc()
        self.min = self.max = self.opt = Dims()


class PluginField:
    def __init__(self, name: str = "", data=None, type: StubEnumMember | None = None) -> None:  # noqa: A002
        self.name, self.data, self.type = name, data, type


class PluginFieldCollection(list):
    pass


class StubPluginRegistry:
    """Records the creators the plugin package registers (TensorRT's registry keys them by name, version and
    namespace)."""

    def __init__(self) -> None:
        self.creators: dict[tuple[str, str, str], object] = {}

    def register_creator(self, creator, plugin_namespace: str = "") -> bool:
        key = (creator.name, creator.plugin_version, plugin_namespace)
        if key in self.creators:
            return False
        self.creators[key] = creator
        return True

    def get_creator(self, name: str, version: str, plugin_namespace: str = ""):
        return self.creators.get((name, version, plugin_namespace))


class Logger:
    def __init__(self, min_severity=None) -> None:
        self.messages: list[str] = []

    def log(self, severity, msg: str) -> None:
        self.messages.append(msg)


def stub_tensorrt_core(version: str = "11.4.0.106") -> types.ModuleType:
    """A fresh ``tensorrt`` stand-in (set its ``__path__`` to the directory holding ``plugin/``)."""
    core = types.ModuleType("tensorrt")
    core.__version__ = version
    for name, members in ENUMS.items():
        setattr(core, name, stub_enum(name, *members))
    logger_class = type("Logger", (Logger,), {level: StubEnumMember("Severity", level, value) for value, level in
                                              enumerate(("INTERNAL_ERROR", "ERROR", "WARNING", "INFO", "VERBOSE"))})
    core.Logger = logger_class
    for base in ("IPluginV3", "IPluginV3QuickCore", "IPluginV3QuickBuild", "IPluginV3QuickRuntime",
                 "IPluginV3QuickAOTBuild", "IPluginCreatorV3Quick", "ISymExpr", "ITensor"):
        setattr(core, base, type(base, (), {"__init__": lambda self: None}))
    for cls in (IDimensionExpr, IExprBuilder, DimsExprs, Dims, PluginTensorDesc, DynamicPluginTensorDesc, PluginField,
                PluginFieldCollection):
        setattr(core, cls.__name__, cls)
    registry = StubPluginRegistry()
    core.get_plugin_registry = lambda: registry
    core.float32, core.float16, core.bfloat16 = core.DataType.FLOAT, core.DataType.HALF, core.DataType.BF16
    core.int8, core.int32, core.int64, core.bool = (core.DataType.INT8, core.DataType.INT32, core.DataType.INT64,
                                                    core.DataType.BOOL)
    numpy_types = {"FLOAT": np.float32, "HALF": np.float16, "INT8": np.int8, "INT32": np.int32, "INT64": np.int64,
                   "BOOL": np.bool_}
    core.nptype = lambda dtype: numpy_types[dtype.name]
    return core
