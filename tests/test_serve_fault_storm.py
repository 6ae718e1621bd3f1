"""A fault storm against a real server process (``tests/fault_server.py``: the OpenAI server over the fault
injector) with real clients (httpx): steps that raise at random, a step thread killed, SIGTERM in the middle of 16
streams. Every stream ends with a final chunk or an error event and then ``[DONE]``, nothing hangs, ``/health`` turns
503 within seconds of the loop dying, and the engine holds nothing afterwards."""
from __future__ import annotations

import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from ssd_trt.serve.process import LOOPBACK, ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
MODES = ("ar", "sd", "ssd")


class FaultServer(ServerProcess):
    name = "the fault-injection server"

    def __init__(self, build: Path, fail_rate: float, grace_s: float, log_file: Path) -> None:
        super().__init__(log_file)
        self.build, self.fail_rate, self.grace_s, self.port = build, fail_rate, grace_s, free_port()
        self.url = f"http://{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tests.fault_server", str(self.build), str(self.port), str(self.fail_rate),
                str(self.grace_s)]

    def health(self) -> int | None:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code
        except httpx.TransportError:
            return None

    def ready(self) -> bool:
        return self.health() == 200

    def held(self) -> dict[str, int]:
        return httpx.get(f"{self.url}/_faults/held", timeout=5).json()


def stream(url: str, prompt: str, max_tokens: int, mode: str) -> dict:
    """One streamed completion read to its end: how it ended ("final" | "error" | "cut") and whether [DONE] came."""
    ended, done = "cut", False
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "mode": mode}
    try:
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"ended": "refused", "status": response.status_code, "done": False}
            for line in response.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        ended = "error"
                    elif any(c.get("finish_reason") for c in event.get("choices", [])):
                        ended = "final"
    except httpx.TransportError:
        pass
    return {"ended": ended, "done": done}


def whole(url: str, prompt: str, max_tokens: int, mode: str) -> int:
    body = {"prompt": prompt, "max_tokens": max_tokens, "mode": mode}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code


def wait_held_nothing(server: FaultServer, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        held = server.held()
        if not any(held.values()) or time.monotonic() > deadline:
            return held


@pytest.fixture(scope="module")
def servers(smollm2_build, tmp_path_factory):
    """Two servers started together: one whose steps fail at random, one for SIGTERM."""
    root = tmp_path_factory.mktemp("faults")
    storm = FaultServer(smollm2_build, 0.1, 30.0, root / "storm.log").start()
    drained = FaultServer(smollm2_build, 0.0, 2.0, root / "drained.log").start()
    try:
        storm.wait_ready(600, 0.5)
        drained.wait_ready(600, 0.5)
        yield storm, drained
    finally:
        storm.stop()
        drained.stop()


@pytest.mark.slow
def test_a_1mb_prompt_is_tokenized_off_the_event_loop_so_the_probes_answer_meanwhile(servers):
    storm, _ = servers
    with ThreadPoolExecutor(1) as pool:
        big = pool.submit(httpx.post, f"{storm.url}/v1/completions", timeout=120,
                          json={"prompt": "hello world, naïve 数学 " * 45000, "max_tokens": 2})
        latencies = []
        while not big.done():
            started = time.perf_counter()
            httpx.get(f"{storm.url}/health", timeout=10)
            latencies.append(time.perf_counter() - started)
            time.sleep(0.02)
        assert big.result().status_code == 400            # longer than the context: refused once tokenized
    assert len(latencies) >= 3 and max(latencies) < 0.25, latencies


@pytest.mark.slow
def test_random_step_failures_end_every_request_and_leave_nothing_held_then_a_dead_loop_fails_health(servers):
    storm, _ = servers
    with ThreadPoolExecutor(24) as pool:
        streams = [pool.submit(stream, storm.url, f"Storm {i}:", 24, MODES[i % 3]) for i in range(24)]
        wholes = [pool.submit(whole, storm.url, f"Whole {i}:", 16, MODES[i % 3]) for i in range(12)]
        ends = [f.result(timeout=120) for f in streams]
        statuses = [f.result(timeout=120) for f in wholes]
    assert all(e["ended"] in ("final", "error") and e["done"] for e in ends), ends
    assert set(statuses) <= {200, 500}, statuses
    assert any(e["ended"] == "error" for e in ends) or 500 in statuses, "no step failed: the storm injected nothing"
    assert wait_held_nothing(storm) == dict.fromkeys(storm.held(), 0)
    assert storm.health() == 200

    httpx.post(f"{storm.url}/_faults/rate", params={"value": 0.0})
    httpx.post(f"{storm.url}/_faults/kill")
    with ThreadPoolExecutor(4) as pool:             # the next step ends the step thread under these streams
        ends = [f.result(timeout=60) for f in [pool.submit(stream, storm.url, f"Killed {i}", 200, "ar")
                                               for i in range(4)]]
    # those the loop took end with an error event; those that came after it died are refused (503)
    assert all((e["ended"] == "error" and e["done"]) or e.get("status") == 503 for e in ends), ends
    assert any(e["ended"] == "error" for e in ends), ends
    started = time.monotonic()
    while storm.health() != 503:
        assert time.monotonic() - started < 5, "/health still answers 200 with a dead loop"
        time.sleep(0.1)
    body = httpx.get(f"{storm.url}/health").json()
    assert body["status"] == "dead" and "StepThreadKilled" in body["detail"]
    refused = httpx.post(f"{storm.url}/v1/completions", json={"prompt": "after", "max_tokens": 2})
    assert refused.status_code == 503
    assert wait_held_nothing(storm) == dict.fromkeys(storm.held(), 0)


@pytest.mark.slow
def test_a_client_that_stops_reading_its_socket_holds_up_no_other_stream_and_ends_cleanly(servers):
    """A real socket with a small receive window reads its response headers, then nothing, while a 1,900-token stream
    is made for it: a stream beside it still finishes, the engine lets go of both, and when the client reads again its
    stream ends properly (the final chunk, or the SlowReader error event once 256 chunks waited unread) and
    ``[DONE]``. On loopback the kernel grows the server's send buffer to megabytes, so here the whole stream fits in
    it; the SlowReader end itself is asserted in-process (``test_serve_faults.py``)."""
    _, server = servers
    body = json.dumps({"prompt": "Count:", "max_tokens": 1900, "stream": True, "mode": "ar", "ignore_eos": True})
    stuck = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)      # before connect: the window stays small
    stuck.connect((LOOPBACK, server.port))
    stuck.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    head = stuck.recv(64)
    assert head.startswith(b"HTTP/1.1 200"), head
    with ThreadPoolExecutor(1) as pool:
        beside = pool.submit(stream, server.url, "Beside:", 24, "ar")
        assert beside.result(timeout=60) == {"ended": "final", "done": True}
    started = time.monotonic()
    while any(server.held().values()):              # nobody reads the stuck stream, yet the engine lets go of it
        assert time.monotonic() - started < 120, f"a stuck reader's request still held: {server.held()}"
        time.sleep(0.2)
    stuck.settimeout(30)
    received = bytearray()
    while not (b"data: [DONE]" in received and received.endswith(b"0\r\n\r\n")):    # chunked: its last chunk
        more = stuck.recv(1 << 16)
        assert more, f"the connection closed without [DONE]: {bytes(received[-500:])!r}"
        received += more
    stuck.close()
    events = [json.loads(line[6:]) for line in received.decode("utf-8", "replace").splitlines()
              if line.startswith("data: {")]
    last = events[-1]
    if "error" in last:
        assert "too slowly" in last["error"]["message"], last
    else:
        assert last["choices"][0]["finish_reason"] == "length", last


@pytest.mark.slow
def test_sigterm_during_16_streams_ends_every_stream_with_a_final_chunk_or_an_error(servers):
    _, drained = servers
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(stream, drained.url, f"Drained {i}:", 8 if i % 4 == 0 else 400, MODES[i % 3])
                   for i in range(16)]
        time.sleep(1.0)                                   # the streams are running
        drained.process.send_signal(15)
        ends = [f.result(timeout=60) for f in futures]
    assert all(e["ended"] in ("final", "error") and e["done"] for e in ends), ends
    assert drained.process.wait(30) in (0, -15)          # uvicorn re-raises the signal once it has shut down
