"""In-kernel views, masks, loads and mat-vecs of state tiles (traced inside a Pallas kernel body).

A state tile S f32[BV, BK] holds rows v0 .. v0 + BV - 1 of one head's V x K
state and all of its K columns (BK = K rounded up to a power of two: the
Triton lowering needs power-of-two tensors). Padded rows and columns are
masked on every load and store; a mask of None stands for all true, so a
statically full tile is loaded without one. Mat-vecs are elementwise
products and reductions (a dot needs >= 16 in every dimension on Triton,
and a mat-vec is memory-bound anyway).
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from replayssm_jax.state import quantize_rows, rounding_uniforms

f32 = jnp.float32


class Quantized(NamedTuple):
    """An 8-bit checkpoint operand of a launch (arrays, block specs or refs).

    values: int8 | float8_e4m3fn[batch, heads, V, K]; scale: f32[batch,
    heads, V], one per row (over K); seed: u32[batch, heads], the stochastic
    rounding's key of this write (:func:`replayssm_jax.state.row_seeds`), or
    None: round to nearest (and in a launch's outputs, which hold the
    written values and scales only). A float32 or bfloat16 checkpoint is
    passed as a plain array instead.
    """

    values: Any
    scale: Any
    seed: Any = None

    @property
    def shape(self):
        return self.values.shape

    @property
    def dtype(self):
        return self.values.dtype


def stochastic(checkpoint) -> bool:
    """Whether a checkpoint operand (array or Quantized, of refs) rounds stochastically when written."""
    return isinstance(checkpoint, Quantized) and checkpoint.seed is not None


def _rows_of(ref, rows, matrix: bool):
    """ref.at[rows, :] (matrix) or ref.at[rows]; the ref itself where rows is None (a block of one tile)."""
    if rows is None:
        return ref
    return ref.at[rows, :] if matrix else ref.at[rows]


def load_checkpoint(checkpoint, rows, tmask, rmask) -> jax.Array:
    """A checkpoint tile f32[BV, BK] as read: rows `rows` (a `pl.ds`, or None:
    the whole block) of `checkpoint` (a ref, or a :class:`Quantized` of refs:
    the values times their rows' scales). tmask: the tile's mask; rmask:
    its rows' (bool[BV] or None)."""
    if not isinstance(checkpoint, Quantized):
        return load(_rows_of(checkpoint, rows, True), tmask)
    ref = _rows_of(checkpoint.values, rows, True)
    if isinstance(ref, (RowRef, SlotView)):
        ref = ref.whole()
    # The padding value in the ref's own kind: Triton casts no integer to fp8.
    zero = 0.0 if jnp.issubdtype(ref.dtype, jnp.floating) else 0
    values = (plgpu.load(ref) if tmask is None else plgpu.load(ref, mask=tmask, other=zero)).astype(f32)
    return values * load(_rows_of(checkpoint.scale, rows, False), rmask)[:, None]


def store_checkpoint(checkpoint, checkpoint_out, rows, S, tmask, rmask, row_ids, K: int) -> None:
    """Store the f32 tile S [BV, BK] (padded columns zero) as rows `rows` (as
    :func:`load_checkpoint`) of the checkpoint: cast to a plain ref's dtype,
    or quantized row by row into a :class:`Quantized` output
    (:func:`replayssm_jax.state.quantize_rows`; stochastically where the
    input `checkpoint` has a seed, the uniforms of elements (row_ids
    i32[BV], the tile's global rows, and its columns) of a V x K state).
    row_ids is read only for stochastic rounding."""
    if not isinstance(checkpoint_out, Quantized):
        store(_rows_of(checkpoint_out, rows, True), S, tmask)
        return
    noise = 0.5
    if checkpoint.seed is not None:
        noise = rounding_uniforms(load_scalar(checkpoint.seed, jnp.uint32), row_ids[:, None],
                                  lane_ids(S.shape[1])[None, :], K)
    values, scale = quantize_rows(S, checkpoint_out.values.dtype, noise)
    store(_rows_of(checkpoint_out.values, rows, True), values, tmask)
    store(_rows_of(checkpoint_out.scale, rows, False), scale, rmask)


def tile_row_ids(tiling, split, rows) -> jax.Array:
    """i32[block_v]: the global state rows of the tile `rows` (a `pl.ds`
    relative to the program's block of block_v * tiles rows) of program
    `split` along the rows, under `tiling` (a ReplayConfig)."""
    return split * (tiling.tiles * tiling.block_v) + rows.start + lane_ids(tiling.block_v)


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


class SlotView:
    """One slot of a pooled ref (a state pool's block that spans the whole slot axis, axis 0).

    squeezed: the launch's batch axis is squeezed, so the view is a ref of
    the remaining axes (`view.at[idx]` is `ref.at[(slot, *idx)]`);
    otherwise a block of one batch row (`view.at[(0, *idx)]` is
    `ref.at[(slot, *idx)]`). One indexing step, as :class:`RowRef`, so a
    `RowRef` of a view indexes the pool once.
    """

    def __init__(self, ref, slot, squeezed: bool):
        self.ref, self.slot, self.squeezed = ref, slot, squeezed
        self.shape = tuple(ref.shape[1:]) if squeezed else (1, *ref.shape[1:])
        self.dtype = ref.dtype

    def _index(self, idx):
        idx = idx if isinstance(idx, tuple) else (idx,)
        if self.squeezed:
            return (self.slot, *idx)
        return (self.slot + idx[0], *idx[1:])

    @property
    def at(self):
        return _RowAt(self)

    def __getitem__(self, idx):
        return self.ref[self._index(idx)]

    def __setitem__(self, idx, value):
        self.ref[self._index(idx)] = value

    def whole(self):
        """The slot's block as a ref (for a load or store of all of it)."""
        return self.ref.at[self.slot] if self.squeezed else self.ref.at[pl.ds(self.slot, 1)]


class _RowAt:
    def __init__(self, view: RowRef | SlotView):
        self.view = view

    def __getitem__(self, idx):
        return self.view.ref.at[self.view._index(idx)]


# The program ids of the kernel being traced, read at its top level (`hoisted_program_ids`).
_GRID: list[tuple] = []


def program_id(axis: int) -> jax.Array:
    """`pl.program_id(axis)`, or within `hoisted_program_ids` the id read at the kernel's top level."""
    return _GRID[-1][axis] if _GRID else pl.program_id(axis)


@contextlib.contextmanager
def hoisted_program_ids(ndim: int, launch_axes: tuple[int, ...] | None = None):
    """Read the `ndim` program ids here, at a kernel's top level, for the `program_id` calls of the
    body traced within (interpret mode cannot read a program id inside a branch, such as the
    `pl.when` that skips a state pool's padding rows). launch_axes: the launch grid's axis of
    each of the kernel's grid axes (None: the same axes). Within an outer `hoisted_program_ids`
    (the launch's, `launch.pallas_call`) the ids read there stand."""
    if _GRID:
        yield
        return
    _GRID.append(tuple(pl.program_id(axis) for axis in (launch_axes or range(ndim))))
    try:
        yield
    finally:
        _GRID.pop()


def row_ids(BV: int) -> jax.Array:
    """Global state-row indices of this program's tile (grid axis 2 = row block)."""
    return program_id(2) * BV + jax.lax.broadcasted_iota(jnp.int32, (BV,), 0)


def lane_ids(n: int) -> jax.Array:
    """i32[n], 0 .. n - 1."""
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


def row_mask(BV: int, V: int):
    """bool[BV], rows of this program's tile inside [0, V); None if statically all true."""
    return None if V % BV == 0 else row_ids(BV) < V


def lane_mask(B: int, n: int):
    """bool[B], lanes < n; None if B == n (statically all true)."""
    return None if B == n else lane_ids(B) < n


def tile_mask(rows, cols, shape):
    """The 2-D mask rows[:, None] & cols[None, :] of `shape`; None stands for all true."""
    if rows is None and cols is None:
        return None
    if rows is None:
        return jnp.broadcast_to(cols[None, :], shape)
    if cols is None:
        return jnp.broadcast_to(rows[:, None], shape)
    return rows[:, None] & cols[None, :]


def mask_and(mask, cond, shape):
    """mask & cond (cond a bool scalar or array), as an array of `shape`; mask None stands for all true."""
    cond = jnp.broadcast_to(cond, shape)
    return cond if mask is None else mask & cond


def load(ref, mask, dtype=f32):
    """Load (zeros where `mask` is false; None: no mask), cast to `dtype`."""
    if isinstance(ref, (RowRef, SlotView)):
        ref = ref.whole()
    if mask is None:
        return plgpu.load(ref).astype(dtype)
    return plgpu.load(ref, mask=mask, other=0).astype(dtype)


def store(ref, value, mask):
    """Store `value`, cast to the ref's dtype, where `mask` (None: everywhere)."""
    if isinstance(ref, (RowRef, SlotView)):
        ref = ref.whole()
    plgpu.store(ref, value.astype(ref.dtype), mask=mask)


def load_scalar(ref, dtype=f32):
    """A 0-d block's value in `dtype`."""
    return ref[()].astype(dtype)


def load_slots(ref, L: int, cols=None, dtype=f32):
    """All slots of a buffer tile, [BL] or [BL, n] in `dtype`; the padded slots (>= L) zero.

    cols: bool[n] or None, the valid columns of a 2-D tile.
    """
    slots = lane_mask(ref.shape[0], L)
    return load(ref, slots if len(ref.shape) == 1 else tile_mask(slots, cols, tuple(ref.shape)), dtype)


def load_live_only(ref, live, cols=None, dtype=f32):
    """A buffer tile [BL] or [BL, n] in `dtype`, its dead slots neither read nor used (zeros).

    live: bool[BL], the live slots; cols: bool[n] or None, the valid columns
    of a 2-D tile. Unlike :func:`load_live`, the load waits for the cursor,
    and the dead slots' bytes are not moved: a launch whose work after the
    load is short, and whose buffer bytes dominate, reads half the buffer
    on average (the Mamba-2 launch after the Mosaic GPU readout: 44.1 us
    against 49.8 at batch 256 on the H200; the GDN append route's prelude:
    9.7 us against 11.0; bench/RESULTS.md, 2026-12-03).
    """
    mask = live if len(ref.shape) == 1 else tile_mask(live, cols, tuple(ref.shape))
    return load(ref, mask, dtype)


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


# Whether the kernel being traced compiles for the GPU through Triton (`triton_arithmetic`, which
# `launch.pallas_call` enters for a launch that is not interpreted): there `fma` is one instruction.
_TRITON: list[bool] = []


@contextlib.contextmanager
def triton_arithmetic(compiled: bool):
    """Trace the kernel body within as compiled by Triton for the GPU (`compiled`) or as interpreted."""
    _TRITON.append(compiled)
    try:
        yield
    finally:
        _TRITON.pop()


def fma(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """a * b + c in f32, broadcast to one shape, rounded once in a compiled kernel.

    XLA's Triton path leaves a kernel's products and sums unfused (our GDN
    standard step's SASS: 1.8 M FFMA executed against 44 M FMUL and FADD at
    batch 256; vLLM's kernel of the same math, built by upstream Triton,
    which contracts by default: 11.1 M FFMA against 21 M). In a
    kernel traced within `triton_arithmetic(True)` this is one PTX
    fma.rn.f32 per element (inline assembly); interpreted, a * b + c (two
    roundings: the results differ in the last bit). Measured in the
    standard steps (batch 64-512, bench/RESULTS.md, 2026-12-05): the GDN
    state update fused took 0.9-1.0% less kernel time on an f32 state (H100
    and H200); on a bf16 one 9-11% more on the H100 and the same on the
    H200; Mamba-2's moved by under 0.4% either way (H100). So only the GDN
    step on an f32 state uses it.
    """
    if not (_TRITON and _TRITON[-1]):
        return a * b + c
    shape = jnp.broadcast_shapes(a.shape, b.shape, c.shape)
    operands = [jnp.broadcast_to(x.astype(f32), shape) for x in (a, b, c)]
    [out] = plgpu.elementwise_inline_asm("fma.rn.f32 $0, $1, $2, $3;", args=operands, constraints="=f,f,f,f",
                                         pack=1, result_shape_dtypes=[jax.ShapeDtypeStruct(shape, f32)])
    return out


def matvec(S: jax.Array, vec: jax.Array) -> jax.Array:
    """S f32[BV, BK] times vec f32[BK] -> f32[BV]."""
    return jnp.sum(S * vec[None, :], axis=1)


def for_each_row_tile(V: int, tiling, split, tile) -> None:
    """Run `tile(rows, row_mask)` over this program's row tiles.

    tiling: a ReplayConfig (its block_v rows per tile, `tiles` tiles per
    program). split: the program's index along the rows (`pl.program_id(2)`,
    read at the kernel's top level: interpret mode cannot read it inside a
    branch). rows: a `pl.ds` of block_v rows, relative to the program's block
    of block_v * tiles rows; row_mask: bool[block_v] (rows < V), None when V
    is a multiple of block_v.
    """
    BV, tiles = tiling.block_v, tiling.tiles
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


def pick_row(tile: jax.Array, t) -> jax.Array:
    """Row t (an int or an i32 scalar) of a register tile f32[n, ...] -> f32[...]: a select and a sum over
    the rows (Triton has no slice of a register tile), so a NaN or inf in another row never reaches the
    result."""
    rows = lane_ids(tile.shape[0]).reshape((-1,) + (1,) * (tile.ndim - 1))
    return jnp.sum(jnp.where(rows == t, tile, jnp.zeros((), tile.dtype)), axis=0)


def store_window(slot_ref, window: jax.Array, W: int, mask) -> None:
    """Store rows 0 .. W - 1 of a window's register tile [BW, n], row t
    through slot_ref(t) (the [n] ref of window step t's buffer slot), where
    `mask` (bool[n] or None: everywhere). A static loop over the W steps."""
    for t in range(W):
        store(slot_ref(t), pick_row(window, t), mask)
