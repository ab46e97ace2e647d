"""Pallas (Triton) decode attention: one query position per row against the row's KV cache.

Letters: batch, S = max_len (the cache's positions), HQ = num_heads, HK = num_kv_heads,
R = HQ / HK (the query heads of one KV head), D = head_dim. With n = length[b] live positions:

    o[b, h] = sum_{t < n} softmax_t(scale q[b, h] . k[b, t, g]) v[b, t, g],   g = h // R

Grid (batch, HK, parts): a program takes the R query heads of KV head g of row b and the part p of
the row's live positions, in blocks of `block_t` positions. Per block it loads K and V [block_t, D]
once for its R heads, forms the scores of its heads as one dot (the R query rows padded to 16, so
that both products run on the tensor cores; f32 inputs take IEEE dots) and keeps the running
maximum, sum and output in f32 (the online softmax of flash attention). It reads positions below
length[b] only, where XLA's two products read all S positions. With parts > 1 (few rows, whose
batch x HK programs would leave SMs idle: flash decoding), each part writes its unnormalised output,
maximum and sum, and XLA combines the parts.

The probabilities enter the second product in V's dtype, as the reference's (which normalises them
first): the two differ by that rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from replayssm_jax.kernels.config import MAX_HEAD_DIM, AttentionConfig, default_attention_config, next_pow2
from replayssm_jax.kernels.launch import pallas_call
from replayssm_jax.kernels.tiles import lane_ids, load, program_id, store, tile_mask

# The least extent of a dot on the tensor cores: the R query rows of a KV head and head_dim are padded to it.
DOT_ROWS = 16
# The dots' precision: f32 operands as IEEE products, not TF32 (the reference's f32 scores, to 2e-5 on the
# GPU); bf16 and f16 operands as they are, f32 accumulation.
EXACT = jax.lax.Precision.HIGHEST
# The kernel's name before its tiling's tag (profiles count kernels so named as attention).
KERNEL_NAME = "attention_decode"


def _attention_kernel(length_ref, q_ref, k_ref, v_ref, *out_refs, R: int, D: int, S: int, BT: int, parts: int,
                      scale: float):
    """One (row, KV head, part): the online softmax over the part's blocks of live positions. q_ref [BR, BD]
    (the R query rows, D columns, padded); k_ref, v_ref [S rounded up to BT, BD]; out_refs: o [BR, BD], or
    with parts > 1 the part's unnormalised output [BR, BD], maximum and sum [BR]."""
    BR, BD = q_ref.shape
    dmask = None if BD == D else lane_ids(BD) < D
    rmask = None if BR == R else lane_ids(BR) < R
    q = load(q_ref, tile_mask(rmask, dmask, (BR, BD)), q_ref.dtype)
    length = jnp.minimum(length_ref[0], S)  # a traced length past the cache reads no further
    blocks = pl.cdiv(length, BT)
    per_part = pl.cdiv(blocks, parts)
    first = program_id(2) * per_part
    last = jnp.minimum(first + per_part, blocks)

    def block(i, carry):
        m, l, acc = carry
        t0 = pl.multiple_of(i * BT, BT)
        live = t0 + lane_ids(BT) < length
        kv_mask = tile_mask(live, dmask, (BT, BD))
        k = load(k_ref.at[pl.ds(t0, BT)], kv_mask, k_ref.dtype)
        v = load(v_ref.at[pl.ds(t0, BT)], kv_mask, v_ref.dtype)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=EXACT,
                                preferred_element_type=jnp.float32) * scale
        s = jnp.where(live[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no score above -inf yet: weights exp(-inf) = 0
        alpha = jnp.exp(m - shift)
        p = jnp.exp(s - shift[:, None])
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + jnp.dot(p.astype(v_ref.dtype), v, precision=EXACT,
                                             preferred_element_type=jnp.float32)
        return m_new, l, acc

    init = (jnp.full((BR,), -jnp.inf, jnp.float32), jnp.zeros((BR,), jnp.float32), jnp.zeros((BR, BD), jnp.float32))
    m, l, acc = jax.lax.fori_loop(first, jnp.maximum(first, last), block, init)
    out_mask = tile_mask(rmask, dmask, (BR, BD))
    if parts == 1:
        (o_ref,) = out_refs
        store(o_ref, acc / l[:, None], out_mask)
    else:
        acc_ref, m_ref, l_ref = out_refs
        store(acc_ref, acc, out_mask)
        store(m_ref, m, rmask)
        store(l_ref, l, rmask)


@functools.partial(jax.jit, static_argnames=("scale", "config", "interpret"))
def _attention_decode(q, k, v, length, *, scale: float, config: AttentionConfig, interpret: bool):
    batch, HQ, D = q.shape
    S, HK = k.shape[1], k.shape[2]
    R, BT, parts = HQ // HK, config.block_v, config.parts
    BR, BD, BS = max(DOT_ROWS, next_pow2(R)), max(DOT_ROWS, next_pow2(D)), pl.cdiv(S, BT) * BT
    heads = pl.BlockSpec((None, None, BR, BD), lambda b, g, p: (b, g, 0, 0))
    cache = pl.BlockSpec((None, BS, None, BD), lambda b, g, p: (b, 0, g, 0))
    q = q.reshape(batch, HK, R, D)
    if parts == 1:
        out_specs = heads
        out_shape = jax.ShapeDtypeStruct(q.shape, q.dtype)
    else:
        out_specs = (pl.BlockSpec((None, None, None, BR, BD), lambda b, g, p: (b, g, p, 0, 0)),
                     *[pl.BlockSpec((None, None, None, BR), lambda b, g, p: (b, g, p, 0))] * 2)
        out_shape = (jax.ShapeDtypeStruct((batch, HK, parts, R, D), jnp.float32),
                     *[jax.ShapeDtypeStruct((batch, HK, parts, R), jnp.float32)] * 2)
    kernel = functools.partial(_attention_kernel, R=R, D=D, S=S, BT=BT, parts=parts, scale=scale)
    out = pallas_call(
        kernel,
        grid=(batch, HK, parts),
        in_specs=(pl.BlockSpec((1,), lambda b, g, p: (b,)), heads, cache, cache),
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        config=config,
        name=f"{KERNEL_NAME}_{config.tag()}",
    )(length, q, k, v)
    if parts > 1:  # the parts' softmax statistics joined: a part with no live position has m = -inf, l = 0
        acc, m, l = out
        top = jnp.max(m, axis=2, keepdims=True)
        w = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - top))
        out = jnp.sum(w[..., None] * acc, axis=2) / jnp.sum(w * l, axis=2)[..., None]
    return out.reshape(batch, HQ, D).astype(q.dtype)


def attention_decode(q, k, v, length, *, scale: float | None = None, config: AttentionConfig | None = None,
                     interpret: bool = False):
    """Attention of one query position per row over the row's first `length` cache positions (module
    docstring).

    Args:
      q: [batch, HQ, D], the new position's queries (f32, bf16 or f16).
      k, v: [batch, S, HK, D] of q's dtype, the KV cache (`replayssm_jax.layers.cache.KVCache` layout), HK
        dividing HQ (validated by `replayssm_jax.ops.attention_decode`).
      length: i32[batch] in [1, S], the live positions of each row (the new one included; a traced length
        above S reads S).
      scale: the scores' factor (None: D ** -0.5).
      config: the launch's AttentionConfig (None: `default_attention_config`).
      interpret: run in Pallas interpret mode (any platform).

    Returns:
      o [batch, HQ, D] of q.dtype (f32 softmax and accumulation).

    Raises:
      TypeError: a config that is not an AttentionConfig.
      ValueError: D above MAX_HEAD_DIM.
    """
    if config is not None and not isinstance(config, AttentionConfig):
        raise TypeError(f"`config` must be an AttentionConfig; got {type(config).__name__}")
    batch, HQ, D = q.shape
    if D > MAX_HEAD_DIM:
        raise ValueError(f"the decode attention kernel takes head_dim D <= {MAX_HEAD_DIM}; got {D} (use backend='xla')")
    config = config or default_attention_config(batch, k.shape[2], k.shape[1], D)
    return _attention_decode(q, k, v, length, scale=float(D ** -0.5 if scale is None else scale), config=config,
                             interpret=interpret)
