"""Issue 19, item 5: the size/cost frontier of feature drafts, from measurements already on disk.

Each size is one draft built into its own build dir and measured three ways (the commands are in
docs/eagle3.md):

* AGREEMENT: ``research/eagle3/measure_feature_draft.py BUILD --agreement-tokens 32 --skip exactness --out ...``
  (first-token agreement on the generated path, chat template and plain text);
* COST: ``research/draft/measure_draft_cost.py BUILD > ...`` (one draft token / one target token, ORT);
* RESULTS: the ``results.json`` of ``python -m ssd_trt.bench BUILD ...`` (AR, SD, SSD tokens/s, paper-style and
  equal cores, K and fan-out tuned on the disjoint tuning split).

    python research/eagle3/draft_frontier.py --size "1 layer" AGREEMENT COST RESULTS --size "2 layers" ... --out DIR

writes ``frontier.json`` (one row per size, and the size each mode is fastest with: the highest speedup over the
AR of its own run) and ``frontier.png``.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COST_LINE = re.compile(r"^(\w+) context: target ([\d.]+) ms/token, draft ([\d.]+) ms/token, ratio ([\d.]+)$")


def draft_cost(path: Path) -> dict:
    """{context: ratio} from research/draft/measure_draft_cost.py's output."""
    costs = {}
    for line in path.read_text().splitlines():
        match = COST_LINE.match(line.strip())
        if match:
            costs[match.group(1)] = {"target_ms": float(match.group(2)), "draft_ms": float(match.group(3)),
                                     "ratio": float(match.group(4))}
    if not costs:
        raise ValueError(f"{path}: no 'CONTEXT context: target X ms/token, draft Y ms/token, ratio R' line")
    return costs


def row(label: str, agreement_path: Path, cost_path: Path, results_path: Path) -> dict:
    agreement = json.loads(agreement_path.read_text())["agreement"]
    bench = json.loads(results_path.read_text())
    out = {"size": label, "artifacts": [str(agreement_path), str(cost_path), str(results_path)],
           "agreement_chat": agreement["chat"]["first_token_agreement"],
           "agreement_plain": agreement["plain"]["first_token_agreement"],
           "cost_ratio": draft_cost(cost_path)["fresh"]["ratio"], "bench": {}}
    for setting, body in bench["presets"]["greedy"]["settings"].items():
        summary = body["summary"]
        out["bench"][setting] = {mode: {key: summary[mode].get(key) for key in
                                        ("tokens_per_s", "mean_accepted", "cache_hit_rate", "speedup_vs_ar",
                                         "speedup_vs_sd", "draft_latency_s", "verify_latency_s")}
                                 for mode in ("ar", "sd", "ssd") if mode in summary}
        out["bench"][setting]["chosen"] = body["chosen"]
    return out


def plot(rows: list[dict], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in rows:
        left.scatter(r["cost_ratio"], r["agreement_chat"], color="tab:blue")
        left.scatter(r["cost_ratio"], r["agreement_plain"], color="tab:orange")
        left.annotate(r["size"], (r["cost_ratio"], r["agreement_chat"]), fontsize=8, xytext=(4, 4),
                      textcoords="offset points")
    for target, color in ((0.75, "tab:blue"), (0.65, "tab:orange")):      # issue 19's acceptance targets
        left.axhline(target, color=color, linestyle=":", linewidth=1)
    left.scatter([], [], color="tab:blue", label="chat template (target 0.75, dotted)")
    left.scatter([], [], color="tab:orange", label="plain text (target 0.65, dotted)")
    left.set_ylim(0.3, 0.8)
    left.set_xlabel("draft token cost / target token (ORT, 1 thread)")
    left.set_ylabel("first-token agreement (engine, SD K=1)")
    left.legend(fontsize=8, loc="lower right")
    # each size's bench is its own run: plot speedups over that run's AR
    width = 0.38
    for i, r in enumerate(rows):
        paper = r["bench"]["paper-style"]
        right.bar(i - width / 2, paper["sd"]["speedup_vs_ar"], width, color="tab:green", label="SD" if i == 0 else None)
        right.bar(i + width / 2, paper["ssd"]["speedup_vs_ar"], width, color="tab:red", label="SSD" if i == 0 else None)
    right.axhline(1.0, color="black", linestyle="dashed", linewidth=1, label="AR (its own run)")
    right.set_xticks(range(len(rows)), [r["size"] for r in rows])
    right.set_ylabel("speedup over AR (paper-style, greedy, 128 tokens)")
    right.set_ylim(0, max(2.0, *(r["bench"]["paper-style"]["ssd"]["speedup_vs_ar"] for r in rows)) * 1.05)
    right.legend(fontsize=8, loc="upper right")
    fig.suptitle("EAGLE-3 draft sizes on the embedded target (2-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", action="append", nargs=4, required=True,
                        metavar=("LABEL", "AGREEMENT", "COST", "RESULTS"), help="one draft size and its measurements")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rows = []
    for label, agreement, cost, results in args.size:
        rows.append(row(label, Path(agreement), Path(cost), Path(results)))
    # each size's bench is its own run: compare speedups over the AR measured in that run, not raw tokens/s
    # (the machine's speed drifts between runs); only settings every size was measured in
    best = {}
    shared = [setting for setting in rows[0]["bench"] if all(setting in r["bench"] for r in rows)]
    for setting in shared:
        for mode in ("sd", "ssd"):
            fastest = max(rows, key=lambda r: r["bench"][setting][mode]["speedup_vs_ar"])
            best[f"{mode} {setting}"] = fastest["size"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "frontier.json").write_text(json.dumps({"command": " ".join(sys.argv), "sizes": rows,
                                                        "fastest_size": best}, indent=1) + "\n")
    plot(rows, args.out / "frontier.png")
    print(json.dumps(best, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
