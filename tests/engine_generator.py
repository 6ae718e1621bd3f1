"""The runtime's :class:`~ssd_trt.runtime.Generator` over engines the caller opened instead of a build directory (for
the tests and the research scripts; not part of the installed package):
``DeviceStepEngine`` on a GPU (``research/gpu``), the tests' trigram models with exact probabilities, engines with
injected faults. ``generate_ids`` (token ids in, token ids out) then runs the engine step exactly as it does for a
build; with no tokenizer, result texts spell the token ids."""
from __future__ import annotations

from typing import Callable

from ssd_trt.batching.policy import Learned
from ssd_trt.decoding.grammar import Grammars
from ssd_trt.engines.factory import free_slots
from ssd_trt.engines.limits import EngineLimits
from ssd_trt.recipe import DecodingDefaults
from ssd_trt.runtime import Generator, RuntimeOptions


class Engines:
    """Engines by role, made on first use and kept, as a build's ``EngineSet`` (a retired one is made again)."""

    def __init__(self, makers: dict[str, Callable]) -> None:
        self.makers, self.opened = makers, {}

    def get(self, role: str):
        if role not in self.opened:
            self.opened[role] = self.makers[role]()
        return self.opened[role]

    def retire(self, role: str) -> None:
        self.opened.pop(role, None)

    def free_slots(self) -> None:
        free_slots(self.opened.values())


class TokenIds:
    """What the engine step asks of a tokenizer (stop strings, result text): text that spells the token ids."""

    @staticmethod
    def decode(tokens, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(t)) for t in tokens)


class GeneratorOverEngines(Generator):
    """``target`` and ``draft``: makers of the engines (``draft`` None: AR only); ``limits``: what they are shaped
    for (requests are checked against them); ``defaults``: K and the fan-out budget of requests that leave them
    unset."""

    def __init__(self, target: Callable, draft: Callable | None, limits: EngineLimits,
                 defaults: DecodingDefaults = DecodingDefaults(), eos_ids: frozenset[int] = frozenset(),
                 options: RuntimeOptions | None = None, tokenizer=None) -> None:
        self.engines = Engines({"target": target} if draft is None else {"target": target, "draft": draft})
        self.limits, self.defaults, self.eos_ids = limits, defaults, eos_ids
        self.options = (options or RuntimeOptions()).for_build(threads_per_engine=1)
        self.tokenizer = tokenizer or TokenIds()
        self.vocab_size = self.engine("target").spec.vocab_size
        self.learned = Learned()
        self.grammars = Grammars(self.tokenizer, self.vocab_size, eos_ids)   # needs a real (fast) tokenizer

    def decoding_defaults(self, params=None) -> DecodingDefaults:
        return self.defaults
