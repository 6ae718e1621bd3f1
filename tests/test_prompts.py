"""Tests for the benchmark prompt set and its loader (ssd_trt.bench.prompts)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from ssd_trt.bench.prompts import CATEGORIES, DEFAULT_PROMPTS, Prompt, load_prompts


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# --- the default set ---------------------------------------------------------


def test_default_file_exists_and_loads() -> None:
    assert DEFAULT_PROMPTS.is_file()
    prompts = load_prompts()
    assert prompts == load_prompts(DEFAULT_PROMPTS)
    assert all(isinstance(p, Prompt) for p in prompts)
    assert len(prompts) >= 100


def test_default_categories_are_exactly_the_five_with_at_least_15_each() -> None:
    counts = Counter(p.category for p in load_prompts())
    assert set(counts) == set(CATEGORIES) == {"code", "chat", "math", "prose", "summarization"}
    for category in CATEGORIES:
        assert counts[category] >= 15, (category, counts[category])


def test_default_ids_unique_and_prompts_nonempty() -> None:
    prompts = load_prompts()
    ids = [p.id for p in prompts]
    assert len(ids) == len(set(ids))
    for p in prompts:
        assert p.prompt.strip(), p.id
        assert p.id.startswith(p.category + "-"), p.id


def test_default_file_every_line_has_id_category_prompt() -> None:
    lines = DEFAULT_PROMPTS.read_text(encoding="utf-8").splitlines()
    assert all(line.strip() for line in lines), "no blank lines in the default set"
    for line in lines:
        record = json.loads(line)
        assert set(record) == {"id", "category", "prompt"}, record


def test_default_prompts_mostly_ascii() -> None:
    prompts = load_prompts()
    ascii_share = sum(p.prompt.isascii() for p in prompts) / len(prompts)
    assert ascii_share >= 0.9


def test_default_summarization_prompts_carry_a_passage_and_an_instruction() -> None:
    for p in load_prompts(categories=["summarization"]):
        passage, _, instruction = p.prompt.rpartition("\n\n")
        assert "summarize" in instruction.lower(), p.id
        assert 60 <= len(passage.split()) <= 150, (p.id, len(passage.split()))


# --- filtering ---------------------------------------------------------------


def test_category_filter_and_limit() -> None:
    math = load_prompts(categories=["math"])
    assert math and all(p.category == "math" for p in math)
    both = load_prompts(categories=("code", "prose"))
    assert {p.category for p in both} == {"code", "prose"}
    assert load_prompts(categories="chat") == load_prompts(categories=["chat"])
    assert load_prompts(limit=7) == load_prompts()[:7]
    assert load_prompts(categories=["code"], limit=3) == load_prompts(categories=["code"])[:3]
    assert load_prompts(limit=0) == []


def test_unknown_category_raises() -> None:
    with pytest.raises(ValueError, match="no prompts in categories"):
        load_prompts(categories=["poetry"])


def test_negative_limit_raises() -> None:
    with pytest.raises(ValueError, match="limit"):
        load_prompts(limit=-1)


# --- other files -------------------------------------------------------------


def test_defaults_for_missing_id_and_category_and_blank_lines_skipped(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            json.dumps({"prompt": "first"}),
            "",
            json.dumps({"prompt": "second", "category": "chat", "extra": 1}),
            json.dumps({"id": "mine", "prompt": "third"}),
        ],
    )
    assert load_prompts(path) == [
        Prompt(id="p1", category="other", prompt="first"),
        Prompt(id="p3", category="chat", prompt="second"),
        Prompt(id="mine", category="other", prompt="third"),
    ]
    assert load_prompts(str(path)) == load_prompts(path)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "invalid JSON"),
        ('["a", "list"]', "expected a JSON object"),
        ('{"id": "x"}', "missing required field 'prompt'"),
        ('{"prompt": ""}', "'prompt' is empty"),
        ('{"prompt": "   \\n "}', "'prompt' is empty"),
        ('{"prompt": 42}', "'prompt' must be a string"),
        ('{"prompt": null}', "'prompt' must be a string"),
        ('{"prompt": "ok", "id": 5}', "'id' must be a non-empty string"),
        ('{"prompt": "ok", "category": ""}', "'category' must be a non-empty string"),
    ],
)
def test_bad_line_raises_value_error_naming_file_and_line(
    tmp_path: Path, bad_line: str, message: str
) -> None:
    path = _write(tmp_path, [json.dumps({"prompt": "fine"}), "", bad_line])
    with pytest.raises(ValueError) as info:
        load_prompts(path)
    text = str(info.value)
    assert f"{path}:3:" in text
    assert message in text


def test_duplicate_id_raises(tmp_path: Path) -> None:
    path = _write(tmp_path, [json.dumps({"id": "a", "prompt": "x"}), json.dumps({"id": "a", "prompt": "y"})])
    with pytest.raises(ValueError, match=r":2: duplicate id 'a' \(first on line 1\)"):
        load_prompts(path)


@pytest.mark.parametrize("content", ["", "\n\n   \n"])
def test_file_without_prompts_raises(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(ValueError, match="no prompts"):
        load_prompts(path)


def test_missing_file_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_prompts(tmp_path / "absent.jsonl")


def test_prompt_is_frozen() -> None:
    p = Prompt(id="a", category="chat", prompt="hi")
    with pytest.raises(AttributeError):
        p.prompt = "changed"  # type: ignore[misc]


def test_round_robin_covers_every_category_evenly_and_stops_when_exhausted():
    from ssd_trt.bench.prompts import round_robin

    first = round_robin(2 * len(CATEGORIES))
    assert Counter(p.category for p in first) == {c: 2 for c in CATEGORIES}
    assert len({p.id for p in first}) == len(first)
    assert len(round_robin(10_000)) == len(load_prompts())
