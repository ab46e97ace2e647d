"""A checkpoint's generation defaults (``generation_config.json``) as a small typed object.

transformers reads the same file into its ``GenerationConfig``; only the keys
that decoding here uses are kept.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
import os

from models.config import ConfigError

__all__ = ["GenerationConfig", "load_generation_config"]


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """Generation defaults of a checkpoint; each field is None where the checkpoint gives none.

    Attributes:
      eos_token_id: the ids that end a sequence (one or several).
      bos_token_id, pad_token_id: token ids.
      temperature, top_k, top_p, do_sample: sampling defaults, as transformers reads them.
    """

    eos_token_id: tuple[int, ...] | None = None
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    do_sample: bool | None = None


def _read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        try:
            d = json.loads(f.read().decode("utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{path}: expected a JSON object; found {type(d).__name__}")
    return d


def _field(d: dict, key: str, kind, source: str):
    value = d.get(key)
    if value is None:
        return None
    if kind is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ConfigError(f"{source}: key {key!r} must be {kind.__name__}; found {value!r}")
    return kind(value)


def _eos(d: dict, source: str) -> tuple[int, ...] | None:
    value = d.get("eos_token_id")
    if value is None:
        return None
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(f"{source}: key 'eos_token_id' must be a token id or a list of them; found {value!r}")
    return tuple(int(i) for i in ids)


def load_generation_config(path: str | os.PathLike) -> GenerationConfig:
    """The generation defaults of checkpoint folder `path`.

    Reads ``generation_config.json``; where it gives no ``eos_token_id`` (or
    is absent), ``config.json``'s is used, as transformers does. Neither file:
    every field None.

    Raises:
      ConfigError: a file that is not a JSON object, or a key of the wrong type.
    """
    path = os.fspath(path)
    gen_path = os.path.join(path, "generation_config.json")
    gen = _read_json(gen_path) or {}
    fields = dict(
        eos_token_id=_eos(gen, gen_path),
        bos_token_id=_field(gen, "bos_token_id", int, gen_path),
        pad_token_id=_field(gen, "pad_token_id", int, gen_path),
        temperature=_field(gen, "temperature", float, gen_path),
        top_k=_field(gen, "top_k", int, gen_path),
        top_p=_field(gen, "top_p", float, gen_path),
        do_sample=_field(gen, "do_sample", bool, gen_path),
    )
    if fields["eos_token_id"] is None:
        cfg_path = os.path.join(path, "config.json")
        fields["eos_token_id"] = _eos(_read_json(cfg_path) or {}, cfg_path)
    return GenerationConfig(**fields)
