"""What a request's output must match, read from the shapes clients send (for both frontends): OpenAI's
``response_format``, vLLM's ``structured_outputs`` object and its older ``guided_*`` fields. Each becomes one
:class:`~ssd_trt.decoding.grammar.Grammar`; the engine masks by it (``decoding/grammar.py``).

  response_format      {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "json_schema":
                       {"name": ..., "schema": {...}, "strict": true}}                       (OpenAI)
  structured_outputs   {"json": schema | "schema text"} | {"regex": "..."} | {"choice": ["a", "b"]} |
                       {"grammar": "Lark or GBNF"} | {"json_object": true}                   (vLLM)
  guided_json, guided_regex, guided_choice, guided_grammar                                   (vLLM, older)

Over Triton the ``structured_outputs`` input holds the vLLM object as JSON text. A request may ask for one of these;
two at once is a RequestError naming both. Each RequestError here carries the field at fault.
"""
from __future__ import annotations

import json
from typing import Any

from ssd_trt.decoding.grammar import Grammar
from ssd_trt.errors import RequestError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def from_response_format(value: Any) -> Grammar | None:
    """OpenAI's ``response_format``."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_schema(None)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON schema object "
                                  "({\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}})",
                                  "response_format")
        return Grammar.json_schema(schema)
    raise RequestError(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                          "response_format")


def from_structured_outputs(value: Any, field: str = "structured_outputs") -> Grammar | None:
    """vLLM's ``structured_outputs`` object (one key of ``STRUCTURED_KEYS``)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RequestError(f"{field} must be an object with one of {', '.join(STRUCTURED_KEYS)}, got "
                              f"{type(value).__name__}", field)
    asked = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = sorted(set(asked) - set(STRUCTURED_KEYS))
    if unknown or len(asked) != 1:
        what = f"unknown keys {unknown}" if unknown else f"{len(asked)} keys"
        raise RequestError(f"{field} must set exactly one of {', '.join(STRUCTURED_KEYS)} ({what} given)", field)
    [(key, spec)] = asked.items()
    return _grammar(key, spec, f"{field}.{key}", field)


def _grammar(key: str, spec: Any, where: str, field: str) -> Grammar:
    if key == "json_object":
        return Grammar.json_schema(None)
    if key == "json":
        if isinstance(spec, str):
            try:
                spec = json.loads(spec)
            except ValueError as exc:
                raise RequestError(f"{where} is not valid JSON ({exc})", field) from None
        if not isinstance(spec, dict):
            raise RequestError(f"{where} must be a JSON schema object", field)
        return Grammar.json_schema(spec)
    if key == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) and c for c in spec):
            raise RequestError(f"{where} must be a non-empty list of non-empty strings", field)
        return Grammar.choice(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise RequestError(f"{where} must be a non-empty string", field)
    return Grammar("regex" if key == "regex" else "lark", spec)


def grammar_of(body: dict) -> tuple[Grammar | None, str | None]:
    """The one grammar a request body asks for through any of the fields above, and that field (None, None: none)."""
    asked = [name for name in ("response_format", "structured_outputs", *GUIDED)
             if body.get(name) is not None and not (name == "response_format" and
                                                    from_response_format(body[name]) is None)]
    if len(asked) > 1:
        raise RequestError(f"{' and '.join(asked)} both constrain the output; send one", asked[1])
    if not asked:
        return None, None
    name = asked[0]
    if name == "response_format":
        return from_response_format(body[name]), name
    if name == "structured_outputs":
        return from_structured_outputs(body[name]), name
    return _grammar(GUIDED[name], body[name], name, name), name


def from_triton(text: str | None) -> Grammar | None:
    """The Triton ``structured_outputs`` input: the vLLM object as JSON text."""
    if text is None or not text.strip():
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise RequestError(f"input 'structured_outputs' is not valid JSON ({exc}); send e.g. "
                              f"{{\"json\": {{...schema...}}}}", "structured_outputs") from None
    return from_structured_outputs(value)
