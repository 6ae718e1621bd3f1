"""Per-request bookkeeping shared by every strategy: emitted tokens, stop conditions, timing."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ssd_trt.decoding.params import SamplingParams
from ssd_trt.engines.feeding import feed_ragged

TokenCallback = Callable[[int, list[int]], None]   # (row, newly committed token ids)


@dataclass
class Sequences:
    """The generated tokens of every row, with EOS / max-token stopping applied as tokens commit."""
    params: SamplingParams
    eos_ids: frozenset[int]
    batch: int
    on_tokens: TokenCallback | None = None
    tokens: list[list[int]] = field(init=False)
    done: np.ndarray = field(init=False)
    started: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None

    def __post_init__(self) -> None:
        self.tokens = [[] for _ in range(self.batch)]
        self.done = np.zeros(self.batch, dtype=bool)

    def commit(self, row: int, new_tokens: list[int]) -> list[int]:
        """Append tokens to ``row`` up to EOS / max_new_tokens; returns what was actually kept."""
        if self.done[row]:
            return []
        kept: list[int] = []
        for token in new_tokens:
            kept.append(int(token))
            if (self.params.stop_on_eos and token in self.eos_ids) or \
                    len(self.tokens[row]) + len(kept) >= self.params.max_new_tokens:
                self.done[row] = True
                break
        self.tokens[row] += kept
        if self.first_token_at is None and kept:
            self.first_token_at = time.perf_counter()
        if self.on_tokens and kept:
            self.on_tokens(row, kept)
        return kept

    @property
    def all_done(self) -> bool:
        return bool(self.done.all())

    def timing_stats(self) -> dict:
        elapsed = time.perf_counter() - self.started
        total = sum(len(t) for t in self.tokens)
        return {"generated_tokens": total, "elapsed_s": elapsed,
                "tokens_per_s": total / elapsed if elapsed > 0 else None,
                "ttft_s": None if self.first_token_at is None else self.first_token_at - self.started}


def first_tokens(target, prompts: list[list[int]], seqs: Sequences, rng: np.random.Generator) -> list[int]:
    """Reset the target, prefill every prompt, sample and commit each row's first token."""
    from ssd_trt.decoding.sampling import next_tokens
    target.reset(len(prompts))
    logits = feed_ragged(target, prompts)
    tokens = [int(t) for t in next_tokens(logits, seqs.params, rng)]
    for row, token in enumerate(tokens):
        seqs.commit(row, [token])
    return tokens
