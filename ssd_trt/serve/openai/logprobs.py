"""The target's logprobs (``decoding/logprobs.py``) in OpenAI's two shapes.

* ``/v1/completions`` (``logprobs: k``, with ``echo`` the prompt's too): ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}``, one entry per token; the prompt's first token has no logprob (``null``), as in
  OpenAI's and vLLM's answers. ``top_logprobs`` maps the ``k`` most likely tokens' text to their logprob.
* ``/v1/chat/completions`` (``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [...]}]}``.

A token's text is its own decoding; a token that holds part of a multi-byte character decodes to U+FFFD, and
``bytes`` (chat) are the UTF-8 bytes of that text.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from ssd_trt.decoding.logprobs import TokenLogprob

Decode = Callable[[list[int]], str]


def completion_logprobs(entries: Sequence[TokenLogprob | None], token_ids: Sequence[int], decode: Decode,
                        offset: int = 0) -> dict[str, Any]:
    """The completions shape for ``token_ids`` (``entries``: their logprobs, None where there is none: the prompt's
    first token); ``offset``: the first token's place in the choice's text."""
    tokens, values, tops, offsets = [], [], [], []
    for token, entry in zip(token_ids, entries):
        text = decode([int(token)])
        tokens.append(text)
        values.append(None if entry is None else entry.logprob)
        tops.append(None if entry is None else _top_by_text(entry, decode))
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def _top_by_text(entry: TokenLogprob, decode: Decode) -> dict[str, float]:
    """The alternatives keyed by their text; two tokens that decode alike keep the higher logprob (``entry.top`` is
    best first), so the chosen token's logprob equals the largest value whenever it is the most likely (what a client
    such as lm-eval compares to tell a greedy continuation)."""
    out: dict[str, float] = {}
    for token, logprob in entry.top:
        out.setdefault(decode([token]), logprob)
    return out


def merge(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """Two completions-shaped runs of tokens, one after the other (the echoed prompt's, then the completion's)."""
    if first is None:
        return second
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(entries: Sequence[TokenLogprob], decode: Decode) -> dict[str, Any]:
    def one(token: int, logprob: float) -> dict[str, Any]:
        text = decode([int(token)])
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}
