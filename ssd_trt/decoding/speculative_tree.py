"""Speculative decoding over a token tree: every node at depth d gets w_d children (greedy: the draft's top
w_d tokens; sampling: w_d i.i.d. draws from q, as the multi-draft rule requires); the target scores the
whole tree in one pass with the tree mask, the accepted root-to-leaf path is kept in its KV cache
(``keep``) and the rest rolled back. ``--mode sd --tree-widths 2,2,1`` (``decoding/speculative.py``).
"""
from __future__ import annotations

import time

import numpy as np

from ssd_trt.decoding.batch import Sequences, first_tokens
from ssd_trt.decoding.feature_relay import hand_over, prompt_features, tree_features
from ssd_trt.decoding.sampling import TokenDistribution, filter_logits, next_tokens, top_tokens, verify_tree_children
from ssd_trt.decoding.stats import RoundStats
from ssd_trt.engines.base import Engine
from ssd_trt.engines.feeding import feed_ragged, tree_mask_from_parents


def tree_shape(widths: list[int]) -> tuple[list[int], list[int]]:
    """Parents and depths of a tree where every depth-d node has widths[d] children (root = node 0)."""
    parents, depths, frontier = [-1], [0], [0]
    for depth, width in enumerate(widths, start=1):
        next_frontier = []
        for parent in frontier:
            for _ in range(width):
                parents.append(parent)
                depths.append(depth)
                next_frontier.append(len(parents) - 1)
        frontier = next_frontier
    return parents, depths


def tree_nodes(widths: list[int]) -> int:
    """Tokens of the tree (the root, the bonus token, included): what one verification feeds the target."""
    return len(tree_shape(widths)[0])


def generate_tree_speculative(target: Engine, draft: Engine, prompts: list[list[int]], seqs: Sequences,
                              rng: np.random.Generator, tree_widths: list[int]) -> dict:
    """Tree verification rounds until every row is done. Static tree shape shared by all rows."""
    batch = len(prompts)
    stats = RoundStats(mode="sd-tree", draft_len=len(tree_widths))
    draft.reset(batch)
    bonus = first_tokens(target, prompts, seqs, rng)
    hand_over(draft, prompt_features(target, draft, prompts))
    pending = [list(p) + [b] for p, b in zip(prompts, bonus)]
    parents, depth_of = tree_shape(tree_widths)        # node 0 is the root (the bonus token)
    mask = tree_mask_from_parents(parents)
    while not seqs.all_done:
        t0 = time.perf_counter()
        draft_start = draft.lengths
        nodes, node_q, base = draft_tree(draft, pending, bonus, tree_widths, parents, depth_of, mask, seqs, rng)
        t1 = time.perf_counter()
        start = target.lengths
        positions = start[:, None] + np.array(depth_of)[None, :]
        logits = target.forward(nodes, positions, np.broadcast_to(mask, (batch,) + mask.shape))
        t2 = time.perf_counter()
        new_draft = base.copy()                           # the draft keeps prefix + pending only
        for row in range(batch):
            if seqs.done[row]:                            # finished rows idle: nothing kept or grown
                target.keep(row, int(start[row]), [])
                pending[row] = [bonus[row]]
                new_draft[row] = draft_start[row]
                continue
            path, extra = accepted_path(nodes[row], node_q, row, logits[row], parents, seqs, rng)
            accepted = [int(nodes[row, n]) for n in path[1:]]
            seqs.commit(row, accepted + [extra])
            stats.record_round(len(accepted))
            hand_over(draft, tree_features(target, draft, row, int(start[row]), path))
            target.keep(row, int(start[row]), path)       # root + accepted nodes, compacted
            pending[row] = accepted + [extra]
            bonus[row] = extra
        draft.rollback(new_draft)
        stats.add_time(draft_s=t1 - t0, verify_s=t2 - t1)
    return stats.summary()


def draft_tree(draft: Engine, pending: list[list[int]], bonus: list[int], widths: list[int], parents: list[int],
               depth_of: list[int], mask: np.ndarray, seqs: Sequences, rng: np.random.Generator):
    """Grow the token tree level by level under the root (each row's bonus token). Returns the nodes
    [B, N], the distribution each node's children were drawn from ((row, node) -> q, when sampling) and
    the draft's cache lengths with the pending tokens fed (the tree itself is rolled back)."""
    batch, params, num_nodes = len(pending), seqs.params, len(parents)
    root_logits = feed_ragged(draft, pending)
    base = draft.lengths
    nodes = np.zeros((batch, num_nodes), dtype=np.int64)
    nodes[:, 0] = bonus
    node_q: dict[tuple[int, int], TokenDistribution] = {}
    level_logits = {0: root_logits}                      # node -> draft logits [B, V] after it
    for depth in range(1, len(widths) + 1):
        level = [n for n in range(num_nodes) if depth_of[n] == depth]
        for row in range(batch):
            for n in level:
                siblings = [m for m in level if parents[m] == parents[n]]
                logits = level_logits[parents[n]][row]
                if params.greedy:
                    nodes[row, n] = top_tokens(logits, len(siblings))[siblings.index(n)]
                else:
                    q = node_q.setdefault((row, parents[n]), filter_logits(logits[None], params)[0])
                    nodes[row, n] = int(q.sample(rng))
        if depth < len(widths):                          # feed this level to get its children's logits
            draft.rollback(base)
            fed = [n for n in range(1, num_nodes) if depth_of[n] <= depth]
            positions = base[:, None] + np.array([depth_of[n] - 1 for n in fed])[None, :]
            sub_mask = mask[np.ix_(fed, fed)]
            out = draft.forward(nodes[:, fed], positions, np.broadcast_to(sub_mask, (batch,) + sub_mask.shape))
            level_logits.update({n: out[:, column] for column, n in enumerate(fed)})
    draft.rollback(base)
    return nodes, node_q, base


def accepted_path(nodes: np.ndarray, node_q: dict, row: int, logits: np.ndarray, parents: list[int],
                  seqs: Sequences, rng: np.random.Generator) -> tuple[list[int], int]:
    """Walk the tree from the root, level by level (``sampling.verify_tree_children``): the accepted path
    (node indices, root first) and the token that follows it."""
    params, path, node = seqs.params, [0], 0
    while True:
        children = [m for m in range(len(parents)) if parents[m] == node]
        if not children:
            return path, int(next_tokens(logits[node][None], params, rng)[0])
        p = None if params.greedy else filter_logits(logits[node][None], params)[0]
        chosen, extra = verify_tree_children([int(nodes[m]) for m in children], node_q.get((row, node)), p,
                                             logits[node] if params.greedy else None, rng)
        if chosen is None:
            return path, extra
        node = children[chosen]
        path.append(node)
