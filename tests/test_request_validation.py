"""Every bad request is refused at the edge with a specific RequestError -- Python API and CLI alike.

The CLI turns each into one line on stderr and exit status 2, never a traceback. (The Triton model's
entry point is tested with the Triton backend.)
"""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

import ssd_trt
from ssd_trt import generate as cli
from ssd_trt.decoding.params import MAX_NEW_TOKENS_LIMIT, SamplingParams
from ssd_trt.errors import ConfigError, RequestError
from ssd_trt.runtime import RuntimeOptions

ROOT = Path(__file__).resolve().parents[1]
OK = SamplingParams(max_new_tokens=4)
TOO_LONG = " ".join(["w5"] * 300)            # the tiny tokenizer: one token per word; max context 256


@pytest.fixture(scope="module")
def gen(tiny_pairs):
    return ssd_trt.load(tiny_pairs["self"])


# -- sampling parameters: refused when constructed ----------------------------------------------------
BAD_PARAMS = {
    "max_new_tokens zero": ({"max_new_tokens": 0}, "max_new_tokens must be an integer in 1.."),
    "max_new_tokens negative": ({"max_new_tokens": -3}, "max_new_tokens"),
    "max_new_tokens huge": ({"max_new_tokens": MAX_NEW_TOKENS_LIMIT + 1}, f"1..{MAX_NEW_TOKENS_LIMIT}"),
    "max_new_tokens float": ({"max_new_tokens": 2.5}, "max_new_tokens"),
    "max_new_tokens bool": ({"max_new_tokens": True}, "max_new_tokens"),
    "temperature negative": ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
    "temperature NaN": ({"temperature": math.nan}, "temperature"),
    "temperature inf": ({"temperature": math.inf}, "temperature"),
    "temperature string": ({"temperature": "hot"}, "temperature"),
    "top_p zero": ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    "top_p above one": ({"top_p": 1.5}, "top_p"),
    "top_p negative": ({"top_p": -0.2}, "top_p"),
    "top_p NaN": ({"top_p": math.nan}, "top_p"),
    "top_k negative": ({"top_k": -1}, "top_k must be an integer >= 0"),
    "top_k float": ({"top_k": 2.5}, "top_k"),
    "seed negative": ({"seed": -1}, "seed must be a non-negative integer"),
    "seed float": ({"seed": 1.5}, "seed"),
}


@pytest.mark.parametrize("case", sorted(BAD_PARAMS))
def test_bad_sampling_parameter_is_refused(case):
    kwargs, message = BAD_PARAMS[case]
    with pytest.raises(RequestError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        SamplingParams(**kwargs)


# -- runtime options and decoding settings: refused when constructed ----------------------------------
BAD_OPTIONS = {
    "draft timeout zero": ({"draft_timeout_s": 0}, "draft_timeout_s must be positive"),
    "threads zero": ({"target_threads": 0}, "target_threads must be a positive integer"),
    "alone threads zero": ({"target_alone_threads": 0}, "target_alone_threads must be a positive integer"),
}


@pytest.mark.parametrize("case", sorted(BAD_OPTIONS))
def test_bad_runtime_option_is_refused(case):
    """A configuration error, not a request's: its own type (ConfigError)."""
    kwargs, message = BAD_OPTIONS[case]
    with pytest.raises(ConfigError) as error:
        RuntimeOptions(**kwargs)
    assert message in str(error.value)
    assert not isinstance(error.value, RequestError)


def test_runtime_options_leave_the_threads_to_the_build_once(tiny_pairs):
    """Threads left unset are the recipe's engine.threads_per_engine, filled in once when the build loads (the CLI
    passes RuntimeOptions(backend=...) and so honours the recipe); threads set are kept."""
    from ssd_trt.manifest import read_manifest
    assert (RuntimeOptions(backend="ort").for_build(3).target_threads, RuntimeOptions().for_build(3).draft_threads) \
        == (3, 3)
    assert RuntimeOptions(target_threads=1).for_build(3).target_threads == 1
    with pytest.raises(ConfigError, match="leave the threads to the build"):
        RuntimeOptions().placement("target")
    build = tiny_pairs["perturbed"]
    threads = read_manifest(build).recipe.engine.threads_per_engine
    loaded = ssd_trt.load(build, RuntimeOptions(backend="ort")).options
    assert (loaded.target_threads, loaded.draft_threads, loaded.backend) == (threads, threads, "ort")


BAD_SETTINGS = {
    "draft_len zero": (ssd_trt.SD, {"draft_len": 0}, "draft_len (K) must be an integer in 1..32"),
    "draft_len too large": (ssd_trt.SSD, {"draft_len": 33}, "draft_len"),
    "draft_len float": (ssd_trt.SD, {"draft_len": 2.5}, "draft_len"),
    "tree widths zero": (ssd_trt.SD, {"tree_widths": (2, 0)}, "tree_widths must be positive integers"),
    "ssd C zero": (ssd_trt.SSD, {"saguaro_c": 0.0}, "saguaro_c (C) must be in (0, 1]"),
    "ssd unknown backup": (ssd_trt.SSD, {"backup": "gpu"}, "backup must be auto, jit or ngram"),
    "ssd budget zero": (ssd_trt.SSD, {"draft_len": 4, "fan_out_budget": 0}, "fan_out_budget must be an integer >= 1"),
    "ssd unknown fork policy": (ssd_trt.SSD, {"fork_policy": "widest"}, "fork_policy must be confidence or geometric"),
}


@pytest.mark.parametrize("case", sorted(BAD_SETTINGS))
def test_bad_decoding_setting_is_refused_when_constructed(case):
    kind, kwargs, message = BAD_SETTINGS[case]
    with pytest.raises(RequestError) as error:
        kind(**kwargs)
    assert message in str(error.value)


def test_an_unknown_setting_is_refused_by_name():
    """A typed settings object: a misspelt option fails where it is written, naming it (it was a dict once,
    which passed construction and failed at generate)."""
    with pytest.raises(TypeError, match="fan_out"):
        ssd_trt.SSD(fan_out=3)


# -- requests: refused before any engine runs ---------------------------------------------------------
BAD_REQUESTS = {
    "empty prompt": (lambda g: g.generate(""), "prompt is empty"),
    "whitespace prompt": (lambda g: g.generate("  \n\t"), "prompt is empty"),
    "prompt not a string": (lambda g: g.generate([None]), "prompt must be a string, got NoneType"),
    "invalid UTF-8 bytes": (lambda g: g.generate(b"w5 \xff\xfe w6"), "prompt is not valid UTF-8 (byte 3"),
    "undecodable str (surrogate)": (lambda g: g.generate("w5 \udcff"), "prompt is not valid UTF-8"),
    "prompt over max context": (lambda g: g.generate(TOO_LONG), "prompt is 300 tokens; this engine's max "
                                                                 "context is 256"),
    "prompt + max_new_tokens over context": (
        lambda g: g.generate(" ".join(["w5"] * 200), SamplingParams(max_new_tokens=100), mode="ar"),
        "prompt (200 tokens) + max_new_tokens (100) exceeds the engine's max context 256"),
    "no prompts": (lambda g: g.generate([]), "no prompts given"),
    "batch over max": (lambda g: g.generate(["w5"] * 5, OK), "5 prompts exceed the engine's max batch 4"),
    "unknown mode": (lambda g: g.generate("w5", OK, mode="beam"), "unknown mode 'beam'; choose one of ar, sd, ssd"),
    "chat without template": (lambda g: g.generate("w5", OK, chat=True), "has no chat template"),
    "params not SamplingParams": (lambda g: g.generate("w5", {"max_new_tokens": 4}),
                                  "params must be SamplingParams, got dict"),
    "empty token ids": (lambda g: g.generate_ids([[]], OK), "a prompt encodes to zero tokens"),
    "token id over vocab": (lambda g: g.generate_ids([[1, 999]], OK), "prompt 0 holds token ids outside 0..255"),
    "negative token id": (lambda g: g.generate_ids([[1, 5], [1, -5]], OK), "prompt 1 holds token ids outside"),
    "non-integer token id": (lambda g: g.generate_ids([[1, "a"]], OK), "outside 0..255 (or not integers)"),
    "ssd tree over engine max": (
        lambda g: g.generate("w5", OK, mode=ssd_trt.SSD(draft_len=4, fan_out_budget=30)),
        "an SSD tree step with K=4 and fan-out budget 30 feeds 125 tokens, more than the engine's max_tree_size 96"),
    "draft_len over engine max": (
        lambda g: g.generate("w5", OK, mode=ssd_trt.SD(draft_len=9)),
        "draft_len 9 exceeds the engine's max_draft_len 8"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_is_refused_with_a_specific_message(gen, case):
    request, message = BAD_REQUESTS[case]
    with pytest.raises(RequestError) as error:
        request(gen)
    assert message in str(error.value)


def test_the_largest_draft_len_the_engine_allows_is_accepted(gen):
    largest = ssd_trt.SSD(draft_len=8)
    # the build's default budget, as it is (a budget below K+1 leaves the unlikely outcomes to the backup)
    assert gen.resolve(largest).settings.fan_out_budget == gen.resolve("ssd").settings.fan_out_budget
    gen.generate("w5", OK, mode=largest)


def test_a_request_gets_the_builds_decoding_defaults_unless_it_sets_its_own(tiny_pairs):
    from ssd_trt.build import build
    from tests.helpers import write_recipe
    root = tiny_pairs["self"].parents[1]                 # where the tiny pairs' checkpoints live
    recipe = write_recipe(root / "defaults.yaml", root / "target", root / "target", name="tiny-defaults",
                          decoding={"sd_draft_len": 3, "ssd_draft_len": 2, "ssd_fan_out_budget": 12})
    tuned = ssd_trt.load(build(recipe, root=root))
    assert tuned.generate("w5", OK, mode="sd")[0].stats["draft_len"] == 3
    assert tuned.generate("w5", OK, mode="ssd")[0].stats["draft_len"] == 2
    assert tuned.resolve("ssd").settings.fan_out_budget == 12
    own = ssd_trt.SSD(draft_len=5)
    assert tuned.generate("w5", OK, mode=own)[0].stats["draft_len"] == 5 and tuned.resolve(own).settings.fan_out_budget == 12
    assert tuned.resolve(ssd_trt.SSD(fan_out_budget=7)).settings.fan_out_budget == 7


def test_valid_utf8_bytes_are_the_same_prompt_as_text(gen):
    assert gen.generate(b"w5 w6", OK)[0].token_ids == gen.generate("w5 w6", OK)[0].token_ids


def test_a_refused_request_leaves_the_generator_usable(gen):
    expected = gen.generate("w5 w6", OK)[0].token_ids
    for request, _ in BAD_REQUESTS.values():
        with pytest.raises(RequestError):
            request(gen)
    assert gen.generate("w5 w6", OK)[0].token_ids == expected


# -- CLI: one line on stderr, exit 2 ------------------------------------------------------------------
BAD_CLI = {
    "empty prompt": (["--prompt", ""], "prompt is empty"),
    "max_new_tokens zero": (["--prompt", "w5", "--max-new-tokens", "0"], "max_new_tokens"),
    "max_new_tokens huge": (["--prompt", "w5", "--max-new-tokens", "10000000"], "max_new_tokens"),
    "temperature NaN": (["--prompt", "w5", "--temperature", "nan"], "temperature"),
    "temperature negative": (["--prompt", "w5", "--temperature", "-1"], "temperature"),
    "top_p above one": (["--prompt", "w5", "--top-p", "1.5"], "top_p"),
    "top_k negative": (["--prompt", "w5", "--top-k", "-1"], "top_k"),
    "draft_len zero": (["--prompt", "w5", "--draft-len", "0"], "draft_len"),
    "draft_len for ar": (["--prompt", "w5", "--mode", "ar", "--draft-len", "2"],
                         "--draft-len applies to mode sd or ssd, not ar (mode ar takes none of them)"),
    "tree for ssd": (["--prompt", "w5", "--mode", "ssd", "--tree-widths", "2,2"],
                     "--tree-widths applies to mode sd, not ssd (mode ssd takes --draft-len, --fan-out-budget, "
                     "--backup)"),
    "undecodable argv": (["--prompt", "w5 \udcff"], "not valid UTF-8"),
    "prompt over max context": (["--prompt", TOO_LONG], "max context is 256"),
    "chat without template": (["--prompt", "w5", "--chat"], "no chat template"),
}


@pytest.mark.parametrize("case", sorted(BAD_CLI))
def test_cli_bad_input_is_one_line_exit_2(tiny_pairs, capsys, case):
    argv, message = BAD_CLI[case]
    assert cli.main([str(tiny_pairs["self"]), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ssd_trt.generate: error: ") and message in err, err


def test_cli_unknown_mode_is_argparse_usage_error(tiny_pairs, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([str(tiny_pairs["self"]), "--prompt", "w5", "--mode", "beam"])
    assert exit_.value.code == 2 and "invalid choice: 'beam'" in capsys.readouterr().err


def test_cli_missing_build_dir_is_one_line(tmp_path, capsys):
    assert cli.main([str(tmp_path / "nope"), "--prompt", "w5"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is not an ssd-trt build" in err


def test_cli_invalid_utf8_in_a_real_argv_is_one_line(tiny_pairs):
    """The bytes reach Python as surrogates; the process prints one line and exits 2."""
    result = subprocess.run([sys.executable.encode(), b"-m", b"ssd_trt.generate", bytes(tiny_pairs["self"]),
                             b"--prompt", b"w5 \xff\xfe"], cwd=ROOT, capture_output=True, timeout=120)
    err = result.stderr.decode("utf-8", "replace").strip()
    assert result.returncode == 2 and "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("ssd_trt.generate: error: prompt is not valid UTF-8"), err
