"""llama.cpp, the CPU yardstick, on the very GGUF file the target is built from (llama-cpp-python).

An optional extra (``bash scripts/install_llama_cpp.sh``: llama-cpp-python's sdist compiles llama.cpp with
AMX off, ~3 min on 2 cores; the ``bench`` extra in pyproject.toml names the version). Two baselines: greedy decoding, and llama-cpp-python's prompt-lookup speculative decoding
(``LlamaPromptLookupDecoding``, its only draft option). Both get the same prompt token ids as this engine
and the same thread count and cores as the setting gives a model that runs alone. Different kernels
(llama.cpp quantizes activations to 8 bits in its 4-bit matmuls), so agreement with this engine's AR is
reported as a rate, not as a pass/fail.
"""
from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from tqdm import tqdm

from ssd_trt.bench.prompts import Prompt
from ssd_trt.bench.runner import PromptRun
from ssd_trt.bench.settings import Setting
from ssd_trt.engines.affinity import pinned

LOOKUP_TOKENS = 4           # tokens the prompt-lookup draft proposes per step (llama-cpp-python's default is 10)
NAMES = ("llama_cpp", "llama_cpp_lookup")


def unavailable_reason() -> str | None:
    """None when llama-cpp-python imports; else why the llama.cpp baselines are skipped."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python is not installed (optional: `bash scripts/install_llama_cpp.sh`, which "
                "compiles llama.cpp, ~3 min on 2 cores)")
    try:
        from llama_cpp import Llama  # noqa: F401
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # noqa: F401
    except (ImportError, OSError) as error:     # a wheel without its shared library, or another API
        return f"llama-cpp-python is installed but does not load here ({error})"
    return None


def run_llama_cpp(gguf: Path, setting: Setting, prompts: list[Prompt], encoded: list[list[int]],
                  max_new_tokens: int, eos_ids: list[int], label: str) -> list[PromptRun]:
    """Greedy generation per prompt (``label`` llama_cpp_lookup: with prompt-lookup drafting)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads = setting.single_threads
    runs = []
    with pinned(setting.single_cores):          # llama.cpp's worker threads inherit these cores
        draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS) if label == "llama_cpp_lookup" else None
        llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=2048, n_batch=512,
                    draft_model=draft, verbose=False)
        for prompt, ids in tqdm(list(zip(prompts, encoded)), desc=f"{setting.name} {label}", unit="prompt",
                                leave=False):
            runs.append(_one(llm, prompt, ids, max_new_tokens, set(eos_ids)))
    return runs


def _one(llm, prompt: Prompt, ids: list[int], max_new_tokens: int, eos_ids: set[int]) -> PromptRun:
    llm.reset()
    tokens: list[int] = []
    ttft = None
    start = time.perf_counter()
    for token in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if ttft is None:
            ttft = time.perf_counter() - start
        tokens.append(int(token))
        if int(token) in eos_ids or len(tokens) >= max_new_tokens:     # as this engine stops: EOS included
            break
    return PromptRun(prompt.id, prompt.category, tokens, time.perf_counter() - start, ttft)

