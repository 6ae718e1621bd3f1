"""Real clients against the OpenAI server on the real pair (Qwen2.5-Coder-1.5B-Instruct verified by SSD with the 0.5B
draft): what issue 57's acceptance asks of LangChain and LiteLLM on a model that follows instructions.

    .venv/bin/python research/serving/real_pair_clients.py build/qwen2.5-coder-1.5b \
        --out docs/bench/real_pair_clients.json

For each mode (ar, sd, ssd; greedy):
  * LangChain ``ChatOpenAI.with_structured_output(Person)`` (json_schema, its default): the object, and whether it
    validates;
  * LangChain ``bind_tools`` with two tools and ``tool_choice`` left to the model (auto): the calls the model chose;
  * LiteLLM ``openai/`` provider: a chat, the same streamed (equal text), and ``response_format`` a pydantic model;
  * the server's own acceptance for a structured request with the draft masked and not (``mask_draft`` is not an
    HTTP field: that comparison runs in-process, ``research/serving/structured_acceptance.py``).
Every answer is compared across modes: greedy, they must be the same.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ssd_trt.serve.openai.process import OpenAIServer  # noqa: E402
from ssd_trt.serve.process import free_port  # noqa: E402

MODES = ("ar", "sd", "ssd")


def run_clients(url: str, model: str, mode: str) -> dict[str, Any]:
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field
    import litellm

    class Person(BaseModel):
        """A person."""
        name: str = Field(description="the person's full name")
        age: int = Field(description="age in years")
        city: str

    def get_weather(city: str) -> str:
        """The current weather in a city."""
        raise NotImplementedError

    def add(a: int, b: int) -> int:
        """Add two integers."""
        raise NotImplementedError

    out: dict[str, Any] = {}
    chat = ChatOpenAI(base_url=url + "/v1", api_key="unused", model=model, temperature=0, max_tokens=96,
                      max_retries=0, extra_body={"mode": mode})
    started = time.perf_counter()
    person = chat.with_structured_output(Person).invoke("Invent a person who lives in Lisbon.")
    out["structured"] = {"object": person.model_dump(), "valid": isinstance(person, Person),
                         "seconds": round(time.perf_counter() - started, 2)}
    for prompt in ("What is the weather in Paris right now?", "What is 17 + 25? Use a tool."):
        started = time.perf_counter()
        message = chat.bind_tools([get_weather, add]).invoke(prompt)
        out.setdefault("tools", []).append({"prompt": prompt, "calls": message.tool_calls, "content": message.content,
                                            "seconds": round(time.perf_counter() - started, 2)})
    common = dict(model=f"openai/{model}", api_base=url + "/v1", api_key="unused", temperature=0, max_tokens=48,
                  messages=[{"role": "user", "content": "Name three prime numbers."}], extra_body={"mode": mode})
    whole = litellm.completion(**common).choices[0].message.content
    parts = "".join(c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **common))
    shaped = litellm.completion(**{**common, "max_tokens": 96, "response_format": Person,
                                   "messages": [{"role": "user", "content": "Invent a person."}]})
    out["litellm"] = {"chat": whole, "stream_equal": parts == whole,
                      "response_format": shaped.choices[0].message.content,
                      "response_format_valid": _valid(Person, shaped.choices[0].message.content)}
    return out


def _valid(model, text: str) -> bool:
    try:
        model.model_validate_json(text)
    except ValueError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("build", type=Path)
    parser.add_argument("--out", type=Path, default=ROOT / "docs/bench/real_pair_clients.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")      # (offline)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = OpenAIServer(args.build, free_port(), ["--no-access-log"], log_file=Path(tmp) / "server.log")
        try:
            server.start().wait_ready(timeout=900)
            for mode in MODES:
                print(f"mode {mode} ...", file=sys.stderr, flush=True)
                results[mode] = run_clients(server.url, args.build.name, mode)
        finally:
            server.stop()
    # greedy: every mode answers the same (ids of tool calls aside)
    def comparable(r: dict) -> str:
        tools = [[{k: v for k, v in c.items() if k != "id"} for c in t["calls"]] for t in r["tools"]]
        return json.dumps([r["structured"]["object"], tools, [t["content"] for t in r["tools"]], r["litellm"]],
                          sort_keys=True)
    same = len({comparable(r) for r in results.values()}) == 1
    artifact = {"build": args.build.name, "when": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "machine": platform.processor() or platform.machine(), "modes_agree": same, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(artifact, indent=1, ensure_ascii=False) + "\n")
    for mode, r in results.items():
        print(f"{mode}: structured {r['structured']['object']} | tools "
              f"{[[(c['name'], c['args']) for c in t['calls']] for t in r['tools']]} | litellm stream equal "
              f"{r['litellm']['stream_equal']}, response_format valid {r['litellm']['response_format_valid']}")
    print(f"modes agree: {same}; wrote {args.out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
