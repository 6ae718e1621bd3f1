"""A tensor-parallel target behind the engine interface: N rank processes driven in lockstep, each running its share
of the target: its shard of the checkpoint (``models/rank_decoder.py``) in a
:class:`~ssd_trt.engines.torch_device.TorchDeviceEngine` (torch backend), or its TensorRT plan, whose all-reduce layers
run over the ranks' NCCL communicator, in a :class:`~ssd_trt.engines.tensorrt.TensorRTEngine` (trt backend).

Every engine call goes to every rank (``engines/rank_worker.py``); the ranks' steps meet in their all-reduces (NCCL
on GPUs, rank r on GPU r; gloo on CPU, rank r on one core); rank 0's answer is the call's. What the parent holds is a
copy of the cache lengths (every answer carries them), so ``lengths`` and the row views (``engines/rows.py``) cost no
round trip.

Faults. A rank that dies, or does not answer within ``step_timeout_s`` (hung, or waiting in an all-reduce for one
that is), fails the call with an :class:`~ssd_trt.errors.EngineError` naming the rank, its pid and exit code, and
every rank is killed at once: a rank left waiting in a collective never comes back on its own. The KV caches went
with them, so the requests in flight fail (the engine step's callers already fail every request of a step whose
target raised: ``runtime.Generator`` raises, the Triton model answers each with the error). The engine keeps the
rows' lengths, refuses to step rows that held tokens, and starts fresh ranks on the next call that needs them: a
new request (an empty row, a reset, or a rollback to nothing first) is served as if nothing had happened. Ranks are
also killed on :meth:`close`, when the engine is collected, and at interpreter exit; a rank whose parent vanishes
ends itself (``rank_worker``'s watchdog).
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ssd_trt.engines.base import EngineDefaults, EngineSpec, checked_rollback
from ssd_trt.engines.rank_worker import RankLaunch, rank_main
from ssd_trt.engines.rows import PaddedRows, check_order
from ssd_trt.errors import ArtifactError, ConfigError, EngineError, SsdTrtError
from ssd_trt.manifest import Manifest

STEP_TIMEOUT_S = 30.0           # a healthy step answers well within this; a hung rank is declared after it
START_TIMEOUT_S = 600.0         # spawning, importing torch and reading a shard of a large checkpoint
SMALL_MESSAGE = 32 << 10        # fits any pipe's buffer: sent inline, never blocks on a rank that stopped reading


@dataclass
class _Ranks:
    """One start of the ranks: their processes, the parent's ends of their pipes, the rendezvous store."""
    processes: list
    conns: list[Connection]
    store: Any
    pids: list[int] = field(default_factory=list)

    def stop(self, grace_s: float = 0.0) -> None:
        """Ask the ranks to end (``grace_s`` > 0), then kill whatever is left and reap it: no orphan, no zombie."""
        if grace_s > 0:
            for conn in self.conns:
                try:
                    conn.send(("close", ()))
                except (OSError, ValueError):
                    pass
            deadline = time.monotonic() + grace_s
            for process in self.processes:
                process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(10)
        for conn in self.conns:
            conn.close()
        self.store = None


def _stop_held(held: list) -> None:
    """The finalizer's job (collection, interpreter exit): stop the ranks the engine holds, if any."""
    if held and held[0] is not None:
        held[0].stop()
        held[0] = None


class TensorParallelEngine(EngineDefaults):
    """The engine interface (``engines/base.py``) over ``launch.ranks`` rank processes (see the module doc).

    ``spec`` describes the whole target (what the runtime checks requests against); ``launch`` tells each rank what
    to load and how to run (its ``store_port`` is filled in at each start). ``step_timeout_s``: how long one call may
    take before the ranks that have not answered count as hung (public: it may be changed between calls).
    """

    def __init__(self, spec: EngineSpec, launch: RankLaunch, *, step_timeout_s: float = STEP_TIMEOUT_S,
                 start_timeout_s: float = START_TIMEOUT_S) -> None:
        if launch.ranks < 2:
            raise ValueError(f"a tensor-parallel engine needs at least 2 ranks, got {launch.ranks}")
        self.spec, self.step_timeout_s, self.start_timeout_s = spec, step_timeout_s, start_timeout_s
        self._launch = launch
        self._held: list[_Ranks | None] = [None]      # the live ranks, shared with the finalizer
        self._finalizer = weakref.finalize(self, _stop_held, self._held)
        self._lengths = np.zeros(0, dtype=np.int32)
        self._lost: str | None = None                  # why the rows' caches are gone (a rank failed), else None
        self.restarts = 0
        self._start()

    # -- the ranks --------------------------------------------------------------------------------------------
    @property
    def rank_pids(self) -> list[int]:
        """The live ranks' process ids, rank 0 first (empty while none run: after a failure, before the next call)."""
        ranks = self._held[0]
        return list(ranks.pids) if ranks is not None else []

    def close(self) -> None:
        """Stop the ranks (asked first, then killed). A later call starts fresh ones."""
        ranks, self._held[0] = self._held[0], None
        if ranks is not None:
            ranks.stop(grace_s=5.0)

    def _start(self) -> None:
        """Spawn the ranks and wait until every one has loaded its shard and joined the process group."""
        import torch.distributed as dist
        context = multiprocessing.get_context("spawn")   # never fork a parent that holds threads and a draft
        # the parent serves the rendezvous on a port the OS picks: no free-port race between ranks
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=self.start_timeout_s))
        launch = replace(self._launch, store_port=store.port)
        processes, conns = [], []
        for rank in range(launch.ranks):
            ours, theirs = context.Pipe()
            process = context.Process(target=rank_main, args=(rank, launch, theirs, os.getpid()),
                                      name=f"ssd-target-rank-{rank}", daemon=True)
            process.start()
            theirs.close()
            processes.append(process)
            conns.append(ours)
        ranks = _Ranks(processes, conns, store)
        self._held[0] = ranks
        replies = self._gather(ranks, "start", self.start_timeout_s)
        failed = [(rank, reply[1]) for rank, reply in enumerate(replies) if reply[0] != "ready"]
        if failed:
            self._stop()
            rank, error = failed[0]
            if isinstance(error, SsdTrtError):
                raise error
            raise EngineError(f"tensor-parallel target: rank {rank} of {launch.ranks} failed to start: "
                              f"{type(error).__name__}: {error}") from error
        ranks.pids = [reply[1] for reply in replies]

    def _stop(self) -> None:
        ranks, self._held[0] = self._held[0], None
        if ranks is not None:
            ranks.stop()

    def _ranks(self) -> _Ranks:
        if self._held[0] is None:
            self._start()
            self.restarts += 1
        return self._held[0]

    # -- one call on every rank -------------------------------------------------------------------------------
    def _call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on every rank; rank 0's result. The same error on every rank (a refused argument: no
        rank stepped) is raised as it is; a rank that dies, hangs or disagrees is a fault."""
        ranks = self._ranks()
        self._post(ranks, pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL))
        replies = self._gather(ranks, method, self.step_timeout_s)
        kinds = {reply[0] for reply in replies}
        lengths = [reply[2] for reply in replies]
        if len(kinds) == 1 and all(np.array_equal(lengths[0], other) for other in lengths[1:]):
            self._lengths = lengths[0]
            if kinds == {"ok"}:
                return replies[0][1]
            raise replies[0][1]
        detail = "; ".join(f"rank {rank} " + (f"raised {type(reply[1]).__name__}: {reply[1]}" if reply[0] == "error"
                                               else f"answered, lengths {reply[2].tolist()}")
                           for rank, reply in enumerate(replies))
        raise self._fault(f"the ranks disagree after {method} ({detail})")

    def _post(self, ranks: _Ranks, payload: bytes) -> None:
        """Send one call to every rank. A large message goes from a helper thread: a rank that stopped reading
        must not block the parent past the call's timeout (``_gather`` notices it, and killing it ends the send)."""
        def send() -> None:
            for conn in ranks.conns:
                try:
                    conn.send_bytes(payload)
                except (OSError, ValueError):        # a dead rank: _gather reports it
                    return
        if len(payload) <= SMALL_MESSAGE:
            send()
        else:
            threading.Thread(target=send, name="ssd-rank-send", daemon=True).start()

    def _gather(self, ranks: _Ranks, what: str, timeout_s: float) -> list[tuple]:
        """Every rank's answer to ``what``, waited for at most ``timeout_s``; a fault when a rank dies or is late."""
        answers: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < len(ranks.conns):
            pending = [rank for rank in range(len(ranks.conns)) if rank not in answers]
            ready = wait([ranks.conns[r] for r in pending] + [ranks.processes[r].sentinel for r in pending],
                         timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raised = "".join(f"; rank {rank} raised {type(answer[1]).__name__}: {answer[1]}"
                                 for rank, answer in answers.items() if answer[0] == "error")
                raise self._fault(f"{_names(pending, ranks)} did not answer {what} within {timeout_s:g} s (hung in "
                                  "a step, or waiting in an all-reduce for a rank that is; "
                                  f"RuntimeOptions.rank_timeout_s sets the limit){raised}")
            for rank in pending:
                conn, process = ranks.conns[rank], ranks.processes[rank]
                if conn in ready:         # an answer (a rank that answered and then ended still answered)
                    try:
                        answers[rank] = conn.recv()
                        continue
                    except (EOFError, OSError):  # its end closed: the rank is gone
                        pass
                elif process.sentinel not in ready:
                    continue
                process.join(1)
                raise self._fault(f"{_names([rank], ranks)} died during {what} ({_exit_status(process.exitcode)})")
        return [answers[rank] for rank in range(len(ranks.conns))]

    def _fault(self, what: str) -> EngineError:
        """Kill every rank, remember that the rows' caches are gone, and the error the call raises."""
        self._stop()
        self._lost = what
        return EngineError(f"tensor-parallel target: {what}. Every rank was stopped; the requests in flight fail "
                           "(their KV caches were on the ranks), and the next request starts the ranks afresh")

    def _recover(self, rows: Sequence[int], batch: int) -> None:
        """After a fault, before a call that needs the ranks: the call goes on with ``rows`` (old row indices), which
        must have held nothing, as they are gone; the ranks start afresh with ``batch`` empty rows."""
        if self._lost is None:
            return
        held = [row for row in rows if self._lengths[row] > 0]
        if held:
            raise EngineError(f"tensor-parallel target: rows {held} held KV cache that was lost when the ranks failed "
                              f"({self._lost}); those requests cannot continue: abort them (or roll them back to "
                              "nothing) and send them again")
        self._lost = None
        self._lengths = np.zeros(batch, dtype=np.int32)
        if batch:
            self._call("reset", batch)

    # -- Engine interface -------------------------------------------------------------------------------------
    @property
    def lengths(self) -> np.ndarray:
        return self._lengths.copy()

    def reset(self, batch: int) -> None:
        self._lost = None           # every row starts empty: nothing lost is read
        self._call("reset", batch)

    def forward(self, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray | None = None,
                logit_indices: np.ndarray | None = None, extra: dict[str, np.ndarray] | None = None) -> np.ndarray:
        if extra:
            raise ValueError(f"{self.spec.name}: a tensor-parallel target takes no extra inputs, got {sorted(extra)}")
        self._recover(range(len(self._lengths)), len(self._lengths))
        args = [np.ascontiguousarray(input_ids), np.ascontiguousarray(position_ids)]
        args += [None if a is None else np.ascontiguousarray(a) for a in (tree_mask, logit_indices)]
        return self._call("forward", *args)

    def rollback(self, lengths: np.ndarray) -> None:
        if self._lost is not None:      # nothing on the ranks to truncate: only the lengths change
            self._lengths = checked_rollback(self._lengths, lengths)
            return
        self._call("rollback", np.asarray(lengths, dtype=np.int32))

    def select_rows(self, order: Sequence[int | None]) -> None:
        order = list(order)
        if self._lost is not None:             # the kept rows must be empty: a fresh batch of empty rows is the same
            check_order(order, len(self._lengths))
            self._recover([row for row in order if row is not None], len(order))
            return
        self._call("select_rows", order)

    def keep(self, row: int, start: int, offsets: Sequence[int]) -> None:
        self._recover(range(len(self._lengths)), len(self._lengths))
        self._call("keep", row, start, list(offsets))

    def rows(self, start: int, stop: int) -> PaddedRows:
        """Rows ``start .. stop-1``: the whole batch steps, the other rows padded (as ``DeviceStepEngine``'s)."""
        return PaddedRows(self, start, stop)


def _names(ranks_: list[int], ranks: _Ranks) -> str:
    """"rank 1 of 2 (pid 123)" / "ranks 0, 1 of 2 (pids 122, 123)"."""
    pids = [str(ranks.processes[r].pid) for r in ranks_]
    total = len(ranks.processes)
    if len(ranks_) == 1:
        return f"rank {ranks_[0]} of {total} (pid {pids[0]})"
    return f"ranks {', '.join(map(str, ranks_))} of {total} (pids {', '.join(pids)})"


def _exit_status(code: int | None) -> str:
    if code is None:
        return "exit code unknown"
    if code < 0:
        try:
            return f"exit code {code}: killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"exit code {code}: killed by signal {-code}"
    return f"exit code {code}"


# -- opening one from a build (engines/factory.py) -----------------------------------------------------------
def check_ranks_fit(manifest: Manifest, on_gpu: bool) -> None:
    """Before any weight is read: on a GPU host a target split over N ranks needs N GPUs and the draft one more; a
    build the runtime cannot split (an EAGLE-3 draft reads features a split target does not return) is refused."""
    ranks = manifest.recipe.engine.tensor_parallel
    if manifest.recipe.draft.kind == "eagle3":
        raise ArtifactError(f"this build splits the target over {ranks} ranks (engine.tensor_parallel) and pairs it "
                            "with an EAGLE-3 draft, which the tensor-parallel runtime does not feed; rebuild with "
                            "engine.tensor_parallel: 1 or with an independent draft")
    if on_gpu:
        import torch
        visible = torch.cuda.device_count()
        if visible < ranks + 1:
            raise ConfigError(f"this build splits the target over {ranks} GPUs (engine.tensor_parallel: {ranks}) and "
                              f"runs the draft on one more, GPU {ranks}: it needs {ranks + 1} GPUs, but {visible} "
                              f"{'is' if visible == 1 else 'are'} visible (see CUDA_VISIBLE_DEVICES); run it on a host "
                              f"with {ranks + 1} GPUs, or rebuild with a smaller engine.tensor_parallel")


def open_split_target(manifest: Manifest, spec: EngineSpec, checkpoint: Path, on_gpu: bool,
                      step_timeout_s: float = STEP_TIMEOUT_S) -> TensorParallelEngine:
    """The build's target over its ``engine.tensor_parallel`` ranks.

    On CPU each rank runs the reference attention math: the Triton interpreter costs ~700 ms per step of a 4-layer
    toy model where the reference takes ~5 ms (measured on 2 cores). On GPUs each rank runs the Triton kernel,
    eagerly: the ranks' all-reduces have not yet been checked inside captured CUDA graphs."""
    launch = RankLaunch(checkpoint=str(checkpoint), dtype=manifest.recipe.target.dtype,
                        limits=manifest.recipe.engine.limits, ranks=manifest.recipe.engine.tensor_parallel,
                        on_gpu=on_gpu, kernel="triton" if on_gpu else "reference", use_cuda_graphs=False,
                        collective_timeout_s=START_TIMEOUT_S)
    return TensorParallelEngine(spec, launch, step_timeout_s=step_timeout_s)


def open_split_plans(manifest: Manifest, spec: EngineSpec, root: Path, edition: str,
                     step_timeout_s: float = STEP_TIMEOUT_S) -> TensorParallelEngine:
    """The build's target over its rank plans of ``edition``, which the caller has checked (``plans.check_rank_plans``,
    ``check_ranks_fit``): rank r's plan on GPU r with the ranks' NCCL communicator. A rank's step holds its share of
    the key/value heads (``rank_spec``); the logits rank 0 returns are whole. Eager steps, as on the torch backend."""
    split = manifest.tensor_parallel
    plans = manifest.tensorrt.rank_plans("target", edition)
    launch = RankLaunch(checkpoint="", dtype=manifest.recipe.target.dtype, limits=manifest.recipe.engine.limits,
                        ranks=split.num_ranks, on_gpu=True, kernel="", use_cuda_graphs=False,
                        collective_timeout_s=START_TIMEOUT_S, backend="trt",
                        plans=tuple(str(Path(root) / plan.path) for plan in plans), edition=edition,
                        rank_spec=replace(spec, num_kv_heads=split.kv_heads_per_rank))
    return TensorParallelEngine(spec, launch, step_timeout_s=step_timeout_s)
