"""Load a build directory and generate: the public runtime API.

    gen = ssd_trt.load("build/smollm2-135m")
    [result] = gen.generate(["Hello"], SamplingParams(max_new_tokens=32), mode=SSD(draft_len=2))

The Generator loads (manifest, tokenizer, engines on first use), encodes, resolves and checks each request once
(``decoding/settings.py``: AR, SD, SSD, or a mode's name; ``requests.py``: the engine limits) and runs the engine
step over it (``batching/engine.py``): ``generate`` is a loop over steps. Where the models run (``RuntimeOptions``)
is fixed at load, filled from the build where left unset.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ssd_trt.batching.engine import LLMEngine
from ssd_trt.batching.policy import Learned
from ssd_trt.decoding.grammar import Grammars
from ssd_trt.decoding.logprobs import TokenLogprob
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.saguaro import overlap_summary
from ssd_trt.decoding.settings import DEFAULT_MODE, MODES, ResolvedMode, Settings, resolve
from ssd_trt.decoding.stats import RoundStats
from ssd_trt.engines.affinity import pinned
from ssd_trt.engines.factory import EngineSet
from ssd_trt.errors import ArtifactError, Cancelled, EngineError, RequestError, SsdTrtError
from ssd_trt.manifest import ROLES, read_manifest, verify_artifacts
from ssd_trt.options import BACKENDS, RuntimeOptions
from ssd_trt.requests import check_prompts, encode_prompt

TokenCallback = Callable[[int, list[int]], None]   # (row, newly committed token ids)

__all__ = ["BACKENDS", "DEFAULT_MODE", "MODES", "GenerationResult", "Generator", "RuntimeOptions", "load"]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: dict[str, Any]
    logprobs: list[TokenLogprob] | None = None          # of token_ids, when params.logprobs is set
    prompt_logprobs: list[TokenLogprob] | None = None   # of the prompt's tokens but the first, when asked for


class Generator:
    def __init__(self, artifact_dir: str | Path, options: RuntimeOptions | None = None,
                 verify_checksums: bool = True) -> None:
        self.root = Path(artifact_dir)
        self.manifest = read_manifest(self.root)
        if verify_checksums:
            verify_artifacts(self.root, self.manifest, roles=ROLES)
        self.limits = self.manifest.recipe.engine
        self.options = (options or RuntimeOptions()).for_build(self.limits.threads_per_engine)
        from transformers import AutoTokenizer
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.root / "tokenizer")
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"tokenizer in {self.root / 'tokenizer'} cannot be loaded ({exc}); rebuild") from None
        self.engines = EngineSet(self.root, self.manifest, {role: self.options.placement(role) for role in ROLES},
                                 self.options.backend, self.options.draft_copy, self.options.rank_timeout_s,
                                 self.options.cpu_kernel)
        self.vocab_size = self.manifest.model("target").config.vocab_size
        eos = self.manifest.model("target").config.eos_token_id
        self.eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_ids)   # structured output
        # what the engine step's SSD load policy learns, kept across requests (each generate() runs its own step
        # loop): step times, measured once; per adaptive settings family, the measured slowdowns and yields
        self.learned = Learned()

    def engine(self, role: str):
        return self.engines.get(role)

    def decoding_defaults(self, params: SamplingParams | None = None):
        """K and the fan-out budget a request gets unless the options set them: the build's tuned winners for
        the request's regime (greedy or sampled; ``python -m ssd_trt.tune``), else the recipe's."""
        tuned = self.manifest.tuned_decoding
        if tuned is None:
            return self.manifest.recipe.decoding
        return tuned.for_params(params is None or params.greedy)

    def resolve(self, mode: "str | Settings" = DEFAULT_MODE, params: SamplingParams | None = None) -> ResolvedMode:
        """What ``mode`` (a name, or an AR / SD / SSD settings object) will do for a request with ``params``
        (greedy when None): its unset K and fan-out budget from the build's defaults for that regime."""
        return resolve(mode, self.decoding_defaults(params))

    def encode(self, prompt: str | bytes, chat: bool = False) -> list[int]:
        """Token ids of one prompt: text, or UTF-8 bytes. Invalid UTF-8 is refused, never guessed at."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def check_prompts(self, prompt_ids: list[list[int]], params: SamplingParams, resolved: ResolvedMode
                      ) -> list[list[int]]:
        """Refuse prompts the engines could not run in this mode (RequestError); the prompts as int lists."""
        if params.grammar is not None:
            self.grammars.check(params.grammar)
        return check_prompts(self.limits, self.vocab_size, prompt_ids, params, resolved.settings)

    def check_request(self, prompt_ids: list[list[int]], params: SamplingParams, mode: "str | Settings"
                      ) -> tuple[list[list[int]], ResolvedMode]:
        """Refuse a request the engines could not run (RequestError); the prompts as int lists, and the mode
        resolved (once: hand it on as it is)."""
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        resolved = self.resolve(mode, params)
        if getattr(resolved.settings, "tree_widths", None) and not self.engine("target").exact_trees:
            raise RequestError(
                "SD token trees (tree_widths) are refused on this engine: the target runs ONNX Runtime's MatMulNBits "
                "with int8 activations, whose results for two identical rows of one step can differ, so a tree could "
                "leave autoregressive decoding's output. Use a chain (no tree_widths), or the CPU kernel engine "
                "(RuntimeOptions(cpu_kernel=True), the default where the build has CPU tiles), or an fp32 build")
        return self.check_prompts(prompt_ids, params, resolved), resolved

    def generate(self, prompts: str | bytes | Sequence[str | bytes], params: SamplingParams | None = None,
                 mode: "str | Settings" = DEFAULT_MODE, chat: bool = False,
                 on_tokens: TokenCallback | None = None) -> list[GenerationResult]:
        """Generate for a batch of prompts. ``on_tokens(row, new_ids)`` streams committed tokens; it may
        raise :class:`ssd_trt.errors.Cancelled` to stop the request (see :meth:`generate_ids`)."""
        prompts = [prompts] if isinstance(prompts, (str, bytes, bytearray)) else list(prompts)
        return self.generate_ids([self.encode(p, chat) for p in prompts], params, mode, on_tokens)

    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams | None = None,
                     mode: "str | Settings" = DEFAULT_MODE,
                     on_tokens: TokenCallback | None = None) -> list[GenerationResult]:
        """Generate from token ids: a loop over the engine step (``batching/engine.py``) with every prompt added at
        once; each prompt is its own request (its own random stream from ``params.seed``). Every request, however
        it ends, leaves no KV slot held.

        Cancellation: an ``on_tokens`` that raises :class:`Cancelled` stops the whole request; the result
        holds every token the callback was shown, with ``stats["cancelled"] = True``. An engine failure
        raises :class:`EngineError` naming the cause (the engines remain usable for the next request).
        """
        params = SamplingParams() if params is None else params
        prompt_ids, resolved = self.check_request(prompt_ids, params, mode)
        llm = LLMEngine(self)
        failures: list[BaseException] = []
        callback = _guarded(on_tokens, failures) if on_tokens else None
        cancelled = False
        started = time.perf_counter()
        try:
            with pinned(self.options.step_cores):
                ids = [llm.add_request(p, params, resolved, stream=row) for row, p in enumerate(prompt_ids)]
                row_of = {request_id: row for row, request_id in enumerate(ids)}
                shown = [0] * len(ids)          # tokens the callback has seen, per row
                try:
                    while llm.has_unfinished():
                        for output in llm.step():
                            if callback and output.new_tokens:
                                shown[row_of[output.request_id]] += len(output.new_tokens)
                                callback(row_of[output.request_id], output.new_tokens)
                except Cancelled:
                    cancelled = True
                    for request_id in ids:
                        llm.abort(request_id)
                    llm.step()
        except SsdTrtError:
            raise
        except Exception as exc:
            failure = _engine_failure(exc, failures, resolved.name)
            if failure is exc:
                raise
            raise failure from exc
        finally:
            llm.close()
            self.engines.free_slots()
        seqs = [llm.take_result(request_id) for request_id in ids]
        if cancelled:                            # the result holds what the callback was shown
            for seq, count in zip(seqs, shown):
                seq.tokens, seq.text_end = seq.tokens[:count], None
        stats = batch_stats(seqs, resolved, llm, started)
        if cancelled:
            stats["cancelled"] = True
        return [GenerationResult(seq.text(lambda t: self.tokenizer.decode(t, skip_special_tokens=True)), seq.tokens,
                                 {**stats, "row_tokens": len(seq.tokens), "finish_reason": seq.finish_reason},
                                 seq.logprobs[:len(seq.tokens)] if params.logprobs is not None else None,
                                 seq.prompt_logprobs if params.prompt_logprobs is not None else None)
                for seq in seqs]


def batch_stats(seqs, resolved: ResolvedMode, llm: LLMEngine, started: float) -> dict:
    """One ``generate`` call's statistics: round totals over its requests, the engine step's timings, throughput, and
    for SSD the fan-out shapes it learned."""
    metrics = llm.metrics
    elapsed = time.perf_counter() - started
    total = sum(len(seq.tokens) for seq in seqs)
    firsts = [seq.first_token_at for seq in seqs if seq.first_token_at is not None]
    rounds = RoundStats.merged([seq.stats for seq in seqs], resolved.name, resolved.settings.checked_draft_len or 0)
    rounds.add_time(draft_s=metrics.draft_s, verify_s=metrics.verify_s, wait_s=metrics.wait_s)
    stats = rounds.summary() if resolved.name != "ar" else \
        {"mode": "ar", "target_forwards": None, "mean_accepted": None, "acceptance_rate": None, "cache_hit_rate": None,
         "draft_failures": []}
    if rounds.draft_failures:
        stats["fallback"] = "autoregressive (draft failed)"
    if resolved.name == "ssd":
        stats.update(overlap_summary(metrics.timeline))
        stats["timeline"] = metrics.timeline
        stats["policy"] = metrics.last_choice
        stats["fan_out"] = llm.fan_out(resolved.settings)
    return {"generated_tokens": total, "elapsed_s": elapsed, "tokens_per_s": total / elapsed if elapsed > 0 else None,
            "ttft_s": min(firsts) - started if firsts else None, **stats}


def _engine_failure(exc: Exception, failures: list[BaseException], mode: str) -> BaseException:
    """What a failed generation raises: the caller's own callback's exception, unchanged, or an EngineError
    naming the cause."""
    if failures and exc is failures[-1]:
        return exc
    return EngineError(f"{mode} generation failed: {type(exc).__name__}: {exc}; nothing was returned for this "
                       f"request, the engines are ready for the next one")


def _guarded(on_tokens: TokenCallback, failures: list[BaseException]) -> TokenCallback:
    """The caller's callback, remembering what it raised (so its own exception passes through unchanged)."""
    def guarded(row: int, tokens: list[int]) -> None:
        try:
            on_tokens(row, tokens)
        except BaseException as exc:
            failures.append(exc)
            raise
    return guarded


def load(artifact_dir: str | Path, options: RuntimeOptions | None = None) -> Generator:
    """Open a build directory (verifying checksums) and return a :class:`Generator`."""
    return Generator(artifact_dir, options)
