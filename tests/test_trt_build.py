"""Engine build and runtime of the TensorRT path, as far as they run without TensorRT, plus the real thing.

CPU (always), on real ONNX step graphs built here with onnx.helper: the binding layout derived from
the graph, optimisation-profile shapes derived from the recipe limits, plugin-node and precision
checks, manifest entries, CUDA-graph bucket planning / selection / padding (padding checked with the
reference attention and the Triton kernel), device placement, and the clear failures without
TensorRT. TensorRT + GPU (marked, skipped here with the reason): build the tiny step graph into an
engine and run it through :class:`TensorRTEngine` against a torch model of the same weights.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml
from onnx import TensorProto, helper, numpy_helper

from ssd_trt_plugins.tree_attention.reference import pack_tree_mask, tree_attention_reference
from ssd_trt_plugins.tree_attention.triton_kernel import tree_attention
from ssd_trt.engines.availability import probe_tensorrt
from ssd_trt.engines.bindings import BindingLayout
from ssd_trt.engines.cuda_graphs import GraphBucket, batch_sizes, pad_step, plan_buckets, select_bucket
from ssd_trt.engines.base import EngineSpec
from ssd_trt.engines.tensorrt import Placement, TensorRTEngine, causal_mask, check_spec, place_draft_and_target
from ssd_trt.trt.engine_build import TensorRTUnavailable, build_engine, check_plugin_nodes, check_precision, \
    manifest_entry, profile_table
from ssd_trt.engines.limits import EngineLimits
from ssd_trt.engines.profiles import Profile, derive_profiles, select_profile
from ssd_trt.engines.editions import DATACENTER
from ssd_trt.manifest import PlanEntry

HAS_TRT, TRT_REASON = probe_tensorrt()
LIMITS = EngineLimits(max_batch=4, max_context=256, max_draft_len=5, max_tree_size=24)
ONNX_FLOAT = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16}


# ---- a tiny but real step graph: embeddings -> per layer q/k/v, tree_attention, out-proj -> logits -----------

def tiny_weights(layers=2, q_heads=4, kv_heads=2, dim=16, vocab=32, positions=512, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hidden = q_heads * dim
    weights = {"embed": rng.normal(0, 1, (vocab, hidden)), "pos_embed": rng.normal(0, 0.1, (positions, hidden)),
               "lm_head": rng.normal(0, hidden ** -0.5, (hidden, vocab))}
    for layer in range(layers):
        for name, cols in (("wq", q_heads * dim), ("wk", kv_heads * dim), ("wv", kv_heads * dim), ("wo", hidden)):
            weights[f"{name}{layer}"] = rng.normal(0, hidden ** -0.5, (hidden, cols))
    return {name: value.astype(np.float32) for name, value in weights.items()}


def tiny_step_graph(weights, layers=2, q_heads=4, kv_heads=2, dim=16, vocab=32, dtype="float16",
                    capacity: int | str = "capacity", batch: int | str = "batch", head_dim_dynamic=False,
                    plugin_attrs=True) -> onnx.ModelProto:
    """The step-graph contract of ssd_trt/engines/base.py with one tree_attention node per layer."""
    ftype = ONNX_FLOAT[dtype]
    cast = np.float16 if dtype == "float16" else np.float32
    inits = [numpy_helper.from_array(value.astype(cast), name) for name, value in weights.items()]
    inits += [numpy_helper.from_array(np.array(shape, dtype=np.int64), f"shape_{name}") for name, shape in
              (("q", [0, 0, q_heads, dim]), ("kv", [0, 0, kv_heads, dim]), ("merge", [0, 0, q_heads * dim]))]
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["tok"]),
             helper.make_node("Gather", ["pos_embed", "position_ids"], ["pos"]),
             helper.make_node("Add", ["tok", "pos"], ["h0"])]
    cache_dims = [batch, kv_heads, capacity, "head_dim" if head_dim_dynamic else dim]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, "tokens"]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [batch, "tokens"]),
              helper.make_tensor_value_info("tree_mask", TensorProto.INT32, [batch, "tokens", "mask_words"]),
              helper.make_tensor_value_info("cache_lengths", TensorProto.INT32, [batch]),
              helper.make_tensor_value_info("logit_indices", TensorProto.INT64, [batch, "logit_count"])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, "logit_count", vocab])]
    for i in range(layers):
        h = f"h{i}"
        for proj, shape in (("q", "q"), ("k", "kv"), ("v", "kv")):
            nodes += [helper.make_node("MatMul", [h, f"w{proj}{i}"], [f"{proj}{i}_flat"]),
                      helper.make_node("Reshape", [f"{proj}{i}_flat", f"shape_{shape}"], [f"{proj}{i}_bthd"]),
                      helper.make_node("Transpose", [f"{proj}{i}_bthd"], [f"{proj}{i}"], perm=[0, 2, 1, 3])]
        attrs = dict(plugin_namespace="ssd", plugin_version="1", scale=dim ** -0.5) if plugin_attrs else {}
        nodes += [helper.make_node("tree_attention", [f"q{i}", f"k{i}", f"v{i}", f"past_key_{i}", f"past_value_{i}",
                                                      "cache_lengths", "tree_mask"],
                                   [f"attn{i}", f"present_key_{i}", f"present_value_{i}"], name=f"attn{i}",
                                   domain="ssd", **attrs),
                  helper.make_node("Transpose", [f"attn{i}"], [f"attn{i}_bthd"], perm=[0, 2, 1, 3]),
                  helper.make_node("Reshape", [f"attn{i}_bthd", "shape_merge"], [f"attn{i}_flat"]),
                  helper.make_node("MatMul", [f"attn{i}_flat", f"wo{i}"], [f"o{i}"]),
                  helper.make_node("Add", [h, f"o{i}"], [f"h{i + 1}"])]
        for kind in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_{kind}_{i}", ftype, cache_dims))
            outputs.append(helper.make_tensor_value_info(f"present_{kind}_{i}", ftype, cache_dims))
    inits += [numpy_helper.from_array(np.array([2], dtype=np.int64), "axis_2"),
              numpy_helper.from_array(np.array([vocab], dtype=np.int64), "vocab_dim")]
    nodes += [helper.make_node("MatMul", [f"h{layers}", "lm_head"], ["logits_every"]),
              # logits of the tokens logit_indices picks: GatherElements over T with [B, L, V] indices
              helper.make_node("Unsqueeze", ["logit_indices", "axis_2"], ["picked_3d"]),
              helper.make_node("Shape", ["logit_indices"], ["picked_shape"]),
              helper.make_node("Concat", ["picked_shape", "vocab_dim"], ["gather_shape"], axis=0),
              helper.make_node("Expand", ["picked_3d", "gather_shape"], ["picked_full"]),
              helper.make_node("GatherElements", ["logits_every", "picked_full"], ["logits_low"], axis=1),
              helper.make_node("Cast", ["logits_low"], ["logits"], to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "tiny_step", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ssd", 1)])


@pytest.fixture(scope="module")
def weights():
    return tiny_weights()


@pytest.fixture(scope="module")
def layout(weights):
    return BindingLayout.from_onnx(tiny_step_graph(weights))


# ---- binding layout -------------------------------------------------------------------------------------------

def test_layout_is_derived_from_the_onnx_graph(layout):
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.vocab_size) == (2, 2, 16, 32)
    assert (layout.cache_dtype, layout.logits_dtype) == ("float16", "float32")
    assert [t.name for t in layout.inputs[:4]] == ["input_ids", "position_ids", "tree_mask", "cache_lengths"]
    assert layout.tensor("past_key_1").roles == ("batch", "kv_heads", "capacity", "head_dim")
    assert layout.tensor("tree_mask").roles == ("batch", "tokens", "mask_words")
    assert ("present_value_1", "past_value_1") in layout.aliases and len(layout.aliases) == 4
    assert layout.static_capacity() is None
    assert layout.shape_for("tree_mask", 3, 40, 256) == (3, 40, 2)
    assert layout.shape_for("logits", 3, 40, 256) == (3, 40, 32)


def test_layout_rejects_graphs_the_runtime_cannot_feed(weights):
    model = tiny_step_graph(weights)
    del model.graph.output[-1]  # present_value_1
    with pytest.raises(ValueError, match="present_value_i must exist"):
        BindingLayout.from_onnx(model)
    with pytest.raises(ValueError, match="head_dim dimension must be static"):
        BindingLayout.from_onnx(tiny_step_graph(weights, head_dim_dynamic=True))
    model = tiny_step_graph(weights)
    model.graph.input.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "s"]))
    with pytest.raises(ValueError, match="unexpected graph input 'attention_mask'"):
        BindingLayout.from_onnx(model)
    model = tiny_step_graph(weights)
    model.graph.input[3].type.tensor_type.elem_type = TensorProto.INT64  # cache_lengths
    with pytest.raises(ValueError, match="cache_lengths must be int32"):
        BindingLayout.from_onnx(model)


# ---- profiles -------------------------------------------------------------------------------------------------

def test_profiles_cover_the_runtime_step_kinds():
    profiles = derive_profiles(LIMITS)
    assert [(p.name, p.tokens) for p in profiles] == [("decode", (1, 1, 1)), ("verify", (6, 6, 6)),
                                                      ("tree", (2, 24, 24)), ("prefill", (1, 256, 256))]
    assert all(p.batch == (1, 4, 4) for p in profiles)
    # a one-token tree step is a decode step
    single = derive_profiles(EngineLimits(max_batch=2, max_context=64, max_draft_len=5, max_tree_size=1))
    assert [(p.name, p.tokens) for p in single] == [("decode", (1, 1, 1)), ("verify", (6, 6, 6)),
                                                   ("prefill", (1, 64, 64))]
    assert select_profile(profiles, 2, 1) == 0 and select_profile(profiles, 2, 6) == 1
    assert select_profile(profiles, 2, 7) == 2 and select_profile(profiles, 1, 100) == 3
    with pytest.raises(ValueError, match="raise engine.max_batch"):
        select_profile(profiles, 5, 1)


def test_limits_are_validated_once_by_the_recipe_model():
    with pytest.raises(ValueError, match="max_batch"):
        EngineLimits(max_batch=0, max_context=256, max_draft_len=5, max_tree_size=24)
    with pytest.raises(ValueError, match="max_tree_size"):
        EngineLimits(max_batch=1, max_context=16, max_draft_len=5, max_tree_size=24)
    # the recipe's engine section *is* the limits (plus build options): no second definition to drift
    from ssd_trt.recipe import Recipe
    recipe = Recipe.model_validate({"name": "r", "target": {"source": "a"}, "draft": {"source": "a"},
                                    "engine": {"max_batch": 2, "max_context": 128, "max_draft_len": 4,
                                               "max_tree_size": 64}})
    assert recipe.engine.limits == EngineLimits(max_batch=2, max_context=128, max_draft_len=4, max_tree_size=64)


@pytest.mark.parametrize("recipe", sorted((Path(__file__).resolve().parents[1] / "recipes" / "gpu").glob("*.yaml")),
                         ids=lambda path: path.stem)
def test_gpu_recipes_give_valid_profiles(recipe):
    data = yaml.safe_load(recipe.read_text())
    assert data["engine"]["backend"] == "trt" and data["engine"]["trt_precision"] == "bf16"
    assert data["target"]["dtype"] == data["draft"]["dtype"] == "bfloat16"
    limits = EngineLimits(**{key: data["engine"][key] for key in
                              ("max_batch", "max_context", "max_draft_len", "max_tree_size")})
    profiles = derive_profiles(limits)
    assert [p.name for p in profiles] == ["decode", "verify", "tree", "prefill"]
    assert plan_buckets(profiles)  # decode and verify steps get CUDA graphs


def test_profile_shapes_for_every_input(layout):
    table = profile_table(layout, LIMITS)
    shapes = dict((profile.name, ranges) for profile, ranges in table)
    assert shapes["decode"]["input_ids"] == ((1, 1), (4, 1), (4, 1))
    assert shapes["tree"]["tree_mask"] == ((1, 2, 1), (4, 24, 1), (4, 24, 1))
    assert shapes["prefill"]["tree_mask"] == ((1, 1, 1), (4, 256, 8), (4, 256, 8))  # ceil(256 / 32) words
    assert shapes["verify"]["past_value_0"] == ((1, 2, 256, 16), (4, 2, 256, 16), (4, 2, 256, 16))
    assert shapes["prefill"]["cache_lengths"] == ((1,), (4,), (4,))
    assert set(shapes["decode"]) == {t.name for t in layout.inputs}


def test_static_dimensions_must_agree_with_the_recipe(weights):
    fixed = BindingLayout.from_onnx(tiny_step_graph(weights, capacity=128))
    with pytest.raises(ValueError, match="capacity is fixed at 128"):
        profile_table(fixed, LIMITS)
    limits = EngineLimits(max_batch=4, max_context=128, max_draft_len=5, max_tree_size=24)
    assert profile_table(fixed, limits)[0][1]["past_key_0"][0] == (1, 2, 128, 16)
    single = BindingLayout.from_onnx(tiny_step_graph(weights, batch=1))
    with pytest.raises(ValueError, match="static dimension 0 = 1"):
        profile_table(single, LIMITS)


# ---- build-time checks and manifest ---------------------------------------------------------------------------

def test_precision_must_match_the_exported_graph(layout):
    check_precision(layout, "fp16")
    with pytest.raises(ValueError, match="export the TensorRT flavour in bfloat16"):
        check_precision(layout, "bf16")
    with pytest.raises(ValueError, match="trt_precision must be one of"):
        check_precision(layout, "int8")


def test_plugin_nodes_must_be_the_tensorrt_flavour(weights):
    assert check_plugin_nodes(tiny_step_graph(weights)) == [pytest.approx(0.25)] * 2
    with pytest.raises(ValueError, match="plugin_namespace"):
        check_plugin_nodes(tiny_step_graph(weights, plugin_attrs=False))
    ort_flavour = tiny_step_graph(weights)
    ort_flavour.functions.append(helper.make_function("ssd", "tree_attention", ["q"], ["o"],
                                                      [helper.make_node("Identity", ["q"], ["o"])],
                                                      [helper.make_opsetid("", 17)]))
    with pytest.raises(ValueError, match="ONNX Runtime flavour"):
        check_plugin_nodes(ort_flavour)


def test_manifest_entry_records_hash_and_profiles(layout, tmp_path):
    (tmp_path / "target").mkdir()
    engine, log = tmp_path / "target" / "engine.plan", tmp_path / "target" / "build.datacenter.log"
    engine.write_bytes(b"not a real engine, but real bytes")
    log.write_text("")
    entry = manifest_entry(DATACENTER, "target", tmp_path, engine, tmp_path / "target" / "model.trt.onnx",
                           profile_table(layout, LIMITS), "fp16", "10.9.0", ("sm90",), 12.5, "f" * 64, log)
    assert entry["sha256"] == hashlib.sha256(engine.read_bytes()).hexdigest()
    assert entry["bytes"] == engine.stat().st_size and entry["path"] == "target/engine.plan"
    assert entry["edition"] == "datacenter" and entry["compute_capabilities"] == ["sm90"]
    assert [p["name"] for p in entry["profiles"]] == ["decode", "verify", "tree", "prefill"]
    assert entry["profiles"][1]["shapes"]["input_ids"] == [[1, 6], [4, 6], [4, 6]]
    PlanEntry.model_validate(entry)      # exactly the manifest's typed record


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed here; this checks the failure without it")
def test_build_without_tensorrt_fails_with_the_reason_after_checking_the_graph(weights, tmp_path):
    (tmp_path / "target").mkdir()
    onnx.save(tiny_step_graph(weights), tmp_path / "target" / "model.trt.onnx")
    with pytest.raises(ValueError, match="bfloat16"):  # graph checks run first, TensorRT or not
        build_engine(DATACENTER, "target", tmp_path, LIMITS, "bf16", (), "f" * 64)
    with pytest.raises(TensorRTUnavailable, match="tensorrt"):
        build_engine(DATACENTER, "target", tmp_path, LIMITS, "fp16", (), "f" * 64)
    assert not (tmp_path / "target" / "engine.plan").exists()


@pytest.mark.skipif(HAS_TRT, reason="TensorRT is installed here; this checks the failure without it")
def test_runtime_without_tensorrt_fails_with_the_reason(tmp_path):
    ok, reason = probe_tensorrt()
    assert not ok and reason
    with pytest.raises(RuntimeError, match="needs its TensorRT and a CUDA GPU"):
        TensorRTEngine(tmp_path / "missing.plan")


# ---- CUDA-graph buckets ---------------------------------------------------------------------------------------

def test_buckets_are_planned_for_exact_token_profiles_and_the_tree_range_not_prefill():
    profiles = derive_profiles(EngineLimits(max_batch=6, max_context=1024, max_draft_len=5, max_tree_size=24))
    buckets = plan_buckets(profiles)
    assert batch_sizes(6) == (1, 2, 4, 6) and batch_sizes(1) == (1,)
    assert {(b.batch, b.tokens) for b in buckets} == {(b, t) for b in (1, 2, 4, 6) for t in (1, 6, 2, 4, 8, 16, 24)}
    names = {profiles[b.profile].name for b in buckets}
    assert names == {"decode", "verify", "tree"}  # prefill (T up to 1024) runs eagerly
    assert all(profiles[b.profile].accepts(b.batch, b.tokens) for b in buckets)


def test_bucket_selection_pads_as_little_as_possible():
    buckets = plan_buckets(derive_profiles(EngineLimits(max_batch=4, max_context=1024, max_draft_len=5,
                                                         max_tree_size=24)))
    assert select_bucket(buckets, 1, 1, room=100) == GraphBucket(1, 1, 0)
    assert select_bucket(buckets, 3, 1, room=100) == GraphBucket(4, 1, 0)  # batch padded to 4
    assert select_bucket(buckets, 2, 6, room=100) == GraphBucket(2, 6, 1)
    assert select_bucket(buckets, 2, 5, room=100) == GraphBucket(2, 6, 1)  # 5 tokens padded to the verify bucket
    assert select_bucket(buckets, 2, 5, room=5) is None  # padding would overflow the cache: run eagerly
    assert select_bucket(buckets, 2, 3, room=100) == GraphBucket(2, 4, 2)  # a tree step padded to 4
    assert select_bucket(buckets, 1, 24, room=100) == GraphBucket(1, 24, 2)
    assert select_bucket(buckets, 1, 25, room=100) is None  # prefill-sized: eager
    with pytest.raises(ValueError, match="room for 3"):
        select_bucket(buckets, 1, 4, room=3)


def random_step(seed, batch=2, tokens=3, q_heads=4, kv_heads=2, dim=16, capacity=32):
    gen = torch.Generator().manual_seed(seed)
    lengths = np.array([5, 11][:batch], dtype=np.int32)
    tree = causal_mask(batch, tokens)
    tree[1, 2, 1] = False  # row 1 is a little tree
    return dict(query=torch.randn(batch, q_heads, tokens, dim, generator=gen),
                key_new=torch.randn(batch, kv_heads, tokens, dim, generator=gen),
                value_new=torch.randn(batch, kv_heads, tokens, dim, generator=gen),
                key_cache=torch.randn(4, kv_heads, capacity, dim, generator=gen),
                value_cache=torch.randn(4, kv_heads, capacity, dim, generator=gen)), lengths, tree


@pytest.mark.parametrize("attention", ["reference", "triton-interpreter"])
def test_padding_a_step_to_a_bucket_leaves_real_outputs_unchanged(attention):
    """The argument behind bucket padding, checked on the attention op itself."""
    step, lengths, tree = random_step(0)
    batch, tokens, rows, padded = 2, 3, 4, 6
    run = tree_attention_reference if attention == "reference" else tree_attention
    ids, positions = np.arange(6).reshape(2, 3), np.arange(6).reshape(2, 3) + 5
    host = pad_step(ids, positions, tree, lengths, rows, padded)
    assert host["tree_mask"].shape == (4, 6, 1) and host["cache_lengths"].tolist() == [5, 11, 0, 0]
    assert host["position_ids"][0].tolist() == [5, 6, 7, 7, 7, 7] and host["input_ids"][3].tolist() == [0] * 6
    plain = run(step["query"], step["key_new"], step["value_new"], step["key_cache"][:batch],
                step["value_cache"][:batch], torch.from_numpy(lengths), torch.from_numpy(pack_tree_mask(tree)),
                0.25)
    gen = torch.Generator().manual_seed(1)

    def pad(tensor, shape):  # real entries where they were, noise in the padding
        out = torch.randn(*shape, generator=gen)
        out[:tensor.shape[0], :, :tensor.shape[2]] = tensor
        return out
    padded_out = run(pad(step["query"], (rows, 4, padded, 16)), pad(step["key_new"], (rows, 2, padded, 16)),
                     pad(step["value_new"], (rows, 2, padded, 16)), step["key_cache"], step["value_cache"],
                     torch.from_numpy(host["cache_lengths"]), torch.from_numpy(host["tree_mask"]), 0.25)
    assert torch.allclose(padded_out[0][:batch, :, :tokens], plain[0], atol=1e-6)
    for row, length in enumerate(lengths):  # the cache up to the new length is what the plain step wrote
        assert torch.equal(padded_out[1][row, :, :length + tokens], plain[1][row, :, :length + tokens])


def test_pad_step_refuses_to_shrink():
    with pytest.raises(ValueError, match="cannot pad"):
        pad_step(np.zeros((2, 3), np.int64), np.zeros((2, 3), np.int64), causal_mask(2, 3), np.zeros(2, np.int32),
                 1, 3)


def test_draft_and_target_placement():
    assert place_draft_and_target(2) == (Placement(device=1), Placement(device=0))
    draft, target = place_draft_and_target(1)
    assert draft.device == target.device == 0 and target.stream_priority < draft.stream_priority
    with pytest.raises(ValueError, match="at least one CUDA device"):
        place_draft_and_target(0)


def test_engine_spec_is_checked_against_the_manifest(tmp_path):
    built = EngineSpec("target", vocab_size=32, num_layers=2, num_kv_heads=2, head_dim=16, max_batch=4,
                       max_context=256)
    check_spec(None, built, tmp_path)
    check_spec(EngineSpec("target", 32, 2, 2, 16, max_batch=2, max_context=128), built, tmp_path)
    with pytest.raises(ValueError, match="num_layers = 2, the manifest says 3"):
        check_spec(EngineSpec("target", 32, 3, 2, 16, 4, 256), built, tmp_path)
    with pytest.raises(ValueError, match="max_context 256 < 512"):
        check_spec(EngineSpec("target", 32, 2, 2, 16, 4, 512), built, tmp_path)


def test_profile_rejects_inconsistent_ranges():
    with pytest.raises(ValueError, match="min <= opt <= max"):
        Profile("bad", (1, 4, 2), (1, 1, 1))


# ---- TensorRT + GPU: the real build and runtime ---------------------------------------------------------------

class TorchTinyModel:
    """The tiny step graph in torch (fp16 weights, fp32 math), with its own KV cache, for comparison."""

    def __init__(self, weights, batch, capacity, layers=2, q_heads=4, kv_heads=2, dim=16):
        self.w = {k: torch.from_numpy(v.astype(np.float16)).float() for k, v in weights.items()}
        self.shape = (layers, q_heads, kv_heads, dim)
        self.caches = [[torch.zeros(batch, kv_heads, capacity, dim) for _ in range(2)] for _ in range(layers)]
        self.lengths = np.zeros(batch, dtype=np.int32)

    def forward(self, ids, positions, tree):
        layers, q_heads, kv_heads, dim = self.shape
        batch, tokens = ids.shape
        h = self.w["embed"][torch.from_numpy(ids)] + self.w["pos_embed"][torch.from_numpy(positions)]
        mask = torch.from_numpy(pack_tree_mask(tree))
        for i in range(layers):
            def heads(name, count):
                return (h @ self.w[f"{name}{i}"]).view(batch, tokens, count, dim).transpose(1, 2)
            out, key, value = tree_attention_reference(heads("wq", q_heads), heads("wk", kv_heads),
                                                       heads("wv", kv_heads), *self.caches[i],
                                                       torch.from_numpy(self.lengths), mask, dim ** -0.5)
            self.caches[i] = [key, value]
            h = h + out.transpose(1, 2).reshape(batch, tokens, -1) @ self.w[f"wo{i}"]
        self.lengths = self.lengths + tokens
        return (h @ self.w["lm_head"]).numpy()

    def keep(self, row, start, offsets):
        index = torch.as_tensor(start + np.asarray(offsets))
        for pair in self.caches:
            for cache in pair:
                cache[row, :, start:start + len(offsets)] = cache[row, :, index]
        self.lengths[row] = start + len(offsets)


@pytest.mark.trt
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_TRT, reason=f"needs TensorRT >= 10.9 and a GPU: {TRT_REASON}")
def test_tiny_engine_builds_and_matches_torch_through_the_runtime(weights, tmp_path):
    (tmp_path / "target").mkdir()
    onnx.save(tiny_step_graph(weights), tmp_path / "target" / "model.trt.onnx")
    entry = build_engine(DATACENTER, "target", tmp_path, LIMITS, "fp16", (), "f" * 64)
    plan = tmp_path / entry["path"]
    assert entry["sha256"] == hashlib.sha256(plan.read_bytes()).hexdigest()
    assert (tmp_path / "timing.cache").stat().st_size > 0 and (tmp_path / entry["log"]).exists()
    engine = TensorRTEngine(plan)
    model = TorchTinyModel(weights, batch=2, capacity=LIMITS.max_context)
    engine.reset(2)
    rng = np.random.default_rng(0)

    def step(tokens, tree=None):
        ids = rng.integers(0, 32, size=(2, tokens))
        positions = engine.lengths[:, None] + np.arange(tokens)[None, :]
        tree = causal_mask(2, tokens) if tree is None else tree
        got, want = engine.forward(ids, positions, tree), model.forward(ids, positions, tree)
        assert got.shape == want.shape == (2, tokens, 32)
        assert np.abs(got - want).max() / np.abs(want).max() < 2e-2
        assert (engine.lengths == model.lengths).all() and engine.last_step_ms > 0

    step(9)  # prefill (eager)
    for _ in range(3):
        step(1)  # decode (graph bucket, captured then replayed)
    step(6)  # verify K + 1
    wide = np.stack([np.eye(5, dtype=bool)] * 2)
    wide[:, 3, 0] = wide[:, 4, 3] = wide[:, 4, 0] = True
    step(5, wide)  # a tree step padded to the verify bucket
    for row in (0, 1):
        start = int(engine.lengths[row]) - 5
        engine.keep(row, start, [0, 3, 4])
        model.keep(row, start, [0, 3, 4])
    engine.rollback(engine.lengths - 1)
    model.lengths = model.lengths - 1
    step(1)
