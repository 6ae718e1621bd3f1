"""A request's decoding mode: one typed, frozen settings object per mode, passed per call, validated once, here.

    gen.generate(prompt, params, mode=SSD(draft_len=2, fan_out_budget=8))
    gen.generate(prompt, params, mode="sd")        # a mode's name: its settings with every default

Each settings class resolves itself against the build's decoding defaults for the request's regime, greedy or
sampled (``resolved``: K and SSD's fan-out budget left unset, None, take the build's; ``python -m ssd_trt.tune``
measures them), and says what it asks of the engines once resolved: the KV slots a round may write past the
committed text (``headroom``), the K checked against the engine's limit (``checked_draft_len``) and the tokens of
its largest draft tree step (``tree_tokens``). A request's mode is resolved once, when it is checked
(:func:`resolve`): an SSD request that left both K and the budget unset *adapts* them to the load
(``batching/policy.py``). Where the models run (cores, threads, backend) is not a decoding setting: that is
``RuntimeOptions``, fixed when a build is loaded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable, ClassVar, Union

from ssd_trt.engines.limits import MAX_DRAFT_LEN
from ssd_trt.errors import RequestError

DEFAULT_MODE = "ssd"     # what a request gets unless it names a mode: the API, the CLI and Triton alike


def ssd_tree_tokens(draft_len: int, fan_out_budget: int) -> int:
    """Tokens in the SSD draft's largest tree step: K+1 glue tokens and K tokens for each of B branches."""
    return draft_len + 1 + draft_len * fan_out_budget


def min_fan_out_budget(draft_len: int) -> int:
    """The smallest fan-out budget for K: one bonus guess. The paper's budgets cover every acceptance length k = 0..K
    (B >= K+1), but an outcome too unlikely to pay for its branch may get none: its misses go to the backup, and
    the output does not depend on what the cache holds (verification never reads it; under Saguaro sampling each
    speculation carries the q' it was drawn from). On a CPU the tree costs in proportion to its K*B tokens, and
    with a draft that agrees often nearly all the probability sits on "all K accepted" (docs/real_pair.md)."""
    return 1


def tree_nodes(widths: tuple[int, ...]) -> int:
    """Tokens of an SD token tree with ``widths[d]`` children under every depth-d node, the root included."""
    return 1 + sum(math.prod(widths[:depth + 1]) for depth in range(len(widths)))


def _check_draft_len(value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DRAFT_LEN):
        raise RequestError(f"draft_len (K) must be an integer in 1..{MAX_DRAFT_LEN} (or None for the build's "
                           f"default), got {value!r}")


@dataclass(frozen=True)
class AR:
    """Plain autoregressive decoding: nothing to set."""
    name: ClassVar[str] = "ar"
    headroom: ClassVar[int] = 0
    checked_draft_len: ClassVar[int | None] = None
    tree_tokens: ClassVar[int] = 0

    def resolved(self, defaults) -> "AR":
        return self


@dataclass(frozen=True)
class SD:
    """Speculative decoding: K draft tokens per round, verified as a chain, or as a token tree with
    ``tree_widths`` children per depth (then K is the tree's depth)."""
    name: ClassVar[str] = "sd"
    tree_tokens: ClassVar[int] = 0                # (a tree is verified by the target: headroom, not a draft step)
    draft_len: int | None = None                 # K; None: the build's default
    tree_widths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        _check_draft_len(self.draft_len)
        if self.tree_widths is not None:
            widths = tuple(self.tree_widths) if isinstance(self.tree_widths, (list, tuple)) else None
            if not widths or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in widths):
                raise RequestError(f"tree_widths must be positive integers (children per depth), got "
                                   f"{self.tree_widths!r}")
            object.__setattr__(self, "tree_widths", widths)

    def resolved(self, defaults) -> "SD":
        """With K set (``defaults``: the build's ``DecodingDefaults`` for the request's regime)."""
        return replace(self, draft_len=self.draft_len or defaults.sd_draft_len)

    @property
    def checked_draft_len(self) -> int:
        """K, as the engine's max_draft_len limits it: a tree's depth is the most a round can accept."""
        return len(self.tree_widths) if self.tree_widths else self.draft_len

    @property
    def headroom(self) -> int:
        """Slots a verification writes: the tree's nodes, or t*_prev and K drafted tokens."""
        return tree_nodes(self.tree_widths) if self.tree_widths else self.draft_len + 1


@dataclass(frozen=True)
class SSD:
    """Speculative speculative decoding with Saguaro scheduling (``decoding/saguaro.py``)."""
    name: ClassVar[str] = "ssd"
    draft_len: int | None = None       # K; None: the build's default
    fan_out_budget: int | None = None  # B = sum_k F_k guesses per sequence and round; None: the build's default
    fork_policy: str = "confidence"    # confidence (this round's odds) | geometric (the paper's shape)
    lookup_forks: int = 3              # prompt-lookup bonus guesses per position (0: draft guesses only)
    saguaro_c: float = 1.0             # C of sigma_{F,C}; 1 = plain draft sampling
    backup: str = "auto"               # auto (the load policy picks, from measured costs) | jit | ngram
    critical_batch: int = 4            # b*: auto's choice before any cost is measured (batches >= b*: prompt lookup)
    prior_acceptance: float = 0.6
    prior_power: float = 0.6

    def __post_init__(self) -> None:
        _check_draft_len(self.draft_len)
        budget = self.fan_out_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or
                                   budget < min_fan_out_budget(self.draft_len or 1)):
            raise RequestError(f"fan_out_budget must be an integer >= {min_fan_out_budget(self.draft_len or 1)} (or "
                               f"None for the build's default), got {budget!r}")
        if not isinstance(self.saguaro_c, (int, float)) or not 0 < self.saguaro_c <= 1:
            raise RequestError(f"saguaro_c (C) must be in (0, 1], got {self.saguaro_c}")
        if self.fork_policy not in ("confidence", "geometric"):
            raise RequestError(f"fork_policy must be confidence or geometric, got {self.fork_policy!r}")
        if isinstance(self.lookup_forks, bool) or not isinstance(self.lookup_forks, int) or self.lookup_forks < 0:
            raise RequestError(f"lookup_forks must be a non-negative integer, got {self.lookup_forks!r}")
        if self.backup not in ("auto", "jit", "ngram"):
            raise RequestError(f"backup must be auto, jit or ngram, got {self.backup!r}")
        if isinstance(self.critical_batch, bool) or not isinstance(self.critical_batch, int) or self.critical_batch < 1:
            raise RequestError(f"critical_batch must be a positive integer, got {self.critical_batch!r}")

    def resolved(self, defaults) -> "SSD":
        """With K and the budget set: unset ones from ``defaults`` (the build's ``DecodingDefaults``)."""
        draft_len = self.draft_len or defaults.ssd_draft_len
        budget = self.fan_out_budget or max(defaults.ssd_fan_out_budget, min_fan_out_budget(draft_len))
        return replace(self, draft_len=draft_len, fan_out_budget=budget)

    def speculating(self, draft_len: int, backup: str) -> "SSD":
        """These (resolved) settings at K = ``draft_len`` with ``backup``, the budget at least the smallest for that K:
        the load policy's options."""
        return replace(self, draft_len=draft_len, fan_out_budget=max(self.fan_out_budget, min_fan_out_budget(draft_len)),
                       backup=backup)

    @property
    def checked_draft_len(self) -> int:
        return self.draft_len

    @property
    def tree_tokens(self) -> int:
        """Tokens in the draft's largest tree step (of resolved settings)."""
        return ssd_tree_tokens(self.draft_len, self.fan_out_budget)

    @property
    def step_tokens(self) -> int:
        """Tokens each of the K tree-decode steps feeds per row: one when the budget is one guess (the branch is a
        chain behind the glue, ``saguaro.DraftWorker._chain_decode``), else the whole tree re-fed."""
        return 1 if self.fan_out_budget == 1 else self.tree_tokens

    @property
    def headroom(self) -> int:
        return self.tree_tokens


Settings = Union[AR, SD, SSD]
BY_NAME: dict[str, type] = {kind.name: kind for kind in (AR, SD, SSD)}
MODES = tuple(BY_NAME)


@dataclass(frozen=True)
class ResolvedMode:
    """A request's mode, resolved once: its settings with every value set, and whether it adapts (an SSD request that
    left K and the budget to the build: the load policy picks its rounds)."""
    settings: Settings
    adaptive: bool = False

    @property
    def name(self) -> str:
        return self.settings.name


def resolve(mode: "str | Settings", defaults) -> ResolvedMode:
    """``mode`` (a name, or an AR / SD / SSD settings object) with the unset values from ``defaults``."""
    settings = as_settings(mode)
    adaptive = isinstance(settings, SSD) and settings.draft_len is None and settings.fan_out_budget is None
    return ResolvedMode(settings.resolved(defaults), adaptive)


def as_settings(mode: "str | Settings") -> Settings:
    """The settings object of ``mode``: itself, or a mode name's settings with every default."""
    if isinstance(mode, (AR, SD, SSD)):
        return mode
    if isinstance(mode, str) and mode in BY_NAME:
        return BY_NAME[mode]()
    raise RequestError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}, or pass "
                       f"ssd_trt.AR() / SD(...) / SSD(...)")


# what a user may set beside a mode's name (the CLI's flags, Triton's inputs), and the modes each applies to
OPTIONS_BY_MODE: dict[str, tuple[str, ...]] = {"ar": (), "sd": ("draft_len", "tree_widths"),
                                               "ssd": ("draft_len", "fan_out_budget", "backup")}


def parse_mode(mode: str, spelled: Callable[[str], str] = str, **options: Any) -> Settings:
    """The settings object of a mode name a user gave and the options they set beside it (None: not set), each
    option refused for a mode it means nothing to. ``spelled`` names an option the way the user wrote it (a flag,
    a Triton input)."""
    if mode not in BY_NAME:
        raise RequestError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    given = {name: value for name, value in options.items() if value is not None}
    for name in given:
        takes = [m for m, names in OPTIONS_BY_MODE.items() if name in names]
        if not takes:
            raise ValueError(f"{name!r} is not a decoding option ({OPTIONS_BY_MODE})")
        if mode not in takes:
            allowed = ", ".join(spelled(n) for n in OPTIONS_BY_MODE[mode]) or "none of them"
            raise RequestError(f"{spelled(name)} applies to mode {' or '.join(takes)}, not {mode} "
                               f"(mode {mode} takes {allowed})")
    return BY_NAME[mode](**given)
