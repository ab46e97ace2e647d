"""Qwen3-Next (model_type "qwen3_next", `Qwen3NextForCausalLM`).

Gated DeltaNet with packed ``in_proj_qkvz`` / ``in_proj_ba`` projections, gated
attention with partial RoPE, sparse MoE (softmax top-k) with a sigmoid-gated
shared expert. The implementation is shared with Qwen3.5 in `models.qwen_hybrid`.
"""

from models.config import QwenHybridConfig as Qwen3NextConfig
from models.qwen_hybrid import QwenHybridForCausalLM as Qwen3NextForCausalLM

__all__ = ["Qwen3NextConfig", "Qwen3NextForCausalLM"]
