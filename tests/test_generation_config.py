"""models.load_generation_config: generation_config.json (with config.json's eos as fallback) as a frozen object."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest

from models import CheckpointNotFoundError, ConfigError, GenerationConfig, load_generation_config

DATA = os.path.join(os.path.dirname(__file__), "data")
FIXTURES = ["mamba2_tiny", "nemotron_h_tiny", "qwen3_5_tiny", "qwen3_next_tiny"]


def write(folder, name, obj):
    (folder / name).write_text(obj if isinstance(obj, str) else json.dumps(obj))


@pytest.mark.parametrize("name", FIXTURES)
def test_fixtures(name):
    cfg = load_generation_config(os.path.join(DATA, name))
    assert cfg == GenerationConfig(eos_token_id=(2,), bos_token_id=1, pad_token_id=0)
    assert cfg.temperature is None and cfg.top_k is None and cfg.top_p is None and cfg.do_sample is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.eos_token_id = (3,)


def test_sampling_defaults_and_an_eos_list(tmp_path):
    write(tmp_path, "generation_config.json", {"eos_token_id": [2, 5], "bos_token_id": None, "temperature": 0.6,
                                               "top_k": 20, "top_p": 0.95, "do_sample": True})
    assert load_generation_config(tmp_path) == GenerationConfig(
        eos_token_id=(2, 5), temperature=0.6, top_k=20, top_p=0.95, do_sample=True)


def test_eos_falls_back_to_config_json(tmp_path):
    write(tmp_path, "config.json", {"model_type": "nemotron_h", "eos_token_id": [7, 8]})
    assert load_generation_config(tmp_path) == GenerationConfig(eos_token_id=(7, 8))  # no generation_config.json
    write(tmp_path, "generation_config.json", {"pad_token_id": 0, "top_k": 5})
    assert load_generation_config(tmp_path) == GenerationConfig(eos_token_id=(7, 8), pad_token_id=0, top_k=5)
    write(tmp_path, "generation_config.json", {"eos_token_id": 3})
    assert load_generation_config(tmp_path).eos_token_id == (3,)  # the file wins over config.json
    write(tmp_path, "config.json", {"model_type": "qwen3_5", "text_config": {"eos_token_id": 9}})
    write(tmp_path, "generation_config.json", {})
    assert load_generation_config(tmp_path).eos_token_id == (9,)  # a multimodal config's text_config


def test_a_folder_without_either_file_gives_all_none(tmp_path):
    assert load_generation_config(tmp_path) == GenerationConfig()
    assert all(getattr(GenerationConfig(), f.name) is None for f in dataclasses.fields(GenerationConfig))


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", b"\xff\xfe"])
def test_malformed_file_names_it(tmp_path, text):
    file = tmp_path / "generation_config.json"
    file.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=re.escape(str(file)) + ": (not valid JSON|expected a JSON object)"):
        load_generation_config(tmp_path)


@pytest.mark.parametrize("key, value", [("eos_token_id", "2"), ("eos_token_id", [2, -1]), ("pad_token_id", True),
                                        ("top_k", 2.5), ("temperature", "hot"), ("do_sample", 1),
                                        ("temperature", -1), ("top_k", -3), ("top_p", 7), ("top_p", 0)])
def test_bad_field_names_the_file_and_key(tmp_path, key, value):
    write(tmp_path, "generation_config.json", {key: value})
    with pytest.raises(ConfigError, match=re.escape(str(tmp_path / "generation_config.json")) + f": key '{key}'"):
        load_generation_config(tmp_path)


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load_generation_config(tmp_path / "nowhere")
