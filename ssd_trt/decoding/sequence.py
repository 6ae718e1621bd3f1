"""One request inside the engine step: its sampling parameters, its own random streams, what it has
generated, where it stands against its stop conditions, and what the draft and the target have not yet seen.

A request's random draws come only from its own streams, in the order its own rounds make them, so a seeded
sampled request draws the same numbers alone or batched with any others.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ssd_trt.decoding.feature_relay import FeatureLog
from ssd_trt.decoding.grammar import GrammarState
from ssd_trt.decoding.logprobs import TokenLogprob
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.sampling import TokenDistribution
from ssd_trt.decoding.settings import ResolvedMode
from ssd_trt.decoding.stats import RoundStats

FINISH_REASONS = ("eos", "stop", "length", "abort", "error")


@dataclass
class Speculation:
    """K drafted tokens for one request, the distributions they were drawn from (K rows; None when greedy) and where
    they came from: sd (a chain drafted in turn with the verification) | primary (an SSD cache hit) | jit (drafted
    just in time) | ngram (prompt lookup).

    ``held_logits`` [K, V]: SSD's draft kept the chain it drafted these tokens on, so its cache holds t*_prev,
    s_1..s_{K-1} past the committed tokens (the request's ``draft_pending`` is then empty), and these are its
    logits after each of them (they drew s_1..s_K). The next round's glue decode feeds s_K alone
    (``saguaro.DraftWorker``); dropping the speculation releases those K slots (:func:`held_tokens`)."""
    tokens: np.ndarray
    dists: TokenDistribution | None
    source: str
    held_logits: np.ndarray | None = None


def held_tokens(speculation: Speculation | None) -> int:
    """The draft cache slots a speculation holds past the committed tokens (0: none, the draft is at the invariant:
    committed tokens but ``draft_pending`` and the unfed one)."""
    return 0 if speculation is None or speculation.held_logits is None else len(speculation.tokens)


@dataclass
class StopRule:
    """EOS, stop token ids, stop strings and the token limit of one request."""
    params: SamplingParams
    eos_ids: frozenset[int]
    decode: Callable[[list[int]], str]

    def token_ends(self, token: int) -> str | None:
        if token in self.params.stop_token_ids:
            return "stop"
        if self.params.stop_on_eos and token in self.eos_ids:
            return "eos"
        return None

    def stop_string_at(self, text: str, checked: int) -> int | None:
        """Where the first stop string starts in ``text``, looking only where a match may end past ``checked``."""
        if not self.params.stop:
            return None
        longest = max(len(s) for s in self.params.stop)
        window_start = max(0, checked - longest + 1)
        found = [at for s in self.params.stop if (at := text.find(s, window_start)) >= 0]
        return min(found) if found else None


@dataclass
class SequenceState:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    resolved: ResolvedMode
    stop_rule: StopRule
    rng: np.random.Generator                  # the target's draws for this request
    draft_rng: np.random.Generator            # the draft's
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    text_end: int | None = None               # a stop string's start: the text is cut there
    checked_chars: int = 0                    # text already searched for stop strings
    unfed: int | None = None                  # the committed token the target's cache does not hold yet
    draft_pending: list[int] = field(default_factory=list)   # committed tokens the draft's cache lacks
    speculation: Speculation | None = None    # SSD: the next round's tokens, ready
    features: FeatureLog | None = None        # the target's features of the verified tokens (for an EAGLE-3 draft)
    stats: RoundStats | None = None
    grammar: GrammarState | None = None       # the request's grammar, advanced by what it commits (params.grammar)
    logprobs: list[TokenLogprob] = field(default_factory=list)      # of ``tokens``, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)   # of prompt[1:], when params.prompt_logprobs
    added_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None

    @classmethod
    def create(cls, request_id: str, prompt: list[int], params: SamplingParams, resolved: ResolvedMode,
               eos_ids: frozenset[int], decode: Callable[[list[int]], str], stream: int = 0) -> "SequenceState":
        """Two random streams from the request's seed (and ``stream``: independent ones for the prompts of one
        batch): the target's draws and the draft's. Unseeded: fresh entropy."""
        seed = params.seed
        rng, draft_rng = (np.random.default_rng() for _ in range(2)) if seed is None else \
            (np.random.default_rng([seed, stream, role]) for role in range(2))
        stats = RoundStats(mode=resolved.name, draft_len=resolved.settings.checked_draft_len or 0)
        return cls(request_id, list(prompt), params, resolved, StopRule(params, eos_ids, decode), rng, draft_rng,
                   stats=stats)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def history(self) -> list[int]:
        """Every token of the sequence: the prompt and what was generated."""
        return self.prompt + self.tokens

    def commit(self, new_tokens: list[int], logprobs: list[TokenLogprob] | None = None) -> list[int]:
        """Append tokens up to the first stop condition; returns what was kept (the last one: the new unfed
        token, when the request goes on). ``logprobs``: the tokens' own, kept alongside them."""
        if self.finished:
            return []
        kept: list[int] = []
        for token in new_tokens:
            kept.append(int(token))
            reason = self.stop_rule.token_ends(int(token))
            if reason is None and self.grammar is not None:
                self.grammar.advance([int(token)])
                if self.grammar.finished:         # complete: it allows only EOS now, which adds nothing
                    reason = "stop"
            if reason is None and self.params.stop:
                text = self.stop_rule.decode(self.tokens + kept)
                at = self.stop_rule.stop_string_at(text, self.checked_chars)
                self.checked_chars = len(text)
                if at is not None:
                    reason, self.text_end = "stop", at
            if reason is None and len(self.tokens) + len(kept) >= self.params.max_new_tokens:
                reason = "length"
            if reason is not None:
                self.finish(reason)
                break
        self.tokens += kept
        if logprobs is not None:
            self.logprobs += logprobs[:len(kept)]
        if kept and self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if kept and not self.finished:
            self.unfed = kept[-1]
        return kept

    def finish(self, reason: str) -> None:
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finished_at = time.perf_counter()

    def text(self, decode: Callable[[list[int]], str]) -> str:
        text = decode(self.tokens)
        return text if self.text_end is None else text[:self.text_end]
