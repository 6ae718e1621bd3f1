"""Incremental text for streamed tokens: what the CLI prints and what Triton streams, one rule for both."""
from __future__ import annotations

from typing import Callable


class Detokenizer:
    """Incremental text for streamed token chunks: the pieces concatenate to the final decoded text.

    Text is held back while it ends in an incomplete UTF-8 sequence (U+FFFD) or when the decoding of
    the longer prefix does not extend what was already sent.
    """

    def __init__(self, decode: Callable[[list[int]], str], hold: int = 0) -> None:
        """``hold``: characters kept back at the end until :meth:`finish` (a request with stop strings holds the
        longest one's length - 1, so a stop string's beginning is never streamed before the text is cut)."""
        self._decode = decode
        self.hold = hold
        self.tokens: list[int] = []
        self.sent = ""

    @classmethod
    def of(cls, tokenizer, hold: int = 0) -> "Detokenizer":
        """For a tokenizer with ``decode(ids, skip_special_tokens=...)``: special tokens are not text."""
        return cls(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), hold)

    def push(self, token_ids: list[int]) -> str:
        self.tokens += token_ids
        text = self._decode(self.tokens)
        return self._advance(text[:max(0, len(text) - self.hold)], final=False)

    def finish(self, final_text: str) -> str:
        return self._advance(final_text, final=True)

    def _advance(self, text: str, final: bool) -> str:
        if (not final and text.endswith("\ufffd")) or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
