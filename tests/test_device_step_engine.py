"""The GPU step runtime (``engines/device_step.py``) with the torch/Triton launcher (``engines/torch_device.py``).

On CPU the engine runs the same forward / padding / rollback / keep code with the tree-attention kernel
in the Triton interpreter, every step eagerly: checked against the real ONNX Runtime engine of the
same model on one step script, and under the decoding strategies (greedy SD and SSD == AR). On a GPU
(marked ``gpu``, skipped here with the reason) the same checks run with CUDA graphs replayed.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ssd_trt
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.settings import AR, SD, SSD
from tests.step_script import step_script
from ssd_trt.engines.torch_device import TorchDeviceEngine
from ssd_trt.engines.availability import probe_cuda
from ssd_trt.engines.limits import EngineLimits
from tests.engine_generator import GeneratorOverEngines
from tests.helpers import perturbed, random_decoder, tiny_config

HAS_CUDA, CUDA_REASON = probe_cuda()
LIMITS = EngineLimits(max_batch=4, max_context=128, max_draft_len=3, max_tree_size=32)
PROMPTS = [[1, 5, 9, 33, 7], [1, 100, 3], [1, 42, 42, 42, 42, 8, 19]]


def test_step_script_matches_the_onnx_runtime_engine(tiny_pairs):
    reference = step_script(ssd_trt.load(tiny_pairs["self"]).engine("target"), PROMPTS[:2], 3, 4)
    engine = TorchDeviceEngine(random_decoder(tiny_config(), seed=0), LIMITS, device="cpu")  # the same target
    for ours, theirs in zip(step_script(engine, PROMPTS[:2], 3, 4), reference):
        np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=0)
    assert engine.last_step_ms > 0


def greedy_runs(target, draft, prompts, new_tokens: int) -> dict[str, list[list[int]]]:
    """Each mode's greedy tokens through the runtime's engine step over these engines."""
    gen = GeneratorOverEngines(lambda: target, lambda: draft, LIMITS, eos_ids=frozenset({2}))
    params = SamplingParams(max_new_tokens=new_tokens, stop_on_eos=False)
    return {name: [r.token_ids for r in gen.generate_ids(prompts, params, mode=mode)]
            for name, mode in (("ar", AR()), ("sd", SD(draft_len=3)), ("ssd", SSD(draft_len=3, fan_out_budget=8)))}


def test_greedy_sd_and_ssd_on_this_engine_equal_autoregressive():
    """The strategies drive the engine through ragged, chain, tree and keep steps, SSD from two threads."""
    model = random_decoder(tiny_config(), seed=0)
    target = TorchDeviceEngine(model, LIMITS, name="target", device="cpu")
    draft = TorchDeviceEngine(perturbed(model, seed=1, amount=0.05), LIMITS, name="draft", device="cpu")
    outputs = greedy_runs(target, draft, PROMPTS[:2], new_tokens=10)
    assert outputs["sd"] == outputs["ar"]
    assert outputs["ssd"] == outputs["ar"]
    assert len(outputs["ar"][0]) == 10


def test_clear_errors_for_a_missing_gpu_and_a_bad_dtype():
    model = random_decoder(tiny_config(), seed=0)
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="needs a CUDA GPU.*device='cpu'"):
            TorchDeviceEngine(model, LIMITS, device="cuda")
    with pytest.raises(ValueError, match="dtype must be float32, float16 or bfloat16"):
        TorchDeviceEngine(model, LIMITS, device="cpu", dtype=torch.float64)


def test_rotary_frequencies_stay_fp32_in_a_bf16_engine():
    engine = TorchDeviceEngine(random_decoder(tiny_config(), seed=0), LIMITS, device="cpu", dtype=torch.bfloat16)
    assert engine.model.inv_freq.dtype == torch.float32
    assert engine.model.embed_tokens.weight.dtype == torch.bfloat16
    assert engine.caches[0][0].dtype == torch.bfloat16


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason=f"needs a CUDA GPU: {CUDA_REASON}")
def test_cuda_graph_engine_matches_the_cpu_engine_and_stays_lossless():
    model = random_decoder(tiny_config(), seed=0)
    gpu = TorchDeviceEngine(model, LIMITS, device="cuda")
    cpu = TorchDeviceEngine(random_decoder(tiny_config(), seed=0), LIMITS, device="cpu", kernel="reference")
    for ours, theirs in zip(step_script(gpu, PROMPTS[:2], 3, 4), step_script(cpu, PROMPTS[:2], 3, 4)):
        np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=0)
    assert gpu.captured_buckets, "decode / verify / tree steps should replay CUDA graphs"
    draft = TorchDeviceEngine(perturbed(random_decoder(tiny_config(), seed=0), seed=1, amount=0.05), LIMITS,
                              name="draft", device="cuda")
    outputs = greedy_runs(gpu, draft, PROMPTS, new_tokens=24)
    assert outputs["sd"] == outputs["ar"] and outputs["ssd"] == outputs["ar"]


# ---- the runtime's torch backend ---------------------------------------------------------------------------

# SSD with K and budget set: every round speculates. (Left unset, the load policy would first time the engine at
# every batch and step size -- on this CPU, through the Triton kernel's interpreter, most of a minute.)
@pytest.mark.parametrize("mode", ["ar", "sd", SSD(draft_len=2, fan_out_budget=4)], ids=["ar", "sd", "ssd"])
def test_the_torch_backend_generates_exactly_what_onnx_runtime_does(tiny_pairs, mode):
    from ssd_trt.runtime import RuntimeOptions
    params = SamplingParams(max_new_tokens=12, stop_on_eos=False)
    prompts = PROMPTS[:2]
    reference = [r.token_ids for r in ssd_trt.load(tiny_pairs["perturbed"]).generate_ids(prompts, params, mode="ar")]
    gen = ssd_trt.load(tiny_pairs["perturbed"], RuntimeOptions(backend="torch"))
    assert gen.engines.backend("target") == "torch"
    assert isinstance(gen.engine("target"), TorchDeviceEngine)
    assert [r.token_ids for r in gen.generate_ids(prompts, params, mode=mode)] == reference


def test_the_torch_backend_refuses_a_source_that_changed_or_vanished(tiny_pairs, tmp_path):
    import json
    import shutil

    from ssd_trt.errors import ArtifactError, ConfigError
    from ssd_trt.runtime import RuntimeOptions
    build = tmp_path / "build"
    shutil.copytree(tiny_pairs["perturbed"], build)
    manifest = json.loads((build / "manifest.json").read_text())
    manifest["models"]["target"]["source_sha256"] = "0" * 64
    manifest["models"]["draft"]["source"] = str(tmp_path / "gone")
    (build / "manifest.json").write_text(json.dumps(manifest))
    gen = ssd_trt.load(build, RuntimeOptions(backend="torch"))
    with pytest.raises(ArtifactError, match="target source .* changed since .* rebuild, or use the ort backend"):
        gen.engine("target")
    with pytest.raises(ArtifactError, match="reloads the draft weights .* not usable"):
        gen.engine("draft")
    with pytest.raises(ConfigError, match="backend must be one of ort, trt, torch"):
        RuntimeOptions(backend="cuda")
