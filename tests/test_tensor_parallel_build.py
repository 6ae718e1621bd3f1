"""A tensor-parallel target (issue 49) built for ONNX / TensorRT: one step graph, weight file and plan per rank.

CPU, always: each rank's graph holds its Megatron slice of the checkpoint, and the ranks' graphs joined into one (each
all-reduce marker replaced by the sum over the ranks) compute the whole model, with key/value heads replicated
when there are fewer than ranks, while one rank's graph alone does not (which is why ONNX Runtime is refused); a
tensor_parallel that does not divide the heads, or a recipe that could not run a split target, fails before any weight
is read, exit status 2. With TensorRT for RTX (CI installs it): a GQA model built at tensor_parallel 2 gets one plan per
rank, each with two native all-reduce layers per decoder layer (counted in the parsed network and in the plan), all
recorded in the manifest; a missing or corrupt rank file is refused at load. Running the plans needs a GPU per rank:
here their checks, and the rank path up to the NCCL communicator (which CPU ranks refuse, saying why).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import yaml

from ssd_trt.engines.editions import DATACENTER, RTX
from ssd_trt.errors import ArtifactError, RecipeError
from ssd_trt.export.tensor_parallel import export_rank_graphs, rank_dir
from ssd_trt.models.checkpoint import Checkpoint
from ssd_trt.models.sharding import MARKER_PREFIX, marker_nodes, rank_split
from tests.helpers import random_decoder, save_hf_checkpoint, tiny_config, write_random_checkpoint, write_recipe

ROOT = Path(__file__).resolve().parents[1]
HAS_RTX = RTX.installed()
needs_rtx = pytest.mark.skipif(not HAS_RTX, reason=f"needs TensorRT for RTX ({RTX.install_hint})")
# GQA: 8 query heads, 4 key/value heads, 4 layers, head_dim 16 (TensorRT for RTX's attention kernels need >= 16)
GQA = replace(tiny_config(layers=4, hidden=128), num_heads=8, num_kv_heads=4, head_dim=16)
LAYERS = GQA.num_layers


def gqa_checkpoint(directory: Path, **changes) -> Path:
    return write_random_checkpoint(replace(GQA, **changes), directory, shards=2, seed=3, dtype=torch.float32, std=0.15)


def tp_recipe(root: Path, target: Path, ranks: int, **engine) -> Path:
    draft = root / "draft"
    if not draft.exists():
        save_hf_checkpoint(random_decoder(tiny_config(layers=1, hidden=64), seed=2), draft)
    settings = dict(backend="auto", tensorrt="rtx", compute_capabilities=["sm89"], trt_precision="fp16",
                    max_context=128, max_tree_size=32, max_draft_len=4, max_batch=2, tensor_parallel=ranks)
    path = write_recipe(root / f"tp{ranks}.yaml", target, draft, name=f"tiny-tp{ranks}", **{**settings, **engine})
    recipe = yaml.safe_load(path.read_text())
    recipe["target"]["check_layers"] = 2
    recipe["decoding"] = {"sd_draft_len": 2, "ssd_draft_len": 2, "ssd_fan_out_budget": 8}
    path.write_text(yaml.safe_dump(recipe))
    return path


# ---- the rank graphs, in ONNX Runtime (no TensorRT needed) -------------------------------------------------------

@pytest.mark.parametrize("ranks, kv_heads", [(2, 4), (4, 2)])
def test_the_ranks_joined_by_their_all_reduces_compute_the_whole_model(tmp_path, ranks, kv_heads):
    """Rank graphs side by side in one ONNX graph, rank r's marker output the sum over the ranks of the marker's
    input (what the all-reduce layers do), give the whole model's logits on every rank and each rank's key/value
    heads of the whole model's caches; (4, 2): fewer key/value heads than ranks, each one held by two ranks."""
    from ssd_trt.export.tensor_parallel_check import bounded_rank_validation
    checkpoint = Checkpoint.open(gqa_checkpoint(tmp_path / "ckpt", num_kv_heads=kv_heads))
    results = bounded_rank_validation(checkpoint, 2, ranks, [(1, 1), (2, 5)], native_capacity=48, traced=True)
    for flavour in ("rtx", "trt"):
        result = results[flavour]
        assert result["passed"] and result["ranks_agree"] and result["max_abs_error"] < 1e-4, (flavour, result)
        assert "first 2 of 4" in result["scope"]


def test_one_rank_graph_alone_is_not_the_model(tmp_path):
    """Negative control, and why ONNX Runtime is refused: run as a whole model, a rank's markers pass its partial
    sums on as if complete."""
    import onnxruntime as ort

    from ssd_trt.export.onnx_export import ort_flavour
    from ssd_trt.export.validate import sample_feeds
    from ssd_trt.models.loading import decoder_from_checkpoint
    checkpoint = Checkpoint.open(gqa_checkpoint(tmp_path / "ckpt", num_layers=1))
    split = rank_split(checkpoint.config, 2, "the test model")
    ranks = export_rank_graphs(checkpoint, split, tmp_path / "target", "weights.trt.bin", torch.float32)
    path = rank_dir(tmp_path / "target", 0) / "model.ort.onnx"
    onnx.save_model(ort_flavour(ranks.graphs[0]), path)
    feeds = dict(sample_feeds(checkpoint.config, 1, 3, seed=0))
    first, last = split.kv_head_range(0)
    rank_feeds = {name: value[:, first:last] if name.startswith("past_") else value for name, value in feeds.items()}
    logits = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["logits"], rank_feeds)[0]
    model = decoder_from_checkpoint(checkpoint.hf_config, {n: checkpoint.tensor(n) for n in checkpoint.tensors})
    with torch.no_grad():
        t = {name: torch.from_numpy(value) for name, value in feeds.items()}
        want = model(t["input_ids"], t["position_ids"], t["tree_mask"], t["cache_lengths"],
                     *[t[n] for n in feeds if n.startswith("past_")], logit_indices=t["logit_indices"])[0].numpy()
    assert np.abs(logits - want).max() > 0.1


def test_each_rank_holds_its_megatron_slice_and_two_markers_per_layer(tmp_path):
    """Rank 1 of 2: query heads 4-7 (rows 64-127 of q_proj, columns of o_proj), key/value heads 2-3, MLP columns
    128-255 of gate/up and rows of down; embedding, norms and head whole. Markers follow o_proj and down_proj."""
    from onnx import numpy_helper
    checkpoint = Checkpoint.open(gqa_checkpoint(tmp_path / "ckpt"))
    split = rank_split(checkpoint.config, 2, "the test model")
    ranks = export_rank_graphs(checkpoint, split, tmp_path / "target", "weights.trt.bin", torch.float16)
    assert ranks.markers == 2 * LAYERS
    graph = ranks.graphs[1]
    markers = marker_nodes(graph)
    assert [m.name for m in markers[:2]] == [f"{MARKER_PREFIX}layers.0.self_attn.o_proj",
                                             f"{MARKER_PREFIX}layers.0.mlp.down_proj"]
    producer = {out: node for node in graph.graph.node for out in node.output}
    assert producer[markers[0].input[0]].input[1] == "model.layers.0.self_attn.o_proj.weight_t"
    onnx.save_model(graph, rank_dir(tmp_path / "target", 1) / "model.onnx")
    saved = onnx.load(str(rank_dir(tmp_path / "target", 1) / "model.onnx"))      # weights read back from the file
    weights = {init.name: numpy_helper.to_array(init) for init in saved.graph.initializer}

    def hf(name: str) -> np.ndarray:
        return checkpoint.tensor(name).to(torch.float16).numpy()
    slices = {"self_attn.q_proj": np.s_[64:], "self_attn.k_proj": np.s_[32:], "self_attn.v_proj": np.s_[32:],
              "self_attn.o_proj": np.s_[:, 64:], "mlp.gate_proj": np.s_[128:], "mlp.up_proj": np.s_[128:],
              "mlp.down_proj": np.s_[:, 128:]}
    for module, rows in slices.items():      # the graph holds W^T: rank 1's rows / columns of the HF [out, in] W
        name = f"model.layers.2.{module}.weight"
        np.testing.assert_array_equal(weights[name + "_t"], hf(name)[rows].T)
    np.testing.assert_array_equal(weights["model.embed_tokens.weight"], hf("model.embed_tokens.weight"))
    np.testing.assert_array_equal(weights["model.lm_head.weight_t"], hf("lm_head.weight").T)


def test_the_plan_build_checks_the_markers_for_either_edition(tmp_path):
    """Before TensorRT: a rank graph is refused as a one-rank plan (its partial sums would pass as whole), and the
    data-centre flavour of a rank goes through the same checks as TensorRT for RTX's, up to TensorRT itself."""
    from ssd_trt.engines.limits import EngineLimits
    from ssd_trt.export.native_graph import native_flavour
    from ssd_trt.export.onnx_export import save_engine_flavours
    from ssd_trt.trt.engine_build import TensorRTUnavailable, build_engine, check_markers
    checkpoint = Checkpoint.open(gqa_checkpoint(tmp_path / "ckpt"))
    split = rank_split(checkpoint.config, 2, "the test model")
    ranks = export_rank_graphs(checkpoint, split, tmp_path / "target", "weights.trt.bin", torch.float16)
    paths = save_engine_flavours(ranks.graphs[0], rank_dir(tmp_path / "target", 0), datacenter=True,
                                 native=native_flavour(ranks.graphs[0], 128, GQA.vocab_size))
    for flavour in ("trt", "rtx"):
        graph = onnx.load(str(paths[flavour]), load_external_data=False)
        assert check_markers(graph, 2) == 2 * LAYERS
        with pytest.raises(ValueError, match="is a tensor-parallel rank's .8 all-reduce markers. but the plan is built "
                                             "for one rank"):
            check_markers(graph, 1)
    limits = EngineLimits(max_batch=2, max_context=128, max_draft_len=4, max_tree_size=32)
    if not DATACENTER.installed():
        with pytest.raises(TensorRTUnavailable, match="cannot build a datacenter TensorRT plan here"):
            build_engine(DATACENTER, "target", tmp_path, limits, "fp16", (), "f" * 64, rank=0, num_ranks=2)


@pytest.mark.parametrize("change, message", [
    ({"tensor_parallel": 3}, r"engine.tensor_parallel: 3 cannot split the target .*: its 8 attention heads do not "
                             r"divide into 3 ranks .*choose one of \[1, 2, 4, 8\]"),
    ({"tensor_parallel": 2, "tensorrt": "none"},
     r"sets engine.tensor_parallel: 2, but the recipe asks for ONNX Runtime only \(engine.tensorrt: none\), which "
     r"cannot run a split target"),
    ({"tensor_parallel": 2, "backend": "ort"}, r"ONNX Runtime has no all-reduce"),
])
def test_a_split_the_build_cannot_make_fails_before_reading_weights(tmp_path, monkeypatch, change, message):
    from ssd_trt.build import build

    def no_reads(self, name):
        raise AssertionError(f"read {name} before the recipe was checked")
    target = gqa_checkpoint(tmp_path / "target")
    engine = dict(change)
    recipe = tp_recipe(tmp_path, target, engine.pop("tensor_parallel"), **engine)
    monkeypatch.setattr(Checkpoint, "tensor", no_reads)
    with pytest.raises(RecipeError, match=message):
        build(recipe, root=tmp_path)
    assert not (tmp_path / "build").exists(), "nothing is written before the split is checked"


def test_a_bad_tensor_parallel_size_exits_2_with_one_paragraph(tmp_path):
    recipe = tp_recipe(tmp_path, gqa_checkpoint(tmp_path / "target"), 3)
    result = subprocess.run([sys.executable, "-m", "ssd_trt.build", str(recipe)], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    error = result.stderr[result.stderr.index("ssd_trt.build: error:"):].strip()
    assert "\n" not in error and "do not divide into 3 ranks" in error, error


# ---- real TensorRT for RTX plans, one per rank ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tp_build(tmp_path_factory) -> Path:
    """The GQA model at tensor_parallel 2, TensorRT for RTX plans (sm89, fp16), and a small whole draft."""
    if not HAS_RTX:
        pytest.skip(f"needs TensorRT for RTX ({RTX.install_hint})")
    from ssd_trt.build import build
    root = tmp_path_factory.mktemp("tp")
    return build(tp_recipe(root, gqa_checkpoint(root / "target"), 2), root=root)


def _plan_all_reduces(path: Path) -> set[str]:
    """The all-reduce layers named in a serialised TensorRT for RTX plan (its per-profile listing; read from the bytes,
    as deserialising a plan needs a GPU)."""
    names = re.findall(rb'comm_allreduce=\{ name="([^"]+)"', path.read_bytes())
    return {name.decode().split(" [profile")[0] for name in names}


@needs_rtx
def test_each_rank_gets_a_plan_with_two_all_reduces_per_decoder_layer(tp_build):
    from ssd_trt.manifest import read_manifest, recipe_fingerprint, sha256_file
    manifest = read_manifest(tp_build)
    split = manifest.tensor_parallel
    assert (split.num_ranks, split.query_heads_per_rank, split.kv_heads_per_rank, split.mlp_columns_per_rank) == \
        (2, 4, 2, 128)
    assert [r.dir for r in split.ranks] == ["target/rank0", "target/rank1"]
    assert all(r.all_reduce_markers == 2 * LAYERS for r in split.ranks)
    listed = {a.path: a for a in manifest.artifacts}
    for rank in split.ranks:
        assert set(rank.files) == {"rtx", "trt_weights"}
        for path in rank.files.values():         # every rank file is an artifact with its size and sha256
            assert listed[path].sha256 == sha256_file(tp_build / path)
    assert not (tp_build / "target" / "model.ort.onnx").exists(), "no ONNX Runtime graph of a split target"
    plans = manifest.tensorrt.rank_plans("target", "rtx")
    assert [p.rank for p in plans] == [0, 1] and manifest.tensorrt.plan("target", "rtx") is None
    for plan in plans:
        assert plan.path == f"target/rank{plan.rank}/engine.rtx.plan"
        assert plan.onnx == f"target/rank{plan.rank}/model.rtx.onnx"
        assert plan.collective_layers == 2 * LAYERS and listed[plan.path].sha256 == plan.sha256
        assert plan.sha256 == sha256_file(tp_build / plan.path) and plan.recipe_sha256 == recipe_fingerprint(
            manifest.recipe)
        assert _plan_all_reduces(tp_build / plan.path) == {f"{MARKER_PREFIX}layers.{i}.{m}.all_reduce"
                                                           for i in range(LAYERS)
                                                           for m in ("self_attn.o_proj", "mlp.down_proj")}
        assert f"rank {plan.rank} of 2: {2 * LAYERS} all-reduce layers" in (tp_build / plan.log).read_text()
    draft = manifest.tensorrt.plan("draft", "rtx")
    assert draft.rank is None and draft.collective_layers == 0 and not _plan_all_reduces(tp_build / draft.path)
    check = manifest.validation["target_rtx"]
    assert check["passed"] and check["ranks_agree"] and "first 2 of 4" in check["scope"]


@needs_rtx
def test_the_parsed_rank_network_reads_an_all_reduce_wherever_it_read_a_marker(tp_build):
    import tensorrt_rtx as trt

    from ssd_trt.trt.collectives import insert_all_reduces
    logger = trt.Logger(trt.Logger.ERROR)
    network = trt.Builder(logger).create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    assert trt.OnnxParser(network, logger).parse_from_file(str(tp_build / "target" / "rank1" / "model.rtx.onnx"))
    assert insert_all_reduces(trt, network, 2) == 2 * LAYERS
    layers = [network.get_layer(i) for i in range(network.num_layers)]
    collectives = [layer for layer in layers if layer.type == trt.LayerType.DIST_COLLECTIVE]
    assert len(collectives) == 2 * LAYERS
    markers = {layer.get_output(0).name for layer in layers if layer.name.startswith(MARKER_PREFIX)
               and layer.type == trt.LayerType.IDENTITY}
    inputs = {layer.get_input(i).name: layer for layer in layers for i in range(layer.num_inputs)
              if layer.get_input(i) is not None}
    assert len(markers) == 2 * LAYERS and not markers & set(inputs), "a layer still reads a marker's output"
    for collective in collectives:
        collective.__class__ = trt.IDistCollectiveLayer
        assert collective.num_ranks == 2
        assert inputs[collective.get_output(0).name].type == trt.LayerType.ELEMENTWISE   # the residual add


@needs_rtx
@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_missing_or_corrupt_rank_file_is_refused_at_load(tp_build, tmp_path, damage):
    from ssd_trt.runtime import Generator
    root = tmp_path / "build"
    shutil.copytree(tp_build, root)
    if damage == "missing":
        (root / "target" / "rank1" / "weights.trt.bin").unlink()
        message = (r"tensor-parallel rank 1 \(of 2\)'s file .*target/rank1/weights.trt.bin listed in the manifest is "
                   r"missing")
    else:
        path = root / "target" / "rank0" / "engine.rtx.plan"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        message = r"tensor-parallel rank 0 \(of 2\)'s file .*target/rank0/engine.rtx.plan does not match its sha256"
    with pytest.raises(ArtifactError, match=message + r".*; rebuild with `python -m ssd_trt.build"):
        Generator(root)


@needs_rtx
def test_onnx_runtime_refuses_a_split_target_and_says_why(tp_build):
    from ssd_trt.runtime import Generator, RuntimeOptions
    for backend in ("ort", None):        # asked for, or the CPU fallback of auto
        generator = Generator(tp_build, RuntimeOptions(backend=backend) if backend else None)
        with pytest.raises(ArtifactError, match=r"splits the target over 2 tensor-parallel ranks .*ONNX Runtime has "
                                                r"no all-reduce, so it cannot run the rank graphs"):
            generator.engine("target")
        assert generator.engine("draft") is not None       # the draft is whole: it runs as before
    manifest = json.loads((tp_build / "manifest.json").read_text())
    assert manifest["validation"]["target"]["ort_graph"].startswith("none: 2 tensor-parallel ranks")


@needs_rtx
def test_the_torch_backend_runs_a_split_build_made_for_tensorrt(tp_build):
    """The split GPU recipes' alternative to the rank plans: `--backend torch` on the same build (the target over 2
    ranks from the checkpoint the manifest records); greedy SSD equals its AR."""
    from ssd_trt.decoding.params import SamplingParams
    from ssd_trt.runtime import Generator, RuntimeOptions
    generator = Generator(tp_build, RuntimeOptions(backend="torch"))
    params = SamplingParams(max_new_tokens=12, stop_on_eos=False)
    try:
        ar = generator.generate_ids([[3, 14, 15, 9, 2]], params, mode="ar")[0].token_ids
        ssd = generator.generate_ids([[3, 14, 15, 9, 2]], params, mode="ssd")[0].token_ids
        assert len(ar) == 12 and ssd == ar
        assert type(generator.engine("target")).__name__ == "TensorParallelEngine"
    finally:
        generator.engine("target").close()


# ---- the rank plans' runtime: one TensorRT engine per GPU, joined by an NCCL communicator -------------------------

@needs_rtx
def test_the_rank_plans_are_checked_together_before_any_is_loaded(tp_build):
    """One plan per rank, each with its all-reduce layers and kernels for the GPU: else refused, saying which rank."""
    from ssd_trt.engines.plans import check_rank_plans
    from ssd_trt.manifest import read_manifest
    manifest = read_manifest(tp_build)
    assert [p.rank for p in check_rank_plans(tp_build, manifest, "target", "rtx", "sm89")] == [0, 1]
    with pytest.raises(ArtifactError, match=r"rank 0 \(of 2\)'s TensorRT plan .* has kernels for sm89, not for this "
                                            r"GPU \(sm90\) \(TensorRT for RTX 1.7 builds no sm90 kernels"):
        check_rank_plans(tp_build, manifest, "target", "rtx", "sm90")
    plans = manifest.tensorrt.plans
    one_rank = manifest.model_copy(update={"tensorrt": manifest.tensorrt.model_copy(
        update={"plans": [p for p in plans if p.rank != 1]})})
    with pytest.raises(ArtifactError, match=r"splits the target over 2 ranks but has rtx TensorRT plans for rank \[0\]"
                                            r".*; rebuild with `python -m ssd_trt.build"):
        check_rank_plans(tp_build, one_rank, "target", "rtx", None)
    short = manifest.model_copy(update={"tensorrt": manifest.tensorrt.model_copy(update={"plans": [
        p.model_copy(update={"collective_layers": 2 * LAYERS - 1}) if p.rank == 1 else p for p in plans]})})
    with pytest.raises(ArtifactError, match=rf"plan of target rank 1 .* has {2 * LAYERS - 1} all-reduce layers, its "
                                            rf"{LAYERS} decoder layers need {2 * LAYERS}"):
        check_rank_plans(tp_build, short, "target", "rtx", None)


@needs_rtx
def test_asking_for_the_rank_plans_without_gpus_says_why_they_cannot_run(tp_build):
    from ssd_trt.runtime import Generator, RuntimeOptions
    generator = Generator(tp_build, RuntimeOptions(backend="trt"))
    with pytest.raises(ArtifactError, match=r"splits the target over 2 tensor-parallel ranks .*its TensorRT rank plans "
                                            r"cannot run here: rtx: .*RuntimeOptions\(backend='torch'\)"):
        generator.engine("target")


def test_a_communicator_is_handed_over_as_a_capsule_of_its_pointer():
    import ctypes

    from ssd_trt.engines.communicator import pointer_capsule
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, (ctypes.py_object, ctypes.c_char_p)
    assert get(pointer_capsule(0x7F00DEADBEE0), None) == 0x7F00DEADBEE0
    with pytest.raises(ValueError, match="null NCCL communicator"):
        pointer_capsule(0)


def test_rank_plans_on_ranks_without_nccl_fail_to_start_with_the_reason(tmp_path):
    """The trt rank path up to the communicator, on CPU ranks (gloo): both ranks refuse at once, naming what is
    needed, and none is left running."""
    from ssd_trt.engines.base import EngineSpec
    from ssd_trt.engines.limits import EngineLimits
    from ssd_trt.engines.rank_worker import RankLaunch
    from ssd_trt.engines.tensor_parallel import TensorParallelEngine
    from ssd_trt.errors import EngineError
    spec = EngineSpec("target", 256, 2, 2, 16, 2, 64)
    launch = RankLaunch(checkpoint="", dtype="float32", limits=EngineLimits(max_batch=2, max_context=64), ranks=2,
                        on_gpu=False, kernel="", use_cuda_graphs=False, collective_timeout_s=60, backend="trt",
                        plans=(str(tmp_path / "r0.plan"), str(tmp_path / "r1.plan")), edition="rtx", rank_spec=spec)
    with pytest.raises(EngineError, match=r"rank \d of 2 failed to start: RuntimeError: the ranks' process group runs "
                                          r"ProcessGroupGloo, which has no NCCL communicator .* need the NCCL backend"):
        TensorParallelEngine(spec, launch, start_timeout_s=120)
    import multiprocessing
    assert not [child for child in multiprocessing.active_children() if child.name.startswith("ssd-target-rank")]


@pytest.mark.gpu
@pytest.mark.trt
def test_the_rank_plans_over_nccl_give_the_torch_ranks_tokens(tp_build):
    """Three GPUs with kernels for the plans (sm89): the target's two rank plans on GPUs 0 and 1, the draft on GPU 2;
    greedy AR and SSD on them token-identical to the torch backend's ranks on the same build."""
    torch_ok = torch.cuda.is_available() and torch.cuda.device_count() >= 3
    if not torch_ok or "sm{}{}".format(*torch.cuda.get_device_capability(0)) != "sm89":
        pytest.skip("needs 3 GPUs of compute capability sm89 (the test build's plans) and TensorRT for RTX")
    from ssd_trt.decoding.params import SamplingParams
    from ssd_trt.runtime import Generator, RuntimeOptions
    prompts = [[3, 14, 15, 9, 2], [27, 18, 28], [1, 2, 3, 4, 5, 6, 7]]
    params = SamplingParams(max_new_tokens=12, stop_on_eos=False)
    reference = Generator(tp_build, RuntimeOptions(backend="torch"))
    expected = [r.token_ids for r in reference.generate_ids(prompts, params, mode="ar")]
    reference.engine("target").close()
    plans = Generator(tp_build, RuntimeOptions(backend="trt"))
    try:
        for mode in ("ar", "ssd"):
            assert [r.token_ids for r in plans.generate_ids(prompts, params, mode=mode)] == expected, mode
    finally:
        plans.engine("target").close()
