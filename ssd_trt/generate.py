"""``python -m ssd_trt.generate BUILD_DIR --prompt "..."``: generate text from a build directory.

Streams text to the terminal, or with ``--json`` prints one line
``{"text", "token_ids", "stats"}`` (token_ids: generated tokens only).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ssd_trt.arguments import ArgumentParser
from ssd_trt.detokenize import Detokenizer
from ssd_trt.errors import SsdTrtError
from ssd_trt.decoding.settings import DEFAULT_MODE, MODES, parse_mode
from ssd_trt.runtime import BACKENDS, RuntimeOptions


def parser(prog: str = "python -m ssd_trt.generate", model_metavar: str = "BUILD_DIR",
           model_help: str = "a directory made by `python -m ssd_trt.build`",
           prompt_required: bool = True) -> argparse.ArgumentParser:
    """The command line; ``ssd-trt generate`` (``from_files/cli.py``) extends it with the model-file flags."""
    p = ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("build_dir", type=Path, metavar=model_metavar, help=model_help)
    p.add_argument("--prompt", required=prompt_required, help="prompt text, tokenized as-is unless --chat")
    p.add_argument("--mode", default=DEFAULT_MODE, choices=MODES,
                   help=f"ar | sd (speculative) | ssd (Saguaro); default {DEFAULT_MODE}")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--draft-len", type=int, default=None,
                   help="K, draft tokens per round (sd/ssd); default: the build's, tuned for greedy or sampled")
    p.add_argument("--tree-widths", default=None, help="sd: verify a token tree, e.g. 2,2,1 children per depth")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of streaming")
    p.add_argument("--backend", default=None, choices=BACKENDS,
                   help="ort | trt | torch (torch decoder + Triton kernel on a GPU, no TensorRT); default: the "
                        "build's choice (TensorRT when usable, else ONNX Runtime)")
    p.add_argument("--no-cpu-kernel", action="store_true",
                   help="on CPU, run ONNX Runtime's MatMulNBits graph instead of ssd-trt's own kernels")
    return p


class TextPrinter:
    """An ``on_tokens`` callback that prints one row's text to stdout as its tokens are committed."""

    def __init__(self, tokenizer) -> None:
        self.detokenizer = Detokenizer.of(tokenizer)

    def __call__(self, row: int, tokens: list[int]) -> None:
        sys.stdout.write(self.detokenizer.push(tokens))
        sys.stdout.flush()

    def finish(self, text: str) -> None:
        """Print what is left of the final text, and a newline."""
        sys.stdout.write(self.detokenizer.finish(text) + "\n")
        sys.stdout.flush()


def parse_widths(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        from ssd_trt.errors import RequestError
        raise RequestError(f"--tree-widths must be comma-separated integers such as 2,2,1; got {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))


def run(args: argparse.Namespace, runtime: dict[str, Any] | None = None) -> int:
    """Generate as ``args`` (of :func:`parser`) say; ``runtime``: further RuntimeOptions fields (threads, cores)."""
    try:
        import ssd_trt
        params = ssd_trt.SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                        top_p=args.top_p, top_k=args.top_k, seed=args.seed)
        settings = parse_mode(args.mode, lambda name: '--' + name.replace('_', '-'),
                                 draft_len=args.draft_len, tree_widths=parse_widths(args.tree_widths))
        options = RuntimeOptions(backend=args.backend, cpu_kernel=not args.no_cpu_kernel, **(runtime or {}))
        generator = ssd_trt.load(args.build_dir, options)
        printer = TextPrinter(generator.tokenizer)
        [result] = generator.generate(args.prompt, params, mode=settings, chat=args.chat,
                                      on_tokens=None if args.json else printer)
    except SsdTrtError as error:
        print(f"ssd_trt.generate: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nssd_trt.generate: interrupted", file=sys.stderr)
        return 130
    except Exception as error:   # noqa: BLE001 -- a bug, not a user error: still one line, details on demand
        if os.environ.get("SSD_TRT_TRACEBACK"):
            raise
        print(f"ssd_trt.generate: internal error: {type(error).__name__}: {error} (set SSD_TRT_TRACEBACK=1 "
              f"for the traceback and please report it)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids, "stats": result.stats}))
    else:
        printer.finish(result.text)
        s = result.stats
        print(f"[{args.mode}] {s['generated_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, "
              f"ttft {s['ttft_s']:.3f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
