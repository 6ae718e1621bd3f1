"""``python -m tests.fault_server BUILD PORT FAIL_RATE GRACE_S``: the OpenAI server over the fault injector
(``fault_injection.py``), with test-only routes that drive it: ``GET /_faults/held`` (what the engine holds),
``POST /_faults/kill`` (the next step ends the step thread), ``POST /_faults/rate?value=`` (the failing steps' rate)."""
from __future__ import annotations

import sys
from pathlib import Path

from ssd_trt.serve.openai.server import ServerOptions, serve
from tests.fault_injection import FaultInjector


def main(argv: list[str]) -> int:
    build, port, fail_rate, grace_s = Path(argv[0]), int(argv[1]), float(argv[2]), float(argv[3])
    injectors: list[FaultInjector] = []

    def wrap(llm):
        injectors.append(FaultInjector(llm, fail_rate, seed=0))
        return injectors[-1]

    def add_routes(app, state) -> None:     # noqa: ARG001
        @app.get("/_faults/held")
        async def held() -> dict:
            return injectors[-1].held()

        @app.post("/_faults/kill")
        async def kill() -> dict:
            injectors[-1].kill()
            return {}

        @app.post("/_faults/rate")
        async def rate(value: float) -> dict:
            injectors[-1].fail_rate = value
            return {}
    options = ServerOptions(build, port=port, verify=False, warmup=False, log_level="warning", access_log=False,
                            graceful_timeout=grace_s)
    return serve(options, wrap, add_routes)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
