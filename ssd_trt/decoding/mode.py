"""What a decoding mode is to the runtime: a strategy object (the registry is ``decoding/modes.py``).

A mode says which engines it needs, resolves a request's settings (``decoding/settings.py``: AR, SD or SSD,
with unset values from the build's decoding defaults) into a :class:`ResolvedMode` (what the runtime checks
against the engine limits before any engine runs). The engine step runs every mode's rounds
(``batching/round.py``). Adding a mode is a settings class, an object here with its resolution, a registry
line, and its round in the engine step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class ResolvedMode:
    """One request's mode with its settings resolved, and what they ask of the engines."""
    name: str                      # ar | sd | ssd
    settings: Any                  # the mode's settings object, every value set (AR, SD or SSD)
    draft_len: int | None          # K, checked against engine.max_draft_len (None: the mode drafts nothing)
    headroom: int                  # cache slots a round may write past the committed text
    tree_tokens: int = 0           # tokens of the mode's largest draft tree step (0: none), vs max_tree_size
    tree_what: str = ""            # how an error message names that step


class Mode(Protocol):
    name: str
    roles: tuple[str, ...]         # engines it needs: ("target",) or ("target", "draft")

    def resolve(self, settings: Any, defaults: Any) -> ResolvedMode:
        """``settings``: this mode's settings object; ``defaults``: the build's DecodingDefaults for the
        request's regime. Raises RequestError."""
