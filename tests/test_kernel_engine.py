"""The CPU engine on ssd-trt's own kernels (engines/kernel_engine.py, kernels/csrc/step.c) on the embedded build's
target: as accurate as ONNX Runtime's int8 graph against the fp32 model, every token row-exact whatever its step,
and a clean fallback when the kernel cannot be had."""
from __future__ import annotations

import json
import shutil
from contextlib import nullcontext

import numpy as np
import pytest
import torch

import ssd_trt
from ssd_trt.engines.kernel_engine import KernelEngine
from ssd_trt.errors import ArtifactError
from ssd_trt.kernels.artifact import INDEX_FILE, TILES_FILE, load_cpu_tiles


@pytest.fixture(scope="module")
def target(smollm2_build) -> KernelEngine:
    gen = ssd_trt.load(smollm2_build)
    engine = gen.engine("target")
    assert isinstance(engine, KernelEngine)
    return engine


def _fp32_logits(smollm2_build, ids: np.ndarray) -> np.ndarray:
    """The fp32 torch model of the same GGUF (transformers' dequantization) on one sequence."""
    from ssd_trt.manifest import read_manifest
    from ssd_trt.models.loading import load_decoder
    from ssd_trt.models.sources import resolve_source
    from ssd_trt_plugins.tree_attention.masks import causal_tree_mask
    manifest = read_manifest(smollm2_build)
    model, _ = load_decoder(resolve_source(manifest.model("target").source), torch.float32)
    c = model.config
    caches = [torch.zeros(1, c.num_kv_heads, ids.shape[1], c.head_dim) for _ in range(2 * c.num_layers)]
    with torch.no_grad():
        mask = torch.tensor(causal_tree_mask(1, ids.shape[1]))
        return model(torch.tensor(ids), torch.arange(ids.shape[1])[None], mask, torch.zeros(1, dtype=torch.int32),
                     *caches)[0][0].numpy()


def test_the_kernel_step_is_as_close_to_the_fp32_model_as_onnx_runtimes_int8_graph(smollm2_build, target):
    gen = ssd_trt.load(smollm2_build, ssd_trt.RuntimeOptions(cpu_kernel=False))
    ort = gen.engine("target")
    ids = np.array([gen.encode("def quicksort(items):\n    if len(items) <= 1:\n        return items\n    pivot =")])
    reference = _fp32_logits(smollm2_build, ids)
    errors, agreement = {}, {}
    for name, engine in (("kernel", target), ("ort", ort)):
        engine.reset(1)
        logits = engine.forward(ids, np.arange(ids.shape[1])[None])[0]
        errors[name] = float(np.abs(logits - reference).mean())
        agreement[name] = float((logits.argmax(-1) == reference.argmax(-1)).mean())
    # both quantize activations to int8 per block (differently): the same size of error, the same top tokens
    assert errors["kernel"] < 1.5 * errors["ort"], errors
    assert agreement["kernel"] >= agreement["ort"] - 0.1 and agreement["kernel"] > 0.8, agreement


def _ragged_tree_step(target: KernelEngine, rng) -> tuple[list, np.ndarray, list]:
    """A batch of 3 rows with different prefixes, then one step of 5 new tokens each under random tree masks."""
    prefixes = [rng.integers(100, 40000, n) for n in (3, 11, 7)]
    tokens = rng.integers(100, 40000, (3, 5))
    masks = np.zeros((3, 5, 5), bool)
    for row in range(3):
        parents = [int(rng.integers(-1, i)) for i in range(5)]   # each token under an earlier one, or the prefix
        for i in range(5):
            node = i
            while node >= 0:                                   # a token sees itself and its ancestors
                masks[row, i, node] = True
                node = parents[node]
    return prefixes, tokens, masks


def test_every_token_of_a_batched_tree_step_gets_the_logits_it_gets_alone(target):
    """Row exactness: a token's logits in a step of 3 ragged rows x 5 tree tokens equal, bit for bit, the logits of
    the same token fed alone after its row's prefix and its ancestors (what AR decoding computes)."""
    rng = np.random.default_rng(7)
    prefixes, tokens, masks = _ragged_tree_step(target, rng)
    width = max(len(p) for p in prefixes)
    target.reset(3)
    for row, prefix in enumerate(prefixes):       # prefill each row through its own rows() view
        target.rows(row, row + 1).forward(prefix[None], np.arange(len(prefix))[None])
    lengths = target.lengths
    depth = masks.sum(-1) - 1
    positions = lengths[:, None] + depth
    batched = target.forward(tokens, positions, masks)
    assert width == 11 and batched.shape == (3, 5, target.spec.vocab_size)
    for row in range(3):
        for i in range(5):
            ancestors = [j for j in range(5) if masks[row, i, j]]
            target.reset(1)
            target.forward(prefixes[row][None], np.arange(len(prefixes[row]))[None])
            for step, j in enumerate(ancestors):
                alone = target.forward(tokens[row, j][None, None], np.array([[len(prefixes[row]) + step]]))
            assert np.array_equal(alone[0, 0], batched[row, i]), f"row {row}, token {i}"


def test_a_two_thread_pool_gives_the_one_thread_pools_bits(target):
    rng = np.random.default_rng(1)
    ids = rng.integers(100, 40000, (4, 9))
    runs = []
    for alone in (None, False, True):
        target.reset(4)
        with target.alone(alone) if alone is not None else nullcontext():
            runs.append(target.forward(ids, np.arange(9)[None].repeat(4, 0)))
    assert all(np.array_equal(runs[0], other) for other in runs[1:])


def test_logit_indices_pick_the_tokens_that_pay_the_head(target):
    ids = np.random.default_rng(2).integers(100, 40000, (2, 6))
    target.reset(2)
    every = target.forward(ids, np.arange(6)[None].repeat(2, 0))
    target.reset(2)
    picked = target.forward(ids, np.arange(6)[None].repeat(2, 0), logit_indices=np.array([[5, 1], [0, 3]]))
    assert np.array_equal(picked[0], every[0, [5, 1]]) and np.array_equal(picked[1], every[1, [0, 3]])


def test_bad_step_inputs_are_refused_before_any_cache_write(target):
    target.reset(1)
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 49152\)"):
        target.forward(np.array([[5, 49152]]), np.arange(2)[None])
    with pytest.raises(ValueError, match="positions must lie"):
        target.forward(np.array([[5]]), np.array([[-1]]))
    assert target.lengths.tolist() == [0]


def test_a_corrupt_tiles_artifact_is_named_with_the_fix(smollm2_build, tmp_path):
    folder = tmp_path / "target"
    folder.mkdir()
    shutil.copy(smollm2_build / "target" / INDEX_FILE, folder / INDEX_FILE)
    with open(smollm2_build / "target" / TILES_FILE, "rb") as src, open(folder / TILES_FILE, "wb") as dst:
        dst.write(src.read(1000))
    with pytest.raises(ArtifactError, match="cpu_tiles.bin is missing or not the .* bytes its index says; rebuild"):
        load_cpu_tiles(folder)
    index = json.loads((folder / INDEX_FILE).read_text())
    (folder / INDEX_FILE).write_text(json.dumps({**index, "format": 99}))
    with pytest.raises(ArtifactError, match="format 99"):
        load_cpu_tiles(folder)


def test_without_a_compiler_the_engine_keeps_onnx_runtime_with_one_line(smollm2_build, tmp_path, monkeypatch, capsys):
    from ssd_trt.engines.ort import OrtEngine
    monkeypatch.setenv("CC", str(tmp_path / "no-such-gcc"))
    monkeypatch.setenv("SSD_TRT_KERNEL_CACHE", str(tmp_path / "cache"))
    gen = ssd_trt.load(smollm2_build)
    assert isinstance(gen.engine("target"), OrtEngine)
    lines = [line for line in capsys.readouterr().err.splitlines() if "MatMulNBits" in line]
    assert lines == [f"ssd-trt: the target runs on ONNX Runtime's MatMulNBits, not the CPU kernel: no C compiler: "
                     f"{tmp_path / 'no-such-gcc'} --version failed ([Errno 2] No such file or directory: "
                     f"'{tmp_path / 'no-such-gcc'}'); install gcc"]


def test_the_build_records_and_checks_its_cpu_tiles(smollm2_build):
    from ssd_trt.manifest import read_manifest
    manifest = read_manifest(smollm2_build)
    target, draft = manifest.validation["target_cpu_tiles"], manifest.validation["draft_cpu_tiles"]
    assert target["written"] and target["checked"] and target["top1_agreement_vs_ort"] > 0.7
    assert not draft["written"] and "weights: gguf, activations: int8" in draft["reason"]
    assert manifest.artifact("target", "cpu_tiles") is not None and manifest.artifact("draft", "cpu_tiles") is None


def _top_k_probs(logits: np.ndarray, temperature: float, k: int) -> dict[int, float]:
    scaled = logits.astype(np.float64) / temperature
    top = np.argsort(-scaled)[:k]
    weights = np.exp(scaled[top] - scaled[top].max())
    return dict(zip(top.tolist(), (weights / weights.sum()).tolist()))


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_sampled_speculation_on_the_kernel_engine_draws_the_target_distribution(smollm2_build, mode):
    """T=1, top-k 3, the first two tokens: 400 draws against the exact distribution enumerated from the kernel
    engine's own logits (9 outcomes), within 1.5x the noise floor of an exact sampler plus 0.005."""
    from ssd_trt.decoding.params import SamplingParams
    gen = ssd_trt.load(smollm2_build)
    target = gen.engine("target")
    prompt = gen.encode("The weather today is")
    target.reset(1)
    first = _top_k_probs(target.forward(np.array([prompt]), np.arange(len(prompt))[None])[0, -1], 1.0, 3)
    exact = {}
    for token, p in first.items():
        target.reset(1)
        ids = prompt + [token]
        second = _top_k_probs(target.forward(np.array([ids]), np.arange(len(ids))[None])[0, -1], 1.0, 3)
        exact.update({(token, t): p * q for t, q in second.items()})
    gen.engines.free_slots()
    samples = []
    for call in range(25):
        params = SamplingParams(max_new_tokens=2, temperature=1.0, top_k=3, seed=call, stop_on_eos=False)
        samples += [tuple(r.token_ids) for r in gen.generate_ids([prompt] * 16, params, mode=mode)]
    counts = {s: samples.count(s) / len(samples) for s in set(samples)}
    assert set(counts) <= set(exact), "a sampled pair outside the top-k support"
    tv = 0.5 * sum(abs(counts.get(s, 0.0) - p) for s, p in exact.items())
    probs = np.array(list(exact.values()))
    floor = float(0.5 * np.sum(np.sqrt(2 * probs * (1 - probs) / (np.pi * len(samples)))))
    assert tv < 1.5 * floor + 0.005, f"{mode}: TV {tv:.4f} against a noise floor of {floor:.4f}"
