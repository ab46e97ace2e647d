"""pallas_call plumbing shared by both layers' kernels: the Triton compiler
parameters, the standard step's launch (also the direct route's), the
per-draft standard verify's launch and the replay step's launches (replay
kernel, flush launch), with their aliasing and the kernel names that
profiles show.

A layer describes its launches by its block specs (:class:`BlockSpecs`,
for programs of a given number of state rows and batch rows) and its
kernel bodies; the operands are grouped as the kernels take their refs:
the state (or checkpoint), the step's inputs and the buffered records as
named tuples (an absent optional input: None), and the cursor.

Over a state pool (:class:`Pool`: the state operands hold `capacity` slots
and batch row b steps slot slots[b]) the step, replay, verify and per-draft
launches take the same kernels: the state operands' blocks span the slot
axis, each program views its slot (`tiles.SlotView`) and runs the kernel
where the slot is not -1 (a padding row: no read, no write). No copy of a
state is made; an 8-bit checkpoint's values, scales and rounding seeds
(`tiles.Quantized`) are pooled operands alike.

The lowering (Pallas on Triton) is private to this package. Pallas warns
that its Triton backend is deprecated; this module silences exactly that
message (the Mosaic GPU kernels, `tma_readout` and `tma_step`, are its successors).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from replayssm_jax.kernels.config import NO_FLUSH_ROUTES, ReplayConfig, StepConfig, default_flush_rows, next_pow2
from replayssm_jax.kernels.cursor import (advance_cursor, cursor_spec, for_each_flushing_row, live_count, next_cursor,
                                          store_entry_cursor, store_next_cursors)
from replayssm_jax.kernels.tiles import (Quantized, SlotView, for_each_row_tile, hoisted_program_ids, lane_ids,
                                         mask_and, program_id, store, store_window, triton_arithmetic)
from replayssm_jax.state import advance_counter, row_seeds, step_writes, window_writes

# Pallas warns, when it lowers a Triton kernel (at the outermost jit's
# lowering, not at the call), that the Triton backend is deprecated. Silence
# exactly that message; every other warning stays.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)


class BlockSpecs(NamedTuple):
    """A layer's block specs for programs of R state rows and nb batch rows.

    state: the state / checkpoint [batch, heads, V, K]; inputs: the step's
    inputs (the layer's named tuple, None for an absent optional input);
    out: the output [batch, heads, V]; records: the buffers (the layer's
    named tuple; None where the launch has none).
    """

    state: pl.BlockSpec
    inputs: Any
    out: pl.BlockSpec
    records: Any


def triton_params(num_warps: int, num_stages: int = 1):
    """The Triton compiler params of a launch: warps per program, software-pipelining stages."""
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


# Elements of a per-head launch's largest tile per warp (`head_work_warps`). With one warp for a 16 x 128
# tile (the GDN prelude at Qwen3.5-4B's layer, L = 16) that launch took 10.5 us at batch 256 on the H200,
# 11.0 with 2 warps and 13.4 with 4 (2026-12-03); larger tiles get more warps, so that no thread holds
# more of it (not measured).
HEAD_TILE_PER_WARP = 2048


def head_work_warps(elements: int) -> int:
    """Warps of a program of a per-head launch (no state tile) whose largest tile has `elements`
    elements: one per HEAD_TILE_PER_WARP, 1 to 8."""
    return min(8, max(1, elements // HEAD_TILE_PER_WARP))


def pallas_call(kernel, *, interpret: bool, config: StepConfig | ReplayConfig, grid=(), in_specs=None,
                out_specs=None, **kwargs):
    """`pl.pallas_call` with the Triton compiler params (num_warps, num_stages) of `config`.

    A kernel grid of three axes (batch rows, heads, row tiles), when
    `config.memory_order`, is launched reversed: the GPU starts programs
    with the launch grid's first axis fastest, so programs that run at the
    same time then work on neighbouring state tiles. The kernel and its
    block specs still see the (batch, heads, row tiles) grid.
    """
    if len(grid) == 3 and config.memory_order:
        kernel, grid, in_specs, out_specs = _launched_reversed(kernel, grid, in_specs, out_specs)

    def traced(*refs):
        with triton_arithmetic(not interpret):
            kernel(*refs)

    return pl.pallas_call(
        traced,
        interpret=interpret,
        compiler_params=triton_params(config.num_warps, config.num_stages),
        grid=grid,
        **({} if in_specs is None else dict(in_specs=in_specs)),
        **({} if out_specs is None else dict(out_specs=out_specs)),
        **kwargs,
    )


def _launched_reversed(kernel, grid, in_specs, out_specs):
    """(kernel, grid, in_specs, out_specs) of a launch on the reversed grid that runs `kernel` on `grid`."""

    def reversed_spec(spec):
        if spec.index_map is None:
            return spec
        index_map = spec.index_map
        return dataclasses.replace(spec, index_map=lambda *ids: index_map(*ids[::-1]))

    def run(*refs):
        with hoisted_program_ids(3, launch_axes=(2, 1, 0)):
            kernel(*refs)

    specs = [None if x is None else jax.tree.map(reversed_spec, x, is_leaf=_is_spec) for x in (in_specs, out_specs)]
    return run, tuple(grid[::-1]), *specs


class Pool(NamedTuple):
    """A launch over a state pool: the state operands hold `capacity` slots
    (axis 0) and the program of batch row b works on slot slots[b].

    slots: i32[batch], each in -1 .. capacity - 1, no slot twice (checked by
    the ops where concrete); -1: a padding row, whose programs read and
    write nothing (its outputs are left unwritten). Under jit, where slots
    are not checked, a slot outside 0 .. capacity - 1 is a padding row too.
    """

    slots: jax.Array
    capacity: int

    @property
    def batch(self) -> int:
        return self.slots.shape[0]


def pool_of(slots, state) -> Pool | None:
    """The :class:`Pool` of `slots` (None: no pool, None) over a state of `state.shape[0]` slots."""
    return None if slots is None else Pool(slots, state.shape[0])


def batch_shaped(state, slots):
    """`state` (an array), or over a pool (`slots` given) its shape with the batch of the slots
    (a ShapeDtypeStruct): the shape that the tiling heuristics see."""
    return state if slots is None else jax.ShapeDtypeStruct((slots.shape[0], *state.shape[1:]), state.dtype)


def _is_spec(x) -> bool:
    return isinstance(x, pl.BlockSpec)


def _pool_specs(specs, capacity: int):
    """`specs` (a tree of block specs) with the whole slot axis (axis 0) in each block: the program
    indexes it by its slot (a `SlotView`), as the kernels index a buffer by the cursor."""

    def whole_axis(spec):
        index_map = spec.index_map
        return pl.BlockSpec((capacity, *spec.block_shape[1:]), lambda *grid: (0, *index_map(*grid)[1:]))

    return jax.tree.map(whole_axis, specs, is_leaf=_is_spec)


def _slot_kernel(kernel, squeezed, capacity: int):
    """`kernel` over a state pool of `capacity` slots: kernel(*inputs,
    *outputs) with each pooled argument's refs replaced by their slot's
    `SlotView`s, run where the slot is in 0 .. capacity - 1 (-1, or a traced
    slot out of range: a padding row, no read and no write). squeezed: per
    argument (inputs, then outputs), None (not pooled) or a tree of bools
    (the launch's batch axis squeezed in that ref's block)."""

    def run(slots_ref, *args):
        with hoisted_program_ids(3):
            slot = slots_ref[0]
            live = (slot >= 0) & (slot < capacity)
            index = jnp.where(live, slot, 0)
            views = [arg if flags is None else jax.tree.map(lambda ref, sq: SlotView(ref, index, sq), arg, flags)
                     for arg, flags in zip(args, squeezed)]

            @pl.when(live)
            def _():
                kernel(*views)

    return run


def _launch(kernel, operands: tuple, *, in_specs: tuple, out_specs: tuple, out_shape: tuple, aliases: dict,
            pool: Pool | None = None, pooled_in: tuple = (), pooled_out: tuple = (), **kwargs):
    """`pallas_call(kernel, ...)(*operands)`; over a state pool (`pool` given)
    the pooled operands and outputs (flags `pooled_in`, `pooled_out`, one
    per top-level argument) get blocks spanning the slot axis, and the
    slots come first (a block of one per batch row). A pooled output that
    no operand aliases holds the launch's writes only (its other slots
    are undefined)."""
    if pool is None:
        return pallas_call(kernel, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                           input_output_aliases=aliases, **kwargs)(*operands)
    squeezed = [jax.tree.map(lambda spec: spec.block_shape[0] is None, spec, is_leaf=_is_spec) if pooled else None
                for spec, pooled in zip((*in_specs, *out_specs), (*pooled_in, *pooled_out))]
    specs_in = tuple(_pool_specs(spec, pool.capacity) if pooled else spec for spec, pooled in zip(in_specs, pooled_in))
    specs_out = tuple(_pool_specs(spec, pool.capacity) if pooled else spec
                      for spec, pooled in zip(out_specs, pooled_out))
    aliases = {1 + i: o for i, o in aliases.items()}
    return pallas_call(_slot_kernel(kernel, squeezed, pool.capacity), in_specs=(cursor_spec(), *specs_in),
                       out_specs=specs_out, out_shape=out_shape, input_output_aliases=aliases,
                       **kwargs)(pool.slots, *operands)


def _shapes(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), tree)


def _num_leaves(tree) -> int:
    return len(jax.tree.leaves(tree))


def checkpoint_operand(state):
    """A replay state's checkpoint as a launch takes it: the array (f32 |
    bf16), or a :class:`~replayssm_jax.kernels.tiles.Quantized` of values,
    scales and (stochastic rounding) the rows' seeds at their write counts."""
    if state.scale is None:
        return state.checkpoint
    seed = None if state.rounding == "nearest" else row_seeds(state.counter, state.checkpoint.shape[1])
    return Quantized(state.checkpoint, state.scale, seed)


def _written(checkpoint):
    """The checkpoint operand's leaves that a launch writes (a Quantized less its seed)."""
    return checkpoint._replace(seed=None) if isinstance(checkpoint, Quantized) else checkpoint


def _checkpoint_specs(state_spec: pl.BlockSpec, checkpoint, rows: int, nb=None, written: bool = False):
    """The block specs of a checkpoint operand of `rows` state rows and nb batch
    rows: `state_spec` for an array; for a Quantized one, the scale's rows
    and (not `written`: an input) the seed of the program's (row, head)."""
    if not isinstance(checkpoint, Quantized):
        return state_spec
    scale = pl.BlockSpec((nb, None, rows), lambda b, h, j: (b, h, j))
    seed = None if written or checkpoint.seed is None else pl.BlockSpec((nb, None), lambda b, h, j: (b, h))
    return Quantized(state_spec, scale, seed)


def _with_checkpoint(state, checkpoint, written_rows, **changes):
    """`state` with the launches' checkpoint (and scale) and `changes`; an 8-bit
    checkpoint's write count advanced in `written_rows` (bool[batch]; None
    for an f32 | bf16 checkpoint)."""
    if isinstance(checkpoint, Quantized):
        state = advance_counter(state, written_rows).replace(scale=checkpoint.scale)
        checkpoint = checkpoint.values
    return state.replace(checkpoint=checkpoint, **changes)


def step_launch(layer: str, kernel, block_specs: Callable[..., BlockSpecs], state, inputs, out_shape, records=None,
                cursor=None, *, config: StepConfig, interpret: bool, pool: Pool | None = None, ring=None):
    """Launch a layer's standard step kernel; its state (operand 0) is updated in place (output 1).

    Grid (batch, heads, cdiv(V, block_v)), one state tile per program.
    kernel(state_ref, inputs, records, cursor_ref, out_ref, state_out_ref,
    cursor_out_ref, *, programs), programs = heads x row tiles (the row's
    programs). With the buffered `records` and `cursor` i32[batch] of a
    replay state whose checkpoint is `state`, the direct route: they follow
    the inputs, and the cursor is an output in place; otherwise their refs
    are None. block_specs(rows, nb) -> BlockSpecs (records None without a
    buffer). pool: a :class:`Pool` (state, records and cursor hold its
    slots, the grid's batch is the slots'), or None. ring: None, or
    (operands, specs) of a fused conv (`gdn.ConvOperands`, no pool): they
    follow the cursor, their first leaf (the conv's ring) is written in
    place as a fourth output, and the kernel is called as
    kernel(state_ref, inputs, records, cursor_ref, ring_refs, out_ref,
    state_out_ref, cursor_out_ref, ring_out_ref, *, programs).

    Returns (output, state, new cursor or None), and the ring with `ring`.
    """
    if ring is not None and pool is not None:  # no op passes both: ops.gdn_conv_step takes no slots
        raise NotImplementedError("step_launch: a fused conv (`ring`) over a state pool (`pool`): the pool's rows "
                                  "would need their rings gathered by slot; decode a pool with the conv apart")
    direct = records is not None
    specs = block_specs(config.block_v, None)
    row_cursor = cursor_spec() if direct else None
    n_written = _num_leaves(_written(state))
    aliases = {i: 1 + i for i in range(n_written)}
    if direct:  # the cursor, after the state, inputs and records
        aliases[_num_leaves((state, inputs, records))] = 1 + n_written
    batch, heads, V, _ = state.shape
    grid = (batch if pool is None else pool.batch, heads, pl.cdiv(V, config.block_v))
    operands = (state, inputs, records, cursor)
    in_specs = (_checkpoint_specs(specs.state, state, config.block_v), specs.inputs, specs.records, row_cursor)
    out_specs = (specs.out, _checkpoint_specs(specs.state, state, config.block_v, written=True), row_cursor)
    out_shape = (out_shape, _shapes(_written(state)), _shapes(cursor))
    if ring is not None:  # the ring (its operands' first leaf) in place, after the cursor
        aliases[_num_leaves(operands)] = 1 + n_written + direct
        ring_leaf, ring_spec = jax.tree.leaves(ring[0])[0], jax.tree.leaves(ring[1], is_leaf=_is_spec)[0]
        operands, in_specs = (*operands, ring[0]), (*in_specs, ring[1])
        out_specs, out_shape = (*out_specs, ring_spec), (*out_shape, _shapes(ring_leaf))
    return _launch(
        functools.partial(kernel, programs=grid[1] * grid[2]),
        operands,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        aliases=aliases,
        pool=pool,
        pooled_in=(True, False, direct, direct),
        pooled_out=(False, True, direct),
        interpret=interpret,
        config=config,
        name=f"{layer}_{'direct' if direct else 'step'}{'' if ring is None else '_conv'}"
             f"{'' if pool is None else '_pool'}_{config.tag()}",
    )


def _replay_specs(block_specs, tiling: ReplayConfig, checkpoint, nb=None, pool: Pool | None = None):
    """(grid, in_specs, out_specs) of the replay kernel's operands for programs of
    tiling.tiles row tiles and nb batch rows (None: one row, the batch axis squeezed);
    the grid's batch is the pool's slots where `pool` is given."""
    batch, heads, V, _ = checkpoint.shape
    batch = batch if pool is None else pool.batch
    rows = tiling.block_v * tiling.tiles
    specs = block_specs(rows, nb)
    row_cursor = cursor_spec(nb)
    grid = (batch // (nb or 1), heads, tiling.splits(V))
    return (grid, (_checkpoint_specs(specs.state, checkpoint, rows, nb), specs.records, row_cursor, specs.inputs),
            (specs.out, _checkpoint_specs(specs.state, checkpoint, rows, nb, written=True), specs.records, row_cursor))


def replay_launch(layer: str, replay_kernel, flush_row, block_specs: Callable[..., BlockSpecs], checkpoint, records,
                  cursor, inputs, out_shape, *, per_head: tuple[str, ...], route: str, config: ReplayConfig,
                  interpret: bool, pool: Pool | None = None):
    """The replay step's launches: the replay kernel, then (config.fused_flush
    False, a route other than "append" and "deferred") the flush launch.
    Checkpoint and records are updated in place. On the append and deferred
    routes the replay kernel flushes no row and an XLA op after it moves the
    cursor, min(cursor + 1, L), from 0 for a full row on the deferred route
    (`cursor.live_count`; its flush launch, `flush_full_launch`, ran before:
    the caller's) (moved in place in the kernel, with the arrival count of
    `cursor.advance_cursor`, it cost more than the flush launch it saves:
    bench/RESULTS.md, 2026-12-02).

    replay_kernel(checkpoint_ref, records, cursor_ref, inputs, out_ref,
    checkpoint_out, records_out, cursor_out, *, config, programs): grid
    (batch, heads, config.splits(V)); programs = the row's programs. A
    one-launch step (fused flush) moves the cursor in place (cursor_out is
    the cursor); in a two-launch step cursor_out is a fresh array of the
    cursors at entry, which the flush launch reads while it moves the
    cursor in place (`cursor.store_next_cursors`).

    flush_row(checkpoint_ref, records, inputs, checkpoint_out, *, cursor,
    split, config): writes one flushing row's state (the refs: that row's,
    as RowRef views in the flush launch). The flush launch runs it with
    one row tile per program (a flushing row's tiles run in parallel) and
    a block of batch rows: the config's flush fields, or by default the
    replay kernel's tile and `default_flush_rows(batch)` rows (the entry
    points have checked that config.flush_rows divides the batch).
    per_head: the fields of `inputs` without a batch axis, which the flush
    launch reads whole. pool: a :class:`Pool` (checkpoint, records and
    cursor hold its slots), or None; over a pool the flush launch takes one
    batch row per program (its rows' slots are not contiguous).

    Returns (output, checkpoint, records, new cursor).
    """
    grid, in_specs, out_specs = _replay_specs(block_specs, config, checkpoint, pool=pool)
    n_records = _num_leaves(records)
    n_in, n_out = _num_leaves(checkpoint), _num_leaves(_written(checkpoint))
    aliases = {i: 1 + i for i in range(n_out)}  # checkpoint and records in place
    aliases.update({n_in + i: 1 + n_out + i for i in range(n_records)})
    one_launch = config.fused_flush and route not in NO_FLUSH_ROUTES
    if one_launch:
        aliases[n_in + n_records] = 1 + n_out + n_records  # one launch: the cursor in place
    operand = checkpoint
    out, checkpoint, records, moved = _launch(
        functools.partial(replay_kernel, config=config, programs=grid[1] * grid[2]),
        (checkpoint, records, cursor, inputs),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=(out_shape, _shapes(_written(checkpoint)), _shapes(records), _shapes(cursor)),
        aliases=aliases,
        pool=pool,
        pooled_in=(True, True, True, False),
        pooled_out=(False, True, True, True),
        interpret=interpret,
        config=config,
        name=f"{layer}_replay_{route}_L{records[0].shape[2]}{'' if pool is None else '_pool'}_{config.tag()}",
    )
    if one_launch:
        return out, checkpoint, records, moved
    if route in NO_FLUSH_ROUTES:  # no flush; `moved` is not written
        L = records[0].shape[2]
        step = lambda rows: jnp.minimum(live_count(rows, L, route) + 1, L)  # noqa: E731
        return out, checkpoint, records, step(cursor) if pool is None else on_pool_rows(cursor, pool, step)
    # `moved` holds the cursors at entry; the flush reads the seeds of the replay kernel's operand
    checkpoint, cursor = _flush_launch(layer, flush_row, block_specs, _reseeded(checkpoint, operand), records, moved,
                                       inputs, per_head=per_head, config=config, interpret=interpret, pool=pool,
                                       cursor=cursor)
    return out, checkpoint, records, cursor


def _reseeded(written, operand):
    """The checkpoint `written` by a launch as the next launch's operand: with `operand`'s seed."""
    return written._replace(seed=operand.seed) if isinstance(written, Quantized) else written


def run_replay_program(tile, flush_row, *, V: int, L: int, config: ReplayConfig, split, count, append, group: int,
                       decay_record, decay_out, key, key_out, key_mask, cursor_out, programs: int,
                       flush: bool = True) -> None:
    """The replay kernel's program after its per-head work (see `replay_launch`).

    Runs tile(rows, row_mask) over the program's row tiles (the readout,
    which also stores the program's rows of the new update record); with
    config.fused_flush, then flush_row(config=its sub-tiling) where the
    row's buffer is full after this step (count >= L - 1). flush=False
    (the append and deferred routes): no flush, fused or launched, and no
    cursor written (the launch moves it). Then the row's
    shared records at slot `count` where `append` (the row has a free slot):
    the log decay decay_record() (f32 scalar, formed here) into decay_out
    f32[BL] by the head's first program, the key f32[BK] (valid lanes
    key_mask) into key_out by the first program of the first head of each
    key group of `group` heads, so that no element has two writers. Last,
    the cursor: moved in place by a one-launch step (`advance_cursor`,
    `programs` programs per row); otherwise its value at entry stored to
    the fresh array cursor_out by the first program of head 0, for the flush
    launch, which moves the cursor.
    split: `pl.program_id(2)`, read at the kernel's top level.
    """
    for_each_row_tile(V, config, split, tile)
    if config.fused_flush and flush:

        @pl.when(count >= L - 1)
        def _():
            flush_row(config=config.fused_flush_tiling())

    first = split == 0
    BL = decay_out.shape[0]
    store(decay_out, jnp.broadcast_to(decay_record(), (BL,)), (lane_ids(BL) == count) & append & first)
    leader = first & (program_id(1) % group == 0)
    store(key_out.at[count], key, mask_and(key_mask, append & leader, key.shape))
    if not flush:  # the append route: the launch moves the cursor
        return
    if config.fused_flush:  # one launch: the cursor moves in place
        advance_cursor(cursor_out, count, next_cursor(count, L), programs)
    else:  # the flush launch reads this copy and moves the cursor
        store_entry_cursor(cursor_out, count, first & (program_id(1) == 0))


def run_verify_program(tile, *, V: int, W: int, config: ReplayConfig, split, start, group: int, decay_window,
                       decay_out, keys, key_out, key_mask) -> None:
    """The verify kernel's program after its per-head work (see `verify_launch`).

    Runs tile(rows, row_mask) over the program's row tiles (the W outputs,
    and the program's rows of the W update records). Then the row's shared
    records at slots start .. start + W - 1 (start: the window's first slot,
    `window_start`): the log decays decay_window f32[BW] (window step t in
    lane t) into decay_out f32[BL] by the head's first program, the keys
    f32[BW, BK] (valid lanes key_mask) into key_out [BL, BK] by the first
    program of the first head of each key group of `group` heads, so that
    no element has two writers. split: `pl.program_id(2)`, read at the
    kernel's top level.
    """
    for_each_row_tile(V, config, split, tile)
    first = split == 0
    step = lane_ids(decay_out.shape[0]) - start  # the window step of each slot
    steps = lane_ids(decay_window.shape[0])
    decays = jnp.sum(jnp.where(step[:, None] == steps[None, :], decay_window[None, :], 0.0), axis=1)
    store(decay_out, decays, (step >= 0) & (step < W) & first)
    leader = first & (program_id(1) % group == 0)
    store_window(lambda t: key_out.at[start + t], keys, W, mask_and(key_mask, leader, keys.shape[1:]))


def _row_views(refs, row, per_head=()):
    """The named tuple `refs` with each ref but those named in `per_head` (and None) replaced by row(ref);
    None for None."""
    if refs is None:
        return None
    return refs._replace(**{name: row(ref) for name, ref in refs._asdict().items()
                            if ref is not None and name not in per_head})


def _checkpoint_view(checkpoint, row):
    """row(ref) of a checkpoint ref, or of each ref of a Quantized one."""
    return _row_views(checkpoint, row) if isinstance(checkpoint, Quantized) else row(checkpoint)


def _flush_kernel(checkpoint_ref, records, cursor_ref, inputs, *outputs, L, flush_row, per_head, first):
    """The flush launch: a program holds one row tile of one head for a block of batch rows. outputs:
    (checkpoint_out,), or (cursor, checkpoint_out, cursor_out) where the launch also moves the cursor
    (cursor_ref: the cursors at entry; cursor, the array moved, is not read)."""
    checkpoint_out, cursor_out = (outputs[0], None) if len(outputs) == 1 else outputs[1:]
    head, split = program_id(1), program_id(2)  # read here: interpret mode cannot read them inside a branch

    def flush(row, cursor):
        flush_row(_checkpoint_view(checkpoint_ref, row), _row_views(records, row), _row_views(inputs, row, per_head),
                  _checkpoint_view(checkpoint_out, row), cursor=cursor, split=split)

    for_each_flushing_row(cursor_ref, L, flush, first)
    if cursor_out is not None:
        store_next_cursors(cursor_ref, cursor_out, L, (head == 0) & (split == 0))


def _present(specs, operands):
    """The named tuple of block specs `specs` with None where `operands` has None (None for None)."""
    if operands is None:
        return None
    return specs._replace(**{name: None for name, operand in operands._asdict().items() if operand is None})


def _flush_launch(layer, flush_row, block_specs, checkpoint, records, entry, inputs, *, per_head, config, interpret,
                  window=None, pool: Pool | None = None, cursor=None, kind: str = "verify"):
    """The flush launch of a two-launch replay step (see `replay_launch`), or
    (window W given) the early flush of a verify window (see
    `verify_launch`; kind "deferred": of the deferred route's step, W = 1,
    `flush_full_launch`), on the rows whose cursors at entry `entry`
    i32[batch] call for it; returns the checkpoint, updated in place, or,
    given the replay step's `cursor` (the array that `entry` copies),
    (checkpoint, cursor moved in place by one step). Over a `pool`: one
    batch row per program."""
    L = records[0].shape[2]
    rows = 1 if pool is not None else config.flush_rows or default_flush_rows(checkpoint.shape[0])
    tiling = config.flush_launch_tiling()
    grid, in_specs, out_specs = _replay_specs(block_specs, tiling, checkpoint, rows, pool=pool)
    first, name = None, f"{layer}_replay_flush_L{L}_{tiling.tag()}_r{rows}{'' if pool is None else '_pool'}"
    if window is not None:  # rows with cursor + W > L; the inputs this flush reads (absent ones None)
        first = L - window + 1
        what = f"verify_flush_W{window}" if kind == "verify" else f"{kind}_flush"
        name = f"{layer}_{what}_L{L}_{tiling.tag()}_r{rows}{'' if pool is None else '_pool'}"
        in_specs = (*in_specs[:3], _present(in_specs[3], inputs))
    kernel = functools.partial(_flush_kernel, L=L, flush_row=functools.partial(flush_row, config=tiling),
                               per_head=per_head, first=first)
    n_out = _num_leaves(_written(checkpoint))
    aliases = {i: i for i in range(n_out)}
    operands = (checkpoint, records, entry, inputs)
    out_specs, out_shape = (out_specs[1],), (_shapes(_written(checkpoint)),)
    if cursor is not None:  # the cursor, moved in place: the last operand and output
        aliases[_num_leaves(operands)] = n_out
        operands, in_specs = (*operands, cursor), (*in_specs, in_specs[2])
        out_specs, out_shape = (*out_specs, in_specs[2]), (*out_shape, _shapes(cursor))
    outs = _launch(
        kernel,
        operands,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        aliases=aliases,
        pool=pool,
        pooled_in=(True, True, True, False, True)[:len(operands)],
        pooled_out=(True, True)[:len(out_shape)],
        interpret=interpret,
        config=tiling,
        name=name,
    )
    return outs[0] if cursor is None else outs  # a Quantized checkpoint is itself a tuple


def flush_full_launch(layer: str, flush_row, block_specs: Callable[..., BlockSpecs], checkpoint, records, cursor,
                      inputs, *, per_head: tuple[str, ...], config: ReplayConfig, interpret: bool,
                      pool: Pool | None = None):
    """The deferred route's first launch: the replay step's flush launch
    (`_flush_launch`, config's flush tiling) for the rows whose buffer is
    full (cursor == L), flush_row(..., step=False) applying their L
    buffered records only, as a verify window's early flush of one step. It
    writes their checkpoint and moves no cursor: the append launches after
    it read a full row as empty (`cursor.live_count`) and move its cursor
    to 1. inputs: the layer's inputs that the flush reads (absent ones
    None), or None. Returns the checkpoint, updated in place, as the next
    launch's operand (an 8-bit one with its rounding seeds)."""
    written = _flush_launch(layer, flush_row, block_specs, checkpoint, records, cursor, inputs, per_head=per_head,
                            config=config, interpret=interpret, window=1, pool=pool, kind="deferred")
    return _reseeded(written, checkpoint)


def verify_launch(layer: str, verify_kernel, flush_row, block_specs: Callable[..., BlockSpecs], checkpoint, records,
                  cursor, inputs, flush_inputs, out_shape, *, window: int, per_head: tuple[str, ...],
                  config: ReplayConfig, interpret: bool, tree=None, pool: Pool | None = None):
    """A verify window's launches: the early flush, then the verify kernel.
    Checkpoint and records are updated in place.

    The early flush is the replay step's flush launch (`_flush_launch`) for
    the rows with cursor + W > L, its flush_row(..., step=False) applying
    a row's `cursor` buffered records only (no step of its own): it writes
    their checkpoint (their state after the buffered records) and skips the
    other rows. flush_inputs: the layer's inputs that flush reads (e.g.
    Mamba-2's A; the others None), or None.

    verify_kernel(checkpoint_ref, records, cursor_ref, inputs, out_ref,
    records_out, *, config): grid (batch, heads, config.splits(V)); it
    reads the checkpoint (after the flush: the flushed rows then verify from
    it with an empty buffer, cursor 0) and writes the W outputs and the W
    records at slots cursor .. cursor + W - 1. block_specs(rows, nb): the
    layer's block specs with the window axis on the inputs and the output.

    tree: the draft tree the kernel walks (not a chain), named in the
    launch's name; None: the window. pool: a :class:`Pool` (checkpoint,
    records and cursor hold its slots; both launches index them by slot,
    the early flush with one batch row per program), or None.

    Returns (output, checkpoint, records, new cursor: 0 for the flushed
    rows, the cursor otherwise; over a pool, the cursors of the slots
    outside the batch unchanged).
    """
    L = records[0].shape[2]
    checkpoint = _flush_launch(layer, flush_row, block_specs, checkpoint, records, cursor, flush_inputs,
                               per_head=per_head, config=config, interpret=interpret, window=window, pool=pool)
    grid, in_specs, out_specs = _replay_specs(block_specs, config, checkpoint, pool=pool)
    n_records, n_in = _num_leaves(records), _num_leaves(checkpoint)
    out, records = _launch(
        functools.partial(verify_kernel, config=config),
        (checkpoint, records, cursor, inputs),
        grid=grid,
        in_specs=in_specs,
        out_specs=(out_specs[0], out_specs[2]),
        out_shape=(out_shape, _shapes(records)),
        aliases={n_in + i: 1 + i for i in range(n_records)},  # the records in place
        pool=pool,
        pooled_in=(True, True, True, False),
        pooled_out=(False, True),
        interpret=interpret,
        config=config,
        name=f"{layer}_verify_W{window}_L{L}{'' if pool is None else '_pool'}_{config.tag()}"
             + ("" if tree is None else f"_{tree.tag()}"),
    )
    if pool is None:
        return out, checkpoint, records, window_start(cursor, L, window)
    return out, checkpoint, records, on_pool_rows(cursor, pool, lambda rows: window_start(rows, L, window))


def in_batch(rows, slots):
    """`rows` (bool[capacity], per slot of a pool) where the slot is one of `slots` (i32[batch]; -1:
    none), False elsewhere; `rows` itself without a pool (slots None)."""
    if slots is None:
        return rows
    target = jnp.where(slots < 0, rows.shape[0], slots)
    return rows & jnp.zeros_like(rows).at[target].set(True, mode="drop")


def on_pool_rows(array, pool: Pool, update):
    """`array` (a pool's per-slot array, slots on axis 0) with the rows of the pool's slots set to
    update(those rows) (an XLA gather and scatter of batch entries); the other slots and the padding
    rows (-1) unchanged."""
    target = jnp.where(pool.slots < 0, pool.capacity, pool.slots)  # out of range: dropped
    return array.at[target].set(update(array[jnp.maximum(pool.slots, 0)]), mode="drop")


def per_draft_launch(layer: str, kernel, block_specs: Callable[..., BlockSpecs], state, index, inputs, out_shape, *,
                     window: int, config: StepConfig, interpret: bool, tree=None, pool: Pool | None = None):
    """Launch a layer's per-draft verify kernel on a slotted standard state, updated in place (output 1).

    state [batch, slots, heads, V, K]; index i32[batch], the slot of each
    row's current state. Grid (batch, heads, cdiv(V, block_v)): a program
    holds its [block_v, K] tile of every slot of its row and head (a block
    of next_pow2(slots) slots). kernel(state_ref, index_ref, inputs,
    out_ref, state_out_ref) reads the tile of slot index once and writes
    the W outputs and the W states of its tile to the draft slots (never
    slot index: W < slots), so no program reads what another writes.
    block_specs(rows, nb): the layer's block specs with the window axis on
    the inputs and the output. tree: the draft tree the kernel walks (not a
    chain), named in the launch's name; None: the window. pool: a
    :class:`Pool` (state and index hold its slots: [capacity, slots, ...]
    and i32[capacity], the program of batch row b works on pool slot
    pool.slots[b]), or None.

    Returns (output, state).
    """
    batch, slots, heads, V, K = state.shape
    specs = block_specs(config.block_v, None)
    slotted = pl.BlockSpec((None, next_pow2(slots), None, config.block_v, next_pow2(K)),
                           lambda b, h, j: (b, 0, h, j, 0))
    grid = (batch if pool is None else pool.batch, heads, pl.cdiv(V, config.block_v))
    return _launch(
        kernel,
        (state, index, inputs),
        grid=grid,
        in_specs=(slotted, cursor_spec(), specs.inputs),
        out_specs=(specs.out, slotted),
        out_shape=(out_shape, _shapes(state)),
        aliases={0: 1},
        pool=pool,
        pooled_in=(True, True, False),
        pooled_out=(False, True),
        interpret=interpret,
        config=config,
        name=f"{layer}_per_draft_W{window}_S{slots}{'' if pool is None else '_pool'}_{config.tag()}"
             + ("" if tree is None else f"_{tree.tag()}"),
    )


def tree_option(tree) -> dict:
    """The verify's `tree` keyword for a draft tree that is not a chain; {} for None and for a chain (which
    runs the window's code, so that the chain's launches are the window's)."""
    return {} if tree is None or tree.is_chain else {"tree": tree}


def walk_tree(tree, S_0, step, replay) -> None:
    """A verify program's steps over the nodes of a draft tree (static, unrolled), in node order.

    step(j, S) -> S: node j's step from its parent's state S (writes node
    j's output and records); replay(j, S) -> S: the same step without
    writes. A node whose parent is the node just computed continues from
    its state (a chain's nodes cost what the window's steps cost); any
    other node restarts from S_0, the window's start state, and replays the
    nodes on its path first (its ancestors, root first).
    """
    S = S_0
    for j, parent in enumerate(tree.parents):  # the node indices as i32 scalars, as a loop's index
        if parent != j - 1:
            S = S_0
            for ancestor in tree.path(parent):
                S = replay(jnp.int32(ancestor), S)
        S = step(jnp.int32(j), S)


def run_window(tree, W: int, S_0, step, replay) -> None:
    """A verify program's W steps from S_0: step(t, S) -> S in a `fori_loop` for a chain (tree None), or
    the draft tree's nodes (`walk_tree`, replay(t, S) -> S the step without writes)."""
    if tree is None:
        jax.lax.fori_loop(0, W, step, S_0)
    else:
        walk_tree(tree, S_0, step, replay)


def window_start(cursor, L: int, W: int):
    """The slot of a verify window's first step, i32 (array or scalar): 0
    where the window does not fit behind the cursor (cursor + W > L: the
    early flush), the cursor otherwise."""
    return jnp.where(cursor + W > L, 0, cursor).astype(jnp.int32)


def verify_window(state, records, inputs, *, window: int, verify, slots=None):
    """A verify window of `window` steps on a layer's replay state.

    records: the state's buffers as the layer's named tuple. verify(
    checkpoint, records, cursor, inputs) -> (y, checkpoint, records,
    cursor): the verify launches. slots: None, or i32[batch], the state
    pool's slots of the batch rows (passed on to `verify`). Returns (y, new
    state with window = W).
    """
    written = None if state.scale is None else in_batch(window_writes(state, window), slots)
    options = {} if slots is None else {"slots": slots}
    y, checkpoint, records, cursor = verify(checkpoint_operand(state), records, state.cursor, inputs, **options)
    return y, _with_checkpoint(state, checkpoint, written, cursor=cursor, window=window, **records._asdict())


def replay_step(state, records, inputs, *, route: str, config: StepConfig | ReplayConfig, step, replay,
                slots=None):
    """One replay step of a layer's replay state on the route's launches.

    records: the state's buffers as the layer's named tuple (its fields
    named as the state's). step(checkpoint, inputs, records, cursor, *,
    config) -> (y, checkpoint, cursor): the standard step's kernel, the
    direct route. replay(checkpoint, records, cursor, inputs, *, route,
    config) -> (y, checkpoint, records, cursor): the replay launches.
    slots: None, or i32[batch], the state pool's slots of the batch rows
    (the state holds the pool; an 8-bit checkpoint's write counts advance
    in the batch's slots only), passed to both.

    Returns (y, new state).
    """
    # The rows an 8-bit write counts.
    written = None if state.scale is None else in_batch(step_writes(state, route), slots)
    options = {} if slots is None else {"slots": slots}
    if route == "direct":
        y, checkpoint, cursor = step(checkpoint_operand(state), inputs, records, state.cursor, config=config,
                                     **options)
        return y, _with_checkpoint(state, checkpoint, written, cursor=cursor)
    y, checkpoint, records, cursor = replay(checkpoint_operand(state), records, state.cursor, inputs, route=route,
                                            config=config, **options)
    return y, _with_checkpoint(state, checkpoint, written, cursor=cursor, **records._asdict())
