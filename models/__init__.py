"""Hybrid SSM language models (Nemotron-H / Mamba-2, Qwen3-Next, Qwen3.5) loaded from Hugging Face checkpoints.

    from models import load_model, make_prefill, make_decode_step, split_params
    model = load_model("path/to/checkpoint")           # config.json + safetensors
    logits = model(input_ids)                          # full forward
    logits, cache = model.prefill(input_ids, max_len=64, replay_buffer_len=16)
    logits, cache = model.decode(tokens, cache)        # one token per sequence

Each model family registers its model types in `models.registry` when its
module is imported; this package imports every family, so `load_model` and
`models.random_init.init_model` know them all.
"""

from models import nemotron_h, qwen_hybrid  # noqa: F401  (registers the families)
from models.common import HybridCache, make_commit, make_decode_step, make_prefill, make_verify_step, split_params
from models.config import ConfigError, NemotronHConfig, QwenHybridConfig
from models.generation_config import GenerationConfig, load_generation_config
from models.loading import (
    CheckpointError,
    CheckpointNotFoundError,
    TensorSource,
    load_model,
    read_config,
)
from models.nemotron_h import NemotronHForCausalLM
from models.qwen_hybrid import QwenHybridForCausalLM
from models.registry import model_types

#: The config.json model types `load_model` reads (those of the registered families).
MODEL_TYPES = model_types()

__all__ = [
    "HybridCache", "make_commit", "make_decode_step", "make_prefill", "make_verify_step", "split_params",
    "ConfigError", "NemotronHConfig", "QwenHybridConfig",
    "GenerationConfig", "load_generation_config",
    "MODEL_TYPES", "CheckpointError", "CheckpointNotFoundError", "TensorSource", "load_model", "read_config",
    "NemotronHForCausalLM", "QwenHybridForCausalLM",
]
