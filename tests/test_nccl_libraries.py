"""One NCCL for torch's process group and TensorRT's all-reduce (``engines/communicator.py``), read from the
process's memory map: the parsing on sample ``/proc/self/maps`` text, the refusal naming both libraries, and a
split target's engine refusing at load."""
from __future__ import annotations

import pytest
import torch

from ssd_trt.engines import communicator
from ssd_trt.engines.communicator import RankCommunicator, check_same_nccl, nccl_communicator, nccl_libraries

TORCH_NCCL = "/opt/venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2"
SYSTEM_NCCL = "/usr/lib/x86_64-linux-gnu/libnccl.so.2.21.5"
MAPS = f"""\
55d0c8a00000-55d0c8a2b000 r--p 00000000 fd:01 1321                       /usr/bin/python3.11
7f3a10000000-7f3a10021000 rw-p 00000000 00:00 0
7f3a1c000000-7f3a1e400000 r--p 00000000 fd:01 99120                      {TORCH_NCCL}
7f3a1e400000-7f3a2b000000 r-xp 02400000 fd:01 99120                      {TORCH_NCCL}
7f3a2c000000-7f3a2c200000 r-xp 00000000 fd:01 99311                      /opt/venv/torch/lib/libtorch_cuda.so
7f3a2d000000-7f3a2d100000 r-xp 00000000 fd:01 99400                      /opt/my libs/libnccl-net.so
7ffd4a3c1000-7ffd4a3e2000 rw-p 00000000 00:00 0                          [stack]
"""
WITH_TENSORRTS = MAPS + f"""\
7f3a30000000-7f3a32000000 r-xp 00000000 fd:01 77001                      {SYSTEM_NCCL}
7f3a33000000-7f3a33001000 r--p 00000000 fd:01 77002                      /tmp/old/libnccl.so (deleted)
"""


def test_the_nccl_libraries_are_read_from_the_memory_map():
    assert nccl_libraries(MAPS) == (TORCH_NCCL,)        # each file once; the NCCL net plugin is not NCCL
    assert nccl_libraries(WITH_TENSORRTS) == (TORCH_NCCL, "/tmp/old/libnccl.so", SYSTEM_NCCL)
    assert nccl_libraries("") == ()


def test_one_nccl_passes_and_a_second_is_refused_naming_both():
    check_same_nccl((TORCH_NCCL,), MAPS)                # TensorRT reused torch's libnccl.so.2
    check_same_nccl((), "")                             # nothing mapped: nothing to compare
    with pytest.raises(RuntimeError, match=f"TensorRT's all-reduce loaded /tmp/old/libnccl.so and {SYSTEM_NCCL}, "
                                           f"but torch's process group .* with {TORCH_NCCL}"):
        check_same_nccl((TORCH_NCCL,), WITH_TENSORRTS)
    with pytest.raises(RuntimeError, match="with the NCCL linked into torch"):
        check_same_nccl((), MAPS)                       # torch's NCCL is static, TensorRT loaded one


def test_the_communicator_records_the_nccl_torch_made_it_with(monkeypatch):
    class Backend:
        def _comm_ptr(self) -> int:
            return 0x7F00DEADBEE0

    class Group:
        def _get_backend(self, device):
            return Backend()

    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(communicator, "process_maps", lambda: MAPS)
    made = nccl_communicator(Group(), torch.device("cpu"))
    assert isinstance(made, RankCommunicator) and made.nccl_libraries == (TORCH_NCCL,)
    monkeypatch.setattr(communicator, "process_maps", lambda: WITH_TENSORRTS)
    with pytest.raises(RuntimeError, match="maps 3 NCCL libraries"):
        nccl_communicator(Group(), torch.device("cpu"))
