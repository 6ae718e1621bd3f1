"""``python -m ssd_trt.serve.openai BUILD_DIR [--host 127.0.0.1] [--port 8000]``: an OpenAI-compatible HTTP server.

``python -m ssd_trt.serve.openai load-bench BUILD_DIR``: its load test beside the Triton frontend (``load_bench.py``).
See docs/serving.md ("OpenAI-compatible server").
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ssd_trt.arguments import ArgumentParser
from ssd_trt.decoding.settings import DEFAULT_MODE, MODES
from ssd_trt.errors import SsdTrtError
from ssd_trt.serve.openai.auth import ENV_KEY, api_key
from ssd_trt.serve.openai.server import GRACEFUL_TIMEOUT_S, ServerOptions, serve

SERVER_PACKAGES = ("fastapi", "starlette", "uvicorn", "anyio", "openai")


def parser(prog: str = "python -m ssd_trt.serve.openai", description: str = __doc__, model_metavar: str = "BUILD_DIR",
           model_help: str = "a build directory (python -m ssd_trt.build)") -> argparse.ArgumentParser:
    """The command line; ``ssd-trt serve`` (``from_files/cli.py``) extends it with the model-file flags."""
    p = ArgumentParser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("build_dir", type=Path, metavar=model_metavar, help=model_help)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model's names in the API (default: the build directory's name); the first is the one "
                        "responses and /v1/models report, requests may use any (as vLLM's)")
    p.add_argument("--api-key", default=None,
                   help=f"a key every /v1 request must send as 'Authorization: Bearer KEY' (401 otherwise; /health "
                        f"and /metrics stay open); default: the environment's {ENV_KEY}, else none")
    p.add_argument("--default-mode", choices=MODES, default=DEFAULT_MODE,
                   help=f"the mode of a request that names none (its 'mode' field; default {DEFAULT_MODE})")
    p.add_argument("--graceful-timeout", type=float, default=GRACEFUL_TIMEOUT_S, metavar="SECONDS",
                   help="after SIGTERM, how long requests in flight get to finish before the server stops (keep it "
                        "within the pod's terminationGracePeriodSeconds less its preStop sleep)")
    p.add_argument("--max-batch-rows", type=int, default=0,
                   help="requests decoded together (default and at most: the engine's max batch)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="requests queued beyond those; one more is answered 503 (retry later)")
    p.add_argument("--runtime-options", default="{}",
                   help='RuntimeOptions as JSON, e.g. \'{"target_threads": 2, "target_cores": null}\'')
    p.add_argument("--no-verify", action="store_true", help="skip the artifacts' checksums at load")
    p.add_argument("--no-warmup", action="store_true", help="skip the 2-token warm-up request per mode")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="do not log every HTTP request")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["load-bench"]:
        from ssd_trt.serve.openai.load_bench import main as load_bench
        return load_bench(argv[1:])
    return run(parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Serve as ``args`` (of :func:`parser`) say, until SIGINT / SIGTERM."""
    if args.graceful_timeout < 0:
        parser().error(f"--graceful-timeout must be >= 0 seconds, got {args.graceful_timeout}")
    names = args.served_model_name or [None]
    try:
        options = ServerOptions(args.build_dir, args.host, args.port, names[0], args.max_batch_rows,
                                args.max_waiting, json.loads(args.runtime_options), not args.no_verify,
                                not args.no_warmup, args.log_level, not args.no_access_log, aliases=tuple(names[1:]),
                                api_key=api_key(args.api_key), graceful_timeout=args.graceful_timeout,
                                default_mode=args.default_mode)
        return serve(options)
    except json.JSONDecodeError as exc:
        print(f"error: --runtime-options is not valid JSON ({exc})", file=sys.stderr)
    except ImportError as exc:
        if exc.name not in SERVER_PACKAGES:
            raise
        print(f"error: {exc.name} is not installed; the OpenAI server needs the 'openai' extra: "
              f"pip install -e '.[openai]'", file=sys.stderr)
    except SsdTrtError as exc:
        print(f"error: {exc}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
