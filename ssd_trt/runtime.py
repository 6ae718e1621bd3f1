"""Load a build directory and generate: the public runtime API.

    gen = ssd_trt.load("build/smollm2-135m")
    [result] = gen.generate(["Hello"], SamplingParams(max_new_tokens=32), mode="ssd")
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ssd_trt.decoding.batch import Sequences, TokenCallback
from ssd_trt.decoding.params import SamplingParams
from ssd_trt.engines.base import EngineSpec
from ssd_trt.engines.copy_mixture import CopyMixture, CopyMixtureEngine
from ssd_trt.errors import ArtifactError, Cancelled, EngineError, RequestError, SsdTrtError
from ssd_trt.manifest import read_manifest, verify_artifacts
from ssd_trt.recipe import DecodingDefaults, ssd_tree_tokens

MODES = ("ar", "sd", "ssd")
# ort: ONNX Runtime on CPU; trt: the TensorRT engines; torch: the torch decoder with the Triton kernel on a
# GPU with CUDA graphs (no TensorRT needed; weights reloaded from the build's recorded sources; on a
# machine without a GPU it runs eagerly with the kernel in the Triton interpreter, which only tests want).
BACKENDS = ("ort", "trt", "torch")


@dataclass
class RuntimeOptions:
    """How engines are placed. Defaults: target on core 0, draft on core 1 (each one thread)."""
    target_threads: int = 1
    draft_threads: int = 1
    target_cores: tuple[int, ...] | None = (0,)
    draft_cores: tuple[int, ...] | None = (1,)
    draft_len: int | None = None            # K; None = the strategy's default
    tree_widths: tuple[int, ...] | None = None   # sd: verify a draft tree (children per depth)
    spin: bool | None = None                # ORT thread-pool spinning; None: off when the models share cores
    ssd: dict[str, Any] = field(default_factory=dict)   # SaguaroConfig overrides
    draft_copy: bool = True                 # use the draft's copy component when its config has one
    backend: str | None = None              # None: the build's (TensorRT when usable, else ONNX Runtime);
                                            # "ort"; "trt"; "torch": torch decoder + Triton kernel (see BACKENDS)

    def __post_init__(self) -> None:
        import os
        available = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        for name in ("target_cores", "draft_cores"):
            cores = getattr(self, name)
            if cores and available and not set(cores) <= available:
                setattr(self, name, None)   # fewer cores than asked: let the OS place the threads
        if self.draft_len is not None and (isinstance(self.draft_len, bool) or not isinstance(self.draft_len, int)
                                           or not 1 <= self.draft_len <= 32):
            raise RequestError(f"draft_len (K) must be an integer in 1..32, got {self.draft_len!r}")
        if self.tree_widths is not None and (not self.tree_widths or any(
                isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in self.tree_widths)):
            raise RequestError(f"tree_widths must be positive integers (children per depth), got {self.tree_widths!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise RequestError(f"backend must be one of {', '.join(BACKENDS)} (or None for the build's choice), "
                               f"got {self.backend!r}")
        self.saguaro_config()   # validate the SSD overrides once, here

    @property
    def spinning(self) -> bool:
        """Spin-waiting pays only when a session has its cores to itself."""
        if self.spin is not None:
            return self.spin
        shared = (self.target_cores is None or self.draft_cores is None
                  or bool(set(self.target_cores) & set(self.draft_cores)))
        return not (shared and max(self.target_threads, self.draft_threads) > 1)

    def saguaro_config(self, defaults: DecodingDefaults | None = None):
        """The SSD settings of a request: these options over the build's decoding defaults."""
        from ssd_trt.decoding.saguaro import SaguaroConfig
        defaults = defaults or DecodingDefaults()
        draft_len = self.draft_len or defaults.ssd_draft_len
        # the budget must cover K+1 guesses: grow the default with a K the caller chose
        budget = max(defaults.ssd_fan_out_budget, draft_len + 1)
        try:
            return SaguaroConfig(**{"draft_len": draft_len, "draft_cores": self.draft_cores,
                                    "fan_out_budget": budget, **self.ssd})
        except TypeError:
            known = ", ".join(f.name for f in fields(SaguaroConfig))
            raise RequestError(f"unknown SSD option in {sorted(self.ssd)}; known: {known}") from None


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
        self.limits = self.manifest["recipe"]["engine"]
        # builds from before decoding defaults existed get the generic ones
        try:
            self.defaults = DecodingDefaults(**self.manifest["recipe"].get("decoding", {}))
        except (TypeError, ValueError) as exc:   # pydantic's ValidationError is a ValueError
            raise ArtifactError(f"manifest in {self.root} has invalid decoding defaults ({exc}); rebuild") from None
        threads = int(self.limits.get("threads_per_engine", 1))
        self.options = options or RuntimeOptions(target_threads=threads, draft_threads=threads)
        from transformers import AutoTokenizer
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(self.root / "tokenizer")
        except (OSError, ValueError) as exc:
            raise ArtifactError(f"tokenizer in {self.root / 'tokenizer'} cannot be loaded ({exc}); rebuild") from None
        target_cfg, draft_cfg = (self.manifest["models"][r]["config"] for r in ("target", "draft"))
        if target_cfg["vocab_size"] != draft_cfg["vocab_size"]:
            raise ArtifactError(f"draft vocabulary ({draft_cfg['vocab_size']}) differs from the target's "
                                f"({target_cfg['vocab_size']}) in {self.root}; rebuild with a matching draft")
        self.copy_mixture = CopyMixture.from_config(self.manifest["models"]["draft"].get("hf_config") or {},
                                                    where=f"draft config in {self.root / 'manifest.json'}")
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
        """The options' backend if set; else 'trt' when the recipe allows it, an engine.plan exists and
        TensorRT + a GPU are usable; else 'ort'."""
        wanted = self.options.backend or self.limits.get("backend", "auto")
        if wanted == "torch":
            return "torch"
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
        if role not in self._engines:
            engine = self._open_engine(role)
            if role == "draft" and self.copy_mixture is not None and self.options.draft_copy:
                engine = CopyMixtureEngine(engine, self.copy_mixture)
            self._engines[role] = engine
        return self._engines[role]

    def _open_engine(self, role: str):
        backend = self.backend(role)
        if backend == "torch":
            return self._open_torch_engine(role)
        if backend == "trt":
            from ssd_trt.trt.engine import TensorRTEngine
            return TensorRTEngine(self.root / role / "engine.plan", self.spec(role), name=role,
                                  placement=self._gpu_placement(role))
        from ssd_trt.engines.ort import OrtEngine
        threads = self.options.target_threads if role == "target" else self.options.draft_threads
        cores = self.options.target_cores if role == "target" else self.options.draft_cores
        return OrtEngine(self.root / role / "model.ort.onnx", self.spec(role), threads, cores,
                         spin=self.options.spinning)

    def _open_torch_engine(self, role: str):
        """The role's model as a TorchDeviceEngine, reloaded from the source the build recorded."""
        import torch

        from ssd_trt.engines.device_step import Placement
        from ssd_trt.engines.torch_device import TorchDeviceEngine
        from ssd_trt.models.loading import load_decoder
        from ssd_trt.models.sources import resolve_source, source_fingerprint
        from ssd_trt.trt.profiles import ProfileLimits

        entry = self.manifest["models"][role]
        try:
            source = resolve_source(entry["source"])
        except SsdTrtError as exc:
            raise ArtifactError(f"the torch backend reloads the {role} weights from the source the build recorded, "
                                f"and it is not usable: {exc}; restore it or use the ort backend") from None
        if source_fingerprint(source) != entry.get("source_sha256"):
            raise ArtifactError(f"the {role} source {source.path} changed since {self.root} was built (sha256 "
                                "differs from the manifest); rebuild, or use the ort backend")
        model, _ = load_decoder(source)
        on_gpu = torch.cuda.is_available()
        limits = ProfileLimits(int(self.limits["max_batch"]), int(self.limits["max_context"]),
                               int(self.limits["max_draft_len"]), int(self.limits["max_tree_size"]))
        dtype = getattr(torch, self.manifest["recipe"][role].get("dtype") or "float32")
        return TorchDeviceEngine(model, limits, name=role, device="cuda" if on_gpu else "cpu", dtype=dtype,
                                 placement=self._gpu_placement(role) if on_gpu else Placement())

    @staticmethod
    def _gpu_placement(role: str):
        """The role's device and stream priority (``place_draft_and_target``: two GPUs, or two streams)."""
        import torch

        from ssd_trt.engines.device_step import place_draft_and_target
        draft_place, target_place = place_draft_and_target(torch.cuda.device_count())
        return target_place if role == "target" else draft_place

    # -- requests ------------------------------------------------------------------------------
    def encode(self, prompt: str | bytes, chat: bool = False) -> list[int]:
        """Token ids of one prompt: text, or UTF-8 bytes. Invalid UTF-8 is refused, never guessed at."""
        if isinstance(prompt, (bytes, bytearray)):
            try:
                prompt = bytes(prompt).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RequestError(f"prompt is not valid UTF-8 (byte {exc.start}: {exc.reason}); send UTF-8 "
                                   f"text") from None
        if not isinstance(prompt, str):
            raise RequestError(f"prompt must be a string, got {type(prompt).__name__}")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:   # lone surrogates: undecodable bytes smuggled in (argv, JSON)
            raise RequestError(f"prompt is not valid UTF-8 (undecodable character at {exc.start}); send "
                               f"UTF-8 text") from None
        if not prompt.strip():
            raise RequestError("prompt is empty; give at least one non-whitespace character")
        if chat:
            if not getattr(self.tokenizer, "chat_template", None):
                raise RequestError("this model's tokenizer has no chat template; drop --chat / chat=True")
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

    def generate(self, prompts: str | bytes | Sequence[str | bytes], params: SamplingParams | None = None,
                 mode: str = "ar", chat: bool = False,
                 on_tokens: TokenCallback | None = None) -> list[GenerationResult]:
        """Generate for a batch of prompts. ``on_tokens(row, new_ids)`` streams committed tokens; it may
        raise :class:`ssd_trt.errors.Cancelled` to stop the request (see :meth:`generate_ids`)."""
        prompts = [prompts] if isinstance(prompts, (str, bytes, bytearray)) else list(prompts)
        ids = [self.encode(p, chat) for p in prompts]
        return self.generate_ids(ids, params, mode, on_tokens)

    def generate_ids(self, prompt_ids: list[list[int]], params: SamplingParams | None = None, mode: str = "ar",
                     on_tokens: TokenCallback | None = None) -> list[GenerationResult]:
        """Generate from token ids. Every request, however it ends, leaves no KV slot held.

        Cancellation: an ``on_tokens`` that raises :class:`Cancelled` stops the whole request; the result
        holds every token the callback was shown, with ``stats["cancelled"] = True``. An engine failure
        raises :class:`EngineError` naming the cause (the engines remain usable for the next request).
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        if mode not in MODES:
            raise RequestError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        if not prompt_ids:
            raise RequestError("no prompts given")
        if len(prompt_ids) > self.limits["max_batch"]:
            raise RequestError(f"{len(prompt_ids)} prompts exceed the engine's max batch "
                               f"{self.limits['max_batch']}; send at most that many at once")
        vocab = self.manifest["models"]["target"]["config"]["vocab_size"]
        for row, ids in enumerate(prompt_ids):
            if not ids:
                raise RequestError("a prompt encodes to zero tokens")
            if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and 0 <= t < vocab
                       for t in ids):
                raise RequestError(f"prompt {row} holds token ids outside 0..{vocab - 1} (or not integers); "
                                   f"encode prompts with this build's tokenizer")
            headroom = self.speculation_headroom(mode)
            if len(ids) + params.max_new_tokens + headroom > self.limits["max_context"]:
                extra = f" + {headroom} slots for {mode} speculation" if headroom else ""
                raise RequestError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}){extra} "
                                   f"exceeds the engine's max context {self.limits['max_context']}; lower "
                                   f"max_new_tokens or shorten the prompt")
        if mode != "ar" and self.draft_len(mode) > self.limits["max_draft_len"]:
            raise RequestError(f"draft_len {self.draft_len(mode)} exceeds the engine's max_draft_len "
                               f"{self.limits['max_draft_len']}; lower it or rebuild")
        if mode == "ssd" and (tree := self.speculation_headroom(mode)) > self.limits["max_tree_size"]:
            config = self.saguaro_config()
            raise RequestError(f"an SSD tree step with K={config.draft_len} and fan-out budget "
                               f"{config.fan_out_budget} feeds {tree} tokens, more than the engine's "
                               f"max_tree_size {self.limits['max_tree_size']}; lower the budget or K, or "
                               f"raise engine.max_tree_size and rebuild")
        prompt_ids = [[int(t) for t in ids] for ids in prompt_ids]
        rng = np.random.default_rng(params.seed)
        callback_failures: list[BaseException] = []

        def guarded(row: int, tokens: list[int]) -> None:
            try:
                on_tokens(row, tokens)
            except BaseException as exc:
                callback_failures.append(exc)
                raise

        for role in ("target",) if mode == "ar" else ("target", "draft"):
            self.engine(role)          # open sessions before the request's clock starts (TTFT)
        seqs = Sequences(params, self.eos_ids, len(prompt_ids), guarded if on_tokens else None)
        stats: dict = {}
        try:
            stats = self._run(mode, prompt_ids, seqs, rng)
        except Cancelled:
            stats = {"mode": mode, "cancelled": True}
        except SsdTrtError:
            raise
        except Exception as exc:
            if callback_failures and exc is callback_failures[-1]:
                raise                      # the caller's own callback failed: its exception, unchanged
            raise EngineError(f"{mode} generation failed: {type(exc).__name__}: {exc}; nothing was returned "
                              f"for this request, the engines are ready for the next one") from exc
        finally:
            self.free_slots()
            if stats.get("draft_failures"):
                # the failed draft may still be running (a hang): never reuse it; the next request
                # that needs a draft opens a fresh engine
                self._engines.pop("draft", None)
        stats = {**seqs.timing_stats(), **stats}
        return [GenerationResult(self.tokenizer.decode(tokens, skip_special_tokens=True), tokens,
                                 {**stats, "row_tokens": len(tokens)}) for tokens in seqs.tokens]

    def speculation_headroom(self, mode: str) -> int:
        """Cache slots a mode may write past the committed text: the K+1 verified tokens, and for SSD the
        draft's tree region (glue K+1 plus K steps of every branch)."""
        if mode == "ar":
            return 0
        if mode == "sd":
            widths = self.options.tree_widths
            nodes, level = 1, 1
            for width in widths or ():
                level *= width
                nodes += level
            return nodes if widths else self.draft_len(mode) + 1
        config = self.saguaro_config()
        return ssd_tree_tokens(config.draft_len, config.fan_out_budget)

    def draft_len(self, mode: str) -> int:
        """K of a request: the caller's, else the build's default for ``mode`` (for SSD: the K its
        SaguaroConfig resolves to, so every check sees the K that will run)."""
        if mode == "ssd":
            return self.saguaro_config().draft_len
        return self.options.draft_len or self.defaults.sd_draft_len

    def saguaro_config(self):
        return self.options.saguaro_config(self.defaults)

    def free_slots(self) -> None:
        """Give back every engine's KV slots (lengths -> 0); buffers stay allocated for the next request."""
        for engine in self._engines.values():
            try:
                lengths = engine.lengths
            except AttributeError:          # never reset: holds nothing
                continue
            engine.rollback(np.zeros_like(lengths))

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
                                        draft_len=self.draft_len("sd"),
                                        tree_widths=list(self.options.tree_widths or []) or None)
        from ssd_trt.decoding.saguaro import generate_saguaro
        return generate_saguaro(target, self.engine("draft"), prompt_ids, seqs, rng, self.saguaro_config())


def load(artifact_dir: str | Path, options: RuntimeOptions | None = None) -> Generator:
    """Open a build directory (verifying checksums) and return a :class:`Generator`."""
    return Generator(artifact_dir, options)
