"""One rank of a tensor-parallel target, in its own process: claim a device, join the process group, open the rank's
engine (its shard of the checkpoint on the torch backend, or its TensorRT plan with the ranks' NCCL communicator), then
run the engine calls the parent sends over a pipe (``engines/tensor_parallel.py``).

Every rank runs every call, in the same order, with the same arguments (the ranks' steps meet in their all-reduces);
rank 0 answers with the call's result, the others with an acknowledgement only (the logits are replicated on every
rank: only one copy needs to cross a pipe). Each answer carries the rank's cache lengths after the call, so the parent
can check that the ranks agree and can answer ``lengths`` without asking.

Messages (pickled over a ``multiprocessing`` pipe):
  parent -> rank   (method, args)        an engine call: reset, forward, rollback, select_rows, keep; ("close", ())
  rank -> parent   ("ready", pid)        the shard is loaded and the process group formed
                   ("ok", result, lengths) | ("error", exception, lengths)

A rank ends when the parent closes its pipe or asks it to, and on its own when the parent process disappears (a
watchdog thread), so a parent killed without cleanup leaves no rank behind.
"""
from __future__ import annotations

import os
import pickle
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Literal

from ssd_trt.engines.base import EngineSpec
from ssd_trt.engines.limits import EngineLimits

CALLS = ("reset", "forward", "rollback", "select_rows", "keep")


@dataclass(frozen=True, slots=True)
class RankLaunch:
    """What every rank needs to open its part of the target: the engine limits, the number of ranks, the rendezvous
    (a TCPStore the parent serves on 127.0.0.1), and what each rank runs:

    * ``backend="torch"``: the HF ``checkpoint`` in ``dtype``, each rank reading its Megatron shard, the step on
      ``kernel`` (CPU or GPU);
    * ``backend="trt"``: ``plans[r]``, rank r's TensorRT plan of ``edition`` (built with its all-reduce layers), whose
      step ``rank_spec`` describes (a rank's share of the key/value heads), on GPU r.
    """
    checkpoint: str
    dtype: str                  # torch dtype name: float32 | float16 | bfloat16
    limits: EngineLimits
    ranks: int
    on_gpu: bool
    kernel: str                 # "triton" | "reference" (engines/torch_device.py)
    use_cuda_graphs: bool
    collective_timeout_s: float
    store_port: int = 0         # the parent's TCPStore, a new one at each start of the ranks
    backend: Literal["torch", "trt"] = "torch"
    plans: tuple[str, ...] = ()
    edition: str = "datacenter"
    rank_spec: EngineSpec | None = None


def rank_main(rank: int, launch: RankLaunch, conn: Connection, parent_pid: int) -> None:
    """The rank process's entry point (``multiprocessing`` spawn target)."""
    _exit_with_parent(parent_pid)
    try:
        engine = _open(rank, launch)
    except BaseException as exc:  # noqa: BLE001 -- whatever failed, the parent hears why before the rank ends
        _send(conn, ("error", exc, None))
        raise SystemExit(1)
    conn.send(("ready", os.getpid()))
    closing = _serve(engine, rank, conn)
    del engine          # a rank plan's contexts hold the communicator: they go before the process group frees it
    if closing:         # every rank is asked at once: leave the process group together
        import torch.distributed as dist
        dist.destroy_process_group()


def _open(rank: int, launch: RankLaunch):
    """The rank's device, process group and engine."""
    import torch
    import torch.distributed as dist

    from ssd_trt.engines.device_step import Placement

    if launch.on_gpu:
        device = torch.device("cuda", rank)      # rank r owns GPU r (the draft gets GPU N: engines/factory.py)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        _pin_to_core(rank)
        torch.set_num_threads(1)
        device, backend = torch.device("cpu"), "gloo"
    store = dist.TCPStore("127.0.0.1", launch.store_port, is_master=False,
                          timeout=timedelta(seconds=launch.collective_timeout_s))
    dist.init_process_group(backend, store=store, rank=rank, world_size=launch.ranks,
                            timeout=timedelta(seconds=launch.collective_timeout_s),
                            **({"device_id": device} if launch.on_gpu else {}))   # NCCL: the communicator at once
    placement = Placement(device=rank if launch.on_gpu else 0)
    if launch.backend == "trt":
        from ssd_trt.engines.communicator import nccl_communicator
        from ssd_trt.engines.tensorrt import TensorRTEngine
        # eager steps: the all-reduce layers have not been checked inside captured CUDA graphs
        return TensorRTEngine(launch.plans[rank], launch.rank_spec, name=f"target rank {rank}", placement=placement,
                              use_cuda_graphs=False, edition=launch.edition,
                              communicator=nccl_communicator(dist.group.WORLD, device))

    from ssd_trt.engines.torch_device import TorchDeviceEngine
    from ssd_trt.models.rank_decoder import load_rank_decoder
    dtype = getattr(torch, launch.dtype)
    model = load_rank_decoder(launch.checkpoint, rank, launch.ranks, dtype, reduce=dist.all_reduce)
    return TorchDeviceEngine(model, launch.limits, name=f"target rank {rank}", device=device, dtype=dtype,
                             placement=placement, use_cuda_graphs=launch.use_cuda_graphs, kernel=launch.kernel)


def _pin_to_core(rank: int) -> None:
    """A CPU rank is one core and one thread: its steps meet the other ranks' in every all-reduce, so a rank whose
    threads roam (or queue behind another rank's) stalls them all. Rank r takes core r mod the cores this process may
    use -- all of them, not the ones it inherited: the thread that spawned it may have been pinned to one core (the
    engine step's thread is), and the ranks would then share it."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))     # the kernel keeps what the cpuset allows
    except OSError:
        pass
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _serve(engine, rank: int, conn: Connection) -> bool:
    """Run the parent's calls until it closes the pipe (False) or says close (True)."""
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):          # the parent is gone
            return False
        if method == "close":
            return True
        try:
            if method not in CALLS:
                raise ValueError(f"rank {rank}: unknown engine call {method!r}")
            result = getattr(engine, method)(*args)
        except Exception as exc:  # noqa: BLE001 -- the parent decides (the same error on every rank: passed on)
            _send(conn, ("error", exc, engine.lengths))
            continue
        _send(conn, ("ok", result if rank == 0 else None, engine.lengths))


def _send(conn: Connection, message: tuple) -> None:
    """Send ``message``; an exception that does not survive pickling (both ways: one whose class needs other
    arguments fails only when the parent unpickles it) travels as a RuntimeError with its text."""
    if message[0] == "error":
        kind, exc, *rest = message
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:  # noqa: BLE001 -- any failure to round-trip
            message = (kind, RuntimeError(f"{type(exc).__name__}: {exc}"), *rest)
    conn.send(message)


def _exit_with_parent(parent_pid: int, every_s: float = 1.0) -> None:
    """End this process when the parent disappears (killed without closing us): a rank blocked in a collective
    would otherwise outlive it."""
    def watch() -> None:
        while True:
            time.sleep(every_s)
            if os.getppid() != parent_pid:
                os._exit(1)
    threading.Thread(target=watch, name="ssd-rank-watchdog", daemon=True).start()
