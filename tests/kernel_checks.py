"""Shared checks of the ops that run on several backends, for both layers.

The layer adapters (`GDN`, `Mamba2`: fresh random inputs of one shape, never
zeros; the ops called through :mod:`replayssm_jax.ops` on a given backend),
the shapes, dtypes and tolerances are replayssm_jax.testing's (re-exported
here); the benchmarks use the same. The checks run the same inputs through
the backend under test ("xla", "interpret" on the CPU, "pallas" on a GPU)
and the float64 NumPy loops (cases.oracle_step; for states of more than
NUMPY_ORACLE_MAX_ELEMENTS elements on a kernel backend, the "xla" reference
on the device instead), and for a kernel backend also through the "xla"
reference, and compare outputs and states with the per-dtype tolerance table.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from cases import assert_close, oracle_step
from hlo_checks import assert_step_alone_and_in_a_loop
from replayssm_jax import kernels
from replayssm_jax.testing import (  # noqa: F401  (the tests import these from here)
    ADAPTERS,
    CASE_TABLES,
    DTYPES,
    GDN,
    GDN_CASES,
    MAMBA2_CASES,
    GDNShape,
    Mamba2,
    Mamba2Shape,
    tolerance_dtype,
)

f32, bf16 = jnp.float32, jnp.bfloat16
tol_dtype = tolerance_dtype

# The shapes of the kernel tests per adapter class: interpreted on the CPU, compiled on a GPU.
CPU_SHAPES = {GDN: list(GDN_CASES.cpu), Mamba2: list(MAMBA2_CASES.cpu)}
GPU_SHAPES = {GDN: list(GDN_CASES.gpu), Mamba2: list(MAMBA2_CASES.gpu)}


def replay_config(layer, L: int, state_dtype, **changes):
    """The kernels' default ReplayConfig at the layer's shape, with `changes` (e.g. fused_flush)."""
    base = kernels.default_replay_config(layer.s.batch, *layer.heads_dims(), state_dtype, L)
    return dataclasses.replace(base, **changes)


def mixed_cursors(batch: int, L: int) -> np.ndarray:
    """Per-row cursors covering: empty (0), about to flush (L - 1), mid, and
    entering full (L, as after a speculative commit)."""
    pattern = [0, L - 1, L // 2, L]
    return np.array([pattern[i % len(pattern)] for i in range(batch)], np.int32)


def _f64(a):
    return np.asarray(jnp.asarray(a, f32), np.float64)


# States above this many elements (the model shapes of the GPU tests at batch
# 64-256) are compared with the "xla" reference on the device only: with the
# float64 NumPy loops at those sizes the GPU tests ran past 330 s on the H200
# (141 of 157 done, 2026-12-01), against 267 s for all 157 without them. The
# CPU shapes, and the GPU shapes at batch 1, are compared with both.
NUMPY_ORACLE_MAX_ELEMENTS = 1 << 22


def _numpy_oracle(layer) -> bool:
    """Whether the checks of `layer` compare with the float64 NumPy loops (small states)."""
    return layer.s.batch * int(np.prod(layer.heads_dims())) <= NUMPY_ORACLE_MAX_ELEMENTS


def check_standard(layer, state_dtype, backend, steps=2):
    """`steps` standard steps on `backend` against the float64 NumPy loop,
    which follows the backend's (rounded) state: outputs in the input dtype
    within the tolerance of (input, state) dtypes, states in `state_dtype`
    within its tolerance. The "xla" reference runs with float32 matmuls (no
    TF32 on a GPU)."""
    with jax.default_matmul_precision("highest"):
        _check_standard(layer, jnp.dtype(state_dtype), backend, steps)


def _check_standard(layer, state_dtype, backend, steps):
    state = layer.state(state_dtype)
    numpy_oracle = _numpy_oracle(layer) or backend == "xla"
    for t in range(steps):
        inp = layer.draw()
        if numpy_oracle:
            y_want, s_want = oracle_step(layer, _f64(state), inp)
        else:  # a large state: the "xla" reference on the same state
            y_want, s_want = layer.step(state, inp, "xla")
        y, state = layer.step(state, inp, backend)
        assert y.dtype == layer.dtype and state.dtype == state_dtype, (t, y.dtype, state.dtype)
        assert_close(y, y_want, tolerance_dtype(layer.dtype, state_dtype), what=f"output, step {t}")
        assert_close(state, s_want, state_dtype, what=f"state, step {t}")


def check_replay(layer, L, route, input_dtype, state_dtype, buffer_dtype, backend, steps=3, config=None,
                 poison=False, wipe_at=None):
    """Replay steps on `backend` from a state with mixed cursors.

    Compared every step: outputs and the materialized state with the float64
    NumPy recurrence from the initial materialized state (tolerance of the
    input, state and buffer dtypes), the cursor rule (`cursor_rule`), and
    that rows that do not flush keep their checkpoint bit for bit; on a
    kernel backend also outputs, materialized state (tolerance
    of the input and state dtypes) and cursors with the "xla" reference's
    replay step on the same state. `route`: one route, or a tuple of routes
    taken in turn, step by step (a decode loop may switch routes), and
    `config` then a config or a {route: config} (absent: the default). The
    reference runs with float32 matmuls (no TF32 on a GPU). `config` fixes
    the kernel tiling; `poison` fills the dead slots of the initial buffers
    with NaN and inf (as a rejected draft may leave them): they must not reach
    any output or state. `wipe_at`: the step whose inputs get an extreme
    decay on head 0 (`layer.wipe_decay`).
    """
    with jax.default_matmul_precision("highest"):
        _check_replay(layer, L, route, input_dtype, state_dtype, buffer_dtype, backend, steps, config, poison,
                      wipe_at)


def cursor_rule(cursor: np.ndarray, L: int, route: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows whose checkpoint a replay step on `route` writes, cursors after it) from the cursors at entry:
    every row, to 0, on the direct route; on the deferred route the full rows (cursor L), which flush
    first and then append (to 1), the others cursor + 1 (a row may fill its buffer: L); on the output and
    state routes the rows at L - 1 or L, which flush with the step (to 0), the others cursor + 1."""
    if route == "direct":
        return np.ones_like(cursor, bool), np.zeros_like(cursor)
    if route == "deferred":
        full = cursor >= L
        return full, np.where(full, 1, cursor + 1)
    flush = cursor >= L - 1
    return flush, np.where(flush, 0, cursor + 1)


def poison_dead_slots(rs):
    """`rs` with every buffer slot at or after its row's cursor set to NaN
    (and the first dead slot to inf)."""
    L = rs.buffer_len
    lane = np.arange(L)[None, None, :]
    cursor = np.asarray(rs.cursor)[:, None, None]
    changes = {}
    for name in ("d", "k", "g", "x", "dt", "B"):
        buf = getattr(rs, name, None)
        if buf is None:
            continue
        a = np.asarray(jnp.asarray(buf, f32)).copy()
        a = np.where((lane > cursor)[..., None] if a.ndim == 4 else lane > cursor, np.nan, a)
        a = np.where((lane == cursor)[..., None] if a.ndim == 4 else lane == cursor, np.inf, a)
        changes[name] = jnp.asarray(a, buf.dtype)
    return rs.replace(**changes)


def _check_replay(layer, L, route, input_dtype, state_dtype, buffer_dtype, backend, steps, config, poison, wipe_at):
    tol = tolerance_dtype(input_dtype, state_dtype)
    tol_np = tolerance_dtype(input_dtype, state_dtype, buffer_dtype)
    rs = layer.replay_state(L, state_dtype, buffer_dtype, mixed_cursors(layer.s.batch, L))
    if poison:
        rs = poison_dead_slots(rs)
    numpy_oracle = _numpy_oracle(layer) or backend == "xla"
    rs_ref, s_np = rs, (_f64(layer.materialize(rs)) if numpy_oracle else None)
    for t in range(steps):
        inp = layer.draw()
        if t == wipe_at:
            inp = layer.wipe_decay(inp)
        cursor = np.asarray(rs.cursor)
        step_route = route[t % len(route)] if isinstance(route, tuple) else route
        y, new = layer.replay_step(rs, inp, step_route, backend,
                                   config.get(step_route) if isinstance(config, dict) else config)
        assert np.isfinite(_f64(y)).all(), f"non-finite output, step {t}"
        if numpy_oracle:
            y_np, s_np = oracle_step(layer, s_np, inp)
            assert_close(y, y_np, tol_np, what=f"output vs NumPy, step {t}")
            assert_close(layer.materialize(new), s_np, tol_np, what=f"materialized state vs NumPy, step {t}")
        flush, after = cursor_rule(cursor, L, step_route)
        np.testing.assert_array_equal(np.asarray(new.cursor), after, err_msg=f"cursor, step {t}")
        if backend != "xla":
            y_ref, rs_ref = layer.replay_step(rs_ref, inp, step_route, "xla")
            assert_close(y, y_ref, tol, what=f"output, step {t}")
            assert_close(layer.materialize(new), layer.materialize(rs_ref), tol,
                         what=f"materialized state, step {t}")
            np.testing.assert_array_equal(np.asarray(new.cursor), np.asarray(rs_ref.cursor),
                                          err_msg=f"cursor vs reference, step {t}")
        kept = _f64(new.checkpoint)[~flush]
        old = _f64(rs.checkpoint)[~flush]
        np.testing.assert_array_equal(kept, old, err_msg=f"checkpoint of non-flushing rows changed, step {t}")
        rs = new


def check_deferred_steps(layer, rs, config, steps: int, tol) -> None:
    """`steps` compiled deferred-route steps (`ops`, backend "pallas", the kernels' `config`) from the replay
    state `rs`, against the reference's ("xla") step by step: outputs and materialized states within `tol`,
    cursors equal (`cursor_rule`: full rows flush first, then append to 1), the checkpoint of every row
    that did not enter full bit for bit and of every full row within `tol` of the reference's flush; at
    least one row enters full at some step."""
    run = jax.jit(lambda s, i: layer.replay_step(s, i, "deferred", "pallas", config))
    ref = jax.jit(lambda s, i: layer.replay_step(s, i, "deferred", "xla"))
    rs_ref, flushed = rs, 0
    for t in range(steps):
        inp, cursor = layer.draw(), np.asarray(rs.cursor)
        y, new = run(rs, inp)
        y_ref, rs_ref = ref(rs_ref, inp)
        assert_close(y, y_ref, tol, what=f"outputs, step {t}")
        assert_close(layer.materialize(new), layer.materialize(rs_ref), tol, what=f"materialized state, step {t}")
        full, after = cursor_rule(cursor, rs.buffer_len, "deferred")
        np.testing.assert_array_equal(np.asarray(new.cursor), after, err_msg=f"cursor, step {t}")
        np.testing.assert_array_equal(np.asarray(rs_ref.cursor), after, err_msg=f"reference cursor, step {t}")
        np.testing.assert_array_equal(_f64(new.checkpoint)[~full], _f64(rs.checkpoint)[~full],
                                      err_msg=f"checkpoint of a row that was not full, step {t}")
        if full.any():  # a full row's flushed checkpoint
            assert_close(_f64(new.checkpoint)[full], _f64(rs_ref.checkpoint)[full], tol,
                         what=f"flushed checkpoints, step {t}")
        flushed += int(full.sum())
        rs = new
    assert flushed, "no row entered full: the flush launch was not tested"


def check_auto_is_deferred(layer, name: str, L: int) -> None:
    """route="auto" through the ops ("pallas") on `layer` (a batch of at least DEFERRED_MIN_BATCH rows), from
    staggered cursors with full rows among them, an f32 checkpoint and bf16 records: the deferred route
    (its flush launch, `{name}_deferred_flush_L...`, or where the GPU is Hopper-class the Mosaic GPU
    readout that flushes, `{name}_deferred_tma...`); L + 2 steps within the tolerance of the reference's
    output route."""
    rs = rs_ref = layer.replay_state(L, f32, bf16, (np.arange(layer.s.batch) * 5 % (L + 1)).astype(np.int32))
    step = jax.jit(lambda s, i: layer.replay_step(s, i, "auto", "pallas"))
    text = step.trace(rs, layer.draw()).lower().as_text()
    hopper = str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")
    flushes = f"{name}_deferred_tma" if hopper else f"{name}_deferred_flush_L"
    assert flushes in text and ("mosaic_gpu_v2" in text) == hopper
    tol = tolerance_dtype(bf16, f32)
    for t in range(L + 2):
        inp = layer.draw()
        y, rs = step(rs, inp)
        y_ref, rs_ref = layer.replay_step(rs_ref, inp, "output", "xla")
        assert_close(y, y_ref, tol, what=f"outputs, step {t}")
        assert_close(layer.materialize(rs), layer.materialize(rs_ref), tol, what=f"materialized state, step {t}")


def check_deferred_step_kernels(layer, L: int, triton_launches: int) -> None:
    """The deferred step on Mosaic GPU (a TMAReadoutConfig()), jitted alone with its state donated:
    `triton_launches` Triton launches (GDN: its prelude; Mamba-2: the launch after the readout, and the
    flush launch where its readout does not flush) and one Mosaic GPU kernel, nothing else; a decode loop
    of 2 L steps on it from staggered cursors (every row fills and flushes its buffer) copies no
    checkpoint, record or cursor (`hlo_checks.assert_step_alone_and_in_a_loop`)."""
    rs = layer.replay_state(L, f32, bf16, (np.arange(layer.s.batch) * 3 % (L + 1)).astype(np.int32))

    def step(rs, inp):
        return layer.kernel_replay_step(rs, inp, "deferred", kernels.TMAReadoutConfig())

    hlo = jax.jit(step).lower(rs, layer.draw()).compile().as_text()
    launches = [hlo.count(f'custom_call_target="{target}"') for target in ("__gpu$xla.gpu.triton", "mosaic_gpu_v2")]
    assert launches == [triton_launches, 1], f"Triton and Mosaic GPU launches: {launches}"
    assert_step_alone_and_in_a_loop(step, rs, [layer.draw() for _ in range(2 * L)], jax.tree.leaves(rs))


def with_dtype(x, dtype):
    return jax.tree.map(lambda a: jnp.asarray(a, dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, x)


def lower_for_cuda(fn, *args):
    """Lower `fn(*args)` for CUDA on a machine without a GPU and return the
    StableHLO text: this runs the whole Pallas -> Triton lowering (power-of-two
    tensors, supported primitives, aliasing), short of compiling the PTX.
    Skips the test where this JAX has no hook for an abstract GPU."""
    import pytest
    from jax._src.pallas.triton import pallas_call_registration as registration

    gpu_info = getattr(registration, "gpu_info_lib", None)
    if gpu_info is None or not hasattr(gpu_info, "GpuInfo"):
        pytest.skip("this JAX has no hook to lower Pallas Triton kernels without a GPU")
    fake = gpu_info.GpuInfo(gpu_version=None, arch_name="sm_90", compute_capability=90)
    real = gpu_info.get_gpu_info
    gpu_info.get_gpu_info = lambda: fake
    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        gpu_info.get_gpu_info = real


def jaxpr_equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs in its equations' parameters (kernels, calls, loops,
    branches), in order."""
    for eqn in jaxpr.eqns:
        yield eqn
        for inner in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from jaxpr_equations(inner)
