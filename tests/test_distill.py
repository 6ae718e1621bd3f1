"""Fast tests of the distillation pipeline against a tiny random-weight Llama target."""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from ssd_trt.distill.corpora import RList, _RReader
from ssd_trt.distill.model import DraftConfig, DraftModel, init_from_target, load_draft, save_draft
from ssd_trt.distill.prompts import build_prompts
from ssd_trt.distill.teacher import Sample, generate_batch
from ssd_trt.distill.train import TrainConfig, kd_loss, select_head_ids, split_samples, train

V = 512


@pytest.fixture(scope="module")
def target() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, rope_theta=10000.0)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits than the default init, so argmax is well defined
        m.model.embed_tokens.weight.mul_(8)
    return m


@pytest.fixture(scope="module")
def samples(target) -> list[Sample]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, V, (int(n),), generator=g).tolist() for n in torch.randint(4, 12, (48,), generator=g)]
    out = []
    for b0 in range(0, len(prompts), 16):
        batch = prompts[b0:b0 + 16]
        for p, (ids, ti, tv) in zip(batch, generate_batch(target, batch, 12, {2}, b0 == 16, 1.0, 8, g)):
            out.append(Sample(torch.tensor(ids, dtype=torch.int32), 0, len(p), ti, tv, "test"))
    return out


def small_cfg(hidden: int = 32) -> DraftConfig:
    return DraftConfig(hidden_size=hidden, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, vocab_size=V, rope_theta=10000.0)


def test_teacher_labels_match_unpadded_forward(target, samples):
    """Left-padded batched generation must record what a plain forward of each row computes."""
    with torch.no_grad():
        for s in samples[:20]:
            logits = target(input_ids=s.ids[None].long()).logits[0]
            assert len(s.ids) == len(s.topk_ids)
            assert torch.equal(logits.argmax(-1).to(torch.int32), s.topk_ids[:, 0])
            assert torch.allclose(logits.topk(8, -1).values, s.topk_logits.float(), atol=2e-2)
    greedy = samples[0]  # first batch is greedy: each new token is the previous position's top-1
    c = greedy.n_prompt
    assert torch.equal(greedy.ids[c:], greedy.topk_ids[c - 1:-1, 0])


def test_draft_matches_hf_llama_and_saved_format(tmp_path):
    torch.manual_seed(0)
    d = DraftModel(small_cfg()).eval()
    save_draft(d, tmp_path, dtype=torch.float32)
    cfg = json.loads((tmp_path / "config.json").read_text())
    for key in ("architectures", "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                "vocab_size", "tie_word_embeddings", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert key in cfg, key
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["vocab_size"] == V
    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})).eval()
    hf.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    x = torch.randint(0, V, (2, 13))
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, d(x), atol=1e-5)


def test_reduced_head_is_minus_inf_off_subset_and_saved(tmp_path):
    ids = torch.tensor([2, 5, 17, 100, 511])
    d = DraftModel(small_cfg(), ids).eval()
    with torch.no_grad():
        logits = d(torch.randint(0, V, (1, 7)))
    off = torch.ones(V, dtype=torch.bool)
    off[ids] = False
    assert torch.isneginf(logits[..., off]).all()
    assert torch.isfinite(logits[..., ids]).all()
    q = torch.softmax(logits, -1)
    assert torch.allclose(q[..., ids].sum(-1), torch.ones(1, 7))
    save_draft(d, tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    assert t["lm_head.weight"].shape == (5, 32) and t["lm_head.weight"].dtype == torch.bfloat16
    assert t["lm_head_token_ids"].dtype == torch.int64 and torch.equal(t["lm_head_token_ids"], ids)
    assert t["model.embed_tokens.weight"].shape == (V, 32)
    back = load_draft(tmp_path)
    with torch.no_grad():
        x = torch.randint(0, V, (1, 5))
        assert torch.allclose(back(x)[..., ids], d(x)[..., ids], atol=0.1)
    with pytest.raises(ValueError):
        DraftModel(small_cfg(), torch.tensor([5, 2]))


def test_kd_loss_is_minimised_by_the_teacher_distribution():
    tlog = torch.randn(1, 3, 4)
    tid = torch.tensor([[[0, 1, 2, 3]] * 3])
    mask = torch.ones(1, 3, dtype=torch.bool)
    best = kd_loss(tlog.clone(), tid, tlog, mask)  # q == p
    assert float(kd_loss(torch.randn(1, 3, 4), tid, tlog, mask)) > float(best)
    tid_out = tid.clone()
    tid_out[..., 0] = -1  # a teacher token outside the head is ignored, not penalised
    assert torch.isfinite(kd_loss(torch.randn(1, 3, 4), tid_out, tlog, mask))


def _train(samples, out, steps, resume=False, seed=0, init_seed=None):
    torch.manual_seed(seed if init_seed is None else init_seed)
    head = select_head_ids(samples, 256, [2], V)
    d = DraftModel(small_cfg(), head)
    tr, held = split_samples(samples, every=8)
    c = TrainConfig(steps=steps, batch=8, lr=1e-2, warmup=2, ckpt_every=3, eval_samples=8, seed=seed)
    return d, train(d, tr, held, c, out, resume=resume, log=lambda *_: None)


def test_distillation_lowers_loss(samples, target, tmp_path):
    d, summary = _train(samples, tmp_path, 40)
    evals = [h["eval"] for h in summary["history"] if "eval" in h]
    losses = [h["loss"] for h in summary["history"] if "loss" in h]  # training loss every 10 steps
    # a random-weight teacher on random prompts does not generalise to held-out text, but the
    # draft must be able to fit its training set: the training KD loss has to fall clearly
    assert losses[-1] < losses[0] - 1.0, losses
    assert len(evals) >= 2 and all(0.0 <= e["agree"] <= 1.0 for e in evals)
    assert (tmp_path / "best" / "model.safetensors").exists() and (tmp_path / "ckpt.pt").exists()


def test_resume_continues_at_same_step_with_same_rng(samples, tmp_path):
    full, _ = _train(samples, tmp_path / "a", 6)
    _train(samples, tmp_path / "b", 3)
    st = torch.load(tmp_path / "b" / "ckpt.pt", weights_only=False)
    assert st["step"] == 3
    # a different init RNG must not matter: weights, optimizer and RNG state come from the checkpoint
    resumed, summary = _train(samples, tmp_path / "b", 6, resume=True, init_seed=123)
    assert summary["step"] == 6
    for (n, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), n
    assert torch.equal(torch.get_rng_state(), _rng_after(samples, tmp_path / "d"))
    fresh, _ = _train(samples, tmp_path / "c", 6, seed=1)
    assert not torch.equal(fresh.lm_head.weight, full.lm_head.weight)
    with pytest.raises(ValueError, match="seed"):
        _train(samples, tmp_path / "b", 8, resume=True, seed=5)


def _rng_after(samples, out):
    _train(samples, out, 6)
    return torch.get_rng_state()


def test_init_from_target_reproduces_tied_logit_geometry(target):
    d = DraftModel(small_cfg(hidden=48))
    kept = init_from_target(d, target)
    assert 0.5 < kept < 1.0
    E = target.get_input_embeddings().weight
    G, Gd = E @ E.T, d.model.embed_tokens.weight @ d.lm_head.weight.T
    # token-token similarities survive the projection well (rank correlation of rows)
    assert torch.corrcoef(torch.stack([G.flatten(), Gd.flatten()]))[0, 1] > 0.9
    with pytest.raises(ValueError):
        init_from_target(DraftModel(small_cfg(hidden=96)), target)


def test_prompts_are_seeded_prefix_stable_and_not_from_the_bench():
    corpora = {"austen": ["It is a truth universally acknowledged. " * 30] * 5,
               "brown": ["The jury said Friday that the election was fair and the city thanked it. " * 20] * 5,
               "nlp": ["A sentence about films and the print I just viewed in town today. " * 20] * 5,
               "fortunes": ["A fool and his money are soon parted."] * 3}
    a, b = build_prompts(corpora, 60, 3), build_prompts(corpora, 120, 3)
    assert a == b[:60]
    assert a != build_prompts(corpora, 60, 4)
    assert {p.kind for p in b} == {"code", "chat", "math", "prose", "summarization"}
    assert all(not p.chat for p in b if p.kind == "prose")
    bench = Path(__file__).resolve().parents[1] / "ssd_trt" / "bench" / "prompts" / "default.jsonl"
    if bench.exists():
        texts = {json.loads(line)["prompt"] for line in bench.read_text().splitlines() if line.strip()}
        assert not texts & {p.text for p in build_prompts(corpora, 2000, 0)}
    with pytest.raises(ValueError):
        build_prompts(corpora, 0, 0)


def test_r_reader_decodes_named_character_vector():
    def i32(v: int) -> bytes:
        return struct.pack(">i", v)

    def charsxp(s: str) -> bytes:
        return i32(0x00040009) + i32(len(s)) + s.encode()

    names_attr = (i32(0x00000402) + i32(1) + charsxp("names") + i32(16) + i32(1) + charsxp("book") + i32(254))
    body = i32(16 | (1 << 9)) + i32(1) + i32(16) + i32(2) + charsxp("Emma") + charsxp("Woodhouse")
    # outer: named list(book = c("Emma", "Woodhouse")) -> VECSXP with names attribute
    blob = b"X\n" + i32(3) + i32(0x040201) + i32(0x030500) + i32(5) + b"UTF-8" + body + names_attr
    obj = _RReader(blob).read()
    assert isinstance(obj, RList) and obj.attrs["names"] == ["book"] and obj[0] == ["Emma", "Woodhouse"]
    with pytest.raises(ValueError):
        _RReader(zlib.compress(b"junk")).read()



def _pattern_samples(target_is_follower: bool) -> list[Sample]:
    """Sequences repeating a 6-token pattern: from the second repeat on, every position has a
    recurring suffix whose follower is the true next token."""
    out = []
    for i in range(6):
        pattern = torch.randint(3, V, (6,), generator=torch.Generator().manual_seed(i))
        ids = pattern.repeat(5).to(torch.int32)
        nxt = torch.cat([ids[1:], ids[:1]]).long()
        top = nxt if target_is_follower else torch.full_like(nxt, 1)   # token 1 never occurs in ids
        out.append(Sample(ids, 0, 2, torch.stack([top, top], 1).to(torch.int32),
                          torch.tensor([[1.0, 0.0]] * len(ids), dtype=torch.float16), "test"))
    return out


def test_copy_fit_trusts_the_follower_only_where_it_is_right(tmp_path):
    from ssd_trt.distill.copy_fit import (fit_copy_mixture, independent_draft_logits, read_copy_mixture,
                                          write_copy_mixture)

    torch.manual_seed(0)
    draft = DraftModel(small_cfg()).eval()                       # untrained: its argmax is noise
    mixture, summary = fit_copy_mixture(independent_draft_logits(draft), _pattern_samples(True), max_ngram=4)
    assert max(mixture.weights) > 0.5
    assert summary["greedy_agreement_with_copy"] > summary["greedy_agreement_draft"] + 0.5
    useless, summary = fit_copy_mixture(independent_draft_logits(draft), _pattern_samples(False), max_ngram=4)
    assert useless.weights == (0.0, 0.0, 0.0, 0.0)
    assert summary["greedy_agreement_with_copy"] == summary["greedy_agreement_draft"]
    save_draft(draft, tmp_path)
    write_copy_mixture(tmp_path, mixture)
    assert read_copy_mixture(tmp_path) == mixture
    assert load_draft(tmp_path).config == draft.config           # the extra key does not disturb the loader


def test_reduced_head_draft_has_a_transformers_parity_check(tmp_path):
    """The build compares a reduced-head draft with transformers too: its body, times the reduced head."""
    from ssd_trt.export.parity import transformers_parity
    from ssd_trt.models.loading import load_decoder
    from ssd_trt.models.sources import resolve_source
    torch.manual_seed(0)
    save_draft(DraftModel(small_cfg(), torch.tensor([2, 5, 17, 100, 511])).eval(), tmp_path, dtype=torch.float32)
    source = resolve_source(str(tmp_path))
    model, _ = load_decoder(source)
    result = transformers_parity(model, source)
    assert "reduced head" in result["reference"] and result["max_abs_diff"] < 1e-4
    with torch.no_grad():                       # and the check can fail: a perturbed layer is caught
        model.layers[0].mlp.down_proj.weight.add_(0.05)
    assert transformers_parity(model, source)["max_abs_diff"] > 1e-3


def test_polygraphy_validation_of_a_reduced_head_draft_is_warning_free(tmp_path):
    """-inf logits off the head subset are compared exactly, the rest by Polygraphy: no inf - inf NaN warnings."""
    import warnings

    from ssd_trt.export.onnx_export import save_flavours, trace_step_graph
    from ssd_trt.export.validate import validate_with_polygraphy
    from ssd_trt.models.loading import load_decoder
    from ssd_trt.models.sources import resolve_source
    torch.manual_seed(0)
    save_draft(DraftModel(small_cfg(), torch.tensor([2, 5, 17, 100, 511])).eval(), tmp_path / "d", dtype=torch.float32)
    model, _ = load_decoder(resolve_source(str(tmp_path / "d")))
    paths = save_flavours(trace_step_graph(model), tmp_path / "onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = validate_with_polygraphy(model, paths["ort"], [(1, 1), (2, 5)])
    assert result["passed"] and result["non_finite_compared_exactly"] > 0
