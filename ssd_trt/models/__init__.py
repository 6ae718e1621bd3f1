"""Export-friendly decoder models written for ssd-trt, loading real HF / GGUF weights."""
