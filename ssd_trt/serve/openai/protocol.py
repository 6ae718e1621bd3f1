"""OpenAI request bodies into ssd_trt requests, checked once; results into OpenAI response objects.

The fields each endpoint takes are ``serve/fields.py``'s table: ``model``, ``prompt`` (a string, token ids, or a list
of several) / ``messages``, ``max_tokens`` (and ``max_completion_tokens``), ``temperature`` (default 1, as OpenAI's),
``top_p``, ``seed``, ``stop`` (a string or a list), ``stop_token_ids``, ``n``, ``logprobs`` (completions: ``k``
alternatives; chat: true, with ``top_logprobs``), ``echo`` (completions; with ``max_tokens`` 0: the prompt's
logprobs alone), ``stream``, ``stream_options.include_usage``; as extra body fields (the Triton inputs of the same
names): ``mode`` (ar | sd | ssd, default ssd), ``draft_len``, ``fan_out_budget``, ``backup``, ``tree_widths``,
``top_k`` and ``ignore_eos``; ``min_p``, ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty`` and
``logit_bias`` (``decoding/penalties.py``); structured output (``response_format``, ``structured_outputs``,
``guided_*``: ``serve/structured.py``) and tool calls (``tools``, ``tool_choice``, ``parallel_tool_calls``; ``tool``
messages and assistant ``tool_calls``: ``tools.py``); OpenAI's advisory fields (``user``, ``metadata``, ...) are taken
and ignored. A field this server does not do (``functions``, ``suffix``, ``best_of`` > 1) and any field it does not
know are refused with a 400 naming the field, never ignored. The logprobs are the target's own
(``decoding/logprobs.py``), shaped by ``logprobs.py``. Several prompts and ``n`` > 1 become one submission per choice
(:class:`Parsed`).
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any

from ssd_trt.decoding.grammar import Grammar
from ssd_trt.decoding.logprobs import TokenLogprob
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.settings import DEFAULT_MODE, Settings, parse_mode
from ssd_trt.errors import RequestError
from ssd_trt.requests import encode_chat
from ssd_trt.serve.core import Final, ServingCore, Submission
from ssd_trt.serve.fields import BY_ENDPOINT, BY_NAME, CHAT, COMPLETIONS, UNSUPPORTED, is_neutral
from ssd_trt.serve.structured import grammar_of
from ssd_trt.serve.openai.errors import ApiError, bad_request
from ssd_trt.serve.openai.logprobs import Decode, chat_logprobs, completion_logprobs, merge
from ssd_trt.serve.openai.tools import (CallStream, ToolUse, parse_calls, plain_tool_message, template_message,
                                        tool_use, with_tool_prompt)

COMPLETION_DEFAULT_MAX_TOKENS = 16      # OpenAI's default for /v1/completions; chat defaults to the rest of the context
ROLES = ("system", "developer", "user", "assistant", "tool")
FINISH_REASON = {"eos": "stop", "stop": "stop", "length": "length"}
TOOL_CALLS = "tool_calls"                 # the finish reason of a choice that called tools
DONE = "data: [DONE]\n\n"                 # the event that ends every stream


@dataclass(frozen=True)
class Parsed:
    """A checked request and how to answer it: one submission per choice. The ``n`` choices of prompt ``p`` have the
    indices ``p * n`` .. ``p * n + n - 1``, as OpenAI numbers them; each runs as its own row of the batch."""
    submissions: tuple[Submission, ...]
    n: int
    include_usage: bool
    chat: bool
    echo: bool = False           # completions: the prompt (and its logprobs) comes first in each choice
    prompt_only: bool = False    # echo with max_tokens 0: the prompt's logprobs alone (one token is made, not shown)
    tools: ToolUse | None = None  # chat: the functions the model may call; its calls are parsed out of its text

    @property
    def stream(self) -> bool:
        return self.submissions[0].stream

    @property
    def logprobs(self) -> bool:
        """The answer carries the target's logprobs (decoding/logprobs.py)."""
        return self.submissions[0].params.logprobs is not None


def _number(body: dict, name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{name} must be a number, got {value!r}", name)
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {value!r}", name)
    return value


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}", name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise bad_request(f"stop must be a string or a list of strings, got {stop!r}", "stop")


def check_model(body: dict, names: tuple[str, ...]) -> None:
    """``model`` (optional) must be one of the served names (``--served-model-name``: the first is the one reported,
    the others aliases, as vLLM's); any other is OpenAI's 404."""
    model = body.get("model")
    if model is not None and model not in names:
        served = " or ".join(repr(name) for name in names)
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served} (GET /v1/models)",
                       param="model", code="model_not_found")


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """Every field of the body must be one the endpoint takes, and a field this server does not do must ask for
    nothing (``serve/fields.py``)."""
    taken = BY_ENDPOINT[CHAT if chat else COMPLETIONS]
    for name, value in body.items():
        field = taken.get(name)
        if field is None:
            route = "/v1/chat/completions" if chat else "/v1/completions"
            other = " (a field of the other endpoint)" if name in BY_NAME else ""
            raise bad_request(f"{name!r} is not a field of {route}{other}; leave it out (the fields taken: "
                              f"{', '.join(sorted(taken))})", name)
        if field.feeds == UNSUPPORTED and not is_neutral(field, value):
            raise bad_request(f"{name} is not supported by this server (got {value!r}); leave it out", name)


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
        raise bad_request(f"stop_token_ids must be a list of token ids (integers), got {ids!r}", "stop_token_ids")
    return tuple(ids)


def _settings(body: dict, default_mode: str = DEFAULT_MODE) -> Settings:
    """The mode and the speculation options the request set (extra body fields, as the Triton inputs); a request
    that names no mode gets the server's ``default_mode``."""
    mode = body.get("mode", default_mode)
    if not isinstance(mode, str):
        raise bad_request(f"mode must be a string (ar, sd or ssd), got {mode!r}", "mode")
    tree = body.get("tree_widths")
    if tree is not None and (not isinstance(tree, list) or any(isinstance(w, bool) or not isinstance(w, int)
                                                               for w in tree)):
        raise bad_request(f"tree_widths must be a list of integers (children per depth), got {tree!r}", "tree_widths")
    backup = body.get("backup")
    if backup is not None and not isinstance(backup, str):
        raise bad_request(f"backup must be a string (auto, jit or ngram), got {backup!r}", "backup")
    return parse_mode(mode.strip().lower(), lambda name: f"'{name}'", draft_len=_integer(body, "draft_len"),
                      fan_out_budget=_integer(body, "fan_out_budget"),
                      backup=None if backup is None else backup.strip().lower(),
                      tree_widths=None if tree is None else tuple(tree))


def _content(message: dict, index: int) -> str:
    """A message's text: a string, or a list of text parts (what the OpenAI client sends for multi-part content)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad_request(f"messages[{index}].content: only text parts are supported, got a {kind!r} part",
                                  "messages")
            texts.append(part["text"])
        return "".join(texts)
    if content is None and message.get("role") in ("assistant", "tool"):      # (an assistant's calls carry none)
        return ""
    raise bad_request(f"messages[{index}].content must be a string or a list of text parts, got {content!r}",
                      "messages")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{index}] must be an object with role and content, got {message!r}",
                              "messages")
        role = message.get("role")
        if role not in ROLES:
            raise bad_request(f"messages[{index}].role {role!r} is not supported; use one of {', '.join(ROLES)}",
                              "messages")
        # chat templates know system, not OpenAI's newer name for it
        out.append({"role": "system" if role == "developer" else role, "content": _content(message, index),
                    **template_message(message, index)})
    if not any(m["content"].strip() or m.get("tool_calls") for m in out):
        raise bad_request("messages hold no text; give at least one message with content", "messages")
    return out


def _chat_ids(tokenizer, messages: list[dict], tools: ToolUse | None = None) -> list[int]:
    """The conversation through the model's chat template (with the request's tools: ``tools.py``). A template that
    refuses it (``raise_exception`` in the template, e.g. roles that do not alternate) is the request's fault: a 400
    naming the first message at fault (the first whose conversation up to it the template refuses) and the
    template's own words."""
    from jinja2.exceptions import TemplateError
    template = tokenizer.chat_template or ""
    if tools is not None and "tools" not in template:
        messages = with_tool_prompt(messages, tools)
    if "tool_calls" not in template:          # (a template that knows no calls: Hermes' text, tools.py)
        messages = [plain_tool_message(m) for m in messages]
    try:
        return encode_chat(tokenizer, messages, "use /v1/completions with a plain prompt",
                           tools.template_tools() if tools is not None and "tools" in template else None)
    except TemplateError as exc:
        at = next((i for i in range(len(messages)) if _refused(tokenizer, messages[:i + 1])), None)
        where = "messages" if at is None else f"messages[{at}] (role {messages[at]['role']!r})"
        raise bad_request(f"{where}: the model's chat template refuses this conversation: {exc}", "messages") \
            from None


def _refused(tokenizer, messages: list[dict[str, str]]) -> bool:
    from jinja2.exceptions import TemplateError
    try:
        tokenizer.apply_chat_template(messages, tokenize=False)
    except TemplateError:
        return True
    return False


def _prompts(body: dict, core: ServingCore) -> list[list[int]]:
    """``prompt``: a string, token ids, or a list of several of either (each its own choices)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_token_ids(prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, str) or _is_token_ids(p) for p in prompt):
        raise bad_request(f"prompt must be a string, a list of token ids, or a non-empty list of either; got "
                          f"{_short(prompt)}", "prompt")
    # token ids are checked against the vocabulary by the runtime
    return [list(p) if isinstance(p, list) else core.generator.encode(p) for p in prompt]


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(t, int) and not isinstance(t, bool)
                                                           for t in value)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse(body: Any, core: ServingCore, names: tuple[str, ...], chat: bool) -> Parsed:
    """Check one request completely before anything is queued (a RequestError or ApiError names what is wrong);
    ``names``: the model names it may ask for."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(body).__name__}", None)
    check_model(body, names)
    _refuse_unsupported(body, chat)
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise bad_request("stream_options needs stream: true and must be an object ({\"include_usage\": true})",
                          "stream_options")
    include_usage = _flag(options or {}, "include_usage")
    echo = not chat and _flag(body, "echo")
    if echo and stream:
        raise bad_request("echo is not supported with stream: true; ask for the whole answer", "echo")
    logprobs = _logprobs(body, chat)
    max_tokens = _integer(body, "max_completion_tokens")
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens")
    if max_tokens is not None and (max_tokens < 0 or max_tokens == 0 and not echo):
        raise bad_request(f"max_tokens must be >= 1 (0 only with echo: the prompt's logprobs alone), got "
                          f"{max_tokens}", "max_tokens")
    prompt_only = max_tokens == 0
    if prompt_only:
        max_tokens = 1                          # (made, not shown: the engine always makes one)
    settings = _settings(body, core.default_mode)
    tools = tool_use(body) if chat else None
    grammar = _grammar(body, tools, core)
    prompts = [_chat_ids(core.generator.tokenizer, _messages(body), tools)] if chat else _prompts(body, core)
    n = _integer(body, "n")
    if n is not None and n < 1:
        raise bad_request(f"n must be >= 1 (choices per prompt), got {n}", "n")
    n = n or 1
    top_k = _integer(body, "top_k")
    temperature, top_p = _number(body, "temperature"), _number(body, "top_p")
    params = SamplingParams(max_new_tokens=1, temperature=1.0 if temperature is None else temperature,
                            top_p=1.0 if top_p is None else top_p, top_k=0 if top_k in (None, -1) else top_k,
                            seed=_integer(body, "seed"), stop_on_eos=not _flag(body, "ignore_eos"), stop=_stop(body),
                            stop_token_ids=_stop_token_ids(body), logprobs=logprobs,
                            prompt_logprobs=logprobs if echo else None, grammar=grammar, **_adjustments(body))
    submissions = []
    for ids in prompts:
        tokens = max_tokens if max_tokens is not None else \
            COMPLETION_DEFAULT_MAX_TOKENS if not chat else default_max_tokens(core, ids, params, settings)
        checked = core.check(ids, replace(params, max_new_tokens=tokens), settings, stream)
        for _ in range(n):
            # each choice its own seed stream: choice i of a seeded request draws as a request seeded seed + i
            seed = None if params.seed is None else params.seed + len(submissions)
            submissions.append(replace(checked, params=replace(checked.params, seed=seed)))
    return Parsed(tuple(submissions), n, include_usage, chat, echo, prompt_only, tools)


def _grammar(body: dict, tools: ToolUse | None, core: ServingCore) -> Grammar | None:
    """What the output must match (``serve/structured.py``; a forced tool call's grammar, ``tools.py``), checked
    against the build's tokenizer now: a bad one is a 400 naming its field."""
    grammar, field = grammar_of(body)
    if tools is not None and tools.forced:
        if grammar is not None:
            raise bad_request(f"{field} and tool_choice {tools.choice!r} both constrain the output; send one", field)
        grammar, field = tools.grammar(), "tools"
    if grammar is not None:
        try:
            core.generator.grammars.check(grammar)
        except RequestError as exc:
            raise bad_request(str(exc), field) from None
    return grammar


def _adjustments(body: dict) -> dict[str, Any]:
    """min_p, the penalties and logit_bias as the request set them (ranges checked by SamplingParams)."""
    out: dict[str, Any] = {name: value for name in ("min_p", "presence_penalty", "frequency_penalty",
                                                    "repetition_penalty") if (value := _number(body, name)) is not None}
    bias = body.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or not all(isinstance(k, str) and k.isdigit() for k in bias):
            raise bad_request(f"logit_bias must map token ids (as strings, e.g. {{\"50256\": -100}}) to biases, got "
                              f"{_short(bias)}", "logit_bias")
        out["logit_bias"] = {int(token): value for token, value in bias.items()}
    return out


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives per token the answer's logprobs carry; None: no logprobs. Completions: ``logprobs: k``;
    chat: ``logprobs: true`` with ``top_logprobs: k`` (default 0)."""
    if not chat:
        return _integer(body, "logprobs")      # (range checked by SamplingParams)
    top = _integer(body, "top_logprobs")
    if not _flag(body, "logprobs"):
        if top is not None:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return top or 0


def default_max_tokens(core: ServingCore, ids: list[int], params: SamplingParams, settings: Settings) -> int:
    """The rest of the context after the prompt and the mode's speculation headroom (at least 1: a prompt that
    leaves nothing is then refused by the runtime's check, which says so)."""
    headroom = core.generator.resolve(settings, params).settings.headroom
    return max(1, core.generator.limits.max_context - len(ids) - headroom)


# -- responses ---------------------------------------------------------------------------------------------------------
def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def usage(finals: list[Final], n: int) -> dict[str, int]:
    """Tokens of the whole request: each prompt counted once (its ``n`` choices share it), every choice's completion."""
    prompt = sum(f.prompt_tokens for i, f in enumerate(finals) if i % n == 0)
    completion = sum(f.completion_tokens for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def spec_stats(final: Final) -> dict[str, Any]:
    """The request's own speculation numbers (JSON null where they do not apply, e.g. mode ar)."""
    def finite(value):
        return None if value is None or (isinstance(value, float) and math.isnan(value)) else value
    return {key: finite(value) for key, value in final.stats.items()}


def shown(parsed: Parsed, final: Final) -> Final:
    """What a choice shows of its result: nothing generated when the request asked for its prompt's logprobs alone."""
    if not parsed.prompt_only:
        return final
    return replace(final, text="", token_ids=[], completion_tokens=0, finish_reason="length",
                   logprobs=None if final.logprobs is None else [])


def choice_logprobs(parsed: Parsed, final: Final, prompt_ids: list[int], decode: Decode) -> dict[str, Any] | None:
    """A choice's logprobs object: the echoed prompt's (completions with echo) and the generated tokens'."""
    if not parsed.logprobs:
        return None
    if parsed.chat:
        return chat_logprobs(final.logprobs or [], decode)
    prompt = None
    if parsed.echo:
        prompt = completion_logprobs([None, *(final.prompt_logprobs or [])], prompt_ids, decode)
    offset = len(decode(prompt_ids)) if parsed.echo else 0
    return merge(prompt, completion_logprobs(final.logprobs or [], final.token_ids, decode, offset))


def response(parsed: Parsed, request_id: str, model: str, finals: list[Final], decode: Decode) -> dict[str, Any]:
    """The whole answer of a request that did not stream (``finals``: its choices' results, by index)."""
    finals = [shown(parsed, final) for final in finals]
    choices = []
    for index, final in enumerate(finals):
        prompt_ids = parsed.submissions[index].prompt_ids
        text = decode(prompt_ids) + final.text if parsed.echo else final.text
        body = {"message": {"role": "assistant", "content": text}} if parsed.chat else {"text": text}
        reason = FINISH_REASON[final.finish_reason]
        if parsed.tools is not None:
            found = parse_calls(text, parsed.tools.names)
            if found.calls:
                body["message"] = {"role": "assistant", "content": found.content, "tool_calls": found.calls}
                reason = TOOL_CALLS if reason == "stop" else reason
        choices.append({"index": index, **body, "logprobs": choice_logprobs(parsed, final, prompt_ids, decode),
                        "finish_reason": reason})
    stats = [spec_stats(final) for final in finals]
    return {"id": request_id, "object": "chat.completion" if parsed.chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices, "usage": usage(finals, parsed.n),
            # the request's speculation numbers; a list, by choice index, when it has several choices
            "ssd_trt": stats[0] if len(stats) == 1 else stats}


class Chunks:
    """A streamed request's server-sent events: ``data: {chunk}`` per piece of a choice's text (with its tokens'
    logprobs when asked for), each choice's finish reason and statistics in its last chunk, the usage in one more
    chunk when ``stream_options.include_usage``, then ``data: [DONE]``."""

    def __init__(self, parsed: Parsed, request_id: str, model: str, decode: Decode) -> None:
        self.parsed, self.id, self.model, self.decode = parsed, request_id, model, decode
        self.created = int(time.time())
        self.started: set[int] = set()          # choices whose first delta was sent (a chat's names the role)
        self.offsets: dict[int, int] = {}       # completions: each choice's text sent so far (its logprobs' offsets)
        # chat with tools: each choice's text split into content and calls as it arrives
        self.calls = {i: CallStream(parsed.tools.names) for i in range(len(parsed.submissions))} \
            if parsed.tools is not None else {}

    def _chunk(self, choices: list[dict], **extra: Any) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.parsed.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, **extra}
        if self.parsed.include_usage and "usage" not in body:
            body["usage"] = None
        return event(body)

    def _logprobs(self, index: int, text: str, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if not self.parsed.logprobs:
            return None
        entries = entries or []
        if self.parsed.chat:
            return chat_logprobs(entries, self.decode)
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(text)
        return completion_logprobs(entries, [e.token for e in entries], self.decode, offset)

    def _choice(self, index: int, text: str, finish_reason: str | None,
                entries: list[TokenLogprob] | None, calls: list[dict] | None = None) -> dict:
        logprobs = self._logprobs(index, text, entries)
        if not self.parsed.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        delta = {"content": text} if text or index not in self.started else {}
        if calls:
            delta["tool_calls"] = calls
        if index not in self.started:
            delta = {"role": "assistant", **delta}
        self.started.add(index)
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def text(self, index: int, text: str, entries: list[TokenLogprob] | None = None) -> str:
        calls = None
        if index in self.calls:
            text, calls = self.calls[index].feed(text)
        return self._chunk([self._choice(index, text, None, entries, calls)]) if text or entries or calls else ""

    def final(self, index: int, final: Final) -> str:
        text, calls, reason = final.text, None, FINISH_REASON[final.finish_reason]
        if index in self.calls:
            text, calls = self.calls[index].end(text)
            if self.calls[index].calls and reason == "stop":
                reason = TOOL_CALLS
        return self._chunk([self._choice(index, text, reason, final.logprobs, calls)], ssd_trt=spec_stats(final))

    def end(self, finals: list[Final]) -> str:
        """After every choice's final chunk: the usage chunk (when asked for), then ``[DONE]``."""
        out = self._chunk([], usage=usage(finals, self.parsed.n)) if self.parsed.include_usage else ""
        return out + DONE


def event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def error_event(error: ApiError) -> str:
    """An error after the stream started (its status is already sent): the error object as an event, then DONE."""
    return event(error.body()) + DONE

