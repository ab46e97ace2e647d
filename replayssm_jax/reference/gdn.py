"""Pure-JAX reference of the Gated DeltaNet ops: standard step, chunked
prefill, and the ReplaySSM step, verify window, materialisation and flush.

Math: Yang, Kautz & Hatamizadeh, "Gated Delta Networks" (ICLR 2025), in the
convention of flash-linear-attention's `fused_recurrent_gated_delta_rule`
(and Qwen3-Next / Qwen3.5); ReplaySSM per ARCHITECTURE.md, "The math" and "The verify window". Per
value head h with key head h // (HV // H), state S f32[V, K] (value-major):

    q, k  = l2norm(q), l2norm(k)             (eps 1e-6, if use_qk_l2norm)
    S     = exp(g) S
    d     = beta * (v - S k)                  the delta-rule update vector
    S     = S + d k^T
    o     = S (scale * q)                     scale = K ** -0.5 by default

The chunked form solves each chunk's update vectors in closed form (the UT
transform of the WY representation): with cum the within-chunk cumulative
log decay, A_ij = beta_i exp(cum_i - cum_j) (k_i . k_j) for i > j and
R_i = beta_i (v_i - exp(cum_i) S_0 k_i), the update vectors are
D = (I + A)^-1 R, found by unit lower-triangular forward substitution.

All arithmetic is float32; outputs have v's dtype and states keep their dtype.
The arguments are validated by :mod:`replayssm_jax.ops` (its namesakes of
these functions); this module holds the math only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from replayssm_jax.reference import _common as c
from replayssm_jax.reference.conv import conv_update
from replayssm_jax.state import GDNReplayState, as_f32_checkpoint, in_order, step_writes, write_slots

f32 = jnp.float32


def gdn_gates(a, b, A_log, dt_bias):
    """The gates of a Gated DeltaNet step from the layer's raw projections.

    Args:
      a, b: [..., HV], any float dtype (the outputs of in_proj_a and in_proj_b).
      A_log, dt_bias: [HV], the layer's parameters.

    Returns:
      (g, beta), f32[..., HV]: g = -exp(A_log) softplus(a + dt_bias), the
      log decay (<= 0), and beta = sigmoid(b) in (0, 1), as transformers'
      Qwen3NextGatedDeltaNet and vLLM's fused_sigmoid_gating_delta_rule_update
      form them.
    """
    g = -jnp.exp(A_log.astype(f32)) * jax.nn.softplus(a.astype(f32) + dt_bias.astype(f32))
    return g, jax.nn.sigmoid(b.astype(f32))


def _gates_of(g, beta, a, b, A_log, dt_bias):
    """(g, beta) as given, or (A_log given) formed from the raw gates by :func:`gdn_gates`."""
    return (g, beta) if A_log is None else gdn_gates(a, b, A_log, dt_bias)


def _prepare_qk(q, k, scale, use_qk_l2norm):
    """(scaled q, k) in float32, L2-normalised if asked."""
    if use_qk_l2norm:
        q, k = c.l2norm(q), c.l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return q.astype(f32) * scale, k.astype(f32)


def gdn_step(state, q, k, v, g=None, beta=None, scale=None, use_qk_l2norm=True, *, a=None, b=None, A_log=None,
             dt_bias=None):
    """One standard Gated DeltaNet decode step (the gated delta rule).

    Args:
      state: f32 | bf16[batch, HV, V, K], value-major recurrent state.
      q, k: [batch, H, K]; v: [batch, HV, V]; g: [batch, HV], log decay <= 0;
      beta: [batch, HV] in (0, 1); scale: float or None (K ** -0.5);
      use_qk_l2norm: bool; or, in place of g and beta, the raw gates a, b
      [batch, HV] and A_log, dt_bias [HV] (:func:`gdn_gates`; the other
      ops take them too). Their meaning: :func:`replayssm_jax.ops.gdn_step`.

    Returns:
      (o [batch, HV, V] in v.dtype, new_state in state.dtype).
    """
    g, beta = _gates_of(g, beta, a, b, A_log, dt_bias)
    HV = state.shape[1]
    q, k = _prepare_qk(q, k, scale, use_qk_l2norm)
    qh, kh = (c.expand_heads(x, HV, axis=1) for x in (q, k))
    S = state.astype(f32) * jnp.exp(g.astype(f32))[..., None, None]
    d = beta.astype(f32)[..., None] * (v.astype(f32) - c.einsum("bhvk,bhk->bhv", S, kh))
    S = S + d[..., None] * kh[:, :, None, :]
    o = c.einsum("bhvk,bhk->bhv", S, qh)
    return o.astype(v.dtype), S.astype(state.dtype)


def gdn_conv_step(state, x, columns, start, weight, g=None, beta=None, scale=None, use_qk_l2norm=True, *,
                  num_k_heads, a=None, b=None, A_log=None, dt_bias=None, activation="silu"):
    """A Gated DeltaNet layer's decode step from its conv input: :func:`conv_update` (no bias) of x [batch,
    C = 2 H K + HV V] (H = num_k_heads), its output cut into q [batch, H, K], k and v [batch, HV, V], then
    :func:`gdn_step`. Their meaning: :func:`replayssm_jax.ops.gdn_conv_step`.

    Returns:
      (o [batch, HV, V] in x.dtype, new_state in state.dtype, the ring with x written).
    """
    batch, HV, V, K = state.shape
    H = num_k_heads
    (q, k, v), columns = conv_update(x, columns, start, weight, None, activation, 0, (H * K, 2 * H * K))
    o, state = gdn_step(state, q.reshape(batch, H, K), k.reshape(batch, H, K), v.reshape(batch, HV, V), g, beta,
                        scale, use_qk_l2norm, a=a, b=b, A_log=A_log, dt_bias=dt_bias)
    return o, state, columns


def gdn_verify(state, index, q, k, v, g=None, beta=None, scale=None, use_qk_l2norm=True, *, a=None, b=None,
               A_log=None, dt_bias=None, tree=None):
    """The per-draft standard verify of W speculative Gated DeltaNet steps (one state per draft position).

    Step t (of a tree: node t) is :func:`gdn_step` from the state of step
    t - 1 (of node t's parent; step 0 and the root: the row's current
    state, slot index), in float32; its state is stored, in the state's
    dtype, at slot (index + 1 + t) mod slots
    (:func:`replayssm_jax.reference._common.draft_slots`), as
    :func:`replayssm_jax.reference.mamba2_verify`.

    Args:
      state: f32 | bf16[batch, slots, HV, V, K]; index: i32[batch] in
        0..slots - 1, the slot of each row's state.
      q, k: [batch, W, H, K]; v: [batch, W, HV, V]; g, beta: [batch, W, HV];
      scale, use_qk_l2norm: as :func:`gdn_step`.
      tree: None (a chain) or a DraftTree of W nodes.

    Returns:
      (o [batch, W, HV, V] in v.dtype, the new slotted state).
    """
    g, beta = _gates_of(g, beta, a, b, A_log, dt_bias)

    def step(S, q, k, v, g, beta):
        return gdn_step(S, q, k, v, g, beta, scale, use_qk_l2norm)

    return c.per_draft_verify(state, index, step, (q, k, v, g, beta), tree)


def gdn_chunk(state, q, k, v, g, beta, ancestors=None):
    """One chunk of T steps from `state`, all in float32.

    With `ancestors` (static bool[T, T] of a draft tree, as
    :func:`replayssm_jax.reference._common.causal_decay`; None: the chain),
    step t follows the steps on its path root .. t only: A_ij is kept for j
    an ancestor of i, and the decays are sums along the path, so the delta
    rule runs along every root-to-node path at once ((I + A) stays unit
    lower triangular: a parent precedes its children).

    Args:
      state: f32[batch, HV, V, K]; q (scaled), k (normalised): [batch, T, HV, K];
      v: [batch, T, HV, V]; g, beta: [batch, T, HV].

    Returns:
      (o f32[batch, T, HV, V], final state f32[batch, HV, V, K],
      d f32[batch, T, HV, V] the update vectors of the T steps). Step t's o
      and d depend on steps 0..t only: from the first step with a
      non-finite k, v, beta or g (other than g = -inf) on, o and d are NaN,
      and so is the final state (:func:`replayssm_jax.reference._common.finite_steps`).
    """
    valid, g, k, v, beta = c.finite_steps(g.astype(f32), k, v.astype(f32), beta.astype(f32), ancestors=ancestors)
    cum, decay = c.causal_decay(g, strict=True, ancestors=ancestors)
    A = c.einsum("bihk,bjhk->bhij", k, k) * decay * jnp.moveaxis(beta, 1, -1)[..., :, None]
    from_state = jnp.exp(cum)[..., None] * c.einsum("bhvk,bihk->bihv", state, k)
    R = jnp.moveaxis(beta[..., None] * (v - from_state), 1, 2)  # [batch, HV, T, V]
    eye = jnp.eye(A.shape[-1], dtype=f32)
    d = solve_triangular(eye + A, R, lower=True, unit_diagonal=True)
    d = jnp.moveaxis(d, 2, 1)
    o, final = c.chunk_readout(state, d, k, q, g, ancestors=ancestors)
    o, final = c.poison_invalid(valid, o, final)
    return o, final, jnp.where(valid[..., None], d, jnp.nan)


def gdn_chunked(state, q, k, v, g=None, beta=None, scale=None, use_qk_l2norm=True, chunk_size=64, *, a=None, b=None,
                A_log=None, dt_bias=None):
    """T Gated DeltaNet steps in the chunk-parallel WY / UT-transform form.

    Args:
      state: None (zeros) or f32 | bf16[batch, HV, V, K].
      q, k: [batch, seqlen, H, K]; v: [batch, seqlen, HV, V];
      g, beta: [batch, seqlen, HV]; scale, use_qk_l2norm: as :func:`gdn_step`.
      chunk_size: steps per chunk (an int >= 1; need not divide seqlen).

    Returns:
      (o [batch, seqlen, HV, V] in v.dtype, final state in state.dtype, or
      float32 if state is None).
    """
    g, beta = _gates_of(g, beta, a, b, A_log, dt_bias)
    batch, T, HV, V = v.shape
    if state is None:
        state = jnp.zeros((batch, HV, V, k.shape[-1]), f32)
    q, k = _prepare_qk(q, k, scale, use_qk_l2norm)
    qh, kh = (c.expand_heads(x, HV, axis=2) for x in (q, k))

    def chunk(S, *inputs):
        o, final, _ = gdn_chunk(S, *inputs)
        return o, final

    inputs = (qh, kh, v.astype(f32), g.astype(f32), beta.astype(f32))
    o, final = c.scan_chunks(chunk, state.astype(f32), inputs, chunk_size)
    return o.astype(v.dtype), final.astype(state.dtype)


# --------------------------------------------------------------------------
# ReplaySSM


def unify(state: GDNReplayState) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The buffer in the common (u, k, lg) form: u = d, k per value head, lg = g."""
    HV = state.checkpoint.shape[1]
    return state.d.astype(f32), c.expand_heads(state.k.astype(f32), HV, axis=1), state.g


def gdn_replay_materialize(state: GDNReplayState) -> jax.Array:
    """The state after `cursor` buffered steps, f32[batch, HV, V, K]:
    S = exp(G) S_c + sum_i w_i d_i k_i^T over the live slots (with a pending
    verify window: the state at the window's start). Arguments as
    :func:`replayssm_jax.ops.gdn_replay_materialize`. An 8-bit checkpoint is
    read dequantized.
    """
    state = as_f32_checkpoint(state)
    return c.replay_materialize(state.checkpoint, *unify(state), state.cursor)


def gdn_replay_flush(state: GDNReplayState) -> GDNReplayState:
    """Every row's materialised state written as its checkpoint (in the
    checkpoint's dtype), cursor 0; the buffers keep their contents, now dead
    slots. Arguments as :func:`replayssm_jax.ops.gdn_replay_flush`.
    """
    if state.scale is not None:
        return c.on_f32_checkpoint(state, jnp.ones_like(state.cursor, bool), lambda s: ((), gdn_replay_flush(s)))[1]
    return c.flush_where(state, jnp.ones_like(state.cursor, bool), unify)


def gdn_replay_step(state: GDNReplayState, q, k, v, g=None, beta=None, scale=None, use_qk_l2norm=True,
                    route: str = "output", *, a=None, b=None, A_log=None, dt_bias=None):
    """One ReplaySSM decode step of a Gated DeltaNet layer.

    Per row: form d = beta (v - exp(g) S_prev k), where S_prev k comes from
    one read of the checkpoint plus the buffer; append (d, k, g) at slot
    `cursor`; read o = S q the same way; cursor += 1; if the cursor reaches
    L, flush (checkpoint <- S_L, cursor <- 0), fused into this step. A row
    that enters with a full buffer (cursor == L, only after a commit)
    flushes its L records and this step together (cursor 0 afterwards).

    Args:
      state: GDNReplayState with no pending verify window.
      q, k, v, g, beta, scale, use_qk_l2norm: as :func:`gdn_step`.
      route: "output" computes S_prev k and S_prev q as exp(G) S_c x +
        sum_i w_i (k_i . x) d_i; "state" reads them off S_prev formed in f32
        (the reference forms S_prev in both routes, for the flush). This
        step's own update d k^T enters the output through the unrounded d and
        k, so the routes agree up to float32 rounding also with a bf16 buffer.
        The flushed checkpoint is the buffer materialized: this step's record
        as stored (rounded to the buffer dtype), as any later step would read
        it; a row that entered full, whose record has no slot, adds it
        unrounded. "direct" folds each row's live records into its
        checkpoint and takes a standard step on it, written back at once
        (cursor 0, no record appended); its output is the other routes' up
        to f32 rounding. "append" is the output route without the flush: a
        row that fills its buffer keeps it full (cursor L), and a row that
        entered full gets NaN outputs and its state unchanged.
        "deferred" flushes the rows that entered full first (their L
        records only; :func:`replayssm_jax.reference._common.flush_full`),
        then takes the append route: the same outputs as "output", but a
        row that fills its buffer keeps it full (cursor L) until its next
        step. ("auto" is resolved by
        :func:`replayssm_jax.ops.gdn_replay_step`.)

    Returns:
      (o [batch, HV, V] in v.dtype, new GDNReplayState); o equals
      :func:`gdn_step`'s output on the same step sequence. An 8-bit
      checkpoint is read dequantized and written quantized once per write
      (:func:`replayssm_jax.reference._common.on_f32_checkpoint`), a
      bfloat16 one rounded once per step (`on_widened_checkpoint`).
    """
    g, beta = _gates_of(g, beta, a, b, A_log, dt_bias)
    if route == "deferred":  # the full rows flush first; the append route then finds a free slot in every row
        return gdn_replay_step(c.flush_full(state, unify), q, k, v, g, beta, scale, use_qk_l2norm, "append")
    if state.scale is not None:
        return c.on_f32_checkpoint(state, step_writes(state, route), lambda s: gdn_replay_step(
            s, q, k, v, g, beta, scale, use_qk_l2norm, route))
    if state.checkpoint.dtype != f32:  # bfloat16: written once per step, as the kernels write it
        return c.on_widened_checkpoint(state, lambda s: gdn_replay_step(
            s, q, k, v, g, beta, scale, use_qk_l2norm, route))
    if route == "direct":
        return c.direct_step(state, unify, lambda S: gdn_step(S, q, k, v, g, beta, scale, use_qk_l2norm))
    HV = state.checkpoint.shape[1]
    entered_full = state.cursor == state.buffer_len
    before = state
    state = c.make_room(state, 1, unify)
    q, k = _prepare_qk(q, k, scale, use_qk_l2norm)
    qh, kh = (c.expand_heads(x, HV, axis=1) for x in (q, k))
    g = g.astype(f32)
    buffered = (state.checkpoint, *unify(state), state.cursor)  # S_{j-1} = checkpoint + buffer
    prev = c.replay_materialize(*buffered)  # f32, formed for the flush
    prev_k, prev_q = (c.READOUTS[route](*buffered, x) for x in (kh, qh))
    decay = jnp.exp(g)[..., None]
    d = beta.astype(f32)[..., None] * (v.astype(f32) - decay * prev_k)
    # o = S_j q with S_j = exp(g) S_{j-1} + d k^T; this step enters through the
    # unrounded d and k (the buffer may round them to bf16 for later steps).
    o = decay * prev_q + jnp.sum(kh * qh, axis=-1, keepdims=True) * d
    flush = ((state.cursor + 1 == state.buffer_len) | entered_full) & (route != "append")
    as_stored = lambda x, dtype: jnp.where(entered_full[:, None, None], x, x.astype(dtype).astype(f32))  # noqa: E731
    S = decay[..., None] * prev + as_stored(d, state.d.dtype)[..., None] * as_stored(kh, state.k.dtype)[:, :, None, :]
    state, (o, S, flush, d, k, g) = in_order(state, (o, S, flush, d, k, g))
    buffers = state.replace(
        checkpoint=jnp.where(flush[:, None, None, None], S.astype(state.checkpoint.dtype), state.checkpoint),
        d=write_slots(state.d, d[:, :, None], state.cursor),
        k=write_slots(state.k, k[:, :, None], state.cursor),
        g=write_slots(state.g, g[:, :, None], state.cursor),
    )
    buffers, flush = in_order(buffers, flush)
    buffers = buffers.replace(cursor=jnp.where(flush, 0, buffers.cursor + 1))
    if route == "append":
        o, buffers = c.refuse_full_rows(entered_full, before, o, buffers)
    return o.astype(v.dtype), buffers


def gdn_replay_verify(state: GDNReplayState, q, k, v, g=None, beta=None, scale=None, use_qk_l2norm=True, *, a=None,
                      b=None, A_log=None, dt_bias=None, tree=None):
    """Verify a window of W speculative steps (ARCHITECTURE.md, "The verify window"), or a draft tree of W nodes.

    Rows with cursor + W > L flush first. The window's update vectors depend
    on one another (each d_t sees the state after the earlier draft steps);
    they are solved in closed form from the state at the window start
    (checkpoint plus buffer), as one chunk of the chunked delta rule. The W
    records (d, k, g) are written at slots cursor .. cursor + W - 1; the
    cursor and the checkpoint are not moved. Follow with
    :func:`replayssm_jax.state.replay_commit`.

    Args:
      state: GDNReplayState with no pending window.
      q, k: [batch, W, H, K]; v: [batch, W, HV, V]; g, beta: [batch, W, HV];
      scale, use_qk_l2norm: as :func:`gdn_step`. 1 <= W <= L.
      tree: None or a chain (the window), or a
        :class:`~replayssm_jax.speculative.tree.DraftTree` of W nodes: node
        t follows its parent, and its output reads the state at the
        window's start and the nodes on its path root .. t only (the delta
        rule along that path); the W records still go to slots cursor ..
        cursor + W - 1 in node order.

    Returns:
      (o [batch, W, HV, V] in v.dtype, new state with window = W): o[:, t]
      is the output of step t assuming steps 0..t-1 of the window (of a
      tree: t's ancestors) are accepted.
      It depends on those steps only: a NaN or inf in a later draft (a
      padded or garbage draft) cannot reach it; from the first draft with a
      non-finite input that enters the state on, the outputs are NaN.
    """
    g, beta = _gates_of(g, beta, a, b, A_log, dt_bias)
    W = v.shape[1]
    if state.scale is not None:
        state = c.early_flush_8bit(state, W, unify)
        return c.reading_f32_checkpoint(state, lambda s: gdn_replay_verify(s, q, k, v, g, beta, scale,
                                                                           use_qk_l2norm, tree=tree))
    HV = state.checkpoint.shape[1]
    state = c.make_room(state, W, unify)
    start = c.replay_materialize(state.checkpoint, *unify(state), state.cursor)
    q, k = _prepare_qk(q, k, scale, use_qk_l2norm)
    qh, kh = (c.expand_heads(x, HV, axis=2) for x in (q, k))
    o, _, d = gdn_chunk(start, qh, kh, v, g, beta, ancestors=c.tree_ancestors(tree))
    state, (o, d) = in_order(state, (o, d))  # the buffers are read before the window is written
    state = state.replace(
        d=write_slots(state.d, jnp.swapaxes(d, 1, 2), state.cursor),
        k=write_slots(state.k, jnp.swapaxes(k, 1, 2), state.cursor),
        g=write_slots(state.g, jnp.swapaxes(g.astype(f32), 1, 2), state.cursor),
        window=W,
    )
    return o.astype(v.dtype), state
