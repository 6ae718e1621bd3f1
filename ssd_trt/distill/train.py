"""Distillation loop: KL(target || draft) on the target's top-k logits, resumable, seeded.

Data order is a pure function of (seed, step): epoch e uses ``randperm(n, seed + e)``, so a
resumed run sees exactly the batches an uninterrupted run would. The checkpoint also carries
the optimizer and all RNG states.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

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


def lr_at(step: int, c: TrainConfig) -> float:
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    t = (step - c.warmup) / max(1, c.steps - c.warmup)
    return c.lr * (c.min_lr_frac + (1 - c.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def make_optimizer(model: DraftModel, c: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=c.lr, betas=(0.9, 0.95))


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


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(s: dict) -> None:
    torch.set_rng_state(s["torch"])
    random.setstate(s["python"])


def train(model: DraftModel, train_s: list[Sample], held: list[Sample], c: TrainConfig, out: Path,
          resume: bool = False, log=print) -> dict:
    """Run (or resume) training; writes ``out/ckpt.pt`` and the best draft to ``out/best/``."""
    if len(train_s) < c.batch:
        raise ValueError(f"need at least batch={c.batch} training samples, got {len(train_s)}")
    out.mkdir(parents=True, exist_ok=True)
    sub_index = head_index(model)
    opt = make_optimizer(model, c)
    step, best, history, elapsed = 0, -1.0, [], 0.0
    ckpt = out / "ckpt.pt"
    torch.manual_seed(c.seed)
    random.seed(c.seed)
    if resume and ckpt.exists():
        st = torch.load(ckpt, weights_only=False)
        if st["config"]["seed"] != c.seed:
            # the data order is a function of the seed: a different one would silently change it
            raise ValueError(f"--resume with seed {c.seed}, but {ckpt} was trained with seed {st['config']['seed']}")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, best, history, elapsed = st["step"], st["best"], st["history"], st["elapsed"]
        if st.get("n_held") != len(held):
            best = -1.0  # resumed on more data: the held-out set changed, old scores do not compare
        _set_rng_state(st["rng"])
        log(f"resumed at step {step}")
    model.train()
    t0 = time.time() - elapsed
    bar = tqdm(total=c.steps, initial=step, desc="distill", dynamic_ncols=True)
    while step < c.steps:
        batch = [train_s[i] for i in batch_indices(step, len(train_s), c)]
        ids, tid, tlog, mask, cont = make_batch(batch, sub_index, c.max_len)
        weight = torch.where(cont, 1.0, c.prompt_weight)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, c)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.bf16):
            logits = model.head_logits(model.hidden(ids))
        loss = kd_loss(logits, tid, tlog, mask, weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c.clip)
        opt.step()
        step += 1
        bar.update(1)
        loss_value = loss.item()
        bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr_at(step - 1, c):.1e}")
        if step % 10 == 0:
            history.append({"step": step, "loss": loss_value})
        if step % c.ckpt_every == 0 or step == c.steps:
            ev = heldout_agreement(model, held, sub_index, c) if held else {"agree": 0.0, "loss": float("nan")}
            ev.update(step=step, minutes=(time.time() - t0) / 60)
            history.append({"eval": ev})
            log(f"step {step}: held-out agreement {ev['agree']:.4f} kd {ev['loss']:.4f} ({ev['minutes']:.1f} min)")
            if ev["agree"] > best:
                best = ev["agree"]
                save_draft(model, out / "best")
            save_draft(model, out / "last")
            st = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "best": best,
                  "history": history, "elapsed": time.time() - t0, "n_held": len(held), "rng": _rng_state(), "config": c.__dict__}
            torch.save(st, ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").replace(ckpt)  # atomic: a kill mid-save keeps the old checkpoint
    bar.close()
    return {"step": step, "best_heldout_agreement": best, "minutes": (time.time() - t0) / 60, "history": history}
