"""What every real-pair check records next to its results: the command line, the date, the machine, the code's
commit; and the prompt sets the checks share (JSONL files with "prompt" and "category")."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

PROMPTS = Path("ssd_trt/bench/prompts")


def load_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def pair_prompts() -> list[dict]:
    """The pair's 15 prompts: the benchmark split (pair.jsonl, 10), then the tuning split (pair_tuning.jsonl, 5)."""
    return [{**row, "file": name} for name in ("pair.jsonl", "pair_tuning.jsonl") for row in load_jsonl(PROMPTS / name)]


def default_chat_prompts(count: int) -> list[dict]:
    """The first ``count`` chat-category prompts of default.jsonl."""
    rows = [{**row, "file": "default.jsonl"} for row in load_jsonl(PROMPTS / "default.jsonl")
            if row.get("category") == "chat"]
    return rows[:count]


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    memory = next((int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                   if line.startswith("MemTotal")), None)
    import numpy
    import onnxruntime
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "memory_bytes": memory, "platform": platform.platform(),
            "python": platform.python_version(), "onnxruntime": onnxruntime.__version__, "numpy": numpy.__version__}


def header() -> dict:
    """The run's provenance: command line, UTC date, machine, git commit (and whether the tree had changes)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = None, None
    return {"command": " ".join(["python", *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine(), "git_commit": commit, "tracked_files_modified": dirty}


def build_info(build_dir: Path) -> dict:
    """Which build ran: its manifest's sha256 and modification time, and the recipe's decoding defaults."""
    import hashlib
    manifest = Path(build_dir) / "manifest.json"
    data = json.loads(manifest.read_text())
    return {"dir": str(build_dir), "manifest_sha256": hashlib.sha256(manifest.read_bytes()).hexdigest(),
            "manifest_mtime": datetime.datetime.fromtimestamp(manifest.stat().st_mtime, datetime.timezone.utc)
            .isoformat(timespec="seconds"), "decoding": data["recipe"].get("decoding"),
            "tuned_decoding": data.get("tuned_decoding"), "build_seconds": data.get("build_seconds")}


def write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {path}", flush=True)
