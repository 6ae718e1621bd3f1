"""``ssd-trt serve`` and ``ssd-trt generate``: from a build directory, or straight from model files.

MODEL is a build directory (``manifest.json``: served as ``python -m ssd_trt.serve.openai`` / ``ssd_trt.generate``
serve it), or a target model: a ``.gguf`` file or a Hugging Face checkpoint folder, with ``--draft`` beside it. From
files, the recipe is written from their metadata (``recipe.py``), built once into the cache (``cache.py``), and every
later start with the same files and build flags uses that build at once. The parsers are the two modules' own, with
the model-file flags added here, so every server and generator flag means what it means there.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ssd_trt.decoding.settings import DEFAULT_MODE
from ssd_trt.errors import ConfigError, SsdTrtError
from ssd_trt.manifest import MANIFEST_NAME

MODEL_HELP = ("a .gguf file or a Hugging Face checkpoint folder (the target; built once into the cache, "
              "$SSD_TRT_CACHE or ~/.cache/ssd-trt), or a build directory (python -m ssd_trt.build)")
# the flags that describe a build from model files: a build directory has fixed them in its recipe
FILE_FLAGS = {"draft": "--draft", "max_model_len": "--max-model-len",
              "num_speculative_tokens": "--num-speculative-tokens"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def add_file_flags(p: argparse.ArgumentParser) -> None:
    files = p.add_argument_group("from model files (MODEL a .gguf file or a checkpoint folder)")
    files.add_argument("--draft", metavar="DRAFT",
                       help="the draft: a .gguf file or checkpoint folder with the target's tokenizer; left out, the "
                            "target drafts for itself, and a request that names no mode runs AR (serve's "
                            "--default-mode, generate's --mode)")
    files.add_argument("--max-model-len", type=int, metavar="TOKENS",
                       help="prompt + output tokens a request may reach (engine.max_context; default: 2048, or less "
                            "where the models were made for less)")
    files.add_argument("--num-speculative-tokens", type=int, metavar="K",
                       help="draft tokens per round, K, of SD and SSD (decoding.sd_draft_len / ssd_draft_len; "
                            "engine.max_draft_len at least K; default 2)")
    files.add_argument("--print-recipe", action="store_true",
                       help="print the recipe these files would be built from, and where, then exit: builds nothing")
    p.add_argument("--threads", type=int, metavar="N",
                   help="threads of each model (RuntimeOptions target_threads / draft_threads), each model on N "
                        "cores of its own where there are; default: from model files, half this machine's cores "
                        "each; a build directory, its recipe's engine.threads_per_engine")


@dataclass(frozen=True)
class Prepared:
    """What to run: a complete build directory, and the runtime options the flags asked for."""
    build_dir: Path
    runtime: dict[str, Any] = field(default_factory=dict)
    self_draft: bool = False                # no --draft: the target drafts for itself


def available_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def default_threads() -> int:
    """Half the cores this process may use, for each of the two models (at least one)."""
    return max(1, len(available_cores()) // 2)


def thread_options(threads: int) -> dict[str, Any]:
    """``--threads N`` as RuntimeOptions: N threads per model, the target on the first N cores and the draft on the N
    after them; a model with fewer cores left is placed by the OS (its ONNX Runtime threads would otherwise be pinned
    N to a core)."""
    if threads < 1:
        raise ConfigError(f"--threads must be a positive number of threads, got {threads}")
    cores = available_cores()
    target, draft = cores[:threads], cores[threads:2 * threads]
    return {"target_threads": threads, "draft_threads": threads,
            "target_cores": tuple(target) if len(target) == threads else None,
            "draft_cores": tuple(draft) if len(draft) == threads else None}


def prepare(args: argparse.Namespace) -> Prepared | None:
    """The build to run for ``args`` (built first if it must be); None when ``--print-recipe`` printed instead."""
    model = Path(args.build_dir).expanduser()
    if (model / MANIFEST_NAME).is_file():
        return _from_build_dir(model, args)
    return _from_files(args)


def _from_build_dir(model: Path, args: argparse.Namespace) -> Prepared | None:
    given = [flag for dest, flag in FILE_FLAGS.items() if getattr(args, dest) is not None]
    if given:
        raise ConfigError(f"{', '.join(given)} describe a build from model files, but {model} is a build directory "
                          f"(its recipe fixed them); leave them out, or give the model files")
    if args.print_recipe:
        import yaml

        from ssd_trt.manifest import read_manifest
        print(yaml.safe_dump(read_manifest(model).recipe.model_dump(mode="json"), sort_keys=False), end="")
        return None
    return Prepared(model, thread_options(args.threads) if args.threads is not None else {})


def _from_files(args: argparse.Namespace) -> Prepared | None:
    import ssd_trt
    from ssd_trt.from_files.cache import FileHashes, cache_root, ensure_built, entry_for, fingerprint
    from ssd_trt.from_files.models import inspect, locate
    from ssd_trt.from_files.recipe import RECIPE_VERSION, BuildFlags, recipe_data, recipe_name, recipe_yaml
    from ssd_trt.from_files.tokenizers import require_shared_tokenizer
    from ssd_trt.manifest import SCHEMA_VERSION

    target = locate(str(args.build_dir), "target")
    draft = locate(args.draft, "draft") if args.draft is not None else None
    flags = BuildFlags(args.max_model_len, args.num_speculative_tokens)
    threads = thread_options(args.threads if args.threads is not None else default_threads())
    root = cache_root()
    hashes = FileHashes(root / "builds")
    name = recipe_name(target)
    entry = entry_for(root, name, {"ssd_trt": ssd_trt.__version__, "manifest_schema": SCHEMA_VERSION,
                                   "recipe": RECIPE_VERSION, "name": name, "target": fingerprint(target, hashes),
                                   "draft": None if draft is None else fingerprint(draft, hashes), **flags.key()})
    if entry.complete() and not args.print_recipe:
        log(f"ssd-trt: these files were built before: {entry.build_dir}")
    else:
        facts = {"target": inspect(target, "target")}
        if draft is not None:
            facts["draft"] = inspect(draft, "draft")
            require_shared_tokenizer(facts["target"].tokenizer, facts["draft"].tokenizer,
                                     facts["target"].embedding_rows, facts["draft"].embedding_rows, str(draft.path))
        text = recipe_yaml(recipe_data(facts["target"], facts.get("draft"), flags), str(entry.build_dir))
        if args.print_recipe:
            print(text, end="")
            return None
        ensure_built(entry, text, [target, draft or target], log)
    return Prepared(entry.build_dir, threads, self_draft=draft is None)


def fail(command: str, error: BaseException) -> int:
    """A user error as one line (its message's lines joined), exit status 2."""
    print(f"ssd-trt {command}: error: {' '.join(str(error).split())}", file=sys.stderr)
    return 2


def interrupted(command: str) -> int:
    print(f"ssd-trt {command}: interrupted (a build cut short leaves nothing in the cache)", file=sys.stderr)
    return 130


def serve(argv: list[str] | None = None) -> int:
    """``ssd-trt serve MODEL [--draft DRAFT] [flags of python -m ssd_trt.serve.openai]``."""
    from ssd_trt.serve.openai import __main__ as openai_cli
    description = "An OpenAI-compatible HTTP server, from a build directory or straight from model files."
    p = openai_cli.parser(prog="ssd-trt serve", description=description, model_metavar="MODEL", model_help=MODEL_HELP)
    add_file_flags(p)
    p.set_defaults(default_mode=None)  # no draft: AR, else the usual default
    args = p.parse_args(argv)
    try:
        prepared = prepare(args)
        if prepared is None:
            return 0
        try:
            given = json.loads(args.runtime_options)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--runtime-options is not valid JSON ({exc})") from None
        if not isinstance(given, dict):
            raise ConfigError(f"--runtime-options must be a JSON object, got {args.runtime_options}")
    except (SsdTrtError, OSError) as error:     # OSError: a cache folder that cannot be written, say
        return fail("serve", error)
    except KeyboardInterrupt:
        return interrupted("serve")
    args.build_dir = prepared.build_dir
    args.default_mode = args.default_mode or ("ar" if prepared.self_draft else DEFAULT_MODE)
    args.runtime_options = json.dumps({**prepared.runtime, **given})    # an explicit --runtime-options field wins
    return openai_cli.run(args)


def generate(argv: list[str] | None = None) -> int:
    """``ssd-trt generate MODEL [--draft DRAFT] --prompt TEXT [flags of python -m ssd_trt.generate]``."""
    from ssd_trt import generate as generate_cli
    p = generate_cli.parser(prog="ssd-trt generate", model_metavar="MODEL", model_help=MODEL_HELP,
                            prompt_required=False)
    add_file_flags(p)
    p.set_defaults(mode=None)          # no draft: AR, else the usual default
    args = p.parse_args(argv)
    if args.prompt is None and not args.print_recipe:
        p.error("the following arguments are required: --prompt")
    try:
        prepared = prepare(args)
    except (SsdTrtError, OSError) as error:
        return fail("generate", error)
    except KeyboardInterrupt:
        return interrupted("generate")
    if prepared is None:
        return 0
    args.build_dir = prepared.build_dir
    args.mode = args.mode or ("ar" if prepared.self_draft else DEFAULT_MODE)
    return generate_cli.run(args, prepared.runtime)
