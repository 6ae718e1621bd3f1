"""The ranks' NCCL communicator, in the form TensorRT's all-reduce layers take it.

A tensor-parallel rank plan's all-reduce layers (``trt/collectives.py``) run over an NCCL communicator that the
application creates and hands to every execution context (``IExecutionContext.set_communicator``, TensorRT for RTX
1.7 and data-centre TensorRT 11.4). Its Python binding takes the ``ncclComm_t`` as a PyCapsule holding the pointer.

The ranks already form a ``torch.distributed`` NCCL process group (rendezvous, the same one the torch backend's ranks
use); its communicator is created eagerly (``init_process_group(device_id=...)``, then one all-reduce so that it
exists on every rank) and its pointer read from the process group's NCCL backend (``_comm_ptr()``, in torch's
ProcessGroupNCCL, e.g. 2.9). Sharing it is safe here because nothing else issues collectives on it: after start-up
every collective of a rank is one of its plan's, enqueued on the engine's stream in the same order on every rank.
"""
from __future__ import annotations

import ctypes
from typing import Any

_NEW_CAPSULE = ctypes.pythonapi.PyCapsule_New
_NEW_CAPSULE.restype = ctypes.py_object
_NEW_CAPSULE.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)


def pointer_capsule(pointer: int) -> Any:
    """A PyCapsule holding ``pointer`` (no name, no destructor: the communicator's owner frees it)."""
    if not pointer:
        raise ValueError("a null NCCL communicator pointer: the communicator was not created")
    return _NEW_CAPSULE(ctypes.c_void_p(pointer), None, None)


def nccl_communicator(group: Any, device: Any) -> Any:
    """The NCCL communicator of ``group`` (a ``torch.distributed`` process group on ``device``) as the capsule
    ``set_communicator`` takes. RuntimeError, saying what is needed, when the group has none."""
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
    return pointer_capsule(int(pointer_of()))
