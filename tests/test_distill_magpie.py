"""Self-synthesised prompts (magpie.py), resumable teacher/feature shards, and warm-starting a draft
(copy_draft_weights).

The synthesis test drives the real SmolLM2 target (bf16, a few short turns): the property that
matters is that a run interrupted after any batch resumes into exactly the prompts a fresh run
writes, and that only turns the target closed itself are kept.
"""
from __future__ import annotations

import json

import pytest
import torch

from ssd_trt.distill.eagle3_data import FeatureSample, same_sequences
from ssd_trt.distill.magpie import OPENERS, derived_prompts, synthesize_prompts, user_turn_prefix
from ssd_trt.distill.model import DraftConfig, DraftModel, copy_draft_weights
from ssd_trt.distill.prompts import SUMMARY_INSTRUCTIONS, Prompt
from ssd_trt.distill.teacher import Sample, encode_prompt, holds_prompts, label_prompts, load_samples, load_target


@pytest.fixture(scope="module")
def smollm2():
    torch.set_num_threads(1)
    return load_target("smollm2-135m", torch.bfloat16)


def test_user_turn_prefix_is_the_template_up_to_the_message(smollm2):
    _, tok = smollm2
    prefix = user_turn_prefix(tok)
    full = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False)
    assert prefix.endswith("user\n") and full.startswith(prefix + "Hi there")


@pytest.mark.slow
def test_synthesis_is_seeded_and_resumes_exactly(smollm2, tmp_path):
    model, tok = smollm2
    fresh = synthesize_prompts(model, tok, 6, tmp_path / "a.jsonl", seed=3, batch=4, max_new=48)
    # an "interrupted" run: first only 2 prompts, then resumed to 6 on the same cache file
    synthesize_prompts(model, tok, 2, tmp_path / "b.jsonl", seed=3, batch=4, max_new=48)
    resumed = synthesize_prompts(model, tok, 6, tmp_path / "b.jsonl", seed=3, batch=4, max_new=48)
    assert resumed == fresh and len(fresh) == 6
    kinds = {k for k, _, _ in OPENERS}
    for p in fresh:
        assert p.chat and p.kind in kinds and 4 <= len(p.text.split()) <= 150
        assert "<|im_end|>" not in p.text and "<|im_start|>" not in p.text
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [r["batch"] for r in rows] == sorted(r["batch"] for r in rows)
    other = synthesize_prompts(model, tok, 6, tmp_path / "c.jsonl", seed=4, batch=4, max_new=48)
    assert other != fresh
    steered = synthesize_prompts(model, tok, 4, tmp_path / "d.jsonl", seed=3, batch=4, max_new=48,
                                 openers=[("chat", "Explain", 1.0)])
    assert all(p.text.startswith("Explain") and p.kind == "chat" for p in steered)


def test_derived_prompts_reuse_answers(smollm2):
    _, tok = smollm2
    answer = " ".join(f"Sentence number {i} explains one more detail about the garden." for i in range(12))
    short = "Too short to summarise."
    samples = []
    for text in [answer] * 9 + [short] * 3:
        prompt = tok("Tell me about gardens.", add_special_tokens=False)["input_ids"]
        ids = prompt + tok(text, add_special_tokens=False)["input_ids"]
        samples.append(Sample(torch.tensor(ids, dtype=torch.int32), 0, len(prompt),
                              torch.zeros(len(ids), 1, dtype=torch.int32), torch.zeros(len(ids), 1), "chat"))
    out = derived_prompts(tok, samples, 100, seed=0)
    assert len(out) == 9  # the three short answers are skipped
    summaries = [p for p in out if p.kind == "summarization"]
    prose = [p for p in out if p.kind == "prose"]
    assert len(summaries) == 6 and len(prose) == 3
    assert all(p.chat and any(p.text.endswith(s) for s in SUMMARY_INSTRUCTIONS) for p in summaries)
    assert all(not p.chat and 25 <= len(p.text.split()) <= 45 and answer.startswith(p.text) for p in prose)
    # prefix-stable: asking for fewer (or adding samples later) keeps the earlier prompts, so the
    # cached teacher shards of a resumed, larger run stay valid
    assert derived_prompts(tok, samples, 4, seed=0) == out[:4]
    assert derived_prompts(tok, samples + samples, 9, seed=0) == out


def test_a_shard_written_for_fewer_prompts_is_relabelled_and_a_matching_one_kept(smollm2, tmp_path):
    """Growing a prompt list (a later stage asking for more self-written prompts) must not keep the old
    partial last shard: it would silently drop the prompts added to its chunk."""
    model, tok = smollm2
    prompts = [Prompt("prose", f"The {word} of the old town was", False)
               for word in ("bridge", "market", "river", "tower", "school")]
    label = lambda n: label_prompts(model, tok, prompts[:n], tmp_path, batch=4, max_new=3, shard_prompts=4)

    def stored(shards):
        return sorted(s.ids[:s.n_prompt].tolist() for s in load_samples(shards))

    expected = lambda n: sorted(encode_prompt(tok, p)[0] for p in prompts[:n])
    assert stored(label(3)) == expected(3)
    first = tmp_path / "shard_0000.pt"
    assert not holds_prompts(first, [encode_prompt(tok, p)[0] for p in prompts[:4]])
    shards = label(5)                                   # shard 0 now has to hold 4 prompts, shard 1 the 5th
    assert len(shards) == 2 and stored(shards) == expected(5) and len(load_samples([first])) == 4
    written = first.stat().st_mtime_ns
    assert stored(label(5)) == expected(5) and first.stat().st_mtime_ns == written   # kept when it matches


def test_a_feature_shard_is_recognised_only_for_the_teacher_sequences_it_was_made_from(tmp_path):
    def sample(ids):
        ids = torch.tensor(ids, dtype=torch.int32)
        return Sample(ids, 0, 1, torch.zeros(len(ids), 2, dtype=torch.int32), torch.zeros(len(ids), 2), "chat")

    teacher = [sample([5, 6, 7]), sample([8, 9])]
    rows = [FeatureSample(s.ids, 0, 1, torch.zeros(len(s.ids), 6, dtype=torch.bfloat16), s.topk_ids,
                          s.topk_logits.half(), s.kind).__dict__ for s in teacher]
    torch.save(rows, tmp_path / "features.pt")
    assert same_sequences(tmp_path / "features.pt", teacher)
    assert not same_sequences(tmp_path / "features.pt", teacher[:1])                    # fewer sequences
    assert not same_sequences(tmp_path / "features.pt", [teacher[0], sample([8, 10])])   # other tokens
    assert not same_sequences(tmp_path / "features.pt", teacher[::-1])                  # other order


def test_copy_draft_weights_matches_head_rows_by_token():
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, vocab_size=64)
    torch.manual_seed(0)
    src = DraftModel(cfg, torch.tensor([1, 5, 9, 20]))
    dst = DraftModel(cfg, torch.tensor([5, 7, 20, 30, 40]))
    fresh_row = dst.lm_head.weight[1].clone()
    assert copy_draft_weights(src, dst) == 2
    assert torch.equal(dst.lm_head.weight[0], src.lm_head.weight[1])   # token 5
    assert torch.equal(dst.lm_head.weight[2], src.lm_head.weight[3])   # token 20
    assert torch.equal(dst.lm_head.weight[1], fresh_row)               # token 7: new, keeps its init
    x = torch.randint(0, 64, (1, 6))
    assert torch.equal(dst.hidden(x), src.hidden(x))
    with pytest.raises(ValueError, match="architecture"):
        copy_draft_weights(DraftModel(DraftConfig(**{**cfg.__dict__, "num_hidden_layers": 1})), dst)
