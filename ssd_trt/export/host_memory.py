"""Host memory a build needs, estimated before any long work, and the build's measured peak.

The estimates are the measured behaviour of each export path, not a bound proved from the code:

* in memory (``build._build``'s own path): the model in fp32, a traced copy with named weights, the ONNX proto
  and its serialised copies, the transformers parity copy and the validation sessions. A 0.22B-parameter
  Llama (2 layers of the 1B body) added 6.2 GB to the build's resident set while it was exported in memory
  (sampled from /proc during development): 28 bytes per parameter, plus the libraries' 1 GiB (a 1.07B one reached
  13.4 GB before it failed, issue 33).
* streamed (``export/streamed.py``): the libraries and the trace (1.5 GiB measured on a 1B skeleton), then the
  larger of two phases that never overlap: the export, a few fp32 copies of the largest tensor while it is
  converted in ~64 MB blocks (the tracer also materialises each zero-stride weight once in fp32 as it multiplies
  by it), and the bounded checks, the cut model's weights in fp32 (this decoder and transformers share them;
  the validation's torch reference holds the graph's dequantized copy) next to ONNX Runtime's session of the cut
  graph and the transient copies: three times its fp32 bytes. A 1.07B target with a 0.22B draft is estimated at
  4.0 GiB and peaked at 2.5 GiB (docs/bench/real_size/llama_1b_ort_int4.json).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import resource
from dataclasses import dataclass

GIB = 1 << 30
IN_MEMORY_BYTES_PER_PARAM = 28
LIBRARIES_BYTES = 1 * GIB
STREAMED_BASE_BYTES = 3 * GIB // 2


@dataclass(frozen=True)
class MemoryPlan:
    """What one model's export is expected to need at its peak, and why."""
    role: str
    path: str            # "in_memory" | "streamed"
    params: int
    peak_bytes: int

    def describe(self) -> str:
        return f"{self.role}: {self.params / 1e9:.2f}B parameters, {self.path} export, ~{self.peak_bytes / GIB:.1f} GiB"


def in_memory_peak(params: int) -> int:
    return IN_MEMORY_BYTES_PER_PARAM * params + LIBRARIES_BYTES


def streamed_peak(largest_tensor_numel: int, checked_params: int) -> int:
    return STREAMED_BASE_BYTES + max(3 * 4 * largest_tensor_numel, 3 * 4 * checked_params)


TENSORRT_WEIGHT_COPIES = 3.5
PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def tensorrt_peak(params: int, precision: str) -> int:
    """A TensorRT plan build of a model of ``params`` in ``precision``: the parsed weights, the builder's copy and
    the serialised plan. The 1.07B build peaked at 8.0 GiB while TensorRT for RTX built its target's bf16 plan (2.0
    GiB of weights), against 2.5 GiB for the same build without plans: the libraries plus 3.5 times the weights
    (docs/bench/real_size/llama_1b_ort_int4_and_rtx_plans.json, llama_1b_ort_int4.json)."""
    return LIBRARIES_BYTES + int(TENSORRT_WEIGHT_COPIES * PRECISION_BYTES[precision] * params)


def available_bytes() -> int:
    """Memory the kernel says can be had now without swapping (MemAvailable), else the physical total."""
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_rss_bytes() -> dict[str, int]:
    """The highest resident set this process (and, separately, its finished children) reached so far."""
    return {"self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}


def release_freed_memory() -> None:
    """Hand the heap that freed tensors left behind back to the kernel (glibc keeps it for reuse otherwise, and it
    counts as resident: the next phase's peak would sit on top of the last one's). Cycles are collected first
    (a validation session held in one would keep its weights). The trim is a no-op without glibc."""
    import gc
    gc.collect()
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is not None:
        trim(0)
