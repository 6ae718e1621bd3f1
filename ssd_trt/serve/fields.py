"""Every request field of the serving frontends, written once: its name in the OpenAI body, the endpoints that take it,
what it feeds, and its Triton input (name and wire type) where Triton takes it.

The OpenAI protocol (``serve/openai/protocol.py``) refuses a body field that is not here, and a field whose ``feeds``
is ``UNSUPPORTED`` unless it holds one of its neutral values, each with a 400 naming the field; ``ADVISORY`` fields
(OpenAI documents them as not changing the output, e.g. ``user``) are taken and ignored. The Triton model
configuration's inputs (``serve/triton/repository.py``) and the inputs the backend reads (``serve/triton/backend.py``)
are this table's Triton columns, and an error's ``param`` is found among these names (``serve/openai/errors.py``).
A new request field is one entry here plus its use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

COMPLETIONS, CHAT = "completions", "chat"
BOTH = (COMPLETIONS, CHAT)
# what a field feeds
SAMPLING = "sampling"          # SamplingParams
MODE = "mode"                  # the decoding mode's settings (decoding/settings.py)
FRONTEND = "frontend"          # how the request is read or answered (prompt, stream, n, ...)
ADVISORY = "advisory"          # taken and ignored, as OpenAI documents them
UNSUPPORTED = "unsupported"    # refused (400) unless it holds a neutral value


@dataclass(frozen=True)
class Field:
    name: str                                  # in the OpenAI body
    feeds: str
    endpoints: tuple[str, ...] = BOTH          # () : a Triton input only
    triton: str | None = None                  # the Triton input's name (None: not a Triton input)
    wire: str | None = None                    # its Triton data type
    dims: str = "[ 1 ]"                        # its Triton dims ([ -1 ]: a list)
    required: bool = False                     # over Triton
    neutral: tuple[Any, ...] = ()              # UNSUPPORTED: the values that ask for nothing (None: absent)


FIELDS: tuple[Field, ...] = (
    # the prompt, then the others; Triton's inputs are listed in this order
    Field("prompt", FRONTEND, (COMPLETIONS,), "text_input", "TYPE_STRING", required=True),
    Field("max_tokens", SAMPLING, BOTH, "max_tokens", "TYPE_INT32", required=True),
    Field("messages", FRONTEND, (CHAT,)),
    Field("model", FRONTEND),
    Field("max_completion_tokens", SAMPLING),
    Field("temperature", SAMPLING, BOTH, "temperature", "TYPE_FP32"),
    Field("top_p", SAMPLING, BOTH, "top_p", "TYPE_FP32"),
    Field("top_k", SAMPLING, BOTH, "top_k", "TYPE_INT32"),
    Field("seed", SAMPLING, BOTH, "random_seed", "TYPE_UINT64"),
    Field("stream", FRONTEND, BOTH, "stream", "TYPE_BOOL"),
    Field("mode", MODE, BOTH, "mode", "TYPE_STRING"),
    Field("chat", FRONTEND, (), "chat", "TYPE_BOOL"),          # OpenAI: the endpoint says it
    Field("ignore_eos", SAMPLING, BOTH, "ignore_eos", "TYPE_BOOL"),
    Field("stop", SAMPLING, BOTH, "stop_words", "TYPE_STRING", "[ -1 ]"),
    Field("draft_len", MODE, BOTH, "draft_len", "TYPE_INT32"),
    Field("fan_out_budget", MODE, BOTH, "fan_out_budget", "TYPE_INT32"),
    Field("backup", MODE, BOTH, "backup", "TYPE_STRING"),
    Field("tree_widths", MODE, BOTH, "tree_widths", "TYPE_INT32", "[ -1 ]"),
    Field("stop_token_ids", SAMPLING),
    Field("logprobs", SAMPLING),               # completions: how many alternatives; chat: true / false
    Field("top_logprobs", SAMPLING, (CHAT,)),
    Field("echo", FRONTEND, (COMPLETIONS,)),
    Field("min_p", SAMPLING),
    Field("presence_penalty", SAMPLING),
    Field("frequency_penalty", SAMPLING),
    Field("repetition_penalty", SAMPLING),
    Field("logit_bias", SAMPLING),
    Field("response_format", SAMPLING),        # structured output (serve/structured.py): OpenAI's
    Field("structured_outputs", SAMPLING, BOTH, "structured_outputs", "TYPE_STRING"),   # vLLM's (Triton: as JSON)
    Field("guided_json", SAMPLING),            # vLLM's older names for the same
    Field("guided_regex", SAMPLING),
    Field("guided_choice", SAMPLING),
    Field("guided_grammar", SAMPLING),
    Field("tools", FRONTEND, (CHAT,)),         # tool calls (serve/openai/tools.py)
    Field("tool_choice", FRONTEND, (CHAT,)),
    Field("parallel_tool_calls", FRONTEND, (CHAT,)),
    Field("n", FRONTEND),
    Field("stream_options", FRONTEND),
    # advisory (OpenAI: for the provider's records, abuse detection or caching; the output does not depend on them)
    Field("user", ADVISORY),
    Field("safety_identifier", ADVISORY),
    Field("prompt_cache_key", ADVISORY),
    Field("metadata", ADVISORY),
    Field("store", ADVISORY),
    Field("service_tier", ADVISORY),
    # not done by this server: refused unless neutral
    Field("suffix", UNSUPPORTED, (COMPLETIONS,), neutral=(None, "")),
    Field("best_of", UNSUPPORTED, (COMPLETIONS,), neutral=(None, 1)),
    Field("functions", UNSUPPORTED, (CHAT,), neutral=(None, [])),
    Field("function_call", UNSUPPORTED, (CHAT,), neutral=(None, "none")),
    Field("modalities", UNSUPPORTED, (CHAT,), neutral=(None, ["text"])),
)
BY_NAME = {f.name: f for f in FIELDS}
NAMES = tuple(BY_NAME)
TRITON_INPUTS = tuple(f for f in FIELDS if f.triton is not None)
BY_TRITON = {f.triton: f for f in TRITON_INPUTS}


def client_dtype(triton_name: str) -> str:
    """The data type a Triton client sends an input as (tritonclient's names: BYTES for TYPE_STRING)."""
    wire = BY_TRITON[triton_name].wire.removeprefix("TYPE_")
    return "BYTES" if wire == "STRING" else wire


# the fields a body sent to each endpoint may hold, by name
BY_ENDPOINT = {endpoint: {f.name: f for f in FIELDS if endpoint in f.endpoints} for endpoint in BOTH}


def is_neutral(field: Field, value: Any) -> bool:
    """Whether an UNSUPPORTED field's value asks for nothing (true and 1 are not the same value here)."""
    for neutral in field.neutral:
        if neutral is None:
            if value is None:
                return True
        elif isinstance(value, bool) == isinstance(neutral, bool) and value == neutral:
            return True
    return False
