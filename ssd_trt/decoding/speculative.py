"""Standard speculative decoding: the draft proposes, the target verifies in one pass, alternating.

Chain (``tree_widths=None``): K draft tokens, verified with :func:`sampling.verify_chain`.
Tree (``tree_widths=[w1, w2, ...]``): every node at depth d gets w_d children (greedy: the draft's top
w_d tokens; sampling: w_d i.i.d. draws from q, as the multi-draft rule requires); the target scores
the whole tree in one pass with the tree mask, the accepted root-to-leaf path is kept in its KV cache
(``keep``) and the rest rolled back.
"""
from __future__ import annotations

import time

import numpy as np

from ssd_trt.decoding.batch import Sequences, feed_ragged, first_tokens
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.sampling import (TokenDistribution, filter_logits, next_tokens, top_tokens, verify_chain,
                                       verify_tree_children)
from ssd_trt.decoding.stats import RoundStats


def draft_chain(draft, pending: list[list[int]], num_tokens: int, params: SamplingParams,
                rng: np.random.Generator) -> tuple[np.ndarray, list[TokenDistribution] | None]:
    """Feed each row's pending tokens, then draft ``num_tokens`` more. Returns tokens [B,K] and, when
    sampling, each row's K distributions the tokens were drawn from (every row drawn at once per step).

    The last drafted token is not fed (the target verifies it first), so after this the draft's cache
    holds the pending tokens plus s_1..s_{K-1}.
    """
    batch = len(pending)
    tokens = np.zeros((batch, num_tokens), dtype=np.int64)
    step_dists: list[TokenDistribution] = []
    logits = feed_ragged(draft, pending)
    for i in range(num_tokens):
        if params.greedy:
            tokens[:, i] = np.argmax(logits, axis=-1)
        else:
            q = filter_logits(logits, params)
            tokens[:, i] = q.sample(rng)
            step_dists.append(q)
        if i + 1 < num_tokens:
            logits = draft.forward(tokens[:, i:i + 1], draft.lengths[:, None].astype(np.int64))[:, 0]
    if params.greedy:
        return tokens, None
    dists = TokenDistribution.stack(step_dists, draft.spec.vocab_size)          # [K, B]
    return tokens, [dists[:, row] for row in range(batch)]


def generate_speculative(target, draft, prompts: list[list[int]], seqs: Sequences, rng: np.random.Generator,
                         draft_len: int = 4, tree_widths: list[int] | None = None) -> dict:
    if tree_widths:
        return generate_tree_speculative(target, draft, prompts, seqs, rng, tree_widths)
    batch, params = len(prompts), seqs.params
    stats = RoundStats(mode="sd", draft_len=draft_len)
    draft.reset(batch)
    bonus = first_tokens(target, prompts, seqs, rng)
    pending = [list(p) + [b] for p, b in zip(prompts, bonus)]   # tokens the draft has not seen yet
    while not seqs.all_done:
        t0 = time.perf_counter()
        draft_start = draft.lengths
        tokens, probs = draft_chain(draft, pending, draft_len, params, rng)
        draft_fed = draft.lengths - draft_start
        t1 = time.perf_counter()
        start = target.lengths
        feed = np.concatenate([np.array(bonus)[:, None], tokens], axis=1)
        positions = start[:, None] + np.arange(draft_len + 1)[None, :]
        logits = target.forward(feed, positions)
        t2 = time.perf_counter()
        new_target, new_draft = start.copy(), draft_start.copy()
        for row in range(batch):
            if seqs.done[row]:           # finished rows idle: nothing kept, nothing grows
                pending[row] = [bonus[row]]
                continue
            outcome = verify_chain(tokens[row], None if probs is None else probs[row], logits[row], params, rng)
            seqs.commit(row, [int(t) for t in tokens[row, :outcome.accepted]] + [outcome.bonus])
            stats.record_round(outcome.accepted)
            new_target[row] = start[row] + 1 + outcome.accepted
            # the draft fed pending + s_1..s_{K-1}; keep pending + s_1..s_k (s_K was never fed)
            fed_pending = int(draft_fed[row]) - (draft_len - 1)
            kept = min(outcome.accepted, draft_len - 1)
            new_draft[row] = draft_start[row] + fed_pending + kept
            pending[row] = [int(t) for t in tokens[row, kept:outcome.accepted]] + [outcome.bonus]
            bonus[row] = outcome.bonus
        target.rollback(new_target)
        draft.rollback(new_draft)
        stats.add_time(draft_s=t1 - t0, verify_s=t2 - t1)
    return stats.summary()


def generate_tree_speculative(target, draft, prompts: list[list[int]], seqs: Sequences,
                              rng: np.random.Generator, tree_widths: list[int]) -> dict:
    """Tree verification; see the module docstring. Static tree shape shared by all rows."""
    batch, params = len(prompts), seqs.params
    stats = RoundStats(mode="sd-tree", draft_len=len(tree_widths))
    draft.reset(batch)
    bonus = first_tokens(target, prompts, seqs, rng)
    pending = [list(p) + [b] for p, b in zip(prompts, bonus)]
    parents, depth_of = tree_shape(tree_widths)        # node 0 is the root (the bonus token)
    num_nodes = len(parents)
    mask = tree_mask_from_parents(parents)
    while not seqs.all_done:
        t0 = time.perf_counter()
        draft_start = draft.lengths
        root_logits = feed_ragged(draft, pending)
        base = draft.lengths
        nodes = np.zeros((batch, num_nodes), dtype=np.int64)
        nodes[:, 0] = bonus
        node_probs = {}                                  # (row, node) -> q at that node (sampling)
        level_logits = {0: root_logits}                  # node -> draft logits [B, V] after it
        for depth, width in enumerate(tree_widths, start=1):
            level = [n for n in range(num_nodes) if depth_of[n] == depth]
            for row in range(batch):
                for n in level:
                    parent = parents[n]
                    siblings = [m for m in level if parents[m] == parent]
                    logits = level_logits[parent][row]
                    if params.greedy:
                        top = top_tokens(logits, len(siblings))
                        nodes[row, n] = top[siblings.index(n)]
                    else:
                        q = node_probs.setdefault((row, parent), filter_logits(logits[None], params)[0])
                        nodes[row, n] = int(q.sample(rng))
            if depth < len(tree_widths):                 # feed this level to get its children's logits
                draft.rollback(base)
                feed_nodes = [n for n in range(1, num_nodes) if depth_of[n] <= depth]
                sub_mask = mask[np.ix_(feed_nodes, feed_nodes)]
                positions = base[:, None] + np.array([depth_of[n] - 1 for n in feed_nodes])[None, :]
                out = draft.forward(nodes[:, feed_nodes], positions, np.broadcast_to(sub_mask, (batch,) + sub_mask.shape))
                for column, n in enumerate(feed_nodes):
                    level_logits[n] = out[:, column]
        draft.rollback(base)
        t1 = time.perf_counter()
        start = target.lengths
        positions = start[:, None] + np.array([depth_of[n] for n in range(num_nodes)])[None, :]
        logits = target.forward(nodes, positions, np.broadcast_to(mask, (batch,) + mask.shape))
        t2 = time.perf_counter()
        new_draft = base.copy()                           # the draft keeps prefix + pending only
        for row in range(batch):
            if seqs.done[row]:                            # finished rows idle: nothing kept or grown
                target.keep(row, int(start[row]), [])
                pending[row] = [bonus[row]]
                new_draft[row] = draft_start[row]
                continue
            path, node, extra = [0], 0, None
            while extra is None:
                children = [m for m in range(num_nodes) if parents[m] == node]
                if not children:
                    extra = int(next_tokens(logits[row, node][None], params, rng)[0])
                    break
                p = None if params.greedy else filter_logits(logits[row, node][None], params)[0]
                chosen, extra = verify_tree_children([int(nodes[row, m]) for m in children],
                                                     node_probs.get((row, node)), p,
                                                     logits[row, node] if params.greedy else None, rng)
                if chosen is not None:
                    node = children[chosen]
                    path.append(node)
            accepted = [int(nodes[row, n]) for n in path[1:]]
            seqs.commit(row, accepted + [extra])
            stats.record_round(len(accepted))
            target.keep(row, int(start[row]), path)       # root + accepted nodes, compacted
            pending[row] = accepted + [extra]
            bonus[row] = extra
        draft.rollback(new_draft)
        stats.add_time(draft_s=t1 - t0, verify_s=t2 - t1)
    return stats.summary()


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


def tree_mask_from_parents(parents: list[int]) -> np.ndarray:
    """Boolean [N, N]: node i sees node j iff j is i or an ancestor of i."""
    size = len(parents)
    mask = np.eye(size, dtype=bool)
    for node in range(size):
        ancestor = parents[node]
        while ancestor >= 0:
            mask[node, ancestor] = True
            ancestor = parents[ancestor]
    return mask
