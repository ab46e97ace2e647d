"""Math shared by the Mamba-2 and Gated DeltaNet references.

Both layers are instances of one recurrence per head (ARCHITECTURE.md, "The math"):

    S_t = exp(lg_t) S_{t-1} + u_t k_t^T,    y_t = S_t q_t,

S f32[V, K], u f32[V], k, q f32[K], lg a log decay <= 0. The functions below
compute it three ways: over the L slots of a ReplaySSM buffer (readout and
materialisation from a checkpoint), and over a chunk of T steps at once
(the quadratic "attention" form of the SSD paper, used by the chunked
prefill and by the verify window). Everything is float32.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax.state import as_f32_checkpoint, in_order, slot_mask, window_writes, write_checkpoint

f32 = jnp.float32

# The reference is the ground truth: its contractions run in full float32 on
# every platform (no TF32 on a GPU).
einsum = functools.partial(jnp.einsum, precision=jax.lax.Precision.HIGHEST)


def expand_heads(x: jax.Array, nheads: int, axis: int) -> jax.Array:
    """Repeat grouped heads along `axis` so that head h reads group h // (nheads // ngroups)."""
    return jnp.repeat(x, nheads // x.shape[axis], axis=axis)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps) over the last axis, as Qwen3-Next / FLA normalise q and k."""
    x = x.astype(f32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def replay_weights(lg: jax.Array, count: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Decay weights of the live buffer slots.

    Args:
      lg: f32[batch, heads, L], log decay of each slot.
      count: i32[batch], live slots per row (slots 0..count-1).

    Returns:
      (G f32[batch, heads], w f32[batch, heads, L]): G = total log decay of the
      live slots, w_i = exp(sum of lg_j over the live slots j > i) for live
      slots i and 0 for dead ones. The exponent is a suffix sum, not G - G_i
      (G_i the prefix sum up to slot i): the difference cancels, to NaN once
      a slot's decay is -inf (g = -inf is allowed) and to lost digits after
      a large one.
    """
    live = slot_mask(count, lg.shape[-1])[:, None, :]
    lg = jnp.where(live, lg, 0.0)
    through = jnp.cumsum(lg[..., ::-1], axis=-1)[..., ::-1]  # sum over slots j >= i
    after = jnp.concatenate([through[..., 1:], jnp.zeros_like(through[..., :1])], axis=-1)
    w = jnp.where(live, jnp.exp(after), 0.0)
    return through[..., 0], w


def live_records(u, k, count):
    """u and k with the dead slots (>= count) zeroed, as float32, so that a
    rejected draft's record (possibly inf or NaN) cannot leak into a sum."""
    live = slot_mask(count, u.shape[2])[:, None, :, None]
    return jnp.where(live, u.astype(f32), 0.0), jnp.where(live, k.astype(f32), 0.0)


def replay_readout(checkpoint, u, k, lg, count, q) -> jax.Array:
    """y = S_count q from the checkpoint and the buffer, without forming S.

    y = exp(G) (S_c q) + sum_i w_i (k_i . q) u_i   (the output-only route).

    Args:
      checkpoint: f32[batch, heads, V, K]; u: [batch, heads, L, V];
      k: [batch, heads, L, K]; lg: f32[batch, heads, L]; count: i32[batch];
      q: [batch, heads, K].

    Returns:
      f32[batch, heads, V].
    """
    total, w = replay_weights(lg, count)
    u, k = live_records(u, k, count)
    from_checkpoint = einsum("bhvk,bhk->bhv", checkpoint.astype(f32), q.astype(f32))
    scores = w * einsum("bhlk,bhk->bhl", k, q.astype(f32))
    return jnp.exp(total)[..., None] * from_checkpoint + einsum("bhl,bhlv->bhv", scores, u)


def replay_materialize(checkpoint, u, k, lg, count) -> jax.Array:
    """S_count = exp(G) S_c + sum_i w_i u_i k_i^T, f32[batch, heads, V, K]."""
    total, w = replay_weights(lg, count)
    u, k = live_records(u, k, count)
    update = einsum("bhl,bhlv,bhlk->bhvk", w, u, k)
    return jnp.exp(total)[..., None, None] * checkpoint.astype(f32) + update


def state_readout(checkpoint, u, k, lg, count, q) -> jax.Array:
    """y = S_count q with S_count formed in f32 (the state route); arguments
    and result as :func:`replay_readout`."""
    return einsum("bhvk,bhk->bhv", replay_materialize(checkpoint, u, k, lg, count), q.astype(f32))


# The replay step's readout per route ("direct" takes a standard step instead).
READOUTS = {"output": replay_readout, "state": state_readout, "append": replay_readout}


def causal_decay(lg: jax.Array, strict: bool = False, ancestors=None) -> tuple[jax.Array, jax.Array]:
    """Within-chunk decays from log decays lg f32[batch, T, heads].

    Returns:
      (cum f32[batch, T, heads], decay f32[batch, heads, T, T]) with
      cum_t = lg_0 + ... + lg_t and decay[t, s] = exp(lg_{s+1} + ... + lg_t)
      for s <= t (s < t if strict), exactly 0 elsewhere (selected, not
      multiplied). The exponent is a segment sum of the log decays (as
      mamba_ssm's `ssd_minimal.segsum`), not cum_t - cum_s: the difference
      is inf - inf = NaN once a step has lg = -inf, where the segment sum is
      -inf, an exact zero decay.

    With `ancestors` (static bool[T, T], ancestors[t, s]: step s is on the
    path root .. t of a draft tree, t included; None: the chain), the sums
    run along each step's path instead: cum_t is the sum over the path
    root .. t, decay[t, s] = exp(sum of lg over the path after s up to t)
    for s on t's path (s != t if strict), exactly 0 elsewhere.
    """
    if ancestors is not None:
        return _tree_decay(lg, np.asarray(ancestors, bool), strict)
    c = jnp.moveaxis(lg, 1, -1)  # [batch, heads, T]
    T = c.shape[-1]
    t = jnp.arange(T)
    later = t[:, None] > t[None, :]  # [t, s]: step t after step s
    segment = jnp.cumsum(jnp.where(later, c[..., :, None], 0.0), axis=-2)  # [t, s]: lg_{s+1} + ... + lg_t
    mask = later if strict else later | (t[:, None] == t[None, :])
    return jnp.cumsum(lg, axis=1), jnp.where(mask, jnp.exp(segment), 0.0)


def _tree_decay(lg: jax.Array, ancestors: np.ndarray, strict: bool) -> tuple[jax.Array, jax.Array]:
    """:func:`causal_decay` along the paths of a draft tree (`ancestors` bool[T, T])."""
    c = jnp.moveaxis(lg, 1, -1)  # [batch, heads, T]
    # between[t, s, n]: step n is on t's path after s (s on t's path); a masked sum, never a difference.
    between = ancestors[:, None, :] & ~ancestors[None, :, :] & ancestors[:, :, None]
    segment = jnp.sum(jnp.where(between, c[..., None, None, :], 0.0), axis=-1)  # [batch, heads, t, s]
    cum = jnp.sum(jnp.where(ancestors, c[..., None, :], 0.0), axis=-1)  # [batch, heads, t]
    mask = ancestors & ~np.eye(len(ancestors), dtype=bool) if strict else ancestors
    return jnp.moveaxis(cum, -1, 1), jnp.where(mask, jnp.exp(segment), 0.0)


def tree_ancestors(tree):
    """The ancestor mask bool[N, N] of a draft tree (a
    :class:`~replayssm_jax.speculative.tree.DraftTree`), or None for None and
    for a chain (whose ops run the chain's code)."""
    return None if tree is None or tree.is_chain else tree.ancestors


def finite_steps(lg: jax.Array, *inputs: jax.Array, ancestors=None) -> tuple[jax.Array, ...]:
    """Mask the steps of a chunk from its first non-finite input on.

    Args:
      lg: f32[batch, T, heads], the log decays (-inf, a step that forgets
        the state, is allowed; NaN and +inf are not).
      inputs: the other per-step inputs that enter the state, each
        [batch, T, heads] or [batch, T, heads, n].

    Returns:
      (valid bool[batch, T, heads], lg, *inputs): valid_t is true where
      steps 0..t are all finite; lg and the inputs with every step from the
      first invalid one on replaced by an identity step (zeros, selected
      with `jnp.where`). The chunked forms contract over all steps of a
      chunk at once, where a later step's NaN would reach an earlier output
      through a product by zero; with the identity steps the outputs of the
      valid steps are those of the steps before them alone, and
      :func:`poison_invalid` makes the others NaN.
      With `ancestors` (a draft tree's, as :func:`causal_decay`), valid_t is
      true where the steps on t's path are all finite.
    """
    ok = ~jnp.isnan(lg) & (lg < jnp.inf)
    for x in inputs:
        finite = jnp.isfinite(x)
        ok &= finite if x.ndim == 3 else jnp.all(finite, axis=-1)
    if ancestors is None:
        valid = jnp.cumsum(~ok, axis=1) == 0
    else:  # [batch, t, n, heads]: a non-finite step n on t's path
        valid = ~jnp.any(np.asarray(ancestors, bool)[None, :, :, None] & ~ok[:, None, :, :], axis=2)

    def select(x):
        return jnp.where(valid if x.ndim == 3 else valid[..., None], x, 0.0)

    return (valid, select(lg), *(select(x) for x in inputs))


def poison_invalid(valid: jax.Array, y: jax.Array, final: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(y, final) with NaN at the steps `valid` (bool[batch, T, heads], from
    :func:`finite_steps`) marks invalid, and a NaN final state
    f32[batch, heads, V, K] if the last step is invalid: a non-finite input
    makes the outputs from its step on NaN, as in the per-step recurrence."""
    y = jnp.where(valid[..., None], y, jnp.nan)
    return y, jnp.where(valid[:, -1, :, None, None], final, jnp.nan)


def chunk_readout(state, u, k, q, lg, ancestors=None) -> tuple[jax.Array, jax.Array]:
    """T steps of the recurrence at once from `state` (SSD's quadratic form).

    Args:
      state: f32[batch, heads, V, K] at the chunk start.
      u: [batch, T, heads, V]; k, q: [batch, T, heads, K]; lg: f32[batch, T, heads].

    Returns:
      (y f32[batch, T, heads, V], final state f32[batch, heads, V, K]):
      y_t = exp(cum_t) S q_t + sum_{s <= t} exp(cum_t - cum_s) (k_s . q_t) u_s,
      S_T = exp(cum_T) S + sum_s exp(cum_T - cum_s) u_s k_s^T, the decays
      from :func:`causal_decay`. y_t depends on steps 0..t only, also when
      a later step's u, k or lg is NaN or inf (:func:`finite_steps`); from
      such a step on, y and the final state are NaN.
      With `ancestors` (a draft tree's, as :func:`causal_decay`), the sums
      run along each step's path: y_t reads the steps on t's path only, and
      the final state is the state after the path of step T - 1.
    """
    valid, lg, u, k = finite_steps(lg.astype(f32), u.astype(f32), k.astype(f32), ancestors=ancestors)
    q = q.astype(f32)
    cum, decay = causal_decay(lg, ancestors=ancestors)
    scores = einsum("bthk,bshk->bhts", q, k) * decay
    y = einsum("bhts,bshv->bthv", scores, u)
    y = y + jnp.exp(cum)[..., None] * einsum("bhvk,bthk->bthv", state, q)
    to_end = jnp.moveaxis(decay[..., -1, :], -1, 1)  # [batch, T, heads]: exp(lg_{s+1} + ... + lg_{T-1})
    final = jnp.exp(cum[:, -1])[..., None, None] * state + einsum("bth,bthv,bthk->bhvk", to_end, u, k)
    return poison_invalid(valid, y, final)


def scan_chunks(chunk_fn: Callable, state: jax.Array, inputs: tuple, chunk_size: int):
    """Run `chunk_fn(state, *chunk) -> (y, state)` over the seqlen axis (axis 1).

    The inputs are zero-padded to a multiple of `chunk_size`; a zero step is
    the identity for both layer types once their inputs are processed
    (lg = 0, u = 0 for Mamba-2; beta = 0 for GDN), so padding does not
    change the final state. The scan runs over chunks, not steps.
    """
    T = inputs[0].shape[1]
    n_chunks = -(-T // chunk_size)
    pad = n_chunks * chunk_size - T

    def to_chunks(a):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        a = a.reshape(a.shape[0], n_chunks, chunk_size, *a.shape[2:])
        return jnp.moveaxis(a, 1, 0)

    def body(carry, chunk):
        y, carry = chunk_fn(carry, *chunk)
        return carry, y

    final, ys = jax.lax.scan(body, state, tuple(to_chunks(a) for a in inputs))
    ys = jnp.moveaxis(ys, 0, 1)
    ys = ys.reshape(ys.shape[0], n_chunks * chunk_size, *ys.shape[3:])
    return ys[:, :T], final


def flush_where(state, rows: jax.Array, unify: Callable):
    """Flush the rows where `rows` (bool[batch]) is set.

    Those rows get checkpoint <- S_cursor (cast to the checkpoint dtype) and
    cursor <- 0; the others are unchanged. `unify(state)` returns the
    buffer in the common form (u, k, lg) of :func:`replay_materialize`.
    """
    materialized = replay_materialize(state.checkpoint, *unify(state), state.cursor)
    state, (materialized, rows) = in_order(state, (materialized, rows))  # read before written
    keep = rows[:, None, None, None]
    checkpoint = jnp.where(keep, materialized.astype(state.checkpoint.dtype), state.checkpoint)
    return state.replace(checkpoint=checkpoint, cursor=jnp.where(rows, 0, state.cursor))


def direct_step(state, unify: Callable, step: Callable):
    """The replay step's direct route: each row's live records folded into
    its checkpoint (in f32), then one standard step on it; the result is the
    new checkpoint (in its dtype), cursor 0. The buffers are unchanged.

    `step(S f32[batch, heads, rows, cols]) -> (output, S_new f32)` is the
    layer's standard step; returns (output, new state).
    """
    y, S = step(replay_materialize(state.checkpoint, *unify(state), state.cursor))
    return y, state.replace(checkpoint=S.astype(state.checkpoint.dtype), cursor=jnp.zeros_like(state.cursor))


def refuse_full_rows(entered_full: jax.Array, before, y: jax.Array, after):
    """The append route's result for rows that entered with a full buffer
    (bool[batch] `entered_full`), which have no slot for the step: NaN
    outputs and the state `before` the step; the other rows take `y` and
    `after`. Returns (y, state)."""
    y = jnp.where(entered_full.reshape((-1,) + (1,) * (y.ndim - 1)), jnp.nan, y)
    keep = lambda a, b: jnp.where(entered_full.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)  # noqa: E731
    return y, jax.tree.map(keep, before, after)


def make_room(state, W: int, unify: Callable):
    """The early-flush rule: rows whose buffer cannot take W more steps
    (cursor + W > L) flush first, so that a step or window never overruns."""
    return flush_where(state, state.cursor + W > state.buffer_len, unify)


def flush_full(state, unify: Callable):
    """The deferred route's first launch: the rows whose buffer is full
    (cursor == L) flush (:func:`make_room` for one step), their checkpoint
    stored in its dtype (an 8-bit one quantized, :func:`early_flush_8bit`),
    before the step reads it."""
    return make_room(state, 1, unify) if state.scale is None else early_flush_8bit(state, 1, unify)


def on_f32_checkpoint(state, written: jax.Array, op: Callable):
    """Run `op(state) -> (output, new state)` on a state with an 8-bit checkpoint.

    `op` runs on the checkpoint read as f32 (:func:`replayssm_jax.state.as_f32_checkpoint`),
    every intermediate in f32; then the rows where `written` (bool[batch])
    is set, those whose checkpoint `op` writes, are quantized once
    (:func:`replayssm_jax.state.write_checkpoint`, keyed by their write
    count at entry), and the other rows keep their stored values and scales
    bit for bit. So a step that flushes twice in f32 (a row that entered
    full: the early flush, then this step's) rounds once, as the kernels do.
    """
    output, new = op(as_f32_checkpoint(state))
    stored = write_checkpoint(state, new.checkpoint, written)
    return output, new.replace(checkpoint=stored.checkpoint, scale=stored.scale, counter=stored.counter)



def on_widened_checkpoint(state, op: Callable):
    """Run `op(state) -> (output, new state)` on a state with a bfloat16
    (not float32) checkpoint widened to float32, and narrow the new
    checkpoint back: a step that flushes twice in f32 (a row that entered
    full: the early flush, then this step's) rounds once, as the kernels
    do; the rows it does not write come back bit for bit (bf16 -> f32 ->
    bf16 is exact)."""
    output, new = op(state.replace(checkpoint=state.checkpoint.astype(f32)))
    return output, new.replace(checkpoint=new.checkpoint.astype(state.checkpoint.dtype))


def reading_f32_checkpoint(state, op: Callable):
    """Run `op(state) -> (output, new state)`, which writes no checkpoint row
    (a verify window after its early flush), on a state with an 8-bit
    checkpoint read as f32; the new state keeps the stored checkpoint,
    scales and write counts."""
    output, new = op(as_f32_checkpoint(state))
    return output, new.replace(checkpoint=state.checkpoint, scale=state.scale, counter=state.counter)


def early_flush_8bit(state, W: int, unify: Callable):
    """:func:`make_room` for a verify window of W steps on a state with an
    8-bit checkpoint: the rows with cursor + W > L flush, quantized, before
    the window reads the checkpoint (as the kernels' early flush launch)."""
    return on_f32_checkpoint(state, window_writes(state, W), lambda s: ((), make_room(s, W, unify)))[1]


def draft_slots(index: jax.Array, slots: int, nodes: int) -> jax.Array:
    """i32[batch, nodes]: the state slots that a per-draft verify writes, (index + 1 + t) mod slots for
    node t (index i32[batch]: the slot of the current state, which none of them is while nodes < slots)."""
    return ((index[:, None] + 1 + jnp.arange(nodes, dtype=jnp.int32)[None, :]) % slots).astype(jnp.int32)


def per_draft_verify(state: jax.Array, index: jax.Array, step: Callable, inputs: tuple, tree=None):
    """The standard per-draft verify: W standard steps from the current state, each state kept in a slot.

    Args:
      state: f32 | bf16[batch, slots, heads, V, K], the slotted standard
        state; index: i32[batch], the slot of each row's current state.
      step: step(S f32[batch, heads, V, K], *inputs_t) -> (y_t, S_t f32),
        one standard step of the layer (the reference's, on a float32
        state: the W states are rounded to the state's dtype only where
        stored).
      inputs: the steps' inputs, each [batch, W, ...] or None (passed on
        as None).
      tree: None (a chain: position t steps from position t - 1) or a
        DraftTree of W nodes (node t steps from its parent's state; the
        root from the current state).

    Returns:
      (y [batch, W, ...] stacked from the steps, new state: node t's state
      at slot :func:`draft_slots` [:, t], every other slot as given).
    """
    batch, slots = state.shape[:2]
    rows = jnp.arange(batch)
    current = state[rows, index].astype(f32)
    W = next(a.shape[1] for a in inputs if a is not None)
    parents = range(-1, W - 1) if tree is None else tree.parents
    ys, states = [], []
    for t, parent in enumerate(parents):
        y, S = step(current if parent < 0 else states[parent], *(None if a is None else a[:, t] for a in inputs))
        ys.append(y)
        states.append(S)
    new = state.at[rows[:, None], draft_slots(index, slots, W)].set(jnp.stack(states, axis=1).astype(state.dtype))
    return jnp.stack(ys, axis=1), new
