"""Qwen3.5 text model (model_type "qwen3_5_text", `Qwen3_5ForCausalLM`; also the text
part of the multimodal "qwen3_5" checkpoints).

Gated DeltaNet with separate ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` /
``in_proj_a`` projections, gated attention with partial RoPE, dense SwiGLU MLP.
The implementation is shared with Qwen3-Next in `models.qwen_hybrid`.
"""

from models.config import QwenHybridConfig as Qwen3_5Config
from models.qwen_hybrid import QwenHybridForCausalLM as Qwen3_5ForCausalLM

__all__ = ["Qwen3_5Config", "Qwen3_5ForCausalLM"]
