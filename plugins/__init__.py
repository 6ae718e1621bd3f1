"""Custom operators shipped with ssd-trt (reference math, kernels, ONNX and TensorRT glue)."""
