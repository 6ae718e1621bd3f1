"""The OpenAI-compatible server: a real ``python -m ssd_trt.serve.openai`` process on a free 127.0.0.1 port serving the
embedded pair, driven by the official ``openai`` client (and httpx for what the client hides: raw errors, the
event stream, a client that goes away), its answers checked against in-process ``ssd_trt``.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import httpx
import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

import ssd_trt
from ssd_trt.batching.scheduler import CapacityError
from ssd_trt.serve.core import Final, Submission
from ssd_trt.serve.openai.errors import from_exception, param_of
from ssd_trt.serve.openai.process import OpenAIServer
from ssd_trt.serve.process import free_port

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 16
MODES = ("ar", "sd", "ssd")
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                            "parameters": {"type": "object", "required": ["city"],
                                                           "properties": {"city": {"type": "string"}}}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "required": ["a", "b"],
                                                       "properties": {"a": {"type": "integer"},
                                                                      "b": {"type": "integer"}}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer"}}}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
CHAT = "Write a haiku about autumn."
SAMPLED = dict(temperature=0.8, top_p=0.95, seed=7)


# -- pieces that need no model ----------------------------------------------------------------------------------------
def test_a_full_queue_is_a_503_with_retry_after_and_validation_errors_name_their_field():
    full = from_exception(CapacityError("16 requests are already waiting; retry later"))
    assert full.status == 503 and full.headers["Retry-After"] and full.body()["error"]["code"] == "queue_full"
    bad = from_exception(ssd_trt.errors.RequestError("prompt (2000 tokens) + max_new_tokens (100) exceeds the "
                                                     "engine's max context 2048; lower max_new_tokens"))
    assert bad.status == 400 and set(bad.body()["error"]) == {"message", "type", "param", "code"}
    assert "max_new_tokens" not in bad.message and bad.param == "max_tokens"
    assert param_of("temperature must be a finite number >= 0 (0 = greedy), got -1") == "temperature"
    assert param_of("'draft_len' applies to mode sd or ssd, not ar (mode ar takes none of them)") == "draft_len"
    assert param_of("unknown mode 'beam'; choose one of ar, sd, ssd") == "mode"
    crash = from_exception(KeyError("boom"))
    assert crash.status == 500 and "Traceback" not in crash.message


def test_a_chat_template_that_refuses_the_conversation_is_a_400_naming_the_message(smollm2_build):
    """A template that enforces alternating roles (as Llama 2's and Mistral's do, with ``raise_exception``), on the
    build's real tokenizer: the 400 names the first message at fault and carries the template's words."""
    from transformers import AutoTokenizer

    from ssd_trt.serve.openai.errors import ApiError
    from ssd_trt.serve.openai.protocol import _chat_ids
    tokenizer = AutoTokenizer.from_pretrained(smollm2_build / "tokenizer")
    tokenizer.chat_template = (
        "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    assert _chat_ids(tokenizer, [{"role": "user", "content": "Hi"}])
    with pytest.raises(ApiError) as caught:
        _chat_ids(tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                              {"role": "assistant", "content": "Again"}])
    error = caught.value
    assert error.status == 400 and error.param == "messages"
    assert error.message.startswith("messages[2] (role 'assistant'): the model's chat template refuses") and \
        "roles must alternate" in error.message, error.message


def test_the_load_bench_sweeps_modes_side_by_side_and_tables_both_frontends():
    from ssd_trt.serve.openai.load_bench import points, table
    assert points(("ar", "ssd"), (1, 4, 16), 16) == [("ar", 1, 16), ("ssd", 1, 16), ("ar", 4, 4), ("ssd", 4, 4),
                                                      ("ar", 16, 4), ("ssd", 16, 4)]
    point = {"mode": "ssd", "concurrency": 4, "requests": 16, "throughput_tok_s": 120.0, "latency_p50_s": 1.0,
             "latency_p99_s": 2.0, "ttft_p50_s": 0.1, "ttft_p99_s": 0.3, "errors": []}
    rendered = table({"openai": [point], "triton": [{**point, "throughput_tok_s": 125.0}], "same_text": [True]})
    assert "| openai | ssd | 4 | 16 | 120.0 |" in rendered and "| triton | ssd | 4 | 16 | 125.0 |" in rendered
    assert "identical between the frontends at 1 of 1 points" in rendered


def test_the_docs_openai_load_table_is_the_rendering_of_its_artifact():
    from ssd_trt.serve.openai.load_bench import table
    rendered = table(json.loads((ROOT / "docs/bench/serving_openai.json").read_text()))
    page = (ROOT / "docs/serving.md").read_text()
    missing = [line for line in rendered.splitlines() if line.strip() and line not in page]
    assert not missing, f"docs/serving.md lacks lines of the OpenAI load bench's table: {missing[:2]}"


class EchoCore:
    """A stand-in for the serving loop (no model): every request answers "Hel" + "lo" in two chunks, or its queue is
    full."""

    def __init__(self, full: bool = False) -> None:
        self.full = full
        self.default_mode = "ssd"
        tokenizer = SimpleNamespace(chat_template="(any)", apply_chat_template=lambda messages, **_: [1, 2, 3])
        self.generator = SimpleNamespace(encode=lambda text: [1, 2, 3], tokenizer=tokenizer,
                                         limits=SimpleNamespace(max_context=64))
        self.rejected: Counter = Counter()

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(ord("a") + t % 26) for t in token_ids)

    def count_rejected(self, reason: str) -> None:
        self.rejected[reason] += 1

    def check(self, ids, params, settings, stream):
        return Submission(ids, params, settings, stream)

    def refusal(self) -> str | None:
        return None

    def health(self) -> dict:
        return {"status": "ok"}

    def submit(self, submission, handle, arrived=None) -> str:     # noqa: ARG002
        if self.full:
            raise CapacityError("1 requests are already waiting for one of 1 running slots (max_waiting 1); "
                                "retry later")
        stats = {"mode": "ar", "generated_tokens": 2, "accepted_tokens": 0, "speculative_rounds": 0,
                 "acceptance_rate": None, "cache_hit_rate": None}

        def answer() -> None:
            if submission.stream:
                handle.chunk("Hel", [7])
                handle.chunk("lo", [8])
                handle.final(Final("", [], "length", 3, 2, stats))
            else:
                handle.final(Final("Hello", [7, 8], "eos", 3, 2, stats))
        threading.Thread(target=answer).start()
        return "1"

    def abort(self, request_id: str) -> None:
        pass

    def close(self) -> None:
        pass


def echo_app(core: EchoCore):
    from fastapi.testclient import TestClient

    from ssd_trt.serve.openai.app import ServerState, create_app
    state = ServerState("echo", lambda: core)
    return TestClient(create_app(state)), state


def test_the_http_layer_answers_in_openais_shapes_and_refuses_a_full_queue_with_503():
    with echo_app(EchoCore())[0] as http:
        while http.get("/health").status_code != 200:       # the loader thread hands the core over
            time.sleep(0.01)
        whole = http.post("/v1/completions", json={"model": "echo", "prompt": "Hi", "max_tokens": 2}).json()
        assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == "Hello"
        assert whole["choices"][0]["finish_reason"] == "stop" and whole["usage"] == {
            "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        assert whole["ssd_trt"]["acceptance_rate"] is None
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True,
                "stream_options": {"include_usage": True}}
        events = [line for line in http.post("/v1/chat/completions", json={**body, "model": "echo"}).text.split("\n\n")
                  if line]
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert events[-1] == "data: [DONE]"
        assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": "Hel"},
                                                                 {"content": "lo"}]
        assert chunks[2]["choices"][0]["finish_reason"] == "length" and chunks[2]["ssd_trt"]["mode"] == "ar"
        assert chunks[3]["choices"] == [] and chunks[3]["usage"]["total_tokens"] == 5
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
        # several prompts and n: one choice each, indexed prompt by prompt, each prompt's tokens counted once
        several = http.post("/v1/completions", json={"prompt": ["Hi", [5, 6, 7]], "n": 2, "max_tokens": 2}).json()
        assert [(c["index"], c["text"]) for c in several["choices"]] == [(i, "Hello") for i in range(4)]
        assert several["usage"] == {"prompt_tokens": 6, "completion_tokens": 8, "total_tokens": 14}
        assert len(several["ssd_trt"]) == 4
        events = [line for line in http.post("/v1/chat/completions", json={**body, "n": 2}).text.split("\n\n")
                  if line]
        chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
        assert events[-1] == "data: [DONE]" and chunks[-1]["usage"]["total_tokens"] == 3 + 2 * 2
        for index in (0, 1):
            mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
            assert [m["delta"] for m in mine[:2]] == [{"role": "assistant", "content": "Hel"}, {"content": "lo"}]
            assert mine[-1]["finish_reason"] == "length" and len(mine) == 3
        bad = http.post("/v1/completions", json={"prompt": [], "max_tokens": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
    full = EchoCore(full=True)
    with echo_app(full)[0] as http:
        while http.get("/health").status_code != 200:
            time.sleep(0.01)
        refused = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert refused.json()["error"]["code"] == "queue_full" and "retry later" in refused.json()["error"]["message"]
    assert full.rejected == {"queue_full": 1}


class EndlessCore(EchoCore):
    """A stand-in loop whose requests never end on their own: a chunk every 20 ms until aborted."""

    def __init__(self) -> None:
        super().__init__()
        self.aborted = threading.Event()

    def submit(self, submission, handle, arrived=None) -> str:     # noqa: ARG002
        def answer() -> None:
            while not self.aborted.is_set():
                try:
                    handle.chunk("x", [7])
                except ConnectionError:              # the HTTP side stopped listening
                    return
                time.sleep(0.02)
        threading.Thread(target=answer, daemon=True).start()
        return "1"

    def abort(self, request_id: str) -> None:
        self.aborted.set()


def test_a_client_that_goes_away_has_its_request_aborted_streaming_or_waiting():
    """Over a real socket (uvicorn): closing a stream mid-way, or giving up on a whole answer, aborts the request
    within about a poll (the streamed one at once)."""
    import uvicorn

    from ssd_trt.serve.openai.app import ServerState, create_app
    core, port = EndlessCore(), free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(ServerState("echo", lambda: core)), host="127.0.0.1",
                                           port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        with httpx.Client(timeout=10) as http, http.stream("POST", url, json={"prompt": "Hi", "stream": True}) as r:
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data: ")
                if events == 3:
                    break
        assert core.aborted.wait(5), "a stream whose client left was not aborted"
        core.aborted.clear()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, json={"prompt": "Hi"}, timeout=0.5)
        assert core.aborted.wait(5), "a whole answer whose client left was not aborted"
    finally:
        server.should_exit = True
        thread.join(10)


def test_requests_before_the_model_loaded_get_503_not_an_error_page():
    from fastapi.testclient import TestClient

    from ssd_trt.serve.openai.app import ServerState, create_app
    loaded = threading.Event()

    def load():
        loaded.wait(30)
        return EchoCore()
    with TestClient(create_app(ServerState("echo", load))) as http:
        assert http.get("/health").status_code == 503
        early = http.post("/v1/completions", json={"prompt": "Hi"})
        assert early.status_code == 503 and early.json()["error"]["code"] == "loading"
        loaded.set()


# -- a real server ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def references(smollm2_build) -> dict:
    """In-process greedy outputs, one prompt at a time (computed before the server starts)."""
    gen = ssd_trt.load(smollm2_build)
    greedy = ssd_trt.SamplingParams(max_new_tokens=MAX_TOKENS)
    refs = {("ar", p): gen.generate(p, greedy, mode="ar")[0] for p in PROMPTS}
    refs.update({(mode, p): gen.generate(p, greedy, mode=mode)[0] for mode in ("sd", "ssd") for p in PROMPTS[:2]})
    refs["chat"] = gen.generate(CHAT, greedy, chat=True, mode="ar")[0]
    sampled = ssd_trt.SamplingParams(max_new_tokens=MAX_TOKENS, **SAMPLED)
    refs["sampled"] = gen.generate(PROMPTS[0], sampled, mode="ar")[0]
    refs["prompt_tokens"] = {p: len(gen.encode(p)) for p in PROMPTS}
    refs["chat_prompt_tokens"] = len(gen.encode(CHAT, chat=True))
    scoring = ssd_trt.SamplingParams(max_new_tokens=MAX_TOKENS, logprobs=2, prompt_logprobs=2)
    refs["logprobs"] = gen.generate(PROMPTS[1], scoring, mode="ar")[0]
    refs["chat_logprobs"] = gen.generate(CHAT, scoring, chat=True, mode="ar")[0]
    refs["ids"] = {p: gen.encode(p) for p in PROMPTS}
    return refs


@pytest.fixture(scope="module")
def server(smollm2_build, references, tmp_path_factory):
    log = tmp_path_factory.mktemp("openai") / "server.log"
    proc = OpenAIServer(smollm2_build, free_port(), ["--no-access-log"], log_file=log).start()
    seen = []
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and proc.process.poll() is None:
            status = proc.health()
            if status is not None and (not seen or seen[-1] != status):
                seen.append(status)
            if status == 200:
                break
            time.sleep(0.2)
        proc.wait_ready(timeout=5)
        proc.health_seen = seen
        yield proc
    finally:
        proc.stop()
        assert proc.process is None
        text = log.read_text()
        assert "Traceback" not in text, text[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def metrics(server) -> dict[tuple, float]:
    """Every sample: (name, labels without model_name) -> value, read with Prometheus' own parser."""
    out = {}
    for family in text_string_to_metric_families(server.metrics()):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            out[(sample.name, labels)] = sample.value
    return out


def streamed(stream) -> tuple[str, list, dict | None, object]:
    """Text, finish reasons, the ssd_trt statistics and the usage of a streamed completion or chat."""
    text, reasons, stats, usage = "", [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if (chunk.model_extra or {}).get("ssd_trt") is not None:
            stats = chunk.model_extra["ssd_trt"]
        for choice in chunk.choices:
            text += getattr(choice, "text", None) or (getattr(choice, "delta", None) and choice.delta.content) or ""
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    return text, reasons, stats, usage


@pytest.mark.slow
def test_health_is_503_while_loading_then_200_and_models_lists_the_build(server, client, smollm2_build):
    assert server.health_seen[-1] == 200 and 503 in server.health_seen, server.health_seen
    [model] = client.models.list().data
    assert model.id == smollm2_build.name and model.model_extra["max_model_len"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_completions_equal_generate_in_every_mode(server, client, references, stream):
    for mode in MODES:
        for prompt in PROMPTS[:2]:
            ref = references[(mode, prompt)]
            kwargs = dict(model=server.build_dir.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                          extra_body={"mode": mode})
            if stream:
                text, reasons, stats, usage = streamed(client.completions.create(
                    **kwargs, stream=True, stream_options={"include_usage": True}))
                reason = reasons[-1]
            else:
                out = client.completions.create(**kwargs)
                text, reason, stats, usage = out.choices[0].text, out.choices[0].finish_reason, \
                    out.model_extra["ssd_trt"], out.usage
            assert text == ref.text, (mode, prompt)
            assert reason == ("length" if ref.stats["finish_reason"] == "length" else "stop")
            assert usage.completion_tokens == len(ref.token_ids) == stats["generated_tokens"]
            assert usage.prompt_tokens == references["prompt_tokens"][prompt]
            assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
            assert stats["mode"] == mode and stats["accepted_tokens"] >= 0
            if mode == "sd":                     # SD always drafts: its drafts were verified and counted
                assert stats["speculative_rounds"] > 0 and 0 <= stats["acceptance_rate"] <= 1


@pytest.mark.slow
def test_chat_applies_the_chat_template_streamed_and_not(server, client, references):
    ref = references["chat"]
    messages = [{"role": "user", "content": CHAT}]
    out = client.chat.completions.create(model=server.build_dir.name, messages=messages, max_tokens=MAX_TOKENS,
                                         temperature=0, extra_body={"mode": "ar"})
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == references["chat_prompt_tokens"]
    assert out.usage.completion_tokens == len(ref.token_ids)
    text, reasons, stats, usage = streamed(client.chat.completions.create(
        model=server.build_dir.name, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"mode": "ssd"}))
    assert text == ref.text and len(reasons) == 1 and usage.completion_tokens == len(ref.token_ids)
    assert stats["mode"] == "ssd"
    # the raw event stream: the role first, the usage in a chunk without choices, then [DONE]
    body = {"messages": messages, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    events = [line[len("data: "):] for line in httpx.post(server.url + "/v1/chat/completions", json=body,
                                                          timeout=120).text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_ends_the_text_before_the_stop_string(server, client, references, stream):
    ref = references[("ar", PROMPTS[1])]
    stop = ref.text[len(ref.text) // 2:][:3]                  # three characters from the middle
    kwargs = dict(model=server.build_dir.name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0, stop=[stop],
                  extra_body={"mode": "sd"})
    if stream:
        text, reasons, _, _ = streamed(client.completions.create(**kwargs, stream=True))
        reason = reasons[-1]
    else:
        out = client.completions.create(**kwargs)
        text, reason = out.choices[0].text, out.choices[0].finish_reason
    assert text == ref.text[:ref.text.index(stop)] and reason == "stop", (stop, text)


@pytest.mark.slow
def test_a_seeded_sampled_request_repeats_and_equals_generate(server, client, references):
    texts = [client.completions.create(model=server.build_dir.name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                       extra_body={"mode": "ar"}, **SAMPLED).choices[0].text for _ in range(2)]
    assert texts[0] == texts[1] == references["sampled"].text
    again = [client.completions.create(model=server.build_dir.name, prompt=PROMPTS[2], max_tokens=MAX_TOKENS,
                                       extra_body={"mode": "sd", "draft_len": 2}, **SAMPLED).choices[0].text
             for _ in range(2)]
    assert again[0] == again[1]


@pytest.mark.slow
def test_several_prompts_and_n_are_rows_of_the_batch_each_exact_and_each_with_its_own_seed(server, client,
                                                                                         references):
    model = server.build_dir.name
    out = client.completions.create(model=model, prompt=PROMPTS[:3], max_tokens=MAX_TOKENS, temperature=0,
                                    extra_body={"mode": "ssd"})
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [references[("ar", p)].text for p in PROMPTS[:3]]
    assert out.usage.completion_tokens == sum(len(references[("ar", p)].token_ids) for p in PROMPTS[:3])
    texts: dict[int, str] = {}
    for chunk in client.completions.create(model=model, prompt=PROMPTS[:2], n=2, max_tokens=MAX_TOKENS,
                                           temperature=0, stream=True, extra_body={"mode": "sd"}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    first, second = (references[("ar", p)].text for p in PROMPTS[:2])
    assert [texts[i] for i in range(4)] == [first, first, second, second]
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT}], n=2,
                                          max_tokens=MAX_TOKENS, temperature=0, extra_body={"mode": "ssd"})
    assert [c.message.content for c in chat.choices] == [references["chat"].text] * 2
    # sampled: choice i draws as a request seeded seed + i, whatever shares its batch
    many = client.completions.create(model=model, prompt=PROMPTS[0], n=3, max_tokens=MAX_TOKENS,
                                     extra_body={"mode": "ar"}, **SAMPLED)
    alone = [client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, extra_body={"mode": "ar"},
                                       **{**SAMPLED, "seed": SAMPLED["seed"] + i}).choices[0].text for i in range(3)]
    assert [c.text for c in many.choices] == alone and alone[0] == references["sampled"].text
    assert len(set(alone)) > 1, "three seeds drew the same 16 tokens"


@pytest.mark.slow
def test_langchains_openai_batch_and_chat_model_get_the_greedy_answers(server, references):
    """LangChain's own clients, as users call them: ``OpenAI.batch`` sends its 4 prompts as one request's prompt
    list; ``ChatOpenAI`` sends its own fields (each one this server must know)."""
    langchain_openai = pytest.importorskip("langchain_openai")
    common = dict(base_url=server.url + "/v1", api_key="unused", model=server.build_dir.name, temperature=0,
                  max_tokens=MAX_TOKENS, max_retries=0)
    texts = langchain_openai.OpenAI(**common).batch(PROMPTS)
    assert texts == [references[("ar", p)].text for p in PROMPTS]
    assert langchain_openai.ChatOpenAI(**common).invoke(CHAT).content == references["chat"].text


@pytest.mark.slow
def test_logprobs_and_echo_are_the_targets_own_in_every_mode_streamed_or_not(server, client, references):
    """Completions (``logprobs: 2``; with ``echo`` and ``max_tokens`` 0 or 1: the prompt's too, as lm-eval's
    loglikelihood asks) and chat (``logprobs: true, top_logprobs: 2``): the numbers of the in-process run, in ar and
    ssd, whole and streamed."""
    model, ref = server.build_dir.name, references["logprobs"]
    ids = references["ids"][PROMPTS[1]]
    expected = [e.logprob for e in ref.logprobs]
    for mode in ("ar", "ssd"):
        out = client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0,
                                        logprobs=2, extra_body={"mode": mode})
        lp = out.choices[0].logprobs
        assert out.choices[0].text == ref.text and lp.token_logprobs == pytest.approx(expected, abs=1e-4)
        assert all(len(top) <= 2 and max(top.values()) == pytest.approx(value, abs=1e-4)
                   for top, value in zip(lp.top_logprobs, lp.token_logprobs))          # greedy: the best one
        assert "".join(lp.tokens) == ref.text and lp.text_offset[0] == 0
        streamed: list[float] = []
        for chunk in client.completions.create(model=model, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                               temperature=0, logprobs=2, stream=True, extra_body={"mode": mode}):
            for choice in chunk.choices:
                streamed += choice.logprobs.token_logprobs if choice.logprobs else []
        assert streamed == pytest.approx(expected, abs=1e-4)
    prompt_expected = [None] + [e.logprob for e in ref.prompt_logprobs]
    for max_tokens in (0, 1):           # token ids in, as lm-eval sends them
        out = client.completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0, logprobs=1,
                                        echo=True)
        lp = out.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + max_tokens and lp.token_logprobs[0] is None
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(prompt_expected[1:], abs=1e-4)
        assert out.choices[0].text.startswith(PROMPTS[1]) and out.usage.completion_tokens == max_tokens
        if max_tokens:
            assert lp.token_logprobs[-1] == pytest.approx(expected[0], abs=1e-4)
        else:
            assert out.choices[0].text == PROMPTS[1] and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT}],
                                          max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"mode": "ssd"})
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in references["chat_logprobs"].logprobs],
                                                         abs=1e-4)
    assert all(len(c.top_logprobs) == 2 and bytes(c.bytes) == c.token.encode() for c in content)


BAD_REQUESTS = [   # (what, endpoint, body, the message's beginning, param)
    ("temperature below 0", "completions", {"prompt": "Hi", "max_tokens": 4, "temperature": -0.5},
     "temperature must be a finite number >= 0", "temperature"),
    ("top_p above 1", "completions", {"prompt": "Hi", "max_tokens": 4, "top_p": 1.5}, "top_p must be in (0, 1]",
     "top_p"),
    ("max_tokens 0", "completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens must be >= 1", "max_tokens"),
    ("max_tokens past the context", "chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5000}, "exceeds the engine's max context",
     "max_tokens"),
    ("n of 0", "completions", {"prompt": "Hi", "max_tokens": 4, "n": 0}, "n must be >= 1", "n"),
    ("a prompt list holding a number", "completions", {"prompt": ["Hi", 5], "max_tokens": 4},
     "prompt must be a string, a list of token ids, or a non-empty list of either", "prompt"),
    ("unknown mode", "completions", {"prompt": "Hi", "max_tokens": 4, "mode": "beam"}, "unknown mode 'beam'", "mode"),
    ("draft_len 0", "completions", {"prompt": "Hi", "max_tokens": 4, "mode": "sd", "draft_len": 0},
     "draft_len (K) must be an integer in 1..", "draft_len"),
    ("draft_len for ar", "completions", {"prompt": "Hi", "max_tokens": 4, "mode": "ar", "draft_len": 2},
     "'draft_len' applies to mode sd or ssd, not ar", "draft_len"),
    ("fan_out_budget zero", "completions",
     {"prompt": "Hi", "max_tokens": 4, "mode": "ssd", "draft_len": 3, "fan_out_budget": 0}, "fan_out_budget",
     "fan_out_budget"),
    ("empty messages", "chat/completions", {"messages": [], "max_tokens": 4}, "messages must be a non-empty list",
     "messages"),
    ("unknown role", "chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}], "max_tokens": 4},
     "messages[0].role 'wizard' is not supported", "messages"),
    ("prompt over the context", "completions", {"prompt": "word " * 3000, "max_tokens": 4}, "prompt is",
     "prompt"),
    ("stop neither string nor list", "completions", {"prompt": "Hi", "max_tokens": 4, "stop": 5},
     "stop must be a string or a list of strings", "stop"),
    ("malformed JSON", "completions", b'{"prompt": "Hi", "max_tokens": ', "the request body is not valid JSON", None),
    ("logprobs over 20", "completions", {"prompt": "Hi", "max_tokens": 4, "logprobs": 21},
     "logprobs must be an integer in 0..20", "logprobs"),
    ("top_logprobs without logprobs", "chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "top_logprobs": 2},
     "top_logprobs needs logprobs: true", "top_logprobs"),
    ("echo streamed", "completions", {"prompt": "Hi", "max_tokens": 4, "echo": True, "stream": True},
     "echo is not supported with stream", "echo"),
    ("max_tokens 0 without echo", "completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens must be >= 1",
     "max_tokens"),
    ("an empty prompt", "completions", {"prompt": "   ", "max_tokens": 4}, "prompt is empty", "prompt"),
    # serve/fields.py: a field nobody knows, one of the other endpoint, or one this server does not do
    ("an unknown field", "completions", {"prompt": "Hi", "max_tokens": 4, "frobnicate": 1},
     "'frobnicate' is not a field of /v1/completions; leave it out", "frobnicate"),
    ("a chat field on completions", "completions", {"prompt": "Hi", "max_tokens": 4, "tools": []},
     "'tools' is not a field of /v1/completions (a field of the other endpoint)", "tools"),
    ("min_p above 1", "chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                                           "min_p": 1.5}, "min_p must be a number in [0, 1]", "min_p"),
    ("logit_bias keyed by words", "completions", {"prompt": "Hi", "max_tokens": 4, "logit_bias": {"hello": 5}},
     "logit_bias must map token ids", "logit_bias"),
    ("a JSON schema that is not one", "chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
      "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}},
     "the json grammar is invalid: Invalid type: bogus", "response_format"),
    ("an unknown response_format", "chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                        "max_tokens": 4, "response_format": {"type": "yaml"}},
     "response_format.type must be text, json_object or json_schema", "response_format"),
    ("a regex that does not compile", "completions",
     {"prompt": "Hi", "max_tokens": 4, "structured_outputs": {"regex": "(["}}, "the regex grammar is invalid",
     "structured_outputs"),
    ("two constraints at once", "completions", {"prompt": "Hi", "max_tokens": 4, "guided_regex": "[0-9]+",
                                                "structured_outputs": {"choice": ["a"]}},
     "structured_outputs and guided_regex both constrain the output", "guided_regex"),
    ("a tool_choice naming no tool", "chat/completions",
     {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "tools": [WEATHER],
      "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "tool_choice names 'fly', which is not among the tools (get_weather)", "tool_choice"),
    ("a tool without a name", "chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                   "max_tokens": 4, "tools": [{"type": "function"}]},
     "tools[0] must be", "tools"),
    ("functions (deprecated)", "chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                    "max_tokens": 4, "functions": [WEATHER["function"]]},
     "functions is not supported by this server", "functions"),
    ("stop_token_ids not a list", "completions", {"prompt": "Hi", "max_tokens": 4, "stop_token_ids": 7},
     "stop_token_ids must be a list of token ids", "stop_token_ids"),
]


@pytest.mark.slow
def test_bad_requests_get_400_with_the_openai_error_object_and_the_server_keeps_serving(server, client, references):
    with httpx.Client(base_url=server.url + "/v1", timeout=60) as http:
        for what, endpoint, body, message, param in BAD_REQUESTS:
            r = http.post(f"/{endpoint}", **({"content": body, "headers": {"Content-Type": "application/json"}}
                                              if isinstance(body, bytes) else {"json": body}))
            assert r.status_code == 400, (what, r.status_code, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
            assert error["message"].startswith(message) or message in error["message"], (what, error["message"])
            assert error["param"] == param, (what, error)
            assert "Traceback" not in r.text
        wrong = http.post("/completions", json={"model": "gpt-4o", "prompt": "Hi", "max_tokens": 4})
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
        nowhere = http.get("/nowhere")
        assert nowhere.status_code == 404 and "error" in nowhere.json()
    with pytest.raises(openai.BadRequestError, match="temperature must be"):
        client.completions.create(model=server.build_dir.name, prompt="Hi", max_tokens=4, temperature=-1)
    out = client.completions.create(model=server.build_dir.name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body={"mode": "ar"})
    assert out.choices[0].text == references[("ar", PROMPTS[0])].text
    assert server.health() == 200


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_stop_token_ids_end_the_output_there_and_advisory_fields_are_taken(server, client, references, mode):
    ref = references[("ar", PROMPTS[1])]
    stop_at = ref.token_ids[3]
    kept = ref.token_ids.index(stop_at) + 1             # the stop token is kept in the output, as EOS is
    out = client.completions.create(model=server.build_dir.name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                    temperature=0, user="someone", extra_body={"mode": mode, "stop_token_ids": [stop_at]})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == kept
    assert ref.text.startswith(out.choices[0].text) and len(out.choices[0].text) < len(ref.text)


def wait_for(server, done, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(server)
        if done(values) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


RUNNING = ("ssd_trt:num_requests_running", ())
ABORTED = ("ssd_trt:request_success_total", (("finished_reason", "abort"),))


@pytest.mark.slow
def test_a_client_that_disconnects_mid_stream_frees_its_rows(server, client, references):
    aborted = metrics(server)[ABORTED]
    body = {"prompt": PROMPTS[0], "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "mode": "ar",
            "stream": True}
    events = 0
    with httpx.Client(timeout=120) as http, http.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break                                    # leaving the block closes the connection
    values = wait_for(server, lambda v: v[RUNNING] == 0 and v[ABORTED] == aborted + 1)
    assert values[ABORTED] == aborted + 1 and values[RUNNING] == 0, values
    out = client.completions.create(model=server.build_dir.name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body={"mode": "ar"})
    assert out.choices[0].text == references[("ar", PROMPTS[0])].text


@pytest.mark.slow
def test_16_concurrent_streams_of_mixed_modes_are_exact_and_the_metrics_add_up(server, references):
    before = wait_for(server, lambda v: v[RUNNING] == 0)
    results: list = [None] * 16
    barrier = threading.Barrier(16)

    def one(i: int) -> None:
        prompt, mode = PROMPTS[i % len(PROMPTS)], MODES[i % len(MODES)]
        try:
            own = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
            barrier.wait()
            results[i] = (prompt, mode, *streamed(own.completions.create(
                model=server.build_dir.name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"mode": mode})))
        except Exception as exc:  # noqa: BLE001 -- counted below
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    errors = [r for r in results if isinstance(r, Exception) or r is None]
    assert errors == []
    for prompt, mode, text, reasons, stats, usage in results:
        # greedy output is the target's whatever the mode (every mode is exact), alone or batched
        assert text == references[("ar", prompt)].text, (prompt, mode)
        assert stats["mode"] == mode and usage.completion_tokens == stats["generated_tokens"] and len(reasons) == 1
    after = wait_for(server, lambda v: v[RUNNING] == 0)

    def grew(name: str, labels: tuple = ()) -> float:
        return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)
    assert grew("ssd_trt:generation_tokens_total") == sum(r[-1].completion_tokens for r in results)
    assert grew("ssd_trt:prompt_tokens_total") == sum(r[-1].prompt_tokens for r in results)
    assert grew("ssd_trt:spec_decode_num_accepted_tokens_total") == sum(r[-2]["accepted_tokens"] for r in results)
    assert grew("ssd_trt:spec_decode_num_drafts_total") == sum(r[-2]["speculative_rounds"] for r in results) > 0
    finished = sum(grew("ssd_trt:request_success_total", (("finished_reason", reason),))
                   for reason in ("stop", "length"))
    assert finished == 16 and grew("ssd_trt:time_to_first_token_seconds_count") == 16
    per_pos = sum(grew(name, labels) for name, labels in after if name.endswith("accepted_tokens_per_pos_total"))
    assert per_pos == grew("ssd_trt:spec_decode_num_accepted_tokens_total")
    # every row-round of the adaptive SSD requests is counted under the kind the load policy chose for it
    assert sum(grew("ssd_trt:ssd_adaptive_rounds_total", (("kind", kind),)) for kind in MODES) > 0
    tokens = sum(r[-1].completion_tokens for r in results)
    print(f"\n16 concurrent OpenAI streams x {MAX_TOKENS} tokens (ar/sd/ssd): {tokens / wall:.1f} tok/s, "
          f"wall {wall:.1f}s")


@pytest.mark.slow
def test_metrics_carry_vllms_names_under_the_ssd_trt_prefix(server):
    names = {name for name, _ in metrics(server)}
    for name in ("ssd_trt:num_requests_running", "ssd_trt:num_requests_waiting", "ssd_trt:prompt_tokens_total",
                 "ssd_trt:generation_tokens_total", "ssd_trt:spec_decode_num_drafts_total",
                 "ssd_trt:spec_decode_num_draft_tokens_total", "ssd_trt:spec_decode_num_accepted_tokens_total",
                 "ssd_trt:time_to_first_token_seconds_bucket", "ssd_trt:inter_token_latency_seconds_count",
                 "ssd_trt:request_success_total", "ssd_trt:ssd_cache_lookups_total", "ssd_trt:ssd_cache_hits_total",
                 "ssd_trt:ssd_adaptive_rounds_total"):
        assert name in names, name


def readme_snippet(language: str, marker: str) -> str:
    """The README's "Using it" block in ``language`` that holds ``marker``."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Using it"):readme.index("## Results")]
    blocks = re.findall(rf"```{language}\n(.*?)```", section, re.S)
    [block] = [b for b in blocks if marker in b]
    return block


@pytest.mark.slow
def test_the_readmes_curl_and_openai_snippets_work_as_written(server, tmp_path):
    address = server.url.removeprefix("http://")
    assert "python -m ssd_trt.serve.openai build/smollm2-135m --port 8000" in readme_snippet("bash", "serve.openai")
    curl = readme_snippet("bash", "curl").replace("127.0.0.1:8000", address)
    out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] > 0
    script = tmp_path / "snippet.py"
    script.write_text(readme_snippet("python", "from openai import OpenAI").replace("127.0.0.1:8000", address))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structured_output_is_the_same_json_in_every_mode_and_validates(server, client, stream):
    """response_format json_schema and json_object, vLLM's structured_outputs (regex, choice) and guided_json: greedy,
    every mode gives the same text, and it matches what was asked for."""
    model, messages = server.build_dir.name, [{"role": "user", "content": "Describe a person."}]
    asks = {"json_schema": {"response_format": {"type": "json_schema",
                                                "json_schema": {"name": "person", "schema": PERSON, "strict": True}}},
            "json_object": {"response_format": {"type": "json_object"}},
            "guided_json": {"extra_body": {"guided_json": PERSON}},
            "regex": {"extra_body": {"structured_outputs": {"regex": "[A-Z][a-z]+ is [0-9]{2}"}}},
            "choice": {"extra_body": {"structured_outputs": {"choice": ["red", "green", "blue"]}}}}
    for name, ask in asks.items():
        texts = {}
        for mode in MODES:
            extra = {**ask.get("extra_body", {}), "mode": mode}
            kwargs = dict(model=model, messages=messages, max_tokens=48, temperature=0, extra_body=extra,
                          **{k: v for k, v in ask.items() if k != "extra_body"})
            if stream:
                text, reasons, _, _ = streamed(client.chat.completions.create(stream=True, **kwargs))
                finish = reasons[-1]
            else:
                out = client.chat.completions.create(**kwargs)
                text, finish = out.choices[0].message.content, out.choices[0].finish_reason
            assert finish == "stop", (name, mode, finish, text)
            texts[mode] = text
        assert len(set(texts.values())) == 1, (name, texts)
        text = texts["ar"]
        if name in ("json_schema", "guided_json"):
            jsonschema.validate(json.loads(text), PERSON)
        elif name == "json_object":
            assert isinstance(json.loads(text), dict)
        elif name == "regex":
            assert re.fullmatch(r"[A-Z][a-z]+ is [0-9]{2}", text), text
        else:
            assert text in ("red", "green", "blue")


@pytest.mark.slow
def test_forced_tool_calls_parse_streamed_or_not_and_a_tool_result_goes_back_to_the_model(server, client):
    model = server.build_dir.name
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for choice, name in (("required", None), ({"type": "function", "function": {"name": "add"}}, "add")):
        out = client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0,
                                             tools=[WEATHER, ADD], tool_choice=choice)
        message, finish = out.choices[0].message, out.choices[0].finish_reason
        assert finish == "tool_calls" and message.tool_calls, out
        call = message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_") and (name is None or call.function.name == name)
        arguments = json.loads(call.function.arguments)
        schema = (WEATHER if call.function.name == "get_weather" else ADD)["function"]["parameters"]
        jsonschema.validate(arguments, schema)
        # streamed: the same call, whole in one delta, then finish_reason tool_calls
        calls, finish = [], None
        for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=64, temperature=0,
                                                    tools=[WEATHER, ADD], tool_choice=choice, stream=True):
            for part in chunk.choices:
                calls += part.delta.tool_calls or []
                finish = part.finish_reason or finish
        assert finish == "tool_calls"
        assert [(c.index, c.function.name, c.function.arguments) for c in calls] == \
            [(i, c.function.name, c.function.arguments) for i, c in enumerate(message.tool_calls)]
    # the call and its result go back: the assistant's tool_calls and a tool message are taken
    follow = client.chat.completions.create(model=model, max_tokens=8, temperature=0, messages=[
        *messages, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}], tools=[WEATHER])
    assert follow.choices[0].message.content
    # tool_choice none: the model answers in text (its tools left out of the prompt)
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0,
                                           tools=[WEATHER], tool_choice="none")
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].finish_reason == "length"


@pytest.mark.slow
def test_langchain_structured_output_and_tools_and_litellm_work_as_their_users_call_them(server, monkeypatch):
    """LangChain's ``with_structured_output`` (json_schema, its default) and ``bind_tools`` (here forced: the embedded
    135M model does not choose tools on its own; the real pair's own choice: research/serving/real_pair_clients.py),
    and LiteLLM's ``openai/`` provider: chat, streaming and response_format."""
    langchain_openai = pytest.importorskip("langchain_openai")
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")      # (no network here)
    litellm = pytest.importorskip("litellm")
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int
    model = server.build_dir.name
    chat = langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=model, temperature=0,
                                       max_tokens=48, max_retries=0)
    person = chat.with_structured_output(Person).invoke("Describe a person.")
    assert isinstance(person, Person) and person.name
    # the official client's own structured-output helper (a pydantic model as response_format)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    parsed = parse(model=model, messages=[{"role": "user", "content": "Describe a person."}], response_format=Person,
                   temperature=0, max_tokens=48).choices[0].message.parsed
    assert parsed == person           # (greedy: LangChain sent the same schema)
    message = chat.bind_tools([WEATHER, ADD], tool_choice="required").invoke("What is the weather in Paris?")
    assert message.tool_calls and message.tool_calls[0]["name"] in ("get_weather", "add")
    assert isinstance(message.tool_calls[0]["args"], dict)

    common = dict(model=f"openai/{model}", api_base=server.url + "/v1", api_key="unused", temperature=0,
                  max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": CHAT}])
    whole = litellm.completion(**common).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **common)]
    assert whole and "".join(parts) == whole
    shaped = litellm.completion(**{**common, "max_tokens": 48, "response_format": Person})
    assert Person.model_validate_json(shaped.choices[0].message.content).name
