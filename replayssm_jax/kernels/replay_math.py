"""In-kernel math of the replay: decay weights of the buffered slots, the
rank-L update, and the fold of buffered records into a state tile.

Both layer types run the same per-head recurrence (DESIGN.md section 2)

    S_t = exp(lg_t) S_{t-1} + u_t k_t^T,    y_t = S_t q_t,

with lg_t the step's log decay (Mamba-2: dt A, GDN: g), u_t its update
vector (Mamba-2: dt x, GDN: d) and k_t its key (Mamba-2: B, GDN: k). With
n live records since the checkpoint S_c,

    S_n = exp(sum_i lg_i) S_c + sum_i w_i u_i k_i^T,   w_i = exp(sum_{i < j < n} lg_j).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from replayssm_jax.kernels.config import next_pow2
from replayssm_jax.kernels.tiles import f32, lane_ids, pick_row

# The smallest extent of every dimension of a dot on the Triton lowering.
DOT_MIN = 16


def replay_weights(lg: jax.Array, count) -> tuple[jax.Array, jax.Array]:
    """Decays of the live buffer slots, from the slot log decays.

    Args:
      lg: f32[BL], log decay of each slot (any value in dead slots).
      count: int scalar, live slots 0 .. count - 1.

    Returns:
      (total f32 scalar, w f32[BL]): total = sum of the live lg, and
      w_i = exp(sum_{i < j < count} lg_j) for live i, 0 for dead slots:
      the decay from slot i to the last live slot, formed as a suffix sum
      (no exp(G) / exp(G_i) cancellation).
    """
    BL = lg.shape[0]
    idx = lane_ids(BL)
    live = idx < count
    lg = jnp.where(live, lg, 0.0)
    later = idx[None, :] > idx[:, None]  # [i, j]: j after i
    suffix = jnp.sum(jnp.where(later, lg[None, :], 0.0), axis=1)
    w = jnp.where(live, jnp.exp(suffix), 0.0)
    return jnp.sum(lg), w


def fits_dot(*dims: int) -> bool:
    """Whether a dot with these (power-of-two) dimensions lowers on Triton."""
    return min(dims) >= DOT_MIN


def split_parts(state_dtype) -> int:
    """bf16 parts an operand of the rank-L update is split into: 3 (about 24
    mantissa bits, f32 accuracy) for an f32 state, 2 (about 16 bits, far
    below a bf16 state's own rounding) for a bf16 state."""
    return 3 if jnp.dtype(state_dtype) == jnp.float32 else 2


def dot_precision(state_dtype):
    """The algorithm of the rank-L update's dot for a state of `state_dtype`
    when the buffered keys are f32: both operands split into
    `split_parts` bf16 parts on the tensor cores, f32 accumulation (6
    products for an f32 state, 3 for a bf16 state). On the
    H200 an IEEE f32 dot (FMAs) made the flush of an f32 state up to 12x
    slower than the record loop, while these dots made it faster
    (bench/RESULTS.md, 2026-11-30).
    """
    presets = jax.lax.DotAlgorithmPreset
    return presets.BF16_BF16_F32_X6 if split_parts(state_dtype) == 3 else presets.BF16_BF16_F32_X3


def split_bf16(a: jax.Array, parts: int) -> list[jax.Array]:
    """bf16 arrays, largest first, whose f32 sum is `a` to about 8 * parts mantissa bits."""
    out = []
    for _ in range(parts):
        out.append(a.astype(jnp.bfloat16))
        a = a - out[-1].astype(f32)
    return out


def rank_update(S: jax.Array, Uw: jax.Array, Kb: jax.Array, state_dtype) -> jax.Array:
    """S + sum_i Uw[i]^T Kb[i], f32[BV, BK]: the buffered records' rank-BL update.

    Uw f32[BL, BV] (records already scaled by their decay weights, dead
    slots zero); Kb [BL, BK], the buffered keys as stored (bf16 or f32);
    state_dtype: the state's dtype (the dot's accuracy).

    When BL, BV and BK are all >= DOT_MIN, dots on the tensor cores with
    f32 accumulation. With bf16 keys, only Uw is split into bf16 parts
    (`split_parts`: 3 for an f32 state, 2 for a bf16 one) and each part is
    one bf16 dot against the keys as stored: every product is exact, and
    the big key tile is neither split nor widened (registers: occupancy).
    f32 keys take one dot of f32 operands with `dot_precision`.
    Otherwise a rolled loop over the slots that picks row i out of the
    register tiles (a masked sum): no reloads, and a register budget of
    about one state tile.
    """
    dims = (((0,), (0,)), ((), ()))
    if fits_dot(*Uw.shape, Kb.shape[1]):
        if Kb.dtype == jnp.bfloat16:
            acc = None
            for part in reversed(split_bf16(Uw, split_parts(state_dtype))):  # smallest first
                term = jax.lax.dot_general(part, Kb, dims, preferred_element_type=f32)
                acc = term if acc is None else acc + term
            return S + acc
        return S + jax.lax.dot_general(Uw, Kb.astype(f32), dims, precision=dot_precision(state_dtype),
                                       preferred_element_type=f32)
    Kb = Kb.astype(f32)
    idx = lane_ids(Uw.shape[0])[:, None]

    def body(i, acc):
        u_i = jnp.sum(jnp.where(idx == i, Uw, 0.0), axis=0)
        k_i = jnp.sum(jnp.where(idx == i, Kb, 0.0), axis=0)
        return acc + u_i[:, None] * k_i[None, :]

    return jax.lax.fori_loop(0, Uw.shape[0], body, S)


def replay_records(S: jax.Array, count, L: int, record, records, state_dtype) -> jax.Array:
    """S after buffered steps 0 .. count - 1, S <- exp(lg_i) S + u_i k_i^T (the flush).

    S f32[BV, BK], a tile of a state of `state_dtype`; count: int scalar
    (static or traced) <= L. With BL = next_pow2(L), BV and BK all >=
    DOT_MIN, the whole buffer is loaded at once, records(live) -> (lg
    f32[BL], U f32[BL, BV], K [BL, BK] as buffered) with the slots where
    `live` (bool[BL]) is false zeroed (`tiles.load_live`), and applied as
    one decay and one rank-L update (`rank_update`, on the tensor cores).
    Otherwise one buffered step per iteration of a loop (`apply_records`),
    record(i) -> (lg_i f32 scalar, u_i f32[BV], k_i f32[BK]) loading slot i
    (a traced index). (A 4-deep prefetch of the loop's records, and the
    whole buffer applied by the masked-sum rank update, both made the flush
    launch slower: bench/RESULTS.md, 2026-11-30.)
    """
    BL = next_pow2(L)
    if fits_dot(BL, *S.shape):  # then rank_update takes its dot too
        lg, U, K = records(lane_ids(BL) < count)
        total, w = replay_weights(lg, count)
        return rank_update(jnp.exp(total) * S, w[:, None] * U, K, state_dtype)

    return apply_records(S, count, record)


def apply_records(S: jax.Array, count, record) -> jax.Array:
    """S after buffered steps 0 .. count - 1, S <- exp(lg_i) S + u_i k_i^T, one slot per iteration.

    S f32[BV, BK]; count: static or traced int; record(i) -> (lg_i f32
    scalar, u_i f32[BV], k_i f32[BK]) loads slot i. Only slots < count are
    read. The direct route folds a row's live records with it (count = the
    cursor, 0 but after a speculative commit): its registers are a state
    tile and one record, where the whole-buffer `rank_update` would set the
    register budget, hence the occupancy, of every step of that kernel
    (bench/RESULTS.md, 2026-11-30).
    """

    def body(i, S):
        lg, u, k = record(i)
        return jnp.exp(lg) * S + u[:, None] * k[None, :]

    return jax.lax.fori_loop(0, count, body, S)


def fold_live_records(S: jax.Array, count, record, finish) -> None:
    """finish(S after the row's `count` live records): the direct route's fold (`apply_records`).

    A row without records (count == 0: plain decoding) runs finish on the
    loaded tile in a branch of its own, so no state tile leaves a loop or a
    branch: one that does cost the launch ~0.3 us even when the loop ran no
    iteration (bench/RESULTS.md, 2026-11-30). finish stores its results; it
    is traced twice.
    """

    @pl.when(count == 0)
    def _():
        finish(S)

    @pl.when(count > 0)
    def _():
        finish(apply_records(S, count, record))


# ----------------------------------------------------------------------------
# The verify window (DESIGN.md section 3): W steps t = 0 .. W - 1 read from the
# state S_0 at the window's start (the checkpoint plus the live buffer) and
# from the window's own earlier steps,
#
#     y_t = exp(G_t) (S_0 q_t) + sum_{s <= t} exp(G_t - G_s) (k_s . q_t) u_s,
#
# G_t = lg_0 + ... + lg_t. Step t reads only steps s <= t: every term of a
# later step is selected away (`jnp.where`), never multiplied by zero, so a
# NaN or inf in a later (padded or garbage) draft cannot reach y_t.


def _causal(BW: int) -> jax.Array:
    """bool[BW, BW], [t, s]: s <= t."""
    idx = lane_ids(BW)
    return idx[None, :] <= idx[:, None]


def window_decays(lg: jax.Array, W: int) -> tuple[jax.Array, jax.Array]:
    """Decays inside a verify window from its steps' log decays.

    Args:
      lg: f32[BW], log decay of window step t (lanes >= W: any value).
      W: the window's steps (static).

    Returns:
      (from_start f32[BW], decay f32[BW, BW]): from_start_t = exp(lg_0 + ...
      + lg_t) and decay[t, s] = exp(lg_{s+1} + ... + lg_t) for s <= t, 0
      for s > t. Each exponent is a sum over its own steps (a rolled loop
      over the W steps), not a difference of two prefix sums: no cancellation,
      and g = -inf gives a zero weight, not NaN.
    """
    BW = lg.shape[0]
    idx = lane_ids(BW)
    t, s = idx[:, None], idx[None, :]

    def body(j, acc):
        through, segment = acc
        lg_j = jnp.sum(jnp.where(idx == j, lg, 0.0))
        through = through + jnp.where(idx >= j, lg_j, 0.0)
        segment = segment + jnp.where((s < j) & (j <= t), lg_j, 0.0)
        return through, segment

    through, segment = jax.lax.fori_loop(0, W, body, (jnp.zeros((BW,), f32), jnp.zeros((BW, BW), f32)))
    return jnp.exp(through), jnp.where(_causal(BW), jnp.exp(segment), 0.0)


def _by_row(W: int, n: int, m: int, row) -> jax.Array:
    """f32[n, m] whose row t < W is row(t) (f32[m], t a traced index) and rows >= W zero.

    A rolled loop over the window's W steps: each iteration holds one row's
    temporaries ([block_v, K] at most), never a product over the window
    axis and a tile at once ([W, block_v, K] products spilled out of the
    registers and made a verify window about ten times a replay step's time
    on the H200: bench/RESULTS.md, 2026-12-01)."""
    idx = lane_ids(n)
    return jax.lax.fori_loop(0, W, lambda t, acc: jnp.where((idx == t)[:, None], row(t)[None, :], acc),
                             jnp.zeros((n, m), f32))


def pair_scores(Q: jax.Array, Kw: jax.Array, W: int) -> jax.Array:
    """f32[BW, BW], [t, s] = Q_t . Kw_s for t < W (rows >= W zero), for Q
    f32[BW, BK] and Kw f32[BW, BK] (the window's queries against its keys;
    Mamba-2: C against B). Entry [t, s] reads only Q_t and Kw_s."""
    return _by_row(W, Q.shape[0], Kw.shape[0], lambda t: jnp.sum(Kw * pick_row(Q, t)[None, :], axis=1))


def buffer_scores(w: jax.Array, Kb: jax.Array, Q: jax.Array, W: int) -> jax.Array:
    """f32[BW, BL], [t, i] = w_i (k_i . q_t) for t < W (rows >= W zero):
    the window's queries Q f32[BW, BK] against the live buffered keys Kb
    [BL, BK] (dead slots zero), times the slots' weights w f32[BL]
    (`replay_weights`, dead slots 0). Row t reads only Q_t."""
    Kb = Kb.astype(f32)
    return _by_row(W, Q.shape[0], Kb.shape[0], lambda t: w * jnp.sum(Kb * pick_row(Q, t)[None, :], axis=1))


def start_readout(S_c: jax.Array, carried, Q: jax.Array, scores: jax.Array, U: jax.Array, W: int) -> jax.Array:
    """S_0 q_t for each window query t < W, f32[BW, BV] (rows >= W zero), without forming S_0:

        S_0 q_t = exp(G) (S_c q_t) + sum_i w_i (k_i . q_t) u_i

    S_c f32[BV, BK] a checkpoint tile (the one read); carried = exp(G), the
    checkpoint's decay over the live slots; Q f32[BW, BK]; scores f32[BW,
    BL] (`buffer_scores`); U f32[BL, BV] the live slots' update rows (dead
    slots zero). Row t reads only Q_t and row t of the scores."""
    BW, BV = Q.shape[0], S_c.shape[0]

    def row(t):
        a_t = pick_row(scores, t)  # [BL]
        return carried * jnp.sum(S_c * pick_row(Q, t)[None, :], axis=1) + jnp.sum(a_t[:, None] * U, axis=0)

    return _by_row(W, BW, BV, row)


def window_readout(Y0: jax.Array, from_start: jax.Array, decay: jax.Array, scores: jax.Array,
                   U: jax.Array, W: int) -> jax.Array:
    """y_t = from_start_t Y0_t + sum_{s <= t} decay[t, s] scores[t, s] U_s, f32[BW, BV].

    Y0 f32[BW, BV]: S_0 q_t (`start_readout`); from_start, decay: as
    `window_decays`; scores f32[BW, BW]: k_s . q_t (and any factor of step
    s, e.g. Mamba-2's dt_s); U f32[BW, BV]: the window's update rows; W the
    window's steps (static). A rolled loop over the steps s, one [BW, BV]
    term each; the terms of steps s > t are selected away (a NaN in U_s
    reaches rows t >= s only)."""
    BW = U.shape[0]
    idx = lane_ids(BW)
    coef = decay * scores

    def body(s, acc):
        c_s = jnp.sum(jnp.where(idx[None, :] == s, coef, 0.0), axis=1)  # [BW]: coef[t, s]
        u_s = jnp.sum(jnp.where((idx == s)[:, None], U, 0.0), axis=0)  # [BV]
        return acc + jnp.where((idx >= s)[:, None], c_s[:, None] * u_s[None, :], 0.0)

    return from_start[:, None] * Y0 + jax.lax.fori_loop(0, W, body, jnp.zeros(U.shape, f32))


def forward_substitution(A: jax.Array, R: jax.Array, W: int) -> jax.Array:
    """D = (I + A)^-1 R for a strictly lower triangular A, f32[BW, n].

    A f32[BW, BW] (entries on and above the diagonal are not read); R
    f32[BW, n]; W: the rows solved (static). D_0 = R_0 and D_i = R_i -
    sum_{j < i} A_ij D_j, one row per iteration of a static loop; row i
    reads rows j < i of D and row i of A and R only, all by selects, so a
    NaN in a later row stays there. Rows >= W keep R's.
    """
    BW = R.shape[0]
    idx = lane_ids(BW)
    D = R
    for i in range(1, W):
        earlier = idx < i
        a_i = jnp.where(earlier, pick_row(A, i), 0.0)
        terms = jnp.where(earlier[:, None], a_i[:, None] * D, 0.0)
        D = jnp.where((idx == i)[:, None], (pick_row(R, i) - jnp.sum(terms, axis=0))[None, :], D)
    return D
