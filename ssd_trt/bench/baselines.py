"""Peer baselines on the same weights: transformers greedy `generate` and assisted generation."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from ssd_trt.manifest import Manifest


def load_hf_pair(manifest: Manifest) -> tuple[object, object | None, str]:
    """(target, draft or None, note). The draft's reduced head, if any, is expanded to the full
    vocabulary with zero rows: transformers has no reduced-head Llama (greedy output stays exact)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    def load(role: str):
        source = Path(manifest.model(role).source)
        if source.suffix == ".gguf":
            return AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        from safetensors.torch import load_file
        state = {}
        for file in sorted(source.glob("*.safetensors")):
            state.update(load_file(file))
        ids = state.pop("lm_head_token_ids", None)
        if ids is None:
            return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        config = LlamaConfig.from_pretrained(source)
        config.tie_word_embeddings = False
        model = LlamaForCausalLM(config)
        head = torch.zeros(config.vocab_size, config.hidden_size)
        head[ids] = state.pop("lm_head.weight").float()
        state["lm_head.weight"] = head
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
        return model

    target = load("target").eval()
    draft = load("draft").eval()
    note = "draft head expanded to the full vocabulary" if manifest.model("draft").config.head_vocab_size \
        else "same draft weights"
    if manifest.model("draft").hf_config.get("copy_mixture"):
        note += "; the network alone, without the draft's copy component (assisted generation takes a plain model)"
    return target, draft, note


def hf_generate(target, prompt_ids: list[int], max_new_tokens: int, eos_ids: list[int],
                assistant=None) -> tuple[list[int], float, float]:
    """Greedy generation; returns (new tokens, seconds, time to first token measured as one prefill)."""
    ids = torch.tensor([prompt_ids])
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos_ids, pad_token_id=eos_ids[0])
    if assistant is not None:
        kwargs["assistant_model"] = assistant
    with torch.no_grad():
        start = time.perf_counter()
        target(ids[:, :])                      # prefill alone: the TTFT estimate
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        out = target.generate(ids, **kwargs)
        elapsed = time.perf_counter() - start
    return out[0, len(prompt_ids):].tolist(), elapsed, ttft
