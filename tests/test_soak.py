"""Soak: many requests of mixed modes, parameters, bad inputs, cancellations and draft faults on one
Generator. Between requests no engine holds a KV slot, cache buffers stay within max batch x max
context, threads do not pile up, resident memory stays within a bound, and greedy answers never drift.
"""
from __future__ import annotations

import gc
import os
import threading
import tracemalloc

import numpy as np

import ssd_trt
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.errors import Cancelled, RequestError
from ssd_trt.runtime import RuntimeOptions
from tests.test_faults import FaultyEngine, slots_held

REQUESTS = 120
WARMUP = 20
PY_HEAP_GROWTH_BOUND = 4 << 20        # bytes of Python heap growth allowed after warm-up
RSS_GROWTH_BOUND = 64 << 20           # bytes of resident memory growth allowed after warm-up


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def cache_bytes(engine) -> int:
    cache = getattr(engine, "cache", None)
    return sum(b.nbytes for b in cache.buffers) if cache is not None else 0


def test_mixed_requests_leak_no_slots_threads_or_memory(tiny_pairs):
    gen = ssd_trt.load(tiny_pairs["perturbed"], RuntimeOptions(draft_timeout_s=5.0))
    real_draft = gen.engine("draft")
    gen.engine("target")
    rng = np.random.default_rng(0)
    greedy_answers: dict[tuple, list[list[int]]] = {}
    counts = {"ok": 0, "refused": 0, "cancelled": 0, "draft_faults": 0}
    threads_before = threading.active_count()
    spec = gen.engine("target").spec
    buffer_bound = 2 * spec.num_layers * spec.max_batch * spec.num_kv_heads * spec.max_context * spec.head_dim * 4

    for index in range(REQUESTS):
        if index == WARMUP:
            gc.collect()
            tracemalloc.start()
            heap_start, rss_start = tracemalloc.get_traced_memory()[0], rss_bytes()
        mode = [ssd_trt.AR(), ssd_trt.SD(draft_len=3), ssd_trt.SSD(draft_len=3)][index % 3]
        batch = int(rng.integers(1, 5))
        prompts = [[1] + rng.integers(3, 256, int(rng.integers(1, 30))).tolist() for _ in range(batch)]
        greedy = rng.random() < 0.4
        params = SamplingParams(max_new_tokens=int(rng.integers(1, 40)), stop_on_eos=bool(rng.random() < 0.5),
                                temperature=0.0 if greedy else float(rng.choice([0.5, 1.0, 1.3])),
                                top_p=float(rng.choice([1.0, 0.9])), top_k=int(rng.choice([0, 20])),
                                seed=int(rng.integers(0, 1000)))
        kind = rng.choice(["plain", "plain", "plain", "bad", "cancel", "draft_fault"])
        gen.engines.opened["draft"] = real_draft
        on_tokens = None
        if kind == "bad":
            prompts = prompts + [[1, 999]] if rng.random() < 0.5 else [[]]
        elif kind == "cancel":
            budget = int(rng.integers(1, 8))

            def on_tokens(row, tokens, seen=[0], budget=budget):   # noqa: B006 -- per-request counter
                seen[0] += len(tokens)
                if seen[0] >= budget:
                    raise Cancelled
        elif kind == "draft_fault" and mode.name == "ssd":
            gen.engines.opened["draft"] = FaultyEngine(real_draft, str(rng.choice(["crash", "garbage"])),
                                                 at=int(rng.integers(0, 12)))
        try:
            results = gen.generate_ids(prompts, params, mode=mode, on_tokens=on_tokens)
        except RequestError:
            counts["refused"] += 1
        else:
            stats = results[0].stats
            counts["cancelled" if stats.get("cancelled") else "ok"] += 1
            counts["draft_faults"] += bool(stats.get("draft_failures"))
            assert all(len(r.token_ids) <= params.max_new_tokens for r in results)
            if greedy and not stats.get("cancelled"):
                key = (tuple(map(tuple, prompts)), params.max_new_tokens, params.stop_on_eos)
                answer = [r.token_ids for r in results]
                assert greedy_answers.setdefault(key, answer) == answer
        for role, engine in gen.engines.opened.items():
            assert slots_held(engine) == 0, f"request {index} ({mode}, {kind}) left {role} slots held"
            assert cache_bytes(getattr(engine, "inner", engine)) <= buffer_bound
        assert threading.active_count() <= threads_before + 1

    gc.collect()
    heap_growth = tracemalloc.get_traced_memory()[0] - heap_start
    tracemalloc.stop()
    rss_growth = rss_bytes() - rss_start
    print(f"soak: {counts}; after warm-up the Python heap grew {heap_growth / 2**10:.0f} KiB, "
          f"resident memory {rss_growth / 2**20:.1f} MiB")
    assert heap_growth < PY_HEAP_GROWTH_BOUND, f"Python heap grew {heap_growth / 2**20:.1f} MiB"
    assert rss_growth < RSS_GROWTH_BOUND, f"resident memory grew {rss_growth / 2**20:.1f} MiB"
    assert min(counts.values()) > 0, counts                  # every kind of request really happened


def test_repeated_identical_requests_give_identical_answers_and_hold_nothing(tiny_pairs):
    gen = ssd_trt.load(tiny_pairs["self"])
    params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=11, stop_on_eos=False)
    prompts = [[1, 5, 9, 33], [1, 7]]
    for mode in (ssd_trt.AR(), ssd_trt.SD(draft_len=4), ssd_trt.SSD(draft_len=4)):
        first = [r.token_ids for r in gen.generate_ids(prompts, params, mode=mode)]
        for _ in range(5):
            assert [r.token_ids for r in gen.generate_ids(prompts, params, mode=mode)] == first
            assert all(slots_held(engine) == 0 for engine in gen.engines.opened.values())
