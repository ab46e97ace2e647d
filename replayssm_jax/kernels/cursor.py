"""The cursor of a replay step in the kernels: which rows flush, and the cursor after the step.

A row's cursor (i32, 0..L) counts its buffered records. A replay step
appends its record at slot `cursor` and moves the cursor to cursor + 1, or
to 0 where the step flushes (`next_cursor`).

A one-launch replay step (fused flush, direct route) moves the cursor in
place, without a copy into the caller's carry. Every program of a row reads
the row's cursor, so none may overwrite it before the others have read it.
So each program, after its read, adds ARRIVAL to the cursor (an atomic add,
which leaves the low bits, the cursor itself, unchanged) and the program
whose add completes the count stores the new cursor (`advance_cursor`).
Between launches the high bits are zero again: the array holds plain
cursors 0..L.

On the append and deferred routes, which flush in no replay kernel, the
cursor moves in place in the Mosaic GPU steps' Triton launch (GDN: the
prelude; Mamba-2: the launch after the readout), and by an XLA op after
the Triton replay kernel. Where the batch is a multiple of 4, the GDN
readout moves it instead, without atomics: its prelude writes each row's
cursor at entry to a fresh array and leaves the cursor as it was, and
one program of the readout, which reads only that array, stores the new
cursors in place (`tma_readout.readout_moves_cursor`). The Mamba-2 readout
runs before its Triton launch, so it is the other way round there: one
program of the readout copies each row's cursor at entry to a fresh array,
the launch after it reads that copy, and each row's first program stores
the new cursor in place. The deferred
route's flush launch, which runs first, moves no cursor: the launches
after it read a full row as empty (`live_count`).

A two-launch step moves it in place without atomics: its replay kernel,
which reads the cursor in every program, writes each row's cursor at entry
to a fresh array (`store_entry_cursor`), and its flush launch reads only
that array, so that one program per block of rows may store the new
cursors in place (`store_next_cursors`). No cursor is copied into the
caller's carry by either step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from replayssm_jax.kernels.tiles import RowRef, SlotView, lane_ids, load, store

ARRIVAL = 1 << 16
MAX_ROW_PROGRAMS = (1 << 15) - 1  # arrivals per row that fit in the int32 above the cursor's 16 bits


def cursor_spec(nb=None):
    """Block spec of the cursor array i32[batch]: nb rows (None: the program's one row, a block of 1)."""
    return pl.BlockSpec((nb or 1,), lambda b, h, j: (b,))


def read_cursor(cursor_ref) -> jax.Array:
    """The row's cursor (i32 scalar) from its block of 1: the low bits, whatever
    other programs' arrivals added above them."""
    return cursor_ref[0] & (ARRIVAL - 1)


def next_cursor(cursor, L: int):
    """The cursor after one replay step: cursor + 1, or 0 where the step flushes.

    A row flushes when its cursor reaches L with this step (cursor == L - 1)
    or when it entered full (cursor == L, possible only after a speculative
    commit): then the flush absorbs the L buffered steps and this one.
    """
    return jnp.where(cursor >= L - 1, 0, cursor + 1).astype(jnp.int32)


def live_count(cursor, L: int, route: str):
    """The row's live records as a replay step on `route` reads them: the
    cursor, except on the deferred route, where a full row (cursor == L)
    has none: that route's first launch flushed its L records, without
    moving its cursor (the launches after it move it, to 1)."""
    return jnp.where(cursor >= L, 0, cursor).astype(jnp.int32) if route == "deferred" else cursor


def advance_cursor(cursor_ref, cursor, new, programs: int) -> None:
    """Move the row's cursor from `cursor` to `new` in place, once all `programs`
    programs of the row (at most MAX_ROW_PROGRAMS, checked by the entry
    points) have read it.

    Every program of the row calls this after its `read_cursor`. Nothing is
    written where new == cursor (the same in every program of the row).
    """

    @pl.when(new != cursor)
    def _():
        ref, index = cursor_ref, (jnp.int32(0),)
        if isinstance(cursor_ref, SlotView):  # a state pool's cursor: the slot's
            ref, index = cursor_ref.ref, cursor_ref._index(index)
        before = plgpu.atomic_add(ref, index, jnp.int32(ARRIVAL))

        @pl.when(before >> 16 == programs - 1)  # the last of the row's programs to arrive
        def _():
            cursor_ref[0] = new


def store_entry_cursor(entry_ref, cursor, writer) -> None:
    """Store the row's cursor at entry (i32 scalar `cursor`) into the fresh
    array i32[batch] of a two-launch step, from the one program where
    `writer`: its flush launch reads that copy, not the cursor that it moves."""

    @pl.when(writer)
    def _():
        entry_ref[0] = cursor


def store_next_cursors(entry_ref, cursor_out_ref, L: int, writer) -> None:
    """Store the cursors after this step (`next_cursor` of the block's cursors
    at entry, entry_ref i32[nb]) in place into cursor_out_ref, from the one
    program of the block where `writer` (the flush launch of a two-launch
    step, which reads no cursor but the entry copy)."""

    @pl.when(writer)
    def _():
        store(cursor_out_ref, next_cursor(load(entry_ref, None, jnp.int32), L), None)


def for_each_flushing_row(cursor_ref, L: int, flush, first: int | None = None) -> None:
    """Run flush(row, cursor) for each batch row of the program's block whose
    buffer is full after this step (cursor at entry >= L - 1), or, given
    `first`, whose cursor at entry is >= first (a verify window of W steps:
    first = L - W + 1, the rows with cursor + W > L).

    cursor_ref: the block's cursors, i32[nb]. row(ref) -> RowRef(ref, r), the
    flushing row r of a block whose first axis is the block's batch rows.
    The block's cursors are read in one load, so a program waits for one
    load before it knows its rows (a load per row made every program wait
    for each in turn), and a program with no flushing row stops there.
    """
    rows = cursor_ref.shape[0]
    first = L - 1 if first is None else first
    cursors = load(cursor_ref, None, jnp.int32)
    full = cursors >= first

    def row(r, carry):
        cursor = jnp.sum(jnp.where(lane_ids(rows) == r, cursors, 0))

        @pl.when(cursor >= first)
        def _():
            flush(lambda ref: RowRef(ref, r), cursor)

        return carry

    @pl.when(jnp.max(full.astype(jnp.int32)) > 0)
    def _():
        jax.lax.fori_loop(0, rows, row, 0)
