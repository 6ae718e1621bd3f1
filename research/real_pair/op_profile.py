"""Where a step's time goes, operator by operator: ONNX Runtime's own profiler on a build's graph, one thread, one
row of T new tokens over a filled cache, with the session options the engine uses (int8 activations as the build
asks). Also lists the operators the optimized graph holds (which DequantizeLinear -> MatMul pairs were fused into
MatMulNBits).

    python research/real_pair/op_profile.py build/qwen2.5-coder-1.5b --role target --tokens 1 --out docs/bench/real_pair/op_profile_target.json
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx

from ssd_trt.engines.ort import _session_options
from ssd_trt.export.validate import sample_feeds
from ssd_trt.manifest import read_manifest


def main() -> int:
    import onnxruntime as ort
    p = argparse.ArgumentParser()
    p.add_argument("build", type=Path)
    p.add_argument("--role", default="target", choices=("target", "draft"))
    p.add_argument("--tokens", type=int, default=1)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    os.sched_setaffinity(0, {0})
    manifest = read_manifest(args.build)
    config = manifest.model(args.role).config
    int8 = manifest.recipe.model_dump()[args.role].get("activations") == "int8"
    graph = args.build / args.role / "model.ort.onnx"
    with tempfile.TemporaryDirectory() as scratch:
        options = _session_options(ort, 1, None, True, int8)
        options.optimized_model_filepath = str(Path(scratch) / "optimized.onnx")
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(scratch) / "profile")
        session = ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(options.optimized_model_filepath, load_external_data=False)
        op_counts = collections.Counter(node.op_type for node in optimized.graph.node)
        nbits = [node for node in optimized.graph.node if node.op_type == "MatMulNBits"]
        nbits_kinds = collections.Counter(
            tuple((a.name, onnx.helper.get_attribute_value(a)) for a in node.attribute if a.name in
                  ("bits", "block_size", "accuracy_level")) for node in nbits)
        names = {i.name for i in session.get_inputs()}
        feeds = sample_feeds(config, 1, args.tokens, seed=0, capacity=args.context + args.tokens + 1)
        feeds["cache_lengths"][:] = args.context
        feeds["position_ids"] = (args.context + np.arange(args.tokens)[None]).astype(np.int64)
        feeds = {k: v for k, v in feeds.items() if k in names}
        for _ in range(3):
            session.run(None, feeds)
        for _ in range(args.steps):
            session.run(None, feeds)
        trace = json.loads(Path(session.end_profiling()).read_text())
    by_op, by_node, runs = collections.Counter(), collections.Counter(), 0
    for event in trace:
        if event.get("cat") == "Session" and event.get("name") == "model_run":
            runs += 1
        if event.get("cat") != "Node" or not event["name"].endswith("_kernel_time"):
            continue
        by_op[event["args"]["op_name"]] += event["dur"]
        by_node[event["name"][:-len("_kernel_time")]] += event["dur"]
    total = sum(by_op.values())
    runs = max(runs, 1)
    record = {"command": "python research/real_pair/op_profile.py " + " ".join(sys.argv[1:]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"), "build": str(args.build),
              "role": args.role, "tokens": args.tokens, "context": args.context, "int8_activations": int8,
              "runs_profiled": runs, "ms_per_step_in_kernels": total / runs / 1e3,
              "optimized_graph_ops": dict(op_counts.most_common()),
              "matmulnbits_attributes": [{"attributes": dict(k), "nodes": n} for k, n in nbits_kinds.items()],
              "ms_per_step_by_op": {op: round(us / runs / 1e3, 3) for op, us in by_op.most_common()},
              "top_nodes_ms_per_step": {n: round(us / runs / 1e3, 3) for n, us in by_node.most_common(15)}}
    print(json.dumps({k: record[k] for k in ("ms_per_step_in_kernels", "optimized_graph_ops",
                                             "matmulnbits_attributes", "ms_per_step_by_op", "top_nodes_ms_per_step")},
                     indent=1))
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
