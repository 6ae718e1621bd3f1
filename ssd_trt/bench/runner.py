"""Run one mode (or one peer baseline) over a prompt set under one hardware setting."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

import ssd_trt
from ssd_trt.bench.prompts import Prompt
from ssd_trt.bench.settings import Setting
from ssd_trt.decoding.settings import Settings
from ssd_trt.engines.affinity import pinned

ROUND_KEYS = ("mean_accepted", "acceptance_rate", "cache_hit_rate", "verify_latency_s", "draft_latency_s",
              "verify_overlap_fraction", "rounds")


@dataclass
class PromptRun:
    prompt_id: str
    category: str
    tokens: list[int]
    seconds: float
    ttft_s: float | None
    stats: dict = field(default_factory=dict)


class LoadedBuilds:
    """Each build loaded once per (hardware setting, mode placement) for a whole benchmark run: sweep points and
    presets pass their decoding settings per call, so nothing is reloaded or re-hashed between them."""

    def __init__(self) -> None:
        self._generators: dict[tuple[str, str, str], ssd_trt.Generator] = {}

    def get(self, build_dir: Path, setting: Setting, mode: str) -> ssd_trt.Generator:
        key = (str(build_dir), setting.name, mode)
        if key not in self._generators:
            self._generators[key] = ssd_trt.load(build_dir, setting.options(mode))
        return self._generators[key]


def run_engine(builds: LoadedBuilds, build_dir: Path, setting: Setting, mode: Settings, prompts: list[Prompt],
               encoded: list[list[int]], params: ssd_trt.SamplingParams, label: str | None = None,
               keep_timeline: bool = False) -> list[PromptRun]:
    """``mode``: the decoding settings (ssd_trt.AR(), SD(...), SSD(...)) every prompt runs with."""
    generator = builds.get(build_dir, setting, mode.name)
    runs = []
    for prompt, ids in tqdm(list(zip(prompts, encoded)), desc=f"{setting.name} {label or mode.name}",
                            unit="prompt", leave=False):
        [result] = generator.generate_ids([ids], params, mode=mode)
        s = result.stats
        kept = {k: s.get(k) for k in ROUND_KEYS}
        if keep_timeline and "timeline" in s:
            kept["timeline"] = s["timeline"]
        runs.append(PromptRun(prompt.id, prompt.category, result.token_ids, s["elapsed_s"], s["ttft_s"], kept))
    return runs


def run_hf(target, assistant, setting: Setting, prompts: list[Prompt], encoded: list[list[int]],
           max_new_tokens: int, eos_ids: list[int], label: str) -> list[PromptRun]:
    import torch

    from ssd_trt.bench.baselines import hf_generate
    previous = torch.get_num_threads()
    torch.set_num_threads(setting.single_threads)
    runs = []
    try:
        with pinned(setting.single_cores):
            for prompt, ids in tqdm(list(zip(prompts, encoded)), desc=f"{setting.name} {label}", unit="prompt",
                                    leave=False):
                tokens, seconds, ttft = hf_generate(target, ids, max_new_tokens, eos_ids, assistant)
                runs.append(PromptRun(prompt.id, prompt.category, tokens, seconds, ttft))
    finally:
        torch.set_num_threads(previous)
    return runs


def summarise(runs: list[PromptRun], reference: list[PromptRun] | None) -> dict:
    """Aggregate tokens/s (total tokens / total time) and means of the round statistics."""
    tokens = sum(len(r.tokens) for r in runs)
    seconds = sum(r.seconds for r in runs)
    out = {"prompts": len(runs), "generated_tokens": tokens, "seconds": seconds,
           "tokens_per_s": tokens / seconds if seconds else None,
           "ttft_s": float(np.mean([r.ttft_s for r in runs if r.ttft_s is not None])) if runs else None,
           "exact_prompts": None if reference is None else
           sum(r.tokens == ref.tokens for r, ref in zip(runs, reference))}
    for key in ROUND_KEYS:
        values = [r.stats.get(key) for r in runs if r.stats.get(key) is not None]
        out[key] = float(np.mean(values)) if values else None
    ttfts = [r.ttft_s for r in runs if r.ttft_s is not None]
    add_ceiling(out, sum(ttfts) if len(ttfts) == len(runs) else None)
    return out


def add_ceiling(summary: dict, prefill_seconds: float | None) -> None:
    """The ceiling is (mean accepted + 1) tokens per target verification: what rounds could yield with no
    time outside verification. ``ceiling_fraction`` divides the whole request's rate by it (prefill
    included); ``decode_ceiling_fraction`` divides the rate after the first token (the rounds alone:
    tokens after the first over the time after it), which is what the ceiling describes."""
    s = summary
    s["ceiling_tokens_per_s"] = s["ceiling_fraction"] = s["decode_tokens_per_s"] = s["decode_ceiling_fraction"] = None
    if prefill_seconds is not None and s["seconds"] > prefill_seconds:
        s["decode_tokens_per_s"] = (s["generated_tokens"] - s["prompts"]) / (s["seconds"] - prefill_seconds)
    if s["mean_accepted"] is not None and s["verify_latency_s"]:
        s["ceiling_tokens_per_s"] = (s["mean_accepted"] + 1) / s["verify_latency_s"]
        s["ceiling_fraction"] = s["tokens_per_s"] / s["ceiling_tokens_per_s"]
        if s["decode_tokens_per_s"] is not None:
            s["decode_ceiling_fraction"] = s["decode_tokens_per_s"] / s["ceiling_tokens_per_s"]


def by_category(runs: list[PromptRun], reference: list[PromptRun] | None) -> dict:
    categories = sorted({r.category for r in runs})
    result = {}
    for category in categories:
        pick = [i for i, r in enumerate(runs) if r.category == category]
        result[category] = summarise([runs[i] for i in pick], None if reference is None else [reference[i] for i in pick])
    return result


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> dict:
    """How often greedy outputs equal a reference's (prompt by prompt): whole outputs, and the mean fraction
    of each reference output before the first differing token. For engines whose kernels differ (llama.cpp,
    int8 activations) this is a rate, not a pass/fail."""
    same = sum(out == ref for out, ref in zip(outputs, reference))
    prefix = [next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref))) / max(len(ref), 1)
              for out, ref in zip(outputs, reference)]
    return {"identical_prompts": same, "prompts": len(reference), "mean_agreeing_prefix": sum(prefix) / max(len(prefix), 1)}
