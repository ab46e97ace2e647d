"""Pallas GPU kernels of the decode ops.

Each function here takes arguments validated by its
:mod:`replayssm_jax.ops` namesake (shapes, dtypes; `scale` a float, the
static switches bools, a replay step's route resolved), rejects shapes and
configs the kernels cannot tile (raised before any kernel runs), and runs
the Pallas kernel of :mod:`replayssm_jax.kernels.mamba2` / :mod:`~.gdn`,
compiled for the GPU or, with `interpret=True`, interpreted on any platform.

Ops without a kernel (chunked prefill, verify, materialize, flush) are not
defined here; :mod:`replayssm_jax.ops` says so when asked for them.

A replay step is one launch or two (`Config.fused_flush`, chosen by
:func:`default_config`). The replay kernel computes the outputs, appends
the new record at the cursor and writes each row's next cursor. At large
grids the flush is a second launch, whose programs (one state tile, a block
of batch rows each) skip rows whose buffer is not full after the step and
materialize the state of the others from the checkpoint and the L records,
in place: keeping the flush out of the replay kernel keeps that kernel's
register budget (so its occupancy) that of the readout alone, at the price
of a second read of the flushing rows' checkpoint (|S| / L per step on
average). At small grids (latency-bound) the replay kernel writes the
flushing rows' state itself, after its readout, re-reading their
checkpoint rows in sub-tiles. Both flushes apply a row's buffered records
and then this step from its inputs, so neither reads the slot this launch
writes. A row that enters with a full buffer (cursor
== L, possible only after a speculative commit) has no slot for this step's
record: the flush absorbs the L records and this step at once (cursor 0
afterwards), as the reference does. No program reads a slot that another
rewrites in the same launch.

The new cursor: a one-launch step moves it in place, each program of a row
counting its arrival with an atomic add above the cursor's bits, the last
to arrive writing the new value (no copy into a decode loop's carry); a
two-launch step writes it to a fresh array, as its flush launch still reads
the old cursors.

The direct route (`route="direct"`) runs the standard step's kernel, tiled
as that step, with each row's live records folded into its checkpoint tile
first (a loop over the live slots, in a branch that plain decoding never
takes), and sets the cursor to 0 in place. :mod:`replayssm_jax.ops` resolves
`route="auto"` to it where the default replay step is one launch
(:func:`replay_is_one_launch`).
"""

from __future__ import annotations

import jax.numpy as jnp

from replayssm_jax.kernels import gdn as _gdn
from replayssm_jax.kernels import mamba2 as _mamba2
from replayssm_jax.kernels._common import Config, default_config, next_pow2
from replayssm_jax.state import GDNReplayState, Mamba2ReplayState

__all__ = [
    "Config",
    "default_config",
    "gdn_replay_step",
    "gdn_step",
    "mamba2_replay_step",
    "mamba2_step",
    "replay_is_one_launch",
]

MAX_HEAD_DIM = 256  # K and N (the full row of a state tile) and V, P
MAX_BUFFER_LEN = 64


def _check_tileable(what: str, name: str, size: int, limit: int) -> None:
    if size > limit:
        raise ValueError(f"the Pallas kernels support {what} `{name}` <= {limit}; got {size} (use backend='xla')")


def replay_is_one_launch(batch: int, heads: int, V: int, K: int, state_dtype, buffer_len: int) -> bool:
    """Whether the default replay step (:func:`default_config`) at this shape
    is one launch, its flush fused into the replay kernel: where one wave
    holds every head (batch x heads <= 132 programs), e.g. the Qwen3.5-4B
    GDN layer at batch 1-4 and the Nemotron-3-Nano-4B Mamba-2 layer at
    batch 1.

    Args:
      batch, heads: the checkpoint's batch and heads (HV or nheads).
      V, K: its rows and columns (GDN: V, K; Mamba-2: head_dim, d_state).
      state_dtype: the checkpoint's dtype (float32 or bfloat16).
      buffer_len: L.
    """
    config = default_config(batch, heads, V, K, jnp.dtype(state_dtype).itemsize, replay_len=buffer_len)
    return config.fused_flush


def _check_config(config):
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"`config` must be a replayssm_jax.kernels.Config or None; got {type(config).__name__}")


def _check_tile_rows(config, rows: int, name: str) -> None:
    """A tile (block_v, flush_block_v) of at most the state's rows, rounded up to a power of two."""
    limit = next_pow2(rows)
    for field in ("block_v", "flush_block_v"):
        value = getattr(config, field)
        if value > limit:
            raise ValueError(f"`config.{field}` must be <= {limit} (the state's {name} = {rows} rows, rounded up "
                             f"to a power of two); got {value}")


def _check_replay_tiling(L, config, batch: int, rows: int, name: str, route: str):
    _check_tileable("buffer length", "L", L, MAX_BUFFER_LEN)
    if route == "direct":  # the standard step's kernel, tiled as that step
        return _check_standard_config(config, rows, name, "the replay step's direct route")
    _check_config(config)
    if config is None:
        return
    _check_tile_rows(config, rows, name)
    if config.flush_rows and batch % config.flush_rows:
        raise ValueError(f"`config.flush_rows` must divide the batch ({batch}); got {config.flush_rows}")


def _check_standard_config(config, rows: int, name: str, step: str = "the standard step"):
    _check_config(config)
    if config is None:
        return
    _check_tile_rows(config, rows, name)
    if config.tiles != 1:
        raise ValueError(f"`config.tiles` must be 1 for {step} (one tile per program); got {config.tiles}")
    if config.fused_flush:
        raise ValueError(f"`config.fused_flush` must be False for {step} (it writes the state at every step: "
                         "no flush); got True")
    if config.has_flush_tiling:
        raise ValueError(f"`config.flush_block_v`, `flush_warps` and `flush_rows` must be 0 for {step} "
                         f"(it writes the state at every step: no flush); got flush_block_v={config.flush_block_v}, "
                         f"flush_warps={config.flush_warps}, flush_rows={config.flush_rows}")


def gdn_step(state, q, k, v, g, beta, *, scale: float, use_qk_l2norm: bool, config: Config | None = None,
             interpret: bool = False):
    """One standard Gated DeltaNet decode step (Pallas kernel, state updated in place).

    Arguments and returns as :func:`replayssm_jax.ops.gdn_step`, validated
    there; `scale` a float. Raises ValueError for K or V > 256 (not tiled),
    or a `config` with tiles != 1, fused_flush, a flush field set, or
    block_v above V rounded up to a power of two; TypeError for a `config`
    that is not a :class:`Config`. `config` overrides the frozen tiling
    heuristic; `interpret` runs the kernel in interpret mode.
    """
    _, _, V, K = state.shape
    _check_tileable("value dim", "V", V, MAX_HEAD_DIM)
    _check_tileable("key dim", "K", K, MAX_HEAD_DIM)
    _check_standard_config(config, V, "value dim V")
    o, state, _ = _gdn.gdn_step(state, q, k, v, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                config=config, interpret=interpret)
    return o, state


def gdn_replay_step(state: GDNReplayState, q, k, v, g, beta, *, scale: float, use_qk_l2norm: bool, route: str,
                    config: Config | None = None, interpret: bool = False):
    """One ReplaySSM Gated DeltaNet decode step (Pallas kernel, in place).

    Arguments and returns as :func:`replayssm_jax.ops.gdn_replay_step`,
    validated there (see the module note on rows entering with cursor ==
    L); `scale` a float, `route` "output", "state" or "direct". Raises
    ValueError for K or V > 256, L > 64, a `config.block_v` or
    `flush_block_v` above V rounded up to a power of two, a
    `config.flush_rows` that does not divide the batch, or, with
    route="direct", a `config` that is not one of the standard step
    (tiles != 1, fused_flush, a flush field set), or a one-launch step
    (fused flush, direct route) of more than 32767 programs per batch row;
    TypeError for a `config` that is not a :class:`Config`.
    """
    _, _, V, K = state.checkpoint.shape
    L = state.buffer_len
    _check_tileable("value dim", "V", V, MAX_HEAD_DIM)
    _check_tileable("key dim", "K", K, MAX_HEAD_DIM)
    _check_replay_tiling(L, config, state.checkpoint.shape[0], V, "value dim V", route)
    if route == "direct":
        o, ck, cursor = _gdn.gdn_step(state.checkpoint, q, k, v, g, beta, (state.d, state.k, state.g, state.cursor),
                                      scale=scale, use_qk_l2norm=use_qk_l2norm, config=config, interpret=interpret)
        return o, state.replace(checkpoint=ck, cursor=cursor)
    o, ck, d, kb, gb, cursor = _gdn.gdn_replay_step(
        state.checkpoint, state.d, state.k, state.g, state.cursor, q, k, v, g, beta,
        L=L, scale=scale, use_qk_l2norm=use_qk_l2norm, route=route, config=config, interpret=interpret)
    return o, state.replace(checkpoint=ck, d=d, k=kb, g=gb, cursor=cursor)


def mamba2_step(state, x, dt, A, B, C, D, z, dt_bias, *, dt_softplus: bool, dt_limit: tuple[float, float],
                config: Config | None = None, interpret: bool = False):
    """One standard Mamba-2 decode step (Pallas kernel, state updated in place).

    Arguments and returns as :func:`replayssm_jax.ops.mamba2_step`,
    validated there (D, z, dt_bias may be None); `dt_limit` a (low, high)
    pair of floats. Raises ValueError for head_dim or d_state > 256, or a
    `config` with tiles != 1, fused_flush, a flush field set, or block_v
    above P rounded up to a power of two; TypeError for a `config` that is
    not a :class:`Config`.
    """
    _, _, P, N = state.shape
    _check_tileable("head_dim", "P", P, MAX_HEAD_DIM)
    _check_tileable("d_state", "N", N, MAX_HEAD_DIM)
    _check_standard_config(config, P, "head_dim P")
    y, state, _ = _mamba2.mamba2_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=dt_softplus,
                                      dt_limit=dt_limit, config=config, interpret=interpret)
    return y, state


def mamba2_replay_step(state: Mamba2ReplayState, x, dt, A, B, C, D, z, dt_bias, *, dt_softplus: bool,
                       dt_limit: tuple[float, float], route: str, config: Config | None = None,
                       interpret: bool = False):
    """One ReplaySSM Mamba-2 decode step (Pallas kernel, in place).

    Arguments and returns as :func:`replayssm_jax.ops.mamba2_replay_step`,
    validated there (see the module note on rows entering with cursor ==
    L); `route` "output", "state" or "direct". Raises ValueError for
    head_dim or d_state > 256, L > 64, a `config.block_v` or
    `flush_block_v` above P rounded up to a power of two, a
    `config.flush_rows` that does not divide the batch, or, with
    route="direct", a `config` that is not one of the standard step
    (tiles != 1, fused_flush, a flush field set), or a one-launch step
    (fused flush, direct route) of more than 32767 programs per batch row;
    TypeError for a `config` that is not a :class:`Config`.
    """
    _, _, P, N = state.checkpoint.shape
    L = state.buffer_len
    _check_tileable("head_dim", "P", P, MAX_HEAD_DIM)
    _check_tileable("d_state", "N", N, MAX_HEAD_DIM)
    _check_replay_tiling(L, config, state.checkpoint.shape[0], P, "head_dim P", route)
    if route == "direct":
        y, ck, cursor = _mamba2.mamba2_step(state.checkpoint, x, dt, A, B, C, D, z, dt_bias,
                                            (state.x, state.dt, state.B, state.cursor), dt_softplus=dt_softplus,
                                            dt_limit=dt_limit, config=config, interpret=interpret)
        return y, state.replace(checkpoint=ck, cursor=cursor)
    y, ck, xb, dtb, Bb, cursor = _mamba2.mamba2_replay_step(
        state.checkpoint, state.x, state.dt, state.B, state.cursor, x, dt, A, B, C, D, z, dt_bias,
        L=L, dt_softplus=dt_softplus, dt_limit=dt_limit, route=route, config=config, interpret=interpret)
    return y, state.replace(checkpoint=ck, x=xb, dt=dtb, B=Bb, cursor=cursor)
