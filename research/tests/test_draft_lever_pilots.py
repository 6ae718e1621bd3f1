"""The loss variants of research/draft/draft_lever_pilots.py are the ones the model card describes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ssd_trt.distill.model import DraftConfig, DraftModel
from ssd_trt.distill.train import kd_loss
from tests.helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "research" / "draft" / "draft_lever_pilots.py"


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 5, 12, generator=g)
    tid = torch.stack([torch.randperm(12, generator=g)[:4] for _ in range(10)]).view(2, 5, 4)
    tid[0, 1, 2] = -1                                    # a teacher token outside the head
    tlog = torch.sort(torch.randn(2, 5, 4, generator=g) * 3, dim=-1, descending=True).values
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, :2] = False
    weight = torch.where(torch.arange(5) < 2, 0.5, 1.0).expand(2, 5)
    return logits, tid, tlog, mask, weight


def test_soft_is_the_training_loss_and_copy_without_weight_is_soft():
    pilots = load_script(SCRIPT)
    logits, tid, tlog, mask, weight = batch()
    soft = pilots.pilot_loss("soft", logits, tid, tlog, mask, weight, None, None)
    torch.testing.assert_close(soft, kd_loss(logits, tid, tlog, mask, weight))
    follower = tid[..., 1].clone()
    no_copy = pilots.pilot_loss("copy", logits, tid, tlog, mask, weight, follower, torch.zeros(2, 5))
    torch.testing.assert_close(no_copy, soft)


def test_hard_is_cross_entropy_on_the_argmax_and_sharp_is_the_teacher_at_half_temperature():
    pilots = load_script(SCRIPT)
    logits, tid, tlog, mask, weight = batch(1)
    hard = pilots.pilot_loss("hard", logits, tid, tlog, mask, weight, None, None)
    logq = torch.log_softmax(logits, -1).gather(-1, tid[..., :1].clamp(min=0))[..., 0]
    m = mask.float() * weight
    torch.testing.assert_close(hard, -(logq * m).sum() / m.sum())
    sharp = pilots.pilot_loss("sharp", logits, tid, tlog, mask, weight, None, None)
    torch.testing.assert_close(sharp, kd_loss(logits, tid, tlog / 0.5, mask, weight))
    assert not torch.isclose(sharp, hard) and not torch.isclose(sharp, kd_loss(logits, tid, tlog, mask, weight))


def test_copy_credits_the_follower_with_its_weight():
    pilots = load_script(SCRIPT)
    logits, tid, tlog, mask, weight = batch(2)
    # the follower is the teacher's argmax at every position: mixing it in must lower the loss
    lam = torch.full((2, 5), 0.3)
    soft = pilots.pilot_loss("soft", logits, tid, tlog, mask, weight, None, None)
    right = pilots.pilot_loss("copy", logits, tid, tlog, mask, weight, tid[..., 0].clamp(min=0), lam)
    assert right < soft
    # one position by hand: q'(v) = 0.7 q(v) + 0.3 [v == f]
    one = torch.ones(1, 1, dtype=torch.bool)
    q = torch.softmax(logits[0, 3], -1)
    p = torch.softmax(tlog[0, 3], -1)
    mixed = 0.7 * q[tid[0, 3]] + 0.3 * (tid[0, 3] == tid[0, 3, 0]).float()
    expect = -(p * mixed.log()).sum()
    got = pilots.pilot_loss("copy", logits[:1, 3:4], tid[:1, 3:4], tlog[:1, 3:4], one, torch.ones(1, 1),
                            tid[:1, 3:4, 0], torch.full((1, 1), 0.3))
    torch.testing.assert_close(got, expect)


def test_a_grown_draft_starts_as_the_same_function():
    pilots = load_script(SCRIPT)
    torch.manual_seed(0)
    cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=100,
                      bos_token_id=1, eos_token_id=2)
    small = DraftModel(cfg, torch.arange(0, 100, 3)).eval()
    big = pilots.grown(small, 4).eval()
    assert len(big.model.layers) == 4
    x = torch.randint(0, 100, (2, 9))
    with torch.no_grad():
        a, b = small(x), big(x)
    finite = torch.isfinite(a)
    assert torch.equal(finite, torch.isfinite(b))
    torch.testing.assert_close(a[finite], b[finite], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="multiple"):
        pilots.grown(small, 3)


def test_curves_reads_the_heldout_evaluations_of_real_training_runs(tmp_path):
    from ssd_trt.distill.teacher import Sample
    from ssd_trt.distill.train import TrainConfig, split_samples, train

    pilots = load_script(SCRIPT)
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(40):   # teacher labels with a learnable rule: the target always predicts token (t + 1) % 50
        ids = torch.randint(0, 50, (10,), generator=g, dtype=torch.int32)
        nxt = ((ids.long() + 1) % 50).unsqueeze(-1)
        topk_ids = torch.cat([nxt, (nxt + 7) % 50], -1).to(torch.int32)
        topk_logits = torch.tensor([[4.0, 0.0]]).expand(10, 2).to(torch.float16)
        samples.append(Sample(ids, 0, 3, topk_ids, topk_logits, "test"))
    tr, held = split_samples(samples, every=8)
    runs = []
    for layers in (1, 2):
        cfg = DraftConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, vocab_size=50, rope_theta=10000.0)
        torch.manual_seed(0)
        run = tmp_path / f"layers{layers}"
        train(DraftModel(cfg), tr, held, TrainConfig(steps=6, batch=8, lr=1e-2, warmup=1, ckpt_every=3,
                                                     eval_samples=8), run, log=lambda *_: None)
        runs.append(run)
    evals = pilots.heldout_curve(runs[1])
    assert [e["step"] for e in evals] == [3, 6]
    assert all(0.0 <= e["agree"] <= 1.0 and e["minutes"] >= 0.0 for e in evals)
    png = tmp_path / "plots" / "curves.png"
    pilots.curves(runs, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(FileNotFoundError, match="not a `python -m ssd_trt.distill --out` directory"):
        pilots.heldout_curve(tmp_path / "plots")
