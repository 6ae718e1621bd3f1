"""The ``ssd-trt`` command: the console script pyproject installs lists every command, each command's help shows its
flags and examples, ``python -m ssd_trt`` is the same command, and a flag or command nobody knows is an error naming
the nearest known one (no abbreviations taken)."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ssd_trt import cli
from ssd_trt.from_files.cli import thread_options
from ssd_trt.options import RuntimeOptions

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).with_name("ssd-trt")
# a flag each command's own parser has: its help is that parser's
FLAG_OF = {"serve": "--num-speculative-tokens", "generate": "--max-new-tokens", "build": "--if-stale",
           "triton": "export", "bench": "--sweep-prompts", "fetch": "--check", "plan": "--gpu-memory"}


def run_script(*args: str) -> subprocess.CompletedProcess:
    assert SCRIPT.is_file(), f"{SCRIPT} is missing: reinstall the project (pip install -e .) to get the console script"
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_pyproject_installs_the_console_script_and_its_help_lists_every_command():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"ssd-trt": "ssd_trt.cli:main"}
    done = run_script("--help")
    assert done.returncode == 0, done.stderr
    listed = [line.split()[0] for line in done.stdout.split("commands:")[1].split("\n\n")[0].strip().splitlines()]
    assert listed == ["serve", "generate", "build", "triton", "bench", "fetch", "plan"]
    assert f"ssd-trt serve {cli.REAL_TARGET} --draft {cli.REAL_DRAFT}" in done.stdout


def test_python_dash_m_ssd_trt_is_the_same_command():
    module = subprocess.run([sys.executable, "-m", "ssd_trt", "--help"], capture_output=True, text=True, timeout=120)
    assert module.returncode == 0 and module.stdout == run_script("--help").stdout
    bare = subprocess.run([sys.executable, "-m", "ssd_trt"], capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and "commands:" in bare.stderr


@pytest.mark.parametrize("command", list(FLAG_OF))
def test_each_commands_help_shows_its_own_flags_and_an_example(command, capsys):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert FLAG_OF[command] in out, out[-600:]
    examples = out.split("\nexamples:\n")[1].strip().splitlines()
    assert examples and all(line.strip().startswith(f"ssd-trt {command} ") for line in examples), examples


@pytest.mark.parametrize("argv, nearest", [
    (["serve", "model.gguf", "--prot", "8000"], "--port"),
    (["serve", "model.gguf", "--num-speculative-token", "3"], "--num-speculative-tokens"),
    (["serve", "model.gguf", "--num-spec", "3"], "--num-speculative-tokens"),        # an abbreviation is not taken
    (["generate", "model.gguf", "--prompt", "x", "--max-new-token", "3"], "--max-new-tokens"),
    (["build", "recipe.yaml", "--if-stal"], "--if-stale"),
    (["fetch", "--chek"], "--check"),
])
def test_an_unknown_flag_is_an_error_naming_the_nearest_known_one(argv, nearest, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert f"unknown flag {argv[-2] if argv[-1].isdigit() else argv[-1]} (did you mean {nearest}?)" in err, err


def test_an_unknown_command_names_the_nearest_one(capsys):
    assert cli.main(["serv", "model.gguf"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'serv'; did you mean 'serve'?" in err and len(err.strip().splitlines()) == 1


def test_threads_give_each_model_its_own_cores_where_there_are_enough():
    cores = sorted(os.sched_getaffinity(0))
    one = thread_options(1)
    assert one["target_threads"] == one["draft_threads"] == 1
    assert one["target_cores"] == (cores[0],) and one["draft_cores"] == ((cores[1],) if len(cores) > 1 else None)
    every = thread_options(len(cores))        # no cores left for the draft: the OS places it
    assert every["target_cores"] == tuple(cores) and every["draft_cores"] is None
    options = RuntimeOptions(**every)
    assert (options.target_threads, options.draft_threads) == (len(cores), len(cores))
