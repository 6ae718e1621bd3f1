"""Serving front-ends for ssd-trt build directories (Triton Inference Server: :mod:`ssd_trt.serve.triton`)."""
