"""Training the EAGLE-3 draft with training-time test (issue 19, item 4), on tiny configs.

The unrolled training forward is checked against what the draft computes at decode time: for every
position and unrolled step, ``Eagle3Draft.forward`` run sequentially with the ``ssd::tree_attention`` cache
(a target-featured prefill, then tokens carrying the draft's own output). A mask that lets a chain see one
target-featured token too many must fail that check; a two-layer draft is checked the same way. A tiny run
overfits; the export loads back through ``load_eagle3_checkpoint`` computing the same logits. A draft deepened
by identity-starting layers computes what it computed before.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from ssd_trt_plugins.tree_attention.reference import causal_tree_mask, tree_attention_reference
from ssd_trt.distill.eagle3_data import FeatureSample, draft_vocabulary
from ssd_trt.distill.eagle3_train import Eagle3TrainConfig, deepen, export_released, init_draft, masked_sdpa, \
    train_eagle3, ttt_mask, unrolled_forward
from ssd_trt.models.config import DecoderConfig
from ssd_trt.models.decoder import Decoder
from ssd_trt.models.eagle3 import load_eagle3_checkpoint

torch.set_num_threads(1)
VOCAB, HIDDEN, TARGET_LAYERS = 96, 32, 6
DRAFT_IDS = torch.arange(0, VOCAB, 2)          # the draft vocabulary: every even target id


def tiny_target(layers: int = TARGET_LAYERS) -> Decoder:
    config = DecoderConfig(model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64,
                           num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5,
                           rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    return Decoder(config).eval()


def tiny_draft(seed: int = 1, layers: int = 1):
    model = init_draft(tiny_target(), DRAFT_IDS, (1, 3, 4), seed=seed, num_layers=layers)
    with torch.no_grad():   # random norms so a wrong pairing of norm and input cannot cancel out
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def sequential_logits(model, ids, features, j: int, steps: int) -> list[torch.Tensor]:
    """Decode as the runtime would: prefill tokens 1..j carrying target features into the tree-attention
    cache, then tokens j+1..j+steps-1 each carrying the draft's own last output. Logits on the draft vocab."""
    caches = model.empty_caches(1, 64)
    n = j
    logits, hidden, *caches = model(ids[None, 1:j + 1], torch.arange(1, j + 1)[None],
                                    torch.from_numpy(causal_tree_mask(1, n)), torch.zeros(1, dtype=torch.int32),
                                    features[None, :j], torch.zeros(1, n, HIDDEN),
                                    torch.ones(1, n, dtype=torch.bool), *caches)
    out = [logits[0, -1, model.draft_token_ids]]
    last = hidden[:, -1:]
    for s in range(1, steps):
        p = j + s
        logits, last, *caches = model(ids[None, p:p + 1], torch.tensor([[p]]),
                                      torch.from_numpy(causal_tree_mask(1, 1)), torch.tensor([p - 1], dtype=torch.int32),
                                      torch.zeros(1, 1, 3 * HIDDEN), last, torch.zeros(1, 1, dtype=torch.bool), *caches)
        out.append(logits[0, -1, model.draft_token_ids])
    return out


def random_sequence(T: int = 12, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (T,), generator=gen), torch.randn(T, 3 * HIDDEN, generator=gen)


def max_mismatch(mask_fn=ttt_mask, steps: int = 3, layers: int = 1) -> float:
    model = tiny_draft(layers=layers)
    ids, features = random_sequence()
    with torch.no_grad():
        unrolled = unrolled_forward(model, ids[None], features[None], steps, mask_fn)
        worst = 0.0
        for j in range(1, len(ids) - steps + 1):     # every chain start with its whole chain in the sequence
            for s, want in enumerate(sequential_logits(model, ids, features, j, steps)):
                worst = max(worst, float((unrolled[s][0, j + s - 1] - want).abs().max()))
    return worst


def test_masked_sdpa_equals_the_tree_attention_op():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 5, 8, generator=gen) for h in (4, 2, 2))
    cache = torch.randn(2, 1, 2, 16, 8, generator=gen)
    want, keys, values = tree_attention_reference(q, k, v, cache[0], cache[1], torch.tensor([7], dtype=torch.int32),
                                                   torch.from_numpy(causal_tree_mask(1, 5)), 0.35)
    mask = torch.zeros(5, 16, dtype=torch.bool)
    mask[:, :7] = True
    mask[:, 7:12] = torch.tril(torch.ones(5, 5, dtype=torch.bool))
    assert torch.allclose(masked_sdpa(q, keys, values, mask, 0.35), want, atol=1e-5)


@pytest.mark.parametrize("layers", [1, 2])
def test_each_unrolled_step_equals_sequential_decoding_with_the_tree_attention_cache(layers):
    assert max_mismatch(layers=layers) < 1e-4


@pytest.mark.parametrize("layers", [1, 2])
def test_a_mask_that_lets_the_chain_see_a_later_target_featured_token_fails_the_check(layers):
    def leaky(rows, step, device=None):     # the prefix reaches one row further than the chain's start
        mask = ttt_mask(rows, step, device)
        b = torch.arange(rows)[:, None]
        if step:
            mask[:, :rows] |= torch.arange(rows)[None, :] == b - step + 1
        return mask
    assert max_mismatch(leaky, layers=layers) > 1e-2


def test_step_zero_of_the_ttt_mask_is_causal_and_later_steps_read_one_key_per_chain_token():
    assert torch.equal(ttt_mask(4, 0), torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    m = ttt_mask(6, 2)
    assert m[5].tolist() == [True] * 4 + [False, False] + [False] * 4 + [True, False] + [False] * 5 + [True]


def tiny_samples(n: int = 8, T: int = 10) -> list[FeatureSample]:
    """Sequences whose labels are a fixed function of the token (next = (3 t + 1) mod V, even ids)."""
    out = []
    for i in range(n):
        ids, features = random_sequence(T, seed=10 + i)
        nxt = (3 * ids + 1) % VOCAB // 2 * 2
        topk_ids = torch.stack((nxt, (nxt + 2) % VOCAB), dim=1).to(torch.int32)
        topk_logits = torch.tensor([[4.0, 0.0]]).expand(T, 2).half()
        out.append(FeatureSample(ids.to(torch.int32), 0, 3, features.to(torch.bfloat16), topk_ids, topk_logits, "x"))
    return out


def test_a_tiny_run_overfits_and_the_export_loads_back(tmp_path):
    model = tiny_draft()
    c = Eagle3TrainConfig(steps=60, batch=4, lr=1e-2, warmup=5, ckpt_every=60, eval_samples=8, bf16=False)
    summary = train_eagle3(model, tiny_samples(), tiny_samples(4), c, tmp_path / "run", log=lambda *_: None)
    losses = [h["loss"] for h in summary["history"] if "loss" in h]
    assert losses[-1] < 0.5 * losses[0]
    assert summary["history"][-1]["eval"]["agree_by_step"][0] > 0.5

    with torch.no_grad():   # the export is bf16: compare with the bf16-rounded model
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    export_released(model, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    loaded = load_eagle3_checkpoint(tmp_path / "export", TARGET_LAYERS, model.embed_tokens.weight.detach())
    assert torch.equal(loaded.draft_token_ids, DRAFT_IDS)
    ids, features = random_sequence()
    with torch.no_grad():
        want = unrolled_forward(model, ids[None], features[None], 2)
        got = unrolled_forward(loaded, ids[None], features[None], 2)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))


def test_the_draft_vocabulary_uses_the_released_encoding():
    d2t, t2d = draft_vocabulary(torch.tensor([5, 1, 9]), 12)
    assert (torch.arange(3) + d2t).tolist() == [1, 5, 9] and t2d.nonzero().flatten().tolist() == [1, 5, 9]


def test_the_draft_starts_from_the_targets_embedding_head_rows_and_norm():
    target = tiny_target()
    model = init_draft(target, DRAFT_IDS, (1, 3, 4))
    assert torch.equal(model.embed_tokens.weight, target.embed_tokens.weight)
    assert not model.embed_tokens.weight.requires_grad
    assert torch.equal(model.lm_head.weight, target.embed_tokens.weight[DRAFT_IDS])
    assert dataclasses.asdict(model.config.layer)["num_layers"] == 1


def test_kind_eagle3_dispatches_to_its_own_pipeline_and_independent_stays_the_default():
    from ssd_trt.distill.__main__ import split_kind
    rest = ["--target", "t", "--out", "o"]
    assert split_kind(["--kind", "eagle3", *rest]) == ("eagle3", rest)
    assert split_kind(["--target", "t", "--out", "o"])[0] == "independent"


def test_init_from_continues_a_released_head_and_refuses_one_reading_other_layers(tmp_path):
    from ssd_trt.distill.eagle3_pipeline import warm_start
    from ssd_trt.models.eagle3 import default_feature_layers

    target = tiny_target(layers=8)     # the default feature layers (2, 4, 5) need 8
    released = init_draft(target, DRAFT_IDS, default_feature_layers(8), seed=3)
    export_released(released, tmp_path / "head")
    model = warm_start(tmp_path / "head", target)
    assert not model.embed_tokens.weight.requires_grad
    assert torch.equal(model.draft_token_ids, DRAFT_IDS)
    assert torch.equal(model.fc.weight, released.fc.weight.to(torch.bfloat16).float())
    c = Eagle3TrainConfig(steps=30, batch=4, lr=1e-2, warmup=2, ckpt_every=30, eval_samples=8, bf16=False)
    summary = train_eagle3(model, tiny_samples(), tiny_samples(4), c, tmp_path / "run", stop_after=20,
                           log=lambda *_: None)
    losses = [h["loss"] for h in summary["history"] if "loss" in h]
    assert losses[-1] < losses[0]
    assert summary["step"] == 20 and summary["history"][-1]["eval"]["step"] == 20   # stopped, evaluated

    export_released(init_draft(target, DRAFT_IDS, (1, 3, 4)), tmp_path / "other")
    with pytest.raises(ValueError, match=r"reads target layers \[1, 3, 4\]"):
        warm_start(tmp_path / "other", target)


def test_a_deepened_draft_starts_where_the_shallow_one_was_and_exports_its_extra_layers(tmp_path):
    shallow = tiny_draft()
    deep = deepen(shallow, 3, seed=4)
    assert deep.config.layer.num_layers == 3 and len(deep.extra_layers) == 2
    assert not deep.embed_tokens.weight.requires_grad
    ids, features = random_sequence()
    with torch.no_grad():
        want = unrolled_forward(shallow, ids[None], features[None], 3)
        got = unrolled_forward(deep, ids[None], features[None], 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))    # zero output projections: exactly the same
    with torch.no_grad():   # the new layers trained a little: the export must carry them
        for layer in deep.extra_layers:
            layer.self_attn.o_proj.weight.normal_(0, 0.2)
            layer.mlp.down_proj.weight.normal_(0, 0.2)
        for p in deep.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    export_released(deep, tmp_path / "deep")
    config = json.loads((tmp_path / "deep" / "config.json").read_text())
    assert config["num_hidden_layers"] == 3
    loaded = load_eagle3_checkpoint(tmp_path / "deep", TARGET_LAYERS, deep.embed_tokens.weight.detach())
    with torch.no_grad():
        want = unrolled_forward(deep, ids[None], features[None], 2)
        got = unrolled_forward(loaded, ids[None], features[None], 2)
        shallow_out = unrolled_forward(shallow, ids[None], features[None], 2)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
    assert not torch.allclose(got[0], shallow_out[0], atol=1e-3)   # the extra layers are really applied
    with pytest.raises(ValueError, match="cannot deepen a 3-layer draft to 2"):
        deepen(deep, 2)


def test_teacher_forced_logits_are_step_0_in_the_full_vocabulary_and_feed_the_copy_fit():
    from ssd_trt.distill.copy_fit import fit_copy_mixture
    from ssd_trt.distill.eagle3_train import teacher_forced_logits

    model = tiny_draft()
    ids, features = random_sequence()
    with torch.no_grad():
        full = teacher_forced_logits(model, ids, features)
        step0 = unrolled_forward(model, ids[None], features[None], 1)[0][0]
    assert full.shape == (len(ids), VOCAB)
    assert torch.allclose(full[1:, DRAFT_IDS], step0) and torch.isinf(full[:, 1::2]).all()

    # sequences repeating a pattern of draft-vocabulary tokens whose target is the follower: the fit trusts it
    samples = []
    for i in range(4):
        pattern = DRAFT_IDS[torch.randperm(len(DRAFT_IDS), generator=torch.Generator().manual_seed(i))[:5]]
        seq = pattern.repeat(4).to(torch.int32)
        nxt = torch.cat([seq[1:], seq[:1]]).long()
        samples.append(FeatureSample(seq, 0, 2, torch.randn(len(seq), 3 * HIDDEN).to(torch.bfloat16),
                                     torch.stack([nxt, (nxt + 2) % VOCAB], 1).to(torch.int32),
                                     torch.tensor([[4.0, 0.0]]).expand(len(seq), 2).half(), "x"))
    with torch.no_grad():
        mixture, summary = fit_copy_mixture(lambda s: teacher_forced_logits(model, s.ids, s.features), samples, 4)
    assert max(mixture.weights) > 0.5
    assert summary["greedy_agreement_with_copy"] > summary["greedy_agreement_draft"] + 0.5
