"""The benchmark prompt set and a loader for it (or any JSONL file like it).

Each line of a prompt file is a JSON object with a required, non-empty string
``prompt`` field and optional ``id`` and ``category`` strings.  Blank lines are
skipped.  See ``README.md`` in this directory for what the default set holds.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["DEFAULT_PROMPTS", "TUNING_PROMPTS", "CATEGORIES", "Prompt", "load_prompts", "round_robin"]

DEFAULT_PROMPTS: Path = Path(__file__).parent / "default.jsonl"
"""The project's default prompt set (about 20 prompts in each of ``CATEGORIES``)."""

TUNING_PROMPTS: Path = Path(__file__).parent / "tuning.jsonl"
"""The tuning split: 2 prompts per category, disjoint from :data:`DEFAULT_PROMPTS`; the benchmark tunes
K and the fan-out budget on it, never on the prompts it reports."""

CATEGORIES: tuple[str, ...] = ("code", "chat", "math", "prose", "summarization")
"""The categories used in :data:`DEFAULT_PROMPTS`."""

DEFAULT_CATEGORY = "other"


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt.

    Attributes:
        id: Identifier, unique within its file (``p<line number>`` when the
            file gives none).
        category: Workload category, e.g. ``"code"`` (``"other"`` when the
            file gives none).
        prompt: The raw prompt text; no chat template applied.
    """

    id: str
    category: str
    prompt: str


def _optional_str(record: dict, key: str, default: str, where: str) -> str:
    """Return ``record[key]`` if it is a non-empty string, ``default`` if absent."""
    value = record.get(key)
    if value is None:
        return default
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: {key!r} must be a non-empty string, got {value!r}")
    return value


def load_prompts(
    path: Path | str | os.PathLike[str] | None = None,
    categories: Sequence[str] | None = None,
    limit: int | None = None,
) -> list[Prompt]:
    """Read prompts from a JSONL file.

    Args:
        path: The JSONL file; :data:`DEFAULT_PROMPTS` when ``None``.
        categories: Keep only prompts whose category is in this sequence
            (all prompts when ``None``).
        limit: Keep at most this many prompts, in file order, after the
            category filter (all when ``None``).

    Returns:
        The prompts, in file order.

    Raises:
        ValueError: A line is not valid JSON or not an object; its ``prompt``
            is missing, empty or not a string; its ``id`` or ``category`` is
            present but not a non-empty string; an ``id`` repeats; the file
            holds no prompts; no prompt matches ``categories``; or ``limit``
            is negative.  Messages name the file and the 1-based line number.
        OSError: The file cannot be read.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    if isinstance(categories, str):  # a lone string is a Sequence[str]; don't iterate its letters
        categories = [categories]
    file = Path(DEFAULT_PROMPTS if path is None else path)

    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    with file.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{file}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON: {exc.msg}") from exc
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            if "prompt" not in record:
                raise ValueError(f"{where}: missing required field 'prompt'")
            text = record["prompt"]
            if not isinstance(text, str):
                raise ValueError(f"{where}: 'prompt' must be a string, got {type(text).__name__}")
            if not text.strip():
                raise ValueError(f"{where}: 'prompt' is empty")
            pid = _optional_str(record, "id", f"p{line_no}", where)
            category = _optional_str(record, "category", DEFAULT_CATEGORY, where)
            if pid in seen:
                raise ValueError(f"{where}: duplicate id {pid!r} (first on line {seen[pid]})")
            seen[pid] = line_no
            prompts.append(Prompt(id=pid, category=category, prompt=text))

    if not prompts:
        raise ValueError(f"{file}: no prompts found")
    if categories is not None:
        wanted = set(categories)
        present = sorted({p.category for p in prompts})
        prompts = [p for p in prompts if p.category in wanted]
        if not prompts:
            raise ValueError(
                f"{file}: no prompts in categories {sorted(wanted)}; file has {present}"
            )
    if limit is not None:
        prompts = prompts[:limit]
    return prompts


def round_robin(count: int, prompts: Sequence[Prompt] | None = None) -> list[Prompt]:
    """Up to ``count`` prompts taken one category at a time (first of each category, then the
    second, ...), so any prefix of the result covers every category about equally."""
    by_category: dict[str, list[Prompt]] = {}
    for p in load_prompts() if prompts is None else prompts:
        by_category.setdefault(p.category, []).append(p)
    chosen: list[Prompt] = []
    while len(chosen) < count and any(by_category.values()):
        for queue in by_category.values():
            if queue and len(chosen) < count:
                chosen.append(queue.pop(0))
    return chosen
