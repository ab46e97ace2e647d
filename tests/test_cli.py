"""The `replayssm-generate` command, run in-process through `main(argv)`:
reports, streaming, the checkpoint's generation defaults, chat templates,
the persistent compilation cache, memory checks, and bad input in one line."""

from __future__ import annotations

import json
import pathlib
import re
import shutil

import jax
import numpy as np
import pytest

from replayssm_jax import generate as command
from replayssm_jax.generate import NEAR_TIES, first_difference, main
from replayssm_jax.generation import set_compile_cache, status

DATA = pathlib.Path(__file__).parent / "data"
README = pathlib.Path(__file__).parent.parent / "README.md"


def reference(name):
    return np.load(DATA / name / "reference.npz")


@pytest.fixture(scope="module")
def module_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xdg-cache")


@pytest.fixture(autouse=True)
def compile_cache(monkeypatch, module_cache):
    """The command's default compile cache lives in one temporary folder for this module (its tests share
    compiled programs, as runs of the command do); JAX's persistent cache is as before each test again (the
    run's: conftest.py)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(module_cache))
    before = jax.config.jax_compilation_cache_dir
    yield
    set_compile_cache(before)


def checkpoint_copy(tmp_path, **files) -> str:
    """A copy of the nemotron_h_tiny fixture in tmp_path, with `files` (name -> text or dict) added or replaced."""
    folder = tmp_path / "checkpoint"
    folder.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(DATA / "nemotron_h_tiny" / name, folder / name)
    for name, content in files.items():
        name = name.replace("__", ".")
        (folder / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return str(folder)


def run_json(argv, capsys) -> dict:
    assert main(argv + ["--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_command_default_checkpoint_json(capsys):
    assert main(["--max-new-tokens", "6", "--compare", "--json", "--buffer-len", "4"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["identical"] is True
    runs = report["runs"]
    assert runs["replay"]["buffer_len"] == 4 and runs["standard"]["buffer_len"] is None
    for r in runs.values():
        assert r["backend"] == "xla" and r["tokens_per_s"] > 0 and r["compile_s"] > 0
        assert len(r["generated_ids"]) == 1 and r["text"][0].startswith("ReplaySSM")
    # generated_ids holds the prompt; new_ids only what was generated
    prompt = report["prompt_ids"][0]
    for r in runs.values():
        assert r["generated_ids"][0] == prompt + r["new_ids"][0]
        assert len(r["new_ids"][0]) == r["num_generated"][0]
    assert report["first_difference"] is None and report["speedup"] > 0


def test_command_text_output_names_state_and_route(capsys):
    assert main(["--max-new-tokens", "3", "--compare", "--buffer-len", "4", "--route", "direct", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "[standard] backend=xla" in out and "[replay L=4 route=direct] backend=xla" in out
    assert "identical" in out


def test_command_with_a_single_new_token_reports_no_speed(capsys):
    assert main(["--max-new-tokens", "1", "--compare", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["speedup"] is None and report["runs"]["replay"]["tokens_per_s"] is None
    assert all(len(r["generated_ids"][0]) == len(report["runs"]["standard"]["generated_ids"][0])
               for r in report["runs"].values())


def test_command_standard_state_ignores_buffer_len(capsys):
    """--buffer-len only matters to the replay state (checked when it runs); given with --state standard it warns."""
    assert main(["--max-new-tokens", "2", "--state", "standard", "--buffer-len", "0", "--json"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["state"] == "standard" and report["buffer_len"] is None and report["num_generated"] == [2]
    assert "warning: --buffer-len applies to --state replay only" in captured.err


def test_route_with_the_standard_state_warns(capsys):
    assert main(["--max-new-tokens", "0", "--state", "standard", "--route", "direct", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ("replayssm-generate: warning: --route applies to --state replay only; the standard "
                            "state ignores it\n")
    assert json.loads(captured.out)["route"] is None


# `slow`: the direct and the default route decode the reference tokens by default in tests/test_generation.py
# (test_direct_route_tokens_match_transformers, test_greedy_tokens_match_transformers), --prompt-ids of
# several rows and --stop '' run in test_lockstep_option, --route in
# test_command_text_output_names_state_and_route, and Generator's default lockstep (--lockstep auto's) stays
# off on the xla backend in tests/test_bench_scripts.py::test_e2e_smoke.
@pytest.mark.slow
def test_command_prompt_ids_on_fixture(capsys):
    ref = reference("qwen3_next_tiny")
    ids = ";".join(",".join(map(str, row)) for row in ref["prompt_ids"])
    n = ref["generated_ids"].shape[1] - ref["prompt_ids"].shape[1]
    argv = ["--checkpoint", str(DATA / "qwen3_next_tiny"), "--prompt-ids", ids, "--max-new-tokens", str(n),
            "--state", "replay", "--buffer-len", "3", "--stop", "", "--json"]
    for route in ("direct", "auto"):  # auto, the default, takes the output route off the kernels
        assert main(argv + (["--route", route] if route != "auto" else [])) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["generated_ids"] == ref["generated_ids"].tolist()
        assert report["state"] == "replay" and report["buffer_len"] == 3 and report["route"] == route
        assert report["lockstep"] is False  # --lockstep auto, the default: off on the xla backend


def test_lockstep_option(capsys):
    """--lockstep on: the reference's tokens, and the JSON says the decode ran in lockstep (auto, the default, is
    off on the xla backend: test_command_prompt_ids_on_fixture, `slow`); on with a block size that L does not
    divide: a usage error naming both flags."""
    ref = reference("qwen3_next_tiny")
    ids = ";".join(",".join(map(str, row)) for row in ref["prompt_ids"])
    n = ref["generated_ids"].shape[1] - ref["prompt_ids"].shape[1]
    argv = ["--checkpoint", str(DATA / "qwen3_next_tiny"), "--prompt-ids", ids, "--max-new-tokens", str(n),
            "--buffer-len", "3", "--block-size", "6", "--route", "output", "--stop", "", "--json"]
    assert main(argv + ["--lockstep", "on"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["generated_ids"] == ref["generated_ids"].tolist() and report["lockstep"] is True
    assert main(argv[:-1] + ["--lockstep", "on", "--block-size", "4"]) == 2
    err = capsys.readouterr().err
    assert "--lockstep on needs" in err and "block_size = 4 not a multiple of buffer_len = 3" in err


# `slow`: the command's stop tokens and sampling from generation_config.json run by default in
# test_generation_config_defaults_and_explicit_options_win, and sampled rows that end at the checkpoint's eos
# in tests/test_generation.py::test_generation_config_gives_the_default_stop_token_and_sampling.
@pytest.mark.slow
def test_default_stop_is_the_checkpoints_eos(capsys):
    """The issue's command: sampled rows end at generation_config.json's eos_token_id (2)."""
    report = run_json(["--checkpoint", str(DATA / "nemotron_h_tiny"), "--prompt-ids",
                       "5,6,7,8,9;10,11;12,13,14,15,16,17,18", "--max-new-tokens", "50", "--temperature", "1.0",
                       "--top-k", "5"], capsys)
    assert report["stop_tokens"] == [2]
    for new in report["new_ids"]:
        assert 2 not in new[:-1]
    assert any(new[-1] == 2 and len(new) < 50 for new in report["new_ids"])


def test_generation_config_defaults_and_explicit_options_win(tmp_path, capsys):
    ckpt = checkpoint_copy(tmp_path, generation_config__json={"do_sample": True, "temperature": 0.7, "top_k": 20,
                                                              "eos_token_id": [2, 3]})
    base = ["--checkpoint", ckpt, "--max-new-tokens", "0"]
    report = run_json(base, capsys)
    assert report["sampling"] == {"temperature": 0.7, "top_k": 20, "top_p": 1.0} and report["stop_tokens"] == [2, 3]
    report = run_json(base + ["--temperature", "0", "--stop", ""], capsys)
    assert report["sampling"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0} and report["stop_tokens"] == []
    report = run_json(base + ["--top-p", "0.5", "--stop", "7, 8"], capsys)
    assert report["sampling"] == {"temperature": 0.7, "top_k": 20, "top_p": 0.5} and report["stop_tokens"] == [7, 8]
    bad = checkpoint_copy(tmp_path / "bad", generation_config__json={"do_sample": True, "temperature": -1.0})
    assert main(["--checkpoint", bad, "--max-new-tokens", "0"]) == 2
    assert "generation_config.json: key 'temperature' must be a finite number >= 0; found -1.0" in \
        capsys.readouterr().err


def test_json_fields_are_documented(capsys):
    """Every field of both JSON layouts is named in the README's "Generating" section."""
    compare = run_json(["--compare", "--max-new-tokens", "0"], capsys)
    single = run_json(["--max-new-tokens", "0"], capsys)
    fields = set(compare) | set(compare["runs"]["replay"]) | set(single) | set(compare["sampling"])
    fields |= {"row", "step", "standard", "replay"}  # first_difference's
    section = README.read_text().split("## Generating")[1].split("\n## ")[0]
    missing = sorted(f for f in fields if f"`{f}`" not in section)
    assert not missing, f"README's Generating section does not document {missing}"
    options = {a.option_strings[0] for a in command.build_parser()._actions if a.option_strings != ["-h", "--help"]}
    missing = sorted(o for o in options if f"`{o}" not in section)
    assert not missing, f"README's Generating section does not document {missing}"


def test_first_difference_is_reported_with_its_reason(capsys):
    assert first_difference([[1, 2, 3, 4]], [[1, 2, 3, 4]], [2]) is None
    assert first_difference([[1, 2], [5, 6, 7, 8]], [[1, 2], [5, 6, 7, 9]], [1, 2]) == \
        {"row": 1, "step": 1, "standard": 8, "replay": 9}
    assert first_difference([[1, 2, 3]], [[1, 2, 3, 4]], [1]) == {"row": 0, "step": 2, "standard": None, "replay": 4}
    run = dict(buffer_len=None, route=None, backend="xla", tokens_per_s=None, prefill_s=0.0, compile_s=0.0,
               generated_ids=[[1]], text=["a"])
    report = dict(checkpoint="c", model_type="m", dtype="bfloat16", device="d", identical=False, speedup=None,
                  first_difference={"row": 0, "step": 17, "standard": 5, "replay": 6},
                  runs={"standard": dict(run, state="standard"), "replay": dict(run, state="replay", buffer_len=4)})
    command._print_human(report, new_only=False, streamed=False)
    out = capsys.readouterr().out
    assert "tokens DIFFERENT from row 0, new token 17 (standard 5, replay 6)" in out and NEAR_TIES in out


def test_a_single_prompt_streams_its_text(capsys):
    """The text goes out as it is generated (here in blocks of 2 steps); --new-only leaves out the prompt.
    On a pipe (pytest's capture) no status line or progress bar is written."""
    argv = ["--max-new-tokens", "5", "--block-size", "2", "--stop", ""]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    lines = captured.out.splitlines()
    assert lines[1] == "[replay L=16 route=auto] backend=xla"
    assert lines[2].startswith(command.DEFAULT_PROMPT) and len(lines[2]) > len(command.DEFAULT_PROMPT)
    assert re.fullmatch(r"5 new tokens: [\d.]+ tokens/s decode, prefill [\d.]+ ms, compile [\d.]+ s, cache [\d.]+ MiB a "
                        r"sequence", lines[-1])
    report = run_json(argv, capsys)
    assert lines[2] == command._printable(report["text"][0])
    assert main(argv + ["--new-only"]) == 0
    assert capsys.readouterr().out.splitlines()[2] == command._printable(report["new_text"][0])


def test_streamed_text_is_the_json_text_with_a_tokenizer_that_spaces_words(tmp_path, capsys):
    """A tokenizer whose decoder joins words with spaces: the streamed new text is decoded after the prompt,
    so the printed line equals the JSON's text (decoding the new ids alone would drop the space after the
    prompt)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"w{i}": i for i in range(1, 256)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    ckpt = checkpoint_copy(tmp_path)
    tokenizer.save(f"{ckpt}/tokenizer.json")
    argv = ["--checkpoint", ckpt, "--prompt", "w7 w9", "--max-new-tokens", "4", "--block-size", "2", "--stop", ""]
    assert main(argv) == 0
    line = capsys.readouterr().out.splitlines()[2]
    report = run_json(argv, capsys)
    assert line == report["text"][0] and line.startswith("w7 w9 w") and len(line.split()) == 6


def test_status_line_only_where_asked(capsys):
    with status("loading weights", True):
        pass
    assert "loading weights" in capsys.readouterr().err
    with status("loading weights", None):  # stderr is not a terminal here
        pass
    assert capsys.readouterr().err == ""


def test_compile_cache_makes_a_second_run_compile_nothing_new(tmp_path, capsys):
    cache = tmp_path / "jax"
    argv = ["--compile-cache", str(cache), "--max-new-tokens", "3"]
    first = run_json(argv, capsys)
    entries = sorted(p.name for p in cache.iterdir())
    assert entries and first["compile_cache"] == str(cache)
    second = run_json(argv, capsys)
    assert sorted(p.name for p in cache.iterdir()) == entries  # every program came from the cache
    assert second["generated_ids"] == first["generated_ids"] and second["compile_s"] < first["compile_s"]
    assert run_json(["--no-compile-cache", "--max-new-tokens", "0"], capsys)["compile_cache"] is None
    assert jax.config.jax_compilation_cache_dir is None


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n"
            "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_chat_applies_the_checkpoints_template(tmp_path, capsys):
    ckpt = checkpoint_copy(tmp_path, tokenizer_config__json={"bos_token": "<s>", "eos_token": {"content": "</s>"},
                                                             "chat_template": TEMPLATE})
    report = run_json(["--checkpoint", ckpt, "--chat", "--prompt", "hi", "--max-new-tokens", "0"], capsys)
    assert report["chat"] is True
    assert report["prompt_ids"] == [list(b"<s><|user|>hi</s>\n<|assistant|>")]
    for name, template, message in [
            ("raises", "{{ raise_exception('no system role here') }}", "fails on this conversation (no system role"),
            ("unsafe", "{{ ''.__class__.__mro__ }}", "fails on this conversation"),
            ("broken", "{% for m in messages %}", "the chat template does not compile")]:
        ckpt = checkpoint_copy(tmp_path / name, tokenizer_config__json={"chat_template": template})
        assert main(["--checkpoint", ckpt, "--chat", "--max-new-tokens", "0"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_malformed_tokenizer_json_is_one_line(tmp_path, capsys):
    ckpt = checkpoint_copy(tmp_path, tokenizer__json='{"version": ')
    assert main(["--checkpoint", ckpt, "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "tokenizer.json: not a tokenizer the `tokenizers` library can read" in err


def test_tokenizer_ids_outside_the_vocabulary_name_the_prompt(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "hello": 300, "world": 5}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    ckpt = checkpoint_copy(tmp_path)
    tokenizer.save(f"{ckpt}/tokenizer.json")
    assert main(["--checkpoint", ckpt, "--prompt", "world hello"]) == 2
    err = capsys.readouterr().err
    assert err == ("replayssm-generate: error: --prompt: the checkpoint's tokenizer.json gives token id 300, "
                   "outside the model's vocabulary [0, 256) (config.json's vocab_size): the tokenizer does not "
                   "belong to this model\n")


def test_memory_that_does_not_fit_is_one_line(monkeypatch, capsys):
    """A run whose weights and cache exceed the free memory is refused before loading, saying what fits."""
    monkeypatch.setattr(command, "free_memory", lambda device=None: (64 * 2**20, "test memory"))
    assert main(["--max-new-tokens", "1000000", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the model does not fit" in err and "the test memory is 64.0 MiB" in err
    fits = int(re.search(r"--max-new-tokens up to about (\d+) fits at this batch", err).group(1))
    assert 100_000 < fits < 1_000_000 and "no batch fits at this length" in err


BAD_COMMANDS = [
    (["--checkpoint", "/nonexistent/folder"], "cannot load checkpoint '/nonexistent/folder'"),
    (["--prompt-ids", "1,2,999"], "token id 999 outside the vocabulary [0, 256)"),
    (["--prompt", ""], "--prompt is empty"),
    (["--prompt-ids", "1,2;;3"], "--prompt-ids: row 1 is empty"),
    (["--prompt-ids", "1,x"], "--prompt-ids: row 0 ('1,x') is not a comma-separated list of integers"),
    (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0; got -1"),
    (["--buffer-len", "0"], "--buffer-len must be >= 1; got 0"),
    (["--buffer-len", "65", "--backend", "interpret"], "--buffer-len must be <= 64 with backend 'interpret'"),
    (["--stop", "999999"], "--stop has token id 999999 outside the vocabulary"),
    (["--prompt-ids", "1,999999"], "--prompt-ids row 0 has token id 999999 outside the vocabulary"),
    (["--backend", "cuda"], "--backend must be one of pallas, interpret, xla; got 'cuda'"),
    (["--dtype", "float64"], "--dtype must be one of float32, bfloat16; got 'float64'"),
    (["--top-p", "0", "--temperature", "1"], "--top-p must be in (0, 1]; got 0.0"),
    (["--top-k", "5"], "--top-k and --top-p apply to sampling: give --temperature > 0 with them"),
    (["--seed", "-3"], "--seed must be in [0, 2**32); got -3"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--state", "fast"], "argument --state: invalid choice: 'fast'"),
    (["--route", "fast"], "argument --route: invalid choice: 'fast'"),
    # A non-UTF-8 argument reaches Python as lone surrogates (PEP 383): b"caf\xe9" is "caf\udce9".
    (["--prompt", "caf\udce9"], "--prompt is not valid UTF-8 text: byte 0xe9 at character 3"),
    (["--prompt-ids", "99999999999999999999"],
     "--prompt-ids row 0 has token id 99999999999999999999 outside the vocabulary [0, 256)"),
    (["--stop", ",,,"], "--stop must be comma-separated token ids ('' for none); got ',,,'"),
    (["--state", "standard", "--compare"], "--compare runs both states: leave out --state (got --state standard)"),
    (["--block-size", "0"], "--block-size must be >= 1; got 0"),
    (["--chat"], "--chat: " + str(pathlib.Path(command.default_checkpoint())) + " has no tokenizer_config.json "
                 "with a chat template"),
    (["--chat", "--prompt-ids", "1,2"], "--chat applies the chat template to text: give --prompt"),
    (["--compile-cache", "/proc/no/such"], "--compile-cache: compile cache directory '/proc/no/such' cannot be"),
    (["--compile-cache", "x", "--no-compile-cache"], "not allowed with argument --compile-cache"),
    (["--max-new-tokens", "1000000000"], "decode cache of 1 prompt x 1073741824 positions needs 256.0 GiB"),
    # A value that starts with "-" is the option's value, not an option of its own.
    (["--prompt-ids", "-1,2"], "--prompt-ids row 0 has token id -1 outside the vocabulary [0, 256)"),
    (["--stop", "-1"], "--stop has token id -1 outside the vocabulary"),
    (["--checkpoint", ""], "--checkpoint must name a folder; got an empty path"),
    (["--buffer-len", "100000000", "--max-new-tokens", "2"],
     "the SSM states, buffers and conv windows take the most, and grow with --buffer-len = 100000000"),
]


@pytest.mark.parametrize("argv, message", BAD_COMMANDS, ids=[m[:24] for _, m in BAD_COMMANDS])
def test_command_bad_input_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert message in err, err
