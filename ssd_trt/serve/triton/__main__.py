"""``python -m ssd_trt.serve.triton setup | export | start | client | load-bench`` (see docs/serving.md)."""
from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from ssd_trt.errors import SsdTrtError


def _setup(args: argparse.Namespace) -> int:
    from ssd_trt.serve.triton.environment import ensure_env
    env = ensure_env(Path(args.venv) if args.venv else None, force=args.force)
    print(env.venv)
    return 0


def _client(args: argparse.Namespace, rest: list[str]) -> int:
    """Run the example client (``client.py``) in the serving venv, where tritonclient lives."""
    import os
    import subprocess

    from ssd_trt.serve.triton.environment import ensure_env
    env = ensure_env(Path(args.venv) if args.venv else None)
    source_root = str(Path(__file__).resolve().parents[2])
    path = os.pathsep.join(filter(None, (source_root, os.environ.get("PYTHONPATH"))))
    return subprocess.run([str(env.python), "-m", "ssd_trt.serve.triton.client", *rest],
                          env={**os.environ, "PYTHONPATH": path}).returncode


def _export(args: argparse.Namespace) -> int:
    from ssd_trt.serve.triton.repository import ExportOptions, export_repository
    options = ExportOptions(model_name=args.model_name, instances=args.instances,
                            max_batch_rows=args.max_batch_rows, runtime_options=json.loads(args.runtime_options),
                            verify_checksums=not args.no_verify, warmup=not args.no_warmup,
                            nonstream=not args.no_nonstream, instance_kind=args.instance_kind)
    out = export_repository(args.build_dir, args.out, options)
    models = sorted(p.name for p in out.iterdir() if (p / "config.pbtxt").is_file())
    print(f"wrote Triton model repository {out}: {', '.join(models)}")
    return 0


def _start(args: argparse.Namespace) -> int:
    from ssd_trt.serve.triton.environment import ensure_env
    from ssd_trt.serve.triton.server import ServerConfig, TritonServer
    env = ensure_env(Path(args.venv) if args.venv else None)
    server = TritonServer(ServerConfig(Path(args.repository), args.http_port, args.grpc_port,
                                       args.metrics_port or None, Path(args.log_file) if args.log_file else None,
                                       args.verbose), env)

    def stop(signum, frame):                      # noqa: ARG001
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        server.start().wait_ready(args.timeout)
        print(f"tritonserver ready: HTTP {server.http_url}, gRPC {server.grpc_url} (Ctrl-C stops it)",
              file=sys.stderr, flush=True)
        code = server.process.wait()
        print(f"tritonserver exited with code {code}", file=sys.stderr)
        return code or 0
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssd_trt.serve.triton",
                                     description="Serve an ssd-trt build directory with Triton Inference Server")
    sub = parser.add_subparsers(dest="command", required=True)
    setup = sub.add_parser("setup", help="create the serving venv (numpy<2, nvidia-pytriton, tritonclient)")
    setup.add_argument("--venv", help="default: $SSD_TRT_SERVE_VENV or ~/.cache/ssd-trt/serve-venv")
    setup.add_argument("--force", action="store_true", help="reinstall even if the venv looks ready")
    setup.set_defaults(func=_setup)

    export = sub.add_parser("export", help="write a Triton model repository for a build directory")
    export.add_argument("build_dir")
    export.add_argument("--out", required=True, help="model repository directory (created / updated)")
    export.add_argument("--model-name", default="ssd_trt")
    export.add_argument("--instances", type=int, default=1, help="model instances (each loads the engines)")
    export.add_argument("--max-batch-rows", type=int, default=0,
                        help="requests decoded together (0 = the engine's max batch; 1 = one at a time)")
    export.add_argument("--runtime-options", default="{}",
                        help='RuntimeOptions as JSON, e.g. \'{"target_threads": 2, "target_cores": null}\'')
    export.add_argument("--no-verify", action="store_true", help="skip artifact checksums at load")
    export.add_argument("--no-warmup", action="store_true", help="skip the short warm-up generation at load")
    export.add_argument("--no-nonstream", action="store_true", help="only the decoupled (streaming) model")
    export.add_argument("--instance-kind", default="auto", choices=("auto", "cpu", "gpu"),
                        help="Triton instance kind (auto: GPU when the model runs on one, see repository.py)")
    export.set_defaults(func=_export)

    start = sub.add_parser("start", help="run tritonserver (CPU, 127.0.0.1 only) on a model repository")
    start.add_argument("repository")
    start.add_argument("--http-port", type=int, default=8000)
    start.add_argument("--grpc-port", type=int, default=8001)
    start.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics (0: off)")
    start.add_argument("--log-file", help="server log (default: this terminal)")
    start.add_argument("--verbose", type=int, default=0, help="tritonserver --log-verbose level")
    start.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the models to load")
    start.add_argument("--venv", help="serving venv (created on first use)")
    start.set_defaults(func=_start)

    client = sub.add_parser("client", add_help=False,
                            help="run the example client in the serving venv (`client --help` for its options)")
    client.add_argument("--venv", help="serving venv (created on first use)")
    client.set_defaults(func=_client)

    sub.add_parser("load-bench", add_help=False,
                   help="serving under load against a real tritonserver (`load-bench --help` for its options)")

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["load-bench"]:
        from ssd_trt.serve.triton.load_bench import main as load_bench
        return load_bench(argv[1:])
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "client":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args, rest) if args.command == "client" else args.func(args)
    except (SsdTrtError, json.JSONDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
