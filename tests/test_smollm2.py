"""The embedded pair (SmolLM2-135M-Instruct, real weights): the fp32 build exact against transformers, CLI contract."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ssd_trt
from ssd_trt.bench.prompts import load_prompts
from ssd_trt.errors import RequestError

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 24


def varied_prompts(count: int) -> list[str]:
    prompts = load_prompts()
    by_category: dict[str, list[str]] = {}
    for p in prompts:
        by_category.setdefault(p.category, []).append(p.prompt)
    chosen = []
    while len(chosen) < count:                      # round-robin over categories
        for texts in by_category.values():
            if texts and len(chosen) < count:
                chosen.append(texts.pop(0))
    return chosen


@pytest.mark.slow
def test_greedy_ar_is_token_identical_to_transformers_generate(smollm2_fp32_build):
    """The fp32 reference build (the default's int8 activations approximate it: docs/weights.md)."""
    from transformers import AutoModelForCausalLM

    smollm2_build = smollm2_fp32_build
    manifest = json.loads((smollm2_build / "manifest.json").read_text())
    source = Path(manifest["models"]["target"]["source"])
    reference = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                     dtype=torch.float32).eval()
    gen = ssd_trt.load(smollm2_build)
    params = ssd_trt.SamplingParams(max_new_tokens=NEW_TOKENS)
    mismatches = []
    prompts = varied_prompts(12) + ["Hello", "1, 2, 3, 4,", "def fib(n):"]     # each of the 5 categories 2-3 times
    for prompt in prompts:
        ids = gen.encode(prompt)
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     eos_token_id=sorted(gen.eos_ids), pad_token_id=2)
        expected = out[0, len(ids):].tolist()
        [ours] = gen.generate_ids([ids], params, mode="ar")
        if ours.token_ids != expected:
            mismatches.append((prompt, ours.token_ids, expected))
    assert not mismatches, mismatches[:2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ssd_trt.generate", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_generate_cli_json_contract(smollm2_build):
    result = run_cli(str(smollm2_build), "--prompt", "The capital of France is", "--max-new-tokens", "8", "--json")
    assert result.returncode == 0, result.stderr
    line = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(line) == {"text", "token_ids", "stats"}
    assert 1 <= len(line["token_ids"]) <= 8
    for key in ("tokens_per_s", "ttft_s", "mean_accepted", "acceptance_rate", "cache_hit_rate"):
        assert key in line["stats"]
    gen = ssd_trt.load(smollm2_build)
    assert gen.tokenizer.decode(line["token_ids"], skip_special_tokens=True) == line["text"]


def test_prompt_longer_than_max_context_is_refused(smollm2_build):
    gen = ssd_trt.load(smollm2_build)
    with pytest.raises(RequestError, match="max context"):
        gen.generate("word " * 3000, ssd_trt.SamplingParams(max_new_tokens=4))
    result = run_cli(str(smollm2_build), "--prompt", "word " * 3000, "--max-new-tokens", "4")
    assert result.returncode == 2 and "max context" in result.stderr and "Traceback" not in result.stderr
