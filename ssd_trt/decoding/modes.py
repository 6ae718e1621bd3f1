"""The decoding modes the runtime offers, by name. A new mode: one module with a strategy object
(``decoding/mode.py``'s ``Mode``), its settings class (``decoding/settings.py``), plus a line here."""
from __future__ import annotations

from ssd_trt.decoding.autoregressive import AUTOREGRESSIVE
from ssd_trt.decoding.mode import Mode
from ssd_trt.decoding.saguaro import SAGUARO
from ssd_trt.decoding.settings import Settings, settings_for
from ssd_trt.decoding.speculative import SPECULATIVE

STRATEGIES: dict[str, Mode] = {mode.name: mode for mode in (AUTOREGRESSIVE, SPECULATIVE, SAGUARO)}


def strategy_for(mode: "str | Settings") -> tuple[Mode, Settings]:
    """The strategy that runs ``mode`` (a name or a settings object), and its settings object."""
    settings = settings_for(mode)
    return STRATEGIES[settings.name], settings
