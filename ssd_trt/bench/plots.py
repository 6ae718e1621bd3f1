"""PNG plots of a benchmark: tokens/s per mode and category, the SSD round timeline, the sweeps."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def tokens_per_category(categories: dict, path: Path, title: str) -> Path:
    modes = list(categories)
    names = sorted({c for mode in modes for c in categories[mode]})
    width = 0.8 / max(len(modes), 1)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, mode in enumerate(modes):
        values = [categories[mode].get(c, {}).get("tokens_per_s") or 0 for c in names]
        ax.bar(np.arange(len(names)) + i * width, values, width, label=mode)
    ax.set_xticks(np.arange(len(names)) + width * (len(modes) - 1) / 2, names)
    ax.set_ylabel("tokens / s")
    ax.set_title(title)
    ax.legend(ncol=len(modes), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def ssd_timeline(timeline: list[dict], path: Path, rounds: int = 12) -> Path:
    """Draft (tree speculation) and target (verification) intervals per round: the overlap is SSD."""
    fig, ax = plt.subplots(figsize=(10, 3))
    shown = timeline[:rounds]
    if shown:
        origin = shown[0]["verify"][0]
        for entry in shown:
            v0, v1 = entry["verify"]
            d0, d1 = entry["draft"]
            ax.broken_barh([(v0 - origin, v1 - v0)], (10, 8), facecolors="tab:blue")
            ax.broken_barh([(d0 - origin, d1 - d0)], (0, 8), facecolors="tab:orange" if entry["hits"] else "tab:red")
            if entry.get("backup_s"):
                ax.broken_barh([(v1 - origin, entry["backup_s"])], (20, 6), facecolors="tab:gray")
    ax.set_yticks([4, 14, 23], ["draft: tree speculation", "target: verify", "backup"])
    ax.set_xlabel("seconds (orange = next round hit the cache, red = miss)")
    ax.set_title("SSD round timeline: draft and target busy at once")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def sweeps(sweep: dict, path: Path) -> Path:
    panels = [(key, values) for key, values in sweep.items() if values]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(4.5 * max(len(panels), 1), 3.5), squeeze=False)
    for ax, (key, values) in zip(axes[0], panels):
        if isinstance(values[0]["value"], list):     # a (K, budget) grid: one line per K over the budgets
            for k in sorted({v["value"][0] for v in values}):
                row = [v for v in values if v["value"][0] == k]
                ax.plot([v["value"][1] for v in row], [v["speedup_vs_ar"] for v in row], marker="o", label=f"K={k}")
            ax.legend()
            ax.set_xlabel("fan-out budget")
        else:
            ax.plot([v["value"] for v in values], [v["speedup_vs_ar"] for v in values], marker="o")
            ax.set_xlabel(key)
        ax.set_ylabel("speedup over AR")
        ax.axhline(1.0, color="gray", linewidth=0.8)
        ax.set_title(key)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
