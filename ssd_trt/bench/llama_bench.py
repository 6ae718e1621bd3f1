"""llama.cpp's own binaries as the yardstick: ``llama-bench`` (decode speed), ``llama-lookup`` (its n-gram
speculative decoding) and ``llama-speculative`` / ``llama-speculative-simple`` (its draft-model speculative
decoding), compiled from the vendored source of llama-cpp-python's sdist by ``bash scripts/install_llama_cpp.sh``
into ``.llama_cpp/bin`` (or found on $SSD_TRT_LLAMA_CPP_BIN / PATH).

These are what a llama.cpp user runs; the ``llama_cpp`` rows (``bench/llama_cpp.py``) drive the same library
through its Python binding's generate loop, which adds per-token Python work, and stay labelled as such.

``llama-bench -p 0 -n N -d D``: N tokens generated after a context of D tokens (the measured prompts' mean
length), on the setting's threads and cores, repeated; its mean tokens/s is the row. ``llama-lookup``: greedy
generation per prompt with a prompt-lookup (n-gram) draft; its decode tokens/s over all prompts.
``llama-speculative -m TARGET -md DRAFT``: greedy generation of one prompt with a draft GGUF of the same vocabulary
(``run_llama_speculative``); its decode tokens/s, drafted and accepted tokens. It needs a second model, so it is not
one of the benchmark CLI's rows (``NAMES``); ``research/real_pair/llama_cpp_pair.py`` drives it.
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

# every llama.cpp binary this module runs, by row kind; NAMES: the kinds the benchmark CLI runs on its one GGUF
BINARIES = {"llama_bench": "llama-bench", "llama_lookup": "llama-lookup",
            "llama_speculative": "llama-speculative", "llama_speculative_simple": "llama-speculative-simple"}
NAMES = ("llama_bench", "llama_lookup", "llama_speculative")   # the benchmark's rows (llama_speculative: a GGUF draft)
SPECULATIVE_DRAFT = 3             # llama-speculative's draft length in the row: its best on code (docs/real_pair.md)
REPETITIONS = 3
LOOKUP_DRAFT = 4                  # tokens the n-gram draft proposes per step (as the binding's lookup row)
SPECULATIVE_CONTEXT = 4096        # -c of llama-speculative (the model's own 32k would allocate a KV cache for it)
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
# "n_drafted = 27", after whatever prefix the log adds ("main: ", "0.39.428.481 I ")
_SPEC_COUNTS = {key: re.compile(rf"(?<![\w.]){key}\s*=\s*(-?\d+)\s*$", re.M)
                for key in ("n_draft", "n_predict", "n_drafted", "n_accept")}


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


def run_llama_bench(gguf: Path, setting: Setting, new_tokens: int, depth: int,
                    repetitions: int = REPETITIONS) -> dict:
    """llama-bench's decode speed: tokens/s (mean and std over ``repetitions``) of ``new_tokens`` after ``depth``."""
    threads = setting.single_threads
    command = [str(binary("llama_bench")), "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-d", str(depth),
               "-t", str(threads), "-r", str(repetitions), "-o", "json"]
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


def run_llama_speculative_row(target_gguf: Path, draft_gguf: Path, setting: Setting, prompts: list[str],
                              new_tokens: int, draft_max: int = SPECULATIVE_DRAFT) -> dict:
    """llama-speculative, greedy, per prompt on the setting's threads: decode tokens/s over all prompts (sum of tokens
    / sum of seconds) and the acceptance over all drafted tokens."""
    runs = [run_llama_speculative(target_gguf, draft_gguf, prompt, new_tokens, setting.single_threads,
                                  setting.single_cores, draft_max) for prompt in prompts]
    drafted = sum(run["n_drafted"] for run in runs)
    return {"tokens_per_s": sum(r["decoded_tokens"] for r in runs) / sum(r["decode_seconds"] for r in runs),
            "acceptance": sum(r["n_accept"] for r in runs) / drafted if drafted else None,
            "threads": setting.single_threads, "prompts": len(prompts), "new_tokens": new_tokens, "draft_max": draft_max}


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def run_llama_speculative(target_gguf: Path, draft_gguf: Path, prompt_text: str, new_tokens: int, threads: int,
                          cores, draft_max: int, draft_min: int = 0, p_min: float = 0.0, *, simple: bool = False,
                          ignore_eos: bool = True, context: int = SPECULATIVE_CONTEXT, poll: int | None = None,
                          timeout: float | None = None) -> dict:
    """llama.cpp's draft-model speculative decoding of one prompt, greedy (``--temp 0``), both models on ``threads``
    threads pinned to ``cores``. ``simple``: ``llama-speculative-simple`` (the server's drafting loop: it honours
    ``draft_min`` and ``p_min``, the draft stops early below ``p_min``) instead of ``llama-speculative`` (one draft
    sequence of ``draft_max`` tokens per step; it accepts ``draft_min`` / ``p_min`` but does not use them).

    Returns decode tokens/s (llama.cpp's own "decoded N tokens in S seconds": generation after the prompt's
    evaluation, model loading excluded), the drafted and accepted token counts, the acceptance rate and the
    generated text. ``new_tokens`` is a floor: the last step may accept past it. ``poll``: the threads' busy-wait
    level (``--poll``, 0 = sleep; the draft's ``--poll-draft`` 0 or 1 to match); None keeps llama.cpp's (50).
    Its two thread pools (target, draft) take turns, so on a loaded machine several threads per model can be far
    slower than one."""
    name = "llama_speculative_simple" if simple else "llama_speculative"
    exe = binary(name)
    if exe is None:
        raise RuntimeError(unavailable_reason(name))
    with tempfile.TemporaryDirectory() as scratch:
        prompt_file = Path(scratch) / "prompt.txt"
        prompt_file.write_text(prompt_text)
        command = [str(exe), "-m", str(target_gguf), "-md", str(draft_gguf), "-f", str(prompt_file),
                   "-n", str(new_tokens), "-c", str(context), "-b", str(context),
                   "-t", str(threads), "-tb", str(threads), "-td", str(threads), "-tbd", str(threads),
                   "-ngl", "0", "-ngld", "0", "--temp", "0", "--top-k", "1", "--seed", "0",
                   "--spec-draft-n-max", str(draft_max), "--spec-draft-n-min", str(draft_min),
                   "--spec-draft-p-min", str(p_min)]
        if ignore_eos:
            command.append("--ignore-eos")
        if poll is not None:
            command += ["--poll", str(poll), "--poll-draft", "1" if poll else "0"]
        try:
            with pinned(cores):                # the child inherits these cores
                done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=timeout)
        except subprocess.TimeoutExpired as error:
            stderr = error.stderr.decode(errors="replace") if isinstance(error.stderr, bytes) else error.stderr or ""
            raise RuntimeError(f"{exe.name} timed out after {timeout} s; last stderr lines:\n{_tail(stderr)}") from None
    stderr, stdout = done.stderr, done.stdout
    decoded, encoded = _DECODED.search(stderr + stdout), _ENCODED.search(stderr + stdout)
    counts = {key: pattern.search(stderr + stdout) for key, pattern in _SPEC_COUNTS.items()}
    if done.returncode != 0 or decoded is None or counts["n_drafted"] is None or counts["n_accept"] is None:
        raise RuntimeError(f"{' '.join(command)} failed (exit {done.returncode}"
                           f"{'' if decoded else ', no decode speed in its output'}); last stderr lines:\n"
                           f"{_tail(stderr)}")
    tokens, seconds = int(decoded.group(1)), float(decoded.group(2))
    drafted, accepted = int(counts["n_drafted"].group(1)), int(counts["n_accept"].group(1))
    # stdout holds only the text: "\n\n" PROMPT GENERATED "\n\n" ... "\n\n" (the statistics go to stderr)
    text = stdout[2:] if stdout.startswith("\n\n") else stdout
    text = text[:-4] if text.endswith("\n\n\n\n") else text.rstrip("\n")
    prompt_echoed = text.startswith(prompt_text)
    return {"tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
            "decoded_tokens": tokens, "decode_seconds": seconds,
            "prompt_tokens": int(encoded.group(1)) if encoded else None,
            "prefill_seconds": float(encoded.group(2)) if encoded else None,
            "n_drafted": drafted, "n_accept": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "text": text[len(prompt_text):] if prompt_echoed else text, "text_includes_prompt": not prompt_echoed,
            "threads": threads, "cores": list(cores) if cores else None, "new_tokens": new_tokens,
            "draft_max": draft_max, "draft_min": draft_min, "p_min": p_min, "binary": exe.name,
            "command": " ".join(command[1:]).replace(str(prompt_file), "PROMPT_FILE")}
