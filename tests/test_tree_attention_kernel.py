"""The Triton tree-attention kernel matches the reference math (Triton interpreter, CPU).

Every case is a random problem of one kind: chains (prefill / decode / verification), wide trees (many
branches off a few roots, masks over two int32 words), deep trees, forests of single-token branches
(the first SSD tree step), arbitrary masks, batches with ragged cache lengths, and prefill from an
empty cache; grouped-query head layouts and a head dim that is not a power of two. Each case checks
the attention output and that exactly the T new slots of each cache were written.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ssd_trt.engines.feeding import tree_mask_from_parents
import pytest
import torch

from ssd_trt_plugins.tree_attention.reference import pack_tree_mask, tree_attention_reference
from ssd_trt_plugins.tree_attention.triton_kernel import KernelSpec, tree_attention

HEADS = [(1, 1), (2, 1), (2, 2), (4, 2), (6, 2), (8, 2), (4, 1)]  # (Hq, Hkv): MHA, GQA, group of 3 (padded)
HEAD_DIMS = [16, 32, 24]  # 24 exercises the padded head dimension
BLOCKS = [(16, 16, 16), (16, 64, 32), (32, 16, 16)]  # (block_m, block_s, block_n)
# Max |error| / max |reference|; fp16/bf16 round P to the input type (as tensor-core kernels do).
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class Case:
    kind: str
    seed: int
    dtype: torch.dtype

    @property
    def id(self) -> str:
        return f"{self.kind}-{DTYPE_NAMES[self.dtype]}-{self.seed}"


def tree_from_parents(parents: list[int]) -> np.ndarray:
    """bool [T,T]: token i sees itself and its ancestors (parent -1 = a root that sees the prefix only)."""
    return tree_mask_from_parents(parents)


def random_mask(kind: str, rng: np.random.Generator, tokens: int) -> np.ndarray:
    if kind in ("chain", "prefill"):
        return np.tril(np.ones((tokens, tokens), dtype=bool))
    if kind == "wide":  # a few roots, everything else one or two levels below them
        roots = int(rng.integers(1, 4))
        parents = [-1] * roots + [int(rng.integers(0, min(node, roots + 4))) for node in range(roots, tokens)]
        return tree_from_parents(parents)
    if kind == "deep":  # long chains that branch now and then
        return tree_from_parents([-1] + [int(rng.integers(max(0, node - 3), node)) for node in range(1, tokens)])
    if kind == "forest":  # N single-token branches: each sees only itself (first draft tree step)
        return np.eye(tokens, dtype=bool)
    if kind == "arbitrary":  # any bits (not a tree), diagonal set as the contract requires
        return (rng.random((tokens, tokens)) < 0.4) | np.eye(tokens, dtype=bool)
    if kind == "ragged":
        return random_mask(str(rng.choice(["chain", "wide", "deep"])), rng, tokens)
    raise ValueError(kind)


TOKENS = {"chain": (1, 8), "prefill": (8, 48), "wide": (9, 40), "deep": (8, 36), "forest": (2, 24),
          "arbitrary": (2, 34), "ragged": (2, 10)}


def make_problem(case: Case):
    rng = np.random.default_rng(case.seed)
    q_heads, kv_heads = HEADS[rng.integers(len(HEADS))]
    dim = HEAD_DIMS[rng.integers(len(HEAD_DIMS))]
    batch = int(rng.integers(2, 4)) if case.kind == "ragged" else int(rng.integers(1, 3))
    tokens = int(rng.integers(*TOKENS[case.kind], endpoint=True))
    if case.kind == "prefill":
        lengths = np.zeros(batch, dtype=np.int32)
    elif case.kind == "ragged":  # one empty row, one long, the rest anywhere
        lengths = rng.integers(0, 40, size=batch).astype(np.int32)
        lengths[0], lengths[-1] = 0, 37
    else:
        lengths = rng.integers(0, 25, size=batch).astype(np.int32)
    capacity = int(lengths.max()) + tokens + int(rng.integers(0, 6))
    masks = np.stack([random_mask(case.kind, rng, tokens) for _ in range(batch)])
    gen = torch.Generator().manual_seed(case.seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(case.dtype)

    tensors = (randn(batch, q_heads, tokens, dim), randn(batch, kv_heads, tokens, dim),
               randn(batch, kv_heads, tokens, dim), randn(batch, kv_heads, capacity, dim),
               randn(batch, kv_heads, capacity, dim), torch.from_numpy(lengths),
               torch.from_numpy(pack_tree_mask(masks)))
    blocks = BLOCKS[rng.integers(len(BLOCKS))]
    return tensors, dim ** -0.5 * float(rng.uniform(0.5, 2.0)), blocks


CASES = ([Case(kind, seed, torch.float32) for kind, count in
          (("chain", 40), ("prefill", 25), ("wide", 30), ("deep", 30), ("forest", 20), ("arbitrary", 20),
           ("ragged", 30)) for seed in range(count)]
         + [Case(kind, 1000 + seed, dtype) for dtype in (torch.float16, torch.bfloat16)
            for kind in ("chain", "wide", "deep", "ragged", "prefill") for seed in range(6)])


def test_enough_cases():
    """The acceptance bar: at least 200 random cases, every kind and dtype represented."""
    assert len(CASES) >= 200
    assert {case.kind for case in CASES} == set(TOKENS)
    assert {case.dtype for case in CASES} == set(TOLERANCE)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.id)
def test_kernel_matches_reference(case: Case):
    (query, key_new, value_new, key_cache, value_cache, lengths, mask), scale, (bm, bs, bn) = make_problem(case)
    out, keys, values = tree_attention(query, key_new, value_new, key_cache, value_cache, lengths, mask, scale,
                                       block_m=bm, block_s=bs, block_n=bn)
    ref_out, ref_keys, ref_values = tree_attention_reference(query, key_new, value_new, key_cache, value_cache,
                                                             lengths, mask, scale)
    error = (out.double() - ref_out.double()).abs().max().item() / ref_out.double().abs().max().item()
    assert error < TOLERANCE[case.dtype], f"{case.id}: relative error {error:.2e}, shapes {tuple(query.shape)} " \
                                          f"cache {tuple(key_cache.shape)}, lengths {lengths.tolist()}"
    # Cache writes are copies: bit-exact, and nothing outside slots L_b .. L_b + T - 1 changes.
    assert torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
    assert torch.equal(key_cache, make_problem(case)[0][3]), "the functional call must not touch its inputs"


def test_inplace_updates_only_new_slots():
    (query, key_new, value_new, key_cache, value_cache, lengths, mask), scale, _ = make_problem(
        Case("ragged", 7, torch.float32))
    before_keys, before_values = key_cache.clone(), value_cache.clone()
    out, keys, values = tree_attention(query, key_new, value_new, key_cache, value_cache, lengths, mask, scale,
                                       inplace=True)
    assert keys.data_ptr() == key_cache.data_ptr() and values.data_ptr() == value_cache.data_ptr()
    tokens = query.shape[2]
    for row, length in enumerate(lengths.tolist()):
        new = slice(length, length + tokens)
        assert torch.equal(key_cache[row, :, new], key_new[row]) and torch.equal(value_cache[row, :, new],
                                                                                 value_new[row])
        for cache, before in ((key_cache, before_keys), (value_cache, before_values)):
            assert torch.equal(cache[row, :, :length], before[row, :, :length])
            assert torch.equal(cache[row, :, length + tokens:], before[row, :, length + tokens:])


def test_decode_step_sees_whole_prefix_only():
    """T = 1 with a long prefix over several key tiles equals softmax attention over prefix + itself."""
    gen = torch.Generator().manual_seed(3)
    query, key_new, value_new = (torch.randn(1, 4, 1, 32, generator=gen) for _ in range(3))
    key_new, value_new = key_new[:, :2], value_new[:, :2]
    key_cache, value_cache = torch.randn(1, 2, 80, 32, generator=gen), torch.randn(1, 2, 80, 32, generator=gen)
    lengths = torch.tensor([70], dtype=torch.int32)
    mask = torch.ones(1, 1, 1, dtype=torch.int32)
    out, _, _ = tree_attention(query, key_new, value_new, key_cache, value_cache, lengths, mask, 32 ** -0.5,
                               block_s=16)
    keys = torch.cat([key_cache[:, :, :70], key_new], dim=2).repeat_interleave(2, dim=1)
    values = torch.cat([value_cache[:, :, :70], value_new], dim=2).repeat_interleave(2, dim=1)
    expected = torch.softmax(query @ keys.transpose(-1, -2) * 32 ** -0.5, dim=-1) @ values
    assert torch.allclose(out, expected, atol=1e-5)


def test_bad_inputs_raise_actionable_errors():
    (query, key_new, value_new, key_cache, value_cache, lengths, mask), scale, _ = make_problem(
        Case("chain", 1, torch.float32))
    with pytest.raises(ValueError, match="cache_lengths"):
        full = torch.full_like(lengths, key_cache.shape[2])
        tree_attention(query, key_new, value_new, key_cache, value_cache, full, mask, scale)
    with pytest.raises(ValueError, match="int32"):
        tree_attention(query, key_new, value_new, key_cache, value_cache, lengths.long(), mask, scale)
    with pytest.raises(ValueError, match="tree_mask must have shape"):
        tree_attention(query, key_new, value_new, key_cache, value_cache, lengths, mask[:, :, :0], scale)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        KernelSpec("fp16", 6, 4, 64, 0.125)
    with pytest.raises(ValueError, match="power of two"):
        KernelSpec("fp16", 8, 2, 64, 0.125, block_s=48)

