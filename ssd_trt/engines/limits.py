"""The engine limits: what every engine of a build is shaped for, defined and validated once, here.

The recipe's ``engine`` section is an :class:`EngineLimits` (plus build options), the manifest records
that recipe, the TensorRT optimisation profiles are derived from it, and the runtime checks each request
against it (``ssd_trt/requests.py``). Nothing else re-validates these numbers.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_DRAFT_LEN = 32          # K: draft tokens per round, for every model pair


class EngineLimits(BaseModel):
    """max_batch rows, max_context tokens per row, K draft tokens per round, N tokens per SSD tree step."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    max_batch: int = Field(4, ge=1, le=256)
    max_context: int = Field(2048, ge=16, le=131072)
    max_draft_len: int = Field(8, ge=1, le=MAX_DRAFT_LEN, description="K, draft tokens per round")
    max_tree_size: int = Field(64, ge=1, le=1024, description="N, tree tokens in one draft step")

    @model_validator(mode="after")
    def _fit_the_context(self) -> "EngineLimits":
        if self.max_draft_len + 1 > self.max_context:
            raise ValueError(f"engine.max_draft_len + 1 ({self.max_draft_len + 1}) exceeds engine.max_context "
                             f"({self.max_context})")
        if self.max_tree_size > self.max_context:
            raise ValueError(f"engine.max_tree_size ({self.max_tree_size}) exceeds engine.max_context "
                             f"({self.max_context})")
        return self

    @property
    def limits(self) -> "EngineLimits":
        """Just the four limits (a recipe's engine section carries build options besides)."""
        return EngineLimits(max_batch=self.max_batch, max_context=self.max_context,
                            max_draft_len=self.max_draft_len, max_tree_size=self.max_tree_size)
