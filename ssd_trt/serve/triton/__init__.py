"""Triton Inference Server front-end: export a model repository, run a CPU ``tritonserver``, client example.

    python -m ssd_trt.serve.triton setup                       # serving venv (numpy<2, pytriton, tritonclient)
    python -m ssd_trt.serve.triton export build/smollm2-135m --out runs/triton-repo
    python -m ssd_trt.serve.triton start runs/triton-repo --http-port 8000 --grpc-port 8001

Tensor names follow the TensorRT-LLM backend (``text_input``/``max_tokens``/... -> ``text_output``),
so existing TensorRT-LLM clients work unchanged. See docs/serving.md.
"""
from __future__ import annotations

STREAM_MODEL = "ssd_trt"                 # decoupled: one response per committed chunk, then a final flag
NONSTREAM_SUFFIX = "_nonstream"          # plain request/response twin (HTTP /infer, non-streaming clients)

__all__ = ["NONSTREAM_SUFFIX", "STREAM_MODEL"]
