"""Loading a build for serving, once for both frontends (the OpenAI server, Triton's Python backend): the runtime
options read from their JSON form, the build loaded (checksums verified) and warmed up, and its serving loop started
with one policy for how many requests it decodes together.

``max_batch_rows``: 0 means the engine's max batch; anything outside 0..max batch is a ConfigError at the edge
(``--max-batch-rows`` of either frontend, the Triton repository's export), never clamped silently.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from ssd_trt.errors import ConfigError
from ssd_trt.runtime import Generator, RuntimeOptions
from ssd_trt.serve.core import ServingCore, warm_up


def runtime_options(raw: dict[str, Any]) -> RuntimeOptions:
    """``RuntimeOptions`` from their JSON form (lists are tuples there); a ConfigError naming an unknown field."""
    try:
        return RuntimeOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    except TypeError as exc:
        raise ConfigError(f"runtime options: {exc}; the fields are those of ssd_trt.RuntimeOptions") from None


def batch_rows(max_batch_rows: int, max_batch: int) -> int:
    """The requests decoded together: ``max_batch_rows``, 0 meaning the engine's ``max_batch``."""
    if isinstance(max_batch_rows, bool) or not isinstance(max_batch_rows, int) \
            or not 0 <= max_batch_rows <= max_batch:
        raise ConfigError(f"max_batch_rows must be in 0..{max_batch} (0: the engine's max batch {max_batch}), got "
                          f"{max_batch_rows!r}")
    return max_batch_rows or max_batch


def load_core(build_dir: str | Path, raw_options: dict[str, Any], max_batch_rows: int, log: Callable[[str], None],
              verify: bool = True, warmup: bool = True, **core_options: Any) -> tuple[ServingCore, float]:
    """The build's serving loop, started, and the seconds loading took. ``core_options``: ``ServingCore``'s
    (``max_waiting``, a test's ``wrap_engine``)."""
    started = time.perf_counter()
    generator = Generator(build_dir, runtime_options(raw_options), verify_checksums=verify)
    rows = batch_rows(max_batch_rows, generator.limits.max_batch)
    if warmup:
        warm_up(generator)
    return ServingCore(generator, rows, log, **core_options), time.perf_counter() - started
