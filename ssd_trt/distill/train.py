"""Distilling the independent draft: KL(target || draft) on the target's top-k logits, resumable, seeded.

Data order is a pure function of (seed, step): epoch e uses ``randperm(n, seed + e)``, so a
resumed run sees exactly the batches an uninterrupted run would; the loop, its checkpoint (optimizer
and all RNG states) and the schedule are ``loop.py``'s, shared with the EAGLE-3 trainer.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .loop import Evaluation, StepResult, run_training
from .model import DraftModel, save_draft
from .teacher import Sample


@dataclass
class TrainConfig:
    steps: int = 2000
    batch: int = 16
    max_len: int = 384
    lr: float = 1.5e-3
    min_lr_frac: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    ckpt_every: int = 100
    eval_samples: int = 96
    bf16: bool = False
    # Loss weight of prompt positions relative to the target's own continuations. Prompt text
    # (corpus passages, instructions) teaches general English, but the draft is judged on -- and
    # used on -- continuations, where the target's distribution is much more predictable.
    prompt_weight: float = 0.5


def select_head_ids(samples: list[Sample], size: int, always: list[int], vocab: int) -> torch.Tensor:
    """The ``size`` tokens most worth proposing, ranked by how often the target favours them.

    The score weights the target's top-1 (what greedy decoding emits, the tokens a draft must be
    able to propose) above top-4 membership and raw occurrence in the text. ``always`` (special
    tokens such as end-of-turn) is forced in.
    """
    if size <= 0 or size > vocab:
        raise ValueError(f"head size must be in 1..{vocab}, got {size}")
    score = torch.zeros(vocab, dtype=torch.float64)
    for s in samples:
        ti = s.topk_ids.long()
        score += 4 * torch.bincount(ti[:, 0], minlength=vocab)
        score += torch.bincount(ti[:, :4].reshape(-1), minlength=vocab)
        score += torch.bincount(s.ids.long(), minlength=vocab)
    score[torch.tensor(always, dtype=torch.long)] = float("inf")
    return torch.sort(score.topk(size).indices).values


def split_samples(samples: list[Sample], every: int = 25) -> tuple[list[Sample], list[Sample]]:
    """Deterministic held-out split: every ``every``-th sample is held out."""
    held = [s for i, s in enumerate(samples) if i % every == every - 1]
    train = [s for i, s in enumerate(samples) if i % every != every - 1]
    return train, held


def make_batch(samples: list[Sample], sub_index: torch.Tensor, max_len: int):
    """Right-padded batch: ids [B,T], target sub-vocab ids [B,T,k] (-1 = not in head), teacher
    logits [B,T,k], loss mask [B,T], and a mask of continuation positions (for agreement)."""
    T = min(max_len, max(len(s.ids) for s in samples))
    k = samples[0].topk_ids.shape[1]
    B = len(samples)
    ids = torch.zeros(B, T, dtype=torch.long)
    tid = torch.full((B, T, k), -1, dtype=torch.long)
    tlog = torch.zeros(B, T, k)
    mask = torch.zeros(B, T, dtype=torch.bool)
    cont = torch.zeros(B, T, dtype=torch.bool)
    for i, s in enumerate(samples):
        n = min(T, len(s.ids))
        ids[i, :n] = s.ids[:n].long()
        tid[i, :n] = sub_index[s.topk_ids[:n].long()]
        tlog[i, :n] = s.topk_logits[:n].float()
        mask[i, s.start:n] = True
        cont[i, max(s.n_prompt - 1, 0):n] = True  # position n_prompt-1 predicts the first new token
    return ids, tid, tlog, mask, cont


def kd_loss(logits: torch.Tensor, tid: torch.Tensor, tlog: torch.Tensor, mask: torch.Tensor,
            weight: torch.Tensor | None = None) -> torch.Tensor:
    """Soft cross-entropy = KL(p || q) + const, p = target softmax over its top-k ∩ head.

    Teacher tokens outside the draft head are dropped and p renormalised: the draft cannot
    propose them, so there is nothing to learn about them.
    """
    valid = tid >= 0
    p = torch.softmax(tlog.masked_fill(~valid, float("-inf")), -1)
    p = torch.nan_to_num(p)  # a position with no valid teacher token contributes nothing
    logq = torch.log_softmax(logits.float(), -1).gather(-1, tid.clamp(min=0))
    per_pos = -(p * logq.masked_fill(~valid, 0.0)).sum(-1)
    m = (mask & valid.any(-1)).float()
    if weight is not None:
        m = m * weight
    return (per_pos * m).sum() / m.sum().clamp(min=1e-6)


def head_index(model: DraftModel) -> torch.Tensor:
    """Vocabulary id -> row of the draft's head (-1: not in the head); the identity for a full head."""
    vocab = model.config.vocab_size
    if model.lm_head_token_ids is None:
        return torch.arange(vocab)
    index = torch.full((vocab,), -1, dtype=torch.long)
    index[model.lm_head_token_ids] = torch.arange(len(model.lm_head_token_ids))
    return index


def batch_indices(step: int, n_samples: int, c: TrainConfig) -> list[int]:
    """The training samples of batch ``step``: epoch e walks ``randperm(n, seed * 7919 + e)``, so the order
    is a pure function of (seed, step) and a resumed run sees the batches an uninterrupted one would."""
    epoch, j = divmod(step, n_samples // c.batch)
    perm = torch.randperm(n_samples, generator=torch.Generator().manual_seed(c.seed * 7919 + epoch))
    return [int(i) for i in perm[j * c.batch:(j + 1) * c.batch]]


@torch.no_grad()
def heldout_agreement(model: DraftModel, held: list[Sample], sub_index: torch.Tensor, c: TrainConfig) -> dict:
    """Greedy agreement (draft argmax == target argmax) on held-out continuation positions,
    from the stored teacher labels: cheap enough to run at every checkpoint."""
    model.eval()
    hit = tot = 0
    loss_sum = 0.0
    n_batches = 0
    for b0 in range(0, min(len(held), c.eval_samples), c.batch):
        ids, tid, tlog, mask, cont = make_batch(held[b0:b0 + c.batch], sub_index, c.max_len)
        logits = model.head_logits(model.hidden(ids))
        loss_sum += float(kd_loss(logits, tid, tlog, mask))
        n_batches += 1
        pred = model.lm_head_token_ids[logits.argmax(-1)] if model.lm_head_token_ids is not None else logits.argmax(-1)
        top1 = torch.full_like(ids, -2)
        ok = tid[..., 0] >= 0
        top1[ok] = model.lm_head_token_ids[tid[..., 0][ok]] if model.lm_head_token_ids is not None else tid[..., 0][ok]
        # positions whose teacher top-1 is outside the head count as misses (top1 = -2)
        m = cont & mask
        hit += int(((pred == top1) & m).sum())
        tot += int(m.sum())
    model.train()
    return {"agree": hit / max(tot, 1), "loss": loss_sum / max(n_batches, 1), "positions": tot}


def train(model: DraftModel, train_s: list[Sample], held: list[Sample], c: TrainConfig, out: Path,
          resume: bool = False, log=print) -> dict:
    """Run (or resume) training; writes ``out/ckpt.pt``, the best draft to ``out/best/`` and the latest to
    ``out/last/``."""
    if len(train_s) < c.batch:
        raise ValueError(f"need at least batch={c.batch} training samples, got {len(train_s)}")
    sub_index = head_index(model)

    def step_loss(step: int) -> StepResult:
        batch = [train_s[i] for i in batch_indices(step, len(train_s), c)]
        ids, tid, tlog, mask, cont = make_batch(batch, sub_index, c.max_len)
        weight = torch.where(cont, 1.0, c.prompt_weight)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.bf16):
            logits = model.head_logits(model.hidden(ids))
        return StepResult(kd_loss(logits, tid, tlog, mask, weight))

    def evaluate() -> Evaluation:
        ev = heldout_agreement(model, held, sub_index, c) if held else {"agree": 0.0, "loss": float("nan")}
        return Evaluation(ev["agree"], ev, f"held-out agreement {ev['agree']:.4f} kd {ev['loss']:.4f}")

    summary = run_training(model, c, out, step_loss=step_loss, evaluate=evaluate,
                           save_best=lambda: save_draft(model, out / "best"),
                           save_last=lambda: save_draft(model, out / "last"),
                           held_out_size=len(held), resume=resume, desc="distill", log=log)
    return {"step": summary["step"], "best_heldout_agreement": summary["best"], "minutes": summary["minutes"],
            "history": summary["history"]}
