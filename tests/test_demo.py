"""`python -m ssd_trt.demo` (what scripts/demo.sh runs): each mode's text, then a table that explains the run."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_ends_with_a_table_per_mode_and_how_to_read_it(tiny_pairs):
    """The default mode as a user gets it (ssd: adapts), and beside it SSD at the build's K and budget every round
    (ssd*: the draft on its own core, beside every verification), labelled as such."""
    result = subprocess.run([sys.executable, "-m", "ssd_trt.demo", str(tiny_pairs["perturbed"]), "--no-chat",
                             "--prompt", "w1 w2 w3", "--max-new-tokens", "12"],
                            cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert [line for line in out.splitlines() if line.startswith("== mode")] == \
        ["== mode ar ==", "== mode sd ==", "== mode ssd ==", "== mode ssd* (K=4, B=8, every round) =="]
    table = out[out.index("mode  tok/s"):]
    rows = {line.split()[0]: line for line in table.splitlines()[1:5]}
    assert set(rows) == {"ar", "sd", "ssd", "ssd*"}
    number = r"\d+\.\d+"
    # AR's and SD's target steps run while the draft idles: on the draft's core too
    assert re.match(rf"ar\s+{number}\s+-\s+-\s+-\s+-\s+core 0,1, 2 threads\s+-$", rows["ar"]), rows["ar"]
    assert re.match(rf"sd\s+{number}\s+{number}\s+-\s+{number}\s+{number}\s+core 0,1, 2 threads\s+core 1, 1 thread "
                    rf"\(in turn with the target\)$", rows["sd"]), rows["sd"]
    # the default SSD runs its target on the draft's core too in the rounds it does not speculate beside it
    assert re.match(rf"ssd\s+{number}\s+.*\s+core 0,1, 2 threads while the draft idles, else core 0, 1 thread\s+"
                    rf"core 1, 1 thread \(beside it, or in turn\)$", rows["ssd"]), rows["ssd"]
    assert re.match(rf"ssd\*\s+{number}\s+{number}\s+{number}\s+{number}\s+{number}\s+core 0, 1 thread\s+"
                    rf"core 1, 1 thread \(its own, beside every verification\)$", rows["ssd*"]), rows["ssd*"]
    assert "How to read it" in table
