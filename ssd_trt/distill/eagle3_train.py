"""Training an EAGLE-3 draft with training-time test (Li et al. 2025, arXiv 2503.01840, Section 3.2).

At decode time the draft's first token of a chain reads the target's features, but every later one reads
the draft's own output of the step before. Trained on target features only, the draft never sees its own
features and its second and third guesses degrade; training-time test unrolls the chain in training.

Layout: a batch of sequences t_0..t_{T-1} with target features f_0..f_{T-1}. The draft's row b is the
token at position p = b + 1 (features lag tokens by one: there is nothing before t_0).

* step 0: row b is token t_p carrying fc(f_{p-1}); it attends to step-0 rows <= b (a causal prefill).
* step s >= 1: row b is the same token t_p, now carrying the draft's own output of step s-1 at row b-1,
  i.e. it is the s-th token of a chain that starts after the target-featured prefix j = p - s. It
  attends to step-0 rows <= b - s (the prefix, their target-featured keys/values) and, for r = 1..s, to
  step-r row b - s + r (its own chain: the keys/values the earlier unrolled steps computed there).

Every step predicts the target's distribution of t_{p+1} (the tokens along the chain are the real ones;
only the carried features are the draft's). This is exactly what a draft sees decoding s tokens after a
verified prefix with the ``ssd::tree_attention`` cache (``tests/test_eagle3_train.py`` checks each row
of each step against that sequential run). Attention over the concatenated keys of all steps is a plain
SDPA with an explicit boolean mask (:func:`ttt_mask`); the loss is KL(target top-k || draft) on the draft
vocabulary, step s weighted ``step_decay ** s``.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ssd_trt.models.decoder import Decoder, rotary_tables
from ssd_trt.models.eagle3 import Eagle3Config, Eagle3Draft

from .eagle3_data import FeatureSample, draft_vocabulary
from .loop import Evaluation, StepResult, run_training
from .train import batch_indices, kd_loss


@dataclass
class Eagle3TrainConfig:
    steps: int = 1200
    batch: int = 8
    max_len: int = 384
    lr: float = 1e-3
    min_lr_frac: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.01
    clip: float = 1.0
    seed: int = 0
    ckpt_every: int = 100
    eval_samples: int = 64
    ttt_steps: int = 3
    step_decay: float = 0.8       # EAGLE-3's weighting of later unrolled steps
    prompt_weight: float = 0.5    # prompt positions count half (as the independent draft's loss)
    bf16: bool = True

    def __post_init__(self) -> None:
        if self.ttt_steps < 1 or self.steps < 1 or self.batch < 1:
            raise ValueError("ttt_steps, steps and batch must be >= 1")


# ---- the model ---------------------------------------------------------------------------------------------------

def init_draft(target: Decoder, draft_target_ids: torch.Tensor, feature_layers: tuple[int, int, int],
               seed: int = 0, num_layers: int = 1) -> Eagle3Draft:
    """An EAGLE-3 draft of ``num_layers`` layers at the target's width and heads. The embedding is the target's
    (frozen: the runtime shares it); the head starts from the target's output rows of the draft vocabulary and
    the final norm from the target's, so step 0 starts as "the target's head on a random layer's output"."""
    layer = dataclasses.replace(target.config, num_layers=num_layers, tie_word_embeddings=False,
                                head_vocab_size=None)
    torch.manual_seed(seed)
    model = Eagle3Draft(Eagle3Config(layer=layer, draft_vocab_size=len(draft_target_ids),
                                     feature_layers=feature_layers))
    d2t, _ = draft_vocabulary(draft_target_ids, layer.vocab_size)
    head = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target.embed_tokens.weight)
        model.d2t.copy_(d2t)
        model.lm_head.weight.copy_(head[model.draft_token_ids])
        model.norm.weight.copy_(target.norm.weight)
    model.embed_tokens.weight.requires_grad_(False)
    return model


def deepen(model: Eagle3Draft, num_layers: int, seed: int = 0) -> Eagle3Draft:
    """``model`` with extra decoder layers appended up to ``num_layers``, computing exactly what ``model``
    computes: each new layer's two output projections (o_proj, down_proj) start at zero, so it adds nothing
    to the residual stream until training moves them (the other weights start random, as in ``init_draft``,
    and receive gradients as soon as those projections are non-zero). A larger draft grown from a trained
    one starts at its agreement instead of from scratch."""
    have = model.config.layer.num_layers
    if num_layers < have:
        raise ValueError(f"cannot deepen a {have}-layer draft to {num_layers} layers")
    config = dataclasses.replace(model.config, layer=dataclasses.replace(model.config.layer, num_layers=num_layers))
    torch.manual_seed(seed)
    grown = Eagle3Draft(config)
    with torch.no_grad():
        missing, unexpected = grown.load_state_dict(model.state_dict(), strict=False)
        if unexpected or any(not name.startswith("extra_layers.") for name in missing):
            raise RuntimeError(f"deepen: the grown draft's tensors do not extend the old ones ({missing}, {unexpected})")
        for layer in list(grown.extra_layers)[have - 1:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    grown.embed_tokens.weight.requires_grad_(False)
    return grown


# ---- the unrolled forward -----------------------------------------------------------------------------------------

def ttt_mask(rows: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """bool [rows, (step + 1) * rows]: which keys (step 0's rows, then step 1's, ...) row b of ``step`` reads.

    Block 0: rows <= b - step (the target-featured prefix); block r >= 1: row b - step + r only (the chain).
    Block ``step`` always holds row b itself, so no row is empty (rows b < step have no valid chain and
    are left out of the loss)."""
    b = torch.arange(rows, device=device)[:, None]
    a = torch.arange(rows, device=device)[None, :]
    blocks = [a <= b - step] + [a == b - step + r for r in range(1, step + 1)]
    return torch.cat(blocks, dim=1)


MaskFn = Callable[[int, int, torch.device], torch.Tensor]


def masked_sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                scale: float) -> torch.Tensor:
    """softmax(scale q.k) v over the keys ``mask`` [T, S] allows, grouped-query heads as the tree op does
    (query head h reads kv head h // (Hq // Hkv))."""
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(query, keys.to(query.dtype), values.to(query.dtype),
                                                            attn_mask=mask, scale=scale)


class UnrolledAttention:
    """The ``attention`` callable of one draft layer for one unrolled forward: it keeps every step's keys
    and values and lets step s read them through ``mask_fn(rows, s)`` (:func:`ttt_mask`). The cache arguments
    of the tree-attention signature are passed through untouched (training has no cache)."""

    def __init__(self, mask_fn: MaskFn = ttt_mask) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.mask_fn = mask_fn

    def __call__(self, query, key_new, value_new, key_cache, value_cache, cache_lengths, tree_mask, scale):
        self.keys.append(key_new)
        self.values.append(value_new)
        step, rows = len(self.keys) - 1, query.shape[2]
        mask = self.mask_fn(rows, step, query.device)
        out = masked_sdpa(query, torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2), mask, scale)
        return out, key_cache, value_cache


def draft_step(model: Eagle3Draft, ids: torch.Tensor, positions: torch.Tensor, carried: torch.Tensor,
               attentions: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits over the draft vocabulary [B, T, D], output hidden [B, T, H]) of the draft's layers for tokens
    that already carry their features: ``Eagle3Draft.forward`` without the cache and without scattering the
    logits into the full vocabulary (a [B, T, V] tensor per step would dominate training memory)."""
    embeds = model.embed_tokens(ids)
    cos, sin = rotary_tables(positions, model.inv_freq, embeds.dtype)
    empty = [embeds.new_zeros(0)] * (2 * model.config.layer.num_layers)
    out, _ = model.layers_forward(embeds, carried, cos, sin, None, None, empty, attentions)
    return model.lm_head(model.norm(out)), out


def unrolled_forward(model: Eagle3Draft, ids: torch.Tensor, features: torch.Tensor, steps: int,
                     mask_fn: MaskFn = ttt_mask) -> list[torch.Tensor]:
    """Draft-vocabulary logits [B, T-1, D] of each of ``steps`` unrolled steps over ``ids`` [B, T] with
    target ``features`` [B, T, 3H]; row b of every step predicts token b + 2 (see the module docstring)."""
    attentions = [UnrolledAttention(mask_fn) for _ in range(model.config.layer.num_layers)]
    tokens = ids[:, 1:]
    positions = torch.arange(1, ids.shape[1], device=ids.device)[None].expand_as(tokens)
    carried = model.fc(features[:, :-1].to(model.fc.weight.dtype))
    logits = []
    for _ in range(steps):
        step_logits, out = draft_step(model, tokens, positions, carried, attentions)
        logits.append(step_logits)
        # the next step's row b carries this step's output at row b - 1 (row 0 has none: it is masked out)
        carried = torch.cat((torch.zeros_like(out[:, :1]), out[:, :-1]), dim=1)
    return logits


def teacher_forced_logits(model: Eagle3Draft, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [T, V] of one sequence, row t the draft's distribution of token t + 1 with the
    target's features up to t (step 0 of :func:`unrolled_forward`); tokens off the draft vocabulary get -inf,
    row 0 (nothing before t_0 to carry features) is uniform over the draft vocabulary."""
    draft_logits = unrolled_forward(model, ids.long()[None], features.float()[None], 1)[0][0].float()
    rows = torch.cat((torch.zeros_like(draft_logits[:1]), draft_logits))
    out = torch.full((rows.shape[0], model.config.layer.vocab_size), float("-inf"))
    out[:, model.draft_token_ids] = rows
    return out


# ---- batches and loss ---------------------------------------------------------------------------------------------

@dataclass
class Batch:
    ids: torch.Tensor        # [B, T] int64
    features: torch.Tensor   # [B, T, 3H] float32
    label_ids: torch.Tensor  # [B, T, k] draft-vocabulary ids of the target's top-k for token t+1 (-1: not in it)
    label_logits: torch.Tensor  # [B, T, k]
    loss_mask: torch.Tensor  # [B, T] bool: positions with a loss
    continuation: torch.Tensor  # [B, T] bool: positions whose next token the target wrote itself


def make_batch(samples: list[FeatureSample], target_to_draft: torch.Tensor, max_len: int) -> Batch:
    """Right-padded batch (padding is never attended to by a real row: every mask is causal)."""
    T = min(max_len, max(len(s.ids) for s in samples))
    B, k, width = len(samples), samples[0].topk_ids.shape[1], samples[0].features.shape[1]
    batch = Batch(torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, width),
                  torch.full((B, T, k), -1, dtype=torch.long), torch.zeros(B, T, k),
                  torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.bool))
    for i, s in enumerate(samples):
        n = min(T, len(s.ids))
        batch.ids[i, :n] = s.ids[:n].long()
        batch.features[i, :n] = s.features[:n].float()
        batch.label_ids[i, :n] = target_to_draft[s.topk_ids[:n].long()]
        batch.label_logits[i, :n] = s.topk_logits[:n].float()
        batch.loss_mask[i, s.start:n] = True
        batch.continuation[i, max(s.n_prompt - 1, 0):n] = True
    return batch


def target_to_draft_index(model: Eagle3Draft) -> torch.Tensor:
    """Target token id -> draft id (-1 off the draft vocabulary)."""
    index = torch.full((model.config.layer.vocab_size,), -1, dtype=torch.long)
    index[model.draft_token_ids] = torch.arange(model.config.draft_vocab_size)
    return index


def ttt_loss(model: Eagle3Draft, batch: Batch, c: Eagle3TrainConfig) -> tuple[torch.Tensor, list[float]]:
    """sum_s step_decay^s KL(target || draft at step s) (each step's KL a weighted mean over its rows)."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=c.bf16):
        logits = unrolled_forward(model, batch.ids, batch.features, c.ttt_steps)
    # row b predicts the token after position b + 1: its labels are the target's at b + 1
    label_ids, label_logits = batch.label_ids[:, 1:], batch.label_logits[:, 1:]
    weight = torch.where(batch.continuation[:, 1:], 1.0, c.prompt_weight)
    rows = torch.arange(label_ids.shape[1])[None]
    total, per_step = torch.zeros(()), []
    for s, step_logits in enumerate(logits):
        mask = batch.loss_mask[:, 1:] & (rows >= s)     # rows < s have no target-featured prefix
        loss = kd_loss(step_logits, label_ids, label_logits, mask, weight)
        per_step.append(loss.item())
        total = total + c.step_decay ** s * loss
    return total, per_step


@torch.no_grad()
def heldout_agreement(model: Eagle3Draft, held: list[FeatureSample], c: Eagle3TrainConfig) -> dict:
    """Per unrolled step, how often the draft's argmax is the target's top-1 on held-out continuation
    positions (stored labels): the training loop's cheap progress measure."""
    model.eval()
    index = target_to_draft_index(model)
    hits, total = [0] * c.ttt_steps, [0] * c.ttt_steps
    for b0 in range(0, min(len(held), c.eval_samples), c.batch):
        batch = make_batch(held[b0:b0 + c.batch], index, c.max_len)
        logits = unrolled_forward(model, batch.ids, batch.features, c.ttt_steps)
        top1 = batch.label_ids[:, 1:, 0]
        rows = torch.arange(top1.shape[1])[None]
        for s, step_logits in enumerate(logits):
            m = batch.loss_mask[:, 1:] & batch.continuation[:, 1:] & (rows >= s)
            hits[s] += int(((step_logits.argmax(-1) == top1) & m).sum())
            total[s] += int(m.sum())
    model.train()
    return {"agree_by_step": [h / max(t, 1) for h, t in zip(hits, total)], "positions": total[0]}


# ---- the loop -----------------------------------------------------------------------------------------------------

def train_eagle3(model: Eagle3Draft, train_s: list[FeatureSample], held: list[FeatureSample],
                 c: Eagle3TrainConfig, out: Path, resume: bool = False, stop_after: int | None = None,
                 log=print) -> dict:
    """Run (or resume from ``out/ckpt.pt``) training (``loop.run_training``); the best state by held-out
    step-0 agreement goes to ``out/best.pt``."""
    if len(train_s) < c.batch:
        raise ValueError(f"need at least batch={c.batch} training sequences, got {len(train_s)}")
    index = target_to_draft_index(model)

    def step_loss(step: int) -> StepResult:
        batch = make_batch([train_s[i] for i in batch_indices(step, len(train_s), c)], index, c.max_len)
        loss, per_step = ttt_loss(model, batch, c)
        return StepResult(loss, {"loss_by_step": per_step}, {"steps": "/".join(f"{x:.2f}" for x in per_step)})

    def evaluate() -> Evaluation:
        ev = heldout_agreement(model, held, c) if held else {"agree_by_step": [0.0]}
        return Evaluation(ev["agree_by_step"][0], ev,
                          f"held-out agreement by step {[round(x, 4) for x in ev['agree_by_step']]}")

    summary = run_training(model, c, out, step_loss=step_loss, evaluate=evaluate,
                           save_best=lambda: torch.save(model.state_dict(), out / "best.pt"),
                           held_out_size=len(held), resume=resume, stop_after=stop_after, desc="eagle3 ttt",
                           log=log)
    return {"step": summary["step"], "best_heldout_step0_agreement": summary["best"],
            "minutes": summary["minutes"], "history": summary["history"]}


# ---- the released layout ------------------------------------------------------------------------------------------

def released_config(model: Eagle3Draft, target_name: str = "") -> dict:
    """config.json of a released EAGLE-3 head (``LlamaForCausalLMEagle3``) for ``model``."""
    c = model.config.layer
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
            "num_hidden_layers": c.num_layers, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
            "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
            "draft_vocab_size": model.config.draft_vocab_size, "bos_token_id": c.bos_token_id,
            "eos_token_id": c.eos_token_id, "tie_word_embeddings": False, "attention_bias": c.attention_bias,
            "torch_dtype": "bfloat16", "target_model": target_name,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(model.config.feature_layers),
                             "use_aux_hidden_state": True}}


def export_released(model: Eagle3Draft, directory: Path, target_name: str = "") -> None:
    """``config.json`` + ``model.safetensors`` (bf16 weights, int64 ``d2t``, bool ``t2d``; no embedding: the
    target's is used), loadable with ``load_eagle3_checkpoint(directory, target_layers, target_embedding)``."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    _, t2d = draft_vocabulary(model.draft_token_ids, model.config.layer.vocab_size)
    state = {name: tensor.detach().to(torch.bfloat16).contiguous() for name, tensor in model.state_dict().items()
             if name not in ("embed_tokens.weight", "d2t")}
    state.update(d2t=model.d2t.clone(), t2d=t2d)
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(released_config(model, target_name), indent=2) + "\n")


def macs_per_token(model: Eagle3Draft) -> int:
    """Multiply-accumulates of one draft token (fc, the layers' linears, the reduced head)."""
    return sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2 and n != "embed_tokens.weight")

