"""TensorRT for RTX: the native-attention step graph, real plans built on this CPU, and the checks at load.

CPU, always: the ``rtx`` flavour (``export/native_graph.py``) computes the step graph's function in ONNX
Runtime (tree masks, ragged cache lengths, a filled prefix) and a wrong rotary layout makes that check fail.
With ``tensorrt_rtx`` installed (``pip install -e '.[rtx]'``; CI installs it): its parser maps the graph to
native attention / KV-cache update / rotary layers, the build writes real plans (tiny pairs, and both models
of the embedded default), refuses a plugin graph and profiles that miss a runtime step shape, and a plan is
refused at load when truncated, from another recipe, or without kernels for the GPU. Running a plan needs
an RTX-class GPU (sm86/89/120; the lent H200 is sm90, for which TensorRT for RTX builds nothing): marked
``gpu``/``trt``, skipped here with the reason.
"""
from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from ssd_trt_plugins.tree_attention.reference import pack_tree_mask
from ssd_trt.build import build
from ssd_trt.engines.availability import probe_tensorrt_rtx
from ssd_trt.engines.editions import RTX
from ssd_trt.engines.limits import EngineLimits
from ssd_trt.engines.plans import check_plan
from ssd_trt.engines.profiles import derive_profiles
from ssd_trt.errors import ArtifactError
from ssd_trt.export.native_graph import native_flavour
from ssd_trt.export.onnx_export import trace_step_graph
from ssd_trt.manifest import read_manifest, recipe_fingerprint, sha256_file
from ssd_trt.trt.engine_build import _build_with_tensorrt, build_engine, check_coverage
from tests.helpers import random_decoder, save_hf_checkpoint, tiny_config, write_recipe

HAS_RTX = RTX.installed()
PROBE = probe_tensorrt_rtx() if HAS_RTX else {"run": False, "reason": "tensorrt_rtx is not installed"}
needs_rtx = pytest.mark.skipif(not HAS_RTX, reason=f"needs TensorRT for RTX ({RTX.install_hint})")
CAPACITY = 48


# ---- the native graph, in ONNX Runtime (no TensorRT needed) -----------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model():
    return random_decoder(tiny_config(layers=2), seed=3)


def step_inputs(model, capacity=CAPACITY, seed=0):
    """Two rows, ragged cache lengths (one prefix filled with noise), a branching tree mask over 6 new tokens."""
    rng = np.random.default_rng(seed)
    c, batch, new = model.config, 2, 6
    lengths = np.array([11, 0], dtype=np.int32)
    tree = np.tril(np.ones((new, new), dtype=bool))
    tree[3:, 1:3] = False                      # tokens 3.. branch off token 0, not 1-2
    positions = lengths[:, None] + np.array([0, 1, 2, 1, 2, 3])[None]      # siblings share positions
    feeds = {"input_ids": rng.integers(0, c.vocab_size, (batch, new)).astype(np.int64),
             "position_ids": positions.astype(np.int64),
             "tree_mask": np.broadcast_to(pack_tree_mask(tree), (batch, new, 1)).copy(),
             "cache_lengths": lengths, "logit_indices": np.tile(np.arange(new), (batch, 1)).astype(np.int64)}
    for layer in range(c.num_layers):
        for kind in ("key", "value"):
            feeds[f"past_{kind}_{layer}"] = rng.standard_normal(
                (batch, c.num_kv_heads, capacity, c.head_dim)).astype(np.float32)
    return feeds


def torch_step(model, feeds):
    t = {name: torch.from_numpy(value) for name, value in feeds.items()}
    caches = [t[name] for name in feeds if name.startswith("past_")]
    with torch.no_grad():
        out = model(t["input_ids"], t["position_ids"], t["tree_mask"], t["cache_lengths"], *caches,
                    logit_indices=t["logit_indices"])
    return [o.numpy() for o in out]


def ort_step(graph: onnx.ModelProto, feeds):
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.log_severity_level = 3          # TensorScatter's "copying past to present" note on CPU
    session = ort.InferenceSession(graph.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def test_native_flavour_computes_the_step_graph_on_native_ops(tiny_model):
    native = native_flavour(trace_step_graph(tiny_model), CAPACITY, tiny_model.config.vocab_size)
    ops = Counter(node.op_type for node in native.graph.node)
    layers = tiny_model.config.num_layers
    assert (ops["Attention"], ops["TensorScatter"], ops["RotaryEmbedding"]) == (layers, 2 * layers, 2 * layers)
    assert not {"tree_attention", "tree_attention_masked"} & set(ops) and not native.functions
    assert [(o.domain, o.version) for o in native.opset_import] == [("", 24)]
    cache_dims = {value.type.tensor_type.shape.dim[2].dim_value for value in native.graph.input
                  if value.name.startswith("past_")}
    assert cache_dims == {CAPACITY}        # static: TensorRT's KV-cache update layer requires it
    feeds = step_inputs(tiny_model)
    want, got = torch_step(tiny_model, feeds), ort_step(native, feeds)
    assert len(want) == len(got) == 1 + 2 * layers
    for w, g in zip(want, got):
        assert np.abs(w - g).max() < 1e-4
    # the new keys landed at slots L_b .. L_b+5 and nothing else moved
    untouched = np.ones(CAPACITY, dtype=bool)
    untouched[11:17] = False
    assert np.array_equal(got[1][0][:, untouched], feeds["past_key_0"][0][:, untouched])


def test_a_wrong_rotary_layout_fails_that_check(tiny_model):
    """Negative control: the interleaved rotary convention (another model family's) must not pass."""
    native = native_flavour(trace_step_graph(tiny_model), CAPACITY, tiny_model.config.vocab_size)
    for node in native.graph.node:
        if node.op_type == "RotaryEmbedding":
            node.attribute.append(onnx.helper.make_attribute("interleaved", 1))
    feeds = step_inputs(tiny_model)
    want, got = torch_step(tiny_model, feeds), ort_step(native, feeds)
    assert np.abs(want[0] - got[0]).max() > 1e-2


def test_half_precision_flavour_has_the_same_nodes(tiny_model):
    import copy
    fp32 = native_flavour(trace_step_graph(tiny_model), CAPACITY, tiny_model.config.vocab_size)
    bf16 = native_flavour(trace_step_graph(copy.deepcopy(tiny_model).to(torch.bfloat16)), CAPACITY,
                          tiny_model.config.vocab_size)
    assert [n.op_type for n in bf16.graph.node] == [n.op_type for n in fp32.graph.node]
    caches = {v.type.tensor_type.elem_type for v in bf16.graph.input if v.name.startswith("past_")}
    assert caches == {onnx.TensorProto.BFLOAT16}


def test_profiles_that_miss_a_runtime_step_shape_are_refused():
    limits = EngineLimits(max_batch=2, max_context=64, max_draft_len=4, max_tree_size=20)
    check_coverage(derive_profiles(limits), limits)
    with pytest.raises(ValueError, match="do not cover a verify step of batch 1 x 2 new tokens"):
        check_coverage(derive_profiles(limits)[:1], limits)
    too_short = derive_profiles(EngineLimits(max_batch=2, max_context=32, max_draft_len=4, max_tree_size=20))
    with pytest.raises(ValueError, match="prefill step of batch 1 x 64 new tokens"):
        check_coverage(too_short, limits)


# ---- real TensorRT for RTX builds -----------------------------------------------------------------------------

def write_tiny_rtx_build(root: Path, name: str, model, **engine) -> Path:
    source = save_hf_checkpoint(model, root / f"{name}-model")
    recipe = write_recipe(root / f"{name}.yaml", source, source, name=name, backend="auto", tensorrt="rtx",
                          compute_capabilities=["sm86", "sm89"], trt_precision="fp16", max_context=128,
                          max_tree_size=64, **engine)
    return build(recipe, root=root)


@pytest.fixture(scope="module")
def tiny_rtx(tmp_path_factory, tiny_model):
    """Two tiny builds with real RTX plans: the one under test, and one of another recipe."""
    if not HAS_RTX:
        pytest.skip(f"needs TensorRT for RTX ({RTX.install_hint})")
    root = tmp_path_factory.mktemp("rtx")
    return {"this": write_tiny_rtx_build(root, "tiny-rtx", tiny_model),
            "other": write_tiny_rtx_build(root, "tiny-rtx-other", tiny_model, max_batch=2)}


@needs_rtx
def test_the_parser_maps_tree_attention_to_native_layers(tiny_rtx):
    import tensorrt_rtx as trt
    logger = trt.Logger(trt.Logger.ERROR)
    network = trt.Builder(logger).create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    assert parser.parse_from_file(str(tiny_rtx["this"] / "target" / "model.rtx.onnx"))
    kinds = Counter(network.get_layer(i).type.name for i in range(network.num_layers))
    assert (kinds["ATTENTION_INPUT"], kinds["KV_CACHE_UPDATE"], kinds["ROTARY_EMBEDDING"]) == (2, 4, 4)
    assert not {"PLUGIN", "PLUGIN_V2", "PLUGIN_V3"} & set(kinds)


@needs_rtx
def test_tiny_plans_are_built_and_recorded(tiny_rtx):
    root = tiny_rtx["this"]
    manifest = read_manifest(root)
    assert manifest.tensorrt.status == "built" and len(manifest.tensorrt.plans) == 2
    for plan in manifest.tensorrt.plans:
        path = root / plan.path
        assert path.name == "engine.rtx.plan" and plan.bytes == path.stat().st_size > 10_000
        assert plan.sha256 == sha256_file(path) and plan.recipe_sha256 == recipe_fingerprint(manifest.recipe)
        assert plan.edition == "rtx" and plan.compute_capabilities == ["sm86", "sm89"]
        assert plan.precision == "fp16" and plan.onnx == f"{plan.role}/model.rtx.onnx"
        assert [p.name for p in plan.profiles] == ["decode", "verify", "tree", "prefill"]
        assert plan.profiles[0].shapes["past_key_0"] == [[1, 2, 128, 16], [4, 2, 128, 16], [4, 2, 128, 16]]
        assert (root / plan.log).read_text().count("[ssd-trt] built in") == 1
        assert manifest.validation[f"{plan.role}_rtx"]["passed"]


@needs_rtx
@pytest.mark.parametrize("layers", [1, 2])
def test_a_feature_pair_gets_plans_for_both_models(tmp_path, layers):
    """Issue 19 on TensorRT for RTX: the target's plan returns its features, the EAGLE-3 draft's plan takes them
    (and its own carried hidden, and which of the two each token carries) with every profile covering them;
    a two-layer draft (item 5) binds one cache pair per layer."""
    import yaml

    from tests.test_feature_draft import write_feature_head
    target = random_decoder(tiny_config(layers=3), seed=5)
    head = write_feature_head(tmp_path / "head", target, layers=layers)
    recipe = write_recipe(tmp_path / "f.yaml", save_hf_checkpoint(target, tmp_path / "target"), head,
                          name="tiny-feature-rtx", backend="auto", tensorrt="rtx", compute_capabilities=["sm86"],
                          trt_precision="fp16", max_context=128, max_tree_size=64)
    data = yaml.safe_load(recipe.read_text())
    data["draft"]["kind"] = "eagle3"
    recipe.write_text(yaml.safe_dump(data))
    root = build(recipe, root=tmp_path)
    manifest = read_manifest(root)
    assert manifest.tensorrt.status == "built" and {p.role for p in manifest.tensorrt.plans} == {"target", "draft"}
    assert manifest.validation["draft_rtx"]["passed"] and manifest.validation["target_rtx"]["passed"]
    target_graph = onnx.load(str(root / "target" / "model.rtx.onnx"), load_external_data=False)
    assert target_graph.graph.output[-1].name == "features"
    draft = manifest.tensorrt.plan("draft", "rtx")
    for profile in draft.profiles:
        low, _, high = profile.shapes["features"]
        assert low[2] == high[2] == 3 * 64 and profile.shapes["from_target"][2] == high[:2]
        assert profile.shapes["draft_hidden"][2] == high[:2] + [64]
        assert {name for name in profile.shapes if name.startswith("past_key_")} == \
            {f"past_key_{i}" for i in range(layers)}


@needs_rtx
def test_an_fp32_plan_marks_attention_decomposable(tmp_path, tiny_model):
    """TensorRT for RTX has no fp32 attention kernel: the build splits it (and says so in the manifest)."""
    (tmp_path / "target").mkdir()
    graph = native_flavour(trace_step_graph(tiny_model), 64, tiny_model.config.vocab_size)
    onnx.save(graph, tmp_path / "target" / "model.rtx.onnx")
    limits = EngineLimits(max_batch=1, max_context=64, max_draft_len=3, max_tree_size=8)
    entry = build_engine(RTX, "target", tmp_path, limits, "fp32", ("sm89", "sm120"), "f" * 64)
    assert entry["decomposable_attention_layers"] == 2 and (tmp_path / entry["path"]).stat().st_size > 10_000


@needs_rtx
def test_a_graph_the_parser_cannot_map_fails_the_build_clearly(tmp_path):
    from tests.test_trt_build import tiny_step_graph, tiny_weights
    (tmp_path / "target").mkdir()
    plugin_graph = tiny_step_graph(tiny_weights(), capacity=64)       # the data-centre flavour: a plugin node
    onnx.save(plugin_graph, tmp_path / "target" / "model.rtx.onnx")
    limits = EngineLimits(max_batch=4, max_context=64, max_draft_len=3, max_tree_size=8)
    with pytest.raises(ValueError, match="TensorRT for RTX takes no plugins: build from the rtx flavour"):
        build_engine(RTX, "target", tmp_path, limits, "fp16", ("sm89",), "f" * 64)
    # past the pre-check, the parser itself refuses it, and the error names the file and the parser's reason
    with pytest.raises(RuntimeError, match=r"tensorrt_rtx could not parse .*model.rtx.onnx: .*tree_attention"):
        _build_with_tensorrt(RTX, "target", tmp_path, tmp_path / "target" / "model.rtx.onnx",
                             tmp_path / "target" / "engine.rtx.plan", tmp_path / "target" / "build.rtx.log",
                             [], "fp16", ("sm89",), "f" * 64)
    assert not (tmp_path / "target" / "engine.rtx.plan").exists()


@needs_rtx
def test_profiles_that_miss_a_step_fail_the_build(tmp_path, tiny_model):
    (tmp_path / "draft").mkdir()
    onnx.save(native_flavour(trace_step_graph(tiny_model), 64, tiny_model.config.vocab_size),
              tmp_path / "draft" / "model.rtx.onnx")
    limits = EngineLimits(max_batch=1, max_context=64, max_draft_len=3, max_tree_size=8)
    with pytest.raises(ValueError, match="do not cover a verify step of batch 1 x 2 new tokens"):
        build_engine(RTX, "draft", tmp_path, limits, "fp32", ("sm89",), "f" * 64,
                     profiles=derive_profiles(limits)[:2])
    assert not (tmp_path / "draft" / "engine.rtx.plan").exists()


@needs_rtx
def test_the_embedded_default_gets_real_plans_for_both_models(smollm2_build):
    manifest = read_manifest(smollm2_build)
    assert manifest.recipe.engine.tensorrt == "rtx", "the embedded default builds TensorRT for RTX plans"
    assert manifest.tensorrt.status == "built", manifest.tensorrt.reason
    sizes = {}
    for role in ("target", "draft"):
        plan = manifest.tensorrt.plan(role, "rtx")
        assert plan is not None and plan.precision == "bf16" and len(plan.compute_capabilities) >= 2
        assert plan.sha256 == sha256_file(smollm2_build / plan.path)
        assert [p.name for p in plan.profiles] == ["decode", "verify", "tree", "prefill"]
        validation = manifest.validation[f"{role}_rtx"]
        assert validation["passed"] and validation["same_nodes_as_twin"] and validation["max_abs_error"] < 1e-2
        sizes[role] = plan.bytes
    # bf16 weights: the target's 135M parameters (and its untied head copy) and the draft's ~20M
    assert sizes["target"] > 200 * 2**20 and 20 * 2**20 < sizes["draft"] < sizes["target"]


# ---- checks at load -------------------------------------------------------------------------------------------

@needs_rtx
def test_a_plan_is_refused_at_load_when_it_does_not_fit(tiny_rtx, tmp_path):
    root = tmp_path / "build"
    shutil.copytree(tiny_rtx["this"], root)
    manifest = read_manifest(root)
    assert check_plan(root, manifest, "target", "rtx", "sm89").role == "target"
    with pytest.raises(ArtifactError, match=r"kernels for sm86, sm89, not for this GPU \(sm120\); add sm120 to "
                                            "engine.compute_capabilities"):
        check_plan(root, manifest, "target", "rtx", "sm120")
    with pytest.raises(ArtifactError, match="no sm90 kernels: on a Hopper GPU use the data-centre edition"):
        check_plan(root, manifest, "draft", "rtx", "sm90")
    with pytest.raises(ArtifactError, match="has no datacenter TensorRT plan for the target"):
        check_plan(root, manifest, "target", "datacenter", "sm90")

    # a plan of another recipe copied over this one: its size and sha256 are not the manifest's
    other = tiny_rtx["other"]
    shutil.copy(other / "draft" / "engine.rtx.plan", root / "draft" / "engine.rtx.plan")
    with pytest.raises(ArtifactError, match=r"the manifest says \d+ \(truncated or replaced\)"):
        check_plan(root, manifest, "draft", "rtx", "sm89")
    # ... and with its manifest entry too: the recipe it was built from is not this build's
    data = json.loads((root / "manifest.json").read_text())
    theirs = json.loads((other / "manifest.json").read_text())["tensorrt"]["plans"]
    data["tensorrt"]["plans"] = [p for p in data["tensorrt"]["plans"] if p["role"] != "draft"] + \
        [p for p in theirs if p["role"] == "draft"]
    (root / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ArtifactError, match="was built from another recipe than this build's 'tiny-rtx'"):
        check_plan(root, read_manifest(root), "draft", "rtx", "sm89")

    # truncated: refused by the plan check and by the build's artifact check when a Generator loads it
    shutil.copytree(tiny_rtx["this"], tmp_path / "truncated")
    plan = tmp_path / "truncated" / "target" / "engine.rtx.plan"
    plan.write_bytes(plan.read_bytes()[: plan.stat().st_size // 2])
    with pytest.raises(ArtifactError, match="truncated or replaced"):
        check_plan(tmp_path / "truncated", read_manifest(tmp_path / "truncated"), "target", "rtx", "sm89")
    from ssd_trt.runtime import Generator
    with pytest.raises(ArtifactError, match=r"engine.rtx.plan has \d+ bytes, the manifest says \d+ \(truncated"):
        Generator(tmp_path / "truncated")


@needs_rtx
def test_without_a_gpu_the_plans_are_not_used_and_trt_says_why(tiny_rtx):
    from ssd_trt.runtime import Generator, RuntimeOptions
    if PROBE["run"]:
        pytest.skip("a GPU is visible: this checks the CPU fallback")
    generator = Generator(tiny_rtx["this"])
    assert generator.engines.backend("target") == "ort"       # auto: ONNX Runtime on this CPU
    strict = Generator(tiny_rtx["this"], RuntimeOptions(backend="trt"))
    with pytest.raises(ArtifactError, match="no target plan can run here: rtx: .*no CUDA device"):
        strict.engines.backend("target")


@needs_rtx
def test_the_runtime_calls_only_api_that_tensorrt_rtx_has():
    """TensorRTEngine runs RTX plans with the calls it makes for data-centre ones; without a GPU to run them,
    at least every call it makes must exist in tensorrt_rtx's bindings (an API drift fails here, not on a GPU)."""
    import inspect
    import io
    import tokenize

    import tensorrt_rtx as trt

    from ssd_trt.engines import bindings, tensorrt
    owners = {"context": trt.IExecutionContext, "engine": trt.ICudaEngine, "_engine": trt.ICudaEngine,
              "_runtime": trt.Runtime}
    calls = set()
    for module in (tensorrt, bindings):     # attribute accesses in code (not in strings or comments)
        names = [t.string for t in tokenize.generate_tokens(io.StringIO(inspect.getsource(module)).readline)
                 if t.type in (tokenize.NAME, tokenize.OP)]
        calls |= {(a, c) for a, b, c in zip(names, names[1:], names[2:]) if a in owners and b == "."}
    assert len(calls) >= 12
    alternatives = {("context", "device_memory"), ("engine", "device_memory_size")}   # used only when the v2 call is absent
    missing = [f"{owner}.{name}" for owner, name in calls
               if (owner, name) not in alternatives and not hasattr(owners[owner], name)]
    assert not missing, f"tensorrt_rtx lacks {missing}"
    for path in ("ExecutionContextAllocationStrategy.USER_MANAGED", "TensorIOMode.INPUT", "Logger.WARNING"):
        obj = trt
        for part in path.split("."):
            obj = getattr(obj, part)
    assert {"FLOAT", "HALF", "BF16", "INT64", "INT32"} <= set(dir(trt.DataType))   # bindings' _TRT_TYPES


# ---- on an RTX-class GPU --------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.trt
@pytest.mark.skipif(not PROBE["run"], reason=f"running a TensorRT for RTX plan needs an sm86/89/120 GPU: "
                                             f"{PROBE['reason']}")
def test_rtx_plans_decode_like_onnx_runtime(smollm2_build):
    """Greedy SD and SSD on the plans token-identical to AR on the plans; AR close to ONNX Runtime's."""
    from ssd_trt.decoding.params import SamplingParams
    from ssd_trt.runtime import Generator, RuntimeOptions
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    params = SamplingParams(max_new_tokens=32, temperature=0.0)
    on_plans = Generator(smollm2_build, RuntimeOptions(backend="trt"))
    ar = [r.token_ids for r in on_plans.generate(prompts, params, mode="ar")]
    for mode in ("sd", "ssd"):
        assert [r.token_ids for r in on_plans.generate(prompts, params, mode=mode)] == ar
    reference = Generator(smollm2_build, RuntimeOptions(backend="ort"))
    agreeing = [a[:8] == r.token_ids[:8] for a, r in zip(ar, reference.generate(prompts, params, mode="ar"))]
    assert sum(agreeing) >= 2          # bf16 vs int8 activations: the first tokens mostly agree
