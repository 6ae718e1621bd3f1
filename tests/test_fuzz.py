"""Property-based tests (hypothesis) of the verification math, tree masks, KV rollback/compaction and the
recipe parser. Examples are derandomized: a failure reproduces on every run.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.saguaro import tree_step_inputs
from ssd_trt.decoding.sampling import TokenDistribution, filter_logits, verify_chain, verify_tree_children
from ssd_trt.decoding.speculative_tree import tree_shape
from ssd_trt.engines.feeding import tree_mask_from_parents
from ssd_trt.engines.base import EngineSpec
from ssd_trt.engines.kv_cache import KVCache
from ssd_trt.errors import RecipeError
from ssd_trt.recipe import Recipe, load_recipe
from tests.sampling_reference import reference_probs, reference_saguaro

FAST = settings(derandomize=True, deadline=None, max_examples=60,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
MONTE_CARLO = settings(FAST, max_examples=12)
DRAWS = 3000


def tv_bound(p: np.ndarray, draws: int) -> float:
    """3x the expected TV of an exact sampler (see test_sampling_lossless) plus slack: derandomized runs
    make this a fixed check, and a biased rule (the planted bug below) lands far above it."""
    return float(1.5 * np.sum(np.sqrt(2 * p * (1 - p) / (np.pi * draws)))) + 0.01


def tv(counts: np.ndarray, p: np.ndarray) -> float:
    return float(0.5 * np.abs(counts / counts.sum() - p).sum())


logits = st.integers(2, 6).flatmap(lambda v: arrays(np.float64, v, elements=st.floats(-4, 4)))


@st.composite
def verification_cases(draw):
    """A random target/draft pair over V tokens at K+1 positions, random sampling knobs and (F, C)."""
    vocab = draw(st.integers(2, 6))
    draft_len = draw(st.integers(1, 3))
    table = st.floats(-4, 4)
    target = draw(arrays(np.float64, (draft_len + 1, vocab), elements=table))
    draft = draw(arrays(np.float64, (draft_len, vocab), elements=table))
    params = SamplingParams(temperature=draw(st.sampled_from([0.5, 1.0, 1.7])), top_k=draw(st.integers(0, vocab)),
                            top_p=draw(st.sampled_from([1.0, 0.9, 0.6])))
    fan_out, c = draw(st.integers(0, vocab)), draw(st.sampled_from([1.0, 0.5, 0.1]))
    return target, draft, params, fan_out, c, draw(st.integers(0, 2**16))


def emitted_tokens(target, draft, params, fan_out, c, seed, rule=verify_chain, draws=DRAWS):
    """Run the chain verification ``draws`` times; return the first emitted token, and the second one
    for the runs that accepted s_1 (then position 2 decides it)."""
    rng = np.random.default_rng(seed)
    q = filter_logits(draft, params).boosted(fan_out, c)          # sigma_{F,C}: what the draft draws from
    first, second = np.zeros(target.shape[1]), np.zeros(target.shape[1])
    for _ in range(draws):
        tokens = q.sample(rng)
        outcome = rule(tokens, q, target, params, rng)
        emitted = [int(t) for t in tokens[:outcome.accepted]] + [outcome.bonus]
        first[emitted[0]] += 1
        if outcome.accepted >= 1:
            second[emitted[1]] += 1
    return first, second


@MONTE_CARLO
@given(verification_cases())
def test_chain_verification_emits_the_target_distribution(case):
    target, draft, params, fan_out, c, seed = case
    first, second = emitted_tokens(target, draft, params, fan_out, c, seed)
    p = reference_probs(target, params)
    assert tv(first, p[0]) < tv_bound(p[0], DRAWS)
    if second.sum() >= 300:
        assert tv(second, p[1]) < tv_bound(p[1], int(second.sum()))


def test_the_verification_fuzz_sees_a_biased_rule():
    """The reference code's biased rule (greedy acceptance, bonus from p) fails the same check. Its
    first-token bias is q(a)(1 - p(a)) for a = argmax p: large for a flat target and a confident draft."""
    from tests.test_sampling_lossless import planted_reference_bug
    target, draft = np.array([[0.5, 0, 0, 0], [0, 0, 0, 0]]), np.array([[3.0, 0, 0, 0]])
    params = SamplingParams(temperature=1.0)
    first, _ = emitted_tokens(target, draft, params, 0, 1.0, 0, rule=planted_reference_bug)
    p = reference_probs(target, params)
    assert tv(first, p[0]) > tv_bound(p[0], DRAWS)


@MONTE_CARLO
@given(verification_cases(), st.integers(1, 4))
def test_multi_draft_tree_level_emits_the_target_distribution(case, children):
    """SpecInfer's rule: children i.i.d. from q, tried in order; the emitted token is ~ p."""
    target, draft, params, fan_out, c, seed = case
    rng = np.random.default_rng(seed)
    p = filter_logits(target[:1], params)[0]
    q = filter_logits(draft[:1], params).boosted(fan_out, c)[0]
    counts = np.zeros(target.shape[1])
    for _ in range(DRAWS):
        tokens = [int(q.sample(rng)) for _ in range(children)]
        chosen, bonus = verify_tree_children(tokens, q, p, None, rng)
        counts[tokens[chosen] if chosen is not None else bonus] += 1
    expected = reference_probs(target[0], params)
    assert tv(counts, expected) < tv_bound(expected, DRAWS)


@FAST
@given(st.integers(2, 8).flatmap(lambda v: st.tuples(
    arrays(np.float64, (4, v), elements=st.floats(-3, 3)), st.lists(st.integers(0, v - 1), min_size=3, max_size=3))))
def test_greedy_verification_accepts_exactly_the_argmax_prefix(case):
    target, draft_tokens = case
    choices = np.argmax(target, axis=-1)
    outcome = verify_chain(np.array(draft_tokens), None, target, SamplingParams(), np.random.default_rng(0))
    k = next((i for i, t in enumerate(draft_tokens) if t != choices[i]), len(draft_tokens))
    assert (outcome.accepted, outcome.bonus) == (k, int(choices[k]))


@FAST
@given(logits, st.sampled_from([0.3, 1.0, 2.0]), st.integers(0, 7), st.floats(0.05, 1.0), st.integers(0, 7),
       st.floats(0.01, 1.0))
def test_filtered_and_saguaro_probs_equal_the_plain_dense_reference(z, temperature, top_k, top_p, fan_out, c):
    """The sparse, batched filter computes exactly the plain dense math (tests/sampling_reference.py)."""
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    dist = filter_logits(np.stack([z, z[::-1]]), params)                  # two rows at once
    expected = reference_probs(np.stack([z, z[::-1]]), params)
    np.testing.assert_allclose(dist.dense(len(z)), expected, rtol=1e-12, atol=1e-15)
    p = expected[0]
    assert np.all(p >= 0) and abs(p.sum() - 1) < 1e-9
    assert p[np.abs(z - z.max()) < 1e-9].sum() > 0                  # a most likely token is always kept
    if 0 < top_k < len(z):
        assert (p > 0).sum() <= top_k + int(np.sum(z == np.sort(z)[-top_k])) - 1   # ties at the k-th value
    q = dist.boosted(fan_out, c)[0].dense(len(z))
    if len(set(p[p > 0])) == len(p[p > 0]):      # no ties among the top-F: the boosted set is well defined
        np.testing.assert_allclose(q, reference_saguaro(p, fan_out, c), rtol=1e-12, atol=1e-15)
    assert abs(q.sum() - 1) < 1e-9 and np.array_equal(q > 0, p > 0)      # C only rescales, never drops


@FAST
@given(st.integers(0, 2**16), st.sampled_from([0.5, 1.0]), st.sampled_from([0, 1, 3, 20]),
       st.sampled_from([1.0, 0.9, 0.5]))
def test_filtered_probs_of_a_reduced_head_equal_the_dense_reference(seed, temperature, top_k, top_p):
    """Rows that are -inf off a head subset (plus a different extra token per row, as the copy component
    adds) take the compressed path; the result is still exactly the dense reference."""
    rng = np.random.default_rng(seed)
    vocab, rows = 64, 3
    z = np.full((rows, vocab), -np.inf, dtype=np.float32)
    head = rng.choice(vocab, size=rng.integers(1, 24), replace=False)
    z[:, head] = rng.standard_normal((rows, len(head))).astype(np.float32) * 2
    z[np.arange(rows), rng.integers(0, vocab, rows)] = 1.0
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    dist = filter_logits(z, params)
    assert dist.ids is not None                                         # sparse: the support, not [V]
    np.testing.assert_allclose(dist.dense(vocab), reference_probs(z, params), rtol=1e-12, atol=1e-15)
    tokens = dist.sample(rng)
    assert np.all(reference_probs(z, params)[np.arange(rows), tokens] > 0)


# -- tree masks ----------------------------------------------------------------------------------
parent_lists = st.integers(1, 24).flatmap(
    lambda n: st.tuples(*[st.just(-1)] + [st.integers(0, i - 1) for i in range(1, n)]).map(list))


@FAST
@given(parent_lists)
def test_tree_mask_is_exactly_ancestor_or_self(parents):
    mask = tree_mask_from_parents(parents)
    for node in range(len(parents)):
        chain, at = {node}, parents[node]
        while at >= 0:
            chain.add(at)
            at = parents[at]
        assert set(np.flatnonzero(mask[node])) == chain
    assert not np.triu(mask, 1).any()                        # parents precede children: lower triangular


@FAST
@given(parent_lists)
def test_packed_tree_mask_round_trips(parents):
    import torch

    from ssd_trt_plugins.tree_attention.reference import pack_tree_mask, unpack_tree_mask
    mask = tree_mask_from_parents(parents)[None]
    unpacked = unpack_tree_mask(torch.from_numpy(pack_tree_mask(mask)), len(parents)).numpy()
    assert np.array_equal(unpacked, mask)


@FAST
@given(st.lists(st.integers(1, 3), min_size=1, max_size=4))
def test_tree_shape_gives_every_depth_d_node_widths_d_children(widths):
    parents, depths = tree_shape(widths)
    assert len(parents) == 1 + sum(int(np.prod(widths[:d + 1])) for d in range(len(widths)))
    for node, parent in enumerate(parents[1:], start=1):
        assert parent < node and depths[node] == depths[parent] + 1
    for node, depth in enumerate(depths):
        assert parents.count(node) == (widths[depth] if depth < len(widths) else 0)


@st.composite
def tree_steps(draw):
    batch, draft_len = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(0, 3), min_size=draft_len + 1, max_size=draft_len + 1).filter(sum))
    glue = [[draw(st.integers(0, 50)) for _ in range(draft_len + 1)] for _ in range(batch)]
    forks = [[(j, draw(st.integers(0, 50))) for j, fan in enumerate(shape) for _ in range(fan)]
             for _ in range(batch)]
    steps = draw(st.integers(1, draft_len))
    tokens = np.array(draw(st.lists(st.integers(0, 50), min_size=batch * len(forks[0]) * steps,
                                    max_size=batch * len(forks[0]) * steps))).reshape(batch, len(forks[0]), steps)
    base = np.array([draw(st.integers(0, 30)) for _ in range(batch)])
    return glue, forks, tokens, base


@FAST
@given(tree_steps())
def test_saguaro_tree_step_sees_prefix_glue_up_to_its_fork_and_its_own_branch(case):
    glue, forks, tokens, base = case
    ids, positions, mask = tree_step_inputs(glue, forks, tokens, base)
    glue_len, (batch, branches, steps) = len(glue[0]), tokens.shape
    for row in range(batch):
        assert ids[row, :glue_len].tolist() == glue[row]
        assert np.array_equal(mask[row, :glue_len, :glue_len], np.tril(np.ones((glue_len, glue_len), bool)))
        assert not mask[row, :glue_len, glue_len:].any()                 # glue never sees branches
        for n, (j, _) in enumerate(forks[row]):
            own = [glue_len + e * branches + n for e in range(steps)]
            for e, index in enumerate(own):
                assert ids[row, index] == tokens[row, n, e]
                assert positions[row, index] == base[row] + j + 1 + e
                expected = set(range(j + 1)) | set(own[:e + 1])
                assert set(np.flatnonzero(mask[row, index])) == expected


# -- KV cache rollback and compaction --------------------------------------------------------------
SPEC = EngineSpec(name="fuzz", vocab_size=16, num_layers=2, num_kv_heads=1, head_dim=2, max_batch=4, max_context=300)

operations = st.lists(st.one_of(
    st.tuples(st.just("append"), st.integers(1, 40)),
    st.tuples(st.just("rollback"), st.lists(st.floats(0, 1), min_size=4, max_size=4)),
    st.tuples(st.just("keep"), st.integers(0, 3), st.floats(0, 1), parent_lists, st.floats(0, 1)),
), min_size=1, max_size=25)


@FAST
@given(st.integers(1, 4), operations)
def test_kv_cache_rollback_and_keep_match_a_list_model(batch, ops):
    """Random appends, rollbacks and tree-path compactions against per-row Python lists."""
    cache, model, counter = KVCache(SPEC, batch), [[] for _ in range(batch)], [0]

    def append(num_new: int) -> None:       # what a forward does to the cache: T new entries per row
        if int(cache.lengths.max()) + num_new > SPEC.max_context:
            return
        cache.reserve(num_new)
        for row in range(batch):
            values = counter[0] + np.arange(num_new)
            counter[0] += num_new
            for buffer in cache.buffers:
                buffer[row, :, cache.lengths[row]:cache.lengths[row] + num_new, :] = values[None, :, None]
            model[row] += values.tolist()
        cache.lengths += num_new

    for op in ops:
        if op[0] == "append":
            append(op[1])
        elif op[0] == "rollback":
            target = np.array([int(f * len(model[r])) for r, f in zip(range(batch), op[1])])
            cache.rollback(target)
            model = [m[:t] for m, t in zip(model, target)]
        else:
            _, row, where, parents, leaf = op
            row %= batch
            append(len(parents))                                    # a tree step of len(parents) nodes
            if len(model[row]) < len(parents):
                continue
            start = len(model[row]) - len(parents)
            path, node = [], int(leaf * (len(parents) - 1))           # a random root-to-node path
            while node >= 0:
                path.insert(0, node)
                node = parents[node]
            cache.keep(row, start, path)
            model[row] = model[row][:start] + [model[row][start + i] for i in path]
        assert cache.lengths.tolist() == [len(m) for m in model]
        assert cache.capacity <= SPEC.max_context
        for row in range(batch):
            for buffer in cache.buffers:
                assert buffer[row, 0, :len(model[row]), 0].tolist() == model[row]


@FAST
@given(st.integers(1, 3), st.data())
def test_kv_cache_refuses_impossible_rollback_and_keep_unchanged(batch, data):
    cache = KVCache(SPEC, batch)
    cache.lengths[:] = data.draw(st.lists(st.integers(0, 50), min_size=batch, max_size=batch))
    before = cache.lengths.copy()
    row = data.draw(st.integers(0, batch - 1))
    bad = before.copy()
    bad[row] += data.draw(st.integers(1, 5))
    with pytest.raises(ValueError):
        cache.rollback(bad)
    with pytest.raises(ValueError):
        cache.keep(row, int(before[row]), [0])                     # a slot past the row's length
    assert np.array_equal(cache.lengths, before)


@pytest.fixture(scope="module")
def ort_engine(tiny_pairs):
    import ssd_trt
    return ssd_trt.load(tiny_pairs["self"]).engine("target")


@settings(FAST, max_examples=15)
@given(parent_lists.filter(lambda p: len(p) <= 10), st.floats(0, 1), st.integers(0, 2**16))
def test_real_engine_tree_step_then_keep_equals_feeding_the_path(ort_engine, parents, leaf, seed):
    """ONNX Runtime engine: a random tree, a random accepted path, keep; then the next token's logits
    equal those of feeding prefix + path directly."""
    engine = ort_engine
    rng = np.random.default_rng(seed)
    prefix, tokens = rng.integers(3, 256, 4), rng.integers(3, 256, len(parents))
    depth = [0] * len(parents)
    for node in range(1, len(parents)):
        depth[node] = depth[parents[node]] + 1
    path, node = [], int(leaf * (len(parents) - 1))
    while node >= 0:
        path.insert(0, node)
        node = parents[node]
    engine.reset(1)
    engine.forward(prefix[None], np.arange(4)[None])
    engine.forward(tokens[None], (4 + np.array(depth))[None], tree_mask_from_parents(parents)[None])
    engine.keep(0, 4, path)
    after = engine.forward(np.array([[7]]), np.array([[4 + len(path)]]))
    engine.reset(1)
    direct = engine.forward(np.concatenate([prefix, tokens[path], [7]])[None], np.arange(5 + len(path))[None])
    assert np.abs(after[0, -1] - direct[0, -1]).max() < 1e-4


# -- the recipe parser never crashes -----------------------------------------------------------------
def parse(text: str | bytes):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "recipe.yaml"
        path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
        try:
            return load_recipe(path)
        except RecipeError as error:
            assert str(error).strip()
            return error


yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8) | st.integers(),
                                                                      children, max_size=4),
    max_leaves=12)
VALID = {"name": "fuzz", "target": {"source": "a"}, "draft": {"source": "b"},
         "engine": {"backend": "ort", "max_batch": 2}}


@settings(FAST, max_examples=150)
@given(st.text(max_size=200))
def test_random_text_never_crashes_the_recipe_parser(text):
    assert isinstance(parse(text), (Recipe, RecipeError))


@settings(FAST, max_examples=80)
@given(st.binary(max_size=200))
def test_random_bytes_never_crash_the_recipe_parser(data):
    assert isinstance(parse(data), (Recipe, RecipeError))


@settings(FAST, max_examples=150)
@given(yaml_values)
def test_random_yaml_documents_never_crash_the_recipe_parser(value):
    assert isinstance(parse(yaml.safe_dump(value)), (Recipe, RecipeError))


@settings(FAST, max_examples=200)
@given(st.sampled_from([("name",), ("target",), ("target", "source"), ("draft", "dtype"), ("engine",),
                        ("engine", "max_batch"), ("engine", "backend"), ("engine", "max_context"),
                        ("output_dir",), ("validate_shapes",), ("extra",), ("engine", "extra")]), yaml_values)
def test_a_valid_recipe_with_one_random_field_never_crashes_the_parser(where, value):
    import copy
    data = copy.deepcopy(VALID)
    node = data
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    result = parse(yaml.safe_dump(data))
    assert isinstance(result, (Recipe, RecipeError))
    if isinstance(result, RecipeError):
        assert "recipe" in str(result) and "Traceback" not in str(result)


HOSTILE = {"self-referencing alias": "a: &a [*a]", "python tag": "!!python/object/apply:os.system ['true']",
           "NUL byte": "\x00", "lone surrogate": "key: \ud800", "duplicate keys": "a: 1\na: 2\n",
           "huge scalar": "name: " + "x" * 100000, "two documents": "--- 1\n--- 2\n",
           "billion laughs": "a: &a [x, x]\nb: &b [*a, *a]\nc: &c [*b, *b]\nd: [*c, *c]\n"}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_yaml_is_one_recipe_error(case):
    assert isinstance(parse(HOSTILE[case]), (Recipe, RecipeError))


def test_deeply_nested_yaml_is_one_recipe_error():
    assert isinstance(parse("[" * 5000), (Recipe, RecipeError))
