"""Bytes per element of what an engine holds, by backend: the build flavour each backend runs.

* TensorRT (``engine.backend`` trt, or auto with a TensorRT edition: on a GPU auto runs the plans): every weight
  in ``engine.trt_precision`` -- the TensorRT flavours carry plain weights in the engine precision whatever
  ``weights`` says (``export/streamed_build.py``; block weights are ONNX Runtime's) -- and the LM head as its
  own transposed copy even when the checkpoint ties it to the embedding (``export/streamed.py``, ``hf_name``).
  KV cache, logits and activations in the same precision.
* torch: the checkpoint's tensors in the recipe's ``dtype`` (``engines/factory.py``); a tied head is the
  embedding itself.
* ONNX Runtime (CPU): float tensors in fp32, linear layers as block-32 integers when ``weights`` asks for them
  (``export/block_weights.py``): int4 codes packed two a byte plus one fp32 scale per 32 weights, int8 codes plus
  the same scales; the LM head quantized too, tied or not (``export/streamed.py``, ``bind_weights``); a GGUF's own
  blocks likewise (Q4_1 adds a second fp32 value per block, its offsets). KV cache and logits in fp32.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ssd_trt.errors import RecipeError
from ssd_trt.recipe import ModelSpec, Recipe

BLOCK = 32
SCALE_BYTES = 4                                   # BlockWeight.scales: float32 [K/32, N]
INT4_BYTES = 0.5 + SCALE_BYTES / BLOCK            # 0.625: pack_int4 puts two 4-bit codes in a byte
INT8_BYTES = 1 + SCALE_BYTES / BLOCK              # 1.125
FLOAT_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True, slots=True)
class Formats:
    """What one engine holds per element. ``linear`` / ``head``: bytes per weight of the projections and the LM head
    (block formats apply to a weight whose in_features is a multiple of 32; others stay ``dense``)."""
    label: str
    dense: float
    linear: float
    head: float
    blocks: bool           # linear / head are block-32 formats
    head_copy: bool        # a tied head is stored apart from the embedding
    cache: int
    activations: int
    on_gpu: bool


def runtime_backend(recipe: Recipe) -> str:
    """The backend the engines run on the devices planned for: trt, torch or ort."""
    engine = recipe.engine
    if engine.backend == "ort" or (engine.backend == "auto" and engine.tensorrt == "none"):
        return "ort"
    return "torch" if engine.backend == "torch" else "trt"


def engine_formats(recipe: Recipe, role: str, gguf_path: Path | None = None) -> Formats:
    """The formats of ``role``'s engine under the recipe's backend (``gguf_path``: the GGUF a ``weights: gguf``
    model's blocks come from)."""
    backend = runtime_backend(recipe)
    spec: ModelSpec = getattr(recipe, role)
    if spec.weights == "gguf" and gguf_path is None:        # refused by the build too (export/block_weights.py)
        raise RecipeError(f"{role}: weights: gguf keeps a GGUF file's own blocks, but its source {spec.source!r} is "
                          "not a .gguf file; use weights: float, int8 or int4 for this model")
    if backend == "torch" and gguf_path is not None:        # refused by the build too (build.build_for_torch)
        raise RecipeError(f"engine.backend: torch runs HF safetensors checkpoints, but the {role} is a .gguf file; "
                          "use engine.backend: auto for this pair")
    if backend in ("trt", "torch"):
        precision = recipe.engine.trt_precision if backend == "trt" else spec.dtype
        size = FLOAT_BYTES[precision]
        return Formats(f"{'TensorRT' if backend == 'trt' else 'torch'} {precision}", dense=size, linear=size,
                       head=size, blocks=False, head_copy=backend == "trt", cache=size, activations=size, on_gpu=True)
    from ssd_trt.export.block_weights import built_bits
    keep_8bit = spec.activations == "int8"    # 8-bit blocks with fp32 activations stay fp32 (block_weights.py)
    bits = built_bits(spec.weights, keep_8bit)          # RecipeError for int8 weights without int8 activations
    if spec.weights == "gguf":
        linear, head = gguf_block_bytes(gguf_path, keep_8bit)
        label = "ONNX Runtime, the GGUF's blocks"
    elif bits is not None:
        linear = head = INT4_BYTES if bits == 4 else INT8_BYTES
        label = f"ONNX Runtime {spec.weights} blocks"
    else:
        linear = head = 4
        label = "ONNX Runtime fp32"
    return Formats(label, dense=4, linear=linear, head=head, blocks=linear != 4 or head != 4, head_copy=True,
                   cache=4, activations=4, on_gpu=False)


LINEAR_NAMES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def graph_bytes(kind: str, keep_8bit: bool) -> float:
    """Bytes per weight of a GGUF block type as the ONNX Runtime graph stores it (``models/gguf_blocks.py``): 4-bit
    or 8-bit codes, a float32 scale per block, and a float32 offset per block for the kinds with a minimum; fp32 for
    float tensors, and for 8-bit kinds without int8 activations (their exact values)."""
    from ssd_trt.models.gguf_blocks import LAYOUTS, WITH_MINIMUM
    layout = LAYOUTS.get(kind)
    bits = None if layout is None else (4 if layout.code_bits == 4 else 8)
    if bits is None or (bits == 8 and not keep_8bit):
        return 4.0
    return bits / 8 + SCALE_BYTES / layout.block * (2 if kind in WITH_MINIMUM else 1)


def gguf_block_bytes(path: Path, keep_8bit: bool) -> tuple[float, float]:
    """Bytes per weight of a GGUF's layer projections (their mean over the file's kinds) and of its LM head
    (``output.weight``, else the tied embedding's blocks), as the ONNX Runtime graph stores them. Reads the
    tensor table only (``gguf.GGUFReader`` maps the file; no weight is read)."""
    import gguf
    total = count = 0
    head = None
    embedding = 4.0
    for tensor in gguf.GGUFReader(str(path)).tensors:
        size = graph_bytes(tensor.tensor_type.name, keep_8bit)
        parts = tensor.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in LINEAR_NAMES:
            total += size * int(tensor.n_elements)
            count += int(tensor.n_elements)
        elif tensor.name == "output.weight":
            head = size
        elif tensor.name == "token_embd.weight":
            embedding = size
    return (total / count if count else 4.0), (embedding if head is None else head)
