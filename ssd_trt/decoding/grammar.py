"""Structured output: a request's grammar (a JSON schema, a regex, a list of choices or a Lark grammar) masks the
tokens it may emit, through llguidance (https://github.com/guidance-ai/llguidance, MIT).

Why llguidance: a self-contained Rust wheel (no torch, no compiler at run time) that takes JSON schemas, regexes and
Lark grammars; it computes a token mask in tens of microseconds with no per-grammar compile step worth caching; and its
matcher rolls back (``LLMatcher.rollback``), which is what speculation needs: a drafted path is consumed, masked along
and rolled back, without copying the parser per position. (xgrammar has rollback too, but its wheel requires torch,
transformers, triton and apache-tvm-ffi, and each grammar goes through its compiler before the first mask;
outlines-core builds an index per regex up front and takes no Lark grammars.)

Lossless under speculation. The target's distribution under a grammar is p'(x) ∝ p(x) * [x allowed after the
output so far] (the mask applies to the logits first, as vLLM applies it before its sampler; logit adjustments,
temperature and the filters follow). Verification uses p' at every verified position, each masked by the grammar
state *at that position*: the request's output plus the drafted tokens ahead of it on the path (a chain's first k, a
tree node's ancestors), exactly what AR would have seen. So accepting or rejecting against it gives AR's masked
distribution, whatever the draft proposed: a drafted token the grammar forbids has p' = 0 and is rejected. Positions
behind such a token are never reached by verification; they get no mask. The draft is masked too, along its own
paths (:meth:`GrammarState.draft_copy`, :class:`DraftGrammar`): it only raises acceptance (any proposal q is exact under verification).

JSON schemas compile with fixed separators (``", "`` and ``": "``, as ``json.dumps``) and no free whitespace: a small
model under a flexible-whitespace grammar can emit newlines forever (and the output is the same JSON).
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ssd_trt.errors import RequestError

KINDS = ("json", "regex", "choice", "lark")
CHECKED_KEPT = 64
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match: ``kind`` json (``source``: a JSON schema, as JSON text), regex, choice
    (``source``: a JSON list of the strings allowed) or lark (llguidance's Lark dialect; a GBNF grammar, with
    ``::=``, is converted)."""
    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"grammar kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.source, str) or not self.source.strip():
            raise RequestError(f"a {self.kind} grammar needs a non-empty source, got {self.source!r}")

    @classmethod
    def json_schema(cls, schema: dict | bool | None = None) -> "Grammar":
        """A JSON value matching ``schema`` (None: any JSON object, OpenAI's ``json_object``)."""
        return cls("json", json.dumps({"type": "object"} if schema is None else schema))

    @classmethod
    def choice(cls, options: Sequence[str]) -> "Grammar":
        return cls("choice", json.dumps(list(options)))

    def compiled(self) -> str:
        """The llguidance grammar (not yet checked: :meth:`Grammars.check` does)."""
        from llguidance import LLMatcher
        if self.kind == "json":
            try:
                schema = json.loads(self.source)
            except ValueError as exc:
                raise RequestError(f"the JSON schema is not valid JSON ({exc})") from None
            if not isinstance(schema, (dict, bool)):
                raise RequestError(f"a JSON schema must be an object, got {type(schema).__name__}")
            return LLMatcher.grammar_from_json_schema(schema, defaults=dict(JSON_OPTIONS))
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            options = json.loads(self.source)
            if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
                raise RequestError(f"choice must be a non-empty list of non-empty strings, got {self.source}")
            # each option a Lark string literal (JSON's escapes are Lark's)
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
        source = self.source
        if "::=" in source:
            from llguidance.gbnf_to_lark import gbnf_to_lark
            try:
                source = gbnf_to_lark(source)
            except Exception as exc:  # noqa: BLE001 -- the converter raises plain exceptions on bad input
                raise RequestError(f"the GBNF grammar cannot be read: {exc}") from None
        return LLMatcher.grammar_from_lark(source)


class Grammars:
    """One build's grammar machinery: its tokenizer as llguidance sees it (made on first use, ~0.5 s), each request's
    grammar checked against it once, and a matcher per request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int], engine_tokenizer=None) -> None:
        """``tokenizer``: the build's (a fast HF tokenizer); ``engine_tokenizer``: llguidance's own, made from it
        when None."""
        self._hf, self.vocab_size, self._eos = tokenizer, vocab_size, sorted(eos_ids)
        self._tokenizer = engine_tokenizer
        self._checked: dict[Grammar, str] = {}       # the last grammars checked (a client repeats its schema)
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                from llguidance.hf import from_tokenizer
                try:
                    self._tokenizer = from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self._eos or None)
                except (ValueError, TypeError) as exc:
                    raise RequestError(f"structured output is not available for this build: the grammar engine "
                                       f"(llguidance) cannot read its tokenizer ({exc}); leave the grammar out") \
                        from None
            return self._tokenizer

    def check(self, grammar: Grammar) -> str:
        """The compiled grammar; a RequestError saying what is wrong with it when llguidance refuses it."""
        from llguidance import LLMatcher
        with self._lock:
            if grammar in self._checked:
                return self._checked[grammar]
        compiled = grammar.compiled()
        error = LLMatcher.validate_grammar(compiled, self.tokenizer)
        if error:
            words = " ".join(line.strip() for line in error.strip().splitlines()[:4] if line.strip())
            raise RequestError(f"the {grammar.kind} grammar is invalid: {words}")
        with self._lock:
            if len(self._checked) >= CHECKED_KEPT:
                self._checked.pop(next(iter(self._checked)))
            self._checked[grammar] = compiled
        return compiled

    def state(self, grammar: Grammar) -> "GrammarState":
        from llguidance import LLMatcher
        matcher = LLMatcher(self.tokenizer, self.check(grammar), log_level=0)
        if matcher.is_error():
            raise RequestError(f"the {grammar.kind} grammar is invalid: {matcher.get_error()}")
        return GrammarState(matcher, self.vocab_size)


class GrammarState:
    """One request's grammar, advanced by the tokens it commits. Masks are bool [V]: True where the token is allowed."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size

    def _mask(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[:self.vocab_size].astype(bool)

    def masks_along(self, paths: Sequence[Sequence[int]]) -> list[np.ndarray | None]:
        """The mask at the end of each path (tokens drafted ahead of the committed output); None where the path
        leaves the grammar or allows nothing after it (verification never reaches there). Paths that extend one
        another (a chain) share the work: only the tokens past their common prefix are consumed."""
        out: list[np.ndarray | None] = []
        matcher, held = self.matcher, []          # the tokens consumed ahead of the committed state
        for path in paths:
            path = [int(t) for t in path]
            common = 0
            while common < min(len(held), len(path)) and held[common] == path[common]:
                common += 1
            if common < len(held):
                matcher.rollback(len(held) - common)
                held = held[:common]
            taken = matcher.try_consume_tokens(path[common:])
            held += path[common:common + taken]
            mask = self._mask() if len(held) == len(path) else None
            # a state that allows nothing at all (a finished request's, past the grammar's end) is never verified
            out.append(mask if mask is not None and mask.any() else None)
        if held:
            matcher.rollback(len(held))
        return out

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume committed tokens (each was allowed when it was chosen)."""
        for token in tokens:
            if self.matcher.is_stopped():
                return                 # the grammar ended; what follows it (EOS) is outside it
            if not self.matcher.consume_token(int(token)):
                raise RuntimeError(f"a committed token ({token}) breaks the request's grammar: "
                                   f"{self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar is complete and allows nothing more (only EOS)."""
        return self.matcher.is_stopped()

    def draft_copy(self) -> "DraftGrammar":
        """A copy the draft's thread advances along its own proposals (it never shares the request's matcher, which
        the target's side advances meanwhile)."""
        return DraftGrammar(self.matcher.deep_copy(), self.vocab_size)


class DraftGrammar(GrammarState):
    """The draft's copy of a request's grammar, for one round: masks along the paths it drafts (``masks_along``), or
    along one chain, a token at a time (``mask_after``); the copy is dropped after the round."""

    def __init__(self, matcher, vocab_size: int) -> None:
        super().__init__(matcher, vocab_size)
        self.off = False         # a drafted token left the grammar: no more masks on this chain

    def mask_after(self, token: int | None) -> np.ndarray | None:
        """Consume the token just drafted (None: none yet) and the mask for the next one (None once off)."""
        if self.off:
            return None
        if token is not None:
            if self.matcher.try_consume_tokens([int(token)]) != 1:
                self.off = True
                return None
        mask = self._mask()
        return mask if mask.any() else None


def apply_mask(logits: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """``logits`` [..., V'] with every token the mask forbids at -inf (tokens past the mask's vocabulary too)."""
    if mask is None:
        return logits
    width = min(logits.shape[-1], mask.shape[0])
    allowed = mask[:width] if width == logits.shape[-1] else np.concatenate(
        [mask[:width], np.zeros(logits.shape[-1] - width, dtype=bool)])
    return np.where(allowed, np.asarray(logits, dtype=np.float32), np.float32(-np.inf))


def draft_copies(seqs) -> list[DraftGrammar | None]:
    """Each request's grammar as the draft's copy (None: a request without one)."""
    return [None if seq.grammar is None or not seq.params.mask_draft else seq.grammar.draft_copy() for seq in seqs]


def mask_rows(logits: np.ndarray, masks: Sequence[np.ndarray | Sequence[np.ndarray | None] | None]) -> np.ndarray:
    """Draft logits [B, V] or [B, N, V] with each row's masks applied: ``masks[b]`` is None, one mask [V] (a [B, V]
    row), or N masks or None (a [B, N, V] row's branches)."""
    if all(m is None for m in masks):
        return logits
    out = np.array(logits, dtype=np.float32)
    for b, mask in enumerate(masks):
        if mask is None:
            continue
        if out.ndim == 2:
            out[b] = _draft_masked(out[b], mask)
        else:
            for n, branch in enumerate(mask):
                out[b, n] = _draft_masked(out[b, n], branch)
    return out


def _draft_masked(logits: np.ndarray, mask: np.ndarray | None) -> np.ndarray:
    """A draft row masked; where the draft gives every allowed token -inf (a draft with a trimmed vocabulary: the
    grammar forces a token it never emits), a uniform pick among them instead (any proposal is exact)."""
    out = apply_mask(logits, mask)
    if mask is not None and not np.isfinite(out).any():
        width = min(out.shape[-1], mask.shape[0])
        out[:width][mask[:width]] = 0.0
    return out
