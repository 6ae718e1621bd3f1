"""research/real_size/paper_pair_gpu_bench.py: the GPU benchmark of the paper's pair shapes (an oracle draft sets
the acceptance), run on CPU with tiny shapes."""
from __future__ import annotations

import json
from pathlib import Path

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_the_real_size_gpu_bench_runs_its_code_path_on_cpu_with_tiny_shapes(tmp_path):
    """research/real_size/paper_pair_gpu_bench.py (the GPU benchmark of the paper's pair shapes) on CPU: SD and SSD equal
    AR, and the oracle draft's acceptance setting moves the measured acceptance as it should."""
    main = load_script(ROOT / "research" / "real_size" / "paper_pair_gpu_bench.py").main
    out = tmp_path / "real_size.json"
    code = main(["--preset", "tiny", "--device", "cpu", "--dtype", "fp32", "--prompts", "2", "--prompt-tokens", "12",
                 "--new-tokens", "24", "--acceptance", "0.2,0.95", "--out", str(out)])
    results = json.loads(out.read_text())
    assert code == 0 and results["exact"]
    low, high = results["points"]
    assert low["sd"]["mean_accepted"] < 1.0 < 2.0 < high["sd"]["mean_accepted"]
    assert high["ssd"]["cache_hit_rate"] > 0.5 and high["ssd"]["mean_accepted"] > 2.0
