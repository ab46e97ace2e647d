"""RMSNorm variants of the hybrid model families, with Hugging Face parameter names.

Three forms appear in the checkpoints this package loads:

- `RMSNorm`, plain: ``weight * (x / rms(x))`` (Mamba2RMSNorm, NemotronHRMSNorm;
  T5 / Llama style). Weight initialised to ones.
- `RMSNorm(zero_centered=True)`: ``(1 + weight) * (x / rms(x))`` (Qwen3NextRMSNorm,
  Qwen3_5RMSNorm: the decoder-layer norms, the final norm and the attention
  q_norm / k_norm). Weight initialised to zeros.
- `GatedRMSNorm`: the norm at the end of an SSM mixer, fed with the gate z:
  * ``norm_before_gate=False`` (Mamba-2 / Nemotron-H, transformers' MambaRMSNormGated
    and Zamba2RMSNormGated): ``weight * rms_norm_per_group(x * silu(z))``;
  * ``norm_before_gate=True`` (Gated DeltaNet, Qwen3NextRMSNormGated /
    Qwen3_5RMSNormGated): ``(weight * rms_norm(x)) * silu(z)``.

All statistics are computed in float32; outputs have the input dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = ["RMSNorm", "GatedRMSNorm", "rms_normalize"]


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """``x * rsqrt(mean(x**2, -1) + eps)`` in float32 (returns float32)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    """RMS normalisation over the last axis.

    Args:
      dim: size of the normalised (last) axis.
      eps: variance epsilon (config `layer_norm_epsilon` / `rms_norm_eps`).
      zero_centered: if True the scale is ``1 + weight`` (Qwen3-Next / Qwen3.5),
        else ``weight`` (Mamba-2 / Nemotron-H).
      param_dtype: dtype of `weight`.

    Parameters: ``weight``: [dim].

    Call: ``x``: [..., dim] any float dtype -> [..., dim] of x.dtype.
    Math follows transformers: plain form casts the normalised value back to
    x.dtype before multiplying by weight; the zero-centered form multiplies in
    float32 and casts last.
    """

    def __init__(self, dim: int, *, eps: float, zero_centered: bool = False, param_dtype=jnp.float32):
        self.dim = dim
        self.eps = float(eps)
        self.zero_centered = zero_centered
        init = jnp.zeros if zero_centered else jnp.ones
        self.weight = nnx.Param(init((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm: `x` last axis must be {self.dim}; got shape {x.shape}")
        h = rms_normalize(x, self.eps)
        w = self.weight[...]
        if self.zero_centered:
            return (h * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
        return (w * h.astype(x.dtype)).astype(x.dtype)


class GatedRMSNorm(nnx.Module):
    """Gated RMSNorm at the output of an SSM mixer.

    Args:
      dim: size of the last axis of x and z (Mamba-2: nheads * head_dim; GDN: the
        value head dim V, applied per head).
      group_size: the statistics are taken over consecutive groups of this size
        (Mamba-2 in Nemotron-H: dim // n_groups; transformers' plain Mamba2 uses
        one group, group_size = dim; GDN: V). Must divide dim.
      eps: variance epsilon.
      norm_before_gate: False: ``weight * norm(x * silu(z))`` (Mamba-2);
        True: ``weight * norm(x) * silu(z)`` (Gated DeltaNet).
      param_dtype: dtype of `weight`.

    Parameters: ``weight``: [dim].

    Call: ``x``, ``z``: [..., dim] -> [..., dim] of x.dtype.

    Tensor parallelism (`models.sharding`, inside ``jax.shard_map``): with
    ``reduce_axis`` set (a mesh axis name; norm_before_gate=False only) one
    norm group spans the shards of that axis, each holding `dim` of its
    channels: the mean square is averaged over the axis (``lax.psum`` of the
    equal-sized shards' means), as transformers' plain Mamba2 normalises over
    all of d_inner.

    Raises:
      ValueError: group_size does not divide dim, or x / z of the wrong shape.
    """

    reduce_axis: str | None = None

    def __init__(self, dim: int, *, group_size: int, eps: float, norm_before_gate: bool, param_dtype=jnp.float32):
        if group_size <= 0 or dim % group_size:
            raise ValueError(f"GatedRMSNorm: `group_size` must divide dim = {dim}; got {group_size}")
        self.dim = dim
        self.group_size = group_size
        self.eps = float(eps)
        self.norm_before_gate = norm_before_gate
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:
        if x.shape[-1] != self.dim or z.shape != x.shape:
            raise ValueError(
                f"GatedRMSNorm: `x` and `z` must have the same shape [..., {self.dim}]; got {x.shape} and {z.shape}"
            )
        dtype = x.dtype
        w = self.weight[...]
        gate = jax.nn.silu(z.astype(jnp.float32))
        if self.norm_before_gate:
            h = (w * rms_normalize(x, self.eps).astype(dtype)).astype(jnp.float32) * gate
            return h.astype(dtype)
        h = x.astype(jnp.float32) * gate
        shape = h.shape
        h = h.reshape(*shape[:-1], self.dim // self.group_size, self.group_size)
        if self.reduce_axis is None:
            h = rms_normalize(h, self.eps)
        else:
            mean_square = jax.lax.pmean(jnp.mean(h * h, axis=-1, keepdims=True), self.reduce_axis)
            h = h * jax.lax.rsqrt(mean_square + self.eps)
        h = h.reshape(shape)
        return (w * h.astype(dtype)).astype(dtype)
