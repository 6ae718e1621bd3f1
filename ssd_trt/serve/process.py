"""A server run as a process of its own (tritonserver, the OpenAI server): started in its own process group on the
loopback interface, waited for until it is ready, stopped with everything it started."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from ssd_trt.errors import SsdTrtError

LOOPBACK = "127.0.0.1"


class ServerError(SsdTrtError):
    """A server did not start, exited, or did not become ready."""


def free_port() -> int:
    """A TCP port that is free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """Subclasses say how to start (:meth:`command`) and when the server is ready (:meth:`ready`). Use as a context
    manager, or call :meth:`stop` (always)."""

    name = "server"

    def __init__(self, log_file: Path | None = None) -> None:
        self.log_file = log_file                    # None: inherit stdout/stderr
        self.process: subprocess.Popen | None = None
        self._log = None

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str] | None:
        return None

    def ready(self) -> bool:
        raise NotImplementedError

    def start(self) -> Any:
        out = None
        if self.log_file is not None:
            Path(self.log_file).parent.mkdir(parents=True, exist_ok=True)
            self._log = out = open(self.log_file, "ab")
        # its own session: stopping it stops whatever it started (Triton's backend stubs) with it
        self.process = subprocess.Popen(self.command(), env=self.environment(), stdout=out,
                                        stderr=subprocess.STDOUT if out else None, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 300.0, poll: float = 1.0) -> Any:
        """Block until :meth:`ready`; raise if the server exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise ServerError(f"{self.name} exited (code {code}) before becoming ready; "
                                  f"see {self.log_file or 'its output above'}")
            if self.ready():
                return self
            time.sleep(poll)
        raise ServerError(f"{self.name} was not ready after {timeout:.0f}s; see "
                          f"{self.log_file or 'its output above'}")

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the process group, then SIGKILL after ``grace`` seconds. Safe to call twice."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            pgid = os.getpgid(process.pid)
            os.killpg(pgid, signal.SIGTERM)
            try:
                process.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(pgid, signal.SIGKILL)
                process.wait(10)
            try:                                     # processes it left behind in the group
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> Any:
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
