"""Compile the tree-attention Triton kernel ahead of time to PTX, on any machine (no GPU needed).

``triton.compile(ASTSource(...), target=GPUTarget("cuda", sm, 32))`` lowers the kernel for one SM
without touching a driver. The result is what the TensorRT AOT plugin hands to TensorRT: a kernel
name, the PTX text and the launch parameters (threads per block, dynamic shared memory).

Two adjustments make the PTX safe to launch from TensorRT:

* PTX ISA version. Triton writes the newest version its bundled ``ptxas`` knows (9.x for sm_90),
  which older drivers refuse to JIT. We pin the oldest version that the target architecture accepts
  (:func:`ptx_version_for`): 8.0 up to Hopper (every CUDA 12+ driver; sm_90a's minimum), 8.6 for
  Blackwell data-centre sm_100a (CUDA 12.8), 8.7 for sm_120a (CUDA 12.8), 8.8 for sm_103a / sm_121a (CUDA
  12.9); LLVM refuses an older one ("PTX version 8.0 does not support target 'sm_120a'").
* Alignment. Pointer parameters are declared 16-byte aligned (TensorRT and torch allocate with at
  least 256-byte alignment and the runtime binds whole buffers or leading-dimension slices of them),
  which lets Triton vectorise the loads.
* Hidden parameters. Triton appends two pointer parameters (global and profile scratch) to every
  kernel, which its own launcher fills. TensorRT passes exactly inputs, extra scalars and outputs.
  When the kernel does not use the scratch buffers (checked: zero scratch size and no reference in
  the body) those trailing parameters are removed from the ``.entry`` declaration, so the parameter
  list TensorRT passes matches the kernel's exactly.

CLI (a CI check, and a way to inspect the PTX): ``python -m ssd_trt_plugins.tree_attention.ptx --sm 90``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ssd_trt_plugins.tree_attention.triton_kernel import KERNEL_INPUTS, KERNEL_OUTPUTS, KERNEL_SCALARS, KernelSpec, \
    kernel_function

DEFAULT_PTX_VERSION = 80
# the PTX ISA each architecture (Triton targets the "a" variants) first appeared in (PTX ISA release notes)
MINIMUM_PTX_VERSION = {100: 86, 101: 86, 103: 88, 110: 90, 120: 87, 121: 88}


def ptx_version_for(sm: int) -> int:
    """The oldest PTX ISA version (x10) that compiles for ``sm``: the widest range of drivers that run it."""
    if sm in MINIMUM_PTX_VERSION:
        return MINIMUM_PTX_VERSION[sm]
    if sm > max(MINIMUM_PTX_VERSION):
        raise ValueError(f"sm_{sm} is newer than this table of PTX ISA versions; pass ptx_version explicitly")
    return DEFAULT_PTX_VERSION
# TensorRT launches AOT kernels with the default dynamic shared-memory limit; above 48 KiB a kernel
# needs an explicit opt-in (cuFuncSetAttribute) that we cannot count on, so stay below it.
SHARED_MEMORY_LIMIT = 48 * 1024
NUM_KERNEL_PARAMS = len(KERNEL_INPUTS) + len(KERNEL_SCALARS) + len(KERNEL_OUTPUTS)


@dataclass(frozen=True, slots=True)
class PtxKernel:
    """One compiled kernel: everything TensorRT needs to launch it."""
    name: str
    ptx: str
    sm: int
    ptx_version: int
    num_warps: int
    shared_mem: int
    params: tuple[str, ...]

    @property
    def block_x(self) -> int:
        """Threads per block (Triton kernels are 1-D blocks of ``num_warps`` warps)."""
        return self.num_warps * 32


def entry_params(ptx: str, name: str) -> list[str]:
    """Parameter names of the ``.entry name(...)`` declaration, in order."""
    match = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, flags=re.S)
    if match is None:
        raise ValueError(f"no .entry {name} in the PTX")
    return re.findall(r"\.param\s+[^,]*?\s(\w+)\s*(?:,|$)", match.group(1).strip() + ",")


def strip_unused_trailing_params(ptx: str, name: str, keep: int) -> str:
    """Remove the ``.entry`` parameters after the first ``keep`` ones, if the body never reads them.

    Raises ValueError when a parameter to be removed is referenced (the kernel would need it).
    """
    params = entry_params(ptx, name)
    if len(params) <= keep:
        return ptx
    match = re.search(r"(\.entry\s+" + re.escape(name) + r"\s*\()(.*?)(\))", ptx, flags=re.S)
    header_end = match.end()
    body = ptx[header_end:]
    for extra in params[keep:]:
        if re.search(r"\b" + re.escape(extra) + r"\b", body):
            raise ValueError(f"kernel parameter {extra} is used by the kernel body; it cannot be dropped")
    lines = [line for line in match.group(2).split("\n") if line.strip()]
    kept = [line.rstrip().rstrip(",") for line in lines[:keep]]
    new_decl = match.group(1) + "\n" + ",\n".join(kept) + "\n" + match.group(3)
    return ptx[:match.start()] + new_decl + body


def compile_ptx(spec: KernelSpec, sm: int, ptx_version: int | None = None) -> PtxKernel:
    """Compile ``spec`` to PTX for compute capability ``sm`` (e.g. 90 for H100/H200, 80 for A100); the PTX
    ISA version defaults to the oldest ``sm`` accepts."""
    ptx_version = ptx_version_for(sm) if ptx_version is None else ptx_version
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: Triton's standard library is then interpreted and cannot "
                           "be compiled. Unset it to compile PTX.")
    if spec.interpreter:
        raise ValueError("compile a KernelSpec made for the GPU (interpreter=False)")
    if sm < 80:
        raise ValueError(f"the kernel targets sm_80 and newer (bf16 tensor cores); got sm_{sm}")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = spec.signature()
    # TensorRT and torch allocations are at least 256-byte aligned: let Triton vectorise loads.
    aligned = {(index,): [["tt.divisibility", 16]]
               for index, kind in enumerate(signature.values()) if kind.startswith("*")}
    source = ASTSource(fn=kernel_function(interpret=False), signature=signature,
                       constexprs=spec.constexprs(), attrs=aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", sm, 32),
                              options={"num_warps": spec.num_warps, "num_stages": spec.num_stages,
                                       "ptx_version": ptx_version, "enable_fp_fusion": True})
    metadata = compiled.metadata
    if getattr(metadata, "global_scratch_size", 0) or getattr(metadata, "profile_scratch_size", 0):
        raise ValueError("the kernel needs Triton scratch memory, which a TensorRT AOT launch does not provide")
    if metadata.shared > SHARED_MEMORY_LIMIT:
        raise ValueError(f"kernel needs {metadata.shared} bytes of shared memory (> {SHARED_MEMORY_LIMIT}); "
                         f"use smaller blocks than {spec}")
    ptx = strip_unused_trailing_params(compiled.asm["ptx"], metadata.name, NUM_KERNEL_PARAMS)
    return PtxKernel(name=metadata.name, ptx=ptx, sm=sm, ptx_version=ptx_version, num_warps=metadata.num_warps,
                     shared_mem=metadata.shared, params=tuple(entry_params(ptx, metadata.name)))


def main(argv: list[str] | None = None) -> int:
    """Compile one kernel instance and print its name and launch parameters (JSON with --json)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sm", type=int, default=90)
    parser.add_argument("--dtype", choices=("fp16", "bf16", "fp32"), default="fp16")
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-m", type=int, default=16)
    parser.add_argument("--block-s", type=int, default=64)
    parser.add_argument("--block-n", type=int, default=32)
    parser.add_argument("--num-stages", type=int, default=2)
    parser.add_argument("--ptx-version", type=int, help="PTX ISA version x10 (default: the oldest --sm accepts)")
    parser.add_argument("--out", type=Path, help="write the PTX to this file")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    args = parser.parse_args(argv)
    spec = KernelSpec(args.dtype, args.q_heads, args.kv_heads, args.head_dim, args.head_dim ** -0.5,
                      block_m=args.block_m, block_s=args.block_s, block_n=args.block_n,
                      num_stages=args.num_stages)
    kernel = compile_ptx(spec, args.sm, args.ptx_version)
    if args.out:
        args.out.write_text(kernel.ptx)
    summary = {key: value for key, value in asdict(kernel).items() if key != "ptx"}
    summary.update(block_x=kernel.block_x, ptx_bytes=len(kernel.ptx), block_t=spec.block_t,
                   grid_for_batch1_decode=spec.grid(1, 1))
    print(json.dumps(summary) if args.json else "\n".join(f"{k}: {v}" for k, v in summary.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
