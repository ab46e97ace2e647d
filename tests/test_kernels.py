"""The ops that run on several backends, one suite for every backend, and the Pallas kernels' own checks.

Each test of an op (the standard step, the replay step on each route, ...)
is written once and parametrized over the backends, each at its shapes of
the case tables (replayssm_jax.testing): "xla" (the reference) at the
reference shapes, "interpret" (the kernels in Pallas interpret mode) at the
CPU shapes, "pallas" (compiled) at the GPU shapes, under the `gpu` marker.
Every backend is compared with the float64 NumPy loops; a kernel backend
also with the "xla" reference. The CPU shapes are small and awkward: GDN
head dims 20, 24 and 100 with HV = 2H; Mamba-2 head_dim 24 and 100, d_state
20, n_groups < nheads, with and without the z gate and a dt clamp; L in
{1, 4, 8, 16}, rows at mixed cursors, bf16 inputs with f32 or bf16 state,
several row tiles per program, poisoned dead slots. The GPU shapes include
the models' layers (Qwen3.5-4B GDN, Nemotron-3-Nano-4B Mamba-2).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import assert_close
from kernel_checks import (
    ADAPTERS,
    CASE_TABLES,
    CPU_SHAPES,
    DTYPES,
    GDN,
    GDN_CASES,
    GPU_SHAPES,
    MAMBA2_CASES,
    GDNShape,
    Mamba2,
    Mamba2Shape,
    check_replay,
    check_standard,
    jaxpr_equations,
    lower_for_cuda,
    mixed_cursors,
    replay_config,
    tolerance_dtype,
)
from replayssm_jax import kernels, ops

# The shapes of each backend: the reference at the reference tests' shapes, the kernels interpreted at the
# CPU shapes and compiled at the GPU shapes.
SHAPES = {
    "xla": {GDN: list(GDN_CASES.reference), Mamba2: list(MAMBA2_CASES.reference)},
    "interpret": CPU_SHAPES,
    "pallas": GPU_SHAPES,
}
KERNEL_BACKENDS = ("interpret", "pallas")
# Replay tilings compiled at the model shape: (block_v, num_warps, tiles,
# fused_flush[, (flush_block_v, flush_warps, flush_rows)]).
GPU_TILINGS = {
    GDN: [(32, 4, 4, False), (64, 8, 2, True), (16, 2, 3, False), (4, 1, 1, True), (64, 4, 2, False, (16, 2, 1)),
          (64, 4, 2, True, (32, 0, 0))],
    Mamba2: [(16, 2, 5, False), (32, 4, 3, True), (16, 2, 2, False), (8, 1, 1, True), (16, 2, 5, False, (8, 1, 2)),
             (16, 2, 5, True, (8, 0, 0))],
}
# Tilings the heuristic picks only at other shapes, interpreted: several row
# tiles per program (a static and a dynamic trip count, rows padded past V).
TILINGS = [
    (kernels.ReplayConfig(block_v=8, num_warps=2, tiles=3), 4),
    (kernels.ReplayConfig(block_v=8, num_warps=2, tiles=2), 16),
    (kernels.ReplayConfig(block_v=16, num_warps=4, tiles=2), 16),
    (kernels.ReplayConfig(block_v=16, num_warps=4, tiles=1), 4),
    (kernels.ReplayConfig(block_v=8, num_warps=2, tiles=3, fused_flush=True), 4),
    (kernels.ReplayConfig(block_v=16, num_warps=4, tiles=1, fused_flush=True), 16),
    # The fused flush in sub-tiles of its program's rows: rank-1 steps, and the rank-L dot.
    (kernels.ReplayConfig(block_v=16, num_warps=4, tiles=2, fused_flush=True, flush_block_v=4), 4),
    (kernels.ReplayConfig(block_v=32, num_warps=4, tiles=1, fused_flush=True, flush_block_v=16), 16),
    # The flush launch on its own tiling: smaller and larger tiles than the
    # replay kernel's, one row and a block of rows per program.
    (kernels.ReplayConfig(block_v=16, num_warps=4, tiles=2, flush_block_v=4, flush_warps=1, flush_rows=1), 4),
    (kernels.ReplayConfig(block_v=8, num_warps=2, tiles=3, flush_block_v=32, flush_rows=2), 16),
]


def cases(table, first_only=False):
    """(adapter class, entry) pairs of a per-layer table, for parametrize."""
    return [(layer, entry) for layer, entries in table.items() for entry in (entries[:1] if first_only else entries)]


def case_id(case):
    return str(case[1]) if not isinstance(case[1], tuple) else f"{case[0].__name__}-{case[1]}"


def backend_marks(backend, slow=False):
    """The marks of a case on `backend`: `gpu` for the compiled kernels (and `slow` if asked)."""
    return ([pytest.mark.gpu] if backend == "pallas" else []) + ([pytest.mark.slow] if slow else [])


def on(backend, *values, id, slow=False):
    """pytest.param(backend, *values), marked `gpu` for the compiled kernels (and `slow` if asked)."""
    return pytest.param(backend, *values, id=f"{backend}-{id}", marks=backend_marks(backend, slow))


def gpu_tiling_config(tiling):
    """kernels.ReplayConfig of a GPU_TILINGS entry."""
    block_v, warps, tiles, fused, *flush = tiling
    flush_block_v, flush_warps, flush_rows = flush[0] if flush else (0, 0, 0)
    return kernels.ReplayConfig(block_v=block_v, num_warps=warps, tiles=tiles, fused_flush=fused,
                                flush_block_v=flush_block_v, flush_warps=flush_warps, flush_rows=flush_rows)


# The Pallas Triton backend warns that it is deprecated when a kernel is lowered.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


# The shape (index in the table) of each bf16 combination in the default run on the CPU backends, per layer:
# each combination on one shape (the masks are the shape's, the casts the dtypes'), so every mask branch and
# every cast runs, in test_step and in test_replay_step on every route; the other shape of each combination
# is `slow` (test_step runs f32 on every shape interpreted; test_replay_tilings also runs the first shape
# with bf16 inputs and f32 state).
DEFAULT_BF16_SHAPE = {"bf16in-bf16state": 0, "bf16in-f32state": 1}

# The standard step, every backend at its shapes, every dtype combination; on the CPU backends by default
# the bf16 combinations at DEFAULT_BF16_SHAPE, f32 interpreted on every shape and on the reference on the
# first shapes (at the second, test_reference.py's chunked T = 15 case holds the reference's f32 step loop to
# the chunked form and that to the float64 loop).
def step_is_slow(backend, index, dtypes) -> bool:
    """Whether the test_step case on `backend` at shape `index` of its table with `dtypes` is `slow`."""
    if backend == "pallas":
        return False
    if dtypes == "f32":
        return backend == "xla" and index != 0
    return index != DEFAULT_BF16_SHAPE[dtypes]


STEP_CASES = [pytest.param(dtypes, backend, (layer, shape), id=f"{dtypes}-{backend}-{case_id((layer, shape))}",
                           marks=backend_marks(backend, slow=step_is_slow(backend, index, dtypes)))
              for dtypes in DTYPES for backend, table in SHAPES.items() for layer, shapes in table.items()
              for index, shape in enumerate(shapes)]


@pytest.mark.parametrize(("dtypes", "backend", "case"), STEP_CASES)
def test_step(backend, case, dtypes, rng):
    """Four standard steps against the float64 loop that follows the rounded state; outputs in the input
    dtype, the state in its own."""
    layer, shape = case
    input_dtype, state_dtype, _ = DTYPES[dtypes]
    check_standard(layer(shape, rng, input_dtype), state_dtype, backend, steps=4)


ROUTES = ["output", "state", "direct", "deferred"]


# The lengths of the first shape's f32 replay steps in the default run, per CPU backend. Interpreted L = 1
# (a flush every step; the output and state routes only, see `deferred_is_slow` and `direct_is_slow`), L 4
# and 16 `slow`: test_replay_dead_slots_never_read runs every route at L = 8 in f32 (the same checks, the dead
# slots poisoned), the bf16 cases every route but the deferred at L = 4, and the first shapes' default tiles
# (8 rows) take the record loop at every L. On the reference L 1 and 4, L 16 `slow` (its replay step has no
# branch on L; test_reference.py runs L 16).
DEFAULT_F32_LENGTHS = {"xla": (1, 4), "interpret": (1,)}


def replay_cases(backend):
    """(case, L, dtypes, steps, slow) of the replay step on `backend`. Interpreted and on the reference: the
    first shape at L 1, 4, 16 in f32, slow but for DEFAULT_F32_LENGTHS; interpreted also every shape at L 4
    with bf16 inputs (the reference's bf16 replay: test_reference.py), slow but for DEFAULT_BF16_SHAPE.
    Compiled: the model shape at every dtype, a short and a long buffer; the second shape (GDN: one program
    per head; Mamba-2: head dim 100, d_state 64) with bf16 inputs and f32 state."""
    table = SHAPES[backend]
    if backend == "pallas":
        return ([((layer, shapes[0]), L, dtypes, L // 2 + 2, False) for layer, shapes in table.items()
                 for L in (4, 32) for dtypes in DTYPES]
                + [((layer, shapes[1]), L, "bf16in-f32state", L // 2 + 2, False) for layer, shapes in table.items()
                   for L in (1, 8)])
    bf16 = [] if backend == "xla" else ("bf16in-f32state", "bf16in-bf16state")
    return ([(case, L, "f32", 3, L not in DEFAULT_F32_LENGTHS[backend])
             for case in cases(table, first_only=True) for L in (1, 4, 16)]
            + [((layer, shape), 4, dtypes, 3, index != DEFAULT_BF16_SHAPE[dtypes])
               for layer, shapes in table.items() for index, shape in enumerate(shapes) for dtypes in bf16])


def deferred_is_slow(backend, L, dtypes) -> bool:
    """Whether a deferred-route case of `replay_cases` is `slow` beyond its case: on the CPU backends all but
    L = 4 in f32 (its launches are the flush launch and the append route's replay kernel, which the other
    routes' cases run at every L and dtype). Interpreted, that case is `slow` as well (DEFAULT_F32_LENGTHS):
    the route runs on both layers in test_replay_dead_slots_never_read (L = 8, f32)."""
    return backend != "pallas" and (L, dtypes) != (4, "f32")


def direct_is_slow(backend, L, dtypes) -> bool:
    """Whether a direct-route case of `replay_cases` is `slow` beyond its case: interpreted, L = 1 in f32 (the
    route writes every row's checkpoint at any L, so L = 1 is no edge of it; test_replay_dead_slots_never_read
    runs it at L = 8 in f32, the bf16 cases at L = 4)."""
    return backend == "interpret" and (L, dtypes) == (1, "f32")


REPLAY_CASES = [on(backend, case, L, dtypes, steps, route, id=f"{route}-{case_id(case)}-L{L}-{dtypes}",
                   slow=slow or (route == "deferred" and deferred_is_slow(backend, L, dtypes))
                   or (route == "direct" and direct_is_slow(backend, L, dtypes)))
                for backend in SHAPES for case, L, dtypes, steps, slow in replay_cases(backend) for route in ROUTES]


@pytest.mark.parametrize(("backend", "case", "L", "dtypes", "steps", "route"), REPLAY_CASES)
def test_replay_step(backend, case, L, dtypes, steps, route, rng):
    layer, shape = case
    input_dtype, state_dtype, buffer_dtype = DTYPES[dtypes]
    check_replay(layer(shape, rng, input_dtype), L, route, input_dtype, state_dtype, buffer_dtype, backend,
                 steps=steps)


# The readout tilings (no flush fields): their row tiles are `tiles.for_each_row_tile`'s, shared by both
# routes' readouts (rows masked past V or not; one tile, a static or a dynamic trip count), and each of its
# branches runs on both routes by default without the (entry, route) cases named here, which are `slow`: the
# output route runs entry 0's static trip count in entry 2, entry 3's one masked tile in entries 5 and 7; the
# state route runs entry 2's static trip count in entry 0, its masked rows in entry 3.
SLOW_READOUT_TILINGS = {(0, "output"), (2, "state"), (3, "output")}


def flush_tiling(config) -> bool:
    """Whether a TILINGS entry is there for its flush (fused, or the flush launch's own tiling): that code is
    the same on both routes (only the readout differs), so its "state" route case is `slow`; the state
    route's readout tilings run in the entries without flush fields."""
    return config.fused_flush or config.flush_block_v > 0


# Interpreted: the first CPU shape at TILINGS, each entry on one layer by default (the layers in turn:
# the tiling code is shared, and each layer's kernel runs at every route in test_replay_step), on the
# other `slow`, and on the routes that `flush_tiling` and SLOW_READOUT_TILINGS leave; compiled: the model
# shape at GPU_TILINGS, L 8 and 32, dead slots poisoned.
TILING_CASES = (
    [on("interpret", (layer, shapes[0]), config, L, False, route, id=f"{layer.__name__}-{config.tag()}-L{L}-{route}",
        slow=(route == "state" and flush_tiling(config)) or (i, route) in SLOW_READOUT_TILINGS
        or i % len(CPU_SHAPES) != j)
     for j, (layer, shapes) in enumerate(CPU_SHAPES.items()) for i, (config, L) in enumerate(TILINGS)
     for route in ("output", "state")]
    + [on("pallas", (layer, GPU_SHAPES[layer][0]), gpu_tiling_config(tiling), L, True, route,
          id=f"{layer.__name__}-{gpu_tiling_config(tiling).tag()}-L{L}-{route}")
       for layer, tilings in GPU_TILINGS.items() for tiling in tilings for L in (8, 32) for route in ("output", "state")])


@pytest.mark.parametrize(("backend", "case", "config", "L", "poison", "route"), TILING_CASES)
def test_replay_tilings(backend, case, config, L, poison, route, rng):
    """Replay steps at fixed kernel tilings (bf16 inputs, f32 state)."""
    layer, shape = case
    check_replay(layer(shape, rng, jnp.bfloat16), L, route, *DTYPES["bf16in-f32state"], backend,
                 steps=L // 2 + 2, config=config, poison=poison)


# On each layer's first CPU shape, Mamba-2's `slow`: the launch order is `launch.pallas_call`'s (the grid and
# the block specs' index maps reversed), the same for every kernel of both layers.
@pytest.mark.parametrize("case", [pytest.param(case, id=case_id(case),
                                               marks=[pytest.mark.slow] if case[0] is Mamba2 else [])
                                  for case in cases(CPU_SHAPES, first_only=True)])
def test_launch_order_changes_no_number(case, rng):
    """A launch in memory order (`memory_order=True`) and one with batch rows first give the same bits: the
    standard step, and the replay step (mixed cursors: flushing rows, a fused and a separate flush)."""
    layer, shape = case
    layer = layer(shape, rng)
    state, inp = layer.state(), layer.draw()
    replay = layer.replay_state(4, jnp.float32, jnp.float32, mixed_cursors(layer.s.batch, 4))
    runs = [(lambda config: layer.step(state, inp, "interpret", config), kernels.StepConfig(block_v=8))]
    runs += [(lambda config: layer.replay_step(replay, inp, "output", "interpret", config),
              kernels.ReplayConfig(block_v=8, num_warps=2, tiles=2, fused_flush=fused)) for fused in (False, True)]
    for run, config in runs:
        reversed_out, batch_first_out = (run(dataclasses.replace(config, memory_order=order)) for order in (True, False))
        for a, b in zip(jax.tree.leaves(reversed_out), jax.tree.leaves(batch_first_out)):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=config.tag())


@pytest.mark.parametrize("case", cases(CPU_SHAPES, first_only=True), ids=case_id)
@pytest.mark.parametrize("route", ROUTES)
def test_replay_dead_slots_never_read(case, route, rng):
    """NaN and inf in the dead slots (a rejected draft's records) reach no output or state."""
    layer, shape = case
    check_replay(layer(shape, rng), 8, route, *DTYPES["f32"], "interpret", steps=6, poison=True)


# A decode loop may change routes between steps (the direct route for plain
# decoding, buffered steps after a speculative commit). Tilings per route:
# the default; a two-launch replay step with a 2-program-per-row direct step;
# a fused replay step of 3 tiles per program.
ROUTE_SEQUENCES = [
    (("output", "direct", "direct", "output", "state", "direct"), {}),
    (("direct", "output", "output", "output", "direct"),
     {"output": kernels.ReplayConfig(block_v=8, num_warps=2, tiles=2),
      "direct": kernels.StepConfig(block_v=16, num_warps=2)}),
    (("state", "output", "direct", "output"),
     {"output": kernels.ReplayConfig(block_v=8, num_warps=2, tiles=3, fused_flush=True),
      "state": kernels.ReplayConfig(block_v=8, num_warps=2, tiles=3, fused_flush=True)}),
    # the deferred route leaves full rows (cursor L) to the next step, on any route
    (("deferred", "deferred", "output", "deferred", "deferred", "state", "deferred", "direct"),
     {"deferred": kernels.ReplayConfig(block_v=8, num_warps=2, tiles=2, flush_block_v=16, flush_rows=2)}),
]


# In the default run the first sequence (the default tilings) on each layer's first CPU shape, and each other
# sequence on one layer's first shape (MIXED_ROUTE_LAYER: the routes' tilings are shared code, and every
# route's kernel of both layers runs in the first sequence); the other cases, and the second shapes (whose
# masks test_replay_step runs on the first sequence's routes), `slow`.
MIXED_ROUTE_LAYER = {1: Mamba2, 2: GDN, 3: GDN}
MIXED_ROUTE_CASES = [pytest.param(case, routes, configs, id=f"{'-'.join(routes)}-{case_id(case)}",
                                  marks=[pytest.mark.slow] if k or (i and MIXED_ROUTE_LAYER[i] is not layer)
                                  else [])
                     for i, (routes, configs) in enumerate(ROUTE_SEQUENCES)
                     for layer, shapes in CPU_SHAPES.items() for k, shape in enumerate(shapes)
                     for case in [(layer, shape)]]


@pytest.mark.parametrize(("case", "routes", "configs"), MIXED_ROUTE_CASES)
def test_replay_routes_mixed_in_one_loop(case, routes, configs, rng):
    layer, shape = case
    check_replay(layer(shape, rng, jnp.bfloat16), 4, routes, *DTYPES["bf16in-f32state"], "interpret",
                 steps=len(routes), config=configs)


@pytest.mark.parametrize("case", cases(CPU_SHAPES, first_only=True), ids=case_id)
def test_direct_route_dot_fold(case, rng):
    """`StepConfig.dot_fold`: the direct route folds a row's live records as one rank-L update on the tensor
    cores (L = 16, 16-row tiles: the dot's sizes), as Generator's lockstep flush does after L - 1 buffered
    steps; a second direct step folds nothing (count 0). Dead slots poisoned."""
    layer, shape = case
    routes = ("output",) * 5 + ("direct", "output", "output", "direct", "direct")
    check_replay(layer(shape, rng, jnp.bfloat16), 16, routes, *DTYPES["bf16in-f32state"], "interpret",
                 steps=len(routes), config={"direct": kernels.StepConfig(block_v=16, num_warps=2, dot_fold=True)},
                 poison=True)


@pytest.mark.parametrize(("backend", "case"), [on(backend, (layer, shapes[0]), id=case_id((layer, shapes[0])))
                                             for backend, table in (("interpret", CPU_SHAPES), ("pallas", GPU_SHAPES))
                                             for layer, shapes in table.items()])
def test_append_route(backend, case, rng):
    """route="append" (Generator's lockstep buffered steps): the output route without the flush. From
    cursors 0 .. L - 2: append, append, output steps on the kernels against the reference's
    output route step by step: outputs and materialized states within tolerance; the append steps write no
    checkpoint (bit for bit), and their rows that fill the buffer keep cursor L until the output step
    flushes them. A row that entered full cannot take an append step: ops raise ValueError on a concrete
    cursor; under a trace its outputs are NaN and its state is kept bit for bit, on both backends."""
    layer, shape = case
    layer = layer(shape, rng, jnp.bfloat16)
    L, batch = 4, layer.s.batch
    tol = tolerance_dtype(jnp.bfloat16, jnp.float32)
    rs = rs_ref = layer.replay_state(L, jnp.float32, jnp.float32, np.arange(batch, dtype=np.int32) % (L - 1))
    for t, route in enumerate(("append", "append", "output")):
        inp, cursor = layer.draw(), np.asarray(rs.cursor)
        y, new = layer.replay_step(rs, inp, route, backend)
        y_ref, rs_ref = layer.replay_step(rs_ref, inp, "output", "xla")
        assert_close(y, y_ref, tol, what=f"output, step {t} ({route})")
        assert_close(layer.materialize(new), layer.materialize(rs_ref), tol, what=f"state, step {t} ({route})")
        after = np.minimum(cursor + 1, L) if route == "append" else np.where(cursor >= L - 1, 0, cursor + 1)
        np.testing.assert_array_equal(np.asarray(new.cursor), after, err_msg=f"cursor, step {t}")
        if route == "append":
            np.testing.assert_array_equal(np.asarray(new.checkpoint), np.asarray(rs.checkpoint))
        rs = new
    assert (np.asarray(rs.cursor) != np.asarray(rs_ref.cursor)).any()  # the flushes came at other steps

    full = layer.replay_state(L, jnp.float32, jnp.float32, np.where(np.arange(batch) == 0, L, 1).astype(np.int32))
    inp = layer.draw()
    with pytest.raises(ValueError, match=r"route 'append'.*batch rows \[0\] are full"):
        layer.replay_step(full, inp, "append", backend)
    for on_backend in (backend, "xla"):
        y, new = jax.jit(lambda s, i, b=on_backend: layer.replay_step(s, i, "append", b))(full, inp)
        assert np.isnan(np.asarray(y[0], np.float32)).all() and np.isfinite(np.asarray(y[1:], np.float32)).all()
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(full)):
            np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]), err_msg=f"{on_backend}: row 0 changed")
        np.testing.assert_array_equal(np.asarray(new.cursor)[1:], 2)


# Each layer's second CPU shape `slow`: the pick depends on the grid (ops.resolve_route), latency-bound at
# every CPU shape.
@pytest.mark.parametrize("case", [pytest.param((layer, shape), id=case_id((layer, shape)),
                                               marks=[pytest.mark.slow] if index else [])
                                  for layer, shapes in CPU_SHAPES.items() for index, shape in enumerate(shapes)])
def test_auto_route_is_the_picked_route(case, rng):
    """route="auto" on these latency-bound grids: the kernels' direct route
    (bit for bit), their output route once a replay config is given, and the
    reference's output route."""
    layer = case[0](case[1], rng)
    rs, inp = layer.replay_state(4, jnp.float32, jnp.float32, mixed_cursors(case[1].batch, 4)), layer.draw()
    for backend, config, picked in (("interpret", None, "direct"),
                                    ("interpret", replay_config(layer, 4, jnp.float32), "output"),
                                    ("xla", None, "output")):
        got, want = (layer.replay_step(rs, inp, route, backend, config) for route in ("auto", picked))
        jax.tree.map(np.testing.assert_array_equal, got, want)


def launched_kernels(fn, *args) -> list[str]:
    """The `name=` of each pallas_call that fn(*args) launches (traced on abstract inputs: nothing runs)."""
    jaxpr = jax.make_jaxpr(fn)(*args)
    return [e.params["name"] for e in jaxpr_equations(jaxpr.jaxpr) if e.primitive.name == "pallas_call"]


def model_replay_step(layer: str, batch: int):
    """(replay step through replayssm_jax.ops on the "interpret" backend, abstract replay state, abstract inputs)
    of the case table's model layer (Qwen3.5-4B's GDN layer or Nemotron-3-Nano-4B's Mamba-2 layer), L = 16."""
    adapter = ADAPTERS[layer](CASE_TABLES[layer].model.with_batch(batch), np.random.default_rng(0), jnp.bfloat16)
    rs = jax.eval_shape(lambda: adapter.replay_init(jnp.zeros((batch, *adapter.heads_dims())), 16))
    inp = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), adapter.draw())
    return (lambda rs, inp, **kw: adapter.replay_step(rs, inp, backend="interpret", **kw)), rs, inp


@pytest.mark.parametrize(("layer", "batch", "picked"), [
    ("gdn", 1, "direct"), ("gdn", 4, "direct"), ("gdn", 8, "output"), ("gdn", 256, "deferred"),
    ("mamba2", 1, "direct"), ("mamba2", 2, "output"), ("mamba2", 64, "deferred"),
])
def test_auto_route_at_model_shapes(layer, batch, picked):
    """The direct route where the default replay step is one launch (batch x
    heads <= 132): Qwen3.5-4B's GDN layer (32 value heads) at batch 1-4,
    Nemotron-3-Nano-4B's Mamba-2 layer (96 heads) at batch 1; the deferred
    route from batch 64; the output route elsewhere and wherever a replay
    config is given."""
    step, rs, inp = model_replay_step(layer, batch)
    assert rs.checkpoint.shape[1:] == ((32, 128, 128) if layer == "gdn" else (96, 80, 128))
    assert kernels.replay_is_one_launch(batch, *rs.checkpoint.shape[1:], jnp.float32, 16) == (picked == "direct")

    def route_of(route, **kw):
        first = launched_kernels(lambda rs, inp: step(rs, inp, route=route, **kw), rs, inp)[0]
        return next(r for r in ("direct", "output", "state", "deferred") if first.startswith(f"{layer}_{r}_")
                    or first.startswith(f"{layer}_replay_{r}_"))

    assert route_of("auto") == picked
    assert route_of("auto", config=kernels.ReplayConfig(block_v=16)) == "output"
    for route in ("output", "state", "direct", "deferred"):
        assert route_of(route) == route
    with pytest.raises(ValueError,
                       match="`route` must be one of 'output', 'state', 'direct', 'deferred', 'auto', 'append'; got 'fast'"):
        route_of("fast")


# Interpreted at the first CPU shapes, L 4; compiled at the model shapes, L 8.
WIPE_CASES = [on(backend, case, L, id=f"{case_id(case)}-L{L}") for backend, L in (("interpret", 4), ("pallas", 8))
              for case in cases(SHAPES[backend], first_only=True)]


@pytest.mark.parametrize(("backend", "case", "L"), WIPE_CASES)
@pytest.mark.parametrize("fused", [False, True], ids=["flush-launch", "fused-flush"])
def test_replay_after_a_wiping_decay(backend, case, L, fused, rng):
    """A decay that wipes a head's state inside the buffer (GDN g = -inf, a
    Mamba-2 dt spike): outputs and flushed states stay finite and equal to the
    reference's."""
    layer = case[0](case[1], rng)
    check_replay(layer, L, "output", *DTYPES["f32"], backend, steps=L + 2, wipe_at=1,
                 config=replay_config(layer, L, jnp.float32, fused_flush=fused))


FLUSH_IDS = {False: "flush-launch", True: "fused-flush"}

# Mamba-2 only: its records are the step's inputs, rounded to bf16 alike in
# kernel and reference. GDN's d is computed in the kernel in f32, and a d that
# differs from the reference's in its last f32 bits can round to the other
# bf16 neighbour (one bf16 ulp, above an f32 tolerance): a flaky comparison.
# test_rank_update_accuracy checks the dots of both layers' flushes
# (`rank_update`) on their own. On the CPU, 16-row tiles make L = 16 take the
# dots (the default tiles of these small shapes are narrower: the loop). Each
# (L, flush) pair runs on one CPU shape by default, each shape with both L and
# both flushes (the first shape the flush launch at L = 4 and the fused flush
# at L = 16, the second the other two), the other shape `slow`.
BF16_BUFFER_FLUSH_CASES = (
    [pytest.param(fused, case, L, "interpret", id=f"{FLUSH_IDS[fused]}-{case_id(case)}-{L}-interpret",
                  marks=[] if (index == 0) == (fused == (L > 8)) else [pytest.mark.slow])
     for fused in (False, True) for index, shape in enumerate(CPU_SHAPES[Mamba2]) for case in [(Mamba2, shape)]
     for L in (4, 16)]
    + [pytest.param(fused, case, L, "pallas", id=f"{FLUSH_IDS[fused]}-{case_id(case)}-{L}-pallas",
                    marks=pytest.mark.gpu)
       for fused in (False, True) for case in cases(GPU_SHAPES, first_only=True) if case[0] is Mamba2
       for L in (16, 32)])


@pytest.mark.parametrize(("fused", "case", "L", "backend"), BF16_BUFFER_FLUSH_CASES)
def test_bf16_buffer_flush_matches_the_reference_to_f32_rounding(case, L, backend, fused, rng):
    """With float32 inputs and state, a bfloat16 buffer rounds the records alike
    in kernel and reference: flushed checkpoints agree to float32 tolerance,
    by the record loop (L = 4) and by the split-bf16 dots (L >= 16)."""
    layer = case[0](case[1], rng)
    config = replay_config(layer, L, jnp.float32, fused_flush=fused,
                           **({"block_v": 16} if backend == "interpret" else {}))
    rs = layer.replay_state(L, jnp.float32, jnp.bfloat16, np.zeros(case[1].batch))
    assert bool(kernel_dots(layer, rs, config)) == (L > 8), "the test must reach the path it names"
    check_replay(layer, L, "output", jnp.float32, jnp.float32, jnp.bfloat16, backend, steps=L + 1, config=config)


def test_gdn_errors_before_any_kernel(rng):
    layer = GDN(CPU_SHAPES[GDN][0], rng)
    state, inp = layer.state(jnp.float32), layer.draw()
    with pytest.raises(ValueError, match="`v` must have shape"):
        ops.gdn_step(state, **dict(inp, v=inp["v"][:, :, :5]), backend="interpret")
    big = GDN(GDNShape(batch=1, H=1, HV=1, K=300, V=8), rng)
    with pytest.raises(ValueError, match="`K` <= 256"):
        ops.gdn_step(big.state(jnp.float32), **big.draw(), backend="interpret")
    with pytest.raises(ValueError, match="`route`"):
        ops.gdn_replay_step(layer.replay_state(4, jnp.float32, jnp.float32, np.zeros(4)), **inp, route="x",
                            backend="interpret")
    with pytest.raises(NotImplementedError, match="no Pallas kernel"):
        ops.gdn_replay_materialize(layer.replay_state(4, jnp.float32, jnp.float32, np.zeros(4)), backend="interpret")
    # The standard step and the direct route take a StepConfig (one tile per
    # program, no flush): a ReplayConfig's tiles, fused flush or flush fields
    # are refused with its class; the output and state routes take a ReplayConfig.
    with pytest.raises(TypeError, match=re.escape("`config` must be a replayssm_jax.kernels.StepConfig or None for "
                                                  "the replay step's direct route (the standard step's kernel); "
                                                  "got ReplayConfig")):
        ops.gdn_replay_step(layer.replay_state(4, jnp.float32, jnp.float32, np.zeros(4)), **inp, route="direct",
                            backend="interpret", config=kernels.ReplayConfig(block_v=8, tiles=2))
    for config in (kernels.ReplayConfig(block_v=8, tiles=2), kernels.ReplayConfig(block_v=8, fused_flush=True),
                   kernels.ReplayConfig(block_v=8, flush_rows=2)):
        with pytest.raises(TypeError, match=re.escape("`config` must be a replayssm_jax.kernels.StepConfig or None "
                                                      "for the standard step; got ReplayConfig")):
            ops.gdn_step(state, **inp, backend="interpret", config=config)
    with pytest.raises(TypeError, match=re.escape("`config` must be a replayssm_jax.kernels.ReplayConfig or None for "
                                                  "the replay step's state route; got StepConfig")):
        ops.gdn_replay_step(layer.replay_state(4, jnp.float32, jnp.float32, np.zeros(4)), **inp, route="state",
                            backend="interpret", config=kernels.StepConfig(block_v=8))
    # V = 24: tiles of at most 32 rows.
    with pytest.raises(ValueError, match=re.escape("`config.block_v` must be <= 32 (the state's value dim V = 24 "
                                                   "rows, rounded up to a power of two); got 64")):
        ops.gdn_step(state, **inp, backend="interpret", config=kernels.StepConfig(block_v=64))
    replay = layer.replay_state(4, jnp.float32, jnp.float32, np.zeros(4))
    too_many = 2 * replay.checkpoint.shape[0]
    with pytest.raises(ValueError, match=rf"`config.flush_rows` must divide the batch \(\d+\); got {too_many}"):
        ops.gdn_replay_step(replay, **inp, backend="interpret",
                            config=kernels.ReplayConfig(block_v=8, flush_rows=too_many))
    with pytest.raises(ValueError, match=re.escape("`config.flush_block_v` must be <= 32 (the state's value dim "
                                                   "V = 24 rows, rounded up to a power of two); got 4096")):
        ops.gdn_replay_step(replay, **inp, backend="interpret",
                            config=kernels.ReplayConfig(block_v=8, flush_block_v=4096))


# Fields of both configs: block_v, num_warps, num_stages.
TILING_FIELD_ERRORS = [
    (dict(block_v=12), ValueError, "`config.block_v` must be a power of two; got 12"),
    (dict(block_v=0), ValueError, "`config.block_v` must be a power of two; got 0"),
    (dict(block_v=4.0), TypeError, "`config.block_v` must be an int; got float 4.0"),
    (dict(block_v=True), TypeError, "`config.block_v` must be an int; got bool True"),
    (dict(block_v=8, num_warps=3), ValueError, "`config.num_warps` must be one of 1, 2, 4, 8, 16; got 3"),
    (dict(block_v=8, num_stages=2.5), TypeError, "`config.num_stages` must be an int; got float 2.5"),
    (dict(block_v=8, num_stages=0), ValueError, "`config.num_stages` must be >= 1; got 0"),
    (dict(block_v=8, memory_order=1), TypeError, "`config.memory_order` must be a bool; got int"),
]
STEP_FIELD_ERRORS = TILING_FIELD_ERRORS + [
    (dict(block_v=8, dot_fold="dot"), TypeError, "`config.dot_fold` must be a bool; got str"),
]


@pytest.mark.parametrize(("fields", "error", "message"), STEP_FIELD_ERRORS)
def test_step_config_rejects_bad_fields(fields, error, message):
    with pytest.raises(error, match=re.escape(message)):
        kernels.StepConfig(**fields)


def test_step_config_has_no_replay_fields():
    """The standard step has one tile per program and no flush: a StepConfig takes no such field."""
    for field, value in (("tiles", 2), ("fused_flush", True), ("flush_block_v", 8), ("flush_warps", 2),
                         ("flush_rows", 2)):
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{field}'"):
            kernels.StepConfig(block_v=8, **{field: value})
    assert kernels.StepConfig(block_v=32).tag() == "bv32_w4_s1_t1"  # the name profiles show (t1: one tile)


@pytest.mark.parametrize(("fields", "error", "message"), TILING_FIELD_ERRORS + [
    (dict(block_v=8, tiles=0), ValueError, "`config.tiles` must be >= 1; got 0"),
    (dict(block_v=8, tiles=1.5), TypeError, "`config.tiles` must be an int; got float 1.5"),
    (dict(block_v=8, fused_flush="yes"), TypeError, "`config.fused_flush` must be a bool; got str"),
    (dict(block_v=8, flush_block_v=24), ValueError, "`config.flush_block_v` must be 0 (default) or a power of two; got 24"),
    (dict(block_v=8, flush_rows=-2), ValueError, "`config.flush_rows` must be 0 (default) or a power of two; got -2"),
    (dict(block_v=8, flush_warps=3), ValueError, "`config.flush_warps` must be 0 (default) or one of 1, 2, 4, 8, 16; got 3"),
    (dict(block_v=8, flush_rows=2.0), TypeError, "`config.flush_rows` must be an int; got float 2.0"),
    (dict(block_v=8, fused_flush=True, flush_warps=2), ValueError, "which a `fused_flush=True` step does not have"),
    (dict(block_v=8, fused_flush=True, flush_block_v=16), ValueError, "sub-tiles the program's block_v = 8 rows, "
     "so must be <= it; got 16"),
])
def test_replay_config_rejects_bad_fields(fields, error, message):
    with pytest.raises(error, match=re.escape(message)):
        kernels.ReplayConfig(**fields)


def test_configs_take_numpy_ints():
    config = kernels.ReplayConfig(block_v=np.int64(16), num_warps=np.int32(2), flush_rows=np.int64(4))
    assert config == kernels.ReplayConfig(block_v=16, num_warps=2, flush_rows=4)
    assert all(type(getattr(config, name)) is int for name in ("block_v", "num_warps", "flush_rows"))
    with pytest.raises(TypeError, match="`config.tiles` must be an int; got bool"):
        kernels.ReplayConfig(block_v=16, tiles=np.bool_(True))
    fused = kernels.ReplayConfig(block_v=16, fused_flush=np.bool_(True))
    assert fused == kernels.ReplayConfig(block_v=16, fused_flush=True) and type(fused.fused_flush) is bool
    step = kernels.StepConfig(block_v=np.int64(16), num_stages=np.int32(2))
    assert step == kernels.StepConfig(block_v=16, num_stages=2) and type(step.block_v) is int
    with pytest.raises(TypeError, match="`config.num_warps` must be an int; got bool"):
        kernels.StepConfig(block_v=16, num_warps=np.bool_(True))
    assert kernels.StepConfig(block_v=16) != kernels.ReplayConfig(block_v=16)  # one config class per launch kind


def test_heuristics_plan_for_132_sms_without_a_gpu():
    """On the CPU the heuristics build the H100 / H200 configs (132 SMs); the
    fused flush where batch x heads <= 132, in 16-row tiles."""
    from replayssm_jax.kernels import config

    assert jax.default_backend() != "gpu" or config.num_sms() >= 1
    if jax.default_backend() != "gpu":
        assert config.num_sms() == config.DEFAULT_NUM_SMS == 132
    assert kernels.default_replay_config(4, 32, 128, 128, jnp.float32, 16) == kernels.ReplayConfig(
        block_v=16, num_warps=4, fused_flush=True)
    assert kernels.default_replay_config(256, 32, 128, 128, jnp.float32, 16) == kernels.ReplayConfig(
        block_v=64, num_warps=4, tiles=2, memory_order=False)
    assert kernels.default_replay_config(256, 32, 128, 128, jnp.bfloat16, 16) == kernels.ReplayConfig(
        block_v=64, num_warps=2, tiles=2)
    assert kernels.default_replay_config(256, 32, 128, 128, jnp.int8, 16).block_v == 128
    assert kernels.default_step_config(64, 32, 128, 128, jnp.float32) == kernels.StepConfig(block_v=32, num_warps=4)
    assert kernels.default_step_config(8, 96, 80, 128, jnp.bfloat16) == kernels.StepConfig(block_v=16, num_warps=2)
    # Each layer's standard step takes its measured tile (STANDARD_TILES), fewer rows on small grids.
    assert kernels.default_step_config(64, 32, 128, 128, jnp.float32, "gdn") == kernels.StepConfig(16, num_warps=1)
    assert kernels.default_step_config(256, 96, 80, 128, jnp.float32, "mamba2") == kernels.StepConfig(8, num_warps=1)
    assert kernels.default_step_config(256, 96, 80, 128, jnp.bfloat16, "mamba2") == kernels.StepConfig(16, num_warps=2)
    assert kernels.default_step_config(1, 32, 128, 128, jnp.float32, "gdn").block_v == 4
    assert kernels.default_step_config(64, 32, 128, 128, jnp.int8, "gdn") == kernels.default_step_config(
        64, 32, 128, 128, jnp.int8)
    # Other key widths than the measured 128 columns take the generic rule.
    assert kernels.default_step_config(64, 32, 128, 256, jnp.float32, "gdn") == kernels.default_step_config(
        64, 32, 128, 256, jnp.float32)
    with pytest.raises(ValueError, match="`layer` must be one of"):
        kernels.default_step_config(64, 32, 128, 128, jnp.float32, "mamba")
    with pytest.raises(ValueError, match="the direct route takes none"):
        config.step_config_for(None, jax.ShapeDtypeStruct((64, 32, 128, 128), jnp.float32),
                               (("value dim", "V"), ("key dim", "K")), direct=True, layer="gdn")
    # The direct route folds with the rank-L dot where the grid is not latency-bound (batch x heads > 132).
    assert kernels.default_direct_config(256, 32, 128, 128, jnp.float32) == kernels.StepConfig(
        block_v=32, num_warps=4, dot_fold=True)
    assert not kernels.default_direct_config(4, 32, 128, 128, jnp.float32).dot_fold
    assert kernels.StepConfig(block_v=32, dot_fold=True).tag() == "bv32_w4_s1_t1_dotfold"


def test_deferred_flush_tiling():
    """The deferred route's flush launch of an f32 checkpoint takes DEFERRED_FLUSH_TILE (32 rows, 4 warps;
    at most V rounded up to a power of two) where the config leaves its flush fields unset; a bf16
    checkpoint, a fused config or set flush fields keep the config's."""
    from replayssm_jax.kernels.config import deferred_flush_default, replay_config_for

    base = kernels.ReplayConfig(block_v=64, num_warps=4, tiles=2)
    assert deferred_flush_default(base, jnp.float32, 128) == kernels.ReplayConfig(
        block_v=64, num_warps=4, tiles=2, flush_block_v=32, flush_warps=4)
    assert deferred_flush_default(base, jnp.float32, 80).flush_launch_tiling().block_v == 32
    assert deferred_flush_default(base, jnp.float32, 12).flush_block_v == 16
    assert deferred_flush_default(base, jnp.bfloat16, 128) == base
    assert deferred_flush_default(base, jnp.int8, 128) == base
    for kept in (kernels.ReplayConfig(block_v=16, fused_flush=True), dataclasses.replace(base, flush_rows=2)):
        assert deferred_flush_default(kept, jnp.float32, 128) == kept
    checkpoint = jax.ShapeDtypeStruct((256, 32, 128, 128), jnp.float32)
    dims = (("value dim", "V"), ("key dim", "K"))
    deferred = replay_config_for(None, checkpoint, 16, dims, route="deferred")
    assert (deferred.flush_block_v, deferred.flush_warps, deferred.flush_rows) == (32, 4, 0)
    assert replay_config_for(None, checkpoint, 16, dims, route="output") == kernels.default_replay_config(
        256, 32, 128, 128, jnp.float32, 16)
    for given in (dataclasses.replace(base, flush_rows=16), kernels.ReplayConfig(block_v=16, fused_flush=True)):
        assert replay_config_for(given, checkpoint, 16, dims, route="deferred") == given


def test_mamba2_errors_before_any_kernel(rng):
    layer = Mamba2(CPU_SHAPES[Mamba2][0], rng)
    state, inp = layer.state(jnp.float32), layer.draw()
    with pytest.raises(ValueError, match="`B` must have shape"):
        ops.mamba2_step(state, **dict(inp, B=inp["B"][:, :, :5]), **layer.params, backend="interpret")
    big = Mamba2(Mamba2Shape(batch=1, H=1, P=8, N=512, G=1), rng)
    with pytest.raises(ValueError, match="`N` <= 256"):
        ops.mamba2_step(big.state(jnp.float32), **big.draw(), **big.params, backend="interpret")
    with pytest.raises(ValueError, match="`route`"):
        ops.mamba2_replay_step(layer.replay_state(4, jnp.float32, jnp.float32, np.zeros(4)), **inp, **layer.params,
                               route="x", backend="interpret")
    with pytest.raises(ValueError, match="`backend`"):
        ops.mamba2_step(state, **inp, **layer.params, backend="triton")
    with pytest.raises(TypeError, match="`config` must be a replayssm_jax.kernels.StepConfig or None for the "
                                        "standard step; got ReplayConfig"):
        ops.mamba2_step(state, **inp, **layer.params, backend="interpret",
                        config=kernels.ReplayConfig(block_v=8, tiles=2))
    with pytest.raises(TypeError, match=re.escape("`config` must be a replayssm_jax.kernels.StepConfig or None for "
                                                  "the replay step's direct route (the standard step's kernel); "
                                                  "got ReplayConfig")):
        ops.mamba2_replay_step(layer.replay_state(4, jnp.float32, jnp.float32, np.zeros(4)), **inp, **layer.params,
                               route="direct", backend="interpret",
                               config=kernels.ReplayConfig(block_v=8, fused_flush=True))
    # P = 24: tiles of at most 32 rows; the state stays usable after the refusal.
    replay = layer.replay_state(4, jnp.float32, jnp.float32, np.zeros(4))
    with pytest.raises(ValueError, match=re.escape("`config.block_v` must be <= 32 (the state's head_dim P = 24 "
                                                   "rows, rounded up to a power of two); got 128")):
        ops.mamba2_replay_step(replay, **inp, **layer.params, backend="interpret",
                               config=kernels.ReplayConfig(block_v=128))
    y, _ = ops.mamba2_replay_step(replay, **inp, **layer.params, backend="interpret")
    y_ref, _ = ops.mamba2_replay_step(replay, **inp, **layer.params, backend="xla")
    assert_close(y, y_ref, jnp.float32, what="output after a refused call")


def test_kernel_limits_before_any_launch(rng):
    """The limits of the kernels themselves, which their entry points
    (replayssm_jax.kernels, given validated arguments) check before any
    launch: a resolved route, L <= MAX_BUFFER_LEN, and at most 32767
    programs per batch row in a one-launch step (fused flush, direct route)."""
    layer = GDN(GDNShape(batch=1, H=1, HV=1024, K=4, V=64), rng)
    rs, inp = layer.replay_state(4, jnp.float32, jnp.float32, np.zeros(1)), layer.draw()
    kw = dict(scale=0.5, use_qk_l2norm=True)
    with pytest.raises(ValueError, match=re.escape("`route` must be one of 'output', 'state', 'direct', 'append', 'deferred' "
                                                   "(the kernels take a resolved route); got 'auto'")):
        kernels.gdn_replay_step(rs, **inp, **kw, route="auto")
    # 1024 heads x 64 one-row tiles: 65536 programs per row
    for route, config in (("direct", kernels.StepConfig(block_v=1, num_warps=1)),
                          ("output", kernels.ReplayConfig(block_v=1, num_warps=1, fused_flush=True))):
        with pytest.raises(ValueError, match=re.escape("a one-launch replay step counts at most 32767 programs per "
                                                       f"batch row; the tiling {config.tag()} has 65536")):
            kernels.gdn_replay_step(rs, **inp, **kw, route=route, config=config)
    # two launches: the flush launch moves the cursor, no count
    o, _ = kernels.gdn_replay_step(rs, **inp, **kw, route="output", config=kernels.ReplayConfig(block_v=16, tiles=4),
                                   interpret=True)
    assert o.shape == inp["v"].shape
    long = layer.replay_state(kernels.MAX_BUFFER_LEN + 1, jnp.float32, jnp.float32, np.zeros(1))
    with pytest.raises(ValueError, match="the Pallas kernels support buffer length `L` <= 64; got 65"):
        kernels.gdn_replay_step(long, **inp, **kw, route="output")


# The lowering depends on the buffer's slots (L) and on the dtypes' casts, each on its own: L = 32 with bf16
# states and buffers lowers at every shape by default, L = 1 in f32 at each layer's first shape (the model
# layer; at the other shapes `slow`: their tiles lower in the L = 32 case), the other two pairings are `slow`.
LOWERING_CASES = [(1, "f32"), (32, "bf16in-bf16state"), (1, "bf16in-bf16state"), (32, "f32")]


@pytest.mark.parametrize(("case", "L", "dtypes"), [
    pytest.param((layer, shape), L, dtypes, id=f"L{L}-{dtypes}-{case_id((layer, shape))}",
                 marks=[] if (L, dtypes) == (32, "bf16in-bf16state") or ((L, dtypes) == (1, "f32") and not index)
                 else [pytest.mark.slow])
    for L, dtypes in LOWERING_CASES for layer, shapes in GPU_SHAPES.items() for index, shape in enumerate(shapes)])
def test_kernels_lower_for_cuda(case, L, dtypes, rng):
    """The Triton lowering of every kernel at the GPU test shapes, on the CPU."""
    input_dtype, state_dtype, buffer_dtype = DTYPES[dtypes]
    layer = case[0](case[1], rng, input_dtype)
    rs = layer.replay_state(L, state_dtype, buffer_dtype, np.zeros(case[1].batch))
    inp = layer.draw()
    texts = {"standard": lower_for_cuda(layer.kernel_step, rs.checkpoint, inp)}
    for route in ("output", "state"):
        for fused in (False, True):
            config = replay_config(layer, L, state_dtype, fused_flush=fused)
            texts[route, fused] = lower_for_cuda(lambda r, i: layer.kernel_replay_step(r, i, route, config), rs, inp)
    texts["direct", True] = lower_for_cuda(lambda r, i: layer.kernel_replay_step(r, i, "direct", None), rs, inp)
    # The standard step, then per route: (replay, flush launch) and the fused
    # replay; the direct route.
    assert sum(text.count("__gpu$xla.gpu.triton") for text in texts.values()) == 8
    # The one-launch steps move the cursor in place, counting the row's programs with an atomic add.
    for key, text in texts.items():
        assert ("atomic_rmw" in text) == (key != "standard" and key[1]), key


@pytest.mark.parametrize("case", [c for c in cases(GPU_TILINGS) if len(c[1]) == 5], ids=case_id)
def test_flush_tilings_lower_for_cuda(case, rng):
    """The flush on its own tiling (GPU_TILINGS: the flush launch's, or the
    fused flush's sub-tiles), lowered for Triton on the CPU."""
    layer = case[0](GPU_SHAPES[case[0]][0], rng, jnp.bfloat16)
    rs = layer.replay_state(8, jnp.float32, jnp.bfloat16, np.zeros(layer.s.batch))
    config = gpu_tiling_config(case[1])
    text = lower_for_cuda(lambda r, i: layer.kernel_replay_step(r, i, "output", config), rs, layer.draw())
    if config.fused_flush:  # one launch, its flush in sub-tiles of flush_block_v rows
        assert text.count("__gpu$xla.gpu.triton") == 1
        assert f"output_L8_{config.tag()}" in text and config.tag().endswith(f"_fused_f{config.flush_block_v}x0x0")
    else:
        assert text.count("__gpu$xla.gpu.triton") == 2
        assert f"flush_L8_bv{config.flush_block_v}_w{config.flush_warps}_s1_t1_r{config.flush_rows}" in text


@pytest.mark.parametrize("case", cases(GPU_SHAPES, first_only=True), ids=case_id)
@pytest.mark.parametrize("fused", [False, True], ids=["flush-launch", "fused-flush"])
def test_flush_is_one_dot_from_16_slots(case, fused, rng):
    """The flush's rank-L update: a loop for L <= 8, dots once the buffer pads
    to 16 slots (L >= 9). With bf16 buffers, one exact bf16 x bf16 dot per
    bf16 part of the weighted records (3 for an f32 state, 2 for a bf16
    state) against the keys as stored; with f32 or f16 buffers one f32 dot
    of 6 split-bf16 products (3 for a bf16 state). The CPU computes every
    dot exactly: the accuracy on the tensor cores is test_rank_update_accuracy's
    GPU case."""
    layer = case[0](case[1], rng, jnp.bfloat16)
    bf, x6, x3 = (("bfloat16", "bfloat16", "None"), ("float32", "float32", "BF16_BF16_F32_X6"),
                  ("float32", "float32", "BF16_BF16_F32_X3"))
    for L, state_dtype, buffer_dtype, expected in [
            (8, jnp.float32, jnp.bfloat16, []), (9, jnp.float32, jnp.bfloat16, [bf] * 3),
            (16, jnp.float32, jnp.bfloat16, [bf] * 3), (32, jnp.bfloat16, jnp.bfloat16, [bf] * 2),
            (16, jnp.float32, jnp.float32, [x6]), (16, jnp.float32, jnp.float16, [x6]),
            (16, jnp.bfloat16, jnp.float16, [x3])]:
        rs = layer.replay_state(L, state_dtype, buffer_dtype, np.zeros(case[1].batch))
        config = replay_config(layer, L, state_dtype, fused_flush=fused)
        assert kernel_dots(layer, rs, config) == expected, (L, state_dtype, buffer_dtype)


def kernel_dots(layer, rs, config):
    """(lhs dtype, rhs dtype, precision) of each dot in the jaxpr of one replay step."""
    jaxpr = jax.make_jaxpr(lambda r, i: layer.kernel_replay_step(r, i, "output", config))(rs, layer.draw())
    return [(str(e.invars[0].aval.dtype), str(e.invars[1].aval.dtype), str(e.params["precision"]).split(".")[-1])
            for e in jaxpr_equations(jaxpr.jaxpr) if e.primitive.name == "dot_general"]


@pytest.mark.parametrize(("state_dtype", "interpret", "fused"), [
    (jnp.float32, False, True), (jnp.bfloat16, False, False), (jnp.float32, True, False),
], ids=["f32-compiled", "bf16-compiled", "f32-interpreted"])
def test_gdn_standard_step_fuses_its_update_on_an_f32_state(state_dtype, interpret, fused):
    """The GDN standard step's state update S + d k^T is one PTX fma.rn.f32 an element
    (`tiles.fma`: XLA's Triton path leaves products and sums unfused) in a kernel compiled for the GPU
    on an f32 state, the one case where that measured faster (bench/RESULTS.md, 2026-12-05); on a
    bf16 state, and interpreted, a product and a sum. Checked on the traced jaxpr (no GPU needed)."""
    B, H, HV, K, V = 2, 2, 4, 64, 32
    S, bf16 = jax.ShapeDtypeStruct, jnp.bfloat16
    args = (S((B, HV, V, K), state_dtype), S((B, H, K), bf16), S((B, H, K), bf16), S((B, HV, V), bf16),
            S((B, HV), jnp.float32), S((B, HV), bf16))
    jaxpr = jax.make_jaxpr(lambda *a: kernels.gdn_step(*a, scale=K ** -0.5, use_qk_l2norm=True,
                                                       interpret=interpret))(*args)
    names = {e.primitive.name for e in jaxpr_equations(jaxpr.jaxpr)}
    assert "pallas_call" in names
    asm = [e.params["asm"] for e in jaxpr_equations(jaxpr.jaxpr) if e.primitive.name == "elementwise_inline_asm_p"]
    assert asm == (["fma.rn.f32 $0, $1, $2, $3;"] if fused else [])


# The f32-key cases check the dot's accuracy on the GPU only: the CPU
# computes it exactly whatever the algorithm (there they check the product).
@pytest.mark.parametrize("backend", ["interpret", pytest.param("pallas", marks=pytest.mark.gpu)])
@pytest.mark.parametrize(("state_dtype", "key_dtype", "rtol"), [
    (jnp.float32, jnp.bfloat16, 1e-6),  # 3 bf16 parts of the weighted records (CPU: <= 2e-7)
    (jnp.bfloat16, jnp.bfloat16, 2e-5),  # 2 parts (CPU: <= 6e-6), far below a bf16 state's rounding (4e-3)
    (jnp.float32, jnp.float32, 1e-6),  # f32 keys: one dot of 6 split-bf16 products
    (jnp.float32, jnp.float16, 1e-6),  # f16 keys: the same dot
], ids=["f32state-bf16keys", "bf16state-bf16keys", "f32state-f32keys", "f32state-f16keys"])
def test_rank_update_accuracy(backend, state_dtype, key_dtype, rtol, rng):
    """The rank-L update's dots (`kernels.replay_math.rank_update`, as both layers'
    flushes call it) in a kernel, against a float64 product: an f32 state
    keeps f32 accuracy (relative to the largest element; one bf16 part of the
    weighted records is off by about 2e-3, two by 2-5e-6)."""
    from replayssm_jax.kernels import launch, replay_math

    BL, BV, BK = 32, 64, 128
    S = jnp.asarray(rng.normal(size=(BV, BK)), jnp.float32)
    Uw = jnp.asarray(rng.normal(size=(BL, BV)) * np.exp(rng.normal(size=(BL, 1))), jnp.float32)
    Kb = jnp.asarray(rng.normal(size=(BL, BK)), key_dtype)

    def kernel(s_ref, u_ref, k_ref, o_ref):
        o_ref[...] = replay_math.rank_update(s_ref[...], u_ref[...], k_ref[...], state_dtype)

    out = launch.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((BV, BK), jnp.float32),
                             interpret=backend == "interpret", config=kernels.StepConfig(block_v=BV))(S, Uw, Kb)
    f64 = [np.asarray(jnp.asarray(a, jnp.float32), np.float64) for a in (S, Uw, Kb)]
    expected = f64[0] + f64[1].T @ f64[2]
    err = np.abs(np.asarray(out, np.float64) - expected).max() / np.abs(expected).max()
    assert err <= rtol, f"relative error {err:.2e} > {rtol:.0e}"
