"""Triton serving: a real CPU tritonserver (nvidia-pytriton wheel) on 127.0.0.1 serving the embedded pair.

The serving venv (numpy<2, nvidia-pytriton, tritonclient) is created on first use (~1 minute); clients run
in that venv as subprocesses, since tritonclient is not part of the main environment.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import ssd_trt
from ssd_trt.detokenize import Detokenizer
from ssd_trt.serve.structured import from_structured_outputs
from ssd_trt.serve.triton.repository import ExportOptions, export_repository

ROOT = Path(__file__).resolve().parents[1]
MAX_TOKENS = 16
MODES = ("ar", "sd", "ssd")
STRUCTURED = {"regex": " (Paris|Lyon|Nice)[.,] [A-Z][a-z]{1,8}"}   # vLLM's structured_outputs object
EXACT_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
CONCURRENT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
CONCURRENCY = 32
SAMPLED = dict(temperature=0.8, top_k=50, top_p=0.95, seed=7)
# greedy and sampled, ar and ssd, different lengths (a sampled SSD request's draws depend on the load: its
# load policy picks each round's kind from measured times, so only its length is checked), and a greedy SD request:
# it always drafts, so the acceptance gauges move whatever the adaptive SSD requests' policy chose
MIXED = [{"prompt": p, "max_tokens": n, "mode": m, "temperature": t, "top_p": 0.95 if t else 1.0,
          "seed": 40 + i if t else None}
         for i, (p, n, m, t) in enumerate([(CONCURRENT_PROMPTS[0], 16, "ar", 0.0), (CONCURRENT_PROMPTS[1], 30, "ssd", 0.0),
                                           (CONCURRENT_PROMPTS[2], 24, "ar", 0.8), (CONCURRENT_PROMPTS[3], 12, "ssd", 0.7),
                                           (CONCURRENT_PROMPTS[0], 28, "ssd", 0.0), (CONCURRENT_PROMPTS[1], 20, "ar", 0.0),
                                           (CONCURRENT_PROMPTS[2], 18, "ssd", 0.0), (CONCURRENT_PROMPTS[3], 26, "ar", 0.7),
                                           (CONCURRENT_PROMPTS[2], 22, "sd", 0.0)])]
# per-request decoding options (Triton inputs draft_len, tree_widths, fan_out_budget, backup; the client's flags)
OPTIONS = {"sd tree": (["--mode", "sd", "--tree-widths", "2,2"], ssd_trt.SD(tree_widths=(2, 2))),
           "sd K=3": (["--mode", "sd", "--draft-len", "3"], ssd_trt.SD(draft_len=3)),
           "ssd K=2": (["--mode", "ssd", "--draft-len", "2", "--fan-out-budget", "4", "--backup", "ngram"],
                       ssd_trt.SSD(draft_len=2, fan_out_budget=4, backup="ngram"))}


# -- pieces that need no server ------------------------------------------------------------------
def test_detokenizer_pieces_concatenate_to_the_final_text():
    pieces = {1: "Hel", 2: "lo", 3: "\ufffd", 4: " w\u00e9"}
    decode = lambda ids: "".join(pieces[i] for i in ids).replace("\ufffd w", " w")   # noqa: E731
    detok = Detokenizer(decode)
    sent = [detok.push([1]), detok.push([2]), detok.push([3]), detok.push([4])]
    assert sent[2] == ""                                   # held back: incomplete character
    assert "".join(sent) + detok.finish("Hello w\u00e9") == "Hello w\u00e9"


def test_triton_metrics_export_the_shared_catalogue_beside_the_legacy_gauges():
    """Counters grow by what the totals grew, gauges are set, histograms replay their new observations, and a family
    the backend refuses (an older Triton without histograms) is logged once while the others still export."""
    from ssd_trt.batching.metrics import EngineMetrics
    from ssd_trt.serve.metrics import ServingMetrics, families
    from ssd_trt.serve.triton.metrics import TritonMetrics

    class Metric:
        def __init__(self, labels, buckets=None):
            self.labels, self.buckets, self.value, self.observed = labels, buckets, 0.0, []

        def increment(self, by):
            self.value += by

        def set(self, value):
            self.value = value

        def observe(self, value):
            self.observed.append(value)

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
        made: dict = {}

        def __init__(self, name, description, kind):
            if kind == "histogram" and name.endswith("e2e_request_latency_seconds"):
                raise ValueError("no histograms here")
            self.name, self.kind, self.metrics = name, kind, []
            MetricFamily.made[name] = self

        def Metric(self, labels, buckets=None):        # noqa: N802 -- pb_utils' name
            self.metrics.append(Metric(labels, buckets))
            return self.metrics[-1]

    logged: list[str] = []
    exporter = TritonMetrics(SimpleNamespace(MetricFamily=MetricFamily), "ssd_trt", logged.append)
    engine, serving = EngineMetrics(), ServingMetrics()
    engine.accepted, engine.drafted, engine.speculative_rounds, engine.waiting = 5, 8, 4, 2
    engine.accepted_per_pos.update({0: 3, 1: 2})
    serving.ttft.observe(0.2)
    serving.e2e.observe(1.0)
    exporter.update(engine, families(engine, serving))
    engine.accepted += 3
    serving.ttft.observe(0.4)
    exporter.update(engine, families(engine, serving))
    made = MetricFamily.made
    [accepted] = made["ssd_trt:spec_decode_num_accepted_tokens_total"].metrics
    assert accepted.value == 8 and accepted.labels == {"model": "ssd_trt"}
    assert made["ssd_trt:num_requests_waiting"].metrics[0].value == 2
    per_pos = made["ssd_trt:spec_decode_num_accepted_tokens_per_pos_total"].metrics
    assert {m.labels["position"]: m.value for m in per_pos} == {"0": 3, "1": 2}
    [ttft] = made["ssd_trt:time_to_first_token_seconds"].metrics
    assert ttft.observed == [0.2, 0.4] and ttft.buckets
    assert made["ssd_trt_acceptance_rate"].metrics[0].value == 8 / 8     # the legacy gauges, as before
    assert len(logged) == 1 and "e2e_request_latency_seconds" in logged[0]


def test_export_writes_two_models_with_trtllm_tensor_names(smollm2_build, tmp_path):
    repo = export_repository(smollm2_build, tmp_path / "repo", ExportOptions(max_batch_rows=2))
    stream, plain = (repo / "ssd_trt" / "config.pbtxt").read_text(), \
        (repo / "ssd_trt_nonstream" / "config.pbtxt").read_text()
    assert "decoupled: true" in stream and "decoupled: false" in plain
    for name in ("text_input", "max_tokens", "temperature", "top_p", "top_k", "random_seed", "stream", "mode",
                 "draft_len", "fan_out_budget", "backup", "tree_widths", "text_output", "output_ids",
                 "accepted_tokens", "cache_hit_rate"):
        assert f'name: "{name}"' in stream
    assert str(smollm2_build.resolve()) in stream and (repo / "ssd_trt" / "1" / "model.py").is_file()
    with pytest.raises(ssd_trt.errors.SsdTrtError, match="max_batch_rows must be in 0..16"):
        export_repository(smollm2_build, tmp_path / "bad", ExportOptions(max_batch_rows=99))
    # no CUDA device here, so the default (auto) serves on CPU; a GPU runtime is asked for explicitly
    assert "kind: KIND_CPU" in stream
    gpu = export_repository(smollm2_build, tmp_path / "gpu", ExportOptions(runtime_options={"backend": "torch"}))
    assert "kind: KIND_GPU" in (gpu / "ssd_trt" / "config.pbtxt").read_text()
    assert "kind: KIND_GPU" in export_repository(smollm2_build, tmp_path / "gpu2", ExportOptions(instance_kind="gpu")
                                                 ).joinpath("ssd_trt", "config.pbtxt").read_text()


# -- the serving venv -----------------------------------------------------------------------------
@pytest.mark.slow
def test_serving_venv_layers_over_the_environment_running_ssd_trt(tmp_path):
    """From a virtualenv (how CI and most users run), the server's python sees this environment's torch and
    ssd_trt, with its own numpy < 2 first (venv --system-site-packages would see only the base interpreter's)."""
    from ssd_trt.serve.triton.environment import ensure_env, main_site_dirs
    env = ensure_env()
    probe = "import numpy, torch, ssd_trt; print(numpy.__version__); print(torch.__file__); print(ssd_trt.__file__)"
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([str(env.python), "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                          env=clean, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    numpy_version, torch_file, ssd_trt_file = proc.stdout.split()
    assert int(numpy_version.split(".")[0]) < 2
    assert any(Path(torch_file).is_relative_to(d) for d in main_site_dirs()), (torch_file, main_site_dirs())
    assert Path(ssd_trt_file).resolve().is_relative_to(ROOT)


# -- a real server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def references(smollm2_build) -> dict[tuple[str, str], list[int]]:
    """In-process ``ssd_trt`` greedy outputs, one prompt at a time (computed before the server starts)."""
    gen = ssd_trt.load(smollm2_build)
    params = ssd_trt.SamplingParams(max_new_tokens=MAX_TOKENS)
    refs = {(mode, p): gen.generate(p, params, mode=mode)[0] for mode in MODES for p in EXACT_PROMPTS}
    refs.update({("ssd", p): gen.generate(p, params, mode="ssd")[0]
                 for p in CONCURRENT_PROMPTS if ("ssd", p) not in refs})
    as_fp32 = {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in SAMPLED.items()}  # wire type
    sampled = ssd_trt.SamplingParams(max_new_tokens=MAX_TOKENS, **as_fp32)
    refs[("sampled", EXACT_PROMPTS[0])] = gen.generate(EXACT_PROMPTS[0], sampled, mode="ar")[0]
    for name, (_, settings) in OPTIONS.items():
        refs[(name, EXACT_PROMPTS[1])] = gen.generate(EXACT_PROMPTS[1], params, mode=settings)[0]
    for spec in MIXED:                    # each mixed request alone (greedy, or sampled AR with its seed)
        params = ssd_trt.SamplingParams(max_new_tokens=spec["max_tokens"], temperature=spec["temperature"],
                                        top_p=float(np.float32(spec["top_p"])), seed=spec["seed"])
        refs[("mixed", spec["prompt"], spec["max_tokens"])] = gen.generate(spec["prompt"], params,
                                                                            mode=spec["mode"])[0]
    shaped = ssd_trt.SamplingParams(max_new_tokens=MAX_TOKENS, grammar=from_structured_outputs(STRUCTURED))
    refs[("structured", EXACT_PROMPTS[0])] = gen.generate(EXACT_PROMPTS[0], shaped, mode="ar")[0]
    return {key: (r.text, r.token_ids) for key, r in refs.items()}


@pytest.fixture(scope="module")
def server(smollm2_build, references, tmp_path_factory):
    from ssd_trt.serve.triton.environment import ensure_env
    from ssd_trt.serve.triton.server import ServerConfig, TritonServer, free_port

    env = ensure_env()
    root = tmp_path_factory.mktemp("triton")
    repo = export_repository(smollm2_build, root / "repo")
    triton = TritonServer(ServerConfig(repo, free_port(), free_port(), free_port(), log_file=root / "tritonserver.log"),
                          env)
    try:
        triton.start().wait_ready(timeout=600)
        yield triton
    finally:
        triton.stop()
        assert triton.process is None


def client(server, *args: str, timeout: float = 900) -> list[dict]:
    """Run the example client as a user does (`python -m ssd_trt.serve.triton client ...`, which runs it in
    the serving venv); its JSON lines."""
    proc = subprocess.run([sys.executable, "-m", "ssd_trt.serve.triton", "client", "--venv", str(server.env.venv),
                           *args, "--http-url", server.http_url, "--grpc-url", server.grpc_url],
                          cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"client printed no JSON (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_greedy_over_triton_equals_generate(server, references, protocol):
    args = ["generate", "--protocol", protocol, "--max-tokens", str(MAX_TOKENS), "--json"]
    for mode in MODES:
        args += ["--mode", mode]
    for prompt in EXACT_PROMPTS:
        args += ["--prompt", prompt]
    results = client(server, *args)
    assert len(results) == len(MODES) * len(EXACT_PROMPTS)
    for r in results:
        assert r["error"] is None, r
        text, ids = references[(r["mode"], r["prompt"])]
        assert r["token_ids"] == ids, (r["mode"], r["prompt"])
        assert r["text"] == text
        assert r["stats"]["generated_tokens"] == len(ids)
        if protocol == "grpc":
            assert r["chunks"] >= 1                          # streamed, then a final response
        stats = r["stats"]
        if r["mode"] == "sd":
            assert stats["accepted_tokens"] >= 0 and 0 <= stats["acceptance_rate"] <= 1
        elif r["mode"] == "ssd":   # adaptive: its load policy may have run only AR rounds (nothing drafted)
            assert stats["accepted_tokens"] >= 0
            assert stats["accepted_tokens"] == 0 if stats["acceptance_rate"] is None else \
                0 <= stats["acceptance_rate"] <= 1


@pytest.mark.slow
def test_per_request_decoding_options_over_triton_equal_generate_with_them(server, references):
    """K, SD's token tree, SSD's budget and backup set per request through the model's inputs: the greedy tokens
    are the target's (every setting is exact), and the request ran as set: its drafts were verified."""
    for name, (flags, _) in OPTIONS.items():
        [r] = client(server, "generate", "--protocol", "http", "--prompt", EXACT_PROMPTS[1], "--max-tokens",
                     str(MAX_TOKENS), *flags, "--json")
        assert r["error"] is None, (name, r["error"])
        assert (r["text"], r["token_ids"]) == references[(name, EXACT_PROMPTS[1])], name
        assert r["token_ids"] == references[("ar", EXACT_PROMPTS[1])][1], name
        assert r["stats"]["acceptance_rate"] is not None and r["stats"]["accepted_tokens"] > 0, (name, r["stats"])


@pytest.mark.slow
def test_structured_outputs_over_triton_is_the_grammars_output_in_every_mode(server, references):
    text, ids = references[("structured", EXACT_PROMPTS[0])]
    assert re.fullmatch(STRUCTURED["regex"], text), text          # (the grammar complete: it stopped there)
    for mode in MODES:
        [r] = client(server, "raw", json.dumps([["text_input", "BYTES", EXACT_PROMPTS[0]],
                                                ["max_tokens", "INT32", MAX_TOKENS], ["mode", "BYTES", mode],
                                                ["structured_outputs", "BYTES", json.dumps(STRUCTURED)]]),
                     "--protocol", "http")
        assert r["error"] is None and (r["text"], r["token_ids"]) == (text, ids), (mode, r)


@pytest.mark.slow
def test_seeded_sampling_over_triton_equals_generate(server, references):
    [r] = client(server, "generate", "--protocol", "http", "--mode", "ar", "--prompt", EXACT_PROMPTS[0],
                 "--max-tokens", str(MAX_TOKENS), "--temperature", str(SAMPLED["temperature"]),
                 "--top-k", str(SAMPLED["top_k"]), "--top-p", str(SAMPLED["top_p"]), "--seed", str(SAMPLED["seed"]),
                 "--json")
    assert r["error"] is None and (r["text"], r["token_ids"]) == references[("sampled", EXACT_PROMPTS[0])]


@pytest.mark.slow
def test_32_concurrent_streams_match_one_at_a_time(server, references, tmp_path_factory):
    args = ["bench", "--concurrency", str(CONCURRENCY), "--max-tokens", str(MAX_TOKENS), "--mode", "ssd", "--full"]
    for prompt in CONCURRENT_PROMPTS:
        args += ["--prompt", prompt]
    [summary] = client(server, *args)
    assert summary["errors"] == []
    results = summary.pop("results")
    assert len(results) == CONCURRENCY
    for i, r in enumerate(results):
        text, ids = references[("ssd", CONCURRENT_PROMPTS[i % len(CONCURRENT_PROMPTS)])]
        assert (r["token_ids"], r["text"]) == (ids, text), i
    print(f"\n{CONCURRENCY} concurrent gRPC streams x {MAX_TOKENS} tokens (ssd): "
          f"{summary['throughput_tok_s']:.1f} tok/s, p50 {summary['latency_p50_s']:.2f}s, "
          f"p99 {summary['latency_p99_s']:.2f}s, wall {summary['wall_s']:.1f}s")
    (tmp_path_factory.getbasetemp() / "triton-bench.json").write_text(json.dumps(summary, indent=1))


@pytest.mark.slow
def test_the_bench_client_over_plain_http_shares_rounds_exactly(server, references):
    """The load bench's mixed workload goes over plain HTTP to the non-streaming model: concurrent clients there share
    rounds too, and greedy / seeded AR requests give what they give alone."""
    specs = [spec for spec in MIXED if spec["temperature"] == 0 or spec["mode"] == "ar"][:4]
    [summary] = client(server, "bench", "--protocol", "http", "--specs", json.dumps(specs), "--concurrency",
                       str(len(specs)), "--full")
    assert summary["errors"] == [] and summary["requests"] == len(specs)
    for spec, r in zip(specs, summary["results"]):
        text, ids = references[("mixed", spec["prompt"], spec["max_tokens"])]
        assert (r["token_ids"], r["text"]) == (ids, text), spec


@pytest.mark.slow
def test_mixed_requests_share_rounds_exactly_and_the_engine_metrics_are_exported(server, references):
    """9 requests of different modes, temperatures and lengths, sent at once, run in shared rounds (continuous
    batching): greedy and seeded sampled AR requests give what they give alone; the engine's gauges report."""
    [summary] = client(server, "bench", "--specs", json.dumps(MIXED), "--concurrency", str(len(MIXED)), "--full")
    assert summary["errors"] == []
    for spec, r in zip(MIXED, summary["results"]):
        text, ids = references[("mixed", spec["prompt"], spec["max_tokens"])]
        if spec["temperature"] == 0 or spec["mode"] == "ar":
            assert (r["token_ids"], r["text"]) == (ids, text), spec
        else:
            assert 0 < len(r["token_ids"]) <= spec["max_tokens"]
    # the sender thread exports the metrics every 0.5 s and before each final response, so they may trail the
    # last response by a moment: read until the acceptance gauge shows the SD request's rounds
    deadline = time.monotonic() + 10
    while True:
        metrics = engine_metrics(server)
        if metrics.get("ssd_trt_acceptance_rate", 0) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert set(metrics) == {"ssd_trt_acceptance_rate", "ssd_trt_mean_accepted_length", "ssd_trt_cache_hit_rate",
                            "ssd_trt_active_batch", "ssd_trt_running_requests", "ssd_trt_waiting_requests",
                            "ssd_trt_aborted_requests_total"}, metrics
    hit_rate = metrics["ssd_trt_cache_hit_rate"]     # NaN until an SSD round has looked its cache up
    assert 0 < metrics["ssd_trt_acceptance_rate"] <= 1 and (np.isnan(hit_rate) or 0 <= hit_rate <= 1)
    assert metrics["ssd_trt_mean_accepted_length"] > 0 and metrics["ssd_trt_waiting_requests"] == 0
    # and the catalogue both frontends export (serve/metrics.py), vLLM's names under ssd_trt:, histograms included
    lines = [line for line in server.metrics().splitlines() if 'model="ssd_trt"' in line]
    for name in ("ssd_trt:num_requests_waiting", "ssd_trt:generation_tokens_total",
                 "ssd_trt:spec_decode_num_accepted_tokens_total", "ssd_trt:request_success_total",
                 "ssd_trt:spec_decode_num_accepted_tokens_per_pos_total", "ssd_trt:ssd_adaptive_rounds_total",
                 "ssd_trt:time_to_first_token_seconds_count", "ssd_trt:inter_token_latency_seconds_bucket"):
        assert any(line.startswith(name + "{") for line in lines), name
    [ttft] = [line for line in lines if line.startswith("ssd_trt:time_to_first_token_seconds_count{")]
    assert float(ttft.rsplit(" ", 1)[1]) >= len(MIXED)



def engine_metrics(server) -> dict[str, float]:
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in server.metrics().splitlines()
            if line.startswith("ssd_trt_") and 'model="ssd_trt"' in line}


@pytest.mark.slow
def test_a_cancelled_stream_is_aborted_and_the_next_request_is_exact(server, references):
    """A client that cancels its streaming request mid-generation (1500 tokens asked, cancelled after 2 chunks):
    the engine aborts it -- the aborted-requests counter grows by one, nothing is left running -- and the next
    request is exact."""
    aborted_before = engine_metrics(server).get("ssd_trt_aborted_requests_total", 0.0)
    [r] = client(server, "generate", "--protocol", "grpc", "--mode", "ar", "--prompt", EXACT_PROMPTS[0],
                 "--max-tokens", "1500", "--ignore-eos", "--cancel-after", "2", "--json")
    assert r["error"].startswith("cancelled by this client") and 2 <= len(r["token_ids"]) < 1500, r
    deadline = time.monotonic() + 60          # the abort takes a round or two (cancellations are polled every 0.1 s)
    while True:
        metrics = engine_metrics(server)
        if metrics["ssd_trt_aborted_requests_total"] == aborted_before + 1 and \
                metrics["ssd_trt_running_requests"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert metrics["ssd_trt_aborted_requests_total"] == aborted_before + 1, metrics
    assert metrics["ssd_trt_running_requests"] == 0, metrics
    [after] = client(server, "generate", "--protocol", "grpc", "--mode", "ar", "--prompt", EXACT_PROMPTS[0],
                     "--max-tokens", str(MAX_TOKENS), "--json")
    assert (after["text"], after["token_ids"]) == references[("ar", EXACT_PROMPTS[0])]


TRITON_REFUSES = ("missing input", "wrong dtype")     # checked by Triton against config.pbtxt, before the backend
BAD_REQUESTS = [
    ("missing input", [["text_input", "BYTES", "Hello"]], "missing required input"),
    ("wrong dtype", [["text_input", "BYTES", "Hello"], ["max_tokens", "FP32", 4.0]], "expects 'INT32'"),
    ("negative max_tokens", [["text_input", "BYTES", "Hello"], ["max_tokens", "INT32", -3]], "max_tokens must be"),
    ("negative temperature", [["text_input", "BYTES", "Hello"], ["max_tokens", "INT32", 4],
                              ["temperature", "FP32", -0.5]], "temperature must be"),
    ("unknown mode", [["text_input", "BYTES", "Hello"], ["max_tokens", "INT32", 4], ["mode", "BYTES", "beam"]],
     "unknown mode 'beam'"),
    ("prompt over max context", [["text_input", "BYTES", "word " * 3000], ["max_tokens", "INT32", 4]],
     "max context"),
    ("tree for ssd", [["text_input", "BYTES", "Hello"], ["max_tokens", "INT32", 4], ["mode", "BYTES", "ssd"],
                      ["tree_widths", "INT32", [2, 2]]], "input 'tree_widths' applies to mode sd, not ssd"),
    ("K for ar", [["text_input", "BYTES", "Hello"], ["max_tokens", "INT32", 4], ["mode", "BYTES", "ar"],
                  ["draft_len", "INT32", 2]], "input 'draft_len' applies to mode sd or ssd, not ar"),
    ("K zero", [["text_input", "BYTES", "Hello"], ["max_tokens", "INT32", 4], ["mode", "BYTES", "sd"],
                ["draft_len", "INT32", 0]], "draft_len (K) must be an integer in 1.."),
    ("unknown backup", [["text_input", "BYTES", "Hello"], ["max_tokens", "INT32", 4], ["backup", "BYTES", "oracle"]],
     "backup must be auto, jit or ngram"),
    ("a regex that does not compile", [["text_input", "BYTES", "Hello"], ["max_tokens", "INT32", 4],
                                       ["structured_outputs", "BYTES", '{"regex": "(["}']],
     "the regex grammar is invalid"),
    ("structured_outputs not JSON", [["text_input", "BYTES", "Hello"], ["max_tokens", "INT32", 4],
                                     ["structured_outputs", "BYTES", "{regex"]],
     "input 'structured_outputs' is not valid JSON"),
]


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(server, references, protocol):
    """Every bad request, then a good one, sent one after another by one client; the backend's refusals are
    counted as bad requests (what Triton refuses against the model's config never reaches the backend)."""
    before = rejected(server, "bad_request")
    good = [["text_input", "BYTES", EXACT_PROMPTS[0]], ["max_tokens", "INT32", MAX_TOKENS], ["mode", "BYTES", "ar"],
            ["stream", "BOOL", protocol == "grpc"]]
    *answers, r = client(server, "raw", *(json.dumps(tensors) for _, tensors, _ in BAD_REQUESTS), json.dumps(good),
                         "--protocol", protocol)
    assert len(answers) == len(BAD_REQUESTS)
    for (what, _, message), answer in zip(BAD_REQUESTS, answers):
        assert answer["error"] and message in answer["error"], (what, answer["error"])
        assert "Traceback" not in answer["error"]
    assert r["error"] is None and r["token_ids"] == references[("ar", EXACT_PROMPTS[0])][1]
    assert server.ready()
    ours = len(BAD_REQUESTS) - len(TRITON_REFUSES)
    deadline = time.monotonic() + 10        # exported by the sender thread every 0.5 s and before final responses
    while rejected(server, "bad_request") < before + ours and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rejected(server, "bad_request") == before + ours


def rejected(server, reason: str) -> float:
    """``ssd_trt:request_rejected_total`` for ``reason`` on Triton's metrics port, summed over the two models (the
    streaming one and its ``_nonstream`` twin; 0 before the first export)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in server.metrics().splitlines()
               if line.startswith("ssd_trt:request_rejected_total{") and f'reason="{reason}"' in line)


def test_a_streamed_request_never_shows_the_beginning_of_its_stop_string():
    pieces = {1: "ab", 2: "c<", 3: "/e", 4: "nd>", 5: "x"}
    decode = lambda ids: "".join(pieces[i] for i in ids)          # noqa: E731
    detok = Detokenizer(decode, hold=len("</end>") - 1)
    streamed = "".join(detok.push([i]) for i in (1, 2, 3))        # token 4 completes it: the request ends
    assert "<" not in streamed and streamed == "abc"[:len(streamed)]
    assert streamed + detok.finish("abc") == "abc"                # the final text, cut before the stop string


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_stop_words_cut_the_text_over_triton(server, references, protocol):
    text, ids = references[("ar", EXACT_PROMPTS[1])]
    stop = text[len(text) // 2:][:3]                               # three characters from the middle
    tensors = [["text_input", "BYTES", EXACT_PROMPTS[1]], ["max_tokens", "INT32", MAX_TOKENS], ["mode", "BYTES", "ar"],
               ["stop_words", "BYTES", stop], ["stream", "BOOL", protocol == "grpc"]]
    [r] = client(server, "raw", json.dumps(tensors), "--protocol", protocol)
    assert r["error"] is None and r["text"] == text[:text.index(stop)], (stop, r["text"])
    assert r["token_ids"] == ids[:len(r["token_ids"])] and len(r["token_ids"]) < len(ids)
