"""Hybrid SSM language models (Nemotron-H / Mamba-2, Qwen3-Next, Qwen3.5) loaded from Hugging Face checkpoints.

    from models import load_model, make_prefill, make_decode_step, split_params
    model = load_model("path/to/checkpoint")           # config.json + safetensors
    logits = model(input_ids)                          # full forward
    logits, cache = model.prefill(input_ids, max_len=64, replay_buffer_len=16)
    logits, cache = model.decode(tokens, cache)        # one token per sequence
"""

from models.common import HybridCache, make_decode_step, make_prefill, split_params
from models.config import ConfigError, NemotronHConfig, QwenHybridConfig
from models.generation_config import GenerationConfig, load_generation_config
from models.loading import (
    MODEL_TYPES,
    CheckpointError,
    CheckpointNotFoundError,
    TensorSource,
    load_model,
    read_config,
)
from models.nemotron_h import NemotronHForCausalLM
from models.qwen_hybrid import QwenHybridForCausalLM

__all__ = [
    "HybridCache", "make_decode_step", "make_prefill", "split_params",
    "ConfigError", "NemotronHConfig", "QwenHybridConfig", "GenerationConfig", "load_generation_config",
    "MODEL_TYPES", "CheckpointError", "CheckpointNotFoundError", "TensorSource", "load_model", "read_config",
    "NemotronHForCausalLM", "QwenHybridForCausalLM",
]
