"""Tool calls (OpenAI's ``tools`` / ``tool_choice``): the tools go to the model through its own chat template, the
model's tool-call text comes back as ``tool_calls``.

The format is Hermes' (NousResearch), which Qwen2.5's template asks for and most open models were tuned on: each
call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``. A template that does not render tools
itself (it never mentions them, e.g. SmolLM2's) gets them in a system message of the same format.

``tool_choice``: ``none`` (the tools are left out of the prompt: the model answers in text), ``auto`` (the default
with tools: the model decides; its calls are parsed out of the text), ``required`` or a named function (enforced by a
grammar, ``decoding/grammar.py``: one or more calls, or exactly one of that function, each call's arguments valid
under the function's JSON schema). ``parallel_tool_calls: false`` allows one call.

Small models often write a call without the tags: the reply is nothing but ``{"name": ..., "arguments": ...}`` (or a
list of them), maybe in a ```json fence. Such a reply is taken as calls when every object names one of the request's
functions (vLLM's Hermes parser would return it as text); anything else stays text.

Streamed, the text before the first call streams as content; a call is sent whole, in one ``tool_calls`` delta (its
index, id, name and complete arguments), once its closing tag arrived, as OpenAI's stream ends each call's deltas. A
reply that starts like a bare call (``{``, ``[`` or a fence) is held to its end, then sent as calls or as text.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from ssd_trt.decoding.grammar import JSON_OPTIONS, Grammar
from ssd_trt.errors import RequestError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FENCE = re.compile(r"```(?:json)?\s*(.*?)\s*```", re.S)
BARE_START = "{[`"          # how a reply that is a bare call begins


@dataclass(frozen=True)
class Function:
    name: str
    description: str
    parameters: dict


@dataclass(frozen=True)
class ToolUse:
    """A request's tools and how the model may use them (``choice``: auto | required | a function's name)."""
    functions: tuple[Function, ...]
    choice: str
    parallel: bool = True

    @property
    def names(self) -> frozenset[str]:
        return frozenset(f.name for f in self.functions)

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def grammar(self) -> Grammar | None:
        """``required`` and a named function: the calls the output must be (None for auto)."""
        if not self.forced:
            return None
        allowed = [f for f in self.functions if self.choice in ("required", f.name)]
        schema = {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                             "properties": {"name": {"const": f.name}, "arguments": f.parameters}}
                            for f in allowed], "x-guidance": dict(JSON_OPTIONS)}
        block = f'"{OPEN}\\n" call "\\n{CLOSE}"'
        # several calls (required, parallel): one a line, as the Hermes format lists them
        start = 'block ("\\n" block)*' if self.parallel and self.choice == "required" else "block"
        return Grammar("lark", f"start: {start}\nblock: {block}\ncall: %json {json.dumps(schema)}")

    def template_tools(self) -> list[dict]:
        """The tools as chat templates take them (OpenAI's shape)."""
        return [{"type": "function", "function": {"name": f.name, "description": f.description,
                                                  "parameters": f.parameters}} for f in self.functions]

    def system_prompt(self) -> str:
        """For a template that does not render tools: the Hermes instructions, with the tools' signatures."""
        listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in self.template_tools())
        return ("You may call one or more functions to assist with the user query. The functions you can call are "
                f"listed within <tools></tools>:\n<tools>\n{listed}\n</tools>\nFor each function call, return a JSON "
                f"object with the function name and arguments within {OPEN}{CLOSE} tags:\n{OPEN}\n"
                f'{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def tool_use(body: dict) -> ToolUse | None:
    """The request's tools (None: none, or ``tool_choice: none``), checked; a RequestError naming the field."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise RequestError(f"parallel_tool_calls must be true or false, got {parallel!r}", "parallel_tool_calls")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise RequestError("tool_choice needs tools: list the functions the model may call", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise RequestError(f"tools must be a list of {{type: function, function: {{name, parameters}}}}, got "
                           f"{type(tools).__name__}", "tools")
    functions = []
    for i, tool in enumerate(tools):
        spec = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        name = spec.get("name") if isinstance(spec, dict) else None
        if not isinstance(name, str) or not name:
            raise RequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                               f"\"parameters\": {{...}}}}}}", "tools")
        parameters = spec.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise RequestError(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        functions.append(Function(name, str(spec.get("description") or ""), parameters))
    if len({f.name for f in functions}) != len(functions):
        raise RequestError("tools hold two functions of the same name", "tools")
    if choice is None or choice == "auto":
        return ToolUse(tuple(functions), "auto", parallel is not False)
    if choice == "none":
        return None
    if choice == "required":
        return ToolUse(tuple(functions), "required", parallel is not False)
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
        choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
    if named is None:
        raise RequestError(f"tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": "
                           f"{{\"name\": ...}}}}, got {choice!r}", "tool_choice")
    if named not in {f.name for f in functions}:
        raise RequestError(f"tool_choice names {named!r}, which is not among the tools "
                           f"({', '.join(f.name for f in functions)})", "tool_choice")
    return ToolUse(tuple(functions), named, False)


def template_message(message: dict, index: int) -> dict:
    """An assistant message's ``tool_calls`` or a ``tool`` message's result, as chat templates take them (their
    arguments as objects: templates serialise them)."""
    out: dict[str, Any] = {}
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise RequestError(f"messages[{index}].tool_calls must be a list", "messages")
        out["tool_calls"] = []
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise RequestError(f"messages[{index}].tool_calls: each call needs function.name and .arguments",
                                   "messages")
            arguments = function.get("arguments") or "{}"
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    raise RequestError(f"messages[{index}].tool_calls: the arguments of {function['name']!r} are not "
                                       f"JSON", "messages") from None
            out["tool_calls"].append({"type": "function", "id": call.get("id"),
                                      "function": {"name": function["name"], "arguments": arguments}})
    if message.get("role") == "tool":
        if message.get("tool_call_id") is not None:
            out["tool_call_id"] = str(message["tool_call_id"])
        if message.get("name") is not None:
            out["name"] = str(message["name"])
    return out


def hermes_text(message: dict) -> str:
    """An assistant message's calls in Hermes' format (for a template that does not render ``tool_calls``)."""
    return "".join(f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                   f"\n{CLOSE}" for c in message.get("tool_calls", []))


def with_tool_prompt(messages: list[dict], tools: ToolUse) -> list[dict]:
    """The tools in the system message, for a template that does not render them."""
    if messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + tools.system_prompt()}, *messages[1:]]
    return [{"role": "system", "content": tools.system_prompt()}, *messages]


def plain_tool_message(message: dict) -> dict:
    """A message with tool calls or a tool's result as plain text (Hermes' tags)."""
    if message.get("tool_calls"):
        return {"role": message["role"], "content": message["content"] + hermes_text(message)}
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
    return message


@dataclass
class Parsed:
    content: str | None
    calls: list[dict]


def parse_calls(text: str, names: frozenset[str]) -> Parsed:
    """The model's text as content and tool calls (OpenAI's objects, arguments as JSON text) of the functions
    ``names``. A block that does not parse as a call stays in the content, as the model wrote it."""
    if OPEN not in text:
        calls = bare_calls(text, names)
        return Parsed(None, calls) if calls else Parsed(text.strip() or None, [])
    content, calls, at = [], [], 0
    while True:
        start = text.find(OPEN, at)
        if start < 0:
            content.append(text[at:])
            break
        end = text.find(CLOSE, start)
        block = text[start + len(OPEN):end if end >= 0 else len(text)]
        call = _call(block)
        if call is None:
            content.append(text[at:end + len(CLOSE) if end >= 0 else len(text)])
        else:
            content.append(text[at:start])
            calls.append(call)
        if end < 0:
            break
        at = end + len(CLOSE)
    joined = "".join(content).strip()
    return Parsed(joined or None, calls)


def bare_calls(text: str, names: frozenset[str]) -> list[dict]:
    """A reply that is nothing but call objects naming the request's functions (module doc); [] otherwise."""
    body = text.strip()
    fenced = FENCE.fullmatch(body)
    try:
        value = json.loads(fenced.group(1) if fenced else body)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [_object_call(item) for item in items]
    if not items or any(c is None or c["function"]["name"] not in names for c in calls):
        return []
    return calls


def _call(block: str) -> dict | None:
    try:
        value = json.loads(block.strip())
    except ValueError:
        return None
    return _object_call(value)


def _object_call(value) -> dict | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": value["name"],
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments,
                                                                                               ensure_ascii=False)}}


class CallStream:
    """One streamed choice's text split into content to send now and tool calls, as the text arrives: content up to
    where a call may begin is sent; from ``<tool_call>`` on, text is held until the call closes, then sent as a call
    (``feed`` returns (content, calls ready)); a reply that starts like a bare call is held whole; ``end`` gives what
    is left."""

    def __init__(self, names: frozenset[str]) -> None:
        self.names = names
        self.held = ""
        self.calls = 0          # calls sent (their indices)
        self.sent = False       # content was sent (the reply is not a bare call)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.held += text
        if not self.sent and not self.calls and (not self.held.strip() or self.held.lstrip()[0] in BARE_START):
            return "", []           # maybe a bare call: wait for the end
        content, calls = "", []
        while True:
            start = self.held.find(OPEN)
            if start < 0:
                # keep back a tail that may be the start of the opening tag
                keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1)
                             if OPEN.startswith(self.held[-k:])), 0)
                content += self.held[:len(self.held) - keep]
                self.held = self.held[len(self.held) - keep:]
                break
            end = self.held.find(CLOSE, start)
            if end < 0:
                content += self.held[:start]
                self.held = self.held[start:]
                break
            call = _call(self.held[start + len(OPEN):end])
            if call is None:
                content += self.held[:end + len(CLOSE)]
            else:
                content += self.held[:start]
                calls.append(self._numbered(call))
            self.held = self.held[end + len(CLOSE):]
        self.sent = self.sent or bool(content.strip())
        return content, calls

    def end(self, text: str) -> tuple[str, list[dict]]:
        """The rest of the text: any last call; what never closed is content."""
        if not self.sent and not self.calls and OPEN not in self.held + text:
            calls = bare_calls(self.held + text, self.names)
            if calls:
                self.held = ""
                return "", [self._numbered(c) for c in calls]
            self.sent = True              # (text after all: the held start goes out as content below)
        content, calls = self.feed(text)
        content, self.held = content + self.held, ""
        return content, calls

    def _numbered(self, call: dict) -> dict:
        call = {"index": self.calls, **call}
        self.calls += 1
        return call
