"""The fp32 build of the real pair decodes like transformers on the same GGUF files (greedy, token for token).

The build (recipe with ``weights: float``, ``activations: fp32``) dequantizes each GGUF tensor to fp32, as
transformers does when it loads a GGUF (``from_pretrained(dir, gguf_file=...)``). Target: the build's greedy AR
(``generate_ids``, mode ar, batch 1) against transformers' greedy ``generate`` on the same input ids (chat template of
the build's tokenizer), 32 new tokens past EOS. Draft: the build's draft engine run alone (a greedy loop over its
``forward``: a prefill, then one token a step; the runtime never runs the draft as a generator of its own) against
transformers on the draft GGUF. Where a prompt differs, the first differing position's logits tell a near-tie (a
rounding flip of fp32 sums taken in another order) from a bug: transformers' gap between its token and ours, and
ours (the build's logits teacher-forced on its own output) the other way round; along the common prefix, the
largest absolute logit difference. Our engines run first and are freed before transformers loads.

    python research/real_pair/check_transformers.py build/qwen2.5-coder-1.5b-fp32 \
        --build-log docs/bench/real_pair/fp32_build.log --out docs/bench/real_pair/transformers_parity.json
"""
from __future__ import annotations

import argparse
import gc
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ssd_trt  # noqa: E402
from ssd_trt.engines.base import last_indices  # noqa: E402
from record import PROMPTS, build_info, header, load_jsonl, write  # noqa: E402


def options() -> ssd_trt.RuntimeOptions:
    """Each model on both cores, 2 threads; no extra 'alone' sessions (an fp32 target's weights held once)."""
    return ssd_trt.RuntimeOptions(target_threads=2, target_cores=(0, 1), draft_threads=2, draft_cores=(0, 1),
                                  target_alone_threads=2)


def teacher_forced(engine, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The engine's logits at the positions that predict each of ``tokens`` [len(tokens), V], in one prefill."""
    seq = prompt + tokens[:-1]
    engine.reset(1)
    logits = engine.forward(np.array([seq], dtype=np.int64), np.arange(len(seq))[None],
                            logit_indices=last_indices(1, len(seq), len(tokens)))[0]
    engine.rollback(np.zeros(1, dtype=np.int32))
    return logits


def greedy_alone(engine, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """A model engine's own greedy decode: the prompt's prefill, then one token a step; tokens and their logits."""
    engine.reset(1)
    logits = engine.forward(np.array([prompt], dtype=np.int64), np.arange(len(prompt))[None],
                            logit_indices=last_indices(1, len(prompt), 1))[0, -1]
    tokens, rows = [], []
    for step in range(steps):
        rows.append(logits)
        tokens.append(int(np.argmax(logits)))
        if step + 1 < steps:
            logits = engine.forward(np.array([[tokens[-1]]], dtype=np.int64),
                                    np.array([[len(prompt) + step]]))[0, -1]
    engine.rollback(np.zeros(1, dtype=np.int32))
    return tokens, np.stack(rows)


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], np.ndarray]:
    """transformers' greedy ``generate``, EOS off (no early stop), raw logits of every step."""
    import torch
    from transformers import GenerationConfig
    config = GenerationConfig(do_sample=False, max_new_tokens=steps, min_new_tokens=0, eos_token_id=None,
                              pad_token_id=model.config.bos_token_id, repetition_penalty=1.0, num_beams=1,
                              output_logits=True, return_dict_in_generate=True)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    tokens = out.sequences[0, len(prompt):].tolist()
    logits = torch.stack(out.logits)[:, 0].float().numpy()
    if len(tokens) != steps or [int(t) for t in logits.argmax(-1)] != tokens:
        raise RuntimeError(f"transformers' generate did not decode {steps} greedy tokens from its raw logits "
                           f"(got {len(tokens)})")
    return tokens, logits


def compare(ours: list[int], our_logits: np.ndarray, theirs: list[int], hf_logits: np.ndarray, tokenizer) -> dict:
    """Identical, or the first differing position with the logit gaps there; the largest |logit difference| over
    the positions whose context the two share (up to and including the first difference)."""
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    shared = len(ours) if at is None else at + 1
    diff = np.abs(our_logits[:shared] - hf_logits[:shared])
    row = {"identical": at is None, "max_abs_logit_diff": float(diff.max()),
           "max_abs_logit_diff_per_position": [round(float(d), 6) for d in diff.max(-1)],
           "logit_scale": float(np.abs(hf_logits[:shared]).max())}
    if at is not None:
        hf, us = hf_logits[at], our_logits[at]
        top2 = np.sort(hf)[-2:]
        row.update(first_difference=at, our_token=ours[at], hf_token=theirs[at],
                   our_text=tokenizer.decode(ours[at:at + 8]), hf_text=tokenizer.decode(theirs[at:at + 8]),
                   hf_gap=float(hf[theirs[at]] - hf[ours[at]]), hf_top2_gap=float(top2[1] - top2[0]),
                   our_gap=float(us[ours[at]] - us[theirs[at]]))
    return row


def build_record(log: Path) -> dict:
    """Wall time, peak RSS and exit status of the build, from its ``/usr/bin/time -v`` log."""
    text = log.read_text()
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text).group(1)
    seconds = sum(float(part) * 60 ** i for i, part in enumerate(reversed(wall.split(":"))))
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    status = int(re.search(r"Exit status: (\d+)", text).group(1))
    command = re.search(r'Command being timed: "(.*)"', text).group(1)
    return {"command": command, "log": str(log), "wall_s": round(seconds, 1), "peak_rss_bytes": rss_kb * 1024,
            "peak_rss_gib": round(rss_kb / 2 ** 20, 2), "exit_status": status}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("build_dir", type=Path)
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--draft-prompts", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--build-log", type=Path, help="the fp32 build's /usr/bin/time -v log")
    p.add_argument("--out", type=Path, default=Path("docs/bench/real_pair/transformers_parity.json"))
    args = p.parse_args()
    record = header()
    started = time.perf_counter()
    steps = args.max_new_tokens
    prompts = load_jsonl(PROMPTS / "pair.jsonl")[:args.prompts]

    gen = ssd_trt.load(args.build_dir, options())
    tokenizer, manifest = gen.tokenizer, gen.manifest
    sources = {role: manifest.model(role).source for role in ("target", "draft")}
    prompt_ids = [gen.encode(row["prompt"], chat=True) for row in prompts]
    params = ssd_trt.SamplingParams(max_new_tokens=steps, temperature=0, stop_on_eos=False)
    ours, timings = {}, {}
    t = time.perf_counter()
    for row, ids in zip(prompts, prompt_ids):
        [result] = gen.generate_ids([ids], params, mode="ar")
        tokens = list(result.token_ids)
        ours[row["id"]] = (tokens, teacher_forced(gen.engine("target"), ids, tokens))
        print(f"ours target {row['id']}: {tokenizer.decode(tokens)!r}", flush=True)
    timings["ours_target_s"] = round(time.perf_counter() - t, 1)
    t = time.perf_counter()
    draft = gen.engine("draft")
    ours_draft = {row["id"]: greedy_alone(draft, ids, steps)
                  for row, ids in list(zip(prompts, prompt_ids))[:args.draft_prompts]}
    timings["ours_draft_s"] = round(time.perf_counter() - t, 1)
    del gen, draft
    gc.collect()

    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(2)
    results = {}
    for role, wanted, count in (("target", ours, args.prompts), ("draft", ours_draft, args.draft_prompts)):
        t = time.perf_counter()
        source = Path(sources[role])
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
        model.eval()
        load_s = time.perf_counter() - t
        rows = []
        for row, ids in list(zip(prompts, prompt_ids))[:count]:
            tokens, logits = wanted[row["id"]]
            hf_tokens, hf_logits = hf_greedy(model, ids, steps)
            rows.append({"id": row["id"], "category": row["category"], "prompt_tokens": len(ids),
                         **compare(tokens, logits, hf_tokens, hf_logits, tokenizer),
                         "our_tokens": tokens, "hf_tokens": hf_tokens})
            print(f"{role} {row['id']}: " + ("identical" if rows[-1]["identical"] else
                  f"differs at {rows[-1]['first_difference']} (hf gap {rows[-1]['hf_gap']:.4f}, hf top-2 gap "
                  f"{rows[-1]['hf_top2_gap']:.4f}, our gap {rows[-1]['our_gap']:.4f})")
                  + f", max |dlogit| {rows[-1]['max_abs_logit_diff']:.2e}", flush=True)
        results[role] = {"source": str(source), "identical": sum(r["identical"] for r in rows), "total": len(rows),
                         "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
                         "hf_load_s": round(load_s, 1), "hf_s": round(time.perf_counter() - t, 1), "per_prompt": rows}
        del model
        gc.collect()
    record.update(
        build=str(args.build_dir), build_manifest=build_info(args.build_dir), recipe=manifest.recipe.model_dump(mode="json"),
        what="greedy decoding, token for token: the fp32 build (target: generate_ids mode ar, batch 1; draft: its "
             "engine alone, a greedy forward loop) against transformers' generate on the same GGUF (fp32), same input "
             "ids (chat template), no EOS stop. Logits: ours teacher-forced (target) or from the loop's steps (draft); "
             "transformers' raw logits of its generate steps",
        max_new_tokens=steps, transformers=__import__("transformers").__version__, torch=torch.__version__,
        fp32_build=build_record(args.build_log) if args.build_log else None,
        summary={role: {k: r[k] for k in ("identical", "total", "max_abs_logit_diff")} for role, r in results.items()},
        results=results, timings=timings, wall_s=round(time.perf_counter() - started, 1))
    write(args.out, record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
