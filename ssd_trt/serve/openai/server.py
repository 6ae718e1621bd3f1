"""Run the OpenAI-compatible server: uvicorn over the app, the build loaded on a thread while it already listens.

Shutdown (SIGTERM, SIGINT): the server stops listening and the serving loop drains: requests in flight get
``graceful_timeout`` seconds to finish; those still running then end with an error (a streamed one as its last event,
then ``[DONE]``), and uvicorn, which waits ``DRAIN_MARGIN_S`` longer, sees every connection close before it would
cut them. The step thread stops before the engines close."""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ssd_trt.decoding.settings import DEFAULT_MODE
from ssd_trt.errors import ConfigError
from ssd_trt.manifest import read_manifest
from ssd_trt.serve import loading
from ssd_trt.serve.core import EngineWrapper, ServingCore

# 45 s: a 5 s preStop sleep, the drain, then the last writes and the engines' close fit the 60 s grace period of a pod
# (deploy/kubernetes)
GRACEFUL_TIMEOUT_S = 45.0
DRAIN_MARGIN_S = 5.0    # uvicorn's wait beyond the drain's: time to write the last events of the streams ended


@dataclass
class ServerOptions:
    build_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None          # default: the build directory's name
    max_batch_rows: int = 0                # 0: the engine's max batch
    max_waiting: int = 1024
    runtime_options: dict[str, Any] = field(default_factory=dict)
    verify: bool = True
    warmup: bool = True
    log_level: str = "info"
    access_log: bool = True
    aliases: tuple[str, ...] = ()          # further names requests may use (--served-model-name's others)
    api_key: str | None = None             # None: no key needed (auth.py)
    graceful_timeout: float = GRACEFUL_TIMEOUT_S   # seconds streams in flight get to finish after SIGTERM
    default_mode: str = DEFAULT_MODE       # the mode of a request that names none

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.build_dir).resolve().name


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_core(options: ServerOptions, wrap_engine: EngineWrapper | None = None) -> ServingCore:
    """The build loaded (checksums verified), warmed up, and its serving loop started (``serve/loading.py``): what the
    server waits for before /health answers 200. ``wrap_engine``: ``ServingCore``'s (a test's fault injector)."""
    core, seconds = loading.load_core(options.build_dir, options.runtime_options, options.max_batch_rows, log,
                                      options.verify, options.warmup, max_waiting=options.max_waiting,
                                      wrap_engine=wrap_engine, default_mode=options.default_mode)
    log(f"ssd_trt: loaded {options.build_dir} in {seconds:.1f}s; serving {options.served_name!r} "
        f"at http://{options.host}:{options.port}/v1 (continuous batching up to {core.max_running} requests)")
    return core


def serve(options: ServerOptions, wrap_engine: EngineWrapper | None = None,
          add_routes: Callable[[Any, Any], None] | None = None) -> int:
    """Serve until SIGINT / SIGTERM; 1 if the build failed to load. ``wrap_engine`` and ``add_routes`` (called with
    the FastAPI app and its ``ServerState``) are for tests: a fault injector and the routes that drive it."""
    import uvicorn

    from ssd_trt.serve.openai.app import ServerState, create_app
    # a wrong path or batch fails now, not on the loader thread
    loading.batch_rows(options.max_batch_rows, read_manifest(Path(options.build_dir)).recipe.engine.max_batch)
    loading.runtime_options(options.runtime_options)
    if options.max_waiting < 1:
        raise ConfigError(f"--max-waiting must be >= 1, got {options.max_waiting}")
    failures: list[str] = []
    state = ServerState(options.served_name, lambda: load_core(options, wrap_engine), log, aliases=options.aliases,
                        api_key=options.api_key)
    app = create_app(state)
    if add_routes is not None:
        add_routes(app, state)
    server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port,
                                           log_level=options.log_level, access_log=options.access_log,
                                           timeout_graceful_shutdown=options.graceful_timeout + DRAIN_MARGIN_S))

    def failed(message: str) -> None:
        failures.append(message)
        server.should_exit = True
    state.on_failure = failed
    drain_on_exit(server, state, options.graceful_timeout)
    server.run()
    return 1 if failures else 0


def drain_on_exit(server, state, grace_s: float) -> None:
    """Make uvicorn's exit signal start the serving loop's drain (``ServingCore.drain``, on a thread of its own)
    as uvicorn stops listening: uvicorn alone would only wait for the connections and then cut the streams still
    open, without a last event."""
    exit_server = server.handle_exit

    def handle_exit(sig, frame) -> None:
        core = state.core
        if core is not None and core.stopping is None:
            core.stopping = "the server is shutting down"
            threading.Thread(target=core.drain, args=(grace_s,), name="ssd-trt-drain", daemon=True).start()
        exit_server(sig, frame)
    server.handle_exit = handle_exit
