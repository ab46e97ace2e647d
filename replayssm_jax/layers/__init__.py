"""Flax NNX layers of the supported hybrid models, with Hugging Face parameter names.

- `Mamba2Mixer` (Mamba-2 / Nemotron-H), `GatedDeltaNet` (Qwen3-Next / Qwen3.5):
  SSM token mixers with prefill (chunked), standard decode and ReplaySSM decode.
- `Attention`: GQA, partial RoPE, output gate, q/k norms, fixed-length `KVCache`.
- `MLP` (relu2 / SwiGLU), `MoE` (softmax or sigmoid group-limited top-k, shared expert).
- `RMSNorm`, `GatedRMSNorm`, `CausalConv1d`, `Linear`, `Embedding`.
- Decode states: `SSMLayerState`, `ReplayLayerState`, `KVCache`, the conv ring `ConvWindow`;
  every stateful layer has ``verify`` (W speculative positions) and ``commit``.
"""

from replayssm_jax.layers.attention import Attention, apply_rope, rope_inv_freq
from replayssm_jax.layers.cache import (
    ConvWindow,
    KVCache,
    LayerState,
    ReplayLayerState,
    SSMLayerState,
    commit_layer_state,
)
from replayssm_jax.layers.conv import CausalConv1d, get_activation
from replayssm_jax.layers.gdn import GatedDeltaNet
from replayssm_jax.layers.linear import Embedding, Linear
from replayssm_jax.layers.mamba2 import Mamba2Mixer
from replayssm_jax.layers.mlp import MLP, MoE, Experts
from replayssm_jax.layers.norms import GatedRMSNorm, RMSNorm

__all__ = [
    "Attention", "apply_rope", "rope_inv_freq",
    "ConvWindow", "KVCache", "LayerState", "ReplayLayerState", "SSMLayerState", "commit_layer_state",
    "CausalConv1d", "get_activation",
    "GatedDeltaNet", "Mamba2Mixer",
    "Embedding", "Linear",
    "MLP", "MoE", "Experts",
    "GatedRMSNorm", "RMSNorm",
]
