"""Serving front-ends for ssd-trt build directories over one serving loop (:mod:`ssd_trt.serve.core`): Triton
Inference Server (:mod:`ssd_trt.serve.triton`) and an OpenAI-compatible HTTP server (:mod:`ssd_trt.serve.openai`)."""
