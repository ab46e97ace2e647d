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
Packed operands: x may be read at a column offset of a wider array (the
conv's input inside a layer's packed projection, e.g. Mamba-2's xBC in
in_proj's output) and y written as separate arrays cut at channel split
points (Mamba-2's x, B, C; GDN's q, k, v), where block_v divides the offset
and every split point: each program's block then lies inside one piece, and
the layer's slices of the packed arrays (one XLA launch each) go away.
The XLA form reads the live columns through a gather, convolves in a second
pass, and writes the new column with a select over the whole ring (its
in-place write at per-row slots would be a scatter, which in an XLA loop on
the CPU copies the ring every step): per step it reads and writes all S
columns, where this launch reads W - 1 and x and writes two.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from replayssm_jax.kernels.config import ConvConfig, default_conv_config, next_pow2
from replayssm_jax.kernels.launch import pallas_call
from replayssm_jax.kernels.tiles import lane_ids, lane_mask, load, program_id, store, tile_mask


def _silu(x):
    return x / (1.0 + jnp.exp(-x))


# The activations the kernel computes (transformers' `hidden_act` names); the ops run the others on XLA.
ACTIVATIONS = {"silu": _silu, "swish": _silu, "identity": lambda x: x, "relu": lambda x: jnp.maximum(x, 0.0),
               "relu2": lambda x: jnp.square(jnp.maximum(x, 0.0))}


# The most ring slots that `conv_channels(..., whole_ring=True)` loads (the decode ring, W - 1 live inputs and
# one free slot, has W; a verify window's more).
WHOLE_RING_SLOTS = 8


def conv_channels(x_ref, column, taps_ref, bias_ref, start, *, W: int, S: int, activation: str, mask=None,
                  tap_columns: bool = False, whole_ring: bool = False):
    """(x, y): the new inputs and the conv's output, f32[n], for a block of n channels (traced inside a kernel).

    x_ref: the [n] block of the new inputs; column(slot) -> the ref [n] of these channels at ring slot `slot`;
    taps_ref: the [n, BW] block of the weight (W taps, BW a power of two >= W); bias_ref: the [n] block of
    the bias, or None; start: the row's oldest live slot (i32 scalar); mask: bool[n] or None (all channels).
    Reads ring slots start .. start + W - 2 mod S, writes nothing. The taps are read as one [n, BW] tile and
    picked out of it by lane, or (`tap_columns`) as W strided columns [n], which leave the vectors in the
    layout of a plain [n] load: in a fused step program, whose q, k and v then feed the state tile's
    products without a layout conversion (the tile form took 255 registers there and spilled, against
    64-130 for columns; static SASS, bench/RESULTS.md, "The GDN conv fused into the standard step").
    The live columns are loaded at their slots (each load waits on `start`), or (`whole_ring`, S at most
    WHOLE_RING_SLOTS) all S slots at once, whose addresses wait on nothing, and the live ones picked by
    slot: one load latency fewer on a latency-bound program's path, for S - W + 1 more columns read.
    """
    n, BW = taps_ref.shape
    if tap_columns:
        def tap(j):  # w[:, j], f32[n]
            return load(taps_ref.at[:, jnp.int32(j)], mask)
    else:
        taps = load(taps_ref, tile_mask(mask, lane_mask(BW, W), (n, BW)))
        lane = lane_ids(BW)[None, :]

        def tap(j):  # w[:, j], f32[n]
            return jnp.sum(jnp.where(lane == j, taps, 0.0), axis=1)

    if whole_ring and S <= WHOLE_RING_SLOTS:
        ring = [load(column(jnp.int32(slot)), mask) for slot in range(S)]

        def live(j):  # the column at slot (start + j) mod S
            at = (start + j) % S
            return functools.reduce(lambda picked, slot: jnp.where(at == slot, ring[slot], picked), range(1, S),
                                    ring[0])
    else:
        def live(j):
            return load(column((start + j) % S), mask)

    x = load(x_ref, mask)
    acc = tap(W - 1) * x if bias_ref is None else load(bias_ref, mask) + tap(W - 1) * x
    for j in range(W - 1):
        acc = acc + tap(j) * live(j)
    return x, ACTIVATIONS[activation](acc)


def _conv_kernel(x_ref, columns_ref, start_ref, weight_ref, bias_ref, *refs, C, W, S, activation, firsts):
    """One row's block of channels: y (into the piece whose blocks start at `firsts[i]`, block units) and
    the new ring column. refs: the pieces of y, then the ring."""
    y_refs, columns_out = refs[:-1], refs[-1]
    BC = x_ref.shape[0]
    c = program_id(1)
    cmask = None if C % BC == 0 else c * BC + lane_ids(BC) < C
    start = start_ref[0]
    x, y = conv_channels(x_ref, lambda slot: columns_ref.at[slot], weight_ref, bias_ref, start, W=W, S=S,
                         activation=activation, mask=cmask)
    if len(y_refs) == 1:
        store(y_refs[0], y, cmask)
    else:  # into the piece this block lies in
        for y_ref, first, end in zip(y_refs, firsts, (*firsts[1:], None)):
            owns = c >= first if end is None else (c >= first) & (c < end)
            pl.when(owns)(functools.partial(store, y_ref, y, cmask))
    store(columns_out.at[(start + W - 1) % S], x, cmask)


def _piece_spec(first: int, size: int, BC: int) -> pl.BlockSpec:
    """The block spec of a piece of y ([batch, size]) whose blocks start at channel block `first`; the
    programs of the other pieces map to one of its blocks and write nothing to it."""
    last = pl.cdiv(size, BC) - 1
    return pl.BlockSpec((None, BC), lambda b, c: (b, jnp.clip(c - first, 0, last)))


def check_pieces(offset, splits, width: int, channels: int) -> tuple[int, tuple[int, ...]]:
    """(offset, splits) as ints, checked: the conv's `channels` (C) inputs at columns offset .. offset + C - 1
    of an input `width` (X) columns wide (offset None: X must be C), and y cut at increasing channel indices
    in (0, C).

    Raises:
      TypeError: an offset or split that is not an int.
      ValueError: X != C with offset None, offset < 0 or offset + C > X; splits not increasing inside (0, C).
    """
    def integer(what, value):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"{what} must be an int; got {type(value).__name__} {value!r}")
        return int(value)

    if offset is None:
        if width != channels:
            raise ValueError(f"`x` must have C = {channels} columns (the conv's channels); got {width} (pass "
                             f"`offset` to read the conv's inputs from a wider, packed array)")
        offset = 0
    offset = integer("`offset`", offset)
    if width < channels:
        raise ValueError(f"`x` must have at least C = {channels} columns (the conv's channels) to read them at "
                         f"`offset`; got {width}")
    if offset < 0 or offset + channels > width:
        raise ValueError(f"`offset` must be in [0, X - C] = [0, {width - channels}] (X = {width} columns of `x`, "
                         f"C = {channels} channels of the conv); got {offset}")
    if not isinstance(splits, (list, tuple, np.ndarray)) or np.ndim(splits) != 1:
        raise TypeError(f"`splits` must be a list, tuple or 1-D NumPy array of ints; got {type(splits).__name__}")
    splits = tuple(integer("each of `splits`", b) for b in splits)
    if any(not 0 < b < channels for b in splits) or any(a >= b for a, b in zip(splits, splits[1:])):
        raise ValueError(f"`splits` must be increasing channel indices in (0, C = {channels}); got {splits}")
    return offset, splits


@functools.partial(jax.jit, static_argnames=("activation", "offset", "splits", "config", "interpret"))
def _conv_update(x, columns, start, weight, bias, *, activation: str, offset: int, splits: tuple[int, ...],
                 config: ConvConfig, interpret: bool):
    batch = x.shape[0]
    S, C, W = columns.shape[1], columns.shape[2], weight.shape[1]
    BC, BS, BW = config.block_v, next_pow2(S), next_pow2(W)
    bounds = (0, *splits, C)
    sizes = tuple(hi - lo for lo, hi in zip(bounds, bounds[1:]))
    firsts = tuple(lo // BC for lo in bounds[:-1])
    pieces = ((pl.BlockSpec((None, BC), lambda b, c: (b, c)),) if not splits
              else tuple(_piece_spec(first, size, BC) for first, size in zip(firsts, sizes)))
    specs = (pl.BlockSpec((None, BC), lambda b, c: (b, c + offset // BC)),
             pl.BlockSpec((None, BS, BC), lambda b, c: (b, 0, c)), pl.BlockSpec((1,), lambda b, c: (b,)),
             pl.BlockSpec((BC, BW), lambda b, c: (c, 0)),
             None if bias is None else pl.BlockSpec((BC,), lambda b, c: (c,)))
    kernel = functools.partial(_conv_kernel, C=C, W=W, S=S, activation=activation, firsts=firsts)
    piece = "" if not splits else "_p" + "_".join(map(str, sizes))
    return pallas_call(
        kernel,
        grid=(batch, pl.cdiv(C, BC)),
        in_specs=specs,
        out_specs=(*pieces, specs[1]),
        out_shape=(*(jax.ShapeDtypeStruct((batch, size), x.dtype) for size in sizes),
                   jax.ShapeDtypeStruct(columns.shape, columns.dtype)),
        input_output_aliases={1: len(sizes)},  # the ring in place
        interpret=interpret,
        config=config,
        name=f"conv_update_w{W}_{config.tag()}{piece}",
    )(x, columns, start, weight, bias)


def conv_update(x, columns, start, weight, bias=None, *, activation: str = "silu", offset: int | None = None,
                splits: tuple[int, ...] = (), config: ConvConfig | None = None, interpret: bool = False):
    """One decode step of the depthwise causal conv on a ring of inputs (module docstring).

    Args:
      x: [batch, C], the new inputs (the activation dtype); with `offset`, [batch, X], the inputs at
        columns offset .. offset + C - 1 of a packed array.
      columns: [batch, S, C], the ring (ConvWindow.columns), S >= W.
      start: i32[batch], the ring slot of each row's oldest live input, in [0, S).
      weight: [C, W] (the conv's [C, 1, W] parameter, reshaped), f32 or bf16.
      bias: [C] or None.
      activation: a name of ACTIVATIONS.
      offset: None (x holds the C inputs alone), or the column of x where the conv's C inputs start.
      splits: increasing channel indices in (0, C) where y is cut into pieces (as `jnp.split`'s).
      config: the launch's ConvConfig (None: `default_conv_config` for C and the boundaries).
      interpret: run in Pallas interpret mode (any platform).

    Returns:
      (y, the ring with x's C inputs at slot (start + W - 1) mod S, updated in place when `columns` is
      donated); y [batch, C] of x.dtype, or with `splits` the tuple of its len(splits) + 1 pieces. Where
      config.block_v does not divide the offset and every split point, XLA slices x and cuts y around the
      launch.

    Raises:
      ValueError: an activation the kernel does not compute; S < W; x not of rank 2; an offset or splits
        outside x or C.
      TypeError: a config that is not a ConvConfig.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {', '.join(map(repr, ACTIVATIONS))} for the conv kernel; "
                         f"got {activation!r}")
    if columns.shape[1] < weight.shape[1]:
        raise ValueError(f"`columns` must hold at least W = {weight.shape[1]} slots; got {columns.shape[1]}")
    if config is not None and not isinstance(config, ConvConfig):
        raise TypeError(f"`config` must be a ConvConfig; got {type(config).__name__}")
    if x.ndim != 2:
        raise ValueError(f"`x` must have rank 2 [batch, X]; got shape {tuple(x.shape)}")
    C = columns.shape[2]
    offset, splits = check_pieces(offset, splits, x.shape[1], C)
    config = config or default_conv_config(C, (offset, *splits))
    kw = dict(activation=activation, config=config, interpret=interpret)
    if all(b % config.block_v == 0 for b in (offset, *splits)):
        *y, columns = _conv_update(x, columns, start, weight, bias, offset=offset, splits=splits, **kw)
        return (tuple(y) if splits else y[0]), columns
    y, columns = _conv_update(x[:, offset:offset + C], columns, start, weight, bias, offset=0, splits=(), **kw)
    return (tuple(jnp.split(y, splits, axis=1)) if splits else y), columns
