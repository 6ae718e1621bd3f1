"""A fixed sequence of engine calls that covers every step shape the decoding strategies use.

Two engines built from the same network must return the same logits for it: a ragged prefill, greedy
decodes, a verify chunk, a rollback in which the rows reject different numbers of tokens, a tree step
under a tree mask, ``keep`` (compacting one row's accepted tree path) and a decode that reads the kept
path. The tests run it to check a backend against ONNX Runtime; ``research/gpu/gpu_runtime_check.py`` runs
it to check the GPU engine (CUDA graphs, Triton kernel) against CPU reference math.
"""
from __future__ import annotations

import numpy as np

from ssd_trt.engines.feeding import feed_ragged, tree_mask_from_parents

TREE_PARENTS = [-1, 0, 0, 1, 2]          # two branches of depth 2
TREE_DEPTHS = np.array([0, 1, 1, 2, 2])
TREE_TOKENS = [17, 42, 99, 7, 13]
KEPT_PATH = [0, 2, 4]                    # root -> node 2 -> node 4


def step_script(engine, prompts: list[list[int]], decode_steps: int, verify_tokens: int) -> list[np.ndarray]:
    """The logits of every call, in order (prefill [2, T, V], then one array per step)."""
    if len(prompts) != 2:
        raise ValueError(f"the step script runs two rows, got {len(prompts)} prompts")
    if verify_tokens < 3:
        raise ValueError(f"verify_tokens must be >= 3 (row 1 rolls back 3 tokens), got {verify_tokens}")
    engine.reset(2)
    outputs = [feed_ragged(engine, prompts)]
    tokens = outputs[-1].argmax(-1)[:, None]
    for _ in range(decode_steps):
        out = engine.forward(tokens, engine.lengths[:, None])
        outputs.append(out)
        tokens = out.argmax(-1)
    outputs.append(engine.forward(np.repeat(tokens, verify_tokens, axis=1),
                                  engine.lengths[:, None] + np.arange(verify_tokens)))
    engine.rollback(engine.lengths - np.array([2, 3]))
    mask = np.broadcast_to(tree_mask_from_parents(TREE_PARENTS), (2, len(TREE_PARENTS), len(TREE_PARENTS)))
    outputs.append(engine.forward(np.tile([TREE_TOKENS], (2, 1)), engine.lengths[:, None] + TREE_DEPTHS, mask))
    start = int(engine.lengths[0]) - len(TREE_TOKENS)
    engine.keep(0, start, KEPT_PATH)
    engine.rollback(np.array([start + len(KEPT_PATH), engine.lengths[1] - len(TREE_TOKENS)]))
    outputs.append(engine.forward(np.array([[5], [6]]), engine.lengths[:, None]))
    if int(engine.lengths[0]) != start + len(KEPT_PATH) + 1:
        raise AssertionError(f"after keep + one decode row 0 should hold {start + len(KEPT_PATH) + 1} tokens, "
                             f"the engine reports {int(engine.lengths[0])}")
    return outputs
