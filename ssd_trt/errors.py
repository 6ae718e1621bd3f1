"""User-facing errors. Each carries a message that says what was wrong and how to fix it."""
from __future__ import annotations


class SsdTrtError(Exception):
    """Base class; the CLIs print ``str(error)`` and exit non-zero, no traceback."""


class RecipeError(SsdTrtError, ValueError):
    """A recipe file is missing, malformed, or names something that does not exist."""


class ArtifactError(SsdTrtError):
    """A build directory is missing, corrupt, from another version, or mismatched."""


class ConfigError(SsdTrtError, ValueError):
    """A configuration given in code or on the command line is invalid (runtime options, engine step limits)."""


class RequestError(SsdTrtError, ValueError):
    """A generation request is invalid (prompt, sampling parameters, mode, batch). ``field``: the request field at
    fault, as the frontends name it, where the raiser knows it (a frontend's error then names it as its ``param``)."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class EngineError(SsdTrtError):
    """An engine failed while serving a request; the request fails, the engines stay usable."""


class Cancelled(Exception):
    """Raise from an ``on_tokens`` callback to stop a request: generation ends, its KV slots are freed
    and the tokens produced so far are returned (``stats["cancelled"] = True``). Not an error."""
