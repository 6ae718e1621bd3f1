"""The serving loop's metrics as Triton custom metrics (the Python backend's ``pb_utils.MetricFamily``, label
``model``), served on Triton's metrics port beside its own.

Two sets, both read from the shared core (``serve/core.py``, ``serve/metrics.py``):

* the ``ssd_trt_*`` gauges this backend has always exported (acceptance rate, mean accepted length, cache hit rate,
  active batch, running and waiting requests, and the counter of aborted requests), under their names;
* the catalogue every frontend exports (``ssd_trt:num_requests_waiting``, ``ssd_trt:spec_decode_num_drafts_total``,
  ..., vLLM's names under the ``ssd_trt:`` prefix): counters incremented by what the total grew since the last
  export, gauges set, histograms fed the observations made since the last export (the Python backend can only
  observe values one at a time, so the core keeps the latest ones for it).

``pb_utils`` exists only inside the backend's stub process, so it is passed in rather than imported here.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from ssd_trt.batching.metrics import EngineMetrics
from ssd_trt.serve.metrics import Family

LEGACY = {   # name: (description, what of EngineMetrics it reports, gauge or counter)
    "ssd_trt_acceptance_rate": ("accepted / drafted tokens over every speculative round so far", "acceptance_rate",
                                "gauge"),
    "ssd_trt_mean_accepted_length": ("drafted tokens accepted per speculative round (the bonus token not counted)",
                                     "mean_accepted", "gauge"),
    "ssd_trt_cache_hit_rate": ("SSD speculation-cache hits per lookup", "cache_hit_rate", "gauge"),
    "ssd_trt_active_batch": ("requests decoded together in the last round", "active_batch", "gauge"),
    "ssd_trt_running_requests": ("requests being decoded (admitted, not finished)", "running", "gauge"),
    "ssd_trt_waiting_requests": ("requests waiting for a free slot", "waiting", "gauge"),
    "ssd_trt_aborted_requests_total": ("requests stopped before their end (their client cancelled or went away)",
                                       "aborted", "counter"),
}


class TritonMetrics:
    """Exports what changed since the last update; a stub without custom metrics exports nothing."""

    def __init__(self, pb_utils, model: str, log: Callable[[str], None] = print) -> None:
        self.family_type = getattr(pb_utils, "MetricFamily", None)
        self.model, self.log = model, log
        self.families: dict[str, Any] = {}
        self.metrics: dict[tuple, Any] = {}         # (family name, labels): its pb_utils Metric
        self.exported: dict[tuple, float] = {}
        self.refused: set[str] = set()              # families this Triton would not create (logged once)

    def update(self, engine: EngineMetrics, catalogue: list[Family]) -> None:
        if self.family_type is None:
            return
        for name, (description, attribute, kind) in LEGACY.items():
            value = getattr(engine, attribute)
            self._export(name, kind, description, {}, float("nan") if value is None else float(value))
        for family in catalogue:
            if family.histogram is not None:
                metric = self._metric(family.name, "histogram", family.help, {}, family.histogram.buckets)
                for value in family.histogram.drain():
                    if metric is not None:
                        metric.observe(value)
                continue
            for labels, value in family.samples:
                self._export(family.sample_name, family.kind, family.help, labels, value)

    def _export(self, name: str, kind: str, description: str, labels: dict[str, str], value: float) -> None:
        key = (name, tuple(sorted(labels.items())))
        last = self.exported.get(key)
        if last is not None and (value == last or (math.isnan(value) and math.isnan(last))):
            return
        metric = self._metric(name, kind, description, labels)
        if metric is None:
            return
        if kind == "counter":
            metric.increment(value - (last or 0.0))
        else:
            metric.set(value)
        self.exported[key] = value

    def _metric(self, name: str, kind: str, description: str, labels: dict[str, str],
                buckets: tuple[float, ...] | None = None):
        key = (name, tuple(sorted(labels.items())))
        if key in self.metrics:
            return self.metrics[key]
        if name in self.refused:
            return None
        try:
            if name not in self.families:
                kinds = {"counter": "COUNTER", "gauge": "GAUGE", "histogram": "HISTOGRAM"}
                self.families[name] = self.family_type(name=name, description=description,
                                                       kind=getattr(self.family_type, kinds[kind]))
            extra = {"buckets": list(buckets)} if buckets is not None else {}
            metric = self.families[name].Metric(labels={"model": self.model, **labels}, **extra)
        except Exception as exc:  # noqa: BLE001 -- e.g. an older Triton without histograms: the others still export
            self.refused.add(name)
            self.log(f"ssd_trt: Triton refused the metric {name} ({type(exc).__name__}: {exc}); not exported")
            return None
        self.metrics[key] = metric
        return metric
