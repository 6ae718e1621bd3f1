"""Fit the draft's copy weights lam_n (engines/copy_mixture.py) on held-out distillation data.

Each match length n gets its own lam_n, chosen on the held-out teacher sequences (never the benchmark
prompts) to maximise greedy agreement: at a position whose longest recurring suffix has n tokens and
follower f, argmax q' is f when (1 - lam) q(f) + lam > (1 - lam) max_v q(v), else the draft's argmax.
Agreement is flat over a range of lam (only the side of each threshold matters), so within that range
the fit takes the lam with the best distillation likelihood sum_v p(v) log q'(v) over the target's
stored top-k: greedy decoding gets the agreement-optimal choice, sampling a calibrated q'.
Positions with different n do not interact, so a grid search per n is exact.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

from ssd_trt.engines.copy_mixture import CopyMixture
from ssd_trt.ngram import longest_match

from .model import DraftModel
from .teacher import Sample

GRID = np.round(np.arange(0.0, 0.96, 0.05), 2)


@dataclass
class MatchedPosition:
    size: int            # n, the longest recurring suffix
    follower_right: bool  # f == target argmax
    draft_right: bool     # argmax q == target argmax
    q_follower: float
    q_max: float
    p_top: np.ndarray     # the target's distribution over its stored top-k tokens
    q_top: np.ndarray     # the draft's probabilities of those tokens
    follower_slot: int    # f's index among them, -1 if f is not one of them

    def log_likelihood(self, lam: float) -> float:
        mixed = (1 - lam) * self.q_top
        if self.follower_slot >= 0:
            mixed[self.follower_slot] += lam
        return float(np.dot(self.p_top, np.log(mixed + 1e-12)))


# The draft's teacher-forced logits of a held-out sequence: row t [V] is its distribution of token t + 1
# (an independent draft reads the tokens; a feature draft also the target's features stored with them).
SequenceLogits = Callable[[Sample], torch.Tensor]


def independent_draft_logits(draft: DraftModel) -> SequenceLogits:
    return lambda sample: draft(sample.ids.long()[None])[0]


@torch.inference_mode()
def matched_positions(logits_of: SequenceLogits, samples: list[Sample], max_ngram: int
                      ) -> tuple[list[MatchedPosition], int, int]:
    """(positions that have a recurring suffix, all continuation positions, draft-right positions)."""
    found, total, draft_right = [], 0, 0
    for s in tqdm(samples, desc="copy-fit positions", unit="seq"):
        ids = s.ids.long()
        first = max(s.n_prompt - 1, s.start)
        if len(ids) <= first + 1:
            continue
        q = torch.softmax(logits_of(s)[first:len(ids) - 1].float(), -1)
        target_top = s.topk_ids[first:len(ids) - 1, 0].long()   # top-k is stored sorted: column 0 is argmax p
        q_max, q_arg = q.max(-1)
        top_ids = s.topk_ids[first:len(ids) - 1].long()
        p_top = torch.softmax(s.topk_logits[first:len(ids) - 1].float(), -1).numpy()
        q_top = q.gather(-1, top_ids).numpy()
        top_ids = top_ids.numpy()
        right = (q_arg == target_top)
        total += len(right)
        draft_right += int(right.sum())
        array = ids.numpy()
        for t in range(len(right)):
            match = longest_match(array[:first + t + 1], max_ngram)
            if match is not None:
                follower, size = match
                slot = np.flatnonzero(top_ids[t] == follower)
                found.append(MatchedPosition(size, follower == int(target_top[t]), bool(right[t]),
                                             float(q[t, follower]), float(q_max[t]), p_top[t], q_top[t],
                                             int(slot[0]) if len(slot) else -1))
    return found, total, draft_right


def fit_copy_mixture(logits_of: SequenceLogits, held: list[Sample], max_ngram: int = 8) -> tuple[CopyMixture, dict]:
    positions, total, draft_right = matched_positions(logits_of, held, max_ngram)
    weights, gained = [], 0
    for size in range(1, max_ngram + 1):
        here = [p for p in positions if p.size == size]
        if not here:                  # never seen on held-out data: no evidence to trust the follower
            weights.append(0.0)
            continue
        base = sum(p.draft_right for p in here)
        scored = []
        for lam in GRID:
            right = sum(p.follower_right if (1 - lam) * p.q_follower + lam > (1 - lam) * p.q_max else p.draft_right
                        for p in here)
            scored.append((right, sum(p.log_likelihood(lam) for p in here), float(lam)))
        best, _, best_weight = max(scored)     # most agreement, then the best likelihood among equals
        weights.append(best_weight)
        gained += best - base
    summary = {"held_out_positions": total, "matched_positions": len(positions),
               "greedy_agreement_draft": draft_right / max(total, 1),
               "greedy_agreement_with_copy": (draft_right + gained) / max(total, 1),
               "weights": [round(w, 4) for w in weights]}
    return CopyMixture(tuple(weights)), summary


def add_copy_arguments(ap: argparse.ArgumentParser, fit_only_help: str) -> None:
    """The copy component's options, the same for every kind of draft the distill pipelines train."""
    ap.add_argument("--no-copy", action="store_true",
                    help="do not fit the draft's copy component (prompt-lookup mixture, copy_fit.py)")
    ap.add_argument("--copy-max-ngram", type=int, default=8, help="longest suffix the copy component matches")
    ap.add_argument("--fit-copy-only", type=Path, default=None, help=fit_only_help)


def fit_and_store(logits_of: SequenceLogits, held: list[Sample], draft_dir: Path, max_ngram: int) -> dict:
    """Fit the copy weights on ``held`` and store them in ``draft_dir``/config.json (the build reads them)."""
    mixture, summary = fit_copy_mixture(logits_of, held, max_ngram)
    write_copy_mixture(draft_dir, mixture)
    print(f"copy component: held-out greedy agreement {summary['greedy_agreement_draft']:.3f} -> "
          f"{summary['greedy_agreement_with_copy']:.3f}, weights {summary['weights']}")
    return summary


def write_copy_mixture(draft_dir: Path, mixture: CopyMixture) -> None:
    """Store the weights in the draft's config.json (the engine build carries them to the runtime)."""
    path = Path(draft_dir) / "config.json"
    config = json.loads(path.read_text())
    config["copy_mixture"] = mixture.as_config()
    path.write_text(json.dumps(config, indent=2) + "\n")


def read_copy_mixture(draft_dir: Path) -> CopyMixture | None:
    path = Path(draft_dir) / "config.json"
    return CopyMixture.from_config(json.loads(path.read_text()), where=str(path))
