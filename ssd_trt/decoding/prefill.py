"""The prompts of requests that just joined the rows, fed to the target between rounds, and their first tokens."""
from __future__ import annotations

import numpy as np

from ssd_trt.decoding.feature_relay import target_features
from ssd_trt.decoding.logprobs import token_logprobs
from ssd_trt.decoding.penalties import adjusts
from ssd_trt.decoding.round import target_choice_logits
from ssd_trt.decoding.sampling import draw_rows
from ssd_trt.decoding.sequence import SequenceState
from ssd_trt.engines.base import Engine
from ssd_trt.engines.feeding import feed_rows

PADDING_WASTE = 0.15     # adjacent prompts share a forward while right-padding them to the longest wastes less


def prefill(target: Engine, rows: list[SequenceState], spin: bool) -> list[tuple[SequenceState, list[int]]]:
    """Feed the prompts of the ``rows`` (the target's, in order) not yet prefilled, on their own rows, and commit
    each one's first token, drawn by its own parameters and stream: what each committed. Runs while the draft is idle
    (``Engine.alone``: on the draft's cores too; ``spin``: the round that follows gives the draft no work)."""
    index = {id(s): i for i, s in enumerate(rows)}
    runs: list[list[SequenceState]] = []
    for seq in (s for s in rows if s.unfed is None and not s.tokens):
        run = runs[-1] if runs else []
        longest = max([len(s.prompt) for s in run + [seq]])
        # (a prefill costs the same per token at any batch on a CPU: padding is pure loss); a request that asks for
        # its prompt's logprobs is fed alone, paying the head at every prompt position
        if run and index[id(run[-1])] + 1 == index[id(seq)] and not _scores_prompt(run[-1]) and \
                not _scores_prompt(seq) and \
                longest * (len(run) + 1) <= (1 + PADDING_WASTE) * sum(len(s.prompt) for s in run + [seq]):
            run.append(seq)
        else:
            runs.append([seq])
    committed = []
    for run in runs:
        first = index[id(run[0])]
        scored = _scores_prompt(run[0])
        with target.alone(spin):
            every = feed_rows(target.rows(first, first + len(run)), [s.prompt for s in run],
                              tail=len(run[0].prompt) if scored else 1)
        logits = every[:, -1]
        for r, seq in enumerate(run):
            if seq.features is not None:
                seq.features.append(0, target_features(target)[r, :len(seq.prompt)])
        if scored:          # prompt token j (j >= 1) was predicted at position j - 1
            seq = run[0]
            seq.prompt_logprobs = token_logprobs(every[0, :-1], seq.prompt[1:], seq.params.prompt_logprobs)
        chosen = logits
        if any(adjusts(s.params) or s.grammar is not None for s in run):
            # (the first token follows no output: masked at the grammar's start, adjusted with no history)
            chosen = np.stack([target_choice_logits(s, None, logits[r][None])[0] for r, s in enumerate(run)])
        tokens, _ = draw_rows(chosen, [s.params for s in run], [s.rng for s in run])
        for r, (seq, token) in enumerate(zip(run, tokens)):
            logprobs = None if seq.params.logprobs is None else \
                token_logprobs(logits[r:r + 1], [int(token)], seq.params.logprobs)
            committed.append((seq, seq.commit([int(token)], logprobs)))
    return committed


def _scores_prompt(seq: SequenceState) -> bool:
    return seq.params.prompt_logprobs is not None and len(seq.prompt) > 1
