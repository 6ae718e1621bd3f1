"""Load a build directory and generate: the public runtime API.

    gen = ssd_trt.load("build/smollm2-135m")
    [result] = gen.generate(["Hello"], SamplingParams(max_new_tokens=32), mode="ssd")
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ssd_trt.decoding.batch import Sequences, TokenCallback
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.engines.base import EngineSpec
from ssd_trt.errors import ArtifactError, RequestError
from ssd_trt.manifest import read_manifest, verify_artifacts

MODES = ("ar", "sd", "ssd")


@dataclass
class RuntimeOptions:
    """How engines are placed. Defaults: target on core 0, draft on core 1 (each one thread)."""
    target_threads: int = 1
    draft_threads: int = 1
    target_cores: tuple[int, ...] | None = (0,)
    draft_cores: tuple[int, ...] | None = (1,)
    draft_len: int | None = None            # K; None = the strategy's default
    ssd: dict[str, Any] = field(default_factory=dict)   # SaguaroConfig overrides

    def __post_init__(self) -> None:
        import os
        available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        for name in ("target_cores", "draft_cores"):
            cores = getattr(self, name)
            if cores and available and not set(cores) <= available:
                setattr(self, name, None)   # fewer cores than asked: let the OS place the threads


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
            verify_artifacts(self.root, self.manifest, roles=("target", "draft"))
        self.options = options or RuntimeOptions()
        self.limits = self.manifest["recipe"]["engine"]
        from transformers import AutoTokenizer
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.root / "tokenizer")
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"tokenizer in {self.root / 'tokenizer'} cannot be loaded ({exc}); rebuild") from None
        target_cfg, draft_cfg = (self.manifest["models"][r]["config"] for r in ("target", "draft"))
        if target_cfg["vocab_size"] != draft_cfg["vocab_size"]:
            raise ArtifactError(f"draft vocabulary ({draft_cfg['vocab_size']}) differs from the target's "
                                f"({target_cfg['vocab_size']}) in {self.root}; rebuild with a matching draft")
        eos = target_cfg.get("eos_token_id")
        self.eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self._engines: dict[str, Any] = {}
        self._tensorrt: tuple[bool, str] | None = None

    # -- engines -------------------------------------------------------------------------------
    def spec(self, role: str) -> EngineSpec:
        c = self.manifest["models"][role]["config"]
        return EngineSpec(name=role, vocab_size=c["vocab_size"], num_layers=c["num_layers"],
                          num_kv_heads=c["num_kv_heads"], head_dim=c["head_dim"],
                          max_batch=self.limits["max_batch"], max_context=self.limits["max_context"])

    def backend(self, role: str) -> str:
        """'trt' when the recipe allows it, an engine.plan exists and TensorRT + a GPU are usable."""
        wanted = self.limits.get("backend", "auto")
        if wanted == "ort" or not (self.root / role / "engine.plan").is_file():
            if wanted == "trt":
                raise ArtifactError(f"{self.root / role} has no TensorRT engine (engine.plan); build on a GPU "
                                    f"host with TensorRT, or set engine.backend to 'auto' or 'ort'")
            return "ort"
        if self._tensorrt is None:
            from ssd_trt.trt.availability import probe_tensorrt
            self._tensorrt = probe_tensorrt()          # (available, reason), probed in a subprocess
        if not self._tensorrt[0] and wanted == "trt":
            raise ArtifactError(f"recipe asks for TensorRT but it cannot run here: {self._tensorrt[1]}")
        return "trt" if self._tensorrt[0] else "ort"

    def engine(self, role: str):
        if role not in self._engines and self.backend(role) == "trt":
            import torch
            from ssd_trt.trt.engine import TensorRTEngine, place_draft_and_target
            draft_place, target_place = place_draft_and_target(torch.cuda.device_count())
            self._engines[role] = TensorRTEngine(self.root / role / "engine.plan", self.spec(role), name=role,
                                                 placement=target_place if role == "target" else draft_place)
        if role not in self._engines:
            from ssd_trt.engines.ort import OrtEngine
            threads = self.options.target_threads if role == "target" else self.options.draft_threads
            cores = self.options.target_cores if role == "target" else self.options.draft_cores
            self._engines[role] = OrtEngine(self.root / role / "model.ort.onnx", self.spec(role), threads, cores)
        return self._engines[role]

    # -- requests ------------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if not isinstance(prompt, str):
            raise RequestError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise RequestError("prompt is empty; give at least one non-whitespace character")
        if chat:
            ids = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                     add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            ids = self.tokenizer(prompt)["input_ids"]
        limit = self.limits["max_context"]
        if len(ids) >= limit:
            raise RequestError(f"prompt is {len(ids)} tokens; this engine's max context is {limit} "
                               f"(prompt + generated tokens). Shorten the prompt or rebuild with a larger "
                               f"engine.max_context")
        return list(ids)

    def generate(self, prompts: str | Sequence[str], params: SamplingParams | None = None, mode: str = "ar",
                 chat: bool = False, on_tokens: TokenCallback | None = None) -> list[GenerationResult]:
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        ids = [self.encode(p, chat) for p in prompts]
        return self.generate_ids(ids, params, mode, on_tokens)

    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams | None = None, mode: str = "ar",
                     on_tokens: TokenCallback | None = None) -> list[GenerationResult]:
        params = params or SamplingParams()
        if mode not in MODES:
            raise RequestError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if not prompt_ids:
            raise RequestError("no prompts given")
        if len(prompt_ids) > self.limits["max_batch"]:
            raise RequestError(f"{len(prompt_ids)} prompts exceed the engine's max batch "
                               f"{self.limits['max_batch']}; send at most that many at once")
        for ids in prompt_ids:
            if not ids:
                raise RequestError("a prompt encodes to zero tokens")
            if len(ids) + params.max_new_tokens > self.limits["max_context"]:
                raise RequestError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                                   f"exceeds the engine's max context {self.limits['max_context']}; lower "
                                   f"max_new_tokens or shorten the prompt")
        rng = np.random.default_rng(params.seed)
        seqs = Sequences(params, self.eos_ids, len(prompt_ids), on_tokens)
        stats = self._run(mode, prompt_ids, seqs, rng)
        stats = {**seqs.timing_stats(), **stats}
        return [GenerationResult(self.tokenizer.decode(tokens, skip_special_tokens=True), tokens,
                                 {**stats, "row_tokens": len(tokens)}) for tokens in seqs.tokens]

    def _run(self, mode: str, prompt_ids: list[list[int]], seqs: Sequences, rng: np.random.Generator) -> dict:
        from ssd_trt.engines.affinity import pinned
        with pinned(self.options.target_cores):
            return self._run_strategy(mode, prompt_ids, seqs, rng)

    def _run_strategy(self, mode: str, prompt_ids: list[list[int]], seqs: Sequences,
                      rng: np.random.Generator) -> dict:
        target = self.engine("target")
        if mode == "ar":
            from ssd_trt.decoding.autoregressive import generate_autoregressive
            return generate_autoregressive(target, prompt_ids, seqs, rng)
        if mode == "sd":
            from ssd_trt.decoding.speculative import generate_speculative
            return generate_speculative(target, self.engine("draft"), prompt_ids, seqs, rng,
                                        draft_len=self.options.draft_len or 4)
        from ssd_trt.decoding.saguaro import SaguaroConfig, generate_saguaro
        config = SaguaroConfig(**{"draft_len": self.options.draft_len or 4,
                                  "draft_cores": self.options.draft_cores, **self.options.ssd})
        return generate_saguaro(target, self.engine("draft"), prompt_ids, seqs, rng, config)


def load(artifact_dir: str | Path, options: RuntimeOptions | None = None) -> Generator:
    """Open a build directory (verifying checksums) and return a :class:`Generator`."""
    return Generator(artifact_dir, options)
