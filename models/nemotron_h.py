"""Nemotron-H (and plain Mamba-2) causal LM in Flax NNX, loading Hugging Face checkpoints.

Architecture (transformers `NemotronHForCausalLM`, `Mamba2ForCausalLM`): token
embedding, then per layer a pre-norm residual block ``h = h + mixer(norm(h))``
whose mixer is one of

- "mamba": `Mamba2Mixer` (gated RMSNorm per n_groups group in Nemotron-H, over all
  of d_inner in plain Mamba2);
- "attention": GQA attention without positional encoding (`Attention`, rotary_dim 0);
- "mlp": relu2 MLP (``up_proj``, ``down_proj``);
- "moe": sigmoid-routed, group-limited top-k MoE with relu2 experts and a shared expert;

then ``norm_f`` and ``lm_head`` (tied to the embedding when the config says so).
Parameter names are the checkpoint's: ``backbone.embeddings``, ``backbone.layers.{i}.norm``,
``backbone.layers.{i}.mixer.*``, ``backbone.norm_f``, ``lm_head``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models import registry
from models.common import HybridBlock, HybridCausalLM, attention_options
from models.config import NemotronHConfig
from replayssm_jax.layers import MLP, Attention, Embedding, Linear, Mamba2Mixer, MoE, RMSNorm
from replayssm_jax.layers.linear import default_rngs

__all__ = ["NemotronHBlock", "NemotronHForCausalLM", "weight_map"]


class NemotronHBlock(HybridBlock):
    """One pre-norm residual block: ``h + mixer(norm(h))``.

    Args:
      config: the model config.
      block_type: "mamba", "attention", "mlp" or "moe".

    Parameters: ``norm`` (RMSNorm [hidden]) and ``mixer``.

    Raises:
      ValueError: an unknown block_type.
    """

    def __init__(self, config: NemotronHConfig, block_type: str, *, ssm_state_dtype=jnp.float32,
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = default_rngs(rngs)
        c = config
        self.block_type = block_type
        self.residual_in_fp32 = c.residual_in_fp32
        self.norm = RMSNorm(c.hidden_size, eps=c.layer_norm_epsilon, param_dtype=param_dtype)
        kw = dict(param_dtype=param_dtype, rngs=rngs)
        if block_type == "mamba":
            self.mixer = Mamba2Mixer(
                c.hidden_size, num_heads=c.mamba_num_heads, head_dim=c.mamba_head_dim, state_size=c.ssm_state_size,
                n_groups=c.n_groups, conv_kernel=c.conv_kernel, use_conv_bias=c.use_conv_bias, use_bias=c.use_bias,
                chunk_size=c.chunk_size, dt_limit=c.dt_limit, norm_eps=c.layer_norm_epsilon,
                norm_group_size=c.mamba_norm_group_size, activation=c.mamba_hidden_act,
                ssm_state_dtype=ssm_state_dtype, **kw)
        elif block_type == "attention":
            self.mixer = Attention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                   bias=c.attention_bias, rotary_dim=0, **kw)
        elif block_type == "mlp":
            self.mixer = MLP(c.hidden_size, c.intermediate_size, activation=c.mlp_hidden_act, gated=False,
                             bias=c.mlp_bias, **kw)
        elif block_type == "moe":
            self.mixer = MoE(
                c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size,
                activation=c.mlp_hidden_act, gated=False, router="sigmoid", norm_topk_prob=c.norm_topk_prob,
                routed_scaling_factor=c.routed_scaling_factor, n_group=c.n_group, topk_group=c.topk_group,
                shared_intermediate_size=c.moe_shared_expert_intermediate_size, shared_name="shared_experts",
                latent_size=c.moe_latent_size, bias=c.mlp_bias, **kw)
        else:
            raise ValueError(f"NemotronHBlock: unknown block type {block_type!r}; expected one of "
                             f"'mamba', 'attention', 'mlp', 'moe'")

    def _residual(self, h, out):
        dtype = jnp.float32 if self.residual_in_fp32 else h.dtype
        return h.astype(dtype) + out.astype(dtype)

    def _normed(self, h):
        return self.norm(h.astype(self.norm.weight[...].dtype))

    def __call__(self, h: jax.Array, *, backend: str | None = None) -> jax.Array:
        """Full forward. h: [batch, T, hidden] -> [batch, T, hidden]."""
        u = self._normed(h)
        out = self.mixer(u, backend=backend) if self.block_type == "mamba" else self.mixer(u)
        return self._residual(h, out)

    def prefill(self, h: jax.Array, max_len: int, *, backend: str | None = None, state=None):
        """Prompt forward that also returns this block's decode state (SSMLayerState, KVCache or None);
        `state`: the block's state after the prompt's earlier parts (a chunked prefill), or None."""
        u = self._normed(h)
        if self.block_type == "mamba":
            out, state = self.mixer.prefill(u, state, backend=backend)
        elif self.block_type == "attention":
            out, state = self.mixer.prefill(u, max_len, state)
        else:
            out, state = self.mixer(u), None
        return self._residual(h, out), state

    def _with_state(self, h, state, mode, **ssm_options):
        """The mixer's `mode` ("decode" or "verify") on its state; MLP / MoE blocks have none."""
        u = self._normed(h)
        if self.block_type == "mamba":
            out, state = getattr(self.mixer, mode)(u, state, **ssm_options)
        elif self.block_type == "attention":
            out, state = getattr(self.mixer, mode)(u, state, **attention_options(ssm_options))
        else:
            out = self.mixer(u)
        return self._residual(h, out), state


class NemotronHBackbone(nnx.Module):
    """``embeddings``, ``layers`` (NemotronHBlock per config.layer_types), ``norm_f``."""

    def __init__(self, config: NemotronHConfig, *, ssm_state_dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        rngs = default_rngs(rngs)
        self.embeddings = Embedding(config.vocab_size, config.hidden_size, param_dtype=param_dtype, rngs=rngs)
        self.layers = nnx.List([
            NemotronHBlock(config, t, ssm_state_dtype=ssm_state_dtype, param_dtype=param_dtype, rngs=rngs)
            for t in config.layer_types])
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon, param_dtype=param_dtype)


class NemotronHForCausalLM(HybridCausalLM):
    """Nemotron-H / Mamba-2 causal language model.

    Args:
      config: `NemotronHConfig`.
      ssm_state_dtype: dtype of the Mamba-2 ssm_state / checkpoint between decode steps.
      param_dtype: dtype of freshly initialised parameters (loading keeps the checkpoint's).

    Parameters: ``backbone`` (`NemotronHBackbone`), ``lm_head`` (absent when tied),
    ``mtp`` (the multi-token prediction head `models.mtp.NemotronHMTPHead`; None
    unless loaded with ``load_model(path, mtp=True)``).
    """

    def __init__(self, config: NemotronHConfig, *, ssm_state_dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        rngs = default_rngs(rngs)
        self.config = config
        self.backbone = NemotronHBackbone(config, ssm_state_dtype=ssm_state_dtype, param_dtype=param_dtype,
                                          rngs=rngs)
        self.lm_head = None if config.tie_word_embeddings else Linear(
            config.hidden_size, config.vocab_size, param_dtype=param_dtype, rngs=rngs)
        self.mtp = None

    def _final_norm(self, h):
        return self.backbone.norm_f(h)

    def _lm_head(self, h):
        if self.lm_head is None:
            return self.backbone.embeddings.attend(h).astype(jnp.float32)
        return self.lm_head(h.astype(self.lm_head.weight[...].dtype)).astype(jnp.float32)

    def _embed(self, ids):
        return self.backbone.embeddings(ids)

    @property
    def _blocks(self):
        return self.backbone.layers


def weight_map(config: NemotronHConfig, model_type: str):
    """The checkpoint tensor name -> parameter name mapping of a Nemotron-H or Mamba2ForCausalLM checkpoint.

    Checkpoint names: ``backbone.*`` (``model.*`` is accepted as an alias),
    ``lm_head.weight``; ``mtp.*`` (multi-token prediction) is skipped (`models.load_model`
    with ``mtp=True`` reads them as the head's parameters, by the same names), as is
    ``lm_head.weight`` of a tied model; Mamba2's legacy ``backbone.embedding.weight``
    is read as ``backbone.embeddings.weight``.
    """

    def checkpoint_key(key: str) -> str | None:
        if key.startswith("mtp."):
            return None
        if key == "lm_head.weight" and config.tie_word_embeddings:
            return None
        if key.startswith("model."):
            key = "backbone." + key[len("model."):]
        if key == "backbone.embedding.weight":
            key = "backbone.embeddings.weight"
        return key

    return checkpoint_key


registry.register(registry.Family(
    class_names={"mamba2": "Mamba2ForCausalLM", "nemotron_h": "NemotronHForCausalLM"},
    parse_config=NemotronHConfig.from_hf_config, model_class=NemotronHForCausalLM, weight_map=weight_map))
