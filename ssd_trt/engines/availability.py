"""Is TensorRT usable here? Asked in a subprocess, because asking in-process can kill the process.

Constructing TensorRT objects on a machine without a usable GPU segfaults (no exception), and the
lean runtime wheel imports fine but cannot build engines. So the probe runs a short script in a
child interpreter: import ``tensorrt`` (>= 10.9, with ``tensorrt.plugin.aot_impl``), count CUDA
devices, construct a ``Builder``. A crash, a timeout or any failed step becomes a reason string.
"""
from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys

MIN_TENSORRT = (10, 9)

_PROBE = r"""
import json, sys

def answer(ok, reason):
    print(json.dumps({"ok": ok, "reason": reason}))
    sys.exit(0)

try:
    import tensorrt as trt
except Exception as error:
    answer(False, f"the tensorrt Python package is not importable ({type(error).__name__}: {error})")
version = getattr(trt, "__version__", "0.0")
try:
    major, minor = (int(part) for part in version.split(".")[:2])
except ValueError:
    answer(False, f"unrecognised TensorRT version {version!r}")
if (major, minor) < MIN_TENSORRT:
    answer(False, f"TensorRT {version} is older than {MIN_TENSORRT[0]}.{MIN_TENSORRT[1]} (tensorrt.plugin.aot_impl)")
try:
    import tensorrt.plugin as trtp
except Exception as error:
    answer(False, f"tensorrt.plugin is not importable with TensorRT {version} ({error})")
if not hasattr(trtp, "aot_impl"):
    answer(False, f"TensorRT {version} has no tensorrt.plugin.aot_impl")
devices = 0
try:
    from cuda.bindings import runtime as cudart
    status, devices = cudart.cudaGetDeviceCount()
    if int(status) != 0:
        devices = 0
except Exception:
    try:
        import torch
        devices = torch.cuda.device_count()
    except Exception:
        devices = 0
if devices < 1:
    answer(False, f"TensorRT {version} is installed but no CUDA device is visible")
builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
if builder is None:
    answer(False, f"TensorRT {version} could not create a Builder")
answer(True, f"TensorRT {version}, {devices} CUDA device(s)")
""".replace("MIN_TENSORRT", repr(MIN_TENSORRT))


@functools.lru_cache(maxsize=1)
def probe_tensorrt(timeout: float = 120.0) -> tuple[bool, str]:
    """(True, description) when TensorRT can build and run engines here, else (False, reason).

    Never imports TensorRT into the calling process. The answer is cached for the process.
    """
    try:
        result = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"the TensorRT probe did not finish within {timeout:.0f} s"
    if result.returncode < 0:
        name = signal.Signals(-result.returncode).name if -result.returncode in signal.valid_signals() else "?"
        return False, (f"the TensorRT probe crashed with signal {name} while constructing TensorRT objects "
                       "(typical without a usable GPU)")
    for line in reversed(result.stdout.strip().splitlines()):
        try:
            answer = json.loads(line)
        except json.JSONDecodeError:
            continue
        return bool(answer["ok"]), str(answer["reason"])
    tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
    return False, f"the TensorRT probe failed (exit code {result.returncode}): {tail[0]}"


def probe_cuda() -> tuple[bool, str]:
    """(True, device name) when torch sees a CUDA device, else (False, reason). Safe in-process."""
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        build = torch.version.cuda or "a CPU-only build"
        return False, f"no CUDA device visible to torch {torch.__version__} ({build})"
    return True, torch.cuda.get_device_name(0)


_PROBE_RTX = r"""
import json, sys

def answer(**fields):
    print(json.dumps(fields))
    sys.exit(0)

try:
    import tensorrt_rtx as trt
except Exception as error:
    answer(build=False, run=False, capabilities=[], version=None,
           reason=f"TensorRT for RTX is not importable ({type(error).__name__}: {error})")
version = getattr(trt, "__version__", "?")
builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
if builder is None:
    answer(build=False, run=False, capabilities=[], version=version,
           reason=f"TensorRT for RTX {version} could not create a Builder")
capabilities = []
try:
    from cuda.bindings import runtime as cudart
    status, count = cudart.cudaGetDeviceCount()
    for device in range(count if int(status) == 0 else 0):
        _, prop = cudart.cudaGetDeviceProperties(device)
        capabilities.append(f"sm{prop.major}{prop.minor}")
except Exception:
    try:
        import torch
        capabilities = [f"sm{a}{b}" for a, b in (torch.cuda.get_device_capability(i)
                                                 for i in range(torch.cuda.device_count()))]
    except Exception:
        capabilities = []
answer(build=True, run=bool(capabilities), capabilities=capabilities, version=version,
       reason=(f"TensorRT for RTX {version}, GPUs: {', '.join(capabilities)}" if capabilities
               else f"TensorRT for RTX {version} builds here; no CUDA device to run its plans"))
"""


@functools.lru_cache(maxsize=1)
def probe_tensorrt_rtx(timeout: float = 120.0) -> dict:
    """What TensorRT for RTX can do here, asked in a subprocess: ``build`` (no GPU needed), ``run`` (a CUDA
    device), ``capabilities`` (each device's, e.g. "sm89"), ``version`` and a ``reason`` to show."""
    failed = {"build": False, "run": False, "capabilities": [], "version": None}
    try:
        result = subprocess.run([sys.executable, "-c", _PROBE_RTX], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**failed, "reason": f"the TensorRT for RTX probe did not finish within {timeout:.0f} s"}
    for line in reversed(result.stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
    return {**failed, "reason": f"the TensorRT for RTX probe failed (exit code {result.returncode}): {tail[0]}"}
