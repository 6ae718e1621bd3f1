"""The build's checks for a streamed (large) model: real, at full width, on the checkpoint's first layers.

A model too large to hold twice in fp32 is checked through its first ``layers`` decoder layers with the real
embedding, final norm and LM head, cut to the vocabulary's first ``CHECK_TOKENS`` tokens (``checked_cut``):

* **parity**: the project's decoder against transformers' implementation of the same cut checkpoint (fp32
  logits on a fixed token sequence), as ``parity.transformers_parity`` does for a whole small model;
* **validation**: the cut checkpoint exported by the same streamed code as the full graph (same types, same
  quantization), run in ONNX Runtime against a torch decoder holding exactly the graph's weights (dequantized
  where they are blocks), on the recipe's step shapes (Polygraphy, ``validate.py``);
* **rtx**: the native-attention rewrite of the cut checkpoint's fp32 graph, the same way.

The full graph is written by the same functions; what is checked on it without running it is its structure
(``streamed.check_structure``). Each result says what it covered (``scope``).
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from ssd_trt.export.onnx_export import save_flavours
from ssd_trt.export.parity import PARITY_TOKENS, decoder_logits
from ssd_trt.export.streamed import export_streamed, first_layers, first_tokens, reference_decoder
from ssd_trt.export.validate import validate_with_polygraphy
from ssd_trt.models.checkpoint import Checkpoint


# tokens of the vocabulary a bounded check keeps (embedding and head rows): every head kernel and block kind is
# exercised on them as on the full rows, without holding several fp32 copies of a 150k-token head and embedding
CHECK_TOKENS = 8192


def checked_cut(checkpoint: Checkpoint, layers: int) -> Checkpoint:
    """What the bounded checks run: the first ``layers`` decoder layers, the first ``CHECK_TOKENS`` tokens."""
    return first_tokens(first_layers(checkpoint, layers), CHECK_TOKENS)


def scope(checkpoint: Checkpoint, layers: int) -> str:
    total = checkpoint.config.num_layers
    tokens = checked_cut(checkpoint, layers).config.vocab_size
    vocab = checkpoint.config.vocab_size
    rows = "" if tokens == vocab else f", cut to the first {tokens} of its {vocab} tokens"
    return (f"the first {min(layers, total)} of {total} decoder layers at full width, with the real embedding, "
            f"final norm and LM head{rows} (the full graph is written by the same code; its structure is checked)")


def bounded_parity(checkpoint: Checkpoint, layers: int) -> dict:
    """Max |logit difference| between this project's decoder and transformers on the cut checkpoint (fp32)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ssd_trt.models.loading import decoder_from_checkpoint
    cut = checked_cut(checkpoint, layers)
    state = {name: cut.tensor(name).float() for name in cut.tensors}
    ours = decoder_from_checkpoint(cut.hf_config, state)
    ids = torch.tensor([[t % cut.config.vocab_size for t in PARITY_TOKENS]])
    config = AutoConfig.for_model(**cut.hf_config)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = reference.load_state_dict(state, strict=False, assign=True)
    if cut.config.tie_word_embeddings:
        reference.tie_weights()
        missing = [name for name in missing if name != "lm_head.weight"]
    missing = [name for name in missing if not name.endswith("inv_freq")]
    if missing or unexpected:
        raise ValueError(f"transformers' {config.model_type} does not take the cut checkpoint: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    for name, buffer in reference.named_buffers():   # rotary tables were made on the meta device: rebuild them
        if buffer.is_meta:
            _rebuild_rotary(reference)
            break
    with torch.no_grad():
        expected = reference.eval()(ids).logits
    got = decoder_logits(ours, ids)
    return {"max_abs_diff": float((got - expected).abs().max()), "logit_scale": float(expected.abs().max()),
            "tokens": ids.shape[1], "reference": "transformers AutoModelForCausalLM of the cut checkpoint",
            "scope": scope(checkpoint, layers)}


def _rebuild_rotary(model) -> None:
    """Re-create transformers' rotary embedding modules on the CPU (their buffers are computed, not loaded)."""
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if type(child).__name__.endswith("RotaryEmbedding"):
                setattr(parent, name, type(child)(config=model.config))


def bounded_validation(checkpoint: Checkpoint, layers: int, bits: int | None, shapes: list[tuple[int, int]],
                       max_positions: int, native_capacity: int | None = None, file_blocks: bool = False,
                       keep_8bit: bool = True) -> dict[str, dict]:
    """ONNX Runtime vs torch on the cut checkpoint's ``ort`` graph, written by the same code as the full one and
    run as the engine runs it (caches in place), and on its native-attention rewrite when ``native_capacity``
    is given; ``{"ort": result, "rtx": result}``."""
    from ssd_trt.export.native_graph import native_flavour
    from ssd_trt.export.streamed_fused import export_ort_graph
    cut = checked_cut(checkpoint, layers)
    results = {}
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch)
        graph, binding, form = export_ort_graph(cut, out, bits, max_positions, keep_computed=True,
                                                file_blocks=file_blocks, keep_8bit=keep_8bit)
        path = (save_flavours(None, out, datacenter=False, fused=graph) if form == "fused" else
                save_flavours(graph, out, datacenter=False))["ort"]
        results["ort"] = validate_with_polygraphy(reference_decoder(cut.config, binding.computed), path, shapes,
                                                  in_place=True)
        if native_capacity is not None:
            (out / "rtx").mkdir()
            plain, binding = export_streamed(cut, out / "rtx", "weights.bin", torch.float32, None, keep_computed=True)
            native = native_flavour(plain, native_capacity, cut.config.vocab_size)
            path = save_flavours(plain, out / "rtx", datacenter=False, native=native)["rtx"]
            results["rtx"] = {**validate_with_polygraphy(reference_decoder(cut.config, binding.computed), path,
                                                         shapes, capacity=native_capacity),
                              "checked_as": "fp32 rewrite of the cut checkpoint's graph"}
    for result in results.values():
        result["scope"] = scope(checkpoint, layers)
    return results
