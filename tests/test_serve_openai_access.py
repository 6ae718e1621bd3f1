"""Who may ask the OpenAI server for what, and what it counts: a real ``python -m ssd_trt.serve.openai`` process serving
the embedded build under several names (``--served-model-name``), with an API key from ``SSD_TRT_API_KEY``, one row
and one waiting slot, driven by the official ``openai`` client and scraped with Prometheus' own parser.
"""
from __future__ import annotations

import os
import threading

import httpx
import pytest

from ssd_trt.serve.openai.auth import ENV_KEY, api_key
from ssd_trt.serve.openai.process import OpenAIServer
from ssd_trt.serve.process import free_port
from tests.test_serve_openai import metrics   # /metrics is open: read without a key

openai = pytest.importorskip("openai")

KEY = "sk-test-8c1d"
NAMES = ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2")      # reported, alias
PROMPT = "The capital of France is"


class KeyedServer(OpenAIServer):
    """The server with its key in the environment, as a Kubernetes Secret gives it."""

    def environment(self) -> dict[str, str]:
        return {**os.environ, ENV_KEY: KEY}


@pytest.fixture(scope="module")
def server(smollm2_build, tmp_path_factory):
    log = tmp_path_factory.mktemp("openai-access") / "server.log"
    args = ["--no-access-log", "--no-warmup", "--served-model-name", *NAMES, "--max-batch-rows", "1",
            "--max-waiting", "1"]
    with KeyedServer(smollm2_build, free_port(), args, log_file=log) as proc:
        yield proc
    text = log.read_text()      # refusals (a full queue included) are counted, not logged as tracebacks
    assert "Traceback" not in text and "could not be taken" not in text, text[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def rejected(server, reason: str) -> float:
    return metrics(server)[("ssd_trt:request_rejected_total", (("reason", reason),))]


def test_the_flag_wins_over_the_environment_and_an_empty_key_is_none(monkeypatch):
    monkeypatch.setenv(ENV_KEY, "from-env")
    assert api_key("from-flag") == "from-flag" and api_key(None) == "from-env"
    monkeypatch.setenv(ENV_KEY, "")
    assert api_key(None) is None


@pytest.mark.slow
def test_an_api_key_guards_every_v1_route_and_leaves_health_and_metrics_open(server, client):
    before = rejected(server, "unauthorized")
    for key in ("wrong", None):
        stranger = openai.OpenAI(base_url=server.url + "/v1", api_key=key or "unused", max_retries=0,
                                 default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as refused:
            stranger.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=2)
        assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            stranger.models.list()
    bare = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
    assert bare.status_code == 401 and bare.headers["WWW-Authenticate"] == "Bearer"
    assert set(bare.json()["error"]) == {"message", "type", "param", "code"} and "Bearer" in bare.json()["error"][
        "message"]
    assert httpx.get(server.url + "/health").status_code == 200            # probes and Prometheus carry no key
    assert rejected(server, "unauthorized") == before + 5
    answer = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=2)
    assert answer.usage.completion_tokens == 2


@pytest.mark.slow
def test_any_served_name_is_accepted_and_the_first_is_reported(server, client):
    assert [model.id for model in client.models.list().data] == [NAMES[0]]
    for name in NAMES:
        assert client.completions.create(model=name, prompt=PROMPT, max_tokens=2).model == NAMES[0]
        stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=2, stream=True)
        assert {chunk.model for chunk in stream} == {NAMES[0]}
    before = rejected(server, "model_not_found")
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4o", prompt=PROMPT, max_tokens=2)
    assert missing.value.body["code"] == "model_not_found" and NAMES[1] in missing.value.body["message"]
    assert rejected(server, "model_not_found") == before + 1


@pytest.mark.slow
def test_bad_and_over_capacity_requests_are_counted_by_reason(server, client):
    before = {reason: rejected(server, reason) for reason in ("bad_request", "queue_full")}
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=2, temperature=-1)
    # one row, one waiting slot: while the first request runs, of two more at least one is refused
    body = dict(model=NAMES[0], prompt=PROMPT, extra_body={"mode": "ar", "ignore_eos": True})
    running = client.completions.create(stream=True, max_tokens=200, **body)
    next(iter(running))
    statuses = []

    def short() -> None:
        try:
            statuses.append(client.completions.create(max_tokens=2, **body) and 200)
        except openai.APIStatusError as exc:
            statuses.append((exc.status_code, exc.body["code"]))
    others = [threading.Thread(target=short) for _ in range(2)]
    for thread in others:
        thread.start()
    for thread in others:
        thread.join(60)
    running.close()
    assert (503, "queue_full") in statuses and len(statuses) == 2, statuses
    after = {reason: rejected(server, reason) for reason in before}
    assert after["bad_request"] == before["bad_request"] + 1 and after["queue_full"] >= before["queue_full"] + 1


@pytest.mark.slow
def test_kv_cache_usage_is_the_running_requests_share_of_the_cache_and_zero_when_idle(server, client):
    [card] = client.models.list().data
    context = card.model_extra["max_model_len"]
    max_tokens = 100
    stream = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=max_tokens, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"mode": "ar", "ignore_eos": True})
    chunks = iter(stream)
    next(chunks)
    during = metrics(server)[("ssd_trt:kv_cache_usage_perc", ())]
    usage = [chunk.usage for chunk in chunks if chunk.usage is not None][-1]
    # one row of a dense cache: the request reserves its prompt and every token it may generate (mode ar: no
    # speculation headroom) of the one row's max context
    assert during == pytest.approx((usage.prompt_tokens + max_tokens) / context)
    assert 0 < during <= 1
    assert metrics(server)[("ssd_trt:kv_cache_usage_perc", ())] == 0.0
