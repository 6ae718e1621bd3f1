"""Hardware settings a benchmark runs under. On this CPU a "device" is a core (FACTS.md): the target's
decode speed scales with cores (memory bandwidth per core), so fairness must be stated explicitly.

* paper-style: the target runs on one core in every mode; SSD adds its draft on a second core
  (as in the SSD paper, where SSD's draft gets an extra GPU). AR, SD and the baselines use one core.
* equal total cores: every mode and baseline may use both cores. SSD splits them (target core 0,
  draft core 1; the target's steps while the draft idles use both, ``RuntimeOptions.target_alone_threads``);
  AR, SD and the baselines run each model with two threads.
"""
from __future__ import annotations

from dataclasses import dataclass

from ssd_trt.runtime import RuntimeOptions


@dataclass(frozen=True)
class Setting:
    name: str
    description: str
    single_threads: int          # threads of a model that runs alone (ar, sd, baselines)

    @property
    def single_cores(self) -> tuple[int, ...]:
        """The cores a model that runs alone is pinned to: one per thread, from core 0."""
        return tuple(range(self.single_threads))

    def options(self, mode: str) -> RuntimeOptions:
        """Where the models of ``mode`` (ar | sd | ssd) run under this setting."""
        # SSD: while the draft idles the target may use what the setting gives one model alone (paper-style: its
        # one core, never the draft's)
        if mode == "ssd":
            return RuntimeOptions(target_threads=1, draft_threads=1, target_cores=(0,), draft_cores=(1,),
                                  target_alone_threads=self.single_threads)
        cores = self.single_cores
        # AR runs one session, which may spin; SD's two sessions share the cores, so they must not
        return RuntimeOptions(target_threads=self.single_threads, draft_threads=self.single_threads,
                              target_cores=cores, draft_cores=cores, spin=True if mode == "ar" else None)


@dataclass(frozen=True)
class SamplingPreset:
    """A decoding setting the benchmark reports on: greedy, or temperature with top-p / top-k."""
    name: str
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def params(self, max_new_tokens: int, seed: int = 0):
        from ssd_trt.decoding.params import SamplingParams
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=seed)

    def describe(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


PRESETS = {preset.name: preset for preset in (
    SamplingPreset("greedy"),
    SamplingPreset("t0.7-p0.9", temperature=0.7, top_p=0.9),      # a common chat default
    SamplingPreset("t1-k50", temperature=1.0, top_k=50),          # transformers' sampling default
)}


PAPER_STYLE = Setting("paper-style", "target on 1 core in every mode; SSD adds its draft on a 2nd core", 1)
EQUAL_CORES = Setting("equal-cores", "every mode and baseline may use both cores", 2)
SETTINGS = {"paper": PAPER_STYLE, "equal": EQUAL_CORES}
