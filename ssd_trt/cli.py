"""``ssd-trt COMMAND ...``: one command for everything the project does (also ``python -m ssd_trt``).

Each subcommand is a module's own command line, run as ``python -m`` runs it (``python -m ssd_trt.build`` and the
others keep working): this module only names them, finds the one asked for, and imports nothing else, so that
``ssd-trt --help`` answers at once. ``serve`` and ``generate`` also take model files (``from_files/cli.py``).
"""
from __future__ import annotations

import difflib
import importlib
import sys
from dataclasses import dataclass
from typing import Callable

PROG = "ssd-trt"
REAL_TARGET = "build/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
REAL_DRAFT = "build/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"


@dataclass(frozen=True)
class Command:
    name: str
    entry: str                  # "module:function", called with the arguments after the command's name
    summary: str
    examples: tuple[str, ...]


# One table: the help's list, the dispatch and each command's examples.
COMMANDS = (
    Command("serve", "ssd_trt.from_files.cli:serve",
            "OpenAI-compatible HTTP server, from model files or a build directory",
            (f"ssd-trt serve {REAL_TARGET} --draft {REAL_DRAFT}",
             "ssd-trt serve build/smollm2-135m --port 8000 --api-key KEY")),
    Command("generate", "ssd_trt.from_files.cli:generate", "generate text, from model files or a build directory",
            (f"ssd-trt generate {REAL_TARGET} --draft {REAL_DRAFT} --chat --prompt 'Write a haiku.'",
             "ssd-trt generate build/smollm2-135m --prompt 'The capital of France is' --json")),
    Command("build", "ssd_trt.build:main", "export, validate and compile a recipe's pair into a build directory",
            ("ssd-trt build recipes/smollm2-135m.yaml --if-stale",)),
    Command("triton", "ssd_trt.serve.triton.__main__:main", "serve a build with Triton Inference Server",
            ("ssd-trt triton export build/smollm2-135m --out runs/triton-repo",
             "ssd-trt triton start runs/triton-repo")),
    Command("bench", "ssd_trt.bench.__main__:main", "benchmark a build's modes beside peer baselines",
            ("ssd-trt bench build/smollm2-135m --out runs/bench",)),
    Command("fetch", "ssd_trt.models.fetch:main", "fetch a real target/draft GGUF pair, checked by sha256",
            ("ssd-trt fetch qwen2.5-coder",)),
    Command("plan", "ssd_trt.sizing.cli:main", "will a recipe fit its GPUs? memory per GPU, from configs only",
            ("ssd-trt plan recipes/gpu/llama31-8b_llama32-1b.yaml --gpu-memory 80",)),
)
BY_NAME = {command.name: command for command in COMMANDS}
HELP_FLAGS = ("-h", "--help")


def usage() -> str:
    from ssd_trt import __version__
    width = max(len(command.name) for command in COMMANDS)
    lines = [f"usage: {PROG} COMMAND [ARGS...]   ({PROG} COMMAND --help: the command's flags and examples)", "",
             f"ssd-trt {__version__}: speculative speculative decoding as an ahead-of-time compiled engine", "",
             "commands:"]
    lines += [f"  {command.name:<{width}}  {command.summary}" for command in COMMANDS]
    lines += ["", "start here:", f"  {BY_NAME['serve'].examples[0]}",
              "  (the files: ssd-trt fetch qwen2.5-coder; any .gguf pair sharing a tokenizer works the same)"]
    return "\n".join(lines)


def entry_point(command: Command) -> Callable[[list[str]], int | None]:
    module, _, function = command.entry.partition(":")
    return getattr(importlib.import_module(module), function)


def run(command: Command, argv: list[str]) -> int:
    """The command's own main on ``argv``; after its --help, its examples."""
    main = entry_point(command)
    if not any(flag in argv for flag in HELP_FLAGS):
        return main(argv) or 0
    try:
        code = main(argv) or 0
    except SystemExit as done:         # argparse's --help exits
        code = done.code or 0
    if code == 0:
        print("\nexamples:\n" + "\n".join(f"  {example}" for example in command.examples))
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in HELP_FLAGS:
        print(usage(), file=sys.stdout if argv else sys.stderr)
        return 0 if argv else 2
    if argv[0] == "--version":
        from ssd_trt import __version__
        print(f"{PROG} {__version__}")
        return 0
    command = BY_NAME.get(argv[0])
    if command is None:
        nearest = difflib.get_close_matches(argv[0], list(BY_NAME), n=1)
        hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
        print(f"{PROG}: error: unknown command {argv[0]!r}{hint} (commands: {', '.join(BY_NAME)}; "
              f"{PROG} --help)", file=sys.stderr)
        return 2
    return run(command, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
