"""Draft-vs-target metrics on a prompt set, measured against the real target.

* greedy agreement: the target greedily continues each prompt; then, teacher-forced on that
  text, the fraction of continuation positions where argmax q (draft) == argmax p (target).
  This is the per-token acceptance rate of greedy speculative decoding.
* expected acceptance at temperature 1: mean over the same positions of sum_v min(p_v, q_v),
  the probability that standard speculative sampling accepts a draft token.
* head coverage: fraction of positions whose target argmax is inside the draft's head (an upper
  bound on agreement for a reduced head).
* top-F recall: fraction of positions whose target argmax is among the draft's F most likely
  tokens. This is what an SSD cache hit needs at temperature 0 (the bonus token t* at the first
  rejected position must be one of the forked guesses), so it bounds the draft's share of the hit
  rate for fan-out F-1 (prompt-lookup guesses come on top).
* with a copy component (``copy_mixture`` in the draft's config.json, engines/copy_mixture.py) every
  metric is of q', the distribution the engine actually drafts from; ``metrics_neural_only`` reports the
  neural draft alone.
* cost: per-token multiply-accumulates of draft vs target, and batch-1 KV-cache decode time.
"""
from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import torch

from ssd_trt.engines.copy_mixture import CopyMixture

from .model import DraftModel
from .prompts import Prompt
from .teacher import cached_forward, encode_prompt, generate_batch


def load_prompt_file(path: Path) -> list[tuple[str, Prompt]]:
    """(category, Prompt) from a JSONL file with "category" and "prompt"; the chat template is
    applied to every category except ``prose``, which is plain continuation."""
    if not Path(path).exists():
        raise ValueError(f"prompt file {path} not found")
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            if "prompt" not in d:
                raise ValueError(f"{path}: every line needs a 'prompt' field")
            cat = d.get("category", "all")
            out.append((cat, Prompt(cat, d["prompt"], cat != "prose")))
    return out


@torch.inference_mode()
def target_continuations(target, tok, prompts: list[Prompt], max_new: int, batch: int = 16) -> list[tuple[list[int], int]]:
    """(ids of prompt + greedy continuation, prompt length) for each prompt."""
    eos = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")) if isinstance(i, int) and i >= 0}
    enc = [encode_prompt(tok, p)[0] for p in prompts]
    out: list[tuple[list[int], int] | None] = [None] * len(enc)
    order = sorted(range(len(enc)), key=lambda i: len(enc[i]))
    g = torch.Generator().manual_seed(0)
    for b0 in range(0, len(order), batch):
        idx = order[b0:b0 + batch]
        res = generate_batch(target, [enc[i] for i in idx], max_new, eos, False, 1.0, 1, g)
        for i, (ids, _, _) in zip(idx, res):
            out[i] = (ids, len(enc[i]))
    return out  # type: ignore[return-value]


RECALL_AT = (1, 2, 4, 8, 16)


@torch.inference_mode()
def agreement(target, draft: DraftModel, seqs: list[tuple[list[int], int]], cats: list[str],
              variants: dict[str, CopyMixture | None]) -> dict[str, dict]:
    """Teacher-forced greedy agreement, sum(min(p, q)) at T=1 and head coverage, overall and per category,
    for each named variant of the draft (its network with the given copy component, or alone: None).
    The target and the network run once per sequence, whatever the number of variants."""
    stats = {name: defaultdict(lambda: [0.0] * (4 + len(RECALL_AT))) for name in variants}
    head = draft.lm_head_token_ids
    for (ids, n_prompt), cat in zip(seqs, cats):
        if len(ids) <= n_prompt:
            continue
        x = torch.tensor(ids)[None]
        sl = slice(n_prompt - 1, len(ids) - 1)  # position t predicts token t+1
        p = torch.softmax(target(input_ids=x).logits[0, sl].float(), -1)
        tp = p.argmax(-1)
        cover = torch.isin(tp, head).float() if head is not None else torch.ones(len(tp))
        network_logits = draft(x)[0, sl].float()
        for name, mixture in variants.items():
            draft_logits = network_logits if mixture is None else torch.from_numpy(
                mixture.apply_teacher_forced(network_logits.numpy().copy(), ids, n_prompt - 1))
            q = torch.softmax(draft_logits, -1)
            agree = (q.argmax(-1) == tp).float()
            accept = torch.minimum(p, q).sum(-1)
            rank = (q > q.gather(-1, tp[:, None])).sum(-1)  # 0 = the draft's argmax is the target's
            for key in (cat, "all"):
                s = stats[name][key]
                s[0] += float(agree.sum()); s[1] += float(accept.sum()); s[2] += float(cover.sum()); s[3] += len(agree)
                for i, f in enumerate(RECALL_AT):
                    s[4 + i] += float((rank < f).sum())
    return {name: {k: {"greedy_agreement": v[0] / v[3], "expected_acceptance_T1": v[1] / v[3],
                       "head_coverage": v[2] / v[3], "positions": int(v[3]),
                       "top_f_recall": {str(f): v[4 + i] / v[3] for i, f in enumerate(RECALL_AT)}}
                   for k, v in by_category.items()}
            for name, by_category in stats.items()}


@torch.inference_mode()
def decode_ms_per_token(step_fn, n_prompt: int = 32, n_new: int = 64, repeats: int = 3) -> float:
    """Best-of-``repeats`` batch-1 decode time per token (ms) of ``step_fn(ids, cache) -> cache``."""
    best = float("inf")
    for _ in range(repeats):
        cache = step_fn(torch.randint(3, 1000, (1, n_prompt)), None)
        t = time.perf_counter()
        for _ in range(n_new):
            cache = step_fn(torch.randint(3, 1000, (1, 1)), cache)
        best = min(best, (time.perf_counter() - t) / n_new * 1e3)
    return best


def cost_report(target, draft: DraftModel) -> dict:
    """Per-token MACs (linear layers + head; the embedding lookup is free) and measured decode times."""
    tc = target.config
    t_layer = (tc.hidden_size * tc.num_attention_heads * (tc.hidden_size // tc.num_attention_heads) * 2
               + tc.hidden_size * tc.num_key_value_heads * (tc.hidden_size // tc.num_attention_heads) * 2
               + 3 * tc.hidden_size * tc.intermediate_size)
    t_macs = tc.num_hidden_layers * t_layer + tc.vocab_size * tc.hidden_size
    d_macs = draft.macs_per_token()

    def tstep(ids, cache):
        return cached_forward(target, input_ids=ids, cache=cache)[1]

    def dstep(ids, cache):
        cache = cache if cache is not None else [[] for _ in draft.model.layers]
        draft.full_logits(draft.hidden(ids, cache=cache)[:, -1:])
        return cache

    t_ms, d_ms = decode_ms_per_token(tstep), decode_ms_per_token(dstep)
    return {"target_macs_per_token": t_macs, "draft_macs_per_token": d_macs, "mac_ratio": d_macs / t_macs,
            "target_ms_per_token_torch": t_ms, "draft_ms_per_token_torch": d_ms, "time_ratio_torch": d_ms / t_ms,
            "threads": torch.get_num_threads()}


def evaluate(target, tok, draft: DraftModel, prompt_file: Path, max_new: int = 64, with_cost: bool = True,
             mixture: CopyMixture | None = None) -> dict:
    items = load_prompt_file(prompt_file)
    t = time.time()
    seqs = target_continuations(target, tok, [p for _, p in items], max_new)
    cats = [c for c, _ in items]
    variants: dict[str, CopyMixture | None] = {"metrics": mixture}
    if mixture is not None:
        variants["metrics_neural_only"] = None
    res = {"prompt_file": str(prompt_file), "n_prompts": len(items), "max_new_tokens": max_new,
           **agreement(target, draft.eval(), seqs, cats, variants)}
    if mixture is not None:
        res["copy_mixture"] = mixture.as_config()
    if with_cost:
        res["cost"] = cost_report(target, draft)
    res["eval_seconds"] = time.time() - t
    return res
