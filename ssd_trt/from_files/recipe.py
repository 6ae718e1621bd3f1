"""The recipe ``ssd-trt serve TARGET --draft DRAFT`` builds: written from the files' metadata, the two flags that shape
a build, and this machine's defaults, then validated by the recipe's own schema (``ssd_trt/recipe.py``).

What it writes, and why:

* a GGUF keeps its own blocks (``weights: gguf``) multiplied with int8 activations, as llama.cpp does and as the
  real pair's recipe does (``recipes/qwen2.5-coder-1.5b.yaml``); that is also what the CPU kernel engine reads. A
  checkpoint folder is built from its float weights in fp32 (exact to transformers);
* the CPU build (``backend: ort``, ``tensorrt: none``): the files most CPU users hold, and a build that needs no GPU;
* the context: ``--max-model-len``, else the smaller of 2048 and what the models were made for;
* K: ``--num-speculative-tokens`` for both SD and SSD, else the real pair's tuned K = 2 with one bonus guess a
  round (docs/real_pair.md); ``engine.max_draft_len`` is at least K, so a request may still ask for up to 8;
* no draft given: the recipe format needs one, and the engine has no draft-free speculation, so the target drafts
  for itself (its own tokenizer, ``tokenizer: target``). Lossless as any draft; the default ``ssd`` mode measures
  such a draft's cost and runs AR rounds where those are faster (``batching/policy.py``).

Threads are not here: they are a runtime option (``--threads``), not part of what is built.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from ssd_trt.decoding.settings import ssd_tree_tokens
from ssd_trt.engines.limits import MAX_DRAFT_LEN
from ssd_trt.errors import ConfigError
from ssd_trt.from_files.models import ModelFacts, display_name
from ssd_trt.models.sources import ResolvedSource
from ssd_trt.recipe import Recipe

# Bump when recipe_data writes something else for the same files and flags: it is part of the cache key, so builds
# of the old recipe are not reused (the project's version and the manifest schema are in the key too).
RECIPE_VERSION = 1
DEFAULT_CONTEXT = 2048
DRAFT_LEN = 2              # the real pair's tuned SD and SSD K (recipes/qwen2.5-coder-1.5b.yaml)
FAN_OUT_BUDGET = 1         # one bonus guess a round: SSD drafts a chain (docs/real_pair.md)
ENGINE_DRAFT_LEN = 8       # engine.max_draft_len: what a request may ask for beyond the default K
MAX_TREE_SIZE = 64
MAX_BATCH = 4
MAX_CONTEXT = 131072       # engine.max_context's ceiling (engines/limits.py)


@dataclass(frozen=True)
class BuildFlags:
    """The command line's flags that change what is built (so they are part of the cache key), checked once here."""
    max_model_len: int | None = None            # --max-model-len: engine.max_context
    num_speculative_tokens: int | None = None   # --num-speculative-tokens: K

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        if k is not None and not 1 <= k <= MAX_DRAFT_LEN:
            raise ConfigError(f"--num-speculative-tokens must be in 1..{MAX_DRAFT_LEN}, got {k}")
        if self.max_model_len is not None and not self.tree_size <= self.max_model_len <= MAX_CONTEXT:
            raise ConfigError(f"--max-model-len must be in {self.tree_size}..{MAX_CONTEXT} tokens (a draft tree step "
                              f"of {self.tree_size} tokens must fit), got {self.max_model_len}")

    @property
    def draft_len(self) -> int:
        return self.num_speculative_tokens or DRAFT_LEN

    @property
    def tree_size(self) -> int:
        """engine.max_tree_size: the default's, or the largest SSD tree step at K with one guess, whichever is more."""
        return max(MAX_TREE_SIZE, ssd_tree_tokens(self.draft_len, FAN_OUT_BUDGET))

    def key(self) -> dict[str, Any]:
        return {"max_model_len": self.max_model_len, "num_speculative_tokens": self.num_speculative_tokens}


def recipe_name(source: ResolvedSource) -> str:
    """A recipe name (``[A-Za-z0-9][A-Za-z0-9._-]*``) from the target's file or folder name."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", display_name(source)).lstrip("._-")
    return name or "model"


def _model(facts: ModelFacts) -> dict[str, Any]:
    if facts.source.kind == "gguf":
        return {"source": str(facts.source.path), "dtype": "float32", "weights": "gguf", "activations": "int8"}
    return {"source": str(facts.source.path), "dtype": "float32", "weights": "float"}


def recipe_data(target: ModelFacts, draft: ModelFacts | None, flags: BuildFlags) -> dict[str, Any]:
    """The recipe as a mapping, validated by the recipe schema (a ConfigError naming the flag where one is at fault).
    ``draft`` None: the target drafts for itself."""
    made_for = min(target.context_length, draft.context_length) if draft else target.context_length
    if flags.max_model_len is not None and flags.max_model_len > target.context_length:
        raise ConfigError(f"--max-model-len {flags.max_model_len} exceeds the target's context length "
                          f"{target.context_length} (its metadata); give at most that")
    context = flags.max_model_len or max(min(DEFAULT_CONTEXT, made_for), flags.tree_size)
    k = flags.draft_len
    data = {"name": recipe_name(target.source),
            "target": _model(target),
            "draft": _model(draft) if draft is not None else {**_model(target), "tokenizer": "target"},
            "engine": {"backend": "ort", "tensorrt": "none", "max_batch": MAX_BATCH, "max_context": context,
                       "max_draft_len": max(ENGINE_DRAFT_LEN, k), "max_tree_size": flags.tree_size,
                       "threads_per_engine": 1},
            "decoding": {"sd_draft_len": k, "ssd_draft_len": k, "ssd_fan_out_budget": FAN_OUT_BUDGET}}
    Recipe.model_validate(data)      # the schema's own checks (the flags above keep it valid)
    return data


def recipe_yaml(data: dict[str, Any], where: str) -> str:
    """The recipe file's text: a header saying where it came from and where its build lives, then the mapping."""
    header = (f"# Written by ssd-trt from the model files' metadata (ssd_trt/from_files/recipe.py).\n"
              f"# Its build: {where}\n")
    return header + yaml.safe_dump(data, sort_keys=False)
