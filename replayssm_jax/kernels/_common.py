"""Tiling, configuration and in-kernel math shared by the Pallas kernels.

Both layer types run the same per-head recurrence (DESIGN.md section 2)

    S_t = exp(lg_t) S_{t-1} + u_t k_t^T,    y_t = S_t q_t,

on a state tile S f32[BV, BK] that holds rows v0 .. v0 + BV - 1 of one head's
V x K state and all of its K columns (BK = K rounded up to a power of two,
the Triton lowering needs power-of-two tensors). Padded rows and columns are
masked on every load and store. Mat-vecs are elementwise products and
reductions: `pl.dot` needs >= 16 in every dimension on Triton, and a
mat-vec is memory-bound anyway.

The lowering (Pallas on Triton) is private to this package. Pallas warns
that its Triton backend is deprecated; this module silences exactly that
message (a Mosaic GPU port is expected, DESIGN.md section 5).
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

f32 = jnp.float32

# Pallas warns, when it lowers a Triton kernel (at the outermost jit's
# lowering, not at the call), that the Triton backend is deprecated. Silence
# exactly that message; every other warning stays.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

# Number of streaming multiprocessors the heuristics plan for (H100 / H200: 132).
_NUM_SMS = 132


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (int(n) - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class Config:
    """Static tiling of one kernel launch.

    Attributes:
      block_v: rows of a state tile (V for GDN, P = head_dim for Mamba-2); a
        power of two.
      num_warps: Triton warps per program.
      num_stages: Triton software-pipelining stages.
      tiles: row tiles per program (ReplaySSM kernels only; the standard
        step takes one tile per program). A replay program forms the
        per-head quantities (buffer scores, decay weights) once and then
        loops over its `tiles` row tiles, so the grid is
        (batch, heads, cdiv(cdiv(V, block_v), tiles)).
    """

    block_v: int
    num_warps: int = 4
    num_stages: int = 1
    tiles: int = 1

    def __post_init__(self):
        if self.block_v < 1 or self.block_v & (self.block_v - 1):
            raise ValueError(f"`config.block_v` must be a power of two; got {self.block_v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"`config.num_warps` must be one of 1, 2, 4, 8, 16; got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"`config.num_stages` must be >= 1; got {self.num_stages}")
        if self.tiles < 1:
            raise ValueError(f"`config.tiles` must be >= 1; got {self.tiles}")

    def tag(self) -> str:
        return f"bv{self.block_v}_w{self.num_warps}_s{self.num_stages}_t{self.tiles}"

    def splits(self, V: int) -> int:
        """Programs per head along the rows: cdiv(cdiv(V, block_v), tiles)."""
        return -(-(-(-V // self.block_v)) // self.tiles)


def default_config(batch: int, heads: int, V: int, K: int, state_bytes: int, replay_len: int = 0) -> Config:
    """The frozen heuristic: tile rows, warps and (replay) tiles per program.

    Standard step: a tile holds about 16 KiB of state (32 elements per
    thread), preferring a row count that divides V (V = 80 -> 16); one tile
    per program, shrunk until there are at least ~8 programs per SM.

    Replay step: tiles of up to 64 rows (again preferring a divisor of V) on
    at most 4 warps, and one program loops over all tiles of a head, so the
    per-head work on the buffer (the buffered keys' scores, the decay
    weights) is done once per head, as long as that leaves at least ~4
    programs per SM; otherwise the head is split over more programs, and
    with one tile per program the tile shrinks as in the standard rule.
    The sweeps in bench/RESULTS.md chose these numbers.
    """
    BK = next_pow2(K)
    BVmax = next_pow2(V)
    if replay_len:
        bv = min(BVmax, 64)
    else:
        bv = min(BVmax, next_pow2(max(1, (16384 // state_bytes) // BK)))
    # Prefer a block that divides V (no padded rows; V = 80 -> 16) if one
    # within a factor 4 exists.
    if V % bv:
        divides = next_pow2(V & -V) if V & -V < bv else bv
        bv = divides if divides * 4 >= bv else bv
    n_tiles = -(-V // bv)
    tiles = n_tiles if replay_len else 1
    while tiles > 1 and batch * heads * -(-n_tiles // tiles) < 4 * _NUM_SMS:
        tiles = -(-tiles // 2)
    if tiles == 1:
        while bv > 4 and batch * heads * -(-V // bv) < 8 * _NUM_SMS:
            bv //= 2
    warps = max(1, min(4 if replay_len else 8, next_pow2(max(1, bv * BK // (32 * 32)))))
    return Config(block_v=bv, num_warps=warps, num_stages=1, tiles=tiles)


def pallas_call(kernel, *, interpret: bool, config: Config, **kwargs):
    """`pl.pallas_call` with the Triton compiler params of `config`."""
    call = pl.pallas_call(
        kernel,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        **kwargs,
    )

    return call


# ----------------------------------------------------------------------------
# In-kernel helpers (traced inside a Pallas kernel body).


def row_ids(BV: int) -> jax.Array:
    """Global state-row indices of this program's tile (grid axis 2 = row block)."""
    return pl.program_id(2) * BV + jax.lax.broadcasted_iota(jnp.int32, (BV,), 0)


def lane_ids(n: int) -> jax.Array:
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def row_mask(BV: int, V: int):
    """bool[BV], rows of this program's tile inside [0, V); None if statically all true."""
    return None if V % BV == 0 else row_ids(BV) < V


def lane_mask(B: int, n: int):
    """bool[B], lanes < n; None if B == n (statically all true)."""
    return None if B == n else lane_ids(B) < n


def outer(rows, cols, shape):
    """The 2-D mask rows[:, None] & cols[None, :] of `shape`; None stands for all true."""
    if rows is None and cols is None:
        return None
    if rows is None:
        return jnp.broadcast_to(cols[None, :], shape)
    if cols is None:
        return jnp.broadcast_to(rows[:, None], shape)
    return rows[:, None] & cols[None, :]


def both(mask, cond, shape):
    """mask & cond (cond a bool scalar or array), as an array of `shape`."""
    cond = jnp.broadcast_to(cond, shape)
    return cond if mask is None else mask & cond


def load(ref, mask, dtype=f32):
    """Load (zeros where `mask` is false; None: no mask), cast to `dtype`."""
    if mask is None:
        return plgpu.load(ref).astype(dtype)
    return plgpu.load(ref, mask=mask, other=0).astype(dtype)


def store(ref, value, mask):
    plgpu.store(ref, value.astype(ref.dtype), mask=mask)


def load_scalar(ref, dtype=f32):
    return ref[()].astype(dtype)


def matvec(S: jax.Array, vec: jax.Array) -> jax.Array:
    """S f32[BV, BK] times vec f32[BK] -> f32[BV]."""
    return jnp.sum(S * vec[None, :], axis=1)


def softplus(x: jax.Array) -> jax.Array:
    """log(1 + exp(x)), exact to f32 rounding, linear above 20 (mamba_ssm's threshold)."""
    return jnp.where(x <= 20.0, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))), x)


def l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x * rsqrt(sum(x^2) + eps); padded lanes must be zero."""
    return x * jax.lax.rsqrt(jnp.sum(x * x) + eps)


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


def rank_update(S: jax.Array, Uw: jax.Array, Kb: jax.Array) -> jax.Array:
    """S + sum_i Uw[i]^T Kb[i], f32[BV, BK]: the buffered records' rank-BL update.

    Uw f32[BL, BV] (records already scaled by their decay weights, dead
    slots zero); Kb f32[BL, BK]. A rolled loop over the slots that picks
    row i out of the register tiles (a masked sum): no reloads, and a
    register budget of about one state tile. (Inside the replay kernel, an
    unrolled loop or a `dot` here took 244-252 registers per thread and 12%
    occupancy from every program of the step, bench/RESULTS.md; it now runs
    in the flush kernel and in the state route.)
    """
    idx = lane_ids(Uw.shape[0])[:, None]

    def body(i, acc):
        u_i = jnp.sum(jnp.where(idx == i, Uw, 0.0), axis=0)
        k_i = jnp.sum(jnp.where(idx == i, Kb, 0.0), axis=0)
        return acc + u_i[:, None] * k_i[None, :]

    return jax.lax.fori_loop(0, Uw.shape[0], body, S)


def replay_tiles(V: int, config: Config, split, tile) -> None:
    """Run `tile(rows, row_mask)` over this program's row tiles.

    split: the program's index along the rows (`pl.program_id(2)`, read at
    the kernel's top level: interpret mode cannot read it inside a branch).
    rows: a `pl.ds` of block_v rows, relative to the program's block of
    block_v * tiles rows; row_mask: bool[block_v] (rows < V), None when V is
    a multiple of block_v.
    """
    BV, tiles = config.block_v, config.tiles
    n_tiles = -(-V // BV)
    first = split * tiles

    def body(r, carry):
        mask = None if V % BV == 0 else (first + r) * BV + lane_ids(BV) < V
        start = r * BV if isinstance(r, int) else pl.multiple_of(r * BV, BV)
        tile(pl.ds(start, BV), mask)
        return carry

    if tiles == 1:
        body(0, 0)
    else:
        count = tiles if n_tiles % tiles == 0 else jnp.minimum(tiles, n_tiles - first)
        jax.lax.fori_loop(0, count, body, 0)


def next_cursor(cursor, L: int):
    """The cursor after one replay step: cursor + 1, or 0 where the step flushes.

    A row flushes when its cursor reaches L with this step (cursor == L - 1)
    or when it entered full (cursor == L, possible only after a speculative
    commit): then the flush absorbs the L buffered steps and this one.
    """
    return jnp.where(cursor >= L - 1, 0, cursor + 1).astype(jnp.int32)
