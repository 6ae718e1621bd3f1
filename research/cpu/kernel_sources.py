"""The research scripts' one way to run a given folder of kernel sources: compile it into its own cache entry (the
cache is keyed by the sources' hash, so two folders never collide) and point the Python face at that library. Each
script is run as ``python research/cpu/NAME.py``, which puts this folder on the path."""
from __future__ import annotations

from pathlib import Path

from ssd_trt.kernels import build, native


def library_of(sources: Path) -> Path:
    """The compiled library of the kernel sources in ``sources`` (built once, then taken from the cache)."""
    build.SOURCES = Path(sources).resolve()
    return build.library_path()


def use_library(lib: Path) -> None:
    """Kernels opened from now on load ``lib``."""
    native.library_path = lambda: lib


def use_sources(sources: Path) -> Path:
    """Compile ``sources`` and open kernels from it from now on; returns the library."""
    lib = library_of(sources)
    use_library(lib)
    return lib
