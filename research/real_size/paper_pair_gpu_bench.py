"""AR, SD and SSD at real size on a GPU: the paper's pair shapes, acceptance set by an oracle draft.

``python research/real_size/paper_pair_gpu_bench.py --out real_size.json`` builds random-weight models of the exact
Llama-3.1-8B (target) and Llama-3.2-1B (draft) configs on the GPU in bf16 (or loads real checkpoints with
``--target DIR --draft DIR``), runs them on the torch GPU runtime (``engines/torch_device.py``: the Triton
tree-attention kernel, CUDA graphs, the draft on its own GPU when there are two, else on its own stream) and
measures tokens/s of AR, SD and SSD.

Random weights accept nothing, so the draft's *proposals* come from an oracle while its *cost* stays real: the
1B draft runs every step it would run, then its logits are replaced. The oracle knows the target's greedy
continuation (AR's output, computed first); at a token whose whole context (cached tokens and its ancestors in
the step) matches that continuation it proposes the next continuation token with probability ``acceptance``
(drawn once per position, so SD and SSD see the same draws), otherwise a wrong token, with the right one
ranked second (``--bonus-rank2``: the fraction of misses where it is; that is what SSD's forking caches). So the
per-token acceptance is set, and verification still decides: SD and SSD must equal AR token for token.

On CPU with tiny shapes (``--preset tiny --device cpu``) the same code runs in seconds: the test of this script.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

from ssd_trt.decoding.params import SamplingParams  # noqa: E402
from ssd_trt.decoding.settings import AR, SD, SSD, ssd_tree_tokens  # noqa: E402
from tests.engine_generator import GeneratorOverEngines  # noqa: E402
from ssd_trt.engines.limits import EngineLimits  # noqa: E402
from ssd_trt.engines.token_mirror import TokenMirrorEngine  # noqa: E402
from ssd_trt.models.config import DecoderConfig  # noqa: E402
from ssd_trt.models.decoder import Decoder, rope_inverse_frequencies  # noqa: E402


def _llama3_rope(factor: float) -> dict:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def _llama(vocab: int, hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, tied: bool,
           rope: dict | None) -> DecoderConfig:
    return DecoderConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                         num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=hidden // heads,
                         rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
                         tie_word_embeddings=tied, rope_scaling=rope)


# (target, draft): the configs of the released checkpoints (config.json of each), and a tiny pair for CPU
PRESETS = {
    "llama-3.1-8b/llama-3.2-1b": (_llama(128256, 4096, 14336, 32, 32, 8, False, _llama3_rope(8.0)),
                                  _llama(128256, 2048, 8192, 16, 32, 8, True, _llama3_rope(32.0))),
    "tiny": (_llama(512, 64, 128, 2, 4, 2, False, None), _llama(512, 32, 64, 1, 2, 1, True, None)),
}


def random_model(config: DecoderConfig, device: torch.device, dtype: torch.dtype, seed: int) -> Decoder:
    """A decoder of ``config`` with N(0, 0.02) weights made directly on ``device`` (no host copy)."""
    with torch.device("meta"):
        model = Decoder(config)
    model = model.to_empty(device=device).to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.inv_freq = rope_inverse_frequencies(config).to(device)
    return model.eval()


class OracleDraft(TokenMirrorEngine):
    """The draft engine runs as it would; its logits are then replaced by an oracle's (module docstring)."""

    def __init__(self, inner, acceptance: float, bonus_rank2: float, seed: int) -> None:
        super().__init__(inner)
        draws = np.random.default_rng(seed).random((2, inner.spec.max_context + 1))
        self.accept, self.second = draws[0] < acceptance, draws[1] < bonus_rank2
        self.references: list[np.ndarray] = []

    def forward(self, input_ids, position_ids, tree_mask=None, logit_indices=None, **extra):
        start = self.inner.lengths
        self.inner.forward(input_ids, position_ids, tree_mask, logit_indices, **extra)   # the real cost
        self._record(np.asarray(input_ids), start)
        ids = np.asarray(input_ids)
        batch, tokens = ids.shape
        picked = np.tile(np.arange(tokens), (batch, 1)) if logit_indices is None else np.asarray(logit_indices)
        vocab = self.spec.vocab_size
        logits = np.zeros(picked.shape + (vocab,), dtype=np.float32)
        for row in range(batch):
            reference = self.references[row]
            cached = self.cached_tokens(row, 0)[:int(start[row])]
            for column, i in enumerate(picked[row]):
                context = np.concatenate([cached, self.visible(ids, tree_mask, row, int(i))])
                position = len(context)              # the position of the token proposed next
                on_path = position < len(reference) and np.array_equal(context, reference[:position])
                right = int(reference[position]) if on_path else 0
                wrong = (right + 1 + position) % vocab
                if on_path and self.accept[position]:
                    logits[row, column, right] = 30.0
                else:
                    logits[row, column, wrong] = 30.0
                    if on_path and self.second[position]:
                        logits[row, column, right] = 20.0
        return logits


@dataclass
class Run:
    tokens: list[list[int]]
    seconds: float
    stats: dict


def run_mode(mode: str, target, draft, prompts: list[list[int]], new_tokens: int, draft_len: int,
             ssd: SSD, limits: EngineLimits) -> Run:
    """One request batch in ``mode`` through the runtime's engine step over these engines."""
    params = SamplingParams(max_new_tokens=new_tokens, stop_on_eos=False)
    settings = {"ar": AR(), "sd": SD(draft_len=draft_len or 1), "ssd": ssd}[mode]
    gen = GeneratorOverEngines(lambda: target, None if draft is None else (lambda: draft), limits)
    started = time.perf_counter()
    results = gen.generate_ids(prompts, params, mode=settings)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return Run([r.token_ids for r in results], time.perf_counter() - started, results[0].stats)


def bench(args: argparse.Namespace) -> dict:
    from ssd_trt.engines.device_step import Placement, place_draft_and_target
    from ssd_trt.engines.torch_device import TorchDeviceEngine
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    draft_place, target_place = place_draft_and_target(gpus) if gpus else (Placement(), Placement())
    target_config, draft_config = PRESETS[args.preset]
    models = {}
    for role, config, place, seed in (("target", target_config, target_place, 0), ("draft", draft_config, draft_place, 1)):
        where = torch.device("cuda", place.device) if device.type == "cuda" else device
        source = getattr(args, role)
        if source:
            from ssd_trt.models.loading import load_decoder
            from ssd_trt.models.sources import resolve_source
            models[role] = load_decoder(resolve_source(source), dtype)[0]
        else:
            models[role] = random_model(config, where, dtype, seed)
    ssd = SSD(draft_len=args.ssd_k, fan_out_budget=args.ssd_budget)
    tree = ssd_tree_tokens(args.ssd_k, args.ssd_budget)
    # room for the last round's verification and the draft's tree step past the last committed token
    context = args.prompt_tokens + args.new_tokens + tree + 2 * (max(args.sd_k, args.ssd_k) + 1)
    limits = EngineLimits(max_batch=1, max_context=context, max_draft_len=max(args.sd_k, args.ssd_k),
                          max_tree_size=tree)
    kernel = "triton" if device.type == "cuda" else "reference"
    target = TorchDeviceEngine(models["target"], limits, name="target", device=device, dtype=dtype,
                               placement=target_place, kernel=kernel)
    inner_draft = TorchDeviceEngine(models["draft"], limits, name="draft", device=device, dtype=dtype,
                                    placement=draft_place, kernel=kernel)
    rng = np.random.default_rng(args.seed)
    vocab = target_config.vocab_size
    prompts = [[int(t) for t in rng.integers(3, vocab, args.prompt_tokens)] for _ in range(args.prompts)]
    results: dict = {"preset": args.preset, "device": torch.cuda.get_device_name(0) if gpus else str(device),
                     "gpus": gpus, "draft_on_own_gpu": gpus >= 2, "dtype": args.dtype,
                     "target_params": sum(p.numel() for p in models["target"].parameters()),
                     "draft_params": sum(p.numel() for p in models["draft"].parameters()),
                     "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
                     "sd_k": args.sd_k, "ssd_k": args.ssd_k, "ssd_budget": args.ssd_budget, "points": []}
    run_mode("ar", target, None, prompts[:1], min(8, args.new_tokens), 0, ssd, limits)             # warm-up (graphs)
    ar = [run_mode("ar", target, None, [p], args.new_tokens, 0, ssd, limits) for p in prompts]
    ar_seconds = sum(r.seconds for r in ar)
    total = args.new_tokens * len(prompts)
    results["ar_tokens_per_s"] = total / ar_seconds
    for acceptance in args.acceptance:
        draft = OracleDraft(inner_draft, acceptance, args.bonus_rank2, seed=args.seed + 1)
        point = {"acceptance": acceptance}
        for mode, k in (("sd", args.sd_k), ("ssd", args.ssd_k)):
            runs = []
            for prompt, reference in zip(prompts, ar):
                draft.references = [np.array(prompt + reference.tokens[0])]
                if not runs:    # warm-up of this mode's shapes, untimed
                    run_mode(mode, target, draft, [prompt], min(8, args.new_tokens), k, ssd, limits)
                runs.append(run_mode(mode, target, draft, [prompt], args.new_tokens, k, ssd, limits))
            seconds = sum(r.seconds for r in runs)
            exact = all(r.tokens == a.tokens for r, a in zip(runs, ar))
            point[mode] = {"tokens_per_s": total / seconds, "speedup_vs_ar": ar_seconds / seconds, "exact": exact,
                           "mean_accepted": float(np.mean([r.stats["mean_accepted"] for r in runs])),
                           "cache_hit_rate": (float(np.mean([r.stats["cache_hit_rate"] for r in runs]))
                                              if mode == "ssd" else None)}
        point["ssd_vs_sd"] = point["sd"]["tokens_per_s"] and point["ssd"]["tokens_per_s"] / point["sd"]["tokens_per_s"]
        results["points"].append(point)
    results["exact"] = all(p[m]["exact"] for p in results["points"] for m in ("sd", "ssd"))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="research/real_size/paper_pair_gpu_bench.py", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="llama-3.1-8b/llama-3.2-1b")
    parser.add_argument("--target", help="a real HF checkpoint dir instead of random weights of the preset's shape")
    parser.add_argument("--draft", help="a real HF checkpoint dir for the draft")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--acceptance", type=lambda s: [float(x) for x in s.split(",")], default=[0.6, 0.8],
                        help="per-token acceptance rates the oracle draft is set to (comma-separated)")
    parser.add_argument("--bonus-rank2", type=float, default=0.9,
                        help="fraction of rejections where the right token is the draft's second choice")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--sd-k", type=int, default=4)
    parser.add_argument("--ssd-k", type=int, default=4)
    parser.add_argument("--ssd-budget", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("paper_pair_gpu_bench.py: error: no CUDA device (use --preset tiny --device cpu for a dry "
              "run of the code path)", file=sys.stderr)
        return 2
    results = bench(args)
    text = json.dumps(results, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(f"AR {results['ar_tokens_per_s']:.1f} tok/s ({results['device']}, {results['gpus']} GPU(s))")
    for point in results["points"]:
        print(f"acceptance {point['acceptance']:.2f}: SD {point['sd']['tokens_per_s']:.1f} tok/s "
              f"({point['sd']['speedup_vs_ar']:.2f}x AR, {point['sd']['mean_accepted']:.2f} accepted), SSD "
              f"{point['ssd']['tokens_per_s']:.1f} tok/s ({point['ssd']['speedup_vs_ar']:.2f}x AR, "
              f"{point['ssd_vs_sd']:.2f}x SD, hit {point['ssd']['cache_hit_rate']:.2f}); exact "
              f"{point['sd']['exact'] and point['ssd']['exact']}")
    return 0 if results["exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
