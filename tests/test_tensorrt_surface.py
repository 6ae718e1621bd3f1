"""Every TensorRT call the runtime makes exists, with the parameters it is called with, in both editions.

The runtime (``engines/tensorrt.py``, ``engines/bindings.py``) declares what it uses (``RUNTIME_API``); here the
declaration is derived again from the source (so it cannot go stale), then checked against ``tensorrt_rtx``
(importable on CPU) and against the data-centre TensorRT 11.4 bindings wheel, read without importing it
(``tests/tensorrt_wheel.py``: the docstrings pybind11 registers for each class member, with their ``:arg:`` names). The recording fake the runtime
tests run against (``tests/fakes/recording_tensorrt.py``) is held to the same names and parameters, so a call renamed in
the runtime fails there and a fake that drifted from TensorRT fails here.
"""
from __future__ import annotations

import inspect
import io
import re
import tokenize

import pytest

from ssd_trt.engines import bindings, tensorrt
from ssd_trt.engines.editions import DATACENTER, RTX
from ssd_trt.engines.tensorrt import RUNTIME_API
from ssd_trt.trt.engine_build import require_user_allocation
from tests.fakes.recording_tensorrt import FAKE_CLASSES, FakeTensorRT
from tests.tensorrt_wheel import bindings_wheel, documented_api, documented_arguments, library_strings, \
    registered

HAS_RTX = RTX.installed()
needs_rtx = pytest.mark.skipif(not HAS_RTX, reason=f"tensorrt_rtx is not installed ({RTX.install_hint})")
OWNERS = {"engine": "ICudaEngine", "context": "IExecutionContext", "runtime": "Runtime"}


def used_api() -> set[tuple[str, str]]:
    """(class, member) of every ``engine.x`` / ``context.x`` / ``runtime.x`` / ``trt.Class.x`` in the runtime's code
    (not its strings or comments); a bare ``trt.Class`` is (class, "")."""
    used = set()
    for module in (tensorrt, bindings):
        tokens = [t.string for t in tokenize.generate_tokens(io.StringIO(inspect.getsource(module)).readline)
                  if t.type in (tokenize.NAME, tokenize.OP)]
        for index, token in enumerate(tokens[:-2]):
            if tokens[index + 1] != ".":
                continue
            if token in OWNERS:
                used.add((OWNERS[token], tokens[index + 2]))
            elif token == "trt":
                member = tokens[index + 4] if tokens[index + 3:index + 4] == ["."] else ""
                used.add((tokens[index + 2], member))
    return used


def declared_api() -> set[tuple[str, str]]:
    return {(owner, member) for owner, members in RUNTIME_API.items() for member in members}


def parameters(function) -> list[str]:
    return [name for name in inspect.signature(function).parameters if name != "self"]


def fake_methods() -> dict[tuple[str, str], object]:
    """The public methods and properties of the fake's classes."""
    found = {}
    for owner, cls in FAKE_CLASSES.items():
        for name, member in vars(cls).items():
            if not name.startswith("_") and (inspect.isfunction(member) or isinstance(member, property)):
                found[(owner, name)] = member
    found[("Runtime", "__init__")] = FakeTensorRT.Runtime
    return found


def test_the_runtime_uses_exactly_the_api_it_declares():
    used = used_api()
    undeclared = sorted(f"{owner}.{member}" for owner, member in used
                        if member and (owner, member) not in declared_api() or not member and owner not in RUNTIME_API)
    assert not undeclared, f"the runtime uses TensorRT API it does not declare in RUNTIME_API: {undeclared}"
    unused = sorted(f"{owner}.{member}" for owner, member in declared_api() if (owner, member) not in used)
    assert not unused, f"RUNTIME_API declares API the runtime no longer uses: {unused}"


def test_the_fake_has_every_call_the_runtime_declares():
    methods = fake_methods()
    for owner, member in declared_api():
        fake_class = FAKE_CLASSES.get(owner) or getattr(FakeTensorRT, owner)    # a class, or an enum of the module
        assert (owner, member) in methods or hasattr(fake_class, member), f"the fake lacks {owner}.{member}"


@needs_rtx
def test_every_declared_call_and_every_fake_method_exists_in_tensorrt_rtx():
    import tensorrt_rtx as trt

    missing = [f"{owner}.{member}" for owner, member in declared_api()
               if not hasattr(getattr(trt, owner, None), member)]
    assert not missing, f"tensorrt_rtx {trt.__version__} lacks {missing}"
    for (owner, member), fake in fake_methods().items():
        real = getattr(getattr(trt, owner), member, None)
        assert real is not None, f"the fake's {owner}.{member} is not in tensorrt_rtx"
        if isinstance(fake, property):
            assert isinstance(real, property), f"{owner}.{member} is a property in the fake only"
            continue
        signatures = re.findall(rf"{member}\(self: [\w.]+(.*?)\) -> ", real.__doc__ or "")
        names = [re.findall(r", (\w+): ", signature) for signature in signatures]
        assert parameters(fake) in names, f"{owner}.{member}: the fake takes {parameters(fake)}, tensorrt_rtx {names}"


def test_every_declared_call_is_in_the_tensorrt_11_4_bindings():
    wheel, why = bindings_wheel()
    if wheel is None:
        pytest.skip(f"the TensorRT 11.4 bindings wheel is not here: {why}")
    docs, strings = documented_api(wheel), library_strings(wheel)
    methods = fake_methods()
    evidence = {}
    for owner, member in sorted(declared_api()):
        if (owner, member) in docs:                 # a documented method: its :arg names are the fake's parameters
            documented = documented_arguments(docs[(owner, member)])
            fake = methods.get((owner, member))
            if fake is not None and not isinstance(fake, property):
                assert documented == parameters(fake), \
                    f"11.4 documents {owner}.{member}({', '.join(documented)}); the fake takes {parameters(fake)}"
            evidence[f"{owner}.{member}"] = f"documented ({', '.join(documented)})"
        elif any(f":ivar {member}:" in text for text in strings):
            evidence[f"{owner}.{member}"] = "a documented attribute"
        elif (owner, "descr") in docs and registered(member, strings):
            evidence[f"{owner}.{member}"] = "a registered name of a documented class"
        elif member in strings:
            evidence[f"{owner}.{member}"] = "a registered name"
        else:
            pytest.fail(f"TensorRT 11.4's bindings have no {owner}.{member}")
    assert evidence["IExecutionContext.set_input_shape"] == "documented (name, shape)"


def test_rtx_plans_require_user_allocation_for_stream_capture():
    """Set on RTX builds (the flag exists in tensorrt_rtx); data-centre 11.4 has no such flag, so it is left alone."""
    wheel, _ = bindings_wheel()
    if wheel is not None:
        assert "REQUIRE_USER_ALLOCATION" not in library_strings(wheel)

    class Config:
        def __init__(self) -> None:
            self.flags = []

        def set_flag(self, flag) -> None:
            self.flags.append(flag)

    class Flags:
        REQUIRE_USER_ALLOCATION = "REQUIRE_USER_ALLOCATION"

    class Module:
        BuilderFlag = Flags

    datacenter = Config()
    require_user_allocation(DATACENTER, Module, datacenter)
    assert datacenter.flags == []
    if not HAS_RTX:
        pytest.skip(f"tensorrt_rtx is not installed ({RTX.install_hint})")
    import tensorrt_rtx as trt

    config = trt.Builder(trt.Logger(trt.Logger.ERROR)).create_builder_config()
    assert not config.get_flag(trt.BuilderFlag.REQUIRE_USER_ALLOCATION)
    require_user_allocation(RTX, trt, config)
    assert config.get_flag(trt.BuilderFlag.REQUIRE_USER_ALLOCATION)
