"""The ranks' NCCL communicator, in the form TensorRT's all-reduce layers take it, and one NCCL for both.

A tensor-parallel rank plan's all-reduce layers (``trt/collectives.py``) run over an NCCL communicator that the
application creates and hands to every execution context (``IExecutionContext.set_communicator``, TensorRT for RTX
1.7 and data-centre TensorRT 11.4). Its Python binding takes the ``ncclComm_t`` as a PyCapsule holding the pointer.

The ranks already form a ``torch.distributed`` NCCL process group (rendezvous, the same one the torch backend's ranks
use); its communicator is created eagerly (``init_process_group(device_id=...)``, then one all-reduce so that it
exists on every rank) and its pointer read from the process group's NCCL backend (``_comm_ptr()``, in torch's
ProcessGroupNCCL, e.g. 2.9). Sharing it is safe here because nothing else issues collectives on it: after start-up
every collective of a rank is one of its plan's, enqueued on the engine's stream in the same order on every rank.

**One NCCL.** An ``ncclComm_t`` is a pointer into the NCCL library that made it; handed to another copy of NCCL (a
different version's structures) it is undefined behaviour. TensorRT finds its NCCL by itself ("checking for
libnccl.so.2 before falling back to libnccl.so through LD_LIBRARY_PATH", TensorRT's multi-device inference docs,
https://docs.nvidia.com/deeplearning/tensorrt/11.5.0/inference-library/multi-device-inference.html): the dynamic
loader reuses torch's ``libnccl.so.2`` when torch loaded one by that name, and loads a second library otherwise
(torch's NCCL linked statically, or found elsewhere). So the NCCL libraries mapped into the process are read from
``/proc/self/maps`` when the communicator is made (torch's) and again once TensorRT's contexts hold it
(:func:`check_same_nccl`): a library that appeared in between is TensorRT's own, and the rank refuses to start,
naming both.
"""
from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_NEW_CAPSULE = ctypes.pythonapi.PyCapsule_New
_NEW_CAPSULE.restype = ctypes.py_object
_NEW_CAPSULE.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)

_NCCL_FILE = re.compile(r"^libnccl\.so(?:\.\d+)*$")     # the library, not its net / tuner plugins


@dataclass(frozen=True, slots=True)
class RankCommunicator:
    """The ranks' communicator as ``set_communicator`` takes it, and the NCCL libraries mapped when torch made it
    (empty: torch's NCCL is linked into torch itself)."""
    capsule: Any
    nccl_libraries: tuple[str, ...]


def pointer_capsule(pointer: int) -> Any:
    """A PyCapsule holding ``pointer`` (no name, no destructor: the communicator's owner frees it)."""
    if not pointer:
        raise ValueError("a null NCCL communicator pointer: the communicator was not created")
    return _NEW_CAPSULE(ctypes.c_void_p(pointer), None, None)


def process_maps() -> str:
    """This process's memory map (``/proc/self/maps``; empty where there is none)."""
    try:
        return Path("/proc/self/maps").read_text()
    except OSError:
        return ""


def nccl_libraries(maps: str) -> tuple[str, ...]:
    """The NCCL library files mapped into a process, from its ``/proc/<pid>/maps`` text (sorted, each once)."""
    found = set()
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue                                  # an anonymous mapping
        path = fields[5].strip().removesuffix(" (deleted)")
        if _NCCL_FILE.match(path.rsplit("/", 1)[-1]):
            found.add(path)
    return tuple(sorted(found))


def check_same_nccl(torch_libraries: tuple[str, ...], maps: str) -> None:
    """RuntimeError naming both when the process now maps an NCCL library that was not mapped when torch made the
    communicator (``torch_libraries``): TensorRT's all-reduce would run torch's communicator on another NCCL."""
    added = [path for path in nccl_libraries(maps) if path not in torch_libraries]
    if not added:
        return
    torchs = " and ".join(torch_libraries) if torch_libraries else "the NCCL linked into torch (no libnccl mapped)"
    raise RuntimeError(f"TensorRT's all-reduce loaded {' and '.join(added)}, but torch's process group made the ranks' "
                       f"NCCL communicator with {torchs}: a communicator cannot cross NCCL libraries. Make both use "
                       "one libnccl.so.2 (e.g. put the directory of torch's first on LD_LIBRARY_PATH, or install the "
                       "nvidia-nccl wheel torch depends on and no other)")


def nccl_communicator(group: Any, device: Any) -> RankCommunicator:
    """The NCCL communicator of ``group`` (a ``torch.distributed`` process group on ``device``) as the capsule
    ``set_communicator`` takes, with the NCCL libraries mapped now. RuntimeError, saying what is needed, when the
    group has none, or when the process maps more than one NCCL library already."""
    import torch
    import torch.distributed as dist

    backend = group._get_backend(device)
    pointer_of = getattr(backend, "_comm_ptr", None)
    if pointer_of is None:
        raise RuntimeError(f"the ranks' process group runs {type(backend).__name__}, which has no NCCL communicator to "
                           "hand to TensorRT: TensorRT rank plans need the NCCL backend (GPUs) and a torch whose "
                           f"ProcessGroupNCCL has _comm_ptr (2.9 does); this is torch {torch.__version__}")
    dist.all_reduce(torch.zeros(1, device=device), group=group)   # the communicator exists on every rank past here
    torch.cuda.synchronize(device)
    libraries = nccl_libraries(process_maps())
    if len(libraries) > 1:
        raise RuntimeError(f"this rank maps {len(libraries)} NCCL libraries ({' and '.join(libraries)}) before "
                           "TensorRT starts: which one made torch's communicator is ambiguous; keep one libnccl")
    return RankCommunicator(pointer_capsule(int(pointer_of())), libraries)
