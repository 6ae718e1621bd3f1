"""Incremental text for streamed tokens: what the CLI prints and what Triton streams, one rule for both."""
from __future__ import annotations

from typing import Callable


class Detokenizer:
    """Incremental text for streamed token chunks: the pieces concatenate to the final decoded text.

    Each push decodes only a window: the tokens whose text is not read out yet, after the tokens read out last time
    as context (a tokenizer decodes a token as it does mid-text only after some text: a SentencePiece token's leading
    space, byte-level merges; vLLM's incremental detokenizer keeps the same window). The window's decoding minus its
    context's is the new text (what ``decode(all)`` adds to ``decode(all before)``), so the work per push does not
    grow with the stream: linear in its length overall, where decoding every prefix was quadratic. Text is held back
    while it ends in an incomplete UTF-8 sequence (U+FFFD), or would change text already read out: the window then
    grows until it does neither. Windows start where a read-out ended, so never inside a character.
    """

    def __init__(self, decode: Callable[[list[int]], str], hold: int = 0) -> None:
        """``hold``: characters kept back at the end until :meth:`finish` (a request with stop strings holds the
        longest one's length - 1, so a stop string's beginning is never streamed before the text is cut)."""
        self._decode = decode
        self.hold = hold
        self.tokens: list[int] = []
        self._context = 0           # the window's first token (context only: its text was read out already)
        self._read = 0              # the first token whose text is not read out yet
        self._sent: list[str] = []  # the pieces streamed
        self._pending = ""          # text read out but held back (``hold``)

    @classmethod
    def of(cls, tokenizer, hold: int = 0) -> "Detokenizer":
        """For a tokenizer with ``decode(ids, skip_special_tokens=...)``: special tokens are not text."""
        return cls(lambda ids: tokenizer.decode(ids, skip_special_tokens=True), hold)

    @property
    def sent(self) -> str:
        return "".join(self._sent)

    def push(self, token_ids: list[int]) -> str:
        self.tokens += token_ids
        before = self._decode(self.tokens[self._context:self._read])
        window = self._decode(self.tokens[self._context:])
        if len(window) > len(before) and not window.endswith("\ufffd") and window.startswith(before):
            self._pending += window[len(before):]
            self._context, self._read = self._read, len(self.tokens)
        piece = self._pending[:max(0, len(self._pending) - self.hold)]
        self._pending = self._pending[len(piece):]
        return self._emit(piece)

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the whole text, possibly cut at a stop string) after what was streamed."""
        sent = self.sent
        return self._emit(final_text[len(sent):]) if final_text.startswith(sent) else ""

    def _emit(self, piece: str) -> str:
        if piece:
            self._sent.append(piece)
        return piece
