"""The engine step (continuous batching) on the embedded pair through the real ONNX Runtime engines: requests
join and leave between rounds in every mode and mix of modes, and each request's tokens stay exactly what it
gets alone -- greedy: AR's; seeded sampling: its own draws. Abort, a full engine (queueing, refusal past the
waiting limit) and stop conditions are checked the same way.
"""
from __future__ import annotations

import pytest

import ssd_trt
from ssd_trt import AR, SD, SSD, SamplingParams
from ssd_trt.batching.engine import LLMEngine
from ssd_trt.batching.scheduler import CapacityError

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:",
           "1, 2, 3, 4,", "The quick brown fox", "Water boils at", "import numpy as np\n"]
LENGTHS = [14, 22, 9, 18, 25, 12, 16, 20]


@pytest.fixture(scope="module")
def gen(smollm2_build):
    return ssd_trt.load(smollm2_build)


@pytest.fixture(scope="module")
def encoded(gen):
    return [gen.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(gen, encoded):
    """Each prompt alone, autoregressive: what every mode and every interleaving must give, greedy."""
    return [gen.generate_ids([ids], SamplingParams(max_new_tokens=n), mode="ar")[0].token_ids
            for ids, n in zip(encoded, LENGTHS)]


def run(engine: LLMEngine, arrivals: dict[int, list[tuple]]) -> tuple[dict[str, list[int]], list[int]]:
    """Step until done, adding ``arrivals[step]`` = [(request_id, ids, params, mode)] before that step; each
    request's streamed tokens, and the number of running requests after each step."""
    streamed: dict[str, list[int]] = {}
    batches: list[int] = []
    step = 0
    while engine.has_unfinished() or any(k >= step for k in arrivals):
        for request_id, ids, params, mode in arrivals.get(step, []):
            engine.add_request(ids, params, mode, request_id=request_id)
        for output in engine.step():
            streamed.setdefault(output.request_id, []).extend(output.new_tokens)
        batches.append(engine.metrics.active_batch)
        step += 1
    return streamed, batches


MIXES = {
    "ar": [AR()] * 8, "sd": [SD(draft_len=2)] * 8, "ssd": ["ssd"] * 8,
    "mixed": [AR(), "ssd", SD(draft_len=3), SSD(draft_len=2, fan_out_budget=6), "sd", AR(), "ssd",
              SSD(draft_len=1, backup="ngram")],
    "trees": [SD(tree_widths=(2, 2, 1)), AR(), SD(tree_widths=(3, 1)), "ssd", SD(draft_len=2),
              SD(tree_widths=(2, 2, 1)), "sd", SSD(draft_len=2, fan_out_budget=6)],
}


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_greedy_requests_joining_and_leaving_mid_generation_match_autoregressive(gen, encoded, reference, mix):
    modes = MIXES[mix]
    engine = LLMEngine(gen)
    # 2 requests start; 3 join while they run; 3 more join later, after the first have finished
    schedule = {0: [0, 1], 3: [2, 3, 4], 11: [5, 6], 15: [7]}
    arrivals = {step: [(str(i), encoded[i], SamplingParams(max_new_tokens=LENGTHS[i]), modes[i]) for i in rows]
                for step, rows in schedule.items()}
    streamed, batches = run(engine, arrivals)
    for i in range(len(PROMPTS)):
        result = engine.take_result(str(i))
        assert result.tokens == reference[i], (mix, i, modes[i])
        assert streamed[str(i)] == reference[i]
    assert max(batches) >= 4 and batches[2] == 2 and batches[3] == 5      # joined mid-generation
    assert any(later > earlier for earlier, later in zip(batches, batches[1:])
               if earlier < max(batches)) and batches[-1] < max(batches)   # and left while others ran
    engine.close()


def test_abort_frees_the_rows_and_the_others_stay_exact(gen, encoded, reference):
    engine = LLMEngine(gen, max_running=2)
    for i in (0, 1, 2):
        engine.add_request(encoded[i], SamplingParams(max_new_tokens=LENGTHS[i]), "ssd", request_id=str(i))
    streamed: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        if steps == 3:
            engine.abort("1")          # mid-generation; request 2 waits for its slot
        for output in engine.step():
            streamed.setdefault(output.request_id, []).extend(output.new_tokens)
        assert engine.metrics.active_batch <= 2
        steps += 1
    aborted = engine.take_result("1")
    assert aborted.finish_reason == "abort" and 0 < len(aborted.tokens) < LENGTHS[1]
    assert aborted.tokens == reference[1][:len(aborted.tokens)]
    assert engine.take_result("0").tokens == reference[0]
    assert engine.take_result("2").tokens == reference[2]
    assert streamed["2"] == reference[2]
    engine.close()


def test_a_full_engine_queues_and_refuses_past_its_waiting_limit(gen, encoded, reference):
    engine = LLMEngine(gen, max_running=2, max_waiting=3)
    for i in range(3):
        engine.add_request(encoded[i], SamplingParams(max_new_tokens=LENGTHS[i]), "sd", request_id=str(i))
    with pytest.raises(CapacityError, match="3 requests are already waiting for one of 2 running slots"):
        engine.add_request(encoded[3], SamplingParams(max_new_tokens=4), "sd")
    most = 0
    while engine.has_unfinished():
        engine.step()
        most = max(most, engine.metrics.active_batch)
        assert engine.metrics.active_batch + engine.metrics.waiting <= 3
    assert most == 2
    assert [engine.take_result(str(i)).tokens for i in range(3)] == reference[:3]
    with pytest.raises(ValueError, match="max_running must be in 1.."):
        LLMEngine(gen, max_running=gen.limits.max_batch + 1)


def test_admission_is_bounded_by_the_kv_budget(gen, encoded):
    """With KV slots for two requests of (nearly) max context, a third waits although running slots are free;
    aborting one admits it. A request id in use is refused."""
    context = gen.limits.max_context
    engine = LLMEngine(gen, kv_budget_tokens=2 * context)
    long = SamplingParams(max_new_tokens=context - 100)      # prompt + this reserves nearly max context
    for i in range(3):
        engine.add_request(encoded[i], long, "ar", request_id=str(i))
    engine.step()
    assert (engine.metrics.active_batch, engine.metrics.waiting) == (2, 1)
    engine.abort("0")
    engine.step()
    assert (engine.metrics.active_batch, engine.metrics.waiting) == (2, 0)
    engine.abort("1")
    engine.abort("2")
    engine.step()
    assert [engine.take_result(str(i)).finish_reason for i in range(3)] == ["abort"] * 3
    engine.add_request(encoded[0], long, "ar", request_id="x")
    with pytest.raises(ValueError, match="request id 'x' is already in use"):
        engine.add_request(encoded[0], long, "ar", request_id="x")


# SSD's backup is set: "auto" picks prompt lookup at a larger live batch, and a different (still exact)
# proposal draws differently
SEEDED = [AR(), SD(draft_len=2), SD(tree_widths=(2, 2)), SSD(draft_len=1, fan_out_budget=4, backup="jit"),
          SSD(draft_len=2, fan_out_budget=6, backup="jit")]


@pytest.mark.parametrize("mode", SEEDED, ids=["ar", "sd", "sd-tree", "ssd-k1", "ssd-k2"])
def test_a_seeded_sampled_request_gives_the_same_tokens_alone_or_batched(gen, encoded, mode):
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.95, seed=11)
    alone = LLMEngine(gen)
    alone.add_request(encoded[0], params, mode, request_id="x")
    run(alone, {})
    expected = alone.take_result("x").tokens
    batched = LLMEngine(gen)
    others = [(str(i), encoded[i], SamplingParams(max_new_tokens=LENGTHS[i], temperature=1.0, top_k=40, seed=i)
               if i % 2 else SamplingParams(max_new_tokens=LENGTHS[i]), m)
              for i, m in zip((1, 2, 3), (mode, "ssd", AR()))]
    run(batched, {0: others[:2], 2: [("x", encoded[0], params, mode)], 5: others[2:]})
    assert batched.take_result("x").tokens == expected


def test_stop_strings_and_stop_token_ids_end_a_request(gen, encoded, reference):
    decode = lambda ids: gen.tokenizer.decode(ids, skip_special_tokens=True)   # noqa: E731
    text = decode(reference[3])
    stop = text[len(decode(reference[3][:6])):][:4]        # four characters that start after token 6
    assert stop.strip() and text.index(stop) >= len(decode(reference[3][:5]))
    engine = LLMEngine(gen)
    engine.add_request(encoded[3], SamplingParams(max_new_tokens=LENGTHS[3], stop=[stop, "never seen"]), "ssd",
                       request_id="s")
    engine.add_request(encoded[3], SamplingParams(max_new_tokens=LENGTHS[3], stop_token_ids=[reference[3][4]]),
                       "sd", request_id="t")
    run(engine, {})
    by_string, by_token = engine.take_result("s"), engine.take_result("t")
    assert by_string.finish_reason == "stop" and by_string.text(decode) == text[:text.index(stop)]
    assert by_string.tokens == reference[3][:len(by_string.tokens)] and stop in decode(by_string.tokens)
    first = reference[3].index(reference[3][4])
    assert by_token.finish_reason == "stop" and by_token.tokens == reference[3][:first + 1]
    with pytest.raises(ValueError, match="stop strings must be non-empty strings"):
        SamplingParams(stop=[""])


def test_the_load_policy_times_only_the_batch_sizes_the_known_requests_can_reach(smollm2_build, encoded, reference):
    """A one-prompt ``generate`` times one-row steps, not every batch size up to the engine's 16 (~16 s of steps
    on 2 cores, all before its first token); a larger call times the sizes up to its own while the engines are
    idle; a batch that outgrows what was timed while rows are live runs as set, and exactly."""
    fresh = ssd_trt.load(smollm2_build)

    def rows_timed() -> set[int]:      # (calibrated, or observed in the rounds run)
        return {rows for (_, rows, _) in fresh.learned.costs.seconds}

    four = SamplingParams(max_new_tokens=4)
    [alone] = fresh.generate_ids([encoded[0]], four, mode="ssd")
    assert rows_timed() == {1} and alone.token_ids == reference[0][:4]
    fresh.generate_ids(encoded[:3], four, mode="ssd")
    assert {2, 4} <= rows_timed() and max(rows_timed()) == 4
    engine = LLMEngine(fresh)
    engine.add_request(encoded[0], SamplingParams(max_new_tokens=12), "ssd", request_id="first")
    engine.step()
    assert engine.metrics.last_choice["batch"] == 1 and engine.metrics.last_choice["chose"] != "as set"
    for i in range(1, 6):
        engine.add_request(encoded[i], four, "ssd", request_id=str(i))
    engine.step()
    assert engine.metrics.last_choice == {"batch": 6, "chose": "as set"} and not rows_timed() & {8, 16}
    while engine.has_unfinished():
        engine.step()
    assert engine.take_result("first").tokens == reference[0][:12]
    assert all(engine.take_result(str(i)).tokens == reference[i][:4] for i in range(1, 6))
    engine.close()
