"""Every quantized tensor of real GGUF files read as the build reads it (gguf_blocks.parse_blocks), compared bit for
bit with gguf-py's dequantization: a count per block type, and how each was carried (bits, block, centred or
not), and any mismatch.

    python research/real_pair/check_gguf_kinds.py build/models/qwen2.5-coder-*-q4_k_m.gguf

Streams tensor by tensor, ``ROWS`` output rows at a time (memory stays well under 3 GB for a 151936-row head).
Exits 1 on any mismatch or unsupported decoder type.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import gguf
import numpy as np

from ssd_trt.models.gguf_blocks import FLOAT_KINDS, KINDS, parse_blocks

ROWS = 16384


def check_tensor(tensor) -> tuple[bool, set[str]]:
    """(all rows bit-exact, how the chunks were carried)."""
    kind = tensor.tensor_type.name
    raw = np.asarray(tensor.data)
    k = int(tensor.shape[0])
    forms = set()
    for start in range(0, raw.shape[0], ROWS):
        rows = raw[start:start + ROWS]
        weight = parse_blocks(rows, kind, k)
        forms.add(f"{weight.bits}-bit/{weight.block}" + ("" if weight.offsets is None else
                                                       ", centred" if weight.values.min() < 0 else ", uncentred"))
        if not np.array_equal(weight.dequantize(), gguf.quants.dequantize(rows, tensor.tensor_type).T):
            return False, forms
    return True, forms


def check_file(path: Path) -> bool:
    tensors, forms, bad = Counter(), {}, []
    for tensor in gguf.GGUFReader(str(path)).tensors:
        kind = tensor.tensor_type.name
        if kind in FLOAT_KINDS:
            continue
        if kind not in KINDS or len(tensor.shape) != 2:
            bad.append(f"{tensor.name}: {kind} {list(tensor.shape)} not supported")
            continue
        equal, carried = check_tensor(tensor)
        tensors[kind] += 1
        forms.setdefault(kind, set()).update(carried)
        if not equal:
            bad.append(f"{tensor.name}: {kind} dequantizes differently from gguf-py")
    print(f"{path.name}:")
    for kind, count in sorted(tensors.items()):
        print(f"  {kind}: {count} tensors, carried as {', '.join(sorted(forms[kind]))}")
    print("  all bit-exact" if not bad else "\n".join(f"  MISMATCH {line}" for line in bad))
    return not bad


if __name__ == "__main__":
    results = [check_file(Path(arg)) for arg in sys.argv[1:]]
    sys.exit(0 if all(results) else 1)
