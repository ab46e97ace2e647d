"""The model families: config.json ``model_type`` -> config parser, model class, weight mapping.

A family module (`models.nemotron_h`, `models.qwen_hybrid`) describes itself
with a `Family` and calls `register` when it is imported; ``models/__init__.py``
imports every family, so `models.load_model` and `models.random_init.init_model`
(which consult this registry) see them all. This module imports no family and
no loader: the families and the loaders import it, and nothing imports back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from models.config import ConfigError

__all__ = ["Family", "register", "family_of", "parse", "model_types"]


@dataclass(frozen=True)
class Family:
    """One model family.

    Attributes:
      class_names: model_type -> the transformers class of such a checkpoint
        (used in error messages), e.g. {"mamba2": "Mamba2ForCausalLM"}.
      parse_config: ``parse_config(config_dict, source=path)`` -> the family's
        frozen config; raises `ConfigError`.
      model_class: the NNX model, built as ``model_class(config, *,
        ssm_state_dtype, param_dtype, rngs)``.
      weight_map: ``weight_map(config, model_type)`` -> a function from a
        checkpoint tensor name to the model's parameter name, or None for a
        tensor skipped on purpose (``mtp.*`` heads, which ``load_model(path,
        mtp=True)`` reads by their own names instead; a tied ``lm_head.weight``).
    """

    class_names: Mapping[str, str]
    parse_config: Callable[..., Any]
    model_class: type
    weight_map: Callable[[Any, str], Callable[[str], str | None]]


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> None:
    """Make `family` the one for each of its model types.

    Raises:
      ValueError: a model_type already registered to another family.
    """
    for model_type in family.class_names:
        other = _FAMILIES.get(model_type)
        if other is not None and other is not family:
            raise ValueError(f"model_type {model_type!r} is already registered to {other.model_class.__name__}")
    for model_type in family.class_names:
        _FAMILIES[model_type] = family


def model_types() -> tuple[str, ...]:
    """The registered model types, in registration order."""
    return tuple(_FAMILIES)


def family_of(model_type: Any, source: str) -> Family:
    """The family of `model_type` (the value of config.json's key at `source`).

    Raises:
      ConfigError: an unregistered (or missing) model_type, naming `source` and the supported ones.
    """
    if model_type is None:
        raise ConfigError(f"{source}: missing key 'model_type' (the model family); supported: {', '.join(_FAMILIES)}")
    family = _FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise ConfigError(f"{source}: unknown model_type {model_type!r}; supported: {', '.join(_FAMILIES)}")
    return family


def parse(config_dict: dict, source: str) -> tuple[Family, Any]:
    """(family, parsed config) of a config.json dict read from `source`.

    Raises:
      ConfigError: an unknown model_type, or a config the family cannot build a model from.
    """
    family = family_of(config_dict.get("model_type"), source)
    return family, family.parse_config(config_dict, source=source)
