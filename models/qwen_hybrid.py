"""Qwen3-Next and Qwen3.5 (text) causal LMs in Flax NNX, loading Hugging Face checkpoints.

Architecture (transformers `Qwen3NextForCausalLM`, `Qwen3_5ForCausalLM`): token
embedding, then per layer

    h = h + mixer(input_layernorm(h))          mixer: GatedDeltaNet ("linear_attn")
                                               or gated attention ("self_attn")
    h = h + mlp(post_attention_layernorm(h))   SwiGLU MLP, or (Qwen3-Next) sparse MoE
                                               with a sigmoid-gated shared expert

then ``model.norm`` and ``lm_head``. Every RMSNorm outside the GDN output norm is
zero-centered (scale 1 + weight). Attention: ``q_proj`` gives [query | gate] per
head, q_norm / k_norm over head_dim, partial RoPE, output * sigmoid(gate).
GDN projections are packed in Qwen3-Next (``in_proj_qkvz``, ``in_proj_ba``) and
separate in Qwen3.5 (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models import registry
from models.common import HybridBlock, HybridCausalLM, attention_options
from models.config import QwenHybridConfig
from replayssm_jax.layers import MLP, Attention, Embedding, GatedDeltaNet, Linear, MoE, RMSNorm
from replayssm_jax.layers.linear import default_rngs

__all__ = ["QwenDecoderLayer", "QwenHybridForCausalLM", "weight_map"]


class QwenDecoderLayer(HybridBlock):
    """One decoder layer: token mixer and feed-forward, each pre-norm residual.

    Args:
      config: the model config.
      layer_idx: index into config.layer_types / config.mlp_types.

    Parameters: ``input_layernorm``, ``linear_attn`` (GDN layers) or ``self_attn``
    (attention layers), ``post_attention_layernorm``, ``mlp``.
    """

    def __init__(self, config: QwenHybridConfig, layer_idx: int, *, ssm_state_dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = default_rngs(rngs)
        c = config
        kw = dict(param_dtype=param_dtype, rngs=rngs)
        self.layer_type = c.layer_types[layer_idx]
        self.input_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, zero_centered=True, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, eps=c.rms_norm_eps, zero_centered=True,
                                                param_dtype=param_dtype)
        if self.layer_type == "gdn":
            self.linear_attn = GatedDeltaNet(
                c.hidden_size, num_k_heads=c.linear_num_key_heads, num_v_heads=c.linear_num_value_heads,
                head_k_dim=c.linear_key_head_dim, head_v_dim=c.linear_value_head_dim,
                conv_kernel=c.linear_conv_kernel_dim, packed=c.gdn_packed, norm_eps=c.rms_norm_eps,
                activation=c.hidden_act, ssm_state_dtype=ssm_state_dtype, **kw)
            self.self_attn = None
        elif self.layer_type == "attention":
            self.self_attn = Attention(
                c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, bias=c.attention_bias,
                output_gate=c.attn_output_gate, qk_norm=True, norm_eps=c.rms_norm_eps, rotary_dim=c.rotary_dim,
                rope_theta=c.rope_theta, **kw)
            self.linear_attn = None
        else:
            raise ValueError(f"QwenDecoderLayer: unknown layer type {self.layer_type!r}; expected 'gdn' or 'attention'")
        if c.mlp_types[layer_idx] == "moe":
            self.mlp = MoE(c.hidden_size, c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                           activation=c.hidden_act, gated=True, router="softmax", norm_topk_prob=c.norm_topk_prob,
                           shared_intermediate_size=c.shared_expert_intermediate_size, shared_name="shared_expert",
                           shared_expert_gate=c.shared_expert_intermediate_size > 0, **kw)
        else:
            self.mlp = MLP(c.hidden_size, c.intermediate_size, activation=c.hidden_act, gated=True, **kw)

    @property
    def mixer(self):
        return self.linear_attn if self.layer_type == "gdn" else self.self_attn

    def _ffn(self, h):
        return h + self.mlp(self.post_attention_layernorm(h))

    def __call__(self, h: jax.Array, *, backend: str | None = None) -> jax.Array:
        """Full forward. h: [batch, T, hidden] -> [batch, T, hidden]."""
        u = self.input_layernorm(h)
        out = self.linear_attn(u, backend=backend) if self.layer_type == "gdn" else self.self_attn(u)
        return self._ffn(h + out)

    def prefill(self, h: jax.Array, max_len: int, *, backend: str | None = None, state=None):
        """Prompt forward that also returns the mixer's decode state (SSMLayerState or KVCache);
        `state`: the mixer's state after the prompt's earlier parts (a chunked prefill), or None."""
        u = self.input_layernorm(h)
        if self.layer_type == "gdn":
            out, state = self.linear_attn.prefill(u, state, backend=backend)
        else:
            out, state = self.self_attn.prefill(u, max_len, state)
        return self._ffn(h + out), state

    def _with_state(self, h, state, mode, **ssm_options):
        """The mixer's `mode` ("decode" or "verify") on its state, then the MLP."""
        u = self.input_layernorm(h)
        if self.layer_type == "gdn":
            out, state = getattr(self.linear_attn, mode)(u, state, **ssm_options)
        else:
            out, state = getattr(self.self_attn, mode)(u, state, **attention_options(ssm_options))
        return self._ffn(h + out), state


class QwenModel(nnx.Module):
    """``embed_tokens``, ``layers`` (QwenDecoderLayer), ``norm`` (zero-centered)."""

    def __init__(self, config: QwenHybridConfig, *, ssm_state_dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        rngs = default_rngs(rngs)
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([
            QwenDecoderLayer(config, i, ssm_state_dtype=ssm_state_dtype, param_dtype=param_dtype, rngs=rngs)
            for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, zero_centered=True, param_dtype=param_dtype)


class QwenHybridForCausalLM(HybridCausalLM):
    """Qwen3-Next / Qwen3.5 text causal language model.

    Args:
      config: `QwenHybridConfig`.
      ssm_state_dtype: dtype of the GDN ssm_state / checkpoint between decode steps.
      param_dtype: dtype of freshly initialised parameters (loading keeps the checkpoint's).

    Parameters: ``model`` (`QwenModel`), ``lm_head`` (absent when tied), ``mtp``
    (the multi-token prediction head `models.mtp.QwenMTPHead`; None unless loaded
    with ``load_model(path, mtp=True)``).
    """

    def __init__(self, config: QwenHybridConfig, *, ssm_state_dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        rngs = default_rngs(rngs)
        self.config = config
        self.model = QwenModel(config, ssm_state_dtype=ssm_state_dtype, param_dtype=param_dtype, rngs=rngs)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, param_dtype=param_dtype, rngs=rngs)
        self.mtp = None

    def _final_norm(self, h):
        return self.model.norm(h)

    def _lm_head(self, h):
        if self.lm_head is None:
            return self.model.embed_tokens.attend(h).astype(jnp.float32)
        return self.lm_head(h).astype(jnp.float32)

    def _embed(self, ids):
        return self.model.embed_tokens(ids)

    @property
    def _blocks(self):
        return self.model.layers


def weight_map(config: QwenHybridConfig, model_type: str):
    """The checkpoint tensor name -> parameter name mapping of a Qwen3-Next or Qwen3.5 checkpoint.

    Checkpoint names: ``model.*``, ``lm_head.weight``. Skipped on purpose: ``mtp.*``
    (multi-token prediction; `models.load_model` with ``mtp=True`` reads them as
    the head's parameters, by the same names), ``lm_head.weight`` of a tied model, and for the
    multimodal Qwen3.5 wrapper (model_type "qwen3_5") the vision tower
    ``model.visual.*``; its ``model.language_model.*`` is read as ``model.*``.
    """
    multimodal = model_type == "qwen3_5"

    def checkpoint_key(key: str) -> str | None:
        if key.startswith("mtp.") or (key == "lm_head.weight" and config.tie_word_embeddings):
            return None
        if multimodal:
            if key.startswith("model.visual."):
                return None
            if key.startswith("model.language_model."):
                return "model." + key[len("model.language_model."):]
        return key

    return checkpoint_key


registry.register(registry.Family(
    class_names={"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                 "qwen3_5": "Qwen3_5ForCausalLM"},
    parse_config=QwenHybridConfig.from_hf_config, model_class=QwenHybridForCausalLM, weight_map=weight_map))
