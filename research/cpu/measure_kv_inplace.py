"""Measure whether ONNX Runtime re-copies the KV cache per step: ScatterElements with its output bound
to the input's memory (what OrtEngine does) vs a separate output buffer.
Run: python research/cpu/measure_kv_inplace.py"""
import numpy as np, onnxruntime as ort, time
from onnx import helper, TensorProto
S = 8192
g = helper.make_graph([helper.make_node("ScatterElements", ["data", "idx", "upd"], ["out"], axis=2)], "g",
    [helper.make_tensor_value_info("data", TensorProto.FLOAT, [1, 3, S, 64]),
     helper.make_tensor_value_info("idx", TensorProto.INT64, [1, 3, 1, 64]),
     helper.make_tensor_value_info("upd", TensorProto.FLOAT, [1, 3, 1, 64])],
    [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 3, S, 64])])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
so = ort.SessionOptions(); so.intra_op_num_threads = 1
s = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
data = np.zeros((1, 3, S, 64), np.float32); idx = np.full((1, 3, 1, 64), 5, np.int64); upd = np.ones((1, 3, 1, 64), np.float32)
v = ort.OrtValue.ortvalue_from_numpy(data); other = ort.OrtValue.ortvalue_from_numpy(np.zeros_like(data))
for label, out in (("output = same buffer (in place)", v), ("output = separate buffer", other)):
    b = s.io_binding(); b.bind_ortvalue_input("data", v); b.bind_cpu_input("idx", idx); b.bind_cpu_input("upd", upd); b.bind_ortvalue_output("out", out)
    for _ in range(20): s.run_with_iobinding(b)
    t = time.perf_counter()
    for _ in range(200): s.run_with_iobinding(b)
    print(f"{label}: {(time.perf_counter()-t)/200*1e6:.0f} us per step (cache {data.nbytes/1e6:.1f} MB)")
print("written in place:", data[0, 0, 5, 0] == 1.0)
