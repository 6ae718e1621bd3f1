"""``python -m ssd_trt.serve.openai`` as a process on 127.0.0.1 (what the tests and the load bench start)."""
from __future__ import annotations

import sys
import urllib.error
import urllib.request
from pathlib import Path

from ssd_trt.serve.process import LOOPBACK, ServerProcess


class OpenAIServer(ServerProcess):
    """A running OpenAI server; use as a context manager, or call :meth:`stop` (always)."""

    name = "the OpenAI server"

    def __init__(self, build_dir: str | Path, port: int, args: list[str] | None = None,
                 log_file: Path | None = None) -> None:
        super().__init__(log_file)
        self.build_dir, self.port, self.args = Path(build_dir), port, list(args or [])

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "ssd_trt.serve.openai", str(self.build_dir), "--host", LOOPBACK, "--port",
                str(self.port), *self.args]

    def health(self) -> int | None:
        """/health's status (200 ready, 503 loading), None while nothing answers."""
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError):
            return None

    def ready(self) -> bool:
        return self.health() == 200

    def metrics(self) -> str:
        """The server's Prometheus metrics text."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            return resp.read().decode()
