"""Start and stop a real ``tritonserver`` (from the nvidia-pytriton wheel) on a model repository, CPU only.

The server binds to 127.0.0.1 only, runs in its own process group (stopping it also stops the Python
backend's stub processes) and gets the serving venv's bin first on PATH (see :mod:`.environment`).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ssd_trt.errors import SsdTrtError
from ssd_trt.serve.triton.environment import ServeEnv, ensure_env

LOOPBACK = "127.0.0.1"


class ServerError(SsdTrtError):
    """tritonserver did not start, exited, or did not become ready."""


def free_port() -> int:
    """A TCP port that is free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


@dataclass
class ServerConfig:
    repository: Path
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int | None = 8002         # Prometheus metrics (the engine's gauges among them); None: off
    log_file: Path | None = None            # None: inherit stdout/stderr
    verbose: int = 0
    extra_args: list[str] = field(default_factory=list)


def server_command(env: ServeEnv, config: ServerConfig) -> list[str]:
    return [str(env.tritonserver), f"--model-repository={config.repository}",
            f"--backend-directory={env.backend_dir}",
            f"--http-address={LOOPBACK}", f"--http-port={config.http_port}",
            f"--grpc-address={LOOPBACK}", f"--grpc-port={config.grpc_port}",
            *(["--allow-metrics=true", f"--metrics-address={LOOPBACK}", f"--metrics-port={config.metrics_port}",
               "--allow-cpu-metrics=false"] if config.metrics_port else ["--allow-metrics=false"]),
            "--allow-gpu-metrics=false", "--strict-readiness=true",
            "--exit-on-error=true", f"--log-verbose={config.verbose}", *config.extra_args]


class TritonServer:
    """A running tritonserver; use as a context manager, or call :meth:`stop` (always)."""

    def __init__(self, config: ServerConfig, env: ServeEnv | None = None) -> None:
        self.config = config
        self.config.repository = Path(config.repository).resolve()
        if not self.config.repository.is_dir():
            raise ServerError(f"model repository {self.config.repository} does not exist; create it with "
                              f"`python -m ssd_trt.serve.triton export BUILD_DIR --out REPO`")
        self.env = env or ensure_env()
        self._log = None
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"{LOOPBACK}:{self.config.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{LOOPBACK}:{self.config.grpc_port}"

    @property
    def metrics_url(self) -> str | None:
        return None if not self.config.metrics_port else f"http://{LOOPBACK}:{self.config.metrics_port}/metrics"

    def metrics(self) -> str:
        """The server's Prometheus metrics text."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as resp:
            return resp.read().decode()

    def start(self) -> "TritonServer":
        out = None
        if self.config.log_file is not None:
            Path(self.config.log_file).parent.mkdir(parents=True, exist_ok=True)
            self._log = out = open(self.config.log_file, "ab")
        self.process = subprocess.Popen(server_command(self.env, self.config), env=self.env.server_environment(),
                                        stdout=out, stderr=subprocess.STDOUT if out else None,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout: float = 300.0, poll: float = 1.0) -> "TritonServer":
        """Block until every model is loaded (strict readiness); raise if the server exits or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = None if self.process is None else self.process.returncode
                raise ServerError(f"tritonserver exited (code {code}) before becoming ready; "
                                  f"see {self.config.log_file or 'its output above'}")
            if self.ready():
                return self
            time.sleep(poll)
        raise ServerError(f"tritonserver was not ready after {timeout:.0f}s; see "
                          f"{self.config.log_file or 'its output above'}")

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
            try:                                     # stub processes left behind in the group
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "TritonServer":
        return self.start().wait_ready()

    def __exit__(self, *exc) -> None:
        self.stop()
