"""A checkpoint's generation defaults: ``generation_config.json`` as a typed, frozen object.

transformers' ``GenerationConfig.from_pretrained`` reads the same file; of its
fields this keeps the ones a decoder of this package uses: the special token ids
and the sampling defaults. ``eos_token_id`` may be an int or a list there (a
model with several end tokens); it is always a tuple here. A file without
``eos_token_id`` (or a folder without the file) takes it from config.json, as
transformers does when it builds a generation config from the model config.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from models.config import ConfigError, parse_float
from models.loading import check_folder, read_json_object

__all__ = ["GenerationConfig", "load_generation_config"]

GENERATION_CONFIG = "generation_config.json"


@dataclass(frozen=True)
class GenerationConfig:
    """Generation defaults of a checkpoint; each field is None where the checkpoint gives none.

    Attributes:
      eos_token_id: the end-of-sequence token ids (a tuple even where the file has one int).
      bos_token_id: the beginning-of-sequence token id.
      pad_token_id: the padding token id.
      temperature: the sampling temperature (> 0 in transformers; 1.0 there when absent).
      top_k: keep the k most likely tokens (0: no limit).
      top_p: nucleus sampling mass, in (0, 1].
      do_sample: True: sample with the settings above; False: greedy decoding.
    """

    eos_token_id: tuple[int, ...] | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    do_sample: bool | None = None


def _token_id(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{where} must be a token id (an integer >= 0); found {value!r}")
    return value


def _eos(value: Any, where: str) -> tuple[int, ...]:
    if isinstance(value, list):
        return tuple(_token_id(v, where) for v in value)
    return (_token_id(value, where),)


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{where} must be a number; found {value!r}")
    return parse_float(value, where=where)


def _within(parse, ok, what: str):
    """`parse`, then ConfigError unless ok(value) (`what`: the range, for the message)."""
    def checked(value, where):
        value = parse(value, where)
        if not ok(value):
            raise ConfigError(f"{where} must be {what}; found {value!r}")
        return value

    return checked


def _optional(d: dict, key: str, file: str, parse):
    value = d.get(key)
    return None if value is None else parse(value, f"{file}: key {key!r}")


def _typed(kind: type, name: str):
    def parse(value, where):
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise ConfigError(f"{where} must be {name}; found {value!r}")
        return value

    return parse


def _config_eos(folder: str) -> tuple[int, ...] | None:
    """config.json's eos_token_id (or its text_config's), or None without the file or the key."""
    file = os.path.join(folder, "config.json")
    if not os.path.isfile(file):
        return None
    d = read_json_object(file)
    text = d.get("text_config")
    if d.get("eos_token_id") is None and isinstance(text, dict):
        return _optional(text, "eos_token_id", f"{file} (text_config)", _eos)
    return _optional(d, "eos_token_id", file, _eos)


def load_generation_config(path: str | os.PathLike) -> GenerationConfig:
    """The generation defaults of checkpoint folder `path`.

    Reads ``path/generation_config.json``; where it has no ``eos_token_id`` (or
    the folder has no such file), ``eos_token_id`` comes from ``path/config.json``
    (top level, else its ``text_config``). Fields absent from both are None.

    Raises:
      CheckpointNotFoundError: `path` is not a folder.
      ConfigError: generation_config.json or config.json is not a JSON object, or a
        field has the wrong type or range (token ids must be integers >= 0,
        ``eos_token_id`` one or a list of them, ``temperature`` a finite number >= 0,
        ``top_k`` an int >= 0, ``top_p`` in (0, 1], ``do_sample`` a bool); the
        message names the file and the key.
    """
    folder = check_folder(path)
    file = os.path.join(folder, GENERATION_CONFIG)
    d = read_json_object(file) if os.path.isfile(file) else {}
    eos = _optional(d, "eos_token_id", file, _eos)
    return GenerationConfig(
        eos_token_id=eos if eos is not None else _config_eos(folder),
        bos_token_id=_optional(d, "bos_token_id", file, _token_id),
        pad_token_id=_optional(d, "pad_token_id", file, _token_id),
        temperature=_optional(d, "temperature", file,
                              _within(_number, lambda t: 0 <= t < math.inf, "a finite number >= 0")),
        top_k=_optional(d, "top_k", file, _within(_typed(int, "an integer"), lambda k: k >= 0, "an integer >= 0")),
        top_p=_optional(d, "top_p", file, _within(_number, lambda p: 0 < p <= 1, "in (0, 1]")),
        do_sample=_optional(d, "do_sample", file, _typed(bool, "true or false")),
    )
