"""Test helpers: tiny real checkpoints (HF format + a real WordLevel tokenizer) built by the real pipeline."""
from __future__ import annotations

import importlib.util
import sys
import json
from pathlib import Path
from types import ModuleType

import torch
import yaml

from ssd_trt.models.config import DecoderConfig
from ssd_trt.models.decoder import Decoder

TINY_VOCAB = 256


def tiny_config(layers: int = 2, hidden: int = 64, vocab: int = TINY_VOCAB) -> DecoderConfig:
    return DecoderConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)


def random_decoder(config: DecoderConfig, seed: int, scale: float = 0.15) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0, scale)
        # sharp next-token distributions, like a trained LM: a strong output head
        model.lm_head.weight.mul_(6.0)
    return model.eval()


def perturbed(model: Decoder, seed: int, amount: float) -> Decoder:
    torch.manual_seed(seed)
    copy = Decoder(model.config)
    copy.load_state_dict(model.state_dict())
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(torch.randn_like(param) * amount * param.std())
    return copy.eval()


def hf_llama_config(c: DecoderConfig, dtype: str = "float32") -> dict:
    """The HF config.json of a Llama-family decoder (llama, qwen2, qwen3, mistral) of config ``c``."""
    architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "mistral": "MistralForCausalLM"}[c.model_type]
    hf = {"architectures": [architecture], "model_type": c.model_type, "vocab_size": c.vocab_size,
          "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
          "num_hidden_layers": c.num_layers, "num_attention_heads": c.num_heads,
          "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps,
          "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
          "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": 1, "eos_token_id": 2,
          "hidden_act": "silu", "attention_bias": c.attention_bias, "mlp_bias": False, "torch_dtype": dtype}
    if c.rope_scaling:
        hf["rope_scaling"] = dict(c.rope_scaling)
    return hf


def save_word_tokenizer(vocab_size: int, directory: Path) -> None:
    """A real WordLevel tokenizer over ``vocab_size`` words (w3, w4, ...), saved in HF format."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)


def save_hf_checkpoint(model: Decoder, directory: Path) -> Path:
    from safetensors.torch import save_file

    c = model.config
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_llama_config(c), indent=1))
    state = {("model." + k if not k.startswith("lm_head") else k): v.contiguous()
             for k, v in model.state_dict().items() if k != "inv_freq"}
    save_file(state, str(directory / "model.safetensors"))
    save_word_tokenizer(c.vocab_size, directory)
    return directory


def write_random_checkpoint(config: DecoderConfig, directory: Path, shards: int = 1, seed: int = 0,
                            dtype: torch.dtype = torch.bfloat16, std: float = 0.02) -> Path:
    """A random-weight HF checkpoint of any size, written shard by shard (never the whole model in memory):
    every weight N(0, std) (the embedding too: a much larger one makes a tied head repeat the last token), norms
    1. With ``shards`` > 1, files model-0000i-of-0000N.safetensors and model.safetensors.index.json."""
    from safetensors.torch import save_file

    from ssd_trt.models.checkpoint import expected_tensors
    directory.mkdir(parents=True, exist_ok=True)
    names = list(expected_tensors(config).items())
    generator = torch.Generator().manual_seed(seed)
    per_shard = -(-len(names) // shards)
    weight_map = {}
    for index in range(shards):
        file = "model.safetensors" if shards == 1 else f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        state = {}
        for name, shape in names[index * per_shard:(index + 1) * per_shard]:
            if "norm" in name:
                tensor = torch.ones(shape, dtype=dtype)
            else:
                tensor = (torch.randn(shape, generator=generator) * std).to(dtype)
            state[name] = tensor
            weight_map[name] = file
        save_file(state, str(directory / file))
        del state
    if shards > 1:
        (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    name = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[dtype]
    (directory / "config.json").write_text(json.dumps(hf_llama_config(config, name), indent=1))
    save_word_tokenizer(config.vocab_size, directory)
    return directory


def write_recipe(path: Path, target: Path, draft: Path, name: str = "tiny", decoding: dict | None = None,
                 **engine) -> Path:
    recipe = {"name": name, "output_dir": str(path.parent / "build" / name),
              "target": {"source": str(target)}, "draft": {"source": str(draft)},
              "engine": {"backend": "ort", "max_batch": 4, "max_context": 256, "max_draft_len": 8,
                         "max_tree_size": 96, **engine}}
    if decoding:
        recipe["decoding"] = decoding
    path.write_text(yaml.safe_dump(recipe))
    return path


def load_script(path: Path) -> ModuleType:
    """A script (research/<topic>/*.py, not a package) imported as a module, so tests can call its functions."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module        # registered first: a dataclass in it looks its module up there
    spec.loader.exec_module(module)
    return module


# hidden 2048, 16 layers, 32 query / 8 key-value heads, MLP 8192, tied head, Llama-3 rotary scaling: the body
# of Llama-3.2-1B, with SmolLM2's vocabulary size (49152) instead of 128256
LLAMA_1B_BODY = DecoderConfig(
    model_type="llama", vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32,
    num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
    tie_word_embeddings=True, rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def cut_copy(source: Path, destination: Path, layers: int) -> Path:
    """The first ``layers`` layers of a checkpoint as a checkpoint of its own (a draft sharing the target's
    embedding and head)."""
    from safetensors.torch import save_file

    from ssd_trt.export.streamed import first_layers
    from ssd_trt.models.checkpoint import Checkpoint
    cut = first_layers(Checkpoint.open(source), layers)
    destination.mkdir(parents=True)
    save_file({name: cut.tensor(name) for name in cut.tensors}, str(destination / "model.safetensors"))
    (destination / "config.json").write_text(json.dumps(cut.hf_config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (destination / name).write_bytes((source / name).read_bytes())
    return destination
