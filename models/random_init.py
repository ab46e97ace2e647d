"""Models of real shape with random weights, built from a config.json alone
(benchmarks and smoke tests; the weights are N(0, 0.02) as each layer's init)."""

from __future__ import annotations

import os

import jax.numpy as jnp
from flax import nnx

from models.config import ConfigError, NemotronHConfig, QwenHybridConfig
from models.loading import check_dtypes, read_config
from models.nemotron_h import NemotronHForCausalLM
from models.qwen_hybrid import QwenHybridForCausalLM

_FAMILIES = {
    "mamba2": (NemotronHConfig, NemotronHForCausalLM),
    "nemotron_h": (NemotronHConfig, NemotronHForCausalLM),
    "qwen3_next": (QwenHybridConfig, QwenHybridForCausalLM),
    "qwen3_5_text": (QwenHybridConfig, QwenHybridForCausalLM),
    "qwen3_5": (QwenHybridConfig, QwenHybridForCausalLM),
}


def init_model(path: str | os.PathLike, dtype=jnp.bfloat16, *, seed: int = 0, ssm_state_dtype=jnp.float32):
    """A model with the architecture of `path`/config.json and random weights.

    Args:
      path: a folder holding config.json (no weights needed).
      dtype: parameter dtype.
      seed: PRNG seed of the weights.
      ssm_state_dtype: dtype of the SSM states between decode steps.

    Raises:
      CheckpointNotFoundError: no folder or no config.json.
      ConfigError: an unknown model_type or a malformed config.
      TypeError: a non-floating `dtype` or an `ssm_state_dtype` other than f32 / bf16.
    """
    check_dtypes(dtype, ssm_state_dtype)
    cfg = read_config(path)
    source = os.path.join(os.fspath(path), "config.json")
    family = _FAMILIES.get(cfg.get("model_type"))
    if family is None:
        raise ConfigError(f"{source}: unknown model_type {cfg.get('model_type')!r}; supported: {', '.join(_FAMILIES)}")
    config_cls, model_cls = family
    config = config_cls.from_hf_config(cfg, source=source)
    return model_cls(config, ssm_state_dtype=ssm_state_dtype, param_dtype=dtype, rngs=nnx.Rngs(seed))
