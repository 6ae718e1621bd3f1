"""What a request must satisfy before any engine runs: prompts as token ids, within the engine limits.

The one place that checks a request against the build's :class:`~ssd_trt.engines.limits.EngineLimits`
(batch, context, K, tree size): every engine below trusts a request that passed here.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.settings import SSD, Settings
from ssd_trt.engines.limits import EngineLimits
from ssd_trt.errors import RequestError


def encode_prompt(tokenizer, prompt: str | bytes, chat: bool) -> list[int]:
    """Token ids of one prompt: text, or UTF-8 bytes. Invalid UTF-8 is refused, never guessed at."""
    if isinstance(prompt, (bytes, bytearray)):
        try:
            prompt = bytes(prompt).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"prompt is not valid UTF-8 (byte {exc.start}: {exc.reason}); send UTF-8 "
                               f"text") from None
    if not isinstance(prompt, str):
        raise RequestError(f"prompt must be a string, got {type(prompt).__name__}")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:   # lone surrogates: undecodable bytes smuggled in (argv, JSON)
        raise RequestError(f"prompt is not valid UTF-8 (undecodable character at {exc.start}); send "
                           f"UTF-8 text") from None
    if not prompt.strip():
        raise RequestError("prompt is empty; give at least one non-whitespace character")
    if not chat:
        return list(tokenizer(prompt)["input_ids"])
    return encode_chat(tokenizer, [{"role": "user", "content": prompt}], "drop --chat / chat=True")


def encode_chat(tokenizer, messages: list[dict], fix: str = "send a plain prompt instead",
                tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation (``role`` / ``content`` dicts) through the tokenizer's chat template, ending where
    the assistant's reply starts; ``tools``: the functions the template renders (OpenAI's shape). ``fix``: what the
    caller should do when the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(f"this model's tokenizer has no chat template; {fix}")
    extra = {"tools": tools} if tools else {}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def check_prompts(limits: EngineLimits, vocab: int, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                  settings: Settings) -> list[list[int]]:
    """Refuse what the engines could not run with these (resolved) mode settings (one RequestError naming the limit and
    the fix); return the prompts as plain int lists."""
    if not isinstance(params, SamplingParams):
        raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
    if not prompt_ids:
        raise RequestError("no prompts given")
    if len(prompt_ids) > limits.max_batch:
        raise RequestError(f"{len(prompt_ids)} prompts exceed the engine's max batch {limits.max_batch}; send "
                           f"at most that many at once")
    for row, ids in enumerate(prompt_ids):
        if not len(ids):
            raise RequestError("a prompt encodes to zero tokens")
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt {row} holds token ids outside 0..{vocab - 1} (or not integers); encode "
                               f"prompts with this build's tokenizer")
        _check_context(limits, len(ids), params.max_new_tokens, settings.name, settings.headroom)
    if settings.checked_draft_len is not None and settings.checked_draft_len > limits.max_draft_len:
        raise RequestError(f"draft_len {settings.checked_draft_len} exceeds the engine's max_draft_len "
                           f"{limits.max_draft_len}; lower it or rebuild")
    if isinstance(settings, SSD) and settings.tree_tokens > limits.max_tree_size:
        raise RequestError(f"an SSD tree step with K={settings.draft_len} and fan-out budget "
                           f"{settings.fan_out_budget} feeds {settings.tree_tokens} tokens, more than the engine's "
                           f"max_tree_size {limits.max_tree_size}; lower the budget or K, or raise "
                           f"engine.max_tree_size and rebuild")
    return [[int(t) for t in ids] for ids in prompt_ids]


def _check_context(limits: EngineLimits, prompt: int, new: int, mode: str, headroom: int) -> None:
    if prompt >= limits.max_context:
        raise RequestError(f"prompt is {prompt} tokens; this engine's max context is {limits.max_context} "
                           f"(prompt + generated tokens). Shorten the prompt or rebuild with a larger "
                           f"engine.max_context")
    if prompt + new + headroom > limits.max_context:
        extra = f" + {headroom} slots for {mode} speculation" if headroom else ""
        raise RequestError(f"prompt ({prompt} tokens) + max_new_tokens ({new}){extra} exceeds the engine's "
                           f"max context {limits.max_context}; lower max_new_tokens or shorten the prompt")
