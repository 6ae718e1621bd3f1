"""Pilots of ways to raise the shipped draft's greedy agreement (model card, "Levers measured").

Each pilot is short (minutes on 2 cores) and compares against a baseline run the same way:

  data      the target writes N user prompts (magpie.py), answers them greedily and answers N/3
            prompts derived from its answers; top-32 teacher labels        -> DATA/teacher_*/
            --openers instruct steers the chat turns with generic instruction openers
  finetune  the shipped draft, 200 steps on DATA with one of four losses   -> OUT/ (a draft dir)
            soft: KL to the top-32 labels (the training loss) | hard: argmax labels |
            sharp: the teacher at temperature 0.5 | copy: the copy mixture q' inside the loss
            --layers 10 first deepens it: a new layer after each shipped one, its output projections
            zero, so the grown draft starts as exactly the shipped function
  evaluate  greedy agreement of a draft dir on the benchmark prompts, network alone and with the
            shipped copy weights (the target's continuations are cached in --cache); with --on-data DATA,
            on every third of DATA's own sequences instead (the stored bf16 teacher argmax)
  datastore retrieval from the target's answers in DATA (REST-style): how often the most frequent
            follower of the longest suffix found there is right where the draft is wrong, and the
            best gate's agreement (fitted on the benchmark itself: an upper bound)
  curves    held-out agreement against step and against training minutes of several
            `python -m ssd_trt.distill` work directories (e.g. drafts of different depth trained
            from scratch on the same teacher data, so they share one held-out set)  -> a PNG

  python research/draft/draft_lever_pilots.py data --out runs/pilots/a --seed 0
  python research/draft/draft_lever_pilots.py finetune --data runs/pilots/a --loss soft --out runs/pilots/ft_soft
  python research/draft/draft_lever_pilots.py evaluate --draft runs/pilots/ft_soft
  python research/draft/draft_lever_pilots.py datastore --data runs/pilots/a
  python research/draft/draft_lever_pilots.py curves runs/distill/scratch5 runs/distill/scratch10 --png curves.png
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ssd_trt.ngram import longest_match  # noqa: E402
from ssd_trt.distill import magpie  # noqa: E402
from ssd_trt.distill.copy_fit import read_copy_mixture  # noqa: E402
from ssd_trt.distill.evaluate import load_prompt_file, target_continuations  # noqa: E402
from ssd_trt.distill.model import DraftConfig, DraftModel, load_draft, save_draft  # noqa: E402
from ssd_trt.distill.teacher import Sample, label_prompts, load_samples, load_target  # noqa: E402
from ssd_trt.distill.loop import lr_at, make_optimizer  # noqa: E402
from ssd_trt.distill.train import (TrainConfig, batch_indices, head_index, kd_loss,  # noqa: E402
                                  make_batch, split_samples)

SHIPPED = ROOT / "recipes" / "drafts" / "smollm2-135m-draft"
BENCH = ROOT / "ssd_trt" / "bench" / "prompts" / "default.jsonl"
INSTRUCTION_OPENERS = ["Explain", "Write", "What are", "How can I", "Give me", "Describe", "List", "Compare",
                       "Why do", "Suggest", "Can you help me", "I want to", "I need", "Create", "Tell me about",
                       "How does", "What is the difference between", "Help me", "Rewrite", "What should I",
                       "Plan", "Teach me"]
MAX_NGRAM = 8


def pilot_data(out: Path, n: int, seed: int, openers: str) -> None:
    target, tok = load_target("smollm2-135m", torch.bfloat16)
    mix = list(magpie.OPENERS)
    temperature = 1.0
    if openers == "instruct":   # 60% generic instruction openers, 10% free, code/math as in training
        mix = ([("chat", o, 0.6 / len(INSTRUCTION_OPENERS)) for o in INSTRUCTION_OPENERS] + [("chat", "", 0.1)]
               + [entry for entry in magpie.OPENERS if entry[0] != "chat"])
        temperature = 0.8
    own = magpie.synthesize_prompts(target, tok, n, out / "magpie_prompts.jsonl", seed=seed,
                                    temperature=temperature, openers=mix)
    shards = label_prompts(target, tok, own, out / "teacher_magpie", sample_frac=0.0, seed=1)
    derived = magpie.derived_prompts(tok, load_samples(shards), n // 3, 0)
    label_prompts(target, tok, derived, out / "teacher_derived", sample_frac=0.0, seed=2)


def data_samples(data: Path) -> list[Sample]:
    return load_samples(sorted((data / "teacher_magpie").glob("shard_*.pt"))
                        + sorted((data / "teacher_derived").glob("shard_*.pt")))


def copy_targets(samples: list[Sample]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample and position t: the copy follower of ids[:t+1] (-1: none) and its shipped weight lam_n."""
    weights = read_copy_mixture(SHIPPED).weights
    out = []
    for s in tqdm(samples, desc="copy followers"):
        ids = s.ids.numpy().astype(np.int64)
        follower, lam = np.full(len(ids), -1), np.zeros(len(ids), np.float32)
        for t in range(max(s.n_prompt - 1, 1), len(ids)):
            match = longest_match(ids[:t + 1], MAX_NGRAM)
            if match is not None:
                follower[t], lam[t] = match[0], weights[match[1] - 1]
        out.append((torch.from_numpy(follower), torch.from_numpy(lam)))
    return out


def pilot_loss(loss: str, logits: torch.Tensor, tid: torch.Tensor, tlog: torch.Tensor, mask: torch.Tensor,
               weight: torch.Tensor, follower_slot: torch.Tensor | None, lam: torch.Tensor | None) -> torch.Tensor:
    """The training loss (``kd_loss``: cross-entropy of the teacher's top-k p, restricted to the head,
    against q) on the teacher's top-k (soft), its argmax only (hard) or its logits at temperature 0.5
    (sharp); for ``copy``, against q' = (1 - lam) q + lam [v = f] (f's head slot: ``follower_slot``, -1: none)."""
    if loss == "soft":
        return kd_loss(logits, tid, tlog, mask, weight)
    if loss == "hard":
        return kd_loss(logits, tid[..., :1], tlog[..., :1], mask, weight)
    if loss == "sharp":
        return kd_loss(logits, tid, tlog / 0.5, mask, weight)
    valid = tid >= 0
    p = torch.nan_to_num(torch.softmax(tlog.masked_fill(~valid, float("-inf")), -1))
    logq = torch.log1p(-lam)[..., None] + torch.log_softmax(logits.float(), -1).gather(-1, tid.clamp(min=0))
    is_follower = (tid == follower_slot[..., None]) & (follower_slot[..., None] >= 0)
    logq = torch.where(is_follower, torch.logaddexp(logq, torch.log(lam.clamp(min=1e-9))[..., None]), logq)
    per_position = -(p * logq.masked_fill(~valid, 0.0)).sum(-1)
    m = (mask & valid.any(-1)).float() * weight
    return (per_position * m).sum() / m.sum().clamp(min=1e-6)


def grown(draft: DraftModel, layers: int) -> DraftModel:
    """``draft`` with new layers interleaved (evenly) whose attention and MLP outputs are zero-initialised:
    each adds nothing to the residual stream until training moves it, so the function is unchanged."""
    old = len(draft.model.layers)
    if layers % old:
        raise ValueError(f"--layers must be a multiple of the shipped draft's {old} layers, got {layers}")
    bigger = DraftModel(replace(draft.config, num_hidden_layers=layers), draft.lm_head_token_ids)
    bigger.model.embed_tokens.load_state_dict(draft.model.embed_tokens.state_dict())
    bigger.model.norm.load_state_dict(draft.model.norm.state_dict())
    bigger.lm_head.load_state_dict(draft.lm_head.state_dict())
    per = layers // old
    for i, layer in enumerate(bigger.model.layers):
        if i % per == 0:
            layer.load_state_dict(draft.model.layers[i // per].state_dict())
        else:
            torch.nn.init.zeros_(layer.self_attn.o_proj.weight)
            torch.nn.init.zeros_(layer.mlp.down_proj.weight)
    return bigger


def finetune(data: Path, loss: str, out: Path, steps: int, lr: float, layers: int | None = None) -> None:
    train_s, _ = split_samples(data_samples(data))
    draft = load_draft(SHIPPED)
    if layers is not None:
        draft = grown(draft, layers)
    sub_index = head_index(draft)
    copies = copy_targets(train_s) if loss == "copy" else None
    c = TrainConfig(steps=steps, batch=16, lr=lr, warmup=20, bf16=True)
    opt = make_optimizer(draft, c)
    draft.train()
    for step in tqdm(range(steps), desc=f"fine-tune ({loss})"):
        picked = batch_indices(step, len(train_s), c)
        ids, tid, tlog, mask, cont = make_batch([train_s[i] for i in picked], sub_index, c.max_len)
        slot = lam = None
        if copies is not None:
            follower = torch.full(ids.shape, -1, dtype=torch.long)
            lam = torch.zeros(ids.shape)
            for row, i in enumerate(picked):
                n = min(ids.shape[1], len(copies[i][0]))
                follower[row, :n], lam[row, :n] = copies[i][0][:n], copies[i][1][:n]
            slot = torch.where(follower >= 0, sub_index[follower.clamp(min=0)], -1)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, c)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = draft.head_logits(draft.hidden(ids))
        value = pilot_loss(loss, logits, tid, tlog, mask, torch.where(cont, 1.0, c.prompt_weight), slot, lam)
        opt.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), c.clip)
        opt.step()
    save_draft(draft, out)


def benchmark_positions(cache: Path) -> list[dict]:
    """The target's greedy continuations of the benchmark prompts and its argmax at each position."""
    if cache.exists():
        return torch.load(cache, weights_only=False)
    target, tok = load_target("smollm2-135m")
    items = load_prompt_file(BENCH)
    rows = []
    with torch.inference_mode():
        for (ids, n), (category, _) in zip(target_continuations(target, tok, [p for _, p in items], 64), items):
            if len(ids) > n:
                logits = target(input_ids=torch.tensor(ids)[None]).logits[0, n - 1:len(ids) - 1]
                rows.append({"ids": ids, "n": n, "category": category, "target": logits.float().argmax(-1)})
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(rows, cache)
    return rows


def draft_logits(draft: DraftModel, rows: list[dict]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(network logits, network + shipped copy logits) [positions, V] of each row, one row at a time."""
    mixture = read_copy_mixture(SHIPPED)
    draft.eval()
    for r in rows:
        with torch.inference_mode():
            logits = draft(torch.tensor(r["ids"])[None])[0, r["n"] - 1:len(r["ids"]) - 1].float()
        mixed = mixture.apply_teacher_forced(logits.numpy().copy(), r["ids"], r["n"] - 1)
        yield logits, torch.from_numpy(mixed)


def data_positions(data: Path) -> list[dict]:
    """Every third sequence of a pilot data set, in the benchmark rows' form (the stored teacher argmax)."""
    rows = []
    for s in data_samples(data)[::3]:
        if len(s.ids) > s.n_prompt:
            rows.append({"ids": s.ids.tolist(), "n": s.n_prompt, "category": s.kind,
                         "target": s.topk_ids[s.n_prompt - 1:len(s.ids) - 1, 0].long()})
    return rows


def evaluate(draft_dir: Path, cache: Path, on_data: Path | None = None) -> None:
    rows = benchmark_positions(cache) if on_data is None else data_positions(on_data)
    tally = collections.defaultdict(lambda: [0, 0, 0])
    for r, (network, mixed) in zip(rows, draft_logits(load_draft(draft_dir), rows)):
        for key in (r["category"], "all"):
            t = tally[key]
            t[0] += int((network.argmax(-1) == r["target"]).sum())
            t[1] += int((mixed.argmax(-1) == r["target"]).sum())
            t[2] += len(r["target"])
    for key, (network, mixed, n) in sorted(tally.items()):
        print(f"{key:14s} network {network / n:.4f}  network+copy {mixed / n:.4f}  ({n} positions)")


def datastore(data: Path, cache: Path) -> None:
    """Follower counts of every n-gram (n <= 8) in the target's answers; at each benchmark position the
    most frequent follower g of the longest suffix found. Gate: use g when the match is >= n0 tokens,
    g's share of the followers >= s0 and the draft's top probability < c0."""
    table: list[dict] = [{} for _ in range(MAX_NGRAM + 1)]
    answers = [s.ids[s.n_prompt:].tolist() for s in data_samples(data)]
    for seq in answers:
        for i in range(1, len(seq)):
            for n in range(1, min(MAX_NGRAM, i) + 1):
                table[n].setdefault(tuple(seq[i - n:i]), collections.Counter())[seq[i]] += 1
    rows = benchmark_positions(cache)
    base = total = 0
    found = []    # (n, follower share, draft top probability, g right, draft right)
    for r, (_, mixed) in zip(rows, draft_logits(load_draft(SHIPPED), rows)):
        top, choice = torch.softmax(mixed, -1).max(-1)
        for t, right_token in enumerate(r["target"].tolist()):
            context = r["ids"][:r["n"] + t]
            draft_right = int(choice[t]) == right_token
            base += draft_right
            total += 1
            for n in range(min(MAX_NGRAM, len(context)), 0, -1):
                counts = table[n].get(tuple(context[-n:]))
                if counts:
                    g, c = counts.most_common(1)[0]
                    found.append((n, c / sum(counts.values()), float(top[t]), g == right_token, draft_right))
                    break
    oracle = (base + sum(g and not d for *_, g, d in found)) / total
    best = (base / total, "never")
    for n0 in range(1, MAX_NGRAM + 1):
        for s0 in (0.0, 0.5, 0.7, 0.9):
            for c0 in (1.01, 0.8, 0.6, 0.4, 0.3):
                gain = sum(int(g) - int(d) for n, s, c, g, d in found if n >= n0 and s >= s0 and c < c0)
                if (base + gain) / total > best[0]:
                    best = ((base + gain) / total, f"n>={n0}, share>={s0}, draft top<{c0}")
    print(f"store: {len(answers)} answers, {sum(map(len, answers))} tokens; benchmark positions {total}, "
          f"a suffix found at {len(found)}")
    print(f"draft+copy {base / total:.4f}; oracle (g or draft right) {oracle:.4f}; best gate {best[0]:.4f} ({best[1]})")


def heldout_curve(run: Path) -> list[dict]:
    """The held-out evaluations (step, minutes, agree) a distill run logged in its checkpoint."""
    ckpt = run / "ckpt.pt"
    if not ckpt.exists():
        raise FileNotFoundError(f"{ckpt} missing: {run} is not a `python -m ssd_trt.distill --out` directory")
    history = torch.load(ckpt, weights_only=False)["history"]
    return [h["eval"] for h in history if "eval" in h]


def curves(runs: list[Path], png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for run in runs:
        evals = heldout_curve(run)
        layers = DraftConfig.from_hf(json.loads((run / "best" / "config.json").read_text())).num_hidden_layers
        label = f"{run.name} ({layers} layers)"
        by_step.plot([e["step"] for e in evals], [e["agree"] for e in evals], marker=".", label=label)
        by_time.plot([e["minutes"] for e in evals], [e["agree"] for e in evals], marker=".", label=label)
        last = evals[-1]
        print(f"{label}: held-out agreement {last['agree']:.4f} at step {last['step']} "
              f"({last['minutes']:.1f} min), best {max(e['agree'] for e in evals):.4f}")
    by_step.set_xlabel("training step (batch 16)")
    by_time.set_xlabel("training minutes on this CPU (2 threads)")
    by_step.set_ylabel("held-out greedy agreement (network alone)")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    print(f"wrote {png}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("data")
    d.add_argument("--out", type=Path, required=True)
    d.add_argument("--prompts", type=int, default=1024)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--openers", choices=("training", "instruct"), default="training")
    f = sub.add_parser("finetune")
    f.add_argument("--data", type=Path, required=True)
    f.add_argument("--loss", choices=("soft", "hard", "sharp", "copy"), required=True)
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--steps", type=int, default=200)
    f.add_argument("--lr", type=float, default=3e-4)
    f.add_argument("--layers", type=int, default=None, help="deepen the shipped draft to this many layers first")
    e = sub.add_parser("evaluate")
    e.add_argument("--draft", type=Path, default=SHIPPED)
    e.add_argument("--on-data", type=Path, default=None, help="a pilot data set instead of the benchmark prompts")
    s = sub.add_parser("datastore")
    s.add_argument("--data", type=Path, required=True)
    c = sub.add_parser("curves")
    c.add_argument("runs", type=Path, nargs="+", help="`python -m ssd_trt.distill --out` directories")
    c.add_argument("--png", type=Path, required=True)
    for p in (e, s):
        p.add_argument("--cache", type=Path, default=ROOT / "runs" / "pilots" / "benchmark_positions.pt")
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    if a.command == "data":
        pilot_data(a.out, a.prompts, a.seed, a.openers)
    elif a.command == "finetune":
        finetune(a.data, a.loss, a.out, a.steps, a.lr, a.layers)
    elif a.command == "curves":
        curves(a.runs, a.png)
    elif a.command == "evaluate":
        evaluate(a.draft, a.cache, a.on_data)
    else:
        datastore(a.data, a.cache)


if __name__ == "__main__":
    main()
