"""Export a Decoder's step graph to ONNX, in the ONNX Runtime and TensorRT flavours."""
