"""Start and stop a real ``tritonserver`` (from the nvidia-pytriton wheel) on a model repository, CPU only.

The server binds to 127.0.0.1 only, runs in its own process group (stopping it also stops the Python
backend's stub processes) and gets the serving venv's bin first on PATH (see :mod:`.environment`).
"""
from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from ssd_trt.serve.process import LOOPBACK, ServerError, ServerProcess, free_port
from ssd_trt.serve.triton.environment import ServeEnv, ensure_env

__all__ = ["LOOPBACK", "ServerConfig", "ServerError", "TritonServer", "free_port", "server_command"]


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


class TritonServer(ServerProcess):
    """A running tritonserver; use as a context manager, or call :meth:`stop` (always)."""

    name = "tritonserver"

    def __init__(self, config: ServerConfig, env: ServeEnv | None = None) -> None:
        super().__init__(config.log_file)
        self.config = config
        self.config.repository = Path(config.repository).resolve()
        if not self.config.repository.is_dir():
            raise ServerError(f"model repository {self.config.repository} does not exist; create it with "
                              f"`python -m ssd_trt.serve.triton export BUILD_DIR --out REPO`")
        self.env = env or ensure_env()

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

    def command(self) -> list[str]:
        return server_command(self.env, self.config)

    def environment(self) -> dict[str, str]:
        return self.env.server_environment()

    def ready(self) -> bool:
        """Every model loaded (strict readiness)."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError):
            return False
