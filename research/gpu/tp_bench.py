#!/usr/bin/env python
"""The paper's layout at real size: a target split over N GPUs, the draft whole on GPU N, through the public runtime.

Writes random checkpoints of real shapes (no weights can be downloaded: speed does not depend on their values), builds
them for the torch backend at ``engine.tensor_parallel: N`` (and at 1 when one GPU holds the target), then runs greedy
AR, SD and SSD on each build (rank r on GPU r over NCCL, the draft on GPU N, ``engines/tensor_parallel.py``):
tokens/s after a warm-up, acceptance, SSD's cache hit rate, and whether SD and SSD give AR's tokens (they must).

Random weights make a draft that agrees with its target by chance only: the draft here is the target's own
checkpoint truncated to its first ``--draft-layers`` layers (same vocabulary, embedding and head), which agrees
often enough for speculation to be exercised; acceptance is not the paper's, speed per step and losslessness are
what this measures.

    python research/gpu/tp_bench.py --tensor-parallel 2 --json tp_bench.json     # 3 GPUs: ranks on 0-1, draft on 2
    python research/gpu/tp_bench.py --device cpu --smoke                          # the code path on 2 CPU ranks

Exit code 0 when every build's SD and SSD equal its AR, 1 when one does not, 2 when the host lacks the GPUs.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ssd_trt.models.config import DecoderConfig  # noqa: E402
from tests.helpers import save_word_tokenizer, write_random_checkpoint, write_recipe  # noqa: E402

# Llama-3.1-8B's shape: at N = 2 each rank holds ~8 GB of bf16 weights (the 70B needs N = 4 and 140 GB of disk)
TARGET = DecoderConfig(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                       num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
SMOKE = replace(TARGET, vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=8,
                num_kv_heads=4, head_dim=8)


def truncated_draft(target_dir: Path, config: DecoderConfig, layers: int, directory: Path) -> Path:
    """The target's checkpoint cut to its first ``layers`` decoder layers: a draft sharing its vocabulary, embedding
    and head (read tensor by tensor, never the whole target in memory)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    directory.mkdir(parents=True, exist_ok=True)
    state = {}
    for shard in sorted(target_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as tensors:
            for name in tensors.keys():
                if ".layers." not in name or int(name.split(".layers.")[1].split(".")[0]) < layers:
                    state[name] = tensors.get_tensor(name)
    save_file(state, str(directory / "model.safetensors"))
    hf = json.loads((target_dir / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**hf, "num_hidden_layers": layers}, indent=1))
    save_word_tokenizer(config.vocab_size, directory)
    return directory


def run_build(build_dir: Path, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy AR, SD and SSD on one build (torch backend), each timed after a warm-up of the same requests."""
    import ssd_trt
    from ssd_trt import SamplingParams
    from ssd_trt.runtime import RuntimeOptions
    params = SamplingParams(max_new_tokens=new_tokens, stop_on_eos=False)
    generator = ssd_trt.load(build_dir, RuntimeOptions(backend="torch"))
    result: dict = {}
    try:
        reference = None
        for mode in ("ar", "sd", "ssd"):
            generator.generate_ids(prompts[:1], SamplingParams(max_new_tokens=4, stop_on_eos=False), mode=mode)
            started = time.perf_counter()
            outputs = [generator.generate_ids([ids], params, mode=mode)[0] for ids in prompts]
            seconds = time.perf_counter() - started
            tokens = [o.token_ids for o in outputs]
            reference = tokens if mode == "ar" else reference
            result[mode] = {"tokens_per_s": sum(map(len, tokens)) / seconds, "equals_ar": tokens == reference,
                            "mean_accepted": outputs[0].stats.get("mean_accepted"),
                            "cache_hit_rate": outputs[0].stats.get("cache_hit_rate")}
        target = generator.engine("target")
        result["target_engine"] = type(target).__name__
        result["draft_device"] = str(generator.engine("draft").caches[0][0].device)
    finally:
        close = getattr(generator.engines.opened.get("target"), "close", None)
        if close is not None:
            close()
    result["ok"] = result["sd"]["equals_ar"] and result["ssd"]["equals_ar"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A target split over N GPUs, the draft on GPU N: speed and exactness.")
    parser.add_argument("--tensor-parallel", type=int, default=2, metavar="N", help="target ranks (GPUs 0 .. N-1)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--smoke", action="store_true", help="a tiny model (the code path, e.g. on CPU)")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--work-dir", type=Path, help="where the checkpoints and builds go (default: a temp dir)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    ranks = args.tensor_parallel
    if args.device == "cuda" and torch.cuda.device_count() < ranks + 1:
        print(f"tp_bench: {ranks} target ranks and the draft need {ranks + 1} GPUs, "
              f"{torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    if args.device == "cpu" and torch.cuda.is_available():
        print("tp_bench: --device cpu on a host with GPUs: hide them (CUDA_VISIBLE_DEVICES=)", file=sys.stderr)
        return 2
    from ssd_trt.build import build
    config = SMOKE if args.smoke else TARGET
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="ssd-tp-bench-"))
    report: dict = {"torch": torch.__version__, "tensor_parallel": ranks, "draft_layers": args.draft_layers,
                    "target_shape": {k: getattr(config, k) for k in ("num_layers", "hidden_size", "num_heads",
                                                                       "num_kv_heads", "intermediate_size",
                                                                       "vocab_size")},
                    "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                    if args.device == "cuda" else ["cpu"], "builds": {}}
    started = time.perf_counter()
    target = write_random_checkpoint(config, work / "target", shards=4, seed=1,
                                     dtype=torch.float32 if args.smoke else torch.bfloat16,
                                     std=0.15 if args.smoke else 0.02)
    draft = truncated_draft(target, config, args.draft_layers, work / "draft")
    report["checkpoint_seconds"] = time.perf_counter() - started
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (16 + 8 * i,), generator=generator).tolist()
               for i in range(args.prompts)]
    dtype = "float32" if args.smoke else "bfloat16"
    # the whole target too, for comparison, when one GPU has room for it beside its caches (8B bf16: 16 GB); not on
    # CPU, where the unsplit torch backend runs the attention kernel in Triton's interpreter
    splits = [ranks] + ([1] if args.device == "cuda" and torch.cuda.get_device_properties(0).total_memory > 40e9
                        else [])
    for split in splits:
        recipe = write_recipe(work / f"tp{split}.yaml", target, draft, name=f"tp{split}", backend="torch",
                              tensor_parallel=split, max_batch=4, max_context=512 if not args.smoke else 256)
        settings = yaml.safe_load(recipe.read_text())
        settings["target"]["dtype"] = settings["draft"]["dtype"] = dtype
        recipe.write_text(yaml.safe_dump(settings))
        started = time.perf_counter()
        build_dir = build(recipe, root=work)
        report["builds"][f"tp{split}"] = {"build_seconds": time.perf_counter() - started,
                                          **run_build(build_dir, prompts, 8 if args.smoke else args.new_tokens)}
        print(f"tp{split}:", json.dumps(report["builds"][f"tp{split}"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    ok = all(b["ok"] for b in report["builds"].values())
    print("tp bench:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
