"""Speculative decoding over a token tree: every node at depth d gets w_d children (greedy: the draft's top
w_d tokens; sampling: w_d i.i.d. draws from q, as the multi-draft rule requires); the target scores the
whole tree in one pass with the tree mask, the accepted root-to-leaf path is kept in its KV cache
(``keep``) and the rest rolled back. ``--mode sd --tree-widths 2,2,1``; the engine step runs it
(``decoding/round.py``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ssd_trt.decoding.grammar import DraftGrammar, apply_mask
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.sampling import TokenDistribution, filter_logits, next_tokens, top_tokens, verify_tree_children
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


def node_path(nodes: Sequence[int], parents: Sequence[int], node: int) -> list[int]:
    """The tokens of ``node``'s ancestors below the root (node 0), then its own: the path verification walks to it."""
    path = []
    while node > 0:
        path.append(int(nodes[node]))
        node = parents[node]
    return path[::-1]


def tree_nodes(widths: list[int]) -> int:
    """Tokens of the tree (the root, the bonus token, included): what one verification feeds the target."""
    return len(tree_shape(widths)[0])


@dataclass(frozen=True)
class TokenTree:
    """A static tree shape: ``widths[d]`` children under every depth-d node; node 0 is the root (the bonus
    token), nodes are numbered level by level."""
    widths: tuple[int, ...]
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    mask: np.ndarray                  # bool [N, N]: node i sees node j iff j is i or an ancestor of i

    @classmethod
    def of(cls, widths) -> "TokenTree":
        parents, depths = tree_shape(list(widths))
        return cls(tuple(widths), tuple(parents), tuple(depths), tree_mask_from_parents(parents))

    @property
    def size(self) -> int:
        return len(self.parents)

    def path(self, nodes: Sequence[int], node: int) -> list[int]:
        """The tokens from below the root down to ``node`` (itself included) of a tree whose tokens are ``nodes``."""
        return node_path(nodes, self.parents, node)

    def children(self, node: int) -> list[int]:
        return [m for m in range(self.size) if self.parents[m] == node]


@dataclass
class DraftedTrees:
    """One tree per row: its tokens, the distribution each node's children were drawn from ((row, node) -> q,
    sampled rows only)."""
    tree: TokenTree
    nodes: np.ndarray                                   # [B, N] int64, node 0 = the row's bonus token
    child_q: dict[tuple[int, int], TokenDistribution]


def draft_trees(draft: Engine, pending: list[list[int]], tree: TokenTree, params: Sequence[SamplingParams],
                rngs: Sequence[np.random.Generator], grammars: Sequence[DraftGrammar | None] | None = None
                ) -> DraftedTrees:
    """Feed each row's pending tokens (its bonus token last: the root), then grow the tree level by level, every
    row by its own parameters and random stream: greedy rows take the draft's top w_d tokens, sampled rows
    draw w_d i.i.d. from q (the multi-draft rule needs i.i.d. children), masked by the row's grammar after the
    parent's path (``grammars``: the draft's copies, ``grammar.py``). The draft's cache keeps the pending tokens only
    (the tree is rolled back)."""
    batch = len(pending)
    level_logits = {0: feed_ragged(draft, pending)}      # node -> the draft's logits [B, V] after it
    base = draft.lengths
    nodes = np.zeros((batch, tree.size), dtype=np.int64)
    nodes[:, 0] = [row[-1] for row in pending]
    child_q: dict[tuple[int, int], TokenDistribution] = {}
    for depth in range(1, len(tree.widths) + 1):
        level = [n for n in range(tree.size) if tree.depths[n] == depth]
        for row in range(batch):
            parents = sorted({tree.parents[n] for n in level})
            grammar = grammars[row] if grammars else None
            masks = grammar.masks_along([tree.path(nodes[row], p) for p in parents]) if grammar else \
                [None] * len(parents)
            for parent, mask in zip(parents, masks):
                children = [n for n in level if tree.parents[n] == parent]
                logits = apply_mask(level_logits[parent][row], mask)
                if params[row].greedy:
                    nodes[row, children] = top_tokens(logits, len(children))
                else:
                    q = child_q.setdefault((row, parent), filter_logits(logits[None], params[row])[0])
                    nodes[row, children] = [int(q.sample(rngs[row])) for _ in children]
        if depth < len(tree.widths):                     # feed the tree so far for its next level's logits
            draft.rollback(base)
            fed = [n for n in range(1, tree.size) if tree.depths[n] <= depth]
            positions = base[:, None] + np.array([tree.depths[n] - 1 for n in fed])[None, :]
            sub_mask = tree.mask[np.ix_(fed, fed)]
            out = draft.forward(nodes[:, fed], positions, np.broadcast_to(sub_mask, (batch,) + sub_mask.shape))
            level_logits.update({n: out[:, column] for column, n in enumerate(fed)})
    draft.rollback(base)
    return DraftedTrees(tree, nodes, child_q)


def accepted_path(trees: DraftedTrees, row: int, logits: np.ndarray, params: SamplingParams,
                  rng: np.random.Generator) -> tuple[list[int], int]:
    """Walk row ``row``'s tree from the root, level by level (``sampling.verify_tree_children``), with the target's
    ``logits`` [N, V] at its nodes: the accepted path (node indices, root first) and the token that follows it."""
    path, node = [0], 0
    while True:
        children = trees.tree.children(node)
        if not children:
            return path, int(next_tokens(logits[node][None], params, rng)[0])
        p = None if params.greedy else filter_logits(logits[node][None], params)[0]
        chosen, extra = verify_tree_children([int(trees.nodes[row, m]) for m in children],
                                             trees.child_q.get((row, node)), p,
                                             logits[node] if params.greedy else None, rng)
        if chosen is None:
            return path, extra
        node = children[chosen]
        path.append(node)
