"""llama.cpp's own binaries as the yardstick: ``llama-bench`` (decode speed) and ``llama-lookup`` (its n-gram
speculative decoding), compiled from the vendored source of llama-cpp-python's sdist by
``bash scripts/install_llama_cpp.sh`` into ``.llama_cpp/bin`` (or found on $SSD_TRT_LLAMA_CPP_BIN / PATH).

These are what a llama.cpp user runs; the ``llama_cpp`` rows (``bench/llama_cpp.py``) drive the same library
through its Python binding's generate loop, which adds per-token Python work, and stay labelled as such.

``llama-bench -p 0 -n N -d D``: N tokens generated after a context of D tokens (the measured prompts' mean
length), on the setting's threads and cores, repeated; its mean tokens/s is the row. ``llama-lookup``: greedy
generation per prompt with a prompt-lookup (n-gram) draft; its decode tokens/s over all prompts.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from ssd_trt.bench.settings import Setting
from ssd_trt.engines.affinity import pinned

NAMES = ("llama_bench", "llama_lookup")
BINARIES = {"llama_bench": "llama-bench", "llama_lookup": "llama-lookup"}
REPETITIONS = 3
LOOKUP_DRAFT = 4                  # tokens the n-gram draft proposes per step (as the binding's lookup row)
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")


def binary(name: str) -> Path | None:
    """The binary of row ``name``: $SSD_TRT_LLAMA_CPP_BIN, the repository's .llama_cpp/bin, then PATH."""
    exe = BINARIES[name]
    for folder in (os.environ.get("SSD_TRT_LLAMA_CPP_BIN"), Path(__file__).resolve().parents[2] / ".llama_cpp" / "bin"):
        if folder and (Path(folder) / exe).is_file():
            return Path(folder) / exe
    found = shutil.which(exe)
    return Path(found) if found else None


def unavailable_reason(name: str) -> str | None:
    if binary(name) is None:
        return (f"{BINARIES[name]} is not built (optional: `bash scripts/install_llama_cpp.sh` compiles llama.cpp's "
                f"binaries from the vendored source of llama-cpp-python's sdist, ~9 min on 2 cores)")
    return None


def run_llama_bench(gguf: Path, setting: Setting, new_tokens: int, depth: int) -> dict:
    """llama-bench's decode speed: tokens/s (mean and std over REPETITIONS) of ``new_tokens`` after ``depth``."""
    threads = setting.single_threads
    command = [str(binary("llama_bench")), "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-d", str(depth),
               "-t", str(threads), "-r", str(REPETITIONS), "-o", "json"]
    with pinned(setting.single_cores):        # the child inherits these cores
        done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr[-800:]}")
    record = json.loads(done.stdout)[0]
    return {"tokens_per_s": float(record["avg_ts"]), "tokens_per_s_std": float(record["stddev_ts"]),
            "threads": threads, "new_tokens": new_tokens, "depth": depth, "command": " ".join(command[1:])}


def run_llama_lookup(gguf: Path, setting: Setting, prompts: list[str], new_tokens: int) -> dict:
    """llama-lookup, greedy, per prompt: decode tokens/s over all prompts (sum of tokens / sum of seconds)."""
    threads, tokens, seconds = setting.single_threads, 0, 0.0
    with tempfile.TemporaryDirectory() as scratch, pinned(setting.single_cores):
        for index, prompt in enumerate(prompts):
            path = Path(scratch) / f"prompt{index}.txt"
            path.write_text(prompt)
            command = [str(binary("llama_lookup")), "-m", str(gguf), "-f", str(path), "-n", str(new_tokens),
                       "--spec-draft-n-max", str(LOOKUP_DRAFT), "-t", str(threads), "-tb", str(threads), "--temp", "0",
                       "-c", "2048", "--ignore-eos"]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            match = _DECODED.search(done.stderr + done.stdout)
            if done.returncode != 0 or match is None:
                raise RuntimeError(f"llama-lookup failed on prompt {index} ({done.returncode}): {done.stderr[-800:]}")
            tokens, seconds = tokens + int(match.group(1)), seconds + float(match.group(2))
    return {"tokens_per_s": tokens / seconds, "threads": threads, "prompts": len(prompts), "new_tokens": new_tokens,
            "draft_max": LOOKUP_DRAFT}
