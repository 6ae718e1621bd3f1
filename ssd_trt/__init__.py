"""ssd-trt: speculative speculative decoding (SSD / Saguaro) as an ahead-of-time compiled engine.

Public API::

    import ssd_trt
    gen = ssd_trt.load("build/smollm2-135m")
    result = gen.generate("Once upon a time", ssd_trt.SamplingParams(max_new_tokens=64))     # SSD, the defaults
    result = gen.generate("Once upon a time", ssd_trt.SamplingParams(max_new_tokens=64), mode=ssd_trt.SD(draft_len=3))
"""
from __future__ import annotations

__version__ = "0.1.0"

from ssd_trt.decoding.params import SamplingParams  # noqa: E402
from ssd_trt.decoding.settings import AR, SD, SSD  # noqa: E402
from ssd_trt.runtime import GenerationResult, Generator, RuntimeOptions, load  # noqa: E402

__all__ = ["AR", "SD", "SSD", "GenerationResult", "Generator", "RuntimeOptions", "SamplingParams", "load",
           "__version__"]
