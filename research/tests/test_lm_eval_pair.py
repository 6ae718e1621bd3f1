"""lm-evaluation-harness, as its users run it, against the real OpenAI server (``research/serving/lm_eval_pair.py``):
model ``local-completions`` with ``--batch_size 4`` (four token-id prompts per request; loglikelihoods by ``echo``,
``logprobs: 1``, ``max_tokens: 1``), one loglikelihood task (10 questions, 40 choices) and one generate-until task
(4 prompts), on the embedded pair's fp32 build, beside lm-eval's own transformers backend on the same weights."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-4          # loglikelihoods, server against transformers (docs/serving.md)


@pytest.mark.slow
def test_lm_eval_local_completions_matches_its_transformers_backend_and_ar_equals_ssd():
    pytest.importorskip("lm_eval")
    subprocess.run([sys.executable, "-m", "ssd_trt.build", str(ROOT / "recipes/smollm2-135m-fp32.yaml"),
                    "--if-stale"], cwd=ROOT, check=True)
    pair = load_script(ROOT / "research/serving/lm_eval_pair.py")
    result = pair.run_pair(ROOT / "build/smollm2-135m-fp32", Path(sys.prefix))
    comparison = result["comparison"]
    for run in ("server-ar", "server-ssd"):
        assert len(result["runs"][run]["loglikelihoods"]) == 40 and len(result["runs"][run]["answers"]) == 4
        assert comparison[run]["max_abs_ll_diff"] < TOLERANCE, comparison
        assert comparison[run]["is_greedy_diffs"] == 0, comparison
    assert comparison["ar_equals_ssd"], result["runs"]["server-ssd"]["answers"]
