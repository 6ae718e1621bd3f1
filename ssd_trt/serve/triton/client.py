"""Client example for the exported models, with ``tritonclient`` (HTTP, and gRPC streaming).

Run it through ``python -m ssd_trt.serve.triton client ...`` (which runs this module in the serving venv,
where tritonclient is installed), or with the serving venv's python directly::

    VENV=$(python -m ssd_trt.serve.triton setup)      # prints the serving venv's path (creates it once)
    $VENV/bin/python -m ssd_trt.serve.triton.client generate --prompt "The capital of France is" \\
        --max-tokens 16 --protocol grpc --mode ssd          # streams chunks as they are committed
    $VENV/bin/python -m ssd_trt.serve.triton.client generate --prompt "Hello" --protocol http
    $VENV/bin/python -m ssd_trt.serve.triton.client bench --concurrency 16 --repeat 4 --max-tokens 32 --mode ar

Plain HTTP/gRPC requests go to ``ssd_trt_nonstream``; gRPC streaming to the decoupled ``ssd_trt``.
"""
from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from ssd_trt.serve.fields import client_dtype

STREAM_MODEL = "ssd_trt"
NONSTREAM_MODEL = "ssd_trt_nonstream"
STAT_OUTPUTS = ("generated_tokens", "accepted_tokens", "acceptance_rate", "cache_hit_rate")
DTYPES = {"BYTES": np.object_, "INT32": np.int32, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_,
          "INT64": np.int64, "FP64": np.float64}


@dataclass
class Result:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    chunks: int = 0                 # responses that carried tokens
    latency_s: float = 0.0          # request sent -> final response
    ttft_s: float | None = None     # request sent -> first token
    error: str | None = None


def request_tensors(prompt: str, max_tokens: int, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                    seed: int | None = None, mode: str = "ssd", stream: bool = False, ignore_eos: bool = False,
                    draft_len: int | None = None, fan_out_budget: int | None = None, backup: str | None = None,
                    tree_widths: list[int] | None = None, chat: bool = False,
                    structured_outputs: dict | None = None) -> list[tuple[str, str, Any]]:
    """(name, Triton dtype, value) for one request, TensorRT-LLM backend names for what they share. The decoding
    options (K for sd / ssd, SSD's fan-out budget and backup, SD's token tree) are sent only when set: unset,
    the build's defaults apply (and an ssd request's load policy adapts them)."""
    values = {"text_input": prompt, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
              "top_k": top_k, "mode": mode, "stream": stream, "random_seed": seed, "ignore_eos": ignore_eos or None,
              "chat": chat or None, "draft_len": draft_len, "fan_out_budget": fan_out_budget, "backup": backup,
              "tree_widths": None if tree_widths is None else list(tree_widths),
              # vLLM's object (serve/structured.py), as JSON text
              "structured_outputs": None if structured_outputs is None else json.dumps(structured_outputs)}
    # each input's data type from the one field table (serve/fields.py)
    tensors = [(name, client_dtype(name), value) for name, value in values.items() if value is not None]
    return tensors


def make_inputs(module, tensors: list[tuple[str, str, Any]]) -> list:
    """tritonclient InferInputs of shape [1, 1] (``max_batch_size: 1``, as TensorRT-LLM clients send); a list value
    (``tree_widths``, several ``stop_words``) of shape [1, n]."""
    inputs = []
    for name, dtype, value in tensors:
        values = value if isinstance(value, list) else [value]
        data = np.array([[v.encode() if isinstance(v, str) else v for v in values]], dtype=DTYPES[dtype])
        item = module.InferInput(name, list(data.shape), dtype)
        item.set_data_from_numpy(data)
        inputs.append(item)
    return inputs


def _stats(result) -> dict[str, Any]:
    stats = {}
    for name in STAT_OUTPUTS:
        value = result.as_numpy(name)
        if value is not None:
            value = value.reshape(-1)[0].item()
            stats[name] = None if isinstance(value, float) and value != value else value   # NaN -> None
    return stats


def _absorb(out: Result, result) -> None:
    ids = result.as_numpy("output_ids")
    text = result.as_numpy("text_output")
    new_ids = [] if ids is None else ids.reshape(-1).tolist()
    if new_ids:
        out.chunks += 1
    out.token_ids += new_ids
    out.text += "" if text is None else b"".join(text.reshape(-1)).decode("utf-8")
    out.stats.update(_stats(result))


def infer_http(url: str, tensors: list[tuple[str, str, Any]], model: str = NONSTREAM_MODEL,
               timeout: float = 600.0) -> Result:
    """One plain HTTP request (non-streaming model)."""
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException
    out, started = Result(), time.perf_counter()
    with httpclient.InferenceServerClient(url, network_timeout=timeout, connection_timeout=timeout) as client:
        try:
            _absorb(out, client.infer(model, make_inputs(httpclient, tensors)))
        except InferenceServerException as exc:
            out.error = exc.message()
    out.latency_s = time.perf_counter() - started
    return out


class GrpcStream:
    """A gRPC bidirectional stream to the decoupled model, on which a client sends its requests one after another.
    A client keeps its stream (a fresh connection per request costs the client a channel and a thread, on the
    server's cores when both run on one machine)."""

    def __init__(self, url: str, model: str = STREAM_MODEL) -> None:
        import tritonclient.grpc as grpcclient
        self.model, self._module = model, grpcclient
        self._responses: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=lambda result, error: self._responses.put((result, error,
                                                                                     time.perf_counter())))

    def infer(self, tensors: list[tuple[str, str, Any]], on_chunk: Callable[[str], None] | None = None,
              timeout: float = 600.0, cancel_after: int | None = None) -> Result:
        """One request; returns when its final response arrives. ``cancel_after``: cancel the request once that
        many chunks of tokens have arrived (this closes the stream: the request's result is what arrived, with
        ``error`` saying it was cancelled)."""
        out, started = Result(), time.perf_counter()
        self.client.async_stream_infer(self.model, make_inputs(self._module, tensors), enable_empty_final_response=True)
        while True:
            result, error, at = self._responses.get(timeout=timeout)
            if error is not None:
                out.error = error.message() if hasattr(error, "message") else str(error)
                break
            before = len(out.text)
            _absorb(out, result)
            if out.ttft_s is None and out.token_ids:
                out.ttft_s = at - started
            if on_chunk is not None and len(out.text) > before:
                on_chunk(out.text[before:])
            final = result.get_response().parameters.get("triton_final_response")
            if final is not None and final.bool_param:
                break
            if cancel_after is not None and out.chunks >= cancel_after:
                self.client.stop_stream(cancel_requests=True)
                out.error = f"cancelled by this client after {out.chunks} chunk(s)"
                break
        out.latency_s = time.perf_counter() - started
        return out

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()

    def __enter__(self) -> "GrpcStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def infer_grpc_stream(url: str, tensors: list[tuple[str, str, Any]], model: str = STREAM_MODEL,
                      on_chunk: Callable[[str], None] | None = None, timeout: float = 600.0,
                      cancel_after: int | None = None) -> Result:
    """One request over its own gRPC stream (:class:`GrpcStream`)."""
    with GrpcStream(url, model) as stream:
        return stream.infer(tensors, on_chunk, timeout, cancel_after)


def bench(url: str, specs: list[dict[str, Any]], concurrency: int, repeat: int = 1, protocol: str = "grpc"
          ) -> dict[str, Any]:
    """``concurrency`` clients, each sending ``repeat`` requests one after another (a closed loop), the requests
    cycling through ``specs`` (dicts of :func:`request_tensors`' arguments: prompt, max_tokens, mode, temperature,
    ...): gRPC streaming to the decoupled model (``url``: its gRPC address), or plain HTTP to the non-streaming one
    (``url``: the HTTP address); throughput, latency and time-to-first-token percentiles."""
    total = concurrency * repeat
    results: list[Result | None] = [None] * total
    barrier = threading.Barrier(concurrency)

    def client(worker: int) -> None:
        def send(index: int, infer: Callable[[list], Result]) -> None:
            results[index] = infer(request_tensors(**{**specs[index % len(specs)], "stream": protocol == "grpc"}))
        if protocol == "http":
            barrier.wait()
            for r in range(repeat):
                send(worker * repeat + r, lambda tensors: infer_http(url, tensors))
            return
        with GrpcStream(url) as stream:                 # each client keeps its connection, as serving clients do
            barrier.wait()
            for r in range(repeat):
                send(worker * repeat + r, stream.infer)

    started = time.perf_counter()
    threads = [threading.Thread(target=client, args=(w,)) for w in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return summarize(results, time.perf_counter() - started, concurrency, specs)


def summarize(results: list[Result | None], wall: float, concurrency: int, specs: list[dict[str, Any]]
              ) -> dict[str, Any]:
    """One closed-loop run's numbers (any frontend's: the OpenAI load bench uses it too): throughput, latency and
    time-to-first-token percentiles, the errors, and every request's result. A request's tokens are its
    ``generated_tokens`` statistic where its client does not see the ids (OpenAI)."""
    done = [r for r in results if r is not None]
    ok = [r for r in done if r.error is None]
    latencies = sorted(r.latency_s for r in ok)
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    tokens = sum(len(r.token_ids) or r.stats.get("generated_tokens", 0) for r in ok)

    def pct(values: list[float], p: float) -> float | None:
        return values[min(len(values) - 1, int(round(p * (len(values) - 1))))] if values else None

    modes = sorted({spec.get("mode", "ssd") for spec in specs})
    return {"concurrency": concurrency, "requests": len(results), "mode": modes[0] if len(modes) == 1 else "mixed",
            "max_tokens": max(spec["max_tokens"] for spec in specs), "wall_s": wall,
            "errors": [r.error for r in done if r.error], "generated_tokens": tokens,
            "throughput_tok_s": tokens / wall, "requests_per_s": len(ok) / wall,
            "latency_p50_s": pct(latencies, 0.50), "latency_p99_s": pct(latencies, 0.99),
            "latency_mean_s": statistics.fmean(latencies) if latencies else None,
            "ttft_p50_s": pct(ttfts, 0.50), "ttft_p99_s": pct(ttfts, 0.99),
            "results": [asdict(r) for r in done]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd_trt.serve.triton.client", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="one request per --prompt (and per --mode)")
    gen.add_argument("--prompt", action="append", required=True)
    gen.add_argument("--mode", action="append", choices=["ar", "sd", "ssd"])
    gen.add_argument("--protocol", choices=["http", "grpc"], default="grpc",
                     help="http: plain request to the non-streaming model; grpc: streaming")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--draft-len", type=int, help="K, draft tokens per round (sd / ssd); default: the build's")
    gen.add_argument("--fan-out-budget", type=int, help="ssd: guesses per round for the speculation cache")
    gen.add_argument("--backup", choices=["auto", "jit", "ngram"], help="ssd: what proposes on a cache miss")
    gen.add_argument("--tree-widths", type=lambda text: [int(w) for w in text.split(",")],
                     help="sd: verify a token tree, e.g. 2,2,1 children per depth")
    gen.add_argument("--json", action="store_true", help="one JSON line per request instead of streamed text")
    gen.add_argument("--chat", action="store_true", help="apply the tokenizer's chat template to the prompt")
    gen.add_argument("--ignore-eos", action="store_true", help="generate --max-tokens tokens whatever they are")
    gen.add_argument("--cancel-after", type=int, metavar="CHUNKS",
                     help="grpc: cancel each request once this many chunks of tokens arrived")
    raw = sub.add_parser("raw", help="send arbitrary tensors: a JSON list of [name, dtype, value] per request "
                                     "(several: sent one after another, one JSON line each)")
    raw.add_argument("tensors", nargs="+")
    raw.add_argument("--protocol", choices=["http", "grpc"], default="http")
    raw.add_argument("--model")
    b = sub.add_parser("bench", help="concurrent requests (closed loop; gRPC streaming or plain HTTP); prints a JSON "
                                     "summary")
    b.add_argument("--prompt", action="append")
    b.add_argument("--concurrency", type=int, default=32)
    b.add_argument("--repeat", type=int, default=1, help="requests each concurrent client sends, one after another")
    b.add_argument("--max-tokens", type=int, default=16)
    b.add_argument("--mode", choices=["ar", "sd", "ssd"], default="ssd")
    b.add_argument("--specs", help="JSON list of requests to cycle through instead of --prompt/--mode/--max-tokens "
                                   "(each: prompt, max_tokens, and optionally mode, temperature, top_p, top_k, seed, "
                                   "draft_len, fan_out_budget, backup, tree_widths, chat)")
    b.add_argument("--protocol", choices=["http", "grpc"], default="grpc",
                   help="grpc: streaming, to the decoupled model; http: plain requests to the non-streaming one")
    b.add_argument("--full", action="store_true", help="include every request's result in the JSON")
    for p in (gen, raw, b):
        p.add_argument("--http-url", default="127.0.0.1:8000")
        p.add_argument("--grpc-url", default="127.0.0.1:8001")
    args = parser.parse_args(argv)
    if args.command == "generate" and args.cancel_after is not None and \
            (args.protocol != "grpc" or args.cancel_after < 1):
        parser.error("--cancel-after needs --protocol grpc (streaming) and a count >= 1")

    if args.command == "bench":
        specs = json.loads(args.specs) if args.specs else \
            [{"prompt": p, "max_tokens": args.max_tokens, "mode": args.mode}
             for p in args.prompt or ["The capital of France is"]]
        summary = bench(args.http_url if args.protocol == "http" else args.grpc_url, specs, args.concurrency,
                        args.repeat, args.protocol)
        if not args.full:
            summary.pop("results")
        print(json.dumps(summary))
        return 1 if summary["errors"] else 0
    if args.command == "raw":
        for request in args.tensors:
            tensors = [tuple(t) for t in json.loads(request)]
            if args.protocol == "http":
                result = infer_http(args.http_url, tensors, args.model or NONSTREAM_MODEL)
            else:
                result = infer_grpc_stream(args.grpc_url, tensors, args.model or STREAM_MODEL)
            print(json.dumps(asdict(result)), flush=True)
        return 0
    failed = False
    for mode in args.mode or ["ssd"]:
        for prompt in args.prompt:
            stream = args.protocol == "grpc"
            tensors = request_tensors(prompt, args.max_tokens, args.temperature, args.top_p, args.top_k,
                                      args.seed, mode, stream, draft_len=args.draft_len,
                                      fan_out_budget=args.fan_out_budget, backup=args.backup,
                                      tree_widths=args.tree_widths, chat=args.chat, ignore_eos=args.ignore_eos)
            if stream:
                printer = None if args.json else (lambda piece: print(piece, end="", flush=True))
                result = infer_grpc_stream(args.grpc_url, tensors, on_chunk=printer, cancel_after=args.cancel_after)
            else:
                result = infer_http(args.http_url, tensors)
            failed |= result.error is not None
            if args.json:
                print(json.dumps({"protocol": args.protocol, "mode": mode, "prompt": prompt, **asdict(result)}))
            elif result.error:
                print(f"error: {result.error}", file=sys.stderr)
            else:
                if not stream:
                    print(result.text, end="")
                print(f"\n[{mode}] {result.stats} latency {result.latency_s:.2f}s", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
