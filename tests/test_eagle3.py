"""The EAGLE-3 draft module and the released checkpoint layout (issue 19, items 2 and 6; no decoding yet).

A synthetic head with exactly the released layout (names and shapes of the one published for
Llama-3.1-8B-Instruct, at a small width; no hub at run time) loads; the module computes what an
independent plain-torch transcription of the EAGLE-3 layer computes, with its KV cache (prefill of target-
featured tokens, then a token carrying the draft's own feature); a damaged checkpoint is refused naming
what is wrong.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ssd_trt_plugins.tree_attention.reference import causal_tree_mask
from ssd_trt.errors import RecipeError
from ssd_trt.models.eagle3 import Eagle3Draft, default_feature_layers, load_eagle3_checkpoint, released_shapes

HIDDEN, HEADS, KV_HEADS, VOCAB, DRAFT_VOCAB, TARGET_LAYERS = 64, 4, 2, 256, 48, 12


def released_config() -> dict:
    """config.json as the released heads spell it (LlamaForCausalLMEagle3), at a small width."""
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": HIDDEN,
            "intermediate_size": 2 * HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": VOCAB,
            "draft_vocab_size": DRAFT_VOCAB, "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}


def write_head(directory, seed=0, drop=(), reshape=None, embed=False, d2t_shift=0):
    """A head with the released names and shapes, random values; the draft vocabulary: every 5th target id."""
    from ssd_trt.models.eagle3 import Eagle3Config
    rng = np.random.default_rng(seed)
    config = Eagle3Config.from_hf_dict(released_config(), TARGET_LAYERS)
    state = {}
    for name, shape in released_shapes(config).items():
        if name.endswith("norm.weight"):
            state[name] = torch.from_numpy(1 + 0.1 * rng.standard_normal(shape)).to(torch.bfloat16)
        elif name not in ("d2t", "t2d"):
            state[name] = torch.from_numpy(rng.standard_normal(shape) / math.sqrt(shape[-1])).to(torch.bfloat16)
    target_ids = torch.arange(DRAFT_VOCAB) * 5
    state["d2t"] = target_ids - torch.arange(DRAFT_VOCAB) + d2t_shift
    state["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    state["t2d"][target_ids] = True
    if embed:
        state["embed_tokens.weight"] = torch.from_numpy(rng.standard_normal((VOCAB, HIDDEN))).to(torch.bfloat16)
    for name in drop:
        state.pop(name)
    if reshape:
        state[reshape] = state[reshape][..., :-1].contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(released_config()))
    return directory


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    directory = write_head(tmp_path_factory.mktemp("eagle3") / "head")
    embeddings = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(1))
    return load_eagle3_checkpoint(directory, TARGET_LAYERS, embeddings), embeddings


def reference_forward(model: Eagle3Draft, ids, positions, carried):
    """The EAGLE-3 layer written out in plain torch (full causal attention, no cache, no tree op)."""
    c = model.config.layer
    state = {k: v.float() for k, v in model.state_dict().items()}

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)

    def rope(x, pos):
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim)).float()
        ang = pos.float()[:, None] * inv[None]
        cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
        half = c.head_dim // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
        return x * cos + rotated * sin

    p = "midlayer."
    x = torch.cat((rms(state["embed_tokens.weight"][ids], state[p + "input_layernorm.weight"]),
                   rms(carried, state[p + "hidden_norm.weight"])), -1)               # [T, 2H]
    q = (x @ state[p + "self_attn.q_proj.weight"].T).view(-1, HEADS, c.head_dim).transpose(0, 1)
    k = (x @ state[p + "self_attn.k_proj.weight"].T).view(-1, KV_HEADS, c.head_dim).transpose(0, 1)
    v = (x @ state[p + "self_attn.v_proj.weight"].T).view(-1, KV_HEADS, c.head_dim).transpose(0, 1)
    q, k = rope(q, positions), rope(k, positions)
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 0), v.repeat_interleave(HEADS // KV_HEADS, 0)
    attn = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    h = carried + attn.transpose(0, 1).reshape(len(ids), -1) @ state[p + "self_attn.o_proj.weight"].T
    m = rms(h, state[p + "post_attention_layernorm.weight"])
    act = torch.nn.functional.silu(m @ state[p + "mlp.gate_proj.weight"].T) * (m @ state[p + "mlp.up_proj.weight"].T)
    h = h + act @ state[p + "mlp.down_proj.weight"].T
    return rms(h, state["norm.weight"]) @ state["lm_head.weight"].T, h


def test_the_released_layout_loads_and_maps_the_draft_vocabulary(head):
    model, embeddings = head
    assert model.config.feature_layers == default_feature_layers(TARGET_LAYERS) == (2, 6, 9)
    assert torch.equal(model.draft_token_ids, torch.arange(DRAFT_VOCAB) * 5)
    assert torch.equal(model.embed_tokens.weight, embeddings)      # the head ships none: the target's
    assert model.fc.weight.shape == (HIDDEN, 3 * HIDDEN)
    assert model.midlayer.self_attn.q_proj.weight.shape == (HEADS * HIDDEN // HEADS, 2 * HIDDEN)


def test_the_module_computes_the_eagle3_layer_with_its_cache(head):
    """Prefill 7 tokens carrying target features, then one token carrying the draft's own output feature:
    the same logits as the plain transcription over all 8 tokens."""
    model, _ = head
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (8,), generator=gen)
    features = torch.randn(8, 3 * HIDDEN, generator=gen)
    positions = torch.arange(8) + 5
    with torch.no_grad():
        caches = model.empty_caches(1, 32)
        caches = [c.clone() for c in caches]
        first, hidden, k, v = model(ids[None, :7], positions[None, :7], torch.from_numpy(causal_tree_mask(1, 7)),
                                    torch.zeros(1, dtype=torch.int32), features[None, :7],
                                    torch.zeros(1, 7, HIDDEN), torch.ones(1, 7, dtype=torch.bool), *caches)
        # token 8 carries the draft's predicted feature: its own output at token 7
        second, _, _, _ = model(ids[None, 7:], positions[None, 7:], torch.from_numpy(causal_tree_mask(1, 1)),
                                torch.tensor([7], dtype=torch.int32), torch.zeros(1, 1, 3 * HIDDEN),
                                hidden[:, -1:], torch.zeros(1, 1, dtype=torch.bool), k, v)
        carried = torch.cat((features[:7] @ model.fc.weight.T, hidden[0, -1:]))
        want_logits, want_hidden = reference_forward(model, ids, positions, carried)
    assert torch.allclose(hidden[0], want_hidden[:7], atol=1e-4)
    got = torch.cat((first[0], second[0]))[:, model.draft_token_ids]
    assert torch.allclose(got, want_logits, atol=1e-4)
    off = torch.ones(VOCAB, dtype=torch.bool)
    off[model.draft_token_ids] = False
    assert torch.isinf(first[..., off]).all() and (first[..., off] < 0).all()   # q = 0 off the draft vocabulary


def test_the_carried_feature_decides_the_output(head):
    """Negative control: feeding the target features as if they were the draft's (no fc) changes the logits."""
    model, _ = head
    gen = torch.Generator().manual_seed(3)
    ids, features = torch.randint(0, VOCAB, (1, 4), generator=gen), torch.randn(1, 4, 3 * HIDDEN, generator=gen)
    args = (ids, torch.arange(4)[None], torch.from_numpy(causal_tree_mask(1, 4)), torch.zeros(1, dtype=torch.int32),
            features, features[..., :HIDDEN])
    with torch.no_grad():
        fused = model(*args, torch.ones(1, 4, dtype=torch.bool), *model.empty_caches(1, 8))[0]
        raw = model(*args, torch.zeros(1, 4, dtype=torch.bool), *model.empty_caches(1, 8))[0]
    finite = torch.isfinite(fused)
    assert (fused[finite] - raw[finite]).abs().max() > 1e-2


@pytest.mark.parametrize("damage, message", [
    (dict(drop=("midlayer.hidden_norm.weight",)), r"missing \['midlayer.hidden_norm.weight'\]"),
    (dict(reshape="fc.weight"), r"fc.weight has shape \[64, 191\], expected \[64, 192\]"),
    (dict(d2t_shift=1), "t2d and d2t disagree"),
])
def test_a_damaged_head_is_refused_naming_the_tensor(tmp_path, damage, message):
    directory = write_head(tmp_path / "head", **damage)
    with pytest.raises(RecipeError, match=message):
        load_eagle3_checkpoint(directory, TARGET_LAYERS, torch.zeros(VOCAB, HIDDEN))


def test_a_head_without_embedding_needs_the_targets(tmp_path):
    directory = write_head(tmp_path / "head")
    with pytest.raises(RecipeError, match="ships no embed_tokens.weight: pass the target's embedding"):
        load_eagle3_checkpoint(directory, TARGET_LAYERS)
    with_embed = write_head(tmp_path / "with", embed=True)
    assert load_eagle3_checkpoint(with_embed, TARGET_LAYERS).embed_tokens.weight.abs().sum() > 0
    config = json.loads((directory / "config.json").read_text())       # layer ids as vLLM-style configs spell them
    config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [1, 4, 9]}
    (directory / "config.json").write_text(json.dumps(config))
    assert load_eagle3_checkpoint(directory, 12, torch.zeros(VOCAB, HIDDEN)).config.feature_layers == (1, 4, 9)
    with pytest.raises(RecipeError, match="feature layer 9 does not exist in a 8-layer target"):
        load_eagle3_checkpoint(directory, 8, torch.zeros(VOCAB, HIDDEN))


# ---- the target's features (item 1) ---------------------------------------------------------------------------

@pytest.mark.parametrize("padded", [False, True], ids=["plain", "row-exact padding"])
def test_the_target_step_graph_returns_the_residual_stream_entering_the_feature_layers(tmp_path, padded):
    from ssd_trt.engines.base import EngineSpec
    from ssd_trt.engines.ort import OrtEngine
    from ssd_trt.export.onnx_export import save_flavours, trace_step_graph
    from ssd_trt.models.decoder import with_target_features
    from tests.helpers import random_decoder, tiny_config
    model = random_decoder(tiny_config(layers=4), seed=4)
    featured = with_target_features(model, (3, 0, 2))
    assert featured.feature_layers == (0, 2, 3) and model.feature_layers == ()
    save_flavours(trace_step_graph(featured), tmp_path, datacenter=False)
    c = model.config
    from ssd_trt.engines.bindings import BindingLayout
    layout = BindingLayout.from_onnx(tmp_path / "model.ort.onnx")      # the contract, with the optional output
    assert layout.tensor("features").roles == ("batch", "tokens", "feature_width")
    assert layout.tensor("features").shape[-1] == 3 * c.hidden_size and not layout.tensor("features").is_input
    assert not layout.tensor("present_key_0").is_input and layout.num_layers == 4
    spec = EngineSpec(name="target", vocab_size=c.vocab_size, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                      head_dim=c.head_dim, max_batch=2, max_context=64)
    engine = OrtEngine(tmp_path / "model.ort.onnx", spec, int8_activations=padded)
    assert engine.has_features
    entering = {}
    hooks = [layer.register_forward_pre_hook(lambda mod, args, i=i: entering.__setitem__(i, args[0]))
             for i, layer in enumerate(model.layers)]
    ids = torch.randint(0, c.vocab_size, (2, 6), generator=torch.Generator().manual_seed(5))
    engine.reset(2)
    caches = model.empty_caches(2, 64)
    for start, stop in ((0, 5), (5, 6)):                       # a prefill, then a one-token step
        positions = torch.arange(start, stop).repeat(2, 1)
        engine.forward(ids[:, start:stop].numpy(), positions.numpy())
        with torch.no_grad():
            out = model(ids[:, start:stop], positions, torch.from_numpy(causal_tree_mask(2, stop - start)),
                        torch.full((2,), start, dtype=torch.int32), *caches)
        caches = list(out[1:])
        want = torch.cat([entering[i] for i in (0, 2, 3)], dim=-1).numpy()
        assert engine.last_features.shape == (2, stop - start, 3 * c.hidden_size)
        assert np.abs(engine.last_features - want).max() < 1e-4
    for hook in hooks:
        hook.remove()


def test_the_draft_exports_as_a_step_graph_that_onnx_runtime_runs(head, tmp_path):
    """Item 2's export: the ORT flavour of the EAGLE-3 step graph computes the module's logits, caches and hidden
    on a tree step over a filled cache, with tokens carrying either kind of feature."""
    import onnxruntime as ort

    from ssd_trt_plugins.tree_attention.reference import pack_tree_mask
    from ssd_trt.export.onnx_export import save_flavours, trace_eagle3_step_graph
    model, _ = head
    save_flavours(trace_eagle3_step_graph(model), tmp_path, datacenter=False)
    gen = torch.Generator().manual_seed(6)
    tree = np.tril(np.ones((5, 5), dtype=bool))
    tree[3:, 1:3] = False
    feeds = {"input_ids": torch.randint(0, VOCAB, (2, 5), generator=gen), "position_ids": torch.tensor(
                 [[9, 10, 11, 10, 11], [4, 5, 6, 5, 6]]),
             "tree_mask": torch.from_numpy(np.broadcast_to(pack_tree_mask(tree), (2, 5, 1)).copy()),
             "cache_lengths": torch.tensor([9, 4], dtype=torch.int32), "logit_indices": torch.tensor([[4, 2], [0, 3]]),
             "features": torch.randn(2, 5, 3 * HIDDEN, generator=gen), "draft_hidden": torch.randn(2, 5, HIDDEN, generator=gen),
             "from_target": torch.tensor([[True, True, False, False, False], [True, False, True, False, True]]),
             "past_key_0": torch.randn(2, KV_HEADS, 24, HIDDEN // HEADS, generator=gen),
             "past_value_0": torch.randn(2, KV_HEADS, 24, HIDDEN // HEADS, generator=gen)}
    with torch.no_grad():
        logits, hidden, keys, values = model(*(feeds[n] for n in ("input_ids", "position_ids", "tree_mask",
                                                                  "cache_lengths", "features", "draft_hidden",
                                                                  "from_target", "past_key_0", "past_value_0")),
                                             logit_indices=feeds["logit_indices"])
    session = ort.InferenceSession(str(tmp_path / "model.ort.onnx"), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()],
                   session.run(None, {name: value.numpy() for name, value in feeds.items()})))
    finite = torch.isfinite(logits).numpy()
    assert np.array_equal(finite, np.isfinite(got["logits"]))
    assert np.abs(got["logits"][finite] - logits.numpy()[finite]).max() < 1e-4
    for name, want in (("present_key_0", keys), ("present_value_0", values), ("hidden", hidden)):
        assert np.abs(got[name] - want.numpy()).max() < 1e-4
