"""The decoding modes the runtime offers, by name. A new mode: one module with a strategy object
(``decoding/mode.py``'s ``Mode``), plus a line here."""
from __future__ import annotations

from ssd_trt.decoding.autoregressive import AUTOREGRESSIVE
from ssd_trt.decoding.mode import Mode
from ssd_trt.decoding.saguaro import SAGUARO
from ssd_trt.decoding.speculative import SPECULATIVE
from ssd_trt.errors import RequestError

MODES: dict[str, Mode] = {mode.name: mode for mode in (AUTOREGRESSIVE, SPECULATIVE, SAGUARO)}
DEFAULT_MODE = AUTOREGRESSIVE.name        # what a request gets unless it names a mode


def mode_named(name: str) -> Mode:
    if name not in MODES:
        raise RequestError(f"unknown mode {name!r}; choose one of {', '.join(MODES)}")
    return MODES[name]
