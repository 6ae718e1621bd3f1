"""The build writes both ONNX flavours, validated, with a manifest that accounts for every file."""
from __future__ import annotations

import json

import numpy as np
import onnx
import torch

from ssd_trt_plugins.tree_attention.reference import pack_tree_mask, tree_attention_reference, unpack_tree_mask
from ssd_trt.manifest import SCHEMA_VERSION, sha256_file


def test_ort_flavour_passes_full_onnx_check_and_polygraphy(tiny_pairs):
    root = tiny_pairs["perturbed"]
    for role in ("target", "draft"):
        onnx.checker.check_model(str(root / role / "model.ort.onnx"), full_check=True)
    manifest = json.loads((root / "manifest.json").read_text())
    for role in ("target", "draft"):
        assert manifest["validation"][role]["passed"] is True
        assert manifest["validation"][role]["max_abs_error"] < 1e-3
        assert manifest["models"][role]["parity_vs_transformers"]["max_abs_diff"] < 1e-4


def test_trt_flavour_has_one_plugin_node_per_layer_and_no_functions(tiny_pairs):
    root = tiny_pairs["perturbed"]
    manifest = json.loads((root / "manifest.json").read_text())
    for role in ("target", "draft"):
        model = onnx.load(str(root / role / "model.trt.onnx"), load_external_data=False)
        nodes = [n for n in model.graph.node if n.op_type == "tree_attention"]
        assert len(nodes) == manifest["models"][role]["config"]["num_layers"]
        assert len(model.functions) == 0
        for node in nodes:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert attrs["plugin_namespace"] == b"ssd" and attrs["plugin_version"] == b"1"
            assert len(node.input) == 7 and len(node.output) == 3


def test_manifest_lists_every_artifact_with_its_sha256(tiny_pairs):
    root = tiny_pairs["self"]
    manifest = json.loads((root / "manifest.json").read_text())
    listed = {entry["path"]: entry for entry in manifest["artifacts"]}
    on_disk = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert on_disk == set(listed)
    for path, entry in listed.items():
        assert sha256_file(root / path) == entry["sha256"]
    assert manifest["tensorrt"]["status"] in ("skipped", "stopped at ONNX")
    assert manifest["tools"]["onnxruntime"] and manifest["schema_version"] == SCHEMA_VERSION


def test_packed_mask_round_trips():
    rng = np.random.default_rng(0)
    for size in (1, 5, 31, 32, 33, 70):
        mask = rng.random((2, size, size)) < 0.5
        assert np.array_equal(unpack_tree_mask(torch.from_numpy(pack_tree_mask(mask)), size).numpy(), mask)


def test_reference_chain_mask_equals_plain_causal_attention():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    cache = torch.zeros(1, 2, 10, 8)
    causal = torch.from_numpy(pack_tree_mask(np.tril(np.ones((1, 6, 6), dtype=bool))))
    out, keys, _ = tree_attention_reference(q, k, v, cache, cache.clone(), torch.zeros(1, dtype=torch.int32),
                                            causal, 8 ** -0.5)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1),
                                                                v.repeat_interleave(2, 1), is_causal=True)
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.equal(keys[:, :, :6], k) and keys[:, :, 6:].abs().sum() == 0


def _single_op_model(function) -> onnx.ModelProto:
    from onnx import TensorProto, helper
    from ssd_trt_plugins.tree_attention.onnx_function import DOMAIN, INPUTS, OPSET, OUTPUTS
    types = [TensorProto.FLOAT] * 5 + [TensorProto.INT32, TensorProto.INT32]
    ranks = [4, 4, 4, 4, 4, 1, 3]
    inputs = [helper.make_tensor_value_info(n, t, [None] * r) for n, t, r in zip(INPUTS, types, ranks)]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in OUTPUTS]
    node = helper.make_node(function.name, INPUTS, OUTPUTS, domain=DOMAIN, scale=0.25)
    graph = helper.make_graph([node], "op", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(DOMAIN, 1)],
                             functions=[function])


def test_canonical_onnx_function_matches_reference_on_random_trees():
    """The op's own 7-input ONNX function (mask built inside) against the reference math."""
    import onnxruntime as ort
    from ssd_trt_plugins.tree_attention.onnx_function import tree_attention_function
    session = ort.InferenceSession(_single_op_model(tree_attention_function()).SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for _ in range(30):
        batch, kv, group, new, dim = rng.integers(1, 4), rng.integers(1, 3), rng.integers(1, 4), rng.integers(1, 40), 16
        capacity = new + rng.integers(0, 20)
        lengths = rng.integers(0, capacity - new + 1, size=batch).astype(np.int32)
        mask = np.tril(rng.random((batch, new, new)) < 0.5) | np.eye(new, dtype=bool)
        feeds = {"query": rng.standard_normal((batch, kv * group, new, dim)).astype(np.float32),
                 "key_new": rng.standard_normal((batch, kv, new, dim)).astype(np.float32),
                 "value_new": rng.standard_normal((batch, kv, new, dim)).astype(np.float32),
                 "key_cache": rng.standard_normal((batch, kv, capacity, dim)).astype(np.float32),
                 "value_cache": rng.standard_normal((batch, kv, capacity, dim)).astype(np.float32),
                 "cache_lengths": lengths, "tree_mask": pack_tree_mask(mask)}
        got = session.run(None, feeds)
        want = tree_attention_reference(*(torch.from_numpy(feeds[k]) for k in
                                          ("query", "key_new", "value_new", "key_cache", "value_cache",
                                           "cache_lengths", "tree_mask")), 0.25)
        for g, w in zip(got, want):
            assert np.abs(g - w.numpy()).max() < 1e-5
