#!/usr/bin/env python
"""GPU check of the tree-attention kernel: one NVIDIA GPU, torch with CUDA and triton; no TensorRT.

Runs in about a minute and prints one table:

1. correctness: the Triton kernel against the reference math (``plugins/tree_attention/reference.py``)
   for fp32, fp16 and bf16 on Llama-3.1-8B attention shapes (32 query heads, 8 kv heads, head dim 128):
   decode (T = 1, ragged cache lengths), verification (T = K + 1 = 6), a 32-token draft tree, and a
   512-token prefill; the relative error max|out - ref| / max|ref| against the dtype's tolerance;
2. speed: the kernel (in-place cache update included) against torch scaled_dot_product_attention
   with an explicit boolean mask over the same keys (cache write not included for SDPA);
3. a CUDA graph of a decode step: captured, replayed, checked against the eager step, timed;
4. the TensorRT plugin's tactics (``trt_plugin.tactics_for``): each tile timed on every case, with its
   relative error, so the tile TensorRT's autotuner would keep can be read off per step kind.

Needs the installed package (``plugins/`` installs as ``ssd_trt_plugins``: ``pip install -e .``). Exit code 0
when every check passes, 1 when one fails, 2 when there is no CUDA device.

    python research/gpu/gpu_check.py [--json results.json] [--iters 50]
    python research/gpu/gpu_check.py --device cpu --smoke     # the same checks at toy sizes, Triton interpreter

``--smoke`` runs the same code at toy shapes (4 / 2 heads, head dim 16, a 32-slot cache); on CPU the kernel runs in
the Triton interpreter, times are wall-clock and the CUDA-graph check is reported as not run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ssd_trt_plugins.tree_attention.reference import attention_mask, pack_tree_mask, tree_attention_reference  # noqa: E402
from ssd_trt_plugins.tree_attention.triton_kernel import tree_attention  # noqa: E402
from ssd_trt_plugins.tree_attention.trt_plugin import tactics_for  # noqa: E402

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


@dataclass(frozen=True)
class Sizes:
    """Attention shapes and the step cases (name, batch, new tokens, cache lengths) checked at them."""
    q_heads: int
    kv_heads: int
    head_dim: int
    capacity: int
    cases: tuple[tuple[str, int, int, list[int]], ...]
    device: str = "cuda"


FULL = Sizes(32, 8, 128, 4096, (       # Llama-3.1-8B attention
    ("decode", 4, 1, [1000, 1500, 700, 2000]),
    ("verify", 4, 6, [1000, 1500, 700, 2000]),
    ("tree", 1, 32, [2000]),
    ("prefill", 1, 512, [0]),
))
SMOKE = Sizes(4, 2, 16, 32, (           # the same code path at toy sizes (CPU: the Triton interpreter)
    ("decode", 2, 1, [5, 9]),
    ("verify", 2, 3, [5, 9]),
    ("tree", 1, 8, [7]),
    ("prefill", 1, 16, [0]),
))


def make_case(sizes: Sizes, name: str, batch: int, tokens: int, lengths: list[int], dtype: torch.dtype,
              seed: int = 0):
    gen = torch.Generator(device=sizes.device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=sizes.device, dtype=torch.float32).to(dtype)
    rng = np.random.default_rng(seed)
    mask = torch.from_numpy(pack_tree_mask(tree_mask(name, batch, tokens, rng))).to(sizes.device)
    q, kv, dim, capacity = sizes.q_heads, sizes.kv_heads, sizes.head_dim, sizes.capacity
    return (randn(batch, q, tokens, dim), randn(batch, kv, tokens, dim), randn(batch, kv, tokens, dim),
            randn(batch, kv, capacity, dim), randn(batch, kv, capacity, dim),
            torch.tensor(lengths, dtype=torch.int32, device=sizes.device), mask)


def time_us(fn, iters: int, warmup: int = 3) -> float:
    """Median time of ``fn`` in microseconds: CUDA events on a GPU, wall-clock on CPU."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if not torch.cuda.is_available():
            started = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - started) * 1e6)
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(samples)


def sdpa_fn(sizes: Sizes, query, key_cache, value_cache, lengths, packed, tokens):
    """torch SDPA over the (already written) cache prefix + new tokens with an explicit boolean mask."""
    used = int(lengths.max()) + tokens
    allowed = attention_mask(lengths, packed, tokens, key_cache.shape[2])[:, None, :, :used]
    groups = sizes.q_heads // sizes.kv_heads
    keys = key_cache[:, :, :used].repeat_interleave(groups, dim=1)
    values = value_cache[:, :, :used].repeat_interleave(groups, dim=1)
    return lambda: torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=allowed,
                                                                    scale=sizes.head_dim ** -0.5)


def check_case(sizes: Sizes, name, batch, tokens, lengths, dtype, iters) -> dict:
    query, key_new, value_new, key_cache, value_cache, lens, packed = make_case(sizes, name, batch, tokens, lengths,
                                                                                dtype)
    scale = sizes.head_dim ** -0.5
    out, keys, values = tree_attention(query, key_new, value_new, key_cache, value_cache, lens, packed, scale)
    ref, ref_keys, ref_values = tree_attention_reference(query, key_new, value_new, key_cache, value_cache, lens,
                                                         packed, scale)
    error = (out.double() - ref.double()).abs().max().item() / ref.double().abs().max().item()
    caches_exact = torch.equal(keys, ref_keys) and torch.equal(values, ref_values)
    # Timing: the in-place mode the runtime uses (re-writing the same slots each iteration is harmless).
    kernel_us = time_us(lambda: tree_attention(query, key_new, value_new, keys, values, lens, packed, scale,
                                               inplace=True, check_lengths=False), iters)
    sdpa_us = time_us(sdpa_fn(sizes, query, ref_keys, ref_values, lens, packed, tokens), iters)
    return {"check": name, "dtype": NAMES[dtype], "batch": batch, "tokens": tokens, "max_len": max(lengths),
            "rel_err": error, "tol": TOLERANCE[dtype], "ok": bool(error < TOLERANCE[dtype] and caches_exact),
            "triton_us": kernel_us, "sdpa_us": sdpa_us, "graph_us": None}


def check_graph(sizes: Sizes, dtype, iters) -> dict:
    """Capture a decode step in a CUDA graph, replay it, compare with the eager step, time both."""
    name, batch, tokens, lengths = sizes.cases[0]
    query, key_new, value_new, key_cache, value_cache, lens, packed = make_case(sizes, name, batch, tokens, lengths,
                                                                                dtype, seed=1)
    scale = sizes.head_dim ** -0.5
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


def check_tactics(sizes: Sizes, dtype, iters) -> list[dict]:
    """Every plugin tactic of ``dtype`` on every case: error and in-place kernel time."""
    rows = []
    name_of = NAMES[dtype]
    for name, batch, tokens, lengths in sizes.cases:
        query, key_new, value_new, key_cache, value_cache, lens, packed = make_case(sizes, name, batch, tokens,
                                                                                    lengths, dtype)
        scale = sizes.head_dim ** -0.5
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
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--smoke", action="store_true", help="toy shapes (the code path, e.g. on CPU)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device visible to torch {torch.__version__} (CUDA build: {torch.version.cuda}); "
              "run this on a machine with an NVIDIA GPU and a CUDA build of torch, or with --device cpu --smoke",
              file=sys.stderr)
        return 2
    import triton
    sizes = SMOKE if args.smoke else FULL
    sizes = Sizes(**{**sizes.__dict__, "device": args.device})
    if args.device == "cuda":
        device = torch.cuda.get_device_name(0)
        device += f" (sm_{''.join(map(str, torch.cuda.get_device_capability(0)))})"
    else:
        device = "cpu (Triton interpreter)"
    print(f"device: {device}, torch {torch.__version__}, triton {triton.__version__}\n"
          f"shapes: Hq={sizes.q_heads} Hkv={sizes.kv_heads} D={sizes.head_dim} cache capacity {sizes.capacity}\n")
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    rows = [check_case(sizes, name, batch, tokens, lengths, dtype, args.iters)
            for dtype in dtypes for name, batch, tokens, lengths in sizes.cases]
    if args.device == "cuda":
        rows += [check_graph(sizes, dtype, args.iters) for dtype in (torch.float16, torch.bfloat16)]
        graph_note = None
    else:
        graph_note = "not run: CUDA graphs need a CUDA device (this was a CPU run)"
        print(f"decode CUDA graph: {graph_note}")
    print_table(rows)
    tactic_rows = [row for dtype in dtypes for row in check_tactics(sizes, dtype, args.iters)]
    print("\nplugin tactics (tile = block_m, block_s, block_n, warps, stages):")
    for row in tactic_rows:
        print(f"  {row['check']:<8} {row['dtype']:<5} tactic {row['tactic']} {str(row['tile']):<22} "
              f"rel_err {row['rel_err']:.2e} {'ok' if row['ok'] else 'NO'} {row['us']:9.1f} us")
    failed = [row for row in rows + tactic_rows if not row["ok"]]
    passed, total = len(rows) + len(tactic_rows) - len(failed), len(rows) + len(tactic_rows)
    if args.json:
        args.json.write_text(json.dumps({"device": device, "torch": torch.__version__, "triton": triton.__version__,
                                         "smoke": args.smoke, "shapes": {k: v for k, v in sizes.__dict__.items()
                                                                         if k != "cases"},
                                         "passed": passed, "total": total, "cuda_graph": graph_note or "checked",
                                         "rows": rows, "tactics": tactic_rows}, indent=2))
    print(f"\n{passed}/{total} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
