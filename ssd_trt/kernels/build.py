"""Compiles the kernel library from ``csrc/`` with the machine's gcc, once per source version, into a cache folder.

Each instruction set's file gets its own flags (the AVX-512 file -mavx512f/bw/vl/vnni, the AVX2 file -mavx2 -mfma,
the scalar specification no SIMD flags and -ffp-contract=off); the library then picks a path at run time from the
CPU's flags (``ssd_cpu_features``), so one build runs on every x86-64 machine. No -march=native: on the Intel
machines here that lets the compiler emit AMX, which they fault on. ``python -m ssd_trt.kernels`` builds it (the
install does) and says which path this CPU takes.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

SOURCES = Path(__file__).with_name("csrc")
COMMON = ["-O3", "-std=c11", "-fPIC", "-Wall", "-Wextra", "-fno-strict-aliasing"]
FLAGS = {
    "scalar.c": ["-O2", "-ffp-contract=off"],
    "avx2.c": ["-mavx2", "-mfma", "-mf16c"],
    "avx512.c": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"],
    "dispatch.c": [],
    "pool.c": [],
    "step.c": ["-mavx2", "-mfma", "-mf16c"],     # the native engine opens only where the avx2 path runs
}
LIBRARY = "libssd_kernels.so"


class KernelBuildError(RuntimeError):
    """The kernel library could not be compiled here (the message says why)."""


def compiler() -> str:
    return os.environ.get("CC", "gcc")


def source_hash() -> str:
    """Of every source, the flags and the compiler's version: a changed one builds anew."""
    h = hashlib.sha256()
    for path in sorted(SOURCES.iterdir()):
        if path.suffix in (".c", ".h"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    h.update(repr((COMMON, FLAGS)).encode())
    try:
        h.update(subprocess.run([compiler(), "--version"], capture_output=True, text=True, timeout=30).stdout.encode())
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelBuildError(f"no C compiler: {compiler()} --version failed ({exc}); install gcc") from exc
    return h.hexdigest()[:16]


def cache_root() -> Path:
    if os.environ.get("SSD_TRT_KERNEL_CACHE"):
        return Path(os.environ["SSD_TRT_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ssd_trt" / "kernels"


def library_path() -> Path:
    """The compiled library, built now if this source version has none yet."""
    target = cache_root() / source_hash() / LIBRARY
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        objects = []
        for name, flags in FLAGS.items():
            obj = Path(work) / (name[:-2] + ".o")
            _run([compiler(), *COMMON, *flags, "-c", str(SOURCES / name), "-o", str(obj)], name)
            objects.append(str(obj))
        built = Path(work) / LIBRARY
        _run([compiler(), "-shared", "-o", str(built), *objects, "-lpthread", "-lm"], "linking")
        os.replace(built, target)      # atomic: a concurrent build finds a whole library or none
    return target


def _run(command: list[str], what: str) -> None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise KernelBuildError(f"compiling {what} failed: {exc}") from exc
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
        first = next((line for line in lines if "error" in line), lines[0])
        raise KernelBuildError(f"compiling {what} failed ({compiler()} exit {done.returncode}): {first.strip()}")
