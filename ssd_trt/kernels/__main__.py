"""python -m ssd_trt.kernels: compile the CPU kernels now (the install does) and say which path this CPU takes."""
from __future__ import annotations

import argparse
import shutil
import sys

from ssd_trt.kernels.build import KernelBuildError, cache_root
from ssd_trt.kernels.native import Kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd_trt.kernels",
                                     description="Compile ssd-trt's CPU kernels and say which path this CPU takes.")
    parser.add_argument("--clean", action="store_true", help="remove every cached build first")
    args = parser.parse_args(argv)
    if args.clean and cache_root().exists():
        shutil.rmtree(cache_root())
    try:
        with Kernels() as kernels:
            print(f"ssd-trt kernels: {kernels.library} -- path {kernels.path} "
                  f"(this CPU runs: {', '.join(kernels.available_paths())})")
    except KernelBuildError as exc:
        print(f"ssd-trt kernels: not built, the CPU engine keeps ONNX Runtime's MatMulNBits: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
