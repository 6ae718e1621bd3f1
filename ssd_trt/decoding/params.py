"""Sampling parameters of one request, validated once when constructed."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ssd_trt.decoding.grammar import Grammar
from ssd_trt.decoding.logprobs import MAX_TOP_LOGPROBS
from ssd_trt.errors import RequestError

MAX_NEW_TOKENS_LIMIT = 1 << 16


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """``temperature == 0`` is greedy; top-k/top-p apply to target and draft alike."""
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_on_eos: bool = True
    stop_token_ids: tuple[int, ...] = ()   # generation ends after any of these (kept in the output, like EOS)
    stop: tuple[str, ...] = ()             # stop strings: generation ends when the text contains one; the text
                                           # returned ends before it (token ids: through the token completing it)
    logprobs: int | None = None            # each generated token's target logprob and this many alternatives
                                           # (decoding/logprobs.py); None: none
    prompt_logprobs: int | None = None     # the same for the prompt's tokens (all but the first)
    min_p: float = 0.0                     # keep tokens with at least min_p times the most likely one's probability
    presence_penalty: float = 0.0          # the target's logits adjusted (decoding/penalties.py): OpenAI's
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0        # vLLM's (CTRL's), over prompt and output; 1 = off
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit)
    grammar: Grammar | None = None         # what the output must match (decoding/grammar.py); None: anything
    mask_draft: bool = True                # the draft is masked by the grammar too (False: the target only, which
                                           # is as exact and accepts less: research/serving/structured_acceptance.py)

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise RequestError(f"max_new_tokens must be an integer in 1..{MAX_NEW_TOKENS_LIMIT}, "
                               f"got {self.max_new_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) \
                or self.temperature < 0 or math.isinf(self.temperature):
            raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or math.isnan(self.top_p) or not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or self.seed < 0):
            raise RequestError(f"seed must be a non-negative integer or None, got {self.seed!r}")

        for name in ("stop_token_ids", "stop"):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
                raise RequestError(f"{name} must be a list, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise RequestError(f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)}")
        if any(not isinstance(text, str) or not text for text in self.stop):
            raise RequestError(f"stop strings must be non-empty strings, got {list(self.stop)}")
        for name, low, high in (("min_p", 0.0, 1.0), ("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0),
                                ("repetition_penalty", 1e-3, 100.0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise RequestError(f"{name} must be a number in [{low:g}, {high:g}], got {value!r}")
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(bias.items())
        if not isinstance(bias, (list, tuple)) or any(
                not isinstance(pair, (list, tuple)) or len(pair) != 2 or isinstance(pair[0], bool)
                or not isinstance(pair[0], int) or pair[0] < 0 or isinstance(pair[1], bool)
                or not isinstance(pair[1], (int, float)) or not -100 <= pair[1] <= 100 for pair in bias):
            raise RequestError(f"logit_bias must map token ids (integers >= 0) to biases in [-100, 100], got "
                               f"{self.logit_bias!r}")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_TOP_LOGPROBS):
                raise RequestError(f"{name} must be an integer in 0..{MAX_TOP_LOGPROBS} (alternatives per token) "
                                   f"or None, got {value!r}")

        if self.grammar is not None and not isinstance(self.grammar, Grammar):
            raise RequestError(f"grammar must be a decoding.grammar.Grammar or None, got {self.grammar!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
