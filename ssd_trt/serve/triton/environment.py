"""The serving virtual environment: ``tritonserver`` from the ``nvidia-pytriton`` wheel, numpy<2, tritonclient.

The Python backend's stub runs the ``python3`` first on PATH, and that interpreter's numpy must be < 2
(with numpy 2 the stub corrupts inputs). The main environment keeps numpy 2, so the server gets its own
venv layered over the environment ssd_trt runs in: a ``.pth`` file in the serving venv adds the main
environment's site directories (``site.addsitedir``, so editable installs resolve too) *after* the venv's
own, so numpy<2 from the venv wins while torch / onnxruntime / transformers / ssd_trt come from the main
environment. That works whether the main environment is the system interpreter, a virtualenv or a conda
env (``venv --system-site-packages`` would only see the *base* interpreter's packages from inside a
virtualenv). Each main environment gets its own serving venv (the default path carries a hash of its
prefix). The bundle also lacks the stub in ``backends/python/``: it is copied there from
``python_backend_stubs/<python version>/``.
"""
from __future__ import annotations

import fcntl
import hashlib
import os
import site
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ssd_trt.errors import SsdTrtError

REQUIREMENTS = ("numpy<2", "nvidia-pytriton==0.7.0", "tritonclient[http,grpc]>=2.50")
MARKER = ".ssd-trt-serve-ok"
VENV_ENV_VAR = "SSD_TRT_SERVE_VENV"
# what the model needs from the main environment, checked once under numpy<2
CHECK_IMPORTS = ("import numpy, torch, onnxruntime, transformers, ssd_trt, tritonclient.grpc, tritonclient.http, "
                 "pytriton")
MAIN_ENV_PTH = "ssd_trt_main_environment.pth"


class ServeEnvError(SsdTrtError):
    """The serving environment cannot be created or is broken."""


def default_venv() -> Path:
    """``$SSD_TRT_SERVE_VENV``, else ``~/.cache/ssd-trt/serve-venv-<hash of this environment's prefix>``."""
    if os.environ.get(VENV_ENV_VAR):
        return Path(os.environ[VENV_ENV_VAR]).expanduser().resolve()
    key = hashlib.sha256(str(Path(sys.prefix).resolve()).encode()).hexdigest()[:10]
    return Path(f"~/.cache/ssd-trt/serve-venv-{key}").expanduser().resolve()


def main_site_dirs() -> list[str]:
    """The site directories of the environment running this code (system, virtualenv or conda)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(dirs) if os.path.isdir(d)]


def link_main_environment(venv: Path) -> Path:
    """Write the ``.pth`` that appends the main environment's site dirs to the serving venv's sys.path."""
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise ServeEnvError(f"{venv} has no lib/python3*/site-packages; recreate it with "
                            f"`python -m ssd_trt.serve.triton setup --force`")
    # lines starting with "import" are executed by site.py; addsitedir also runs the .pth files found
    # there (editable installs), and appends, so the venv's own numpy<2 stays first
    lines = [f"import site; site.addsitedir({d!r})" for d in main_site_dirs()]
    path = found[0] / MAIN_ENV_PTH
    text = "\n".join(lines) + "\n"
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return path


@dataclass(frozen=True)
class ServeEnv:
    """Paths inside a ready serving venv."""
    venv: Path
    python_libdir: str | None = None        # the base interpreter's libpython dir (shared builds)

    @property
    def bin(self) -> Path:
        return self.venv / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    @property
    def bundle(self) -> Path:
        """``pytriton/tritonserver``: bin/tritonserver, backends/, python_backend_stubs/ -- from the venv, or from the
        environment running ssd_trt when nvidia-pytriton is installed there (``pip install -e '.[serve]'``: then pip
        finds it already satisfied through the venv's link and installs it nowhere else)."""
        found = sorted(self.venv.glob("lib/python3*/site-packages/pytriton/tritonserver")) + \
            [Path(d) / "pytriton" / "tritonserver" for d in main_site_dirs()
             if (Path(d) / "pytriton" / "tritonserver").is_dir()]
        if not found:
            raise ServeEnvError(f"nvidia-pytriton is not installed in {self.venv}; run "
                                f"`python -m ssd_trt.serve.triton setup --force`")
        return found[0]

    @property
    def tritonserver(self) -> Path:
        return self.bundle / "bin" / "tritonserver"

    @property
    def backend_dir(self) -> Path:
        return self.bundle / "backends"

    @property
    def libs(self) -> Path:
        """Shared libraries the bundle links against (pytriton's ``nvidia_pytriton.libs``)."""
        return self.bundle.parent.parent / "nvidia_pytriton.libs"

    def server_environment(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for ``tritonserver``: this venv's bin first on PATH (the stub's python3)."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        env["VIRTUAL_ENV"] = str(self.venv)
        env.pop("PYTHONHOME", None)
        # the stub links libpython3.X dynamically: it must be the venv's own interpreter's (e.g. a pyenv
        # build), not an older system copy, or stdlib extension modules fail with undefined symbols
        lib = os.pathsep.join(p for p in (self.python_libdir, str(self.libs)) if p)
        env["LD_LIBRARY_PATH"] = f"{lib}{os.pathsep}{env['LD_LIBRARY_PATH']}" if env.get("LD_LIBRARY_PATH") else lib
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        return env


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise ServeEnvError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    return proc.stdout


PROBE = ("import sys, sysconfig; print(f'{sys.version_info[0]}.{sys.version_info[1]}'); "
         "print(sysconfig.get_config_var('LIBDIR') if sysconfig.get_config_var('Py_ENABLE_SHARED') else '')")


def _probe(venv: Path) -> tuple[ServeEnv, str]:
    """The venv with its interpreter's libpython dir filled in (and its version, for the stub)."""
    version, libdir = (_run([str(venv / "bin" / "python"), "-c", PROBE], "probing the venv's python")
                       .strip("\n").split("\n") + [""])[:2]
    return ServeEnv(venv, libdir.strip() or None), version.strip()


def _copy_stub(env: ServeEnv, version: str) -> Path:
    stub = env.bundle / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServeEnvError(f"nvidia-pytriton ships no Python backend stub for Python {version} ({stub}); "
                            f"create the venv with Python 3.8-3.13")
    target = env.backend_dir / "python" / "triton_python_backend_stub"
    if not target.is_file() or target.stat().st_size != stub.stat().st_size:
        shutil.copy2(stub, target)
    return target


def is_ready(venv: Path | None = None) -> bool:
    venv = venv or default_venv()
    marker = venv / MARKER
    return marker.is_file() and marker.read_text().strip() == " ".join(REQUIREMENTS) \
        and (venv / "bin" / "python").exists()


def ensure_env(venv: Path | None = None, force: bool = False,
               log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr)) -> ServeEnv:
    """Create (once) and return the serving venv. Idempotent and safe against concurrent callers."""
    venv = (venv or default_venv()).resolve()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_ready(venv) and not force:
            link_main_environment(venv)
            env, version = _probe(venv)
            _copy_stub(env, version)
            return env
        if not (venv / "bin" / "python").exists():
            log(f"creating serving venv {venv} on top of {sys.prefix} (torch/onnxruntime/transformers/ssd_trt "
                f"come from there)")
            _run([sys.executable, "-m", "venv", str(venv)], "creating the venv")
        link_main_environment(venv)
        log(f"installing {', '.join(REQUIREMENTS)} into {venv}")
        env, version = _probe(venv)
        _run([str(env.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *REQUIREMENTS],
             "pip install")
        _copy_stub(env, version)
        # ssd_trt from this source tree even when it is not installed (the model repository does the same)
        source_root = str(Path(__file__).resolve().parents[3])
        check_env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (source_root,
                                                                              os.environ.get("PYTHONPATH"))))}
        _run([str(env.python), "-c", CHECK_IMPORTS + "; assert int(numpy.__version__.split('.')[0]) < 2, "
              "numpy.__version__"], "checking torch/onnxruntime/transformers/ssd_trt under numpy<2 in the venv",
             check_env)
        if not env.tritonserver.is_file():
            raise ServeEnvError(f"{env.tritonserver} is missing; the nvidia-pytriton wheel looks incomplete")
        (venv / MARKER).write_text(" ".join(REQUIREMENTS) + "\n")
        log(f"serving venv ready: {venv}")
        return env
