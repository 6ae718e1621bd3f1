"""``ssd-trt serve TARGET.gguf --draft DRAFT.gguf``: a real tiny GGUF pair (tests/gguf_files.py, each file with its
tokenizer in the metadata, as the real files carry it), built on first use into the cache keyed by the files' sha256,
served by the real console script and answered by the official openai client; a second start uses the build at once;
a changed file builds anew; two starts at once share one build; bad input is one line, exit status 2, and nothing
half-built is left in the cache: a missing file, a file that is not GGUF, a draft with another tokenizer, a block type
the engine cannot read, and a full disk (a real one: a small tmpfs in a mount namespace of its own)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from ssd_trt import cli
from ssd_trt.from_files.cache import CACHE_ENV
from ssd_trt.serve.openai.process import OpenAIServer
from ssd_trt.serve.process import LOOPBACK, free_port
from tests.gguf_files import CHATML, KINDS, byte_tokens, write_tiny_qwen2
from tests.helpers import random_decoder, save_hf_checkpoint, tiny_config

openai = pytest.importorskip("openai")

SCRIPT = Path(sys.executable).with_name("ssd-trt")
KEY = "tiny-secret"
BUILDING = "first use of these files: building"


class FilesServer(OpenAIServer):
    """``ssd-trt serve MODEL ARGS`` (the console script) on a free loopback port, with its own cache."""

    name = "ssd-trt serve"

    def __init__(self, model: Path, cache: Path, args: list[str], log_file: Path) -> None:
        super().__init__(model, free_port(), args, log_file)
        self.cache = cache

    def command(self) -> list[str]:
        assert SCRIPT.is_file(), f"{SCRIPT} is missing: reinstall the project (pip install -e .)"
        return [str(SCRIPT), "serve", str(self.build_dir), "--host", LOOPBACK, "--port", str(self.port), *self.args]

    def environment(self) -> dict[str, str]:
        return {**os.environ, CACHE_ENV: str(self.cache)}

    def log(self) -> str:
        return Path(self.log_file).read_text()


def entries(cache: Path) -> list[Path]:
    """The cache's build folders (complete or not)."""
    builds = cache / "builds"
    return sorted(p for p in builds.iterdir() if p.is_dir()) if builds.is_dir() else []


def leftovers(cache: Path) -> list[Path]:
    """Anything a build leaves behind besides complete builds, their recipes, the locks and the hash memo."""
    return [p for p in cache.rglob("*") if p.name.startswith((".partial-", ".recipe.yaml", ".file-hashes"))]


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("pair")
    return {"target": write_tiny_qwen2(folder / "tiny-target.gguf", seed=0, with_tokenizer=True, chat_template=CHATML),
            "draft": write_tiny_qwen2(folder / "tiny-draft.gguf", seed=1, with_tokenizer=True, chat_template=CHATML),
            "folder": folder}


@pytest.fixture(scope="module")
def served(pair, tmp_path_factory):
    """The first start, on an empty cache: it builds, then serves (the one build the module's tests share)."""
    cache = tmp_path_factory.mktemp("cache")
    args = ["--draft", str(pair["draft"]), "--served-model-name", "tiny", "--api-key", KEY, "--max-model-len", "256",
            "--num-speculative-tokens", "3", "--threads", "1"]
    server = FilesServer(pair["target"], cache, args, cache.parent / "first-start.log")
    server.start()
    try:
        server.wait_ready(timeout=900)
        yield server
    finally:
        server.stop()


def test_serve_from_two_gguf_files_answers_the_official_openai_client(served):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0)
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ab"}], max_tokens=6,
                                            temperature=0)
    assert answer.model == "tiny" and answer.choices[0].message.content
    assert answer.model_extra["ssd_trt"]["mode"] == "ssd"              # with a draft: the usual default mode
    assert 1 <= answer.usage.completion_tokens <= 6
    [card] = client.models.list().data
    assert card.id == "tiny" and card.max_model_len == 256             # --max-model-len is the engine's context
    with pytest.raises(openai.AuthenticationError):                     # --api-key is the server's key
        openai.OpenAI(base_url=f"{served.url}/v1", api_key="wrong", max_retries=0).models.list()
    assert BUILDING in served.log()


def test_without_a_draft_a_request_that_names_no_mode_runs_ar(pair, tmp_path):
    """No --draft: the target drafts for itself (the recipe needs a draft), and the server's default mode is AR; a
    request may still name another."""
    server = FilesServer(pair["target"], tmp_path / "cache", ["--served-model-name", "solo", "--max-model-len", "256",
                                                               "--threads", "1"], tmp_path / "solo.log")
    server.start()
    try:
        server.wait_ready(timeout=900)
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        plain = client.completions.create(model="solo", prompt="ab", max_tokens=4, temperature=0)
        assert plain.model_extra["ssd_trt"]["mode"] == "ar"
        named = client.completions.create(model="solo", prompt="ab", max_tokens=4, temperature=0,
                                          extra_body={"mode": "sd"})
        assert named.model_extra["ssd_trt"]["mode"] == "sd"
        assert named.choices[0].text == plain.choices[0].text           # greedy: the same tokens either way
    finally:
        server.stop()


def test_the_recipe_comes_from_the_files_and_the_flags(served, pair):
    [entry] = entries(served.cache)
    recipe = yaml.safe_load((entry / "recipe.yaml").read_text())
    for role in ("target", "draft"):
        assert recipe[role] == {"source": str(pair[role].resolve()), "dtype": "float32", "weights": "gguf",
                                "activations": "int8"}
    engine, decoding = recipe["engine"], recipe["decoding"]
    assert (engine["backend"], engine["tensorrt"], engine["max_context"]) == ("ort", "none", 256)
    assert decoding["sd_draft_len"] == decoding["ssd_draft_len"] == 3 and engine["max_draft_len"] >= 3
    manifest = json.loads((entry / recipe["name"] / "manifest.json").read_text())
    assert manifest["recipe"]["engine"]["max_context"] == 256
    assert leftovers(served.cache) == []


def test_a_second_start_with_the_same_files_uses_the_build_at_once(served, pair):
    [entry] = entries(served.cache)
    manifest = entry / "tiny-target" / "manifest.json"
    built = manifest.stat().st_mtime_ns
    # runtime flags (port, name, threads, key) are not part of the key: the same build
    args = ["--draft", str(pair["draft"]), "--max-model-len", "256", "--num-speculative-tokens", "3", "--threads", "2"]
    second = FilesServer(pair["target"], served.cache, args, served.cache.parent / "second-start.log")
    with second:
        client = openai.OpenAI(base_url=f"{second.url}/v1", api_key="unused", max_retries=0)
        answer = client.completions.create(model="tiny-target", prompt="ab", max_tokens=4, temperature=0)
        assert answer.choices[0].text is not None and answer.usage.completion_tokens >= 1
    log = second.log()
    assert "these files were built before" in log and BUILDING not in log, log[-2000:]
    assert entries(served.cache) == [entry] and manifest.stat().st_mtime_ns == built


def test_the_build_flags_are_part_of_the_key_and_print_recipe_builds_nothing(served, pair, capsys, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(served.cache))
    [entry] = entries(served.cache)
    base = ["serve", str(pair["target"]), "--draft", str(pair["draft"]), "--print-recipe"]
    builds = {}
    for flags in (["--max-model-len", "256", "--num-speculative-tokens", "3"], ["--max-model-len", "256"],
                  ["--max-model-len", "128", "--num-speculative-tokens", "3"]):
        assert cli.main(base + flags) == 0
        text = capsys.readouterr().out
        builds[tuple(flags)] = text.splitlines()[1].removeprefix("# Its build: ")
        assert yaml.safe_load(text)["engine"]["max_context"] == int(flags[1])
    assert list(builds.values())[0] == str(entry / "tiny-target")
    assert len(set(builds.values())) == 3
    assert entries(served.cache) == [entry]                  # --print-recipe built nothing


def test_a_build_directory_takes_the_runtime_flags_but_refuses_the_build_flags(served, capsys):
    [entry] = entries(served.cache)
    assert cli.main(["serve", str(entry / "tiny-target"), "--num-speculative-tokens", "4"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--num-speculative-tokens describe a build from model files" in err
    assert cli.main(["serve", str(entry / "tiny-target"), "--print-recipe"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["decoding"]["ssd_draft_len"] == 3


def build_of(argv: list[str], capsys) -> str:
    """Where ``--print-recipe`` says the build of ``argv`` lives."""
    assert cli.main([*argv, "--print-recipe"]) == 0
    return capsys.readouterr().out.splitlines()[1].removeprefix("# Its build: ")


def test_a_changed_file_builds_anew_and_two_starts_at_once_share_one_build(served, pair, tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(served.cache))
    [entry] = entries(served.cache)
    # the draft's bytes elsewhere are the same build; rewritten in place with other weights (same size), another one
    draft = Path(shutil.copy(pair["draft"], tmp_path / "tiny-draft.gguf"))
    argv = ["generate", str(pair["target"]), "--draft", str(draft), "--max-model-len", "256",
            "--num-speculative-tokens", "3"]
    assert build_of(argv, capsys) == str(entry / "tiny-target")
    write_tiny_qwen2(draft, seed=2, with_tokenizer=True, chat_template=CHATML)
    assert draft.stat().st_size == pair["draft"].stat().st_size and build_of(argv, capsys) != str(entry / "tiny-target")
    command = [str(SCRIPT), *argv, "--prompt", "ab", "--max-new-tokens", "6", "--json"]
    env = {**os.environ, CACHE_ENV: str(served.cache)}
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    first = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=open(logs[0], "w"), text=True)
    deadline = time.monotonic() + 300
    while BUILDING not in logs[0].read_text():      # the second starts while the first builds
        assert first.poll() is None and time.monotonic() < deadline, logs[0].read_text()
        time.sleep(0.2)
    second = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=open(logs[1], "w"), text=True)
    outputs = [process.communicate(timeout=600)[0] for process in (first, second)]
    texts = [log.read_text() for log in logs]
    assert (first.returncode, second.returncode) == (0, 0), texts
    assert BUILDING not in texts[1], texts[1]
    assert "waiting for it to finish" in texts[1] or "these files were built before" in texts[1], texts[1]
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs]
    assert results[0]["token_ids"] == results[1]["token_ids"]
    assert len(entries(served.cache)) == 2 and leftovers(served.cache) == []


# -- bad input: one line each, exit status 2, nothing left in the cache ------------------------------------------------
def refused(argv: list[str], cache: Path, capsys) -> str:
    code = cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert entries(cache) == [] and leftovers(cache) == []
    return err


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


def test_a_missing_file_is_one_line(pair, cache, capsys):
    err = refused(["serve", str(pair["target"]), "--draft", str(pair["folder"] / "nowhere.gguf")], cache, capsys)
    assert "the draft" in err and "nowhere.gguf does not exist" in err


def test_a_file_that_is_not_gguf_is_one_line(pair, cache, capsys, tmp_path):
    notes = tmp_path / "notes.gguf"
    notes.write_text("these are not weights\n")
    err = refused(["generate", str(notes), "--prompt", "ab"], cache, capsys)
    assert "notes.gguf is not a GGUF file (it starts with b'thes'" in err


@pytest.mark.parametrize("change, named", [
    ({"tokens": [byte_tokens()[i] for i in (1, 0, *range(2, 256))]},
     f"the tokens at 2 ids (id 0: {byte_tokens()[1]!r} vs {byte_tokens()[0]!r}, id 1:"),
    ({"tokens": byte_tokens()[:200]}, "the vocabulary size (200 vs 256 tokens)"),
    ({"eos_token_id": 3}, "the eos token id (3 vs 2)"),
], ids=["two-tokens-swapped", "smaller-vocabulary", "other-eos"])
def test_a_draft_with_another_tokenizer_is_refused_before_the_build_naming_what_differs(change, named, pair, cache,
                                                                                        capsys, tmp_path):
    draft = write_tiny_qwen2(tmp_path / "other.gguf", seed=1, with_tokenizer=True, **change)
    err = refused(["serve", str(pair["target"]), "--draft", str(draft)], cache, capsys)
    assert "does not share the target's tokenizer" in err and named in err, err


def test_a_block_type_the_engine_cannot_read_is_refused_before_the_build(pair, cache, capsys, tmp_path):
    draft = write_tiny_qwen2(tmp_path / "q3k.gguf", {**KINDS, "ffn_up": "Q3_K"}, seed=1, with_tokenizer=True)
    err = refused(["serve", str(pair["target"]), "--draft", str(draft)], cache, capsys)
    assert "tensor blk.0.ffn_up.weight is Q3_K, a GGUF block type the engine cannot read" in err


def unshare_works() -> bool:
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True) if shutil.which("unshare") else None
    return probe is not None and probe.returncode == 0


@pytest.mark.skipif(not unshare_works(), reason="needs a mount namespace (unshare -rm) for a small tmpfs: a real "
                                                "full disk without touching this machine's")
def test_a_full_disk_is_one_line_and_leaves_nothing_half_built(pair, tmp_path):
    """The cache on a real 400 kB tmpfs, mounted in a user and mount namespace of the test's own: the tokenizer and
    recipe fit, the first ONNX file does not (the tiny pair's build is ~5 MB)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    script = ('mount -t tmpfs -o size=400k tmpfs "$0" || exit 99; "$@"; echo "exit=$?"; '
              'find "$0" -mindepth 1 | sed "s|^$0/|left: |"')
    command = [str(SCRIPT), "generate", str(pair["target"]), "--draft", str(pair["draft"]), "--prompt", "ab"]
    done = subprocess.run(["unshare", "-rm", "sh", "-c", script, str(mount), *command], capture_output=True, text=True,
                          env={**os.environ, CACHE_ENV: str(mount)}, timeout=600)
    lines = done.stdout.strip().splitlines()
    assert "exit=2" in lines, (done.stdout, done.stderr[-2000:])
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith("ssd-trt generate: error: the disk holding the cache") and \
        "is full (no space left on device" in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    left = {line.removeprefix("left: ") for line in lines if line.startswith("left: ")}
    [lock] = left - {"builds", "builds/file-hashes.json"}        # no build folder, no partial one: the lock only
    assert lock.startswith("builds/tiny-target-") and lock.endswith(".lock"), left


# -- the other model sources: a checkpoint folder, no draft ------------------------------------------------------------
def test_a_checkpoint_folder_pair_and_a_missing_draft_have_their_recipes(pair, cache, capsys, tmp_path):
    target = save_hf_checkpoint(random_decoder(tiny_config(), seed=0), tmp_path / "hf-target")
    draft = save_hf_checkpoint(random_decoder(tiny_config(layers=1), seed=1), tmp_path / "hf-draft")
    assert cli.main(["serve", str(target), "--draft", str(draft), "--print-recipe"]) == 0
    recipe = yaml.safe_load(capsys.readouterr().out)
    assert recipe["name"] == "hf-target" and recipe["draft"]["source"] == str(draft.resolve())
    assert recipe["target"]["weights"] == recipe["draft"]["weights"] == "float"
    assert cli.main(["generate", str(pair["target"]), "--print-recipe"]) == 0
    alone = yaml.safe_load(capsys.readouterr().out)      # no draft: the target drafts for itself
    assert alone["draft"] == {**alone["target"], "tokenizer": "target"}
    assert entries(cache) == []
