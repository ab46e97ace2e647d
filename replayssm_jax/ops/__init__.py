"""Public ops of a decode step (the SSM layers' steps and states, the conv update, the decode
attention) with a choice of backend.

Every op validates its arguments once (:mod:`replayssm_jax.ops.validate`),
resolves its backend and, for a replay step, its route
(:mod:`replayssm_jax.ops.dispatch`), and calls the pure-JAX reference
(:mod:`replayssm_jax.reference`, the math) or the Pallas kernel
(:mod:`replayssm_jax.kernels`). Keyword-only arguments of every op:

  backend  "xla" (the reference, any platform), "pallas" (the Pallas GPU
           kernels, compiled; needs a CUDA GPU), "interpret" (the same
           kernels in interpret mode, any platform; slow, for tests), or None:
           "pallas" on a GPU for an op with a kernel (:data:`KERNEL_OPS`),
           else "xla".
  config   a :class:`replayssm_jax.kernels.StepConfig` (standard steps, the
           replay step's direct route) or :class:`~replayssm_jax.kernels.ReplayConfig`
           (the replay step's output, state, append and deferred routes,
           the verify window) or :class:`~replayssm_jax.kernels.ConvConfig`
           (the conv update) or :class:`~replayssm_jax.kernels.AttentionConfig`
           (the decode attention) overriding the kernels' frozen tiling
           heuristic, or None; only the kernel backends take one. The
           replay step's append and deferred routes (both layers; the
           deferred route's flush launch then takes the default
           ReplayConfig's tiling), the GDN replay step's direct route and
           the GDN standard step also take a
           :class:`~replayssm_jax.kernels.TMAReadoutConfig`: their Mosaic
           GPU forms (compiled, "pallas" only;
           :mod:`replayssm_jax.kernels.tma_readout`,
           :mod:`replayssm_jax.kernels.tma_step`); the append and
           deferred routes' is the default on a Hopper-class GPU from
           batch 64.

The decode steps (`mamba2_step`, `gdn_step` and their replay steps) and the
verify ops (`*_replay_verify`, the per-draft `mamba2_verify` / `gdn_verify`)
also take ``slots``: None, or i32[batch], the rows of a state pool
(:mod:`replayssm_jax.pool`): the state then holds `capacity` slots on
axis 0 (a per-draft state [capacity, slots, ...] with its index
i32[capacity]) and batch row b steps slot slots[b]; -1 is a padding row,
which reads and writes nothing (its output is unspecified); no slot twice.
The kernels index the pool by slot (no copy of the states); "xla" gathers
the slots' rows, steps them and scatters them back. A verify over a pool
takes chain windows (no `tree`). An 8-bit checkpoint's scales and write
counts are indexed by slot as the checkpoint (stochastic rounding keys its
noise by the pool's slot on the kernels, by the batch row on "xla").

An explicitly requested backend that cannot run raises (no GPU for
"pallas"; no kernel for the op); nothing falls back silently. Every error
is raised before any computation, so a failed call leaves the caller's
state usable. Inside `jax.jit` only shapes and dtypes are checked; checks
of values (A < 0, cursors in [0, L], commit counts) need concrete arrays.

Dimension letters (glossary in :mod:`replayssm_jax.reference`): Mamba-2
batch, H = nheads, P = head_dim, N = d_state, G = n_groups; Gated DeltaNet
batch, H key heads, HV value heads, K key dim, V value dim; L the buffer
length, W a verify window. States are value-major: Mamba-2 [batch, nheads,
head_dim, d_state] (mamba_ssm's and transformers' ssm_state), GDN [batch,
HV, V, K] (FLA's; transformers' cache is [batch, HV, K, V]: transpose it).
float16 arrays of the SSM ops (activations, parameters, states, buffers) raise
TypeError: float16 overflows in these recurrences; use bfloat16 or float32.

Replay checkpoints may also be int8 or float8_e4m3fn (`checkpoint_dtype`
of the init ops): one f32 scale per state row, quantized at every
checkpoint write, to nearest or stochastically (:mod:`replayssm_jax.state`).
No standard step takes an 8-bit state (TypeError). The combinations that
:data:`UNSAFE_CHECKPOINTS` lists warn at init, and the direct route on an
8-bit checkpoint warns at each call (UserWarning); "auto" takes the output
route on one.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from replayssm_jax import kernels, reference
from replayssm_jax import state as _state
from replayssm_jax.ops import validate as val
from replayssm_jax.ops.dispatch import (
    BACKENDS,
    KERNEL_OPS,
    ROUTES,
    STEP_ROUTES,
    backend_for,
    check_buffer_len,
    check_route,
    choose_backend,
    default_backend,
    resolve_backend,
    resolve_route,
)
from replayssm_jax.state import GDNReplayState, Mamba2ReplayState

__all__ = [
    "BACKENDS",
    "GDNReplayState",
    "KERNEL_OPS",
    "Mamba2ReplayState",
    "ROUTES",
    "STEP_ROUTES",
    "attention_decode",
    "backend_for",
    "check_buffer_len",
    "check_route",
    "conv_update",
    "default_backend",
    "gdn_chunked",
    "gdn_conv_step",
    "gdn_replay_flush",
    "gdn_replay_init",
    "gdn_replay_materialize",
    "gdn_replay_step",
    "gdn_replay_verify",
    "gdn_step",
    "gdn_verify",
    "mamba2_chunked",
    "mamba2_replay_flush",
    "mamba2_replay_init",
    "mamba2_replay_materialize",
    "mamba2_replay_step",
    "mamba2_replay_verify",
    "mamba2_step",
    "mamba2_verify",
    "put_slots",
    "replay_commit",
    "resolve_backend",
    "resolve_route",
    "take_slots",
]

INF = math.inf

# The 8-bit checkpoints (dtype, rounding) that warn, per layer type, with the reason the warning gives.
# The drift study (bench/state_drift.py --model-shapes, 2026-12-01: random-weight layers at the model
# shapes with slow decays, 4096 steps, L 8, 16 and 32) puts float8_e4m3fn at 15-22x the bfloat16
# checkpoint's output error on both layer types, with both roundings, and int8 at 3.9x (nearest) and
# 5.5x (stochastic), at every L. int8 also warns on GDN layers: uniform int8 GDN states are reported to
# drop Qwen3.5-4B's GSM8K accuracy from 81% to 41%, where int8 Mamba-2 states keep Nemotron's (85.9%
# against 85.4% in f32, FlashInfer's checkpointing_ssu). The direct route on an 8-bit checkpoint warns
# as well (it rounds at every step).
_FP8_DRIFT = ("drifts from the float32 checkpoint's outputs by 15-22x the bfloat16 checkpoint's error at the model "
              "shapes (int8 to nearest: 3.9x)")
_GDN_INT8 = ("is reported to drop Qwen3.5-4B's GSM8K accuracy from 81% to 41% (uniform int8 GDN states; its drift "
             "here is 3.9-5.5x the bfloat16 checkpoint's error)")
UNSAFE_CHECKPOINTS = {
    "mamba2": {(jnp.dtype(jnp.float8_e4m3fn), r): _FP8_DRIFT for r in ("nearest", "stochastic")},
    "gdn": {**{(jnp.dtype(jnp.float8_e4m3fn), r): _FP8_DRIFT for r in ("nearest", "stochastic")},
            **{(jnp.dtype(jnp.int8), r): _GDN_INT8 for r in ("nearest", "stochastic")}},
}

# The `config` a kernel op takes (None: the heuristic).
KernelConfig = kernels.StepConfig | kernels.ReplayConfig | kernels.TMAReadoutConfig


# --------------------------------------------------------------------------
# The conv update


def conv_update(x, columns, start, weight, bias=None, activation: str = "silu", *, offset: int | None = None,
                splits=(), backend: str | None = None, config: kernels.ConvConfig | None = None):
    """One decode step of the short causal conv (Mamba-2's and GDN's conv1d) on its ring of inputs.

    With xp_j = columns[b, (start + j) mod S] for j < W - 1 and xp_{W-1} = x:
    y[b, c] = act(bias[c] + sum_j weight[c, j] xp_j[b, c]) (f32 arithmetic),
    and x written at ring slot (start + W - 1) mod S; start is the caller's
    to move (`replayssm_jax.layers.cache.ConvWindow.advance`). The kernel
    (one launch, grid over rows and channel blocks) reads the W - 1 live
    columns and x and writes y and the new column, the ring in place when
    donated; the reference writes the ring with a select over every slot.

    Packed operands (a decode layer's projections): `offset` reads x from
    columns offset .. offset + C - 1 of a wider array, and `splits` returns
    y cut into pieces; the kernel reads and writes them in place where its
    channel block divides the offset and every split point (Mamba-2's xBC
    at in_proj's column d_inner, cut into x, B, C; GDN's q, k, v), so no
    XLA slice runs before or after it.

    Args:
      x: [batch, C], the new inputs (bf16 or f32); with `offset`, [batch, X]
        holding them at columns offset .. offset + C - 1.
      columns: [batch, S, C] (S >= W), the ring: `ConvWindow.columns`.
      start: int[batch] in [0, S), the slot of each row's oldest live input.
      weight: [C, W], the conv's [C, 1, W] weight reshaped; bias: [C] or None.
      activation: a name of :data:`replayssm_jax.reference.conv.ACTIVATIONS`;
        the kernel computes silu / swish, relu, relu2 and identity, and the
        backend None runs the others on "xla".
      offset: None, or the int column of x where the conv's inputs start.
      splits: increasing int channel indices in (0, C) (as `jnp.split`'s):
        y comes back as the tuple of its len(splits) + 1 pieces.
      backend, config: as every op (module docstring); a
        :class:`replayssm_jax.kernels.ConvConfig` for the kernel (None: the
        default for C and the pieces' boundaries).

    Returns:
      (y [batch, C] of x's dtype, or the tuple of its pieces [batch, size]
      with `splits`; the ring [batch, S, C] with x's C inputs written).

    Raises:
      TypeError, ValueError: bad arguments (`validate.check_conv_update`:
        x not [batch, C] without `offset`, an offset or splits outside x or
        C), an activation that an explicitly requested kernel backend does
        not compute.
    """
    x, columns, start, weight, bias, activation, offset, splits = val.check_conv_update(
        x, columns, start, weight, bias, activation, reference.conv.ACTIVATIONS, offset, splits)
    if backend is None and activation not in kernels.CONV_ACTIVATIONS:
        if config is not None:
            raise TypeError(f"`config` tunes the conv kernel, which does not compute `activation` {activation!r} "
                            "(backend=None runs it on 'xla'); pass config=None")
        backend = "xla"  # an activation that the kernel does not compute
    chosen = choose_backend("conv_update", backend, config)
    if chosen == "xla":
        return reference.conv_update(x, columns, start, weight, bias, activation, offset, splits)
    if activation not in kernels.CONV_ACTIVATIONS:
        raise ValueError(f"`activation` {activation!r}: the conv kernel computes {', '.join(kernels.CONV_ACTIVATIONS)}"
                         " (use backend='xla' or None)")
    return kernels.conv_update(x, columns, start, weight, bias, activation=activation, offset=offset, splits=splits,
                               config=config, interpret=chosen == "interpret")


def attention_decode(q, k, v, length, *, scale=None, backend: str | None = None,
                     config: kernels.AttentionConfig | None = None):
    """Attention of one new position per row over its KV cache (GQA), as a decode step's attention layer
    forms it: o[b, h] = sum_{t < length[b]} softmax_t(scale q[b, h] . k[b, t, g]) v[b, t, g] with g the KV
    head of query head h (h // (HQ / HK)); scores and softmax in f32.

    The reference (`replayssm_jax.reference.attention_decode`, the attention layers' math) masks the
    positions at and after `length` and runs XLA's two products over all S; the kernel (one launch, grid
    over rows, KV heads and parts of the live positions) reads each row's live positions only, K and V
    once for the KV head's query heads, with an online softmax; where the rows are few, parts of a row
    run side by side and XLA joins them (flash decoding). The kernel's probabilities enter the second
    product unnormalised, the reference's normalised, each in V's dtype: the two differ by that rounding.

    Args:
      q: [batch, HQ, D] (f32, bf16 or f16), the new position's queries, RoPE and norms applied.
      k, v: [batch, S, HK, D] of q's dtype, the KV cache with the new position's entry written
        (`replayssm_jax.layers.cache.KVCache` layout); HK divides HQ.
      length: int[batch] in [1, S], the live positions of each row, the new one included (checked where
        concrete).
      scale: the scores' factor, a finite number; None: D ** -0.5.
      backend, config: as every op (module docstring); a
        :class:`replayssm_jax.kernels.AttentionConfig` for the kernel (None: `default_attention_config`).

    Returns:
      o [batch, HQ, D] of q's dtype.

    Raises:
      TypeError, ValueError: bad arguments (`validate.check_attention_decode`), named; on the kernel
        backends D above 256 (ValueError).
    """
    q, k, v, length, scale = val.check_attention_decode(q, k, v, length, scale)
    chosen = choose_backend("attention_decode", backend, config)
    if chosen == "xla":
        return reference.attention_decode(q, k, v, length, scale)
    return kernels.attention_decode(q, k, v, length, scale=scale, config=config, interpret=chosen == "interpret")


# --------------------------------------------------------------------------
# Replay states


def mamba2_replay_init(checkpoint, buffer_len: int, n_groups: int, buffer_dtype=jnp.float32, checkpoint_dtype=None,
                       rounding: str = "nearest") -> Mamba2ReplayState:
    """A Mamba-2 ReplaySSM state with an empty buffer.

    Args:
      checkpoint: f32 | bf16[batch, nheads, head_dim, d_state], the SSM state
        to start from (zeros for an empty prefix, or a prefill's final state).
      buffer_len: L >= 1, the number of buffered steps between flushes;
        the kernel backends take L <= 64 (`kernels.MAX_BUFFER_LEN`) and
        refuse a longer buffer at its first step (:func:`check_buffer_len`
        checks it up front), the "xla" backend any L.
      n_groups: G, the number of B/C groups; must divide nheads.
      buffer_dtype: dtype of the x and B records (dt is always float32).
        Use the activation dtype (e.g. bfloat16) to halve buffer traffic;
        records of bf16 activations are then stored exactly.
      checkpoint_dtype: the stored checkpoint's dtype: None (the given
        checkpoint's), float32, bfloat16, int8 or float8_e4m3fn. 8-bit
        checkpoints hold one f32 scale per (head, head_dim row), over
        d_state (`state.scale` f32[batch, nheads, head_dim]), and are
        quantized at every write (:mod:`replayssm_jax.state`).
      rounding: "nearest" or "stochastic" (counter-based, reproducible):
        how an 8-bit checkpoint write rounds; ignored for f32 | bf16.

    Returns:
      Mamba2ReplayState with cursor 0 for every row. Its checkpoint is the
      given array itself where no cast or quantization is asked (no copy):
      donating the state to a `jax.jit` deletes `checkpoint` too, so pass
      ``jnp.copy(checkpoint)`` to keep decoding from the original.

    Raises:
      TypeError: non-float checkpoint or buffer_dtype, a checkpoint_dtype
        other than the four, or non-int sizes.
      ValueError: wrong rank, L < 1, nheads not divisible by n_groups, or
        an unknown rounding.
    """
    dtype, rounding = _checkpoint_format("mamba2", checkpoint_dtype, rounding)
    return _state.mamba2_replay_init(*val.check_mamba2_replay_init(checkpoint, buffer_len, n_groups, buffer_dtype),
                                     checkpoint_dtype=dtype, rounding=rounding)


def _checkpoint_format(layer: str, checkpoint_dtype, rounding):
    """(checkpoint_dtype as a dtype or None, rounding), checked; a UserWarning for a combination that
    :data:`UNSAFE_CHECKPOINTS` lists for `layer`."""
    dtype = None if checkpoint_dtype is None else val.check_checkpoint_dtype("checkpoint_dtype", checkpoint_dtype)
    rounding = val.check_rounding("rounding", rounding)
    reason = None if dtype is None else UNSAFE_CHECKPOINTS[layer].get((dtype, rounding))
    if reason is not None:
        val.warn(f"a replay checkpoint of {dtype} with {rounding} rounding on {layer} layers {reason} "
                 "(bench/RESULTS.md, 8-bit checkpoints, 2026-12-01); a bfloat16 checkpoint is safer")
    return dtype, rounding


def _check_append(state, route: str, slots) -> None:
    """On the append route, a ValueError for a concrete cursor with a full buffer in a batch row (that row
    cannot take the step; under a trace the kernels give it NaN outputs and leave its state, as the
    reference does). With `slots`, batch row b is pool slot slots[b] (-1: padding, not checked)."""
    if route != "append" or any(isinstance(a, jax.core.Tracer) for a in (state.cursor, slots)):
        return
    cursor = state.cursor if slots is None else jnp.where(slots >= 0, state.cursor[jnp.maximum(slots, 0)], 0)
    full = [int(r) for r in jnp.flatnonzero(cursor >= state.buffer_len)]
    if full:
        where = "" if slots is None else f" (pool slots {[int(slots[r]) for r in full[:8]]})"
        raise ValueError(f"route 'append' needs a free buffer slot in every row (cursor < buffer_len = "
                         f"{state.buffer_len}); batch rows {full[:8]}{where} are full: step them on another "
                         "route ('output', 'state', 'direct' or 'deferred'), which flushes them")


def _warn_direct_8bit(state, route: str) -> None:
    """A UserWarning for the direct route on an 8-bit checkpoint, which it rounds at every step."""
    if route == "direct" and state.scale is not None:
        val.warn(f"the direct route rounds a checkpoint of {state.checkpoint.dtype} at every step (the output and "
                 "state routes round it once per flush): its outputs drift about 3x further from the float32 "
                 "checkpoint's (bench/state_drift.py, 2026-12-01); use route='output'")


def take_slots(pool, slots):
    """The rows `slots` (i32[batch]) of every array of `pool` (a pytree whose arrays have the slot axis
    first): an XLA gather, a copy of those rows; a padding row (-1) reads slot 0."""
    return jax.tree.map(lambda a: a[jnp.maximum(slots, 0)], pool)


def put_slots(pool, slots, rows):
    """`pool` with rows `slots` (i32[batch]) of each array set to `rows` (the same pytree with the
    batch first): an XLA scatter of those rows; the padding rows (-1) are dropped."""
    capacity = jax.tree.leaves(pool)[0].shape[0]
    target = jnp.where(slots < 0, capacity, slots)  # out of range: dropped
    return jax.tree.map(lambda a, row: a.at[target].set(row.astype(a.dtype), mode="drop"), pool, rows)


def _on_slots(step, state, slots):
    """step(state) -> (y, state), or over a state pool (`slots` i32[batch], validated) step(rows) on
    the slots' rows of the pool: gathered, stepped and scattered back (the reference's XLA code; the
    kernels index the pool instead)."""
    if slots is None:
        return step(state)
    y, rows = step(take_slots(state, slots))
    if getattr(rows, "window", None) != getattr(state, "window", None):  # a verify's pending window (static)
        state = state.replace(window=rows.window)
    return y, put_slots(state, slots, rows)


def _with_tree(result, tree):
    """A replay verify's (y, state) with the verified tree's parents recorded on the state (None for a chain),
    which :func:`replay_commit` checks its `path` against."""
    y, state = result
    return y, state.replace(tree=val.tree_parents(tree))


def _pool_option(slots) -> dict:
    """The kernels' `slots` keyword: {} without a pool (so that those calls are unchanged)."""
    return {} if slots is None else {"slots": slots}


def _rows_shape(state, slots):
    """`state` as the shapes of a state of the slots' batch (route and tiling choices), or itself."""
    if slots is None:
        return state
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((slots.shape[0], *a.shape[1:]), a.dtype), state)


def gdn_replay_init(checkpoint, buffer_len: int, num_k_heads: int, buffer_dtype=jnp.float32, checkpoint_dtype=None,
                    rounding: str = "nearest") -> GDNReplayState:
    """A Gated DeltaNet ReplaySSM state with an empty buffer.

    Args:
      checkpoint: f32 | bf16[batch, HV, V, K], the value-major state to start
        from (transformers' cache is [batch, HV, K, V]: transpose its last
        two axes first; a transposed checkpoint with K != V is reported by
        the first replay op that sees q or v).
      buffer_len: L >= 1, the number of buffered steps between flushes
        (kernel backends: L <= 64, as :func:`mamba2_replay_init`).
      num_k_heads: H, the number of key heads; must divide HV.
      buffer_dtype: dtype of the d and k records (g is always float32).
      checkpoint_dtype, rounding: as :func:`mamba2_replay_init`; an 8-bit
        checkpoint holds one f32 scale per (value head, value row), over
        the key dim K (`state.scale` f32[batch, HV, V]).

    Returns:
      GDNReplayState with cursor 0 for every row; its checkpoint is the
      given array itself where no cast or quantization is asked, as in
      :func:`mamba2_replay_init` (donating the state deletes `checkpoint`).

    Raises:
      TypeError: non-float checkpoint or buffer_dtype, a checkpoint_dtype
        other than the four, or non-int sizes.
      ValueError: wrong rank, L < 1, HV not divisible by H, or an unknown
        rounding.
    """
    dtype, rounding = _checkpoint_format("gdn", checkpoint_dtype, rounding)
    return _state.gdn_replay_init(*val.check_gdn_replay_init(checkpoint, buffer_len, num_k_heads, buffer_dtype),
                                  checkpoint_dtype=dtype, rounding=rounding)


def replay_commit(state: Mamba2ReplayState | GDNReplayState, num_accepted, path=None):
    """Accept the first `num_accepted` steps of the pending verify window, or a path of a verified tree.

    Commit is a cursor move (ARCHITECTURE.md, "The verify window"): `cursor += num_accepted`;
    the rejected records stay in their slots as dead entries and are
    overwritten later. The checkpoint is not touched. A row whose cursor
    reaches L is flushed by its next step or verify. With a `path` (tree
    speculation), the records of the row's accepted nodes path[:m] are first
    gathered within the row's buffers to slots cursor .. cursor + m - 1 (XLA;
    in place where the state is donated), then the cursor moves by m.

    Args:
      state: a Mamba2ReplayState or GDNReplayState returned by a verify
        (`state.window = W > 0`).
      num_accepted: int[batch], per-sequence counts in 0..W (with a path:
        0..P).
      path: None after a chain's verify (the first m steps); after a
        tree's verify (required), int[batch, P]: per row the node indices
        of its accepted path, root first (path[b, i] is the node at depth
        i; entries past num_accepted[b] are not read).

    Returns:
      The state with the cursor moved and `window = 0`.

    Raises:
      TypeError: not a replay state, or non-integer counts.
      ValueError: no pending window, counts of the wrong shape, or (when
        the counts are concrete) a count outside 0..W; a path after a
        chain's verify or none after a tree's; a path not [batch, P] with
        P <= W, or (concrete) a node index outside 0..W - 1, a count above
        P, or a row's kept nodes that are not a path of the verified tree
        from its root (`state.tree`). Inside jit, counts are clipped to 0..W.
    """
    num_accepted = val.check_replay_commit(state, num_accepted)
    return _state.replay_commit(state, num_accepted,
                                val.check_commit_path(path, num_accepted, state.window, state.tree))


# --------------------------------------------------------------------------
# Mamba-2


def mamba2_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, INF), *,
                dt_offset: int | None = None, backend: str | None = None, config: KernelConfig | None = None,
                slots=None):
    """One standard Mamba-2 decode step (the selective state update).

    Per head h with group g = h // (nheads // n_groups):
    dt' = clamp(softplus(dt + dt_bias), dt_limit), S <- exp(dt' A) S +
    (dt' x) B_g^T, y = S C_g + D x, then y *= silu(z) (Dao & Gu 2024;
    mamba_ssm's `selective_state_update`; :func:`replayssm_jax.reference.mamba2_step`).

    Args:
      state: f32 | bf16[batch, nheads, head_dim, d_state], ssm_state before the step.
      x: [batch, nheads, head_dim], the SSM input (after conv1d and silu).
      dt: [batch, nheads], raw time step (before dt_bias and softplus).
      A: f32[nheads], negative, A = -exp(A_log).
      B, C: [batch, n_groups, d_state]; n_groups divides nheads.
      D: optional [nheads], skip connection y += D * x.
      z: optional [batch, nheads, head_dim], gate: y *= silu(z).
      dt_bias: optional [nheads], added to dt before softplus.
      dt_softplus: bool, apply softplus to dt (+ dt_bias).
      dt_limit: (low, high) with 0 <= low <= high, clamp of the processed dt
        (the model's time_step_limit).
      dt_offset: None, or an int >= 0: `dt` is [batch, X] and holds the
        nheads values at columns dt_offset .. dt_offset + nheads - 1, where
        the kernels read them (Mamba-2's in_proj output zxbcdt, dt its last
        nheads columns: no slice launch before the step). The other Mamba-2
        ops take it too (dt then [batch, W or seqlen, X]).
      backend, config, slots: see the module docstring (a kernel op; with
        slots, `state` is a pool [capacity, nheads, head_dim, d_state]).

    Returns:
      (y [batch, nheads, head_dim] in x.dtype, new_state in state.dtype);
      the kernels update the state in place.

    Raises:
      TypeError: an argument is not a floating array, the state is not
        f32 / bf16, dt_softplus is not a bool, dt_offset is not a static
        int, or a `config` on "xla".
      ValueError: a shape does not match (a state with its last two axes
        swapped is named as such; with dt_offset, a dt narrower than
        dt_offset + nheads), nheads % n_groups != 0, a bad dt_limit, a
        negative dt_offset, a concrete A with an entry >= 0, an unknown
        backend; on the kernel backends also the kernels' limits
        (:func:`replayssm_jax.kernels.mamba2_step`).
      RuntimeError: backend "pallas" without a GPU.
      ValueError: `slots` not of shape [batch], a concrete slot outside
        [-1, capacity) or used twice;
        TypeError: `slots` not integers.
    """
    dt_offset = val.check_dt_offset_value(dt_offset)
    state, dt_softplus, dt_limit, slots = val.check_mamba2_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                                                dt_limit, slots, dt_offset)
    chosen = choose_backend("mamba2_step", backend, config)
    if chosen == "xla":
        return _on_slots(lambda s: reference.mamba2_step(s, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit,
                                                         dt_offset=dt_offset), state, slots)
    return kernels.mamba2_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=dt_softplus, dt_limit=dt_limit,
                               dt_offset=dt_offset, config=config, interpret=chosen == "interpret",
                               **_pool_option(slots))


def mamba2_verify(state, index, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, INF),
                  *, tree=None, dt_offset: int | None = None, backend: str | None = None,
                  config: KernelConfig | None = None, slots=None):
    """The per-draft standard verify of W speculative Mamba-2 steps: one state per draft position.

    The standard-state baseline of speculative decoding, as vLLM runs it
    (its selective_state_update with per-draft state indices): the state
    keeps `slots` states per row, `index` the slot of the current one.
    Step t (of a draft tree: node t) is :func:`mamba2_step` from the state
    after step t - 1 (node t's parent; step 0 and the root: the current
    state); its state goes to slot (index + 1 + t) mod slots, so the
    current slot is never written (W <= slots - 1) and a commit of m steps
    only moves the index (:func:`replayssm_jax.layers.commit_layer_state`).
    The kernel reads the current state once and writes W states (1 + W
    state passes). Math: :func:`replayssm_jax.reference.mamba2_verify`.

    Args:
      state: f32 | bf16[batch, slots, nheads, head_dim, d_state].
      index: int[batch] in 0..slots - 1, each row's slot of the current state.
      x: [batch, W, nheads, head_dim]; dt: [batch, W, nheads] (raw);
      B, C: [batch, W, n_groups, d_state]; z: optional like x; A, D,
      dt_bias, dt_softplus, dt_limit: as :func:`mamba2_step`. 1 <= W <= slots - 1.
      dt_offset: as :func:`mamba2_step` (dt then [batch, W, X]).
      tree: None (a chain) or a
        :class:`~replayssm_jax.speculative.tree.DraftTree` of W nodes (static).
      backend, config, slots: see the module docstring (a kernel op; config a
        StepConfig; with slots, `state` is a pool [capacity, slots, ...] and
        `index` i32[capacity]).

    Returns:
      (y [batch, W, nheads, head_dim] in x.dtype: y[:, t] assumes steps
      0 .. t - 1 (of a tree: t's ancestors) accepted; the new state, the W
      states at their slots, the kernels writing in place).

    Raises:
      TypeError: as :func:`mamba2_step` (an 8-bit state: states of 8 bits
        are replay checkpoints only); a non-integer index; a `tree` that is
        not a DraftTree.
      ValueError: as :func:`mamba2_step`, for a state [batch, slots, ...]
        of rank 5; an index not [batch] or (concrete) outside 0..slots - 1;
        W outside [1, slots - 1]; a tree of another size than W.
      RuntimeError: backend "pallas" without a GPU.
    """
    dt_offset = val.check_dt_offset_value(dt_offset)
    state, index, dt_softplus, dt_limit, slots = val.check_mamba2_verify(state, index, x, dt, A, B, C, D, z, dt_bias,
                                                                         dt_softplus, dt_limit, tree, slots, dt_offset)
    chosen = choose_backend("mamba2_verify", backend, config)
    if chosen == "xla":
        rows_index = index if slots is None else take_slots(index, slots)
        return _on_slots(lambda s: reference.mamba2_verify(s, rows_index, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                                           dt_limit, tree, dt_offset=dt_offset), state, slots)
    return kernels.mamba2_verify(state, index, x, dt, A, B, C, D, z, dt_bias, dt_softplus=dt_softplus,
                                 dt_limit=dt_limit, dt_offset=dt_offset, tree=tree, config=config,
                                 interpret=chosen == "interpret", **_pool_option(slots))


def mamba2_chunked(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, INF),
                   chunk_size=64, *, dt_offset: int | None = None, backend: str | None = None,
                   config: KernelConfig | None = None):
    """T Mamba-2 steps at once in the chunked SSD form (the prefill path).

    Within a chunk of `chunk_size` steps the outputs are one masked
    "attention" product C B^T * decay; the state passes between chunks (the
    SSD form of Dao & Gu 2024, mamba_ssm's `ssd_minimal`;
    :func:`replayssm_jax.reference.mamba2_chunked`). Equal to seqlen
    :func:`mamba2_step` calls up to float32 rounding.

    Args:
      state: None (zeros) or f32 | bf16[batch, nheads, head_dim, d_state].
      x: [batch, seqlen, nheads, head_dim]; dt: [batch, seqlen, nheads] (raw);
      A: f32[nheads] < 0; B, C: [batch, seqlen, n_groups, d_state];
      D: optional [nheads]; z: optional like x; dt_bias: optional [nheads];
      dt_softplus, dt_limit: as :func:`mamba2_step`.
      dt_offset: as :func:`mamba2_step` (dt then [batch, seqlen, X]).
      chunk_size: steps per chunk (an int >= 1; need not divide seqlen).
      backend, config: see the module docstring; this op has no kernel, so
        "pallas", "interpret" and a config raise.

    Returns:
      (y [batch, seqlen, nheads, head_dim] in x.dtype, final state in
      state.dtype, or float32 if state is None).

    Raises:
      TypeError, ValueError: as :func:`mamba2_step`; also chunk_size < 1.
      NotImplementedError: backend "pallas" or "interpret".
    """
    dt_offset = val.check_dt_offset_value(dt_offset)
    state, dt_softplus, dt_limit, chunk_size = val.check_mamba2_chunked(
        state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, chunk_size, dt_offset)
    choose_backend("mamba2_chunked", backend, config)
    return reference.mamba2_chunked(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, chunk_size,
                                    dt_offset=dt_offset)


def mamba2_replay_step(state: Mamba2ReplayState, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                       dt_limit=(0.0, INF), route: str = "output", *, dt_offset: int | None = None,
                       backend: str | None = None,
                       config: KernelConfig | None = None, slots=None):
    """One ReplaySSM decode step of a Mamba-2 layer (ARCHITECTURE.md, "The math").

    Appends this step's record (x, dt, B) at each row's cursor, computes y
    from one read of the checkpoint plus the buffer, and flushes the rows whose
    buffer it fills, as the reference does
    (:func:`replayssm_jax.reference.mamba2_replay_step`, which gives the math).

    Args:
      state: Mamba2ReplayState with no pending verify window.
      x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, dt_offset: as
        :func:`mamba2_step`; B and C with the state's n_groups.
      route: "output" (y from the checkpoint plus the buffer, no state
        formed), "state" (the state formed for the readout), "direct" (the
        live records folded into the checkpoint, then a standard step
        written back at once: cursor 0, no record appended; the standard
        step's traffic, for latency-bound batches, the buffer kept for
        speculative decoding), "deferred" (the output route with each
        row's flush deferred to its next step: a flush launch for the rows
        that entered full, then the append route's launches; a row that
        fills its buffer keeps it full, cursor L, until then), or "auto"
        (:func:`resolve_route`). All give
        the same numbers up to float32 rounding. Also "append": the output
        route without the flush (one launch on the kernel backends), for a
        schedule that flushes the rows itself, as the `Generator`'s lockstep
        cycles do: a row that fills its buffer keeps it full (cursor L)
        until a step on another route flushes it.
      backend, config, slots: see the module docstring (a kernel op; with
        slots, `state` is a pool of capacity slots).

    Returns:
      (y [batch, nheads, head_dim] in x.dtype, new Mamba2ReplayState); y
      equals :func:`mamba2_step`'s output on the same step sequence.

    Raises:
      TypeError, ValueError, RuntimeError: as :func:`mamba2_step`; also a
        malformed state, a pending verify window, an unknown route, or B /
        C with another n_groups than the state's; on the kernel backends the
        kernels' limits (:func:`replayssm_jax.kernels.mamba2_replay_step`).
      ValueError: route "append" with a concrete cursor at buffer_len in
        some batch row (no free slot; under a trace that row's outputs are
        NaN and its state is left unchanged).
      ValueError: `slots` not of shape [batch], a concrete slot outside
        [-1, capacity) or used twice;
        TypeError: `slots` not integers.
    """
    dt_offset = val.check_dt_offset_value(dt_offset)
    dt_softplus, dt_limit, slots = val.check_mamba2_replay_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                                                dt_limit, slots, dt_offset)
    chosen = choose_backend("mamba2_replay_step", backend, config)
    route = resolve_route(route, chosen, _rows_shape(state, slots), config, pool=slots is not None)
    _warn_direct_8bit(state, route)
    _check_append(state, route, slots)
    if chosen == "xla":
        return _on_slots(lambda s: reference.mamba2_replay_step(s, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                                                dt_limit, route, dt_offset=dt_offset), state, slots)
    return kernels.mamba2_replay_step(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=dt_softplus,
                                      dt_limit=dt_limit, dt_offset=dt_offset, route=route, config=config,
                                      interpret=chosen == "interpret", **_pool_option(slots))


def mamba2_replay_verify(state: Mamba2ReplayState, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True,
                         dt_limit=(0.0, INF), *, tree=None, dt_offset: int | None = None,
                         backend: str | None = None, config: KernelConfig | None = None, slots=None):
    """Verify a window of W speculative steps of a Mamba-2 layer (ARCHITECTURE.md, "The verify window").

    Writes the W records after each row's cursor (flushing first the rows
    that lack room) and returns the W outputs; neither the cursor nor the
    checkpoint moves until :func:`replay_commit` accepts some of the steps.
    Math: :func:`replayssm_jax.reference.mamba2_replay_verify`.

    Args:
      state: Mamba2ReplayState with no pending window.
      x: [batch, W, nheads, head_dim], 1 <= W <= L; dt: [batch, W, nheads]
        (raw); B, C: [batch, W, n_groups, d_state]; z: optional like x;
        A, D, dt_bias, dt_softplus, dt_limit: as :func:`mamba2_step`.
      dt_offset: as :func:`mamba2_step` (dt then [batch, W, X]).
      tree: None (a chain window) or a
        :class:`~replayssm_jax.speculative.tree.DraftTree` of W nodes (tree
        speculation: node t reads its ancestors' steps only; a chain tree
        runs the chain's code).
      backend, config, slots: see the module docstring (a kernel op; config a
        :class:`~replayssm_jax.kernels.ReplayConfig`; with slots, `state` is a
        pool of capacity slots and the window's early flush, records and
        cursors touch the batch's slots only).

    Returns:
      (y [batch, W, nheads, head_dim] in x.dtype, new state with window = W):
      y[:, t] is the output of step t assuming steps 0..t-1 of the window
      (of a tree: t's ancestors) are accepted.
      The state records the tree's parents (`state.tree`; None for a
      chain), which :func:`replay_commit` checks its `path` against.

    Raises:
      TypeError, ValueError, RuntimeError: as :func:`mamba2_replay_step`, and
        W outside [1, L], a `tree` that is not a DraftTree of W nodes; on the
        kernel backends the kernels' limits
        (:func:`replayssm_jax.kernels.mamba2_replay_verify`).
    """
    dt_offset = val.check_dt_offset_value(dt_offset)
    dt_softplus, dt_limit, slots = val.check_mamba2_replay_verify(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus,
                                                                  dt_limit, tree, slots, dt_offset)
    chosen = choose_backend("mamba2_replay_verify", backend, config)
    if chosen == "xla":
        return _with_tree(_on_slots(lambda s: reference.mamba2_replay_verify(
            s, x, dt, A, B, C, D, z, dt_bias, dt_softplus, dt_limit, tree, dt_offset=dt_offset), state, slots), tree)
    return _with_tree(kernels.mamba2_replay_verify(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=dt_softplus,
                                                   dt_limit=dt_limit, dt_offset=dt_offset, tree=tree, config=config,
                                                   interpret=chosen == "interpret", **_pool_option(slots)), tree)


def mamba2_replay_materialize(state: Mamba2ReplayState, A, *, backend: str | None = None,
                              config: KernelConfig | None = None) -> jax.Array:
    """The current full SSM state from checkpoint plus buffer,
    S = exp(G) S_c + sum_i w_i (dt_i x_i) B_i^T over the live slots (ARCHITECTURE.md,
    "The math"; :func:`replayssm_jax.reference.mamba2_replay_materialize`).

    Args:
      state: a Mamba2ReplayState; A: f32[nheads], negative.
      backend, config: see the module docstring; this op has no kernel.

    Returns:
      f32[batch, nheads, head_dim, d_state]: the state after `cursor` buffered
      steps, equal to the state a standard decode would hold now. With a
      pending verify window: the state at the window's start.

    Raises:
      TypeError, ValueError: a malformed state, a wrong shape or dtype of
        `A`, or a concrete `A` with an entry >= 0.
      NotImplementedError: backend "pallas" or "interpret".
    """
    val.check_mamba2_replay_materialize(state, A)
    choose_backend("mamba2_replay_materialize", backend, config)
    return reference.mamba2_replay_materialize(state, A)


def mamba2_replay_flush(state: Mamba2ReplayState, A, *, backend: str | None = None,
                        config: KernelConfig | None = None) -> Mamba2ReplayState:
    """Write the materialised state of every row as its checkpoint; cursor <- 0.

    Use it to hand a replay state to code that reads only the checkpoint
    (e.g. a standard decode step or a cache export); decoding itself
    flushes a row when its buffer fills. Math:
    :func:`replayssm_jax.reference.mamba2_replay_flush` (with
    :func:`mamba2_replay_materialize`).

    Args:
      state: a Mamba2ReplayState without a pending verify window.
      A: f32[nheads], negative (A = -exp(A_log)).
      backend, config: see the module docstring; this op has no kernel.

    Returns:
      Mamba2ReplayState: checkpoint = the materialised state (in the
      checkpoint's dtype), cursor 0 in every row; the buffers keep their
      contents (dead slots, never read).

    Raises:
      TypeError, ValueError: as :func:`mamba2_replay_materialize`, or a
        pending verify window.
      NotImplementedError: backend "pallas" or "interpret".
    """
    val.check_mamba2_replay_flush(state, A)
    choose_backend("mamba2_replay_flush", backend, config)
    return reference.mamba2_replay_flush(state, A)


# --------------------------------------------------------------------------
# Gated DeltaNet


def gdn_step(state, q, k, v, g=None, beta=None, scale=None, use_qk_l2norm=True, *, a=None, b=None, A_log=None,
             dt_bias=None, backend: str | None = None, config: KernelConfig | None = None, slots=None):
    """One standard Gated DeltaNet decode step (the gated delta rule).

    Per value head h with key head h // (HV // H): q, k <- l2norm(q, k) (if
    use_qk_l2norm), S <- exp(g) S, d = beta (v - S k), S <- S + d k^T,
    o = S (scale q) (Yang, Kautz & Hatamizadeh, ICLR 2025; FLA's
    `fused_recurrent_gated_delta_rule`; :func:`replayssm_jax.reference.gdn_step`).

    Args:
      state: f32 | bf16[batch, HV, V, K], value-major recurrent state
        (transformers' cache is [batch, HV, K, V]: transpose it).
      q, k: [batch, H, K], query and key (before L2 norm); H divides HV.
      v: [batch, HV, V], value.
      g: [batch, HV], log decay <= 0 (g = -exp(A_log) * softplus(a + dt_bias)).
      beta: [batch, HV], write strength in [0, 2]: sigmoid(b) in (0, 1), or
        2 sigmoid(b) with negative eigenvalues (outside [0, 2], I - beta k k^T
        amplifies the state along a unit k: ValueError where concrete).
      a, b, A_log, dt_bias: the raw gates, in place of g and beta: a, b
        [batch, HV] the layer's projections (any float dtype but float16),
        A_log, dt_bias [HV] its parameters; g = -exp(A_log) softplus(a +
        dt_bias) and beta = sigmoid(b) are formed in float32 inside the
        kernels (:func:`replayssm_jax.reference.gdn_gates` on "xla"), as the
        original ReplaySSM and vLLM's fused GDN kernels do: no XLA launch
        for them in a decode step.
      scale: query scale, a finite real number (a concrete scalar) or None
        for K ** -0.5.
      use_qk_l2norm: bool, L2-normalise q and k over K (eps 1e-6), as the models do.
      backend, config, slots: see the module docstring (a kernel op; with
        slots, `state` is a pool [capacity, HV, V, K]).

    Returns:
      (o [batch, HV, V] in v.dtype, new_state in state.dtype); the kernels
      update the state in place.

    Raises:
      TypeError: a non-floating argument, a state that is not f32 / bf16, a
        bad scale or use_qk_l2norm, or a `config` on "xla"; gates other than
        one whole form (g and beta, or a, b, A_log and dt_bias).
      ValueError: a shape mismatch (a state in transformers' [batch, HV, K,
        V] layout, K != V, is named as such), HV not divisible by H, an
        unknown backend; on the kernel backends also the kernels' limits
        (:func:`replayssm_jax.kernels.gdn_step`).
      RuntimeError: backend "pallas" without a GPU.
      ValueError: `slots` not of shape [batch], a concrete slot outside
        [-1, capacity) or used twice;
        TypeError: `slots` not integers.
    """
    gates = val.GDNGates(g, beta, a, b, A_log, dt_bias)
    state, scale, use_qk_l2norm, slots = val.check_gdn_step(state, q, k, v, gates, scale, use_qk_l2norm, slots)
    chosen = choose_backend("gdn_step", backend, config)
    if chosen == "xla":
        return _on_slots(lambda s: reference.gdn_step(s, q, k, v, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                                      **gates.keywords()), state, slots)
    return kernels.gdn_step(state, q, k, v, **gates.keywords(), scale=scale, use_qk_l2norm=use_qk_l2norm,
                            config=config, interpret=chosen == "interpret", **_pool_option(slots))


def gdn_conv_step(state, x, columns, start, weight, g=None, beta=None, scale=None, use_qk_l2norm=True, *,
                  num_k_heads: int, a=None, b=None, A_log=None, dt_bias=None, activation: str = "silu",
                  backend: str | None = None, config: kernels.StepConfig | None = None):
    """A Gated DeltaNet layer's decode step from its conv input: the short conv, then the standard step.

    (q, k, v) = act(conv(x)) as :func:`conv_update` (no bias), cut at H K
    and 2 H K, then :func:`gdn_step`
    (:func:`replayssm_jax.reference.gdn_conv_step`). The kernel backends run both
    in one launch (:func:`replayssm_jax.kernels.gdn_conv_step`: q, k and v
    formed in the step's programs, never stored); "xla" runs the two
    references.

    Args:
      state: f32 | bf16[batch, HV, V, K], value-major.
      x: [batch, C], the conv's new inputs [q; k; v] (C = 2 H K + HV V),
        bf16 or f32.
      num_k_heads: H, the key heads (a positive int dividing HV). A state
        in transformers' [batch, HV, K, V] layout is then refused by name
        (K != V), except where HV = 2 H: there C reads the same in both
        layouts, and the state must be value-major as stated.
      columns, start, weight, activation: the conv's ring [batch, S, C],
        i32[batch] oldest live slots in [0, S) and weight [C, W], as
        :func:`conv_update` (S >= W).
      g, beta, a, b, A_log, dt_bias, scale, use_qk_l2norm: as :func:`gdn_step`.
      backend, config: as every op (module docstring; a StepConfig).

    Returns:
      (o [batch, HV, V] in x.dtype, new state, the ring with x written at
      slot (start + W - 1) mod S); the kernels update state and ring in
      place. start is the caller's to move (`ConvWindow.advance`).

    Raises:
      TypeError, ValueError: as :func:`conv_update` and :func:`gdn_step`; x
        not of C = 2 H K + HV V channels (a state in transformers' [batch,
        HV, K, V] layout named as such), num_k_heads not dividing HV; on the
        kernel backends, an activation the kernel does not compute, or a K
        or tiling the fused launch does not take
        (:func:`replayssm_jax.kernels.conv_step_fits`: K a power of two,
        `config.block_v` dividing V and 2 H K; None picks such a tiling).
      RuntimeError: backend "pallas" without a GPU.
    """
    gates = val.GDNGates(g, beta, a, b, A_log, dt_bias)
    state, x, columns, start, weight, scale, use_qk_l2norm = val.check_gdn_conv_step(
        state, x, columns, start, weight, gates, scale, use_qk_l2norm, activation, reference.conv.ACTIVATIONS,
        num_k_heads)
    chosen = choose_backend("gdn_conv_step", backend, config)
    if chosen == "xla":
        return reference.gdn_conv_step(state, x, columns, start, weight, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                       num_k_heads=num_k_heads, activation=activation, **gates.keywords())
    if activation not in kernels.CONV_ACTIVATIONS:
        raise ValueError(f"`activation` {activation!r}: the conv kernel computes {', '.join(kernels.CONV_ACTIVATIONS)}"
                         " (use backend='xla')")
    return kernels.gdn_conv_step(state, x, columns, start, weight, **gates.keywords(), scale=scale,
                                 use_qk_l2norm=use_qk_l2norm, activation=activation, config=config,
                                 interpret=chosen == "interpret")


def gdn_verify(state, index, q, k, v, g=None, beta=None, scale=None, use_qk_l2norm=True, *, a=None, b=None,
               A_log=None, dt_bias=None, tree=None, backend: str | None = None, config: KernelConfig | None = None,
               slots=None):
    """The per-draft standard verify of W speculative Gated DeltaNet steps: one state per draft position.

    As :func:`mamba2_verify`, with :func:`gdn_step` for the step (vLLM's
    fused_recurrent_gated_delta_rule with per-draft state indices). Math:
    :func:`replayssm_jax.reference.gdn_verify`.

    Args:
      state: f32 | bf16[batch, slots, HV, V, K], value-major.
      index: int[batch] in 0..slots - 1, each row's slot of the current state.
      q, k: [batch, W, H, K]; v: [batch, W, HV, V]; g, beta (or a, b):
      [batch, W, HV]; A_log, dt_bias, scale, use_qk_l2norm: as :func:`gdn_step`.
      1 <= W <= slots - 1.
      tree: None (a chain) or a DraftTree of W nodes (static).
      backend, config, slots: see the module docstring (a kernel op; config a
        StepConfig; with slots, as :func:`mamba2_verify`).

    Returns:
      (o [batch, W, HV, V] in v.dtype, the new state, the W states at their
      slots).

    Raises:
      TypeError, ValueError, RuntimeError: as :func:`mamba2_verify`, for
        the arguments of :func:`gdn_step`.
    """
    gates = val.GDNGates(g, beta, a, b, A_log, dt_bias)
    state, index, scale, use_qk_l2norm, slots = val.check_gdn_verify(state, index, q, k, v, gates, scale,
                                                                     use_qk_l2norm, tree, slots)
    chosen = choose_backend("gdn_verify", backend, config)
    if chosen == "xla":
        rows_index = index if slots is None else take_slots(index, slots)
        return _on_slots(lambda s: reference.gdn_verify(s, rows_index, q, k, v, scale=scale,
                                                        use_qk_l2norm=use_qk_l2norm, tree=tree, **gates.keywords()),
                         state, slots)
    return kernels.gdn_verify(state, index, q, k, v, **gates.keywords(), scale=scale, use_qk_l2norm=use_qk_l2norm,
                              tree=tree, config=config, interpret=chosen == "interpret", **_pool_option(slots))


def gdn_chunked(state, q, k, v, g=None, beta=None, scale=None, use_qk_l2norm=True, chunk_size=64, *, a=None,
                b=None, A_log=None, dt_bias=None, backend: str | None = None, config: KernelConfig | None = None):
    """T Gated DeltaNet steps in the chunk-parallel WY / UT-transform form.

    Each chunk's update vectors are solved in closed form, D = (I + A)^-1 R
    by forward substitution (FLA's chunked gated delta rule;
    :func:`replayssm_jax.reference.gdn_chunked`). Equal to seqlen
    :func:`gdn_step` calls up to float32 rounding.

    Args:
      state: None (zeros) or f32 | bf16[batch, HV, V, K].
      q, k: [batch, seqlen, H, K]; v: [batch, seqlen, HV, V];
      g, beta (or a, b): [batch, seqlen, HV]; A_log, dt_bias, scale,
      use_qk_l2norm: as :func:`gdn_step`.
      chunk_size: steps per chunk (an int >= 1; need not divide seqlen).
      backend, config: see the module docstring; this op has no kernel, so
        "pallas", "interpret" and a config raise.

    Returns:
      (o [batch, seqlen, HV, V] in v.dtype, final state in state.dtype, or
      float32 if state is None).

    Raises:
      TypeError, ValueError: as :func:`gdn_step`; also chunk_size < 1.
      NotImplementedError: backend "pallas" or "interpret".
    """
    gates = val.GDNGates(g, beta, a, b, A_log, dt_bias)
    state, scale, use_qk_l2norm, chunk_size = val.check_gdn_chunked(state, q, k, v, gates, scale, use_qk_l2norm,
                                                                    chunk_size)
    choose_backend("gdn_chunked", backend, config)
    return reference.gdn_chunked(state, q, k, v, scale=scale, use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                                 **gates.keywords())


def gdn_replay_step(state: GDNReplayState, q, k, v, g=None, beta=None, scale=None, use_qk_l2norm=True,
                    route: str = "output", *, a=None, b=None, A_log=None, dt_bias=None, backend: str | None = None,
                    config: KernelConfig | None = None, slots=None):
    """One ReplaySSM decode step of a Gated DeltaNet layer (ARCHITECTURE.md, "The math").

    Forms the delta-rule update vector d from one read of the checkpoint
    plus the buffer, appends the record (d, k, g) at each row's cursor,
    reads o the same way, and flushes the rows whose buffer it fills, as the
    reference does (:func:`replayssm_jax.reference.gdn_replay_step`, which
    gives the math).

    Args:
      state: GDNReplayState with no pending verify window.
      q, k, v, g, beta, scale, use_qk_l2norm: as :func:`gdn_step`; q and k
        with the state's H.
      a, b, A_log, dt_bias: the raw gates in place of g and beta, as
        :func:`gdn_step` (formed inside the kernels).
      route: "output", "state", "direct", "deferred", "auto" or "append",
        as :func:`mamba2_replay_step`.
      backend, config, slots: see the module docstring (a kernel op; with
        slots, `state` is a pool of capacity slots).

    Returns:
      (o [batch, HV, V] in v.dtype, new GDNReplayState); o equals
      :func:`gdn_step`'s output on the same step sequence.

    Raises:
      TypeError, ValueError, RuntimeError: as :func:`gdn_step`; also a
        malformed state (a checkpoint in transformers' layout is named as
        such), a pending verify window, an unknown route, or q / k with
        another H than the state's; on the kernel backends the kernels'
        limits (:func:`replayssm_jax.kernels.gdn_replay_step`); route
        "append" on a full row, as :func:`mamba2_replay_step`.
      ValueError: `slots` not of shape [batch], a concrete slot outside
        [-1, capacity) or used twice;
        TypeError: `slots` not integers.
    """
    gates = val.GDNGates(g, beta, a, b, A_log, dt_bias)
    scale, use_qk_l2norm, slots = val.check_gdn_replay_step(state, q, k, v, gates, scale, use_qk_l2norm, slots)
    chosen = choose_backend("gdn_replay_step", backend, config)
    route = resolve_route(route, chosen, _rows_shape(state, slots), config, pool=slots is not None)
    _warn_direct_8bit(state, route)
    _check_append(state, route, slots)
    if chosen == "xla":
        return _on_slots(lambda s: reference.gdn_replay_step(s, q, k, v, scale=scale, use_qk_l2norm=use_qk_l2norm,
                                                             route=route, **gates.keywords()), state, slots)
    return kernels.gdn_replay_step(state, q, k, v, **gates.keywords(), scale=scale, use_qk_l2norm=use_qk_l2norm,
                                   route=route, config=config, interpret=chosen == "interpret", **_pool_option(slots))


def gdn_replay_verify(state: GDNReplayState, q, k, v, g=None, beta=None, scale=None, use_qk_l2norm=True, *, a=None,
                      b=None, A_log=None, dt_bias=None, tree=None, backend: str | None = None,
                      config: KernelConfig | None = None, slots=None):
    """Verify a window of W speculative steps of a Gated DeltaNet layer (ARCHITECTURE.md, "The verify window").

    As :func:`mamba2_replay_verify`; the window's update vectors, which
    depend on one another, are solved in closed form as one chunk of the
    chunked delta rule by the reference
    (:func:`replayssm_jax.reference.gdn_replay_verify`), step by step from
    the window's start state by the kernels
    (:func:`replayssm_jax.kernels.gdn_replay_verify`).

    Args:
      state: GDNReplayState with no pending window.
      q, k: [batch, W, H, K]; v: [batch, W, HV, V], 1 <= W <= L;
      g, beta (or a, b): [batch, W, HV]; A_log, dt_bias, scale,
      use_qk_l2norm: as :func:`gdn_step`.
      tree: as :func:`mamba2_replay_verify` (node t's update vector from the
        delta rule along its path root .. t).
      backend, config, slots: see the module docstring (a kernel op; config a
        :class:`~replayssm_jax.kernels.ReplayConfig`; with slots, as
        :func:`mamba2_replay_verify`).

    Returns:
      (o [batch, W, HV, V] in v.dtype, new state with window = W): o[:, t]
      is the output of step t assuming steps 0..t-1 of the window (of a
      tree: t's ancestors) are accepted.
      The state records the tree's parents, as :func:`mamba2_replay_verify`.

    Raises:
      TypeError, ValueError, RuntimeError: as :func:`gdn_replay_step`, and
        W outside [1, L], a `tree` that is not a DraftTree of W nodes; on the
        kernel backends the kernels' limits
        (:func:`replayssm_jax.kernels.gdn_replay_verify`).
    """
    gates = val.GDNGates(g, beta, a, b, A_log, dt_bias)
    scale, use_qk_l2norm, slots = val.check_gdn_replay_verify(state, q, k, v, gates, scale, use_qk_l2norm, tree,
                                                              slots)
    chosen = choose_backend("gdn_replay_verify", backend, config)
    if chosen == "xla":
        return _with_tree(_on_slots(lambda s: reference.gdn_replay_verify(
            s, q, k, v, scale=scale, use_qk_l2norm=use_qk_l2norm, tree=tree, **gates.keywords()), state, slots), tree)
    return _with_tree(kernels.gdn_replay_verify(state, q, k, v, **gates.keywords(), scale=scale,
                                                use_qk_l2norm=use_qk_l2norm, tree=tree, config=config,
                                                interpret=chosen == "interpret", **_pool_option(slots)), tree)


def gdn_replay_materialize(state: GDNReplayState, *, backend: str | None = None,
                           config: KernelConfig | None = None) -> jax.Array:
    """The current full state from checkpoint plus buffer,
    S = exp(G) S_c + sum_i w_i d_i k_i^T over the live slots (ARCHITECTURE.md,
    "The math"; :func:`replayssm_jax.reference.gdn_replay_materialize`).

    Args:
      state: a GDNReplayState.
      backend, config: see the module docstring; this op has no kernel.

    Returns:
      f32[batch, HV, V, K]: the state after `cursor` buffered steps, equal to
      the state a standard decode would hold now. With a pending verify
      window: the state at the window's start.

    Raises:
      TypeError, ValueError: a malformed state.
      NotImplementedError: backend "pallas" or "interpret".
    """
    val.check_gdn_replay_materialize(state)
    choose_backend("gdn_replay_materialize", backend, config)
    return reference.gdn_replay_materialize(state)


def gdn_replay_flush(state: GDNReplayState, *, backend: str | None = None,
                     config: KernelConfig | None = None) -> GDNReplayState:
    """Write the materialised state of every row as its checkpoint; cursor <- 0.

    As :func:`mamba2_replay_flush`, for a Gated DeltaNet layer. Math:
    :func:`replayssm_jax.reference.gdn_replay_flush`.

    Args:
      state: a GDNReplayState without a pending verify window.
      backend, config: see the module docstring; this op has no kernel.

    Returns:
      GDNReplayState: checkpoint = the materialised state (in the
      checkpoint's dtype), cursor 0 in every row; the buffers keep their
      contents (dead slots, never read).

    Raises:
      TypeError, ValueError: a malformed state, or a pending verify window.
      NotImplementedError: backend "pallas" or "interpret".
    """
    val.check_gdn_replay_flush(state)
    choose_backend("gdn_replay_flush", backend, config)
    return reference.gdn_replay_flush(state)
