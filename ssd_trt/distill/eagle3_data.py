"""Training data of an EAGLE-3 draft: the target's own text, its features and its soft labels.

The independent draft's teacher stage (``teacher.label_prompts``) already makes the text: the target
continues each training prompt (bf16, greedy or sampled) and the shards under ``OUT/teacher`` hold the
token ids. An EAGLE-3 draft also needs what the target computed *for* each token: the residual stream
entering layers (2, L/2, L-3). Those come from one more forward of our own :class:`Decoder` (fp32, the
precision of the engines that will feed the draft at run time) over each whole sequence, with
``with_target_features``; the same forward gives the teacher logits, so features and labels are of one
computation. Per sequence we keep bf16 features [T, 3H], the top-k logits and the ids, in shards under
``OUT/eagle3_features`` that a restarted run skips.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from ssd_trt_plugins.tree_attention.masks import causal_tree_mask
from ssd_trt.models.decoder import Decoder, with_target_features
from ssd_trt.models.eagle3 import default_feature_layers
from ssd_trt.models.loading import decoder_from_checkpoint

from .teacher import Sample, load_samples, load_target


@dataclass
class FeatureSample:
    """One sequence with the target's view of it. Row t of ``features``/``topk_*`` is for token t:
    features the target computed for it, and its logits for token t + 1."""

    ids: torch.Tensor          # int32 [T]
    start: int                 # first position with a loss (after the fixed system prompt)
    n_prompt: int              # positions >= n_prompt are the target's own continuation
    features: torch.Tensor     # bfloat16 [T, 3H]
    topk_ids: torch.Tensor     # int32 [T, k]
    topk_logits: torch.Tensor  # float16 [T, k]
    kind: str


def featured_target(hf_model) -> Decoder:
    """Our fp32 :class:`Decoder` with the weights of a transformers model, returning EAGLE-3's features.

    Built from the already-loaded HF model so the GGUF is dequantised once for both the teacher and this."""
    state = {name: tensor.float() for name, tensor in hf_model.state_dict().items()}
    decoder = decoder_from_checkpoint(hf_model.config.to_dict(), state)
    return with_target_features(decoder, default_feature_layers(decoder.config.num_layers)).float().eval()


def load_featured_target(source: str) -> tuple[Decoder, object, object]:
    """(featured fp32 Decoder, fp32 transformers model, tokenizer) for a ``--target`` source."""
    hf_model, tok = load_target(source, torch.float32)
    return featured_target(hf_model), hf_model, tok


@torch.inference_mode()
def target_pass(target: Decoder, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [T, 3H], logits [T, V]) of the whole sequence ``ids`` [T] in one causal forward."""
    n = len(ids)
    out = target(ids.long()[None], torch.arange(n)[None], torch.from_numpy(causal_tree_mask(1, n)),
                 torch.zeros(1, dtype=torch.int32), *target.empty_caches(1, n))
    return out[-1][0], out[0][0]


def featurize_shards(target: Decoder, teacher_shards: list[Path], out_dir: Path, k: int = 32) -> list[Path]:
    """For each teacher shard ``<dir>/<name>``, ``out_dir/<dir>_<name>`` with every sequence's features and
    fp32 top-k logits.

    Resumable: a shard already written is kept (written to .tmp then renamed, so never half-written) when
    it holds the teacher shard's sequences; one made from an older version of the teacher shard is redone."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    for teacher_shard in teacher_shards:
        path = out_dir / f"{teacher_shard.parent.name}_{teacher_shard.name}"
        shards.append(path)
        samples = load_samples([teacher_shard])
        if path.exists():
            if same_sequences(path, samples):
                continue
            tqdm.write(f"{path}: made from another version of {teacher_shard}; featurizing it again")
        rows = []
        for s in tqdm(samples, desc=f"features {path.name}", leave=False):
            features, logits = target_pass(target, s.ids)
            values, indices = logits.float().topk(k, dim=-1)
            rows.append(FeatureSample(s.ids, s.start, s.n_prompt, features.to(torch.bfloat16),
                                      indices.to(torch.int32), values.half(), s.kind).__dict__)
        tmp = path.with_suffix(".tmp")
        torch.save(rows, tmp)
        tmp.rename(path)
    return shards


def same_sequences(feature_shard: Path, samples: list[Sample]) -> bool:
    """Whether a feature shard was made from these teacher samples (same token ids, same order).
    Memory-mapped: only the id tensors are read, not the features."""
    rows = torch.load(feature_shard, weights_only=True, mmap=True)
    return len(rows) == len(samples) and all(torch.equal(row["ids"], s.ids) for row, s in zip(rows, samples))


def load_feature_samples(paths: list[Path]) -> list[FeatureSample]:
    return [FeatureSample(**row) for path in paths for row in torch.load(path, weights_only=True)]


def as_teacher_samples(samples: list[FeatureSample]) -> list[Sample]:
    """The same sequences as ``teacher.Sample`` (what ``train.select_head_ids`` ranks)."""
    return [Sample(s.ids, s.start, s.n_prompt, s.topk_ids, s.topk_logits, s.kind) for s in samples]


def draft_vocabulary(target_ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The released heads' encoding of a draft vocabulary (sorted target ids): ``d2t`` [D] int64 with
    draft id d -> target id d + d2t[d], and ``t2d`` [V] bool marking the target ids it holds."""
    target_ids = torch.sort(target_ids.long()).values
    if len(set(target_ids.tolist())) != len(target_ids) or target_ids.min() < 0 or target_ids.max() >= vocab_size:
        raise ValueError("the draft vocabulary must be distinct target token ids")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return target_ids - torch.arange(len(target_ids)), t2d
