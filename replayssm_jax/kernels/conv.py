"""Pallas (Triton) decode kernel of the short causal conv (the conv1d update of Mamba-2 and GDN).

Letters: batch, C channels (conv_dim), W the conv width, S the ring's slots.
One decode step of the depthwise causal conv on the ring of
:class:`replayssm_jax.layers.cache.ConvWindow` (columns [batch, S, C], the
oldest live input at slot `start`), as
:meth:`replayssm_jax.layers.conv.CausalConv1d.step` computes it:

    y[b, c] = act(bias[c] + sum_{j < W-1} w[c, j] columns[b, (start + j) mod S, c] + w[c, W-1] x[b, c])

and x written into the ring at slot (start + W - 1) mod S, in place; start
is left to the caller (`ConvWindow.advance`).

Grid (batch, cdiv(C, block_v)): a program reads its row's start, the W - 1
live columns and x for block_v channels, and writes y and the new column.
The XLA form reads the live columns through a gather, convolves in a second
pass, and writes the new column with a select over the whole ring (its
in-place write at per-row slots would be a scatter, which in an XLA loop on
the CPU copies the ring every step): per step it reads and writes all S
columns, where this launch reads W - 1 and x and writes two.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from replayssm_jax.kernels.config import ConvConfig, default_conv_config, next_pow2
from replayssm_jax.kernels.launch import pallas_call
from replayssm_jax.kernels.tiles import lane_ids, lane_mask, load, program_id, store, tile_mask


def _silu(x):
    return x / (1.0 + jnp.exp(-x))


# The activations the kernel computes (transformers' `hidden_act` names); the ops run the others on XLA.
ACTIVATIONS = {"silu": _silu, "swish": _silu, "identity": lambda x: x, "relu": lambda x: jnp.maximum(x, 0.0),
               "relu2": lambda x: jnp.square(jnp.maximum(x, 0.0))}


def _conv_kernel(x_ref, columns_ref, start_ref, weight_ref, bias_ref, y_ref, columns_out, *, C, W, S, activation):
    """One row's block of channels: y and the new ring column."""
    BC = x_ref.shape[0]
    cmask = None if C % BC == 0 else program_id(1) * BC + lane_ids(BC) < C
    start = start_ref[0]
    BW = weight_ref.shape[1]
    taps = load(weight_ref, tile_mask(cmask, lane_mask(BW, W), (BC, BW)))
    lane = lane_ids(BW)[None, :]

    def tap(j):  # w[:, j], f32[BC]
        return jnp.sum(jnp.where(lane == j, taps, 0.0), axis=1)

    x = load(x_ref, cmask)
    acc = tap(W - 1) * x if bias_ref is None else load(bias_ref, cmask) + tap(W - 1) * x
    for j in range(W - 1):
        acc = acc + tap(j) * load(columns_ref.at[(start + j) % S], cmask)
    store(y_ref, ACTIVATIONS[activation](acc), cmask)
    store(columns_out.at[(start + W - 1) % S], x, cmask)


@functools.partial(jax.jit, static_argnames=("activation", "config", "interpret"))
def _conv_update(x, columns, start, weight, bias, *, activation: str, config: ConvConfig, interpret: bool):
    batch, C = x.shape
    S, W = columns.shape[1], weight.shape[1]
    BC, BS, BW = config.block_v, next_pow2(S), next_pow2(W)
    row = pl.BlockSpec((None, BC), lambda b, c: (b, c))
    specs = (row, pl.BlockSpec((None, BS, BC), lambda b, c: (b, 0, c)), pl.BlockSpec((1,), lambda b, c: (b,)),
             pl.BlockSpec((BC, BW), lambda b, c: (c, 0)),
             None if bias is None else pl.BlockSpec((BC,), lambda b, c: (c,)))
    kernel = functools.partial(_conv_kernel, C=C, W=W, S=S, activation=activation)
    return pallas_call(
        kernel,
        grid=(batch, pl.cdiv(C, BC)),
        in_specs=specs,
        out_specs=(row, specs[1]),
        out_shape=(jax.ShapeDtypeStruct(x.shape, x.dtype), jax.ShapeDtypeStruct(columns.shape, columns.dtype)),
        input_output_aliases={1: 1},  # the ring in place
        interpret=interpret,
        config=config,
        name=f"conv_update_w{W}_{config.tag()}",
    )(x, columns, start, weight, bias)


def conv_update(x, columns, start, weight, bias=None, *, activation: str = "silu", config: ConvConfig | None = None,
                interpret: bool = False):
    """One decode step of the depthwise causal conv on a ring of inputs (module docstring).

    Args:
      x: [batch, C], the new inputs (the activation dtype).
      columns: [batch, S, C], the ring (ConvWindow.columns), S >= W.
      start: i32[batch], the ring slot of each row's oldest live input, in [0, S).
      weight: [C, W] (the conv's [C, 1, W] parameter, reshaped), f32 or bf16.
      bias: [C] or None.
      activation: a name of ACTIVATIONS.
      config: the launch's ConvConfig (None: `default_conv_config`).
      interpret: run in Pallas interpret mode (any platform).

    Returns:
      (y [batch, C] of x.dtype, the ring with x at slot (start + W - 1) mod S,
      updated in place when `columns` is donated).

    Raises:
      ValueError: an activation the kernel does not compute; S < W.
      TypeError: a config that is not a ConvConfig.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {', '.join(map(repr, ACTIVATIONS))} for the conv kernel; "
                         f"got {activation!r}")
    if columns.shape[1] < weight.shape[1]:
        raise ValueError(f"`columns` must hold at least W = {weight.shape[1]} slots; got {columns.shape[1]}")
    if config is not None and not isinstance(config, ConvConfig):
        raise TypeError(f"`config` must be a ConvConfig; got {type(config).__name__}")
    config = config or default_conv_config(x.shape[1])
    return _conv_update(x, columns, start, weight, bias, activation=activation, config=config, interpret=interpret)
