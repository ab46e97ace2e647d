"""Tiling, configuration and in-kernel math shared by the Pallas kernels.

Both layer types run the same per-head recurrence (DESIGN.md section 2)

    S_t = exp(lg_t) S_{t-1} + u_t k_t^T,    y_t = S_t q_t,

on a state tile S f32[BV, BK] that holds rows v0 .. v0 + BV - 1 of one head's
V x K state and all of its K columns (BK = K rounded up to a power of two,
the Triton lowering needs power-of-two tensors). Padded rows and columns are
masked on every load and store. Mat-vecs are elementwise products and
reductions (a dot needs >= 16 in every dimension on Triton, and a mat-vec
is memory-bound anyway); the buffered records' rank-L update (the flush,
and the replay kernel's state route) is a dot where it fits.

The lowering (Pallas on Triton) is private to this package. Pallas warns
that its Triton backend is deprecated; this module silences exactly that
message (a Mosaic GPU port is expected, DESIGN.md section 5).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import warnings

import jax
import jax.numpy as jnp
import numpy as np
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
      fused_flush: ReplaySSM kernels only (not the direct route, which
        runs the standard step's kernel and takes its config). True: the
        replay kernel also writes the state of its flushing rows: after
        its readout, a program of such a row re-reads its checkpoint rows
        in sub-tiles (`fused_flush_config`) and writes them (one launch
        per step). The flush's code still sets the register budget, hence
        the occupancy, of every program, which only small grids can
        afford (bench/RESULTS.md, ninth session). False: the flush is a
        second launch, one tile and a block of batch rows per program,
        that skips rows which do not flush (the checkpoint tiles of
        flushing rows are read twice per flush cycle). Both run the same
        flush: the row's buffered records, then this step.
      flush_block_v, flush_warps, flush_rows: the flush launch's own tiling
        (two-launch replay steps; 0: its default, the replay kernel's
        block_v and num_warps and `flush_rows(batch)` batch rows per
        program). flush_block_v a power of two, flush_warps as num_warps,
        flush_rows a power of two that must divide the batch. With
        fused_flush only flush_block_v may be set: the rows of the fused
        flush's sub-tiles, at most block_v (0: `fused_flush_config`).

    Raises:
      TypeError: a field of the wrong type (ints, numpy ints included;
        fused_flush a bool, numpy bools included).
      ValueError: block_v not a power of two, num_warps not in {1, 2, 4,
        8, 16}, num_stages or tiles < 1, a flush field out of range, or,
        with fused_flush, flush_warps or flush_rows set (that step has no
        flush launch) or flush_block_v above block_v.
    """

    block_v: int
    num_warps: int = 4
    num_stages: int = 1
    tiles: int = 1
    fused_flush: bool = False
    flush_block_v: int = 0
    flush_warps: int = 0
    flush_rows: int = 0

    def __post_init__(self):
        for name in ("block_v", "num_warps", "num_stages", "tiles", "flush_block_v", "flush_warps", "flush_rows"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
                raise TypeError(f"`config.{name}` must be an int; got {type(value).__name__} {value!r}")
            object.__setattr__(self, name, int(value))  # a numpy int (from a sweep) is stored as an int
        if not isinstance(self.fused_flush, (bool, np.bool_)):
            raise TypeError(f"`config.fused_flush` must be a bool; got {type(self.fused_flush).__name__}")
        object.__setattr__(self, "fused_flush", bool(self.fused_flush))  # a numpy bool is stored as a bool
        if self.block_v < 1 or self.block_v & (self.block_v - 1):
            raise ValueError(f"`config.block_v` must be a power of two; got {self.block_v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"`config.num_warps` must be one of 1, 2, 4, 8, 16; got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"`config.num_stages` must be >= 1; got {self.num_stages}")
        if self.tiles < 1:
            raise ValueError(f"`config.tiles` must be >= 1; got {self.tiles}")
        for name in ("flush_block_v", "flush_rows"):
            value = getattr(self, name)
            if value < 0 or value & (value - 1):
                raise ValueError(f"`config.{name}` must be 0 (default) or a power of two; got {value}")
        if self.flush_warps not in (0, 1, 2, 4, 8, 16):
            raise ValueError(f"`config.flush_warps` must be 0 (default) or one of 1, 2, 4, 8, 16; "
                             f"got {self.flush_warps}")
        if self.fused_flush and (self.flush_warps or self.flush_rows):
            raise ValueError("`config.flush_warps` and `flush_rows` tile the flush launch, which a "
                             f"`fused_flush=True` step does not have; got {self.flush_warps}, {self.flush_rows}")
        if self.fused_flush and self.flush_block_v > self.block_v:
            raise ValueError("`config.flush_block_v` of a `fused_flush=True` step sub-tiles the program's "
                             f"block_v = {self.block_v} rows, so must be <= it; got {self.flush_block_v}")

    @property
    def has_flush_tiling(self) -> bool:
        """Whether a flush field is set (not 0)."""
        return bool(self.flush_block_v or self.flush_warps or self.flush_rows)

    def tag(self) -> str:
        fused = "_fused" if self.fused_flush else ""
        flush = f"_f{self.flush_block_v}x{self.flush_warps}x{self.flush_rows}" if self.has_flush_tiling else ""
        return f"bv{self.block_v}_w{self.num_warps}_s{self.num_stages}_t{self.tiles}{fused}{flush}"

    def splits(self, V: int) -> int:
        """Programs per head along the rows: cdiv(cdiv(V, block_v), tiles)."""
        return -(-(-(-V // self.block_v)) // self.tiles)


def default_config(batch: int, heads: int, V: int, K: int, state_bytes: int, replay_len: int = 0) -> Config:
    """The frozen heuristic: tile rows, warps and (replay) tiles per program.

    Standard step: a tile holds about 4096 state elements (32 per thread:
    16 KiB in f32, 8 KiB in bf16), preferring a row count that divides V
    (V = 80 -> 16), on at most 4 warps (8 warps on a 64-row bf16 tile ran
    16% slower); one tile per program, shrunk until there are at least ~8
    programs per SM. (A bf16 tile of 16 KiB, 64 rows of K = 128, ran 2-4%
    slower than 32 rows at batch 64-256 and equal at 512: ninth session.)

    Replay step: tiles of up to 64 rows (again preferring a divisor of V) on
    at most 4 warps, and one program loops over all tiles of a head, so the
    per-head work on the buffer (the buffered keys' scores, the decay
    weights) is done once per head, as long as that leaves at least ~4
    programs per SM; otherwise the head is split over more programs, and
    with one tile per program the tile shrinks as in the standard rule.
    When one wave holds every head (batch x heads <= number of SMs: batch
    1 to 4 here), the step is bound by latency, not by occupancy: the flush
    is fused into the replay kernel, on 16-row tiles and 4 warps.
    The sweeps in bench/RESULTS.md chose these numbers.
    """
    BK = next_pow2(K)
    BVmax = next_pow2(V)
    fused = bool(replay_len) and batch * heads <= _NUM_SMS
    if fused:
        bv = min(BVmax, 16)
    elif replay_len:
        # About 32 KiB of state per tile when V is a power of two (f32: 64
        # rows, bf16: 128; GDN bf16 at batch 256 ran 174 us on 128 rows
        # against 183 us on 64); 64 rows otherwise (Mamba-2's P = 80: the
        # divisor rule below takes 16).
        bv = min(BVmax, max(64, 32768 // state_bytes // BK)) if V == BVmax else min(BVmax, 64)
    else:
        bv = min(BVmax, next_pow2(max(1, 4096 // BK)))
    # Prefer a block that divides V (no padded rows; V = 80 -> 16) if one
    # within a factor 4 exists.
    if V % bv:
        divides = next_pow2(V & -V) if V & -V < bv else bv
        bv = divides if divides * 4 >= bv else bv
    if fused:
        return Config(block_v=bv, num_warps=4, num_stages=1, tiles=1, fused_flush=True)
    n_tiles = -(-V // bv)
    tiles = n_tiles if replay_len else 1
    while tiles > 1 and batch * heads * -(-n_tiles // tiles) < 4 * _NUM_SMS:
        tiles = -(-tiles // 2)
    if tiles == 1:
        while bv > 4 and batch * heads * -(-V // bv) < 8 * _NUM_SMS:
            bv //= 2
    warps = max(1, min(4, next_pow2(max(1, bv * BK // (32 * 32)))))
    return Config(block_v=bv, num_warps=warps, num_stages=1, tiles=tiles)


# Batch rows per program of the flush launch (at most; a power of two that
# divides the batch). A flush program returns at once for a row that does not
# flush, but a launch of one program per row and tile spent ~30 us per step
# on those programs alone at batch 256 (bench/RESULTS.md, third session).
MAX_FLUSH_ROWS = 8


def flush_rows(batch: int) -> int:
    """Batch rows per flush program: the largest power of two <= MAX_FLUSH_ROWS dividing `batch`."""
    return min(MAX_FLUSH_ROWS, batch & -batch)


class RowRef:
    """Row r of a ref's first axis, indexed as a ref of the remaining axes.

    `view.at[idx]` is `ref.at[(r, *idx)]` and `view[idx]` is `ref[(r, *idx)]`:
    one indexing step, not `ref.at[r].at[idx]` (interpret mode mis-shapes a
    branch that stores through such a chain of dynamic views).
    """

    def __init__(self, ref, r):
        self.ref, self.r = ref, r
        self.shape, self.dtype = tuple(ref.shape[1:]), ref.dtype

    def _index(self, idx):
        return (self.r, *(idx if isinstance(idx, tuple) else (idx,)))

    @property
    def at(self):
        return _RowAt(self)

    def __getitem__(self, idx):
        return self.ref[self._index(idx)]

    def whole(self):
        """The row as a ref (for a load or store of all of it)."""
        return self.ref.at[self.r]


class _RowAt:
    def __init__(self, view: RowRef):
        self.view = view

    def __getitem__(self, idx):
        return self.view.ref.at[self.view._index(idx)]


def flush_rows_of_program(refs, L: int, flush, shared=()) -> None:
    """Run flush(*views, cursor=cursor) for each batch row of the program
    whose buffer is full after this step (cursor at entry >= L - 1).

    refs[0] is the checkpoint block (its first axis: the program's batch
    rows), refs[4] the cursor block. views[i] = RowRef(refs[i], r), or
    refs[i] itself for i in `shared` (per-head parameters, no batch axis).
    The block's cursors are read in one load, so a program waits for one
    load before it knows its rows (a load per row made every program wait
    for each in turn), and a program with no flushing row stops there.
    """
    rows = refs[0].shape[0]
    cursors = load(refs[4], None, jnp.int32)
    full = cursors >= L - 1

    def row(r, carry):
        cursor = jnp.sum(jnp.where(lane_ids(rows) == r, cursors, 0))

        @pl.when(cursor >= L - 1)
        def _():
            flush(*[ref if i in shared else RowRef(ref, r) for i, ref in enumerate(refs)], cursor=cursor)

        return carry

    @pl.when(jnp.max(full.astype(jnp.int32)) > 0)
    def _():
        jax.lax.fori_loop(0, rows, row, 0)


# Rows of the fused flush's sub-tiles (at most): a flushing program
# re-reads its checkpoint rows in tiles this small (an L2 hit, it has just
# read them), so its rank-L update holds a small tile (at batch 1-4 the
# default replay tile has 16 rows anyway). At large grids the fused step
# stays slower than two launches all the same (bench/RESULTS.md, ninth
# session), so the heuristic fuses only small grids.
FUSED_FLUSH_ROWS = 16


def fused_flush_config(config: Config) -> Config:
    """The tiling of the fused flush inside a replay program of `config`: the
    same rows in sub-tiles of `config.flush_block_v` rows (default
    min(block_v, FUSED_FLUSH_ROWS); `Config` refuses more than block_v)."""
    fbv = config.flush_block_v or min(config.block_v, FUSED_FLUSH_ROWS)
    return Config(block_v=fbv, num_warps=config.num_warps, num_stages=config.num_stages,
                  tiles=config.tiles * config.block_v // fbv)


def flush_launch(kernel, specs, config: Config, checkpoint, operands, *, interpret: bool, name: str):
    """The flush launch of the two-launch replay step; returns the checkpoint, updated in place.

    kernel(*refs, config=...): the layer's flush kernel; specs(config, nb)
    -> (grid, in_specs, out_specs) of the layer's replay step (out_specs[1]:
    the checkpoint's); operands: the replay step's inputs after the
    checkpoint. One row tile per program (a flushing row's tiles run in
    parallel) and a block of batch rows: the config's flush fields, or by
    default the replay kernel's tile and `flush_rows(batch)` rows (the
    public wrappers have checked that config.flush_rows divides the batch).
    """
    rows = config.flush_rows or flush_rows(checkpoint.shape[0])
    fcfg = Config(block_v=config.flush_block_v or config.block_v, num_warps=config.flush_warps or config.num_warps,
                  num_stages=config.num_stages)
    grid, in_specs, out_specs = specs(fcfg, rows)
    return pallas_call(
        functools.partial(kernel, config=fcfg),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs[1],
        out_shape=jax.ShapeDtypeStruct(checkpoint.shape, checkpoint.dtype),
        input_output_aliases={0: 0},
        interpret=interpret,
        config=fcfg,
        name=f"{name}_{fcfg.tag()}_r{rows}",
    )(checkpoint, *operands)


def step_launch(kernel, layer: str, *, grid, in_specs, out_specs, out_shape, operands, config: Config,
                interpret: bool, replay=None, buffer_specs=None):
    """Launch a layer's standard step kernel: its state (operand 0) updated in place (output 1).

    With `replay` = (three buffers, cursor) of a replay state whose
    checkpoint is that state, the direct route: the buffers (block specs
    `buffer_specs(L)`, L = replay[0].shape[2]) and the cursor follow the
    step's operands, the kernel gets `L` and `programs` (per batch row:
    grid[1] * grid[2]), and the cursor is an output in place.

    Returns (output, state, new cursor or None).
    """
    aliases, extra = {0: 1}, ()
    in_specs, out_specs, out_shape = list(in_specs), list(out_specs), list(out_shape)
    if replay is not None:
        extra, cursor, L = replay, replay[3], replay[0].shape[2]
        kernel = functools.partial(kernel, L=L, programs=grid[1] * grid[2])
        in_specs += buffer_specs(L) + [cursor_spec()]
        out_specs.append(cursor_spec())
        out_shape.append(jax.ShapeDtypeStruct(cursor.shape, cursor.dtype))
        aliases[len(in_specs) - 1] = 2
    out, state, *cursor = pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases=aliases,
        interpret=interpret,
        config=config,
        name=f"{layer}_{'step' if replay is None else 'direct'}_{config.tag()}",
    )(*operands, *extra)
    return out, state, (cursor[0] if cursor else None)


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
    if isinstance(ref, RowRef):
        ref = ref.whole()
    if mask is None:
        return plgpu.load(ref).astype(dtype)
    return plgpu.load(ref, mask=mask, other=0).astype(dtype)


def store(ref, value, mask):
    plgpu.store(ref, value.astype(ref.dtype), mask=mask)


def load_slots(ref, L: int, cols=None, dtype=f32):
    """All slots of a buffer tile, [BL] or [BL, n] in `dtype`; the padded slots (>= L) zero.

    cols: bool[n] or None, the valid columns of a 2-D tile.
    """
    slots = lane_mask(ref.shape[0], L)
    return load(ref, slots if len(ref.shape) == 1 else outer(slots, cols, tuple(ref.shape)), dtype)


def load_live(ref, live, L: int, cols=None, dtype=f32):
    """A buffer tile [BL] or [BL, n] in `dtype` with its dead slots zeroed.

    live: bool[BL], the live slots. The load itself is masked only by what
    is static (slots < L, and `cols`, bool[n] or None), so it need not wait
    for the cursor; the dead slots are then zeroed by a select, not a
    product, so a NaN or inf left there (a rejected draft's record) never
    reaches the math.
    """
    return jnp.where(live if len(ref.shape) == 1 else live[:, None], load_slots(ref, L, cols, dtype),
                     jnp.zeros((), dtype))


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


# The smallest extent of every dimension of a dot on the Triton lowering.
DOT_MIN = 16


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
    when the buffered keys are not bf16 (f32 or f16 buffers): both operands
    split into `split_parts` bf16 parts on the tensor cores, f32
    accumulation (6 products for an f32 state, 3 for a bf16 state). On the
    H200 an IEEE f32 dot (FMAs) made the flush of an f32 state up to 12x
    slower than the record loop, while these dots made it faster
    (bench/RESULTS.md, fifth session).
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
    slots zero); Kb [BL, BK], the buffered keys as stored (bf16, or f32 /
    f16 buffers); state_dtype: the state's dtype (the dot's accuracy).

    When BL, BV and BK are all >= DOT_MIN, dots on the tensor cores with
    f32 accumulation. With bf16 keys, only Uw is split into bf16 parts
    (`split_parts`: 3 for an f32 state, 2 for a bf16 one) and each part is
    one bf16 dot against the keys as stored: every product is exact, and
    the big key tile is neither split nor widened (registers: occupancy).
    Other key dtypes take one dot of f32 operands with `dot_precision`.
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


def replay_records(S: jax.Array, count, L: int, record, records, state_dtype) -> jax.Array:
    """S after buffered steps 0 .. count - 1, S <- exp(lg_i) S + u_i k_i^T.

    S f32[BV, BK], a tile of a state of `state_dtype`; count: int scalar
    (static or traced) <= L. With BL = next_pow2(L), BV and BK all >=
    DOT_MIN, the whole buffer is loaded at once, records(live) -> (lg
    f32[BL], U f32[BL, BV], K [BL, BK] as buffered) with the slots where
    `live` (bool[BL]) is false zeroed (`load_live`), and applied as one
    decay and one rank-L update (`rank_update`, on the tensor cores), with
    n = count: S_n = exp(sum_i lg_i) S + sum_i w_i u_i k_i^T,
    w_i = exp(sum_{i < j < n} lg_j).
    Otherwise one buffered step per iteration of a loop, record(i) ->
    (lg_i f32 scalar, u_i f32[BV], k_i f32[BK]) loading slot i (a traced
    index). (In the fourth session a 4-deep prefetch of the loop's records,
    and the whole buffer applied by the masked-sum rank update, both made
    the flush launch slower: bench/RESULTS.md.)
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
    (bench/RESULTS.md, eighth session).
    """

    def body(i, S):
        lg, u, k = record(i)
        return jnp.exp(lg) * S + u[:, None] * k[None, :]

    return jax.lax.fori_loop(0, count, body, S)


def fold_then(S: jax.Array, count, record, finish) -> None:
    """finish(S after the row's `count` live records), the direct route's fold (`apply_records`).

    A row without records (count == 0: plain decoding) runs finish on the
    loaded tile in a branch of its own, so no state tile leaves a loop or a
    branch: one that does cost the launch ~0.3 us even when the loop ran no
    iteration (bench/RESULTS.md, eighth and ninth sessions). finish stores
    its results; it is traced twice.
    """

    @pl.when(count == 0)
    def _():
        finish(S)

    @pl.when(count > 0)
    def _():
        finish(apply_records(S, count, record))


def store_cursor(cursor_out, cursor, L: int, writer) -> None:
    """Store the row's cursor after this step (see `next_cursor`) into a fresh
    array, from the one program where `writer` (two-launch replay steps: the
    flush launch still reads the old cursors)."""

    @pl.when(writer)
    def _():
        cursor_out[0] = next_cursor(cursor, L)


# A one-launch replay step (fused flush, direct route) moves the cursor in
# place, without a copy into the caller's carry. Every program of a row reads
# the row's cursor, so none may overwrite it before the others have read it.
# So each program, after its read, adds ARRIVAL to the cursor (an atomic add,
# which leaves the low bits, the cursor itself, unchanged) and the program
# whose add completes the count stores the new cursor. Between launches the
# high bits are zero again: the array holds plain cursors 0..L.
ARRIVAL = 1 << 16
MAX_ROW_PROGRAMS = (1 << 15) - 1  # arrivals per row that fit in the int32 above the cursor's 16 bits


def cursor_spec(nb=None):
    """Block spec of the cursor array i32[batch]: nb rows (None: the program's one row, a block of 1)."""
    return pl.BlockSpec((nb or 1,), lambda b, h, j: (b,))


def read_cursor(cur_ref) -> jax.Array:
    """The row's cursor (i32 scalar) from its block of 1: the low bits, whatever
    other programs' arrivals added above them."""
    return cur_ref[0] & (ARRIVAL - 1)


def advance_cursor(cur_ref, cursor, new, programs: int) -> None:
    """Move the row's cursor from `cursor` to `new` in place, once all `programs` programs of the row have read it.

    Every program of the row calls this after its `read_cursor`. Nothing is
    written where new == cursor (the same in every program of the row).
    """
    if programs > MAX_ROW_PROGRAMS:
        raise ValueError(f"a one-launch replay step counts at most {MAX_ROW_PROGRAMS} programs per batch row; "
                         f"this tiling has {programs} (use larger row tiles)")

    @pl.when(new != cursor)
    def _():
        before = plgpu.atomic_add(cur_ref, (jnp.int32(0),), jnp.int32(ARRIVAL))

        @pl.when(before >> 16 == programs - 1)  # the last of the row's programs to arrive
        def _():
            cur_ref[0] = new


def next_cursor(cursor, L: int):
    """The cursor after one replay step: cursor + 1, or 0 where the step flushes.

    A row flushes when its cursor reaches L with this step (cursor == L - 1)
    or when it entered full (cursor == L, possible only after a speculative
    commit): then the flush absorbs the L buffered steps and this one.
    """
    return jnp.where(cursor >= L - 1, 0, cursor + 1).astype(jnp.int32)
