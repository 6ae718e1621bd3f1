"""Which bonus guesses SSD caches: prompt lookup and the two fork policies (fan_out.py, ngram.py)."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from ssd_trt.ngram import earlier_matches, lookup_followers, ngram_proposal
from ssd_trt.decoding.fan_out import LOOKUP_PRIOR, confident_forks, ranked_forks


def test_earlier_matches_are_most_recent_first_and_followed_by_a_token():
    context = np.array([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3])
    assert earlier_matches(context, 2).tolist() == [5, 1]          # [2, 3] at 5 and 1, not the suffix itself
    assert earlier_matches(context, 3).tolist() == []              # [5, 2, 3] never occurred before
    assert earlier_matches(np.array([4, 4]), 1).tolist() == [0]
    assert earlier_matches(np.array([4]), 1).tolist() == []


def test_lookup_followers_longest_match_first_then_recency_distinct_tokens():
    assert lookup_followers([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3]) == [(7, 2), (9, 2)]
    assert lookup_followers([8, 1, 2, 3, 6, 4, 3, 5, 1, 2, 3], limit=3) == [(6, 3), (5, 1)]
    assert lookup_followers([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], limit=1) == [(7, 2)]
    assert lookup_followers([5]) == [] and lookup_followers([1, 2, 1]) == [(2, 1)]


def reference_ngram_proposal(context: list[int], draft_len: int, max_ngram: int = 3) -> list[int]:
    """The backup's specification, written as the plain loop."""
    for size in range(min(max_ngram, len(context) - 1), 0, -1):
        for start in range(len(context) - size - 1, -1, -1):
            if context[start:start + size] == context[-size:]:
                follow = context[start + size:start + size + draft_len]
                return (follow + [follow[-1]] * draft_len)[:draft_len]
    return [context[-1]] * draft_len


def test_ngram_proposal_matches_its_specification_on_random_contexts():
    rng = random.Random(0)
    for _ in range(2000):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        k = rng.randrange(1, 5)
        assert ngram_proposal(context, k) == reference_ngram_proposal(context, k), (context, k)


def brute_force_scores(probs: np.ndarray, own: list[int], lookup) -> dict[tuple[int, int], float]:
    """P(k=j, t*=t) estimate for every (j, t), straight from the definition."""
    scores = {}
    for j, t in itertools.product(range(len(probs)), range(probs.shape[1])):
        if j < len(own) and t == own[j]:
            continue
        reach = float(np.prod([probs[i, own[i]] for i in range(j)]))
        q = probs[j, t]
        for token, size in lookup[j]:
            if token == t:
                q = max(q, LOOKUP_PRIOR[size])
        scores[(j, t)] = reach * q
    return scores


@pytest.mark.parametrize("seed", range(5))
def test_confident_forks_are_the_budget_most_likely_outcomes(seed):
    rng = np.random.default_rng(seed)
    K, vocab, budget = 3, 12, 9
    probs = rng.dirichlet(np.full(vocab, 0.3), size=K + 1)
    own = [int(np.argmax(p)) for p in probs[:K]]
    lookup = [[(int(rng.integers(vocab)), int(rng.integers(1, 4)))] for _ in range(K + 1)]
    forks = confident_forks(probs, own, budget, lookup)
    scores = brute_force_scores(probs, own, lookup)
    assert len(forks) == budget == len(set(forks))
    assert all(t != own[j] for j, t in forks if j < K)             # a rejected draft token is never t*
    chosen = sorted(scores[f] for f in forks)
    rest = [v for key, v in scores.items() if key not in forks]
    assert chosen[0] >= max(rest) - 1e-12                          # nothing left out scores higher


def test_confident_forks_follow_the_odds_of_reaching_a_position():
    vocab = 6
    sure = np.full(vocab, 0.01)
    sure[0] = 0.95
    shaky = np.full(vocab, 0.2)
    shaky[1] = 0.0
    # position 0: the draft is sure of token 0; position 1 is unlikely to be reached... then flip it
    confident = confident_forks(np.stack([sure / sure.sum(), shaky / shaky.sum()]), [0], 4, [[], []])
    assert sum(j == 1 for j, _ in confident) >= 3
    unsure = confident_forks(np.stack([shaky / shaky.sum(), sure / sure.sum()]), [1], 4, [[], []])
    assert sum(j == 0 for j, _ in unsure) >= 3


def test_a_lookup_candidate_beats_a_token_the_draft_finds_unlikely():
    probs = np.stack([np.array([0.6, 0.3, 0.06, 0.04, 0.0]), np.full(5, 0.2)])
    forks = confident_forks(probs, [0], 2, [[(4, 3)], []])
    assert (0, 4) in forks and (0, 1) in forks


def test_ranked_forks_keep_the_shape_and_put_lookup_first():
    logits = np.log(np.array([[0.5, 0.3, 0.1, 0.06, 0.04], [0.1, 0.2, 0.3, 0.25, 0.15]]))
    forks = ranked_forks(logits, [0], [2, 3], [[(4, 1), (0, 2)], []])
    assert forks == [(0, 4), (0, 1), (1, 2), (1, 3), (1, 1)]     # own token 0 skipped at j=0; j=K keeps all


def test_one_guess_a_row_drafts_its_branch_as_a_chain_not_as_a_re_fed_tree(tiny_pairs):
    """With a budget of one guess, the draft's steps after the glue decode feed one token a row (its cache keeps the
    glue up to the fork); with two, each tree step re-feeds glue and branches. Both stay token-identical to AR."""
    import ssd_trt
    gen = ssd_trt.load(tiny_pairs["perturbed"])
    draft = gen.engine("draft")
    fed: list[int] = []
    forward_rows = draft.forward_rows      # what the draft lane's row views step through (engines/ort.py)

    def recording(start, stop, input_ids, *args, **kwargs):
        fed.append(input_ids.shape[1])
        return forward_rows(start, stop, input_ids, *args, **kwargs)

    draft.forward_rows = recording
    params = ssd_trt.SamplingParams(max_new_tokens=24, stop_on_eos=False)
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    expected = [r.token_ids for r in gen.generate_ids(prompts, params, mode="ar")]
    total = {}
    for budget in (1, 2):
        fed.clear()
        mode = ssd_trt.SSD(draft_len=3, fan_out_budget=budget, backup="jit", lookup_forks=0)
        assert [r.token_ids for r in gen.generate_ids(prompts, params, mode=mode)] == expected, budget
        total[budget] = sum(fed)
    # a round at K=3: one guess feeds the glue (4) then 1 + 1 + 1 (a chain: 7 tokens); re-fed as a tree it would be
    # 4 + 5 + 6 + 7 = 22, and two guesses are 4 + 6 + 8 + 10 = 28
    assert total[1] < 0.5 * total[2], total
