"""How well an EAGLE-3 draft predicts the real target, and what it costs per token.

* step-1 (first-token) agreement: the target greedily continues each prompt (fp32); then, teacher-forced
  on that text, with the target's features up to position p-1 and the tokens up to p, how often the
  draft's argmax is the target's greedy token p+1. This is the acceptance rate of greedy SD with K=1.
* step-s agreement (s = 2, 3): the same, but the draft's last s-1 tokens carry its own features (a chain
  of s draft steps after a verified prefix, the tokens along it the target's): the acceptance of the s-th
  drafted token given the ones before it were accepted.
* mean accepted (K = steps): the mean number of leading agreements of a chain started at every position,
  i.e. tokens accepted per greedy SD round before the bonus token.
* cost: one thread, median over interleaved repeats of a one-token decode step at a 100-token context,
  the draft (``Eagle3Draft.forward``) vs the target (:class:`Decoder`), both torch with the tree-attention op.
"""
from __future__ import annotations

import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from ssd_trt_plugins.tree_attention.masks import causal_tree_mask
from ssd_trt.models.decoder import Decoder
from ssd_trt.models.eagle3 import Eagle3Draft

from .eagle3_data import target_pass
from .eagle3_train import macs_per_token, unrolled_forward
from .evaluate import load_prompt_file, target_continuations


@torch.inference_mode()
def agreement_by_step(draft: Eagle3Draft, target: Decoder, seqs: list[tuple[list[int], int]],
                      groups: list[tuple[str, ...]], steps: int = 3) -> dict[str, dict]:
    """Step-s agreement for s = 1..steps and the mean accepted chain length, per group name (each sequence
    counts in every group it lists, e.g. its category and "all")."""
    stats: dict[str, list[float]] = defaultdict(lambda: [0.0] * (2 * steps + 2))
    for (ids, n_prompt), names in zip(seqs, groups):
        if len(ids) <= n_prompt or n_prompt < 2:
            continue
        ids_t = torch.tensor(ids)
        features, logits = target_pass(target, ids_t)
        greedy = logits.argmax(-1)                          # greedy[p]: the target's token p + 1
        unrolled = unrolled_forward(draft, ids_t[None], features[None].float(), steps)
        # guess[s][p]: the draft's token p + 1 at step s (its row p - 1)
        guess = [draft.draft_token_ids[u[0].argmax(-1)] for u in unrolled]
        agree = [torch.zeros(len(ids), dtype=torch.bool) for _ in range(steps)]
        for s in range(steps):
            agree[s][1:] = guess[s] == greedy[1:]
        positions = range(n_prompt - 1, len(ids) - 1)      # the continuation's tokens
        for key in names:
            row = stats[key]
            for s in range(steps):
                ok = [p for p in positions if p - s >= 1]
                row[2 * s] += float(agree[s][ok].sum())
                row[2 * s + 1] += len(ok)
            # a chain after a verified prefix ending at p - 1: its s-th token is predicted by step s at p + s
            for p in positions:
                accepted = 0
                while accepted < steps and p + accepted < len(ids) - 1 and agree[accepted][p + accepted]:
                    accepted += 1
                row[2 * steps] += accepted
                row[2 * steps + 1] += 1
    return {key: {**{f"step{s + 1}_agreement": row[2 * s] / max(row[2 * s + 1], 1) for s in range(steps)},
                  f"mean_accepted_k{steps}": row[2 * steps] / max(row[2 * steps + 1], 1),
                  "positions": int(row[1])}
            for key, row in stats.items()}


@torch.inference_mode()
def cost_report(draft: Eagle3Draft, target: Decoder, context: int = 100, repeats: int = 40) -> dict:
    """Median one-token decode time of the draft and the target at ``context`` cached tokens (interleaved)."""
    one = torch.from_numpy(causal_tree_mask(1, 1))
    length = torch.tensor([context], dtype=torch.int32)
    token, position = torch.tensor([[17]]), torch.tensor([[context]])
    t_caches = [torch.randn_like(c) for c in target.empty_caches(1, context + 1)]
    d_caches = [torch.randn_like(c) for c in draft.empty_caches(1, context + 1)]
    width = draft.config.layer.hidden_size
    features, hidden = torch.randn(1, 1, 3 * width), torch.randn(1, 1, width)
    from_target = torch.ones(1, 1, dtype=torch.bool)

    def run_target():
        target(token, position, one, length, *t_caches)

    def run_draft():
        draft(token, position, one, length, features, hidden, from_target, *d_caches)

    times: dict[str, list[float]] = {"target": [], "draft": []}
    for _ in range(3):
        run_target(), run_draft()
    for _ in range(repeats):
        for name, fn in (("target", run_target), ("draft", run_draft)):
            t = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t) * 1e3)
    t_ms, d_ms = statistics.median(times["target"]), statistics.median(times["draft"])
    t_macs = sum(p.numel() for n, p in target.named_parameters() if p.ndim == 2 and "embed" not in n) + \
        (target.config.vocab_size * target.config.hidden_size if target.lm_head is None else 0)
    return {"target_ms_per_token_torch": t_ms, "draft_ms_per_token_torch": d_ms, "time_ratio_torch": d_ms / t_ms,
            "target_macs_per_token": t_macs, "draft_macs_per_token": macs_per_token(draft),
            "mac_ratio": macs_per_token(draft) / t_macs, "context": context, "repeats": repeats,
            "threads": torch.get_num_threads()}


def evaluate_eagle3(draft: Eagle3Draft, target: Decoder, hf_target, tok, prompt_file: Path, max_new: int = 64,
                    steps: int = 3) -> dict:
    """Agreement per category as the benchmark runs its prompts (the chat template for every category but
    ``prose``), over the templated ones ("chat_template") and over plain-text continuation ("plain_text":
    the ``prose`` prompts without a template; the prompt set has no other plain-text prompts), and the cost."""
    t0 = time.time()
    items = load_prompt_file(prompt_file)
    seqs = target_continuations(hf_target, tok, [p for _, p in items], max_new)
    groups = [(c, "all", "chat_template" if p.chat else "plain_text") for c, p in items]
    return {"prompt_file": str(prompt_file), "max_new_tokens": max_new, "n_prompts": len(items),
            "agreement": agreement_by_step(draft.eval(), target, seqs, groups, steps),
            "cost": cost_report(draft, target), "eval_seconds": time.time() - t0}
