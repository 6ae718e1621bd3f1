"""llama.cpp's own speculative decoding on a real GGUF pair, against its own AR decode (llama-bench).

    python research/real_pair/llama_cpp_pair.py PROMPTS.json \\
        --target build/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \\
        --draft build/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf \\
        --new-tokens 128 --spec-threads 1,2 --draft-max 3,5,8 --bench-threads 1,2 --out runs/llama_cpp_pair.json

PROMPTS.json is a JSON list of strings, fed as raw text (``--chat``: each wrapped in a ChatML user turn, the
Qwen instruct template). Rows:

* ``bench``: ``llama-bench -p 0 -n N -d D`` on the target and on the draft per thread count (AR decode speed, D
  the mean prompt length in target tokens, as llama-speculative counted them; ``--depth`` sets it);
* ``speculative``: ``llama-speculative`` (``--simple``: ``llama-speculative-simple``) per thread count and draft
  length K, greedy, one run per prompt: per-prompt decode tok/s, drafted / accepted tokens, and the aggregate
  (tokens / seconds summed over the prompts, acceptance = accepted / drafted summed), with its speedup over the
  target's llama-bench at the same threads where that was measured.

Both binaries come from ``bash scripts/install_llama_cpp.sh``; cores are pinned from core 0, one per thread.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from ssd_trt.bench import llama_bench                       # noqa: E402
from ssd_trt.bench.settings import Setting                  # noqa: E402

CHATML = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def ints(text: str) -> list[int]:
    return [int(item) for item in text.split(",") if item.strip()]


def aggregate(runs: list[dict]) -> dict:
    tokens = sum(r["decoded_tokens"] for r in runs)
    seconds = sum(r["decode_seconds"] for r in runs)
    drafted = sum(r["n_drafted"] for r in runs)
    accepted = sum(r["n_accept"] for r in runs)
    return {"tokens_per_s": tokens / seconds if seconds > 0 else None, "decoded_tokens": tokens,
            "decode_seconds": seconds, "n_drafted": drafted, "n_accept": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "per_prompt_tokens_per_s": [r["tokens_per_s"] for r in runs]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("prompts", type=Path, help="JSON list of prompt strings")
    p.add_argument("--target", type=Path, default=Path("build/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"))
    p.add_argument("--draft", type=Path, default=Path("build/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"))
    p.add_argument("--chat", action="store_true", help="wrap each prompt in a ChatML user turn")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--spec-threads", type=ints, default=[2], help="comma list of thread counts for llama-speculative")
    p.add_argument("--draft-max", type=ints, default=[3], help="comma list of draft lengths K")
    p.add_argument("--draft-min", type=int, default=0)
    p.add_argument("--p-min", type=float, default=0.0)
    p.add_argument("--simple", action="store_true", help="llama-speculative-simple (honours --draft-min/--p-min)")
    p.add_argument("--bench-threads", type=ints, default=[1, 2], help="comma list of thread counts for llama-bench "
                                                                       "(empty: none)")
    p.add_argument("--bench-repetitions", type=int, default=llama_bench.REPETITIONS)
    p.add_argument("--depth", type=int, default=None, help="llama-bench's context depth (default: the mean prompt "
                                                           "length in target tokens, 0 without speculative runs)")
    p.add_argument("--poll", type=int, default=None, help="llama-speculative's --poll (0: threads sleep when idle; "
                                                          "default: llama.cpp's 50)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per llama-speculative run")
    p.add_argument("--out", type=Path, default=Path("runs/llama_cpp_pair.json"))
    args = p.parse_args(argv)

    prompts = json.loads(args.prompts.read_text())
    if not isinstance(prompts, list) or not all(isinstance(x, str) for x in prompts) or not prompts:
        p.error(f"{args.prompts}: expected a non-empty JSON list of strings")
    texts = [CHATML.format(x) if args.chat else x for x in prompts]
    spec_name = "llama_speculative_simple" if args.simple else "llama_speculative"
    for name in ([spec_name] if args.spec_threads and args.draft_max else []) + (
            ["llama_bench"] if args.bench_threads else []):
        reason = llama_bench.unavailable_reason(name)
        if reason:
            p.error(reason)
    for path in (args.target, args.draft):
        if not path.is_file():
            p.error(f"{path}: no such GGUF")

    started = time.perf_counter()
    speculative = []
    for threads in args.spec_threads:
        cores = tuple(range(threads))
        for k in args.draft_max:
            runs = []
            for index, text in enumerate(texts):
                run = llama_bench.run_llama_speculative(args.target, args.draft, text, args.new_tokens, threads, cores,
                                                        k, args.draft_min, args.p_min, simple=args.simple,
                                                        poll=args.poll, timeout=args.timeout)
                runs.append({"prompt": index, **run})
                print(f"speculative t={threads} K={k} prompt {index}: {run['tokens_per_s']:.2f} tok/s, "
                      f"accept {run['n_accept']}/{run['n_drafted']}", file=sys.stderr)
            speculative.append({"threads": threads, "draft_max": k, "aggregate": aggregate(runs), "runs": runs})

    prompt_lengths = [r["prompt_tokens"] for row in speculative for r in row["runs"] if r["prompt_tokens"] is not None]
    depth = args.depth if args.depth is not None else (
        round(sum(prompt_lengths) / len(prompt_lengths)) if prompt_lengths else 0)
    bench = []
    for threads in args.bench_threads:
        setting = Setting(name=f"{threads}t", description=f"{threads} thread(s) on cores 0..{threads - 1}",
                          single_threads=threads)
        for role, gguf in (("target", args.target), ("draft", args.draft)):
            row = llama_bench.run_llama_bench(gguf, setting, args.new_tokens, depth, args.bench_repetitions)
            bench.append({"model": role, **row})
            print(f"llama-bench {role} t={threads}: {row['tokens_per_s']:.2f} tok/s", file=sys.stderr)

    target_ar = {row["threads"]: row["tokens_per_s"] for row in bench if row["model"] == "target"}
    for row in speculative:
        ar = target_ar.get(row["threads"])
        speed = row["aggregate"]["tokens_per_s"]
        row["aggregate"]["speedup_vs_llama_bench"] = speed / ar if ar and speed else None

    result = {"target": str(args.target), "draft": str(args.draft), "prompts": prompts, "chat": args.chat,
              "new_tokens": args.new_tokens, "depth": depth, "binary": llama_bench.BINARIES[spec_name],
              "bench": bench, "speculative": speculative, "wall_s": time.perf_counter() - started,
              "command": " ".join(sys.argv)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for row in speculative:
        a = row["aggregate"]
        print(f"speculative t={row['threads']} K={row['draft_max']}: {a['tokens_per_s']:.2f} tok/s, acceptance "
              f"{a['acceptance']}, speedup vs llama-bench {a['speedup_vs_llama_bench']}")
    for row in bench:
        print(f"llama-bench {row['model']} t={row['threads']}: {row['tokens_per_s']:.2f} tok/s")
    print(f"wrote {args.out} ({result['wall_s']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
