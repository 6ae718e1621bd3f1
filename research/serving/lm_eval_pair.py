"""lm-evaluation-harness against the OpenAI server, beside lm-eval's own transformers backend on the same weights.

    .venv/bin/python research/serving/lm_eval_pair.py build/smollm2-135m-fp32 --out docs/bench/lm_eval.json

lm-eval 0.4.13 (``lm-eval[api]``) is in the test extras, beside this project: by default the script runs the lm-eval of
its own virtualenv (``--lm-eval-venv`` another). CI runs it (``research/tests/test_lm_eval_pair.py``) and checks the
documented tolerance.
Two local tasks (``lm_eval_tasks/``, no download): ``ssd_mc``, 10 multiple-choice questions scored by loglikelihood,
and ``ssd_gen``, 4 greedy generate-until prompts. Runs, all offline:

* ``hf``: lm-eval's transformers backend on the GGUF the build was made from, dequantized to float32;
* ``server-ar`` and ``server-ssd``: model ``local-completions`` against ``python -m ssd_trt.serve.openai BUILD``,
  ``tokenized_requests`` (prompts as token-id lists), ``--batch_size 4`` (four prompts per request). Loglikelihood
  requests are ``echo: true, logprobs: 1, max_tokens: 1``; the decoding mode goes in ``gen_kwargs`` (``mode``), which
  lm-eval passes on in generate-until requests.

Compared: every loglikelihood (server against hf, max |difference|), every ``is_greedy``, the accuracies, and the
generate-until answers (server-ar against server-ssd: identical, greedy; and against hf).
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ssd_trt.bench.artifact import write_artifact  # noqa: E402
from ssd_trt.manifest import read_manifest  # noqa: E402
from ssd_trt.models.sources import resolve_source  # noqa: E402
from ssd_trt.serve.openai.process import OpenAIServer  # noqa: E402
from ssd_trt.serve.process import free_port  # noqa: E402

TASKS = Path(__file__).resolve().parent / "lm_eval_tasks"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def task_dir(root: Path) -> Path:
    """The task YAMLs with their data files' absolute paths filled in."""
    out = root / "tasks"
    for template in TASKS.glob("*.yaml.in"):
        folder = out / template.name.removesuffix(".yaml.in")
        folder.mkdir(parents=True)
        (folder / template.name.removesuffix(".in")).write_text(template.read_text().replace("DATA_DIR", str(TASKS)))
    return out


def lm_eval(venv: Path, model: str, model_args: str, tasks: Path, out: Path, extra: list[str]) -> list[str]:
    command = [str(venv / "bin" / "lm-eval"), "run", "--model", model, "--model_args", model_args, "--batch_size", "4",
               "--include_path", str(tasks), "--tasks", "ssd_mc,ssd_gen", "--log_samples", "--output_path", str(out),
               "--seed", "1234", *extra]
    env = {**os.environ, **OFFLINE, "HF_HOME": str(out.parent / "hf_home")}
    subprocess.run(command, check=True, env=env, cwd=out.parent)
    return command


def samples(out: Path, task: str) -> dict[int, dict[str, Any]]:
    [path] = glob.glob(f"{out}/*/samples_{task}_*.jsonl")
    return {(row := json.loads(line))["doc_id"]: row for line in Path(path).read_text().splitlines()}


def loglikelihoods(out: Path) -> list[tuple[float, bool]]:
    """(loglikelihood, is_greedy) of every choice of every ssd_mc question, in order."""
    rows = samples(out, "ssd_mc")
    return [(float(resp[0][0]), resp[0][1] in (True, "True")) for doc in sorted(rows) for resp in rows[doc]["resps"]]


def answers(out: Path) -> list[str]:
    rows = samples(out, "ssd_gen")
    return [rows[doc]["resps"][0][0] for doc in sorted(rows)]


def accuracy(out: Path) -> float:
    rows = samples(out, "ssd_mc")
    return sum(row["acc"] for row in rows.values()) / len(rows)


def table(result: dict[str, Any]) -> str:
    c = result["comparison"]
    return "\n".join([
        "| | hf (transformers) | server, mode ar | server, mode ssd |", "|---|---|---|---|",
        "| ssd_mc accuracy | " + " | ".join(f"{result['runs'][r]['accuracy']:.2f}" for r in RUNS) + " |",
        f"| max abs loglikelihood difference vs hf | - | {c['server-ar']['max_abs_ll_diff']:.2e} | "
        f"{c['server-ssd']['max_abs_ll_diff']:.2e} |",
        f"| is_greedy differing from hf | - | {c['server-ar']['is_greedy_diffs']} | {c['server-ssd']['is_greedy_diffs']} |",
        f"| ssd_gen answers equal to hf's | - | {c['server-ar']['answers_equal_hf']} of 4 | "
        f"{c['server-ssd']['answers_equal_hf']} of 4 |",
        "", f"Generate-until answers identical between modes ar and ssd: {c['ar_equals_ssd']}."])


RUNS = ("hf", "server-ar", "server-ssd")


def plot(result: dict[str, Any], path: Path) -> Path | None:
    """Every choice's loglikelihood, the server's against transformers'."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    reference = [ll for ll, _ in result["runs"]["hf"]["loglikelihoods"]]
    fig, ax = plt.subplots(figsize=(5, 5))
    for run, marker in zip(RUNS[1:], ("o", "x")):
        ax.scatter(reference, [ll for ll, _ in result["runs"][run]["loglikelihoods"]], marker=marker, label=run)
    low, high = min(reference), max(reference)
    ax.plot([low, high], [low, high], color="gray", linewidth=0.8)
    ax.set_xlabel("lm-eval hf (transformers, fp32) loglikelihood")
    ax.set_ylabel("lm-eval local-completions against the server")
    ax.set_title("ssd_mc: 40 choices, one dot each")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_pair(build: Path, venv: Path) -> dict[str, Any]:
    """The three runs (``RUNS``) on ``build`` with the lm-eval of ``venv`` and their comparison."""
    build = build.resolve()
    manifest = read_manifest(build)
    gguf = resolve_source(manifest.recipe.target.source).path
    tokenizer = build / "tokenizer"
    result: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "build": build.name, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tasks = task_dir(root)
        outs = {run: root / run for run in RUNS}
        hf_args = f"pretrained={gguf.parent},gguf_file={gguf.name},tokenizer={tokenizer},dtype=float32"
        commands = {"hf": lm_eval(venv, "hf", hf_args, tasks, outs["hf"], ["--device", "cpu"])}
        server = OpenAIServer(build, free_port(), ["--no-access-log"], log_file=root / "server.log")
        try:
            server.start().wait_ready(timeout=900)
            lc_args = (f"model={build.name},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,"
                       f"tokenizer={tokenizer},tokenized_requests=True,num_concurrent=1,max_retries=1")
            for mode in ("ar", "ssd"):
                run = f"server-{mode}"
                commands[run] = lm_eval(venv, "local-completions", lc_args, tasks, outs[run],
                                        ["--gen_kwargs", f"mode={mode}"])
        finally:
            server.stop()
        reference = loglikelihoods(outs["hf"])
        for run in RUNS:
            result["runs"][run] = {"command": " ".join(commands[run]), "accuracy": accuracy(outs[run]),
                                   "loglikelihoods": loglikelihoods(outs[run]), "answers": answers(outs[run])}
        result["comparison"] = {run: {
            "max_abs_ll_diff": max(abs(a[0] - b[0]) for a, b in zip(reference, result["runs"][run]["loglikelihoods"])),
            "is_greedy_diffs": sum(a[1] != b[1] for a, b in zip(reference, result["runs"][run]["loglikelihoods"])),
            "answers_equal_hf": sum(a == b for a, b in zip(result["runs"]["hf"]["answers"],
                                                           result["runs"][run]["answers"]))}
            for run in RUNS[1:]}
        result["comparison"]["ar_equals_ssd"] = result["runs"]["server-ar"]["answers"] == \
            result["runs"]["server-ssd"]["answers"]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("build_dir", type=Path)
    parser.add_argument("--lm-eval-venv", type=Path, default=Path(sys.prefix),
                        help="the virtualenv whose lm-eval runs (default: this one; the test extras install it)")
    parser.add_argument("--out", type=Path, default=Path("docs/bench/lm_eval.json"))
    args = parser.parse_args(argv)
    result = {"command": "python research/serving/lm_eval_pair.py " + " ".join(argv or sys.argv[1:]),
              **run_pair(args.build_dir, args.lm_eval_venv)}
    write_artifact(result, args.out, plot, table)
    return 0 if result["comparison"]["ar_equals_ssd"] else 1


if __name__ == "__main__":
    sys.exit(main())
