"""What a server reports to Prometheus, whichever frontend serves it: one catalogue over the engine step's totals
(:class:`~ssd_trt.batching.metrics.EngineMetrics`) and the serving loop's own (:class:`ServingMetrics`: tokens in and
out, finished requests, latency histograms).

Names follow vLLM's where the meaning is the same (``vllm:num_requests_waiting`` -> ``ssd_trt:num_requests_waiting``,
``vllm:spec_decode_num_accepted_tokens_per_pos`` -> ``ssd_trt:spec_decode_num_accepted_tokens_per_pos``, ...), so a
dashboard or an autoscaler written for vLLM reads them with the prefix changed; SSD's own (speculation-cache hits and
lookups, miss backups, the load policy's choices) follow under the same prefix. :func:`render` writes the Prometheus
text format (the OpenAI frontend's ``/metrics``); the Triton backend exports the same families through Triton's
custom-metrics API (``serve/triton/metrics.py``).
"""
from __future__ import annotations

import bisect
import math
import threading
from collections import Counter, deque
from dataclasses import dataclass, field

from ssd_trt.batching.metrics import EngineMetrics

PREFIX = "ssd_trt:"
# upper bounds (seconds); chosen for a CPU that serves tens of tokens per second and a GPU that serves thousands
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
               2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
# the engine's finish reasons as OpenAI and vLLM name them (EOS and a stop token or string both "stop")
FINISHED_REASON = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort", "error": "error"}
# why a frontend refused a request before queueing it (each reported, as 0, before it first occurs)
REJECTED_REASONS = ("bad_request", "model_not_found", "queue_full", "unauthorized")
PENDING_OBSERVATIONS = 10_000     # kept for a frontend that replays observations (Triton); older ones are dropped


class Histogram:
    """Cumulative bucket counts, their sum and count (what Prometheus stores), and the latest raw observations for a
    frontend whose metrics API can only observe values one by one (Triton's)."""

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)      # the last: above every bound (+Inf)
        self.sum = 0.0
        self.count = 0
        self._pending: deque[float] = deque(maxlen=PENDING_OBSERVATIONS)
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.buckets, value)] += 1
            self.sum += value
            self.count += 1
            self._pending.append(value)

    def cumulative(self) -> tuple[list[tuple[float, int]], float, int]:
        """(upper bound, observations <= it) per bucket, +Inf last; the sum; the count: one consistent reading."""
        with self._lock:
            counts, total, count = list(self.counts), self.sum, self.count
        running, out = 0, []
        for bound, n in zip((*self.buckets, math.inf), counts):
            running += n
            out.append((bound, running))
        return out, total, count

    def drain(self) -> list[float]:
        """The observations since the last drain (one consumer)."""
        with self._lock:
            values = list(self._pending)
            self._pending.clear()
        return values


@dataclass
class ServingMetrics:
    """The serving loop's totals: what the engine step does not see (when a client got its tokens, how requests
    ended). Written by the step loop's thread, read by any."""
    prompt_tokens: int = 0
    finished: Counter = field(default_factory=Counter)     # by FINISHED_REASON
    rejected: Counter = field(default_factory=Counter)     # by REJECTED_REASONS: refused before being queued
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))


@dataclass
class Family:
    """One metric: its name without the ``_total`` a counter's samples carry, kind, help, and samples (labels,
    value), or a histogram."""
    name: str
    kind: str                                   # counter | gauge | histogram
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)
    histogram: Histogram | None = None

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


def _one(name: str, kind: str, help_: str, value: float) -> Family:
    return Family(PREFIX + name, kind, help_, [({}, float(value))])


def _by(name: str, help_: str, label: str, counts: dict, keys: tuple = ()) -> Family:
    """A counter with one label; ``keys`` are reported (as 0) before they first occur."""
    values = {**{key: 0 for key in keys}, **counts}
    return Family(PREFIX + name, "counter", help_,
                  [({label: str(key)}, float(n)) for key, n in sorted(values.items())])    # (keys of one type)


def families(engine: EngineMetrics, serving: ServingMetrics) -> list[Family]:
    """Every metric a frontend exports, read now."""
    return [
        _one("num_requests_running", "gauge", "Requests being decoded (admitted to the engine step, not finished).",
             engine.running),
        _one("num_requests_waiting", "gauge", "Requests waiting for a running slot (KV memory or max batch).",
             engine.waiting),
        _one("kv_cache_usage_perc", "gauge", "KV-cache usage: the fraction (0..1) of the KV slots the running "
             "requests reserve (rows x the longest request's need: the caches are dense); at 1 requests wait.",
             engine.kv_cache_usage),
        _one("prompt_tokens", "counter", "Prompt tokens of the requests accepted.", serving.prompt_tokens),
        _one("generation_tokens", "counter", "Tokens generated (committed by the engine step).",
             engine.generated_tokens),
        _by("request_success", "Requests finished, by finish reason (stop: EOS, a stop token or string; length: "
            "max_tokens; abort: the client cancelled or went away).", "finished_reason", serving.finished,
            ("stop", "length", "abort")),
        _by("request_rejected", "Requests refused before being queued, by reason (queue_full: 503, retry later; "
            "bad_request: 400; model_not_found: 404; unauthorized: 401, a missing or wrong API key).", "reason",
            serving.rejected, REJECTED_REASONS),
        Family(PREFIX + "time_to_first_token_seconds", "histogram",
               "Seconds from a request's arrival to its first generated token.", histogram=serving.ttft),
        Family(PREFIX + "inter_token_latency_seconds", "histogram",
               "Seconds between a request's successive deliveries of tokens (one per engine step that gave it "
               "tokens: a speculative round may give several).", histogram=serving.itl),
        Family(PREFIX + "e2e_request_latency_seconds", "histogram",
               "Seconds from a request's arrival to its last token.", histogram=serving.e2e),
        _one("spec_decode_num_drafts", "counter", "Speculative row-rounds: drafts verified by the target.",
             engine.speculative_rounds),
        _one("spec_decode_num_draft_tokens", "counter", "Draft tokens proposed for verification.", engine.drafted),
        _one("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted by verification.", engine.accepted),
        _by("spec_decode_num_accepted_tokens_per_pos", "Drafts whose token at this position was accepted.",
            "position", engine.accepted_per_pos),
        _one("ssd_cache_lookups", "counter", "SSD speculation-cache lookups (one per SSD row-round).", engine.lookups),
        _one("ssd_cache_hits", "counter", "SSD speculation-cache hits: the verified outcome had been pre-speculated.",
             engine.hits),
        _by("ssd_backup_rounds", "SSD cache misses, by what proposed the round's draft instead (jit: the draft just "
            "in time; ngram: prompt lookup).", "backup", engine.backup_rounds),
        _by("ssd_adaptive_rounds", "Row-rounds of adaptive SSD requests, by the kind the load policy chose (ar: "
            "speculation paused).", "kind", engine.adaptive_rounds, ("ar", "sd", "ssd")),
    ]


def _escaped(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{_escaped(str(value))}"' for key, value in labels.items()) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return "NaN" if math.isnan(value) else repr(float(value))


def render(found: list[Family], labels: dict[str, str] | None = None) -> str:
    """The Prometheus text exposition format (version 0.0.4) of ``found``, every sample with ``labels`` added."""
    base = dict(labels or {})
    lines = []
    for family in found:
        # (the classic text format names a counter by its samples' name, _total included, as prometheus_client does)
        lines += [f"# HELP {family.sample_name} {family.help}", f"# TYPE {family.sample_name} {family.kind}"]
        if family.histogram is not None:
            buckets, total, count = family.histogram.cumulative()
            for bound, n in buckets:
                lines.append(f"{family.name}_bucket{_labels({**base, 'le': _number(bound)})} {n}")
            lines += [f"{family.name}_sum{_labels(base)} {_number(total)}",
                      f"{family.name}_count{_labels(base)} {count}"]
            continue
        for sample_labels, value in family.samples:
            lines.append(f"{family.sample_name}{_labels({**base, **sample_labels})} {_number(value)}")
    return "\n".join(lines) + "\n"
