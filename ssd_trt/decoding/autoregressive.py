"""Plain autoregressive decoding: one target forward per token. The exactness baseline (its rounds:
``batching/round.py``, a row that verifies no proposal)."""
from __future__ import annotations

from ssd_trt.decoding.mode import ResolvedMode


class Autoregressive:
    """``--mode ar``."""
    name = "ar"
    roles = ("target",)

    def resolve(self, settings, defaults) -> ResolvedMode:
        return ResolvedMode(self.name, settings, draft_len=None, headroom=0)


AUTOREGRESSIVE = Autoregressive()
