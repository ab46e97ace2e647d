"""Attention over a KV cache, the math of the attention layers (GQA): softmax(scale q k^T) v with the
scores and softmax in float32 and the probabilities cast to V's dtype before the second product, as
transformers' eager attention computes it. A product with an f32 operand is an IEEE f32 product
(`Precision.HIGHEST`): XLA's default on a GPU rounds f32 operands to TF32, errors of 2e-4 to 2e-3 at the
models' head_dims (bench/RESULTS.md, "GPU test runs", 2026-12-05).

Letters: batch, T query positions, S cache positions, HQ query heads, HK KV heads (query head h reads
KV head h // (HQ / HK)), D head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attend(q, k, v, mask, scale: float):
    """Attention of T query positions over S cache positions.

    Args:
      q: [batch, T, HQ, D]; k, v: [batch, S, HK, D] of one dtype; mask: bool[batch, T, S] (False: not
        attended); scale: the scores' factor (typically D ** -0.5).

    Returns:
      [batch, T, HQ, D] of v's dtype.
    """
    batch, seqlen, heads, d = q.shape
    kv_heads = k.shape[2]
    qg = q.reshape(batch, seqlen, kv_heads, heads // kv_heads, d)
    scores = jnp.einsum("btgrd,bsgd->bgrts", qg, k, preferred_element_type=jnp.float32,
                        precision=_precision(q, k)) * scale
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bgrts,bsgd->btgrd", probs, v, precision=_precision(v)).reshape(batch, seqlen, heads, d)


def _precision(*operands):
    """IEEE f32 products (`Precision.HIGHEST`) for a product with an f32 operand; XLA's default otherwise."""
    return jax.lax.Precision.HIGHEST if any(x.dtype == jnp.float32 for x in operands) else None


def attention_decode(q, k, v, length, scale: float):
    """One query position per row over the row's first `length` cache positions.

    Args:
      q: [batch, HQ, D]; k, v: [batch, S, HK, D]; length: i32[batch] in [1, S]; scale as `attend`.

    Returns:
      [batch, HQ, D] of v's dtype. The positions at and after `length` carry no weight, and their values
      are not read (a NaN there does not reach the output).
    """
    live = jnp.arange(k.shape[1], dtype=jnp.int32)[None, :] < length[:, None]  # [batch, S]
    v = jnp.where(live[:, :, None, None], v, jnp.zeros((), v.dtype))
    return attend(q[:, None], k, v, live[:, None, :], scale)[:, 0]
