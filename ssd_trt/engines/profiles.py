"""Optimisation profiles: the step shapes the runtime uses, derived from the recipe's limits.

One step graph serves every kind of step; only the number of new tokens T differs:

  decode   T = 1          autoregressive steps, the draft's plain decode
  verify   T = K + 1      target verification of K drafted tokens plus the bonus position, and the
                          draft's glue decode (same shape)
  tree     T in [2, N]    the draft's tree decode over all N fan-out branches (fewer after a miss)
  prefill  T in [1, C]    prompts (C = max_context)

A TensorRT engine gets one optimisation profile per kind (kernels are tuned for each profile's
``opt`` shape); the batch runs from 1 to max_batch, and the cache capacity S is always max_context
(the runtime owns caches of exactly that size).
"""
from __future__ import annotations

from dataclasses import dataclass

from ssd_trt.engines.limits import EngineLimits

MASK_WORD_BITS = 32


@dataclass(frozen=True, slots=True)
class Profile:
    """One optimisation profile: ranges (min, opt, max) of the batch and of the new-token count T."""
    name: str
    batch: tuple[int, int, int]
    tokens: tuple[int, int, int]

    def __post_init__(self) -> None:
        for label, (low, opt, high) in (("batch", self.batch), ("tokens", self.tokens)):
            if not 1 <= low <= opt <= high:
                raise ValueError(f"profile {self.name}: {label} range must satisfy 1 <= min <= opt <= max, "
                                 f"got {(low, opt, high)}")

    def accepts(self, batch: int, tokens: int) -> bool:
        """Whether a step of ``batch`` rows and ``tokens`` new tokens fits this profile."""
        return self.batch[0] <= batch <= self.batch[2] and self.tokens[0] <= tokens <= self.tokens[2]

    @property
    def exact_tokens(self) -> bool:
        """True when the profile admits a single T (such steps are worth a CUDA graph)."""
        return self.tokens[0] == self.tokens[2]


def mask_words(tokens: int) -> int:
    """int32 words per packed tree-mask row."""
    return (tokens + MASK_WORD_BITS - 1) // MASK_WORD_BITS


def derive_profiles(limits: EngineLimits, prefill_opt: int = 256) -> tuple[Profile, ...]:
    """The optimisation profiles of an engine, in selection order (first match wins).

    Duplicate token ranges are dropped (e.g. a tree of N = K + 1 tokens is the verify shape).
    """
    batch = (1, limits.max_batch, limits.max_batch)
    k1, n = limits.max_draft_len + 1, limits.max_tree_size
    candidates = [
        Profile("decode", batch, (1, 1, 1)),
        Profile("verify", batch, (k1, k1, k1)),
        Profile("tree", batch, (min(2, n), n, n)),
        Profile("prefill", batch, (1, min(prefill_opt, limits.max_context), limits.max_context)),
    ]
    profiles: list[Profile] = []
    for profile in candidates:
        if all(profile.tokens != kept.tokens for kept in profiles):
            profiles.append(profile)
    return tuple(profiles)


def select_profile(profiles: tuple[Profile, ...], batch: int, tokens: int) -> int:
    """Index of the first profile that accepts the step; ValueError when none does."""
    for index, profile in enumerate(profiles):
        if profile.accepts(batch, tokens):
            return index
    raise ValueError(f"no optimisation profile accepts batch {batch} x {tokens} new tokens "
                     f"(profiles: {[(p.name, p.batch, p.tokens) for p in profiles]}); raise engine.max_batch / "
                     "engine.max_context in the recipe and rebuild")
