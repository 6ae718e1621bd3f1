"""Load a build directory and generate: the public runtime API.

    gen = ssd_trt.load("build/smollm2-135m")
    [result] = gen.generate(["Hello"], SamplingParams(max_new_tokens=32), mode=SSD(draft_len=2))

The Generator loads (manifest, tokenizer, engines on first use), encodes, validates and dispatches to a
decoding mode (``decoding/modes.py``); what each mode does lives in its own module. A request's decoding
settings (``decoding/settings.py``: AR, SD, SSD, or a mode's name) come with each call; where the models run
(``RuntimeOptions``) is fixed at load.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ssd_trt.decoding.batch import Sequences, TokenCallback
from ssd_trt.decoding.mode import ResolvedMode
from ssd_trt.decoding.modes import strategy_for
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.decoding.settings import DEFAULT_MODE, MODES, Settings
from ssd_trt.engines.affinity import pinned
from ssd_trt.engines.factory import EngineSet
from ssd_trt.errors import ArtifactError, Cancelled, EngineError, SsdTrtError
from ssd_trt.manifest import ROLES, read_manifest, verify_artifacts
from ssd_trt.options import BACKENDS, RuntimeOptions
from ssd_trt.requests import check_request, encode_prompt

__all__ = ["BACKENDS", "DEFAULT_MODE", "MODES", "GenerationResult", "Generator", "RuntimeOptions", "load"]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    stats: dict[str, Any]


class Generator:
    def __init__(self, artifact_dir: str | Path, options: RuntimeOptions | None = None,
                 verify_checksums: bool = True) -> None:
        self.root = Path(artifact_dir)
        self.manifest = read_manifest(self.root)
        if verify_checksums:
            verify_artifacts(self.root, self.manifest, roles=ROLES)
        self.limits = self.manifest.recipe.engine
        threads = self.limits.threads_per_engine
        self.options = options or RuntimeOptions(target_threads=threads, draft_threads=threads)
        from transformers import AutoTokenizer
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.root / "tokenizer")
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"tokenizer in {self.root / 'tokenizer'} cannot be loaded ({exc}); rebuild") from None
        self.engines = EngineSet(self.root, self.manifest, {role: self.options.placement(role) for role in ROLES},
                                 self.options.backend, self.options.draft_copy)
        eos = self.manifest.model("target").config.eos_token_id
        self.eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])

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
        strategy, settings = strategy_for(mode)
        return strategy.resolve(settings, self.decoding_defaults(params))

    def encode(self, prompt: str | bytes, chat: bool = False) -> list[int]:
        """Token ids of one prompt: text, or UTF-8 bytes. Invalid UTF-8 is refused, never guessed at."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def check_request(self, prompt_ids: list[list[int]], params: SamplingParams, mode: "str | Settings"
                      ) -> tuple[list[list[int]], ResolvedMode]:
        """Refuse a request the engines could not run (RequestError); the prompts as int lists, and the mode
        resolved."""
        # (bad params are refused by check_request, with the request's other checks)
        resolved = self.resolve(mode, params if isinstance(params, SamplingParams) else None)
        vocab = self.manifest.model("target").config.vocab_size
        return check_request(self.limits, vocab, prompt_ids, params, resolved), resolved

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
        """Generate from token ids. Every request, however it ends, leaves no KV slot held.

        Cancellation: an ``on_tokens`` that raises :class:`Cancelled` stops the whole request; the result
        holds every token the callback was shown, with ``stats["cancelled"] = True``. An engine failure
        raises :class:`EngineError` naming the cause (the engines remain usable for the next request).
        """
        params = SamplingParams() if params is None else params
        prompt_ids, resolved = self.check_request(prompt_ids, params, mode)
        strategy, _ = strategy_for(resolved.settings)
        engines = {role: self.engines.get(role) for role in strategy.roles}   # opened before TTFT starts
        failures: list[BaseException] = []
        seqs = Sequences(params, self.eos_ids, len(prompt_ids), _guarded(on_tokens, failures) if on_tokens else None)
        stats: dict = {}
        try:
            with pinned(self.options.target_cores):
                stats = strategy.run(engines, prompt_ids, seqs, np.random.default_rng(params.seed), resolved,
                                     self.engines.placements)
        except Cancelled:
            stats = {"mode": resolved.name, "cancelled": True}
        except SsdTrtError:
            raise
        except Exception as exc:
            if failures and exc is failures[-1]:
                raise                      # the caller's own callback failed: its exception, unchanged
            raise EngineError(f"{resolved.name} generation failed: {type(exc).__name__}: {exc}; nothing was returned "
                              f"for this request, the engines are ready for the next one") from exc
        finally:
            self.engines.free_slots()
            if stats.get("draft_failures"):   # the failed draft may still be running (a hang): never reuse it
                self.engines.retire("draft")
        stats = {**seqs.timing_stats(), **stats}
        return [GenerationResult(self.tokenizer.decode(tokens, skip_special_tokens=True), tokens,
                                 {**stats, "row_tokens": len(tokens)}) for tokens in seqs.tokens]


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
