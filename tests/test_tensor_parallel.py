"""A target split over tensor-parallel ranks (``engine.tensor_parallel: 2``, the torch backend), on CPU: two rank
processes joined by gloo, each holding half the query heads, half the key/value heads and half the MLP columns of a
random GQA Llama (8 query / 4 key-value heads, 4 layers), the draft whole beside them.

The split computes the whole model: the two ranks' logits are the unsplit build's on every step shape, greedy SD and
SSD on the split build give AR's tokens (alone, and in a batch that requests join and leave), and sampled SSD follows
the target's distribution. A rank killed or stopped mid-request fails that request within the time limit, leaves no
process behind, and the next request is served exactly; a split the heads do not allow is refused before any weight
is read, and a GPU host with too few GPUs before any is loaded.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import ssd_trt
from ssd_trt import AR, SD, SSD, SamplingParams
from ssd_trt.batching.engine import LLMEngine
from ssd_trt.engines.tensor_parallel import TensorParallelEngine
from ssd_trt.errors import ConfigError, EngineError, RecipeError
from ssd_trt.export.parity import decoder_logits
from ssd_trt.models.config import DecoderConfig
from ssd_trt.models.rank_decoder import rank_decoder
from ssd_trt.models.sharding import rank_split
from ssd_trt.options import RuntimeOptions
from tests.helpers import perturbed, random_decoder, save_hf_checkpoint, write_recipe
from tests.step_script import step_script
from tests.test_engine_step import run
from tests.test_sampling_lossless_ort import PROMPT, check, exact_tokens

ROOT = Path(__file__).resolve().parents[1]
GQA = DecoderConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                    num_heads=8, num_kv_heads=4, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                    max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
PROMPTS = [[1, 5, 9, 33, 7], [1, 100, 3], [1, 42, 42, 42, 42, 8, 19], [1, 250], [7, 7, 8, 9, 10, 11],
           [1, 60, 61], [3, 200, 17, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
LENGTHS = [14, 20, 9, 18, 16, 12, 15, 10]
GREEDY = [SamplingParams(max_new_tokens=n, stop_on_eos=False) for n in LENGTHS]
MODES = {"sd": SD(draft_len=3), "sd-tree": SD(tree_widths=(2, 2, 1)),
         "ssd": SSD(draft_len=3, fan_out_budget=8, backup="jit")}
ROWS = 32                      # the builds' max batch: the sampled test draws 32 sequences per request


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """The random target and a perturbed draft, built for the torch backend whole and split over 2 ranks."""
    from ssd_trt.build import build
    root = tmp_path_factory.mktemp("tp")
    target = random_decoder(GQA, seed=5)
    with torch.no_grad():     # half as sharp a head: the sampled test's first two tokens have 16 likely outcomes
        target.lm_head.weight.mul_(0.5)
    draft = perturbed(target, seed=6, amount=0.05)
    target_dir, draft_dir = save_hf_checkpoint(target, root / "target"), save_hf_checkpoint(draft, root / "draft")
    builds = {ranks: build(write_recipe(root / f"tp{ranks}.yaml", target_dir, draft_dir, name=f"tp{ranks}",
                                        backend="torch", tensor_parallel=ranks, max_batch=ROWS), root=root)
              for ranks in (1, 2)}
    return {"target": target, "root": root, "target_dir": target_dir, "draft_dir": draft_dir, **builds}


@pytest.fixture(scope="module")
def gen(pair):
    generator = ssd_trt.load(pair[2])
    yield generator
    engine = generator.engines.opened.get("target")
    if engine is not None:
        engine.close()


@pytest.fixture(scope="module")
def reference(gen) -> list[list[int]]:
    """Each prompt alone, autoregressive, on the split build: what every mode and interleaving must give."""
    return [gen.generate_ids([ids], params, mode="ar")[0].token_ids for ids, params in zip(PROMPTS, GREEDY)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


# -- the split itself, in one process: each rank in a thread, the all-reduce a sum across the threads ------------
class ThreadSum:
    """An all-reduce over threads: every rank deposits its partial sum, and each adds them all in rank order."""

    def __init__(self, ranks: int) -> None:
        self.parts: list[torch.Tensor | None] = [None] * ranks
        self.barrier = threading.Barrier(ranks)

    def reduce_for(self, rank: int):
        def reduce(tensor: torch.Tensor) -> None:
            self.parts[rank] = tensor.clone()
            self.barrier.wait()
            total = sum(self.parts[1:], self.parts[0].clone())
            self.barrier.wait()               # every rank has read every part before any overwrites its own
            tensor.copy_(total)
        return reduce


def split_logits(model, ranks: int, ids: torch.Tensor) -> list[torch.Tensor]:
    total = ThreadSum(ranks)
    shards = [rank_decoder(model, rank, ranks, total.reduce_for(rank)) for rank in range(ranks)]
    out: list[torch.Tensor | None] = [None] * ranks

    def run_rank(rank: int) -> None:
        out[rank] = decoder_logits(shards[rank], ids)
    threads = [threading.Thread(target=run_rank, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return out


SPLITS = {   # (model type, query heads, key/value heads, ranks): what each rank holds
    "llama-kv-split": ("llama", 8, 4, 2),             # 4 query, 2 key/value heads per rank
    "llama-kv-replicated": ("llama", 8, 2, 4),        # 2 query heads per rank, each key/value head on 2 ranks
    "qwen2-biases": ("qwen2", 8, 4, 4),               # q/k/v biases split with their rows
    "qwen3-qk-norm": ("qwen3", 4, 1, 2),              # per-head q/k norms whole; the one key/value head on both
}


@pytest.mark.parametrize("name", sorted(SPLITS))
def test_the_ranks_partial_sums_add_up_to_the_whole_model(name):
    model_type, heads, kv_heads, ranks = SPLITS[name]
    config = DecoderConfig(**{**GQA.to_dict(), "model_type": model_type, "num_layers": 2, "num_heads": heads,
                              "num_kv_heads": kv_heads, "head_dim": 64 // heads,
                              "attention_bias": model_type == "qwen2", "qk_norm": model_type == "qwen3"})
    model = random_decoder(config, seed=1)
    ids = torch.tensor([[1, 5, 9, 33, 7, 100, 3, 42]])
    whole = decoder_logits(model, ids)
    for rank, logits in enumerate(split_logits(model, ranks, ids)):
        assert torch.allclose(logits, whole, rtol=0, atol=1e-4 * whole.abs().max()), (name, rank)
    # each rank's query heads sit with the key/value head they read: query head j reads head j // (H / KV)
    d, group = config.head_dim, heads // kv_heads
    for rank in range(ranks):
        shard = rank_decoder(model, rank, ranks, reduce=lambda tensor: None).layers[0].self_attn
        whole_attn = model.layers[0].self_attn
        queries = range(rank * heads // ranks, (rank + 1) * heads // ranks)
        kv_read = sorted({q // group for q in queries})
        assert torch.equal(shard.q_proj.weight, whole_attn.q_proj.weight[queries[0] * d:(queries[-1] + 1) * d])
        assert torch.equal(shard.k_proj.weight, whole_attn.k_proj.weight[kv_read[0] * d:(kv_read[-1] + 1) * d])
        assert shard.o_proj.linear.weight.shape == (config.hidden_size, len(queries) * d)
        if model_type == "qwen2":
            assert torch.equal(shard.v_proj.bias, whole_attn.v_proj.bias[kv_read[0] * d:(kv_read[-1] + 1) * d])
        if model_type == "qwen3":
            assert torch.equal(shard.k_norm.weight, whole_attn.k_norm.weight)


@pytest.mark.parametrize("heads,kv_heads,mlp,ranks,problem", [
    (8, 4, 128, 3, "its 8 attention heads do not divide into 3 ranks"),
    (12, 6, 128, 4, "its 6 key/value heads do not divide into 4 ranks"),
    (12, 4, 128, 6, "its 4 key/value heads cannot be replicated evenly over 6 ranks"),
    (8, 4, 100, 8, "its MLP width 100 does not divide into 8 ranks"),
])
def test_a_split_the_sizes_do_not_allow_says_why_and_which_would_work(heads, kv_heads, mlp, ranks, problem):
    config = DecoderConfig(**{**GQA.to_dict(), "num_heads": heads, "num_kv_heads": kv_heads,
                              "intermediate_size": mlp, "head_dim": 8})
    with pytest.raises(RecipeError, match=rf"engine.tensor_parallel: {ranks} cannot split this model: {problem}.*"
                                          r"choose one of \[1, 2"):
        rank_split(config, ranks, "this model")


def test_a_build_whose_heads_do_not_split_is_refused_before_any_weight_is_read(pair, monkeypatch):
    from ssd_trt.build import build, main
    from ssd_trt.models.checkpoint import Checkpoint

    def no_weights(self, name):
        raise AssertionError(f"read weight {name} before checking the split")
    monkeypatch.setattr(Checkpoint, "tensor", no_weights)
    recipe = write_recipe(pair["root"] / "tp3.yaml", pair["target_dir"], pair["draft_dir"], name="tp3",
                          backend="torch", tensor_parallel=3)
    with pytest.raises(RecipeError, match=r"engine.tensor_parallel: 3 cannot split the target .*: its 8 attention "
                                          r"heads do not divide into 3 ranks .* choose one of \[1, 2, 4, 8\]"):
        build(recipe, root=pair["root"])
    assert not (pair["root"] / "build" / "tp3").exists()
    assert main([str(recipe)]) == 2


def test_too_few_gpus_are_refused_before_any_rank_starts(pair, monkeypatch):
    """On a GPU host the target's N ranks take GPUs 0 .. N-1 and the draft GPU N."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(TensorParallelEngine, "_start", lambda self: pytest.fail("started ranks"))
    generator = ssd_trt.load(pair[2])
    for role in ("target", "draft"):
        with pytest.raises(ConfigError, match=r"splits the target over 2 GPUs .* runs the draft on one more, GPU 2: "
                                              r"it needs 3 GPUs, but 2 are visible"):
            generator.engine(role)


# -- two gloo ranks behind the engine interface --------------------------------------------------------------------
def test_two_ranks_give_the_whole_models_logits_on_every_step_shape(pair, gen):
    """Ragged prefill, decodes, a verify chunk, a rollback, a tree step, keep: against the unsplit build (its one
    engine runs the Triton kernel in the interpreter; the ranks run the reference attention)."""
    split = gen.engine("target")
    assert isinstance(split, TensorParallelEngine) and len(split.rank_pids) == 2
    whole = ssd_trt.load(pair[1]).engine("target")
    for ours, theirs in zip(step_script(split, PROMPTS[:2], 3, 4), step_script(whole, PROMPTS[:2], 3, 4)):
        assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_greedy_sd_and_ssd_on_two_ranks_equal_autoregressive_one_request_at_a_time(gen, reference, mode):
    for ids, params, expected in zip(PROMPTS, GREEDY, reference):
        assert gen.generate_ids([ids], params, mode=MODES[mode])[0].token_ids == expected


def test_greedy_requests_joining_and_leaving_a_running_batch_on_two_ranks_match_autoregressive(gen, reference):
    modes = [AR(), MODES["ssd"], MODES["sd"], MODES["sd-tree"], MODES["ssd"], AR(), MODES["sd"], MODES["ssd"]]
    engine = LLMEngine(gen)
    schedule = {0: [0, 1], 3: [2, 3, 4], 11: [5, 6], 15: [7]}   # 2 start, 3 join while they run, 3 join later
    arrivals = {step: [(str(i), PROMPTS[i], GREEDY[i], modes[i]) for i in rows] for step, rows in schedule.items()}
    streamed, batches = run(engine, arrivals)
    engine.close()
    for i in range(len(PROMPTS)):
        assert engine.take_result(str(i)).tokens == reference[i] == streamed[str(i)], (i, modes[i])
    assert batches[2] == 2 and batches[3] == 5                       # joined mid-generation
    assert batches[-1] < max(batches)                               # and left while others ran


def test_sampled_ssd_on_two_ranks_follows_the_target_distribution(pair, gen):
    """The first two tokens of 1,536 seeded SSD requests (T=0.7, top-p 0.9) against the exact distribution from the
    whole torch decoder, at the noise-floor threshold of tests/test_sampling_lossless.py."""
    settings = dict(temperature=0.7, top_p=0.9)
    joint = exact_tokens(pair["target"], SamplingParams(max_new_tokens=2, **settings))
    assert len(joint) > 10
    samples = []
    for call in range(48):
        params = SamplingParams(max_new_tokens=2, seed=7000 + call, stop_on_eos=False, **settings)
        samples += [tuple(r.token_ids) for r in gen.generate_ids([PROMPT] * ROWS, params, mode=MODES["ssd"])]
    for what, tv, threshold in check(joint, samples):
        assert tv < threshold, f"{what}: TV {tv:.4f} >= {threshold:.4f}"


# -- faults ----------------------------------------------------------------------------------------------------------
def _fail_mid_request(gen, fault: int, mode=MODES["ssd"]) -> tuple[EngineError, float, list[int]]:
    """Send ``fault`` (a signal) to rank 1 once the request has streamed its first tokens; the error and how long the
    request took to fail after the signal."""
    engine = gen.engine("target")
    pids = engine.rank_pids
    sent: list[float] = []

    def on_tokens(row: int, tokens: list[int]) -> None:
        if not sent:
            os.kill(pids[1], fault)
            sent.append(time.perf_counter())
    with pytest.raises(EngineError) as failure:
        gen.generate_ids([PROMPTS[1]], GREEDY[1], mode=mode, on_tokens=on_tokens)
    return failure.value, time.perf_counter() - sent[0], pids


def test_a_rank_killed_mid_request_fails_it_and_the_next_request_is_served_exactly(gen, reference):
    engine = gen.engine("target")
    error, elapsed, pids = _fail_mid_request(gen, signal.SIGKILL)
    assert elapsed < 30
    assert re.search(rf"rank 1 of 2 \(pid {pids[1]}\) died during \w+ \(exit code -9: killed by SIGKILL\)",
                     str(error)), str(error)
    assert "the next request starts the ranks afresh" in str(error)
    assert not any(alive(pid) for pid in pids) and engine.rank_pids == []      # rank 0 too: no orphan
    assert all(int(length) == 0 for length in engine.lengths)                 # the request's slots were freed
    restarts = engine.restarts
    assert gen.generate_ids([PROMPTS[0]], GREEDY[0], mode=MODES["ssd"])[0].token_ids == reference[0]
    assert engine.restarts == restarts + 1 and not set(engine.rank_pids) & set(pids)


def test_a_hung_rank_fails_the_request_after_the_time_limit_and_is_killed(gen, reference):
    """A stopped rank (SIGSTOP) answers nothing; the other waits for it in an all-reduce: both are declared hung after
    ``step_timeout_s`` (RuntimeOptions.rank_timeout_s, 30 s by default; 2 s here) and killed."""
    engine = gen.engine("target")
    assert engine.step_timeout_s == gen.options.rank_timeout_s == 30.0
    with pytest.raises(ConfigError, match="rank_timeout_s must be positive"):
        RuntimeOptions(rank_timeout_s=0)
    engine.step_timeout_s = 2.0
    try:
        error, elapsed, pids = _fail_mid_request(gen, signal.SIGSTOP, mode=MODES["sd"])
    finally:
        engine.step_timeout_s = 30.0
    assert 2.0 <= elapsed < 10
    assert "did not answer" in str(error) and "within 2 s" in str(error) and str(pids[1]) in str(error)
    assert not any(alive(pid) for pid in pids)
    assert gen.generate_ids([PROMPTS[2]], GREEDY[2], mode=MODES["sd"])[0].token_ids == reference[2]


def test_the_engine_step_fails_the_requests_of_a_failed_step_and_serves_later_ones(gen, reference):
    """What the Triton model does when a step raises (``StepLoop`` -> ``fail_all``): every request of the step is
    aborted with the error; requests sent afterwards run on fresh ranks, exactly."""
    engine = gen.engine("target")
    llm = LLMEngine(gen)
    for i in (0, 1, 2):
        llm.add_request(PROMPTS[i], GREEDY[i], MODES["ssd"] if i else AR(), request_id=str(i))
    llm.step()
    llm.step()
    os.kill(engine.rank_pids[0], signal.SIGKILL)
    with pytest.raises(EngineError, match=r"rank 0 of 2 .* died"):
        llm.step()
    for i in (0, 1, 2):
        llm.abort(str(i))
    finished = {out.request_id: out.finish_reason for out in llm.step()}
    assert finished == {"0": "abort", "1": "abort", "2": "abort"} and not llm.has_unfinished()
    later = {3: MODES["sd"], 4: MODES["ssd"]}
    streamed, _ = run(llm, {0: [(str(i), PROMPTS[i], GREEDY[i], mode) for i, mode in later.items()]})
    llm.close()
    for i in later:
        assert llm.take_result(str(i)).tokens == reference[i] == streamed[str(i)]


def test_a_step_on_rows_whose_cache_was_lost_is_refused(gen):
    """After a fault the rows' caches are gone: continuing them would read nothing as if it were their past."""
    engine = gen.engine("target")
    engine.reset(2)
    engine.forward(np.array([[5, 6], [7, 8]]), np.array([[0, 1], [0, 1]]))
    os.kill(engine.rank_pids[1], signal.SIGKILL)
    with pytest.raises(EngineError, match="died during forward"):
        engine.forward(np.array([[9], [9]]), np.array([[2], [2]]))
    with pytest.raises(EngineError, match=r"rows \[0, 1\] held KV cache that was lost"):
        engine.forward(np.array([[9], [9]]), np.array([[2], [2]]))
    with pytest.raises(EngineError, match=r"rows \[1\] held KV cache"):
        engine.select_rows([None, 1])
    engine.rollback(np.zeros(2, dtype=np.int32))            # given back: empty rows step again
    logits = engine.forward(np.array([[5], [7]]), np.array([[0], [0]]))
    assert logits.shape == (2, 1, GQA.vocab_size) and engine.lengths.tolist() == [1, 1]


# -- the command line ------------------------------------------------------------------------------------------------
def test_generate_runs_a_split_build_with_no_other_flag_and_leaves_no_rank_behind(pair, gen, reference):
    mark = uuid.uuid4().hex
    prompt = " ".join(f"w{token}" for token in PROMPTS[4])
    out = subprocess.run([sys.executable, "-m", "ssd_trt.generate", str(pair[2]), "--backend", "torch", "--prompt",
                          prompt, "--max-new-tokens", str(LENGTHS[4]), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "SSD_TRT_TEST_MARK": mark})
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    expected = gen.generate_ids([gen.encode(prompt)], SamplingParams(max_new_tokens=LENGTHS[4]), mode="ar")
    assert result["token_ids"] == expected[0].token_ids
    assert _marked_processes(mark) == [], "rank processes outlived the command"


def _marked_processes(mark: str) -> list[int]:
    """Live processes whose environment carries ``mark`` (the CLI and the ranks it spawned)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if f"SSD_TRT_TEST_MARK={mark}".encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_closing_the_engine_stops_every_rank(gen):
    engine = gen.engine("target")
    if not engine.rank_pids:
        engine.reset(1)                    # (started again after an earlier test's fault)
    pids = engine.rank_pids
    assert len(pids) == 2 and all(alive(pid) for pid in pids)
    engine.close()
    assert not any(alive(pid) for pid in pids) and engine.rank_pids == []


def test_the_gpu_tensor_parallel_bench_runs_its_code_path_on_cpu_ranks(tmp_path):
    """research/gpu/tp_bench.py (what scripts/gpu_session.sh runs on a host with N + 1 GPUs), on a tiny model over
    2 gloo ranks: its split build's SD and SSD equal its AR, and the report says where each model ran."""
    report = tmp_path / "tp.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "research" / "gpu" / "tp_bench.py"), "--device", "cpu",
                           "--smoke", "--prompts", "2", "--json", str(report)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(report.read_text())
    assert result["tensor_parallel"] == 2 and list(result["builds"]) == ["tp2"]
    split = result["builds"]["tp2"]
    assert split["target_engine"] == "TensorParallelEngine" and split["draft_device"] == "cpu"
    assert split["sd"]["equals_ar"] and split["ssd"]["equals_ar"] and split["ar"]["tokens_per_s"] > 0
