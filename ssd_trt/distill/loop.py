"""The resumable training loop both draft trainers share (``train.py``: the independent draft;
``eagle3_train.py``: the feature draft with training-time test).

What the loop owns: AdamW with decay on matrices only, the warmup + cosine schedule (``lr_at``), gradient
clipping, a progress bar, a held-out evaluation every ``ckpt_every`` steps that keeps the best state, and an
atomic checkpoint of everything a resumed run needs (model, optimizer, step, history, RNG states) — so a
killed run resumed with ``--resume`` sees exactly the batches an uninterrupted one would (the trainers draw
batch ``step`` as a pure function of (seed, step): ``train.batch_indices``). What each trainer brings: its
loss for a step and its evaluation.
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch
from tqdm import tqdm


class LoopConfig(Protocol):
    """The fields of a trainer's config the loop reads (``TrainConfig``, ``Eagle3TrainConfig``)."""
    steps: int
    batch: int
    lr: float
    min_lr_frac: float
    warmup: int
    weight_decay: float
    clip: float
    seed: int
    ckpt_every: int


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor                                      # to backpropagate
    record: dict[str, Any] = dataclasses.field(default_factory=dict)   # extra history fields every 10 steps
    postfix: dict[str, str] = dataclasses.field(default_factory=dict)  # progress-bar fields


@dataclass(frozen=True)
class Evaluation:
    score: float              # higher is better; the best state is kept
    record: dict[str, Any]    # goes into the history
    summary: str              # one log line


def lr_at(step: int, c: LoopConfig) -> float:
    """Linear warmup to ``lr``, then a cosine down to ``min_lr_frac * lr`` at ``steps``."""
    if step < c.warmup:
        return c.lr * (step + 1) / c.warmup
    t = (step - c.warmup) / max(1, c.steps - c.warmup)
    return c.lr * (c.min_lr_frac + (1 - c.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def make_optimizer(model: torch.nn.Module, c: LoopConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters; weight decay on matrices except embeddings."""
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decay = [p for n, p in params if p.ndim == 2 and "embed" not in n]
    rest = [p for n, p in params if not (p.ndim == 2 and "embed" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": c.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=c.lr, betas=(0.9, 0.95))


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def run_training(model: torch.nn.Module, c: LoopConfig, out: Path, *, step_loss: Callable[[int], StepResult],
                 evaluate: Callable[[], Evaluation], save_best: Callable[[], None],
                 save_last: Callable[[], None] | None = None, held_out_size: int = 0, resume: bool = False,
                 stop_after: int | None = None, desc: str = "train", log=print) -> dict:
    """Train ``model`` for ``c.steps`` steps (or resume from ``out/ckpt.pt``): ``step_loss(step)`` gives the
    loss of batch ``step``, ``evaluate()`` scores the model every ``c.ckpt_every`` steps and ``save_best()``
    keeps the best state. ``stop_after``: end after that many steps of the ``c.steps`` schedule (the learning
    rate follows the full schedule). Returns {"step", "best", "minutes", "history"}."""
    end = c.steps if stop_after is None else min(stop_after, c.steps)
    out.mkdir(parents=True, exist_ok=True)
    opt = make_optimizer(model, c)
    trainable = [p for p in model.parameters() if p.requires_grad]
    step, best, history, elapsed = 0, -1.0, [], 0.0
    ckpt = out / "ckpt.pt"
    torch.manual_seed(c.seed)
    random.seed(c.seed)
    if resume and ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if state["config"]["seed"] != c.seed:
            # the data order is a function of the seed: a different one would silently change it
            raise ValueError(f"--resume with seed {c.seed}, but {ckpt} was trained with seed {state['config']['seed']}")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, best, history, elapsed = state["step"], state["best"], state["history"], state["elapsed"]
        if state.get("n_held") != held_out_size:
            best = -1.0   # resumed on more data: the held-out set changed, old scores do not compare
        _set_rng_state(state["rng"])
        log(f"resumed at step {step}")
    model.train()
    t0 = time.time() - elapsed
    bar = tqdm(total=c.steps, initial=step, desc=desc, dynamic_ncols=True)
    while step < end:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, c)
        result = step_loss(step)
        opt.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, c.clip)
        opt.step()
        step += 1
        bar.update(1)
        loss_value = result.loss.item()
        bar.set_postfix(loss=f"{loss_value:.3f}", lr=f"{lr_at(step - 1, c):.1e}", **result.postfix)
        if step % 10 == 0:
            history.append({"step": step, "loss": loss_value, **result.record})
        if step % c.ckpt_every == 0 or step == end:
            model.eval()
            with torch.no_grad():
                ev = evaluate()
            model.train()
            minutes = (time.time() - t0) / 60
            history.append({"eval": {**ev.record, "step": step, "minutes": minutes}})
            log(f"step {step}: {ev.summary} ({minutes:.1f} min)")
            if ev.score > best:
                best = ev.score
                save_best()
            if save_last is not None:
                save_last()
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "best": best,
                     "history": history, "elapsed": time.time() - t0, "n_held": held_out_size,
                     "rng": _rng_state(), "config": dataclasses.asdict(c)}
            torch.save(state, ckpt.with_suffix(".tmp"))
            ckpt.with_suffix(".tmp").replace(ckpt)   # atomic: a kill mid-save keeps the old checkpoint
    bar.close()
    return {"step": step, "best": best, "minutes": (time.time() - t0) / 60, "history": history}
