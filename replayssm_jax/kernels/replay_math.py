"""In-kernel math of the replay: decay weights of the buffered slots, the
rank-L update, and the fold of buffered records into a state tile; and the
gates' softplus, which the kernels form from the layers' raw projections.

Both layer types run the same per-head recurrence (ARCHITECTURE.md, "The math")

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
from replayssm_jax.kernels.tiles import f32, lane_ids

# The smallest extent of every dimension of a dot on the Triton lowering.
DOT_MIN = 16


def softplus(x: jax.Array) -> jax.Array:
    """log(1 + exp(x)), exact to f32 rounding, linear above 20 (mamba_ssm's and PyTorch's threshold)."""
    return jnp.where(x <= 20.0, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))), x)


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
    The parts' dots are summed smallest first and S is added last, in
    one f32 add. (Accumulating the dots onto S, S as the dots'
    accumulator, made the Mamba-2 direct step at batch 256 5.8% faster on
    the H200, but sends S through the tensor cores' f32 accumulation,
    which does not round to nearest, at every flush: bench/RESULTS.md,
    2026-12-03.) f32 keys take one dot of f32 operands with
    `dot_precision`.
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


def fold_live_records(S: jax.Array, count, record, finish, records=None, L: int = 0, state_dtype=None) -> None:
    """finish(S after the row's `count` live records): the direct route's fold.

    One record per loop iteration (`apply_records`), or, given `records`
    (the whole-buffer loader of `replay_records`, with the buffer length L
    and the state's dtype), the buffer at once as the flush folds it
    (`replay_records`: one rank-L dot where the tile's sizes allow). A row
    without records (count == 0: plain decoding) runs finish on the loaded
    tile in a branch of its own, so no state tile leaves a loop or a
    branch: one that does cost the launch ~0.3 us even when the loop ran no
    iteration (bench/RESULTS.md, 2026-11-30). finish stores its results; it
    is traced twice.
    """

    @pl.when(count == 0)
    def _():
        finish(S)

    @pl.when(count > 0)
    def _():
        if records is None:
            finish(apply_records(S, count, record))
        else:
            finish(replay_records(S, count, L, record, records, state_dtype))
