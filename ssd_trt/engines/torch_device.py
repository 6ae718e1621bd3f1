"""The project's torch decoder as a step engine on a GPU, attention by the Triton kernel in place.

This is the GPU runtime without TensorRT: the same :class:`~ssd_trt.engines.device_step.DeviceStepEngine`
(static KV caches, CUDA-graph buckets, a stream per engine) that the TensorRT engine uses, with
the step enqueued by the :class:`~ssd_trt.models.decoder.Decoder` that the exporters trace, its
``ssd::tree_attention`` replaced by the Triton kernel that the TensorRT plugin compiles ahead of time
(``plugins/tree_attention/triton_kernel.py``, ``inplace=True``). It is the runtime's ``torch`` backend
(``generate --backend torch``), what ``research/gpu/gpu_runtime_check.py`` checks on a GPU, and what the
tests run on CPU (the kernel then runs in the Triton interpreter, every step eagerly).
"""
from __future__ import annotations

import functools

import torch

from ssd_trt_plugins.tree_attention.reference import tree_attention_reference
from ssd_trt_plugins.tree_attention.triton_kernel import tree_attention as triton_tree_attention
from ssd_trt.engines.base import EngineSpec
from ssd_trt.engines.device_step import DeviceStepEngine, Placement, StepBuffers, StepExtras
from ssd_trt.models.decoder import Decoder
from ssd_trt.models.eagle3 import Eagle3Draft
from ssd_trt.engines.limits import EngineLimits
from ssd_trt.engines.profiles import derive_profiles


def reference_attention_inplace(query, key_new, value_new, key_cache, value_cache, cache_lengths, tree_mask, scale):
    """The reference math (pure torch) with the engine's in-place cache contract (O(S) per step)."""
    output, keys, values = tree_attention_reference(query, key_new, value_new, key_cache, value_cache,
                                                    cache_lengths, tree_mask, scale)
    key_cache.copy_(keys)
    value_cache.copy_(values)
    return output, key_cache, value_cache


class TorchDeviceEngine(DeviceStepEngine):
    """``model`` on ``device`` in ``dtype``, shaped by ``limits`` (the recipe's engine limits).

    ``kernel`` is ``"triton"`` (the kernel TensorRT gets; the Triton interpreter on CPU) or
    ``"reference"`` (the plain torch math of ``reference.py``: what the kernel is checked against).
    """

    def __init__(self, model: Decoder | Eagle3Draft, limits: EngineLimits, *, name: str = "model",
                 device: torch.device | str = "cuda", dtype: torch.dtype = torch.float32,
                 placement: Placement = Placement(), use_cuda_graphs: bool = True, kernel: str = "triton") -> None:
        device = torch.device(device)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"TorchDeviceEngine on {device} needs a CUDA GPU; torch {torch.__version__} sees "
                                   "none (use device='cpu' to run the kernel in the Triton interpreter)")
            device = torch.device("cuda", placement.device)
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16 (the kernel's), got {dtype}")
        if kernel not in ("triton", "reference"):
            raise ValueError(f"kernel must be 'triton' or 'reference', got {kernel!r}")
        # an EAGLE-3 draft (its one layer's config) takes per-token features; a target may return its own
        self.feature_draft = isinstance(model, Eagle3Draft)
        config = model.config.layer if self.feature_draft else model.config
        if self.feature_draft:
            extras = StepExtras.feature_draft(3 * config.hidden_size, config.hidden_size, dtype)
        elif model.feature_layers:
            extras = StepExtras.target_features(len(model.feature_layers) * config.hidden_size, dtype)
        else:
            extras = StepExtras()
        spec = EngineSpec(name=name, vocab_size=config.vocab_size, num_layers=config.num_layers,
                          num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                          max_batch=limits.max_batch, max_context=limits.max_context)
        # Rotary frequencies stay fp32 whatever the weights' dtype: rounding them to bf16 would shift
        # the angles of far positions by whole radians.
        inv_freq = model.inv_freq.detach().float().clone()
        self.model = model.to(device=device, dtype=dtype).eval()
        self.model.inv_freq = inv_freq.to(device)
        self._attention = functools.partial(triton_tree_attention, inplace=True, check_lengths=False) \
            if kernel == "triton" else reference_attention_inplace
        super().__init__(spec, derive_profiles(limits), device=device, cache_dtype=dtype, logits_dtype=dtype,
                         stream_priority=placement.stream_priority, use_cuda_graphs=use_cuda_graphs, extras=extras)
        self.capture_graphs()

    def _launch(self, profile: int, buffers: StepBuffers) -> None:
        """The decoder over the first ``buffers.rows`` cache rows; the kernel writes the new slots in place."""
        rows = buffers.rows
        caches = [cache[:rows] for pair in self.caches for cache in pair]
        inputs = buffers.inputs
        with torch.no_grad():
            if self.feature_draft:
                logits, hidden, *_ = self.model(inputs["input_ids"], inputs["position_ids"], inputs["tree_mask"],
                                                inputs["cache_lengths"], inputs["features"], inputs["draft_hidden"],
                                                inputs["from_target"], *caches, attention=self._attention,
                                                logit_indices=inputs["logit_indices"])
                buffers.extra_output.copy_(hidden)
            else:
                logits, *rest = self.model(inputs["input_ids"], inputs["position_ids"], inputs["tree_mask"],
                                           inputs["cache_lengths"], *caches, attention=self._attention,
                                           logit_indices=inputs["logit_indices"])
                if buffers.extra_output is not None:
                    buffers.extra_output.copy_(rest[-1])             # the features (Decoder.feature_layers)
            buffers.logits.copy_(logits)
