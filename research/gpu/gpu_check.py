#!/usr/bin/env python
"""GPU check of the tree-attention kernel: one NVIDIA GPU, torch with CUDA and triton; no TensorRT.

Runs in well under 5 minutes and prints one table:

1. correctness: the Triton kernel against the reference math (``plugins/tree_attention/reference.py``)
   for fp32, fp16 and bf16 on Llama-3.1-8B attention shapes (32 query heads, 8 kv heads, head dim 128):
   decode (T = 1, ragged cache lengths), verification (T = K + 1 = 6), a 32-token draft tree, and a
   512-token prefill; the relative error max|out - ref| / max|ref| against the dtype's tolerance;
2. speed: the kernel (in-place cache update included) against torch scaled_dot_product_attention
   with an explicit boolean mask over the same keys (cache write not included for SDPA);
3. a CUDA graph of a decode step: captured, replayed, checked against the eager step, timed;
4. the TensorRT plugin's tactics (``trt_plugin.tactics_for``): each tile timed on every case, with its
   relative error, so the tile TensorRT's autotuner would keep can be read off per step kind.

Needs only ``plugins/`` and this script (a few hundred KB). Exit code 0 when every check passes, 1
when one fails, 2 when there is no CUDA device.

    python research/gpu/gpu_check.py [--json results.json] [--iters 50]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ssd_trt_plugins.tree_attention.reference import attention_mask, pack_tree_mask, tree_attention_reference  # noqa: E402
from ssd_trt_plugins.tree_attention.triton_kernel import tree_attention  # noqa: E402
from ssd_trt_plugins.tree_attention.trt_plugin import tactics_for  # noqa: E402

Q_HEADS, KV_HEADS, HEAD_DIM, CAPACITY = 32, 8, 128, 4096
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def tree_mask(kind: str, batch: int, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """bool [B,T,T]: causal for chains, a random tree (each token sees its ancestors) otherwise."""
    if kind != "tree":
        return np.broadcast_to(np.tril(np.ones((tokens, tokens), dtype=bool)), (batch, tokens, tokens)).copy()
    masks = np.zeros((batch, tokens, tokens), dtype=bool)
    for row in range(batch):
        parents = [-1] + [int(rng.integers(max(0, i - 4), i)) for i in range(1, tokens)]
        for node in range(tokens):
            masks[row, node, node] = True
            parent = parents[node]
            while parent >= 0:
                masks[row, node, parent] = True
                parent = parents[parent]
    return masks


CASES = [  # name, batch, new tokens, cache lengths
    ("decode", 4, 1, [1000, 1500, 700, 2000]),
    ("verify", 4, 6, [1000, 1500, 700, 2000]),
    ("tree", 1, 32, [2000]),
    ("prefill", 1, 512, [0]),
]


def make_case(name: str, batch: int, tokens: int, lengths: list[int], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)
    rng = np.random.default_rng(seed)
    mask = torch.from_numpy(pack_tree_mask(tree_mask(name, batch, tokens, rng))).cuda()
    return (randn(batch, Q_HEADS, tokens, HEAD_DIM), randn(batch, KV_HEADS, tokens, HEAD_DIM),
            randn(batch, KV_HEADS, tokens, HEAD_DIM), randn(batch, KV_HEADS, CAPACITY, HEAD_DIM),
            randn(batch, KV_HEADS, CAPACITY, HEAD_DIM), torch.tensor(lengths, dtype=torch.int32, device="cuda"),
            mask)


def time_us(fn, iters: int, warmup: int = 3) -> float:
    """Median wall time of ``fn`` on the GPU in microseconds (CUDA events)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(samples)


def sdpa_fn(query, key_cache, value_cache, lengths, packed, tokens):
    """torch SDPA over the (already written) cache prefix + new tokens with an explicit boolean mask."""
    used = int(lengths.max()) + tokens
    allowed = attention_mask(lengths, packed, tokens, key_cache.shape[2])[:, None, :, :used]
    keys = key_cache[:, :, :used].repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
    values = value_cache[:, :, :used].repeat_interleave(Q_HEADS // KV_HEADS, dim=1)
    return lambda: torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=allowed,
                                                                    scale=HEAD_DIM ** -0.5)


def check_case(name, batch, tokens, lengths, dtype, iters) -> dict:
    query, key_new, value_new, key_cache, value_cache, lens, packed = make_case(name, batch, tokens, lengths, dtype)
    scale = HEAD_DIM ** -0.5
    out, keys, values = tree_attention(query, key_new, value_new, key_cache, value_cache, lens, packed, scale)
    ref, ref_keys, ref_values = tree_attention_reference(query, key_new, value_new, key_cache, value_cache, lens,
                                                         packed, scale)
    error = (out.double() - ref.double()).abs().max().item() / ref.double().abs().max().item()
    caches_exact = torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
    # Timing: the in-place mode the runtime uses (re-writing the same slots each iteration is harmless).
    kernel_us = time_us(lambda: tree_attention(query, key_new, value_new, keys, values, lens, packed, scale,
                                               inplace=True, check_lengths=False), iters)
    sdpa_us = time_us(sdpa_fn(query, ref_keys, ref_values, lens, packed, tokens), iters)
    return {"check": name, "dtype": NAMES[dtype], "batch": batch, "tokens": tokens, "max_len": max(lengths),
            "rel_err": error, "tol": TOLERANCE[dtype], "ok": bool(error < TOLERANCE[dtype] and caches_exact),
            "triton_us": kernel_us, "sdpa_us": sdpa_us, "graph_us": None}


def check_graph(dtype, iters) -> dict:
    """Capture a decode step in a CUDA graph, replay it, compare with the eager step, time both."""
    name, batch, tokens, lengths = CASES[0]
    query, key_new, value_new, key_cache, value_cache, lens, packed = make_case(name, batch, tokens, lengths, dtype,
                                                                                seed=1)
    scale = HEAD_DIM ** -0.5
    eager_out, _, _ = tree_attention(query, key_new, value_new, key_cache.clone(), value_cache.clone(), lens, packed,
                                     scale)

    def step():
        return tree_attention(query, key_new, value_new, key_cache, value_cache, lens, packed, scale, inplace=True,
                              check_lengths=False)[0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile + warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    graph.replay()
    torch.cuda.synchronize()
    error = (graph_out.double() - eager_out.double()).abs().max().item()
    return {"check": "decode CUDA graph", "dtype": NAMES[dtype], "batch": batch, "tokens": tokens,
            "max_len": max(lengths), "rel_err": error, "tol": 0.0, "ok": error == 0.0,
            "triton_us": time_us(step, iters), "sdpa_us": None, "graph_us": time_us(graph.replay, iters)}


def check_tactics(dtype, iters) -> list[dict]:
    """Every plugin tactic of ``dtype`` on every case: error and in-place kernel time."""
    rows = []
    name_of = NAMES[dtype]
    for name, batch, tokens, lengths in CASES:
        query, key_new, value_new, key_cache, value_cache, lens, packed = make_case(name, batch, tokens, lengths,
                                                                                    dtype)
        scale = HEAD_DIM ** -0.5
        ref, _, _ = tree_attention_reference(query, key_new, value_new, key_cache, value_cache, lens, packed, scale)
        for tactic, tile in sorted(tactics_for(name_of).items()):
            tiles = dict(block_m=tile.block_m, block_s=tile.block_s, block_n=tile.block_n, num_warps=tile.num_warps,
                         num_stages=tile.num_stages)
            out, _, _ = tree_attention(query, key_new, value_new, key_cache.clone(), value_cache.clone(), lens,
                                       packed, scale, **tiles)
            error = (out.double() - ref.double()).abs().max().item() / ref.double().abs().max().item()
            keys, values = key_cache.clone(), value_cache.clone()
            micros = time_us(lambda: tree_attention(query, key_new, value_new, keys, values, lens, packed, scale,
                                                    inplace=True, check_lengths=False, **tiles), iters)
            rows.append({"check": name, "dtype": name_of, "tactic": tactic, "tile": list(tiles.values()),
                         "rel_err": error, "ok": bool(error < TOLERANCE[dtype]), "us": micros})
    return rows


def print_table(rows: list[dict]) -> None:
    header = f"{'check':<18} {'dtype':<5} {'B':>2} {'T':>4} {'L':>5} {'rel_err':>9} {'tol':>8} {'ok':>3} " \
             f"{'triton_us':>10} {'sdpa_us':>9} {'speedup':>8} {'graph_us':>9}"
    print(header)
    print("-" * len(header))
    for row in rows:
        speedup = f"{row['sdpa_us'] / row['triton_us']:.2f}x" if row["sdpa_us"] else "-"
        sdpa = f"{row['sdpa_us']:.1f}" if row["sdpa_us"] else "-"
        graph = f"{row['graph_us']:.1f}" if row["graph_us"] else "-"
        print(f"{row['check']:<18} {row['dtype']:<5} {row['batch']:>2} {row['tokens']:>4} {row['max_len']:>5} "
              f"{row['rel_err']:>9.2e} {row['tol']:>8.1e} {'yes' if row['ok'] else 'NO':>3} "
              f"{row['triton_us']:>10.1f} {sdpa:>9} {speedup:>8} {graph:>9}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Check the tree-attention Triton kernel on one NVIDIA GPU.")
    parser.add_argument("--iters", type=int, default=50, help="timed iterations per measurement")
    parser.add_argument("--json", type=Path, help="also write the table as JSON here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}); "
              "run this on a machine with an NVIDIA GPU and a CUDA build of torch", file=sys.stderr)
        return 2
    import triton
    device = torch.cuda.get_device_name(0)
    print(f"device: {device} (sm_{''.join(map(str, torch.cuda.get_device_capability(0)))}), torch {torch.__version__},"
          f" triton {triton.__version__}\nshapes: Hq={Q_HEADS} Hkv={KV_HEADS} D={HEAD_DIM} cache capacity {CAPACITY}\n")
    rows = [check_case(name, batch, tokens, lengths, dtype, args.iters)
            for dtype in (torch.float32, torch.float16, torch.bfloat16) for name, batch, tokens, lengths in CASES]
    rows += [check_graph(dtype, args.iters) for dtype in (torch.float16, torch.bfloat16)]
    print_table(rows)
    tactic_rows = [row for dtype in (torch.float32, torch.float16, torch.bfloat16)
                   for row in check_tactics(dtype, args.iters)]
    print(f"\nplugin tactics (tile = block_m, block_s, block_n, warps, stages):")
    for row in tactic_rows:
        print(f"  {row['check']:<8} {row['dtype']:<5} tactic {row['tactic']} {str(row['tile']):<22} "
              f"rel_err {row['rel_err']:.2e} {'ok' if row['ok'] else 'NO'} {row['us']:9.1f} us")
    if args.json:
        args.json.write_text(json.dumps({"device": device, "torch": torch.__version__, "triton": triton.__version__,
                                         "rows": rows, "tactics": tactic_rows}, indent=2))
    failed = [row for row in rows + tactic_rows if not row["ok"]]
    print(f"\n{len(rows) + len(tactic_rows) - len(failed)}/{len(rows) + len(tactic_rows)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
