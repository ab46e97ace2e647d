"""The pure-JAX reference against float64 NumPy loops, for both layer types.

Every test runs for Mamba-2 and for Gated DeltaNet through the adapters in
cases.py, at the reference shapes of the case tables (replayssm_jax.testing):
head dims 24 and 100, n_groups < nheads, and HV = 2H and 3H. The adapters
call replayssm_jax.reference itself (the math, no argument checks);
replay_commit is replayssm_jax's (validated). The standard and replay steps,
which also run on the kernels, are checked for every backend in
test_kernels.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cases import GDN_CASES, MAMBA2_CASES, GDNCase, Mamba2Case, assert_close, take_rows, take_step
from replayssm_jax import replay_commit

SHAPES = {str(shape): shape for table in (MAMBA2_CASES, GDN_CASES) for shape in table.reference}
CASES = list(SHAPES)
TWO_CASES = ["mamba2", "gdn-HV2H"]


def make_case(name, rng, batch=None):
    """The reference adapter at the shape `name` of SHAPES (with `batch` rows if given)."""
    shape = SHAPES[name] if batch is None else SHAPES[name].with_batch(batch)
    return (GDNCase if name.startswith("gdn") else Mamba2Case)(rng, api="reference", shape=shape)


def run_standard(case, state, seq, steps):
    """The reference's standard step loop; returns (outputs [batch, T, ...], final state)."""
    ys = []
    for t in range(steps):
        y, state = case.step(state, take_step(seq, t))
        ys.append(y)
    return jnp.stack(ys, axis=1), state


def run_oracle(case, state, seq, steps):
    ys = []
    for t in range(steps):
        y, state = case.oracle_step(state, take_step(seq, t))
        ys.append(y)
    return np.stack(ys, axis=1), state


# T = 1 (one partial chunk), 15 (a full and a partial chunk; also against the float64 loop) and 63 (eight
# chunks) on each layer's first shape; the second shapes (the ungated Mamba-2 with a dt limit, GDN with
# HV = 3H and K = 100) at T = 15, their T 1 and 63 `slow`.
@pytest.mark.parametrize(("name", "T"), [pytest.param(name, T, id=f"{T}-{name}",
                                                      marks=[] if name in TWO_CASES or T == 15 else [pytest.mark.slow])
                                         for T in (1, 15, 63) for name in CASES])
def test_chunked_matches_step_loop(name, T, rng):
    case = make_case(name, rng)
    state = case.initial_state()
    seq = case.draw(T)
    y, final = case.chunked(state, seq, chunk_size=8)
    y_loop, final_loop = run_standard(case, state, seq, T)
    assert_close(y, y_loop, jnp.float32, "chunked outputs vs step loop")
    assert_close(final, final_loop, jnp.float32, "chunked final state vs step loop")
    if T == 15:
        y_ref, final_ref = run_oracle(case, state, seq, T)
        assert_close(y, y_ref, jnp.float32, "chunked outputs vs numpy")
        assert_close(final, final_ref, jnp.float32, "chunked final state vs numpy")


@pytest.mark.parametrize("name", TWO_CASES)
def test_chunked_from_zero_state(name, rng):
    case = make_case(name, rng)
    seq = case.draw(10)
    y, final = case.chunked(None, seq, chunk_size=4)
    y_ref, final_ref = run_oracle(case, np.zeros(case.dims), seq, 10)
    assert final.dtype == jnp.float32
    assert_close(y, y_ref, jnp.float32, "outputs")
    assert_close(final, final_ref, jnp.float32, "final state")


# The reference's replay step has no branch on L: L = 1 (a flush every step), 3 and 16 (a short and a
# long buffer) run by default, 2 and 8 (the same paths) as `slow`. By default L = 1 on each layer's first
# shape (TWO_CASES), on the second shapes `slow`; L 3 and 16 on every shape, each on one route: on the first
# shapes L = 16 on the output route and L = 3 on the state route, on the second shapes the reverse (every
# route runs every shape, L = 1, a short and a long buffer on both layers); the other route `slow`.
REPLAY_LENGTHS = [1, 2, 3, 8, 16]


def default_replay_case(name, L, route) -> bool:
    """Whether a case of test_replay_matches_standard runs by default (see REPLAY_LENGTHS)."""
    if L == 1:
        return name in TWO_CASES
    return L in (3, 16) and (route == "output") == ((L == 16) == (name in TWO_CASES))


@pytest.mark.parametrize(("name", "L", "route"), [
    pytest.param(name, L, route, id=f"{route}-{L}-{name}",
                 marks=[] if default_replay_case(name, L, route) else [pytest.mark.slow])
    for route in ("output", "state") for L in REPLAY_LENGTHS for name in CASES])
def test_replay_matches_standard(name, L, route, rng):
    case = make_case(name, rng)
    state = case.initial_state()
    steps = 3 * L + 1
    seq = case.draw(steps)
    y_std, final_std = run_standard(case, state, seq, steps)
    rs = case.replay_init(state, L)
    for t in range(steps):
        y, rs = case.replay_step(rs, take_step(seq, t), route=route)
        assert_close(y, y_std[:, t], jnp.float32, f"replay output at step {t}")
        np.testing.assert_array_equal(rs.cursor, (t + 1) % L)
    assert_close(case.materialize(rs), final_std, jnp.float32, "materialized state")
    if L > 1:  # the checkpoint is the state at the last flush, step 3L
        _, at_flush = run_standard(case, state, seq, 3 * L)
        assert_close(rs.checkpoint, at_flush, jnp.float32, "checkpoint")


@pytest.mark.parametrize("name", TWO_CASES)
@pytest.mark.parametrize("route", ["output", "state"])
def test_replay_after_an_extreme_decay(name, route, rng):
    """A decay that wipes the state (GDN g = -inf, allowed by g <= 0; Mamba-2 a
    dt spike of 1e4) inside the buffer: replay outputs stay finite and equal to
    the standard step's (the slot weights are suffix sums, no G - G_i)."""
    case = make_case(name, rng)
    state, L, steps = case.initial_state(), 8, 12
    seq = case.draw(steps)
    if name.startswith("gdn"):
        seq["g"][:, 2, 0] = -np.inf
        seq["g"][:, 5] = -500.0
    else:
        seq["dt"][:, 2] = 1e4
    y_std, final_std = run_standard(case, state, seq, steps)
    assert np.isfinite(np.asarray(y_std)).all()
    rs = case.replay_init(state, L)
    for t in range(steps):
        y, rs = case.replay_step(rs, take_step(seq, t), route=route)
        assert_close(y, y_std[:, t], jnp.float32, f"replay output at step {t}")
    assert_close(case.materialize(rs), final_std, jnp.float32, "materialized state")


# f32 records `slow`: test_replay_matches_standard holds both routes to the standard step at f32 tolerance.
@pytest.mark.parametrize("name", TWO_CASES)
@pytest.mark.parametrize("buffer_dtype", [pytest.param(jnp.float32, marks=pytest.mark.slow), jnp.bfloat16])
def test_replay_routes_agree(name, buffer_dtype, rng):
    """The output and state routes give the same outputs and checkpoints over 7 steps (a flush at the 5th),
    to f32 rounding; with bf16 records to bf16's: GDN's d record is computed in f32 by both routes in a
    different order of sums, and where the two values straddle a bf16 rounding boundary the records differ
    by one bf16 step, which the later steps carry (seen once in the checkpoint: 1.5e-4 of 1.3)."""
    case = make_case(name, rng)
    state = case.initial_state()
    a = b = case.replay_init(state, 5, buffer_dtype=buffer_dtype)
    tol = jnp.bfloat16 if buffer_dtype == jnp.bfloat16 and name.startswith("gdn") else jnp.float32
    for t in range(7):
        inp = case.draw()
        ya, a = case.replay_step(a, inp, route="output")
        yb, b = case.replay_step(b, inp, route="state")
        assert_close(ya, yb, tol, f"routes at step {t}")
    assert_close(a.checkpoint, b.checkpoint, tol, "checkpoints")


@pytest.mark.parametrize("name", TWO_CASES)
def test_replay_bf16_checkpoint_and_buffer(name, rng):
    """bf16 checkpoint and bf16 records against the float64 recurrence."""
    case = make_case(name, rng)
    state = case.initial_state()
    steps = 9
    seq = {key: jnp.asarray(value, jnp.bfloat16) for key, value in case.draw(steps).items()}
    y_ref, final_ref = run_oracle(case, state, {k: np.asarray(v.astype(jnp.float32)) for k, v in seq.items()}, steps)
    rs = case.replay_init(jnp.asarray(state, jnp.bfloat16), 4, buffer_dtype=jnp.bfloat16)
    for t in range(steps):
        y, rs = case.replay_step(rs, take_step(seq, t))
        assert y.dtype == jnp.bfloat16
        assert_close(y, y_ref[:, t], jnp.bfloat16, f"output at step {t}")
    assert rs.checkpoint.dtype == jnp.bfloat16
    assert_close(case.materialize(rs), final_ref, jnp.bfloat16, "materialized state")


@pytest.mark.parametrize("name", TWO_CASES)
def test_a_full_row_rounds_its_bf16_checkpoint_once(name, rng):
    """Rows filled by append steps (cursor L) then stepped: the flush absorbs the L records and this step in
    f32 and rounds the bf16 checkpoint once, so the output and state routes give the direct route's output
    to f32 rounding (a rounding between the early flush and the step moved it ~1e-3), and all three write
    the same checkpoint to bf16 rounding."""
    case = make_case(name, rng)
    rs = case.replay_init(jnp.asarray(case.initial_state(), jnp.bfloat16), 4, buffer_dtype=jnp.float32)
    for _ in range(4):
        _, rs = case.replay_step(rs, case.draw(), route="append")
    assert np.asarray(rs.cursor).tolist() == [4] * len(rs.cursor)
    inp = case.draw()
    y_direct, direct = case.replay_step(rs, inp, route="direct")
    for route in ("output", "state"):
        y, new = case.replay_step(rs, inp, route=route)
        assert_close(y, y_direct, jnp.float32, f"{route} route's output")
        assert_close(new.checkpoint, direct.checkpoint, jnp.bfloat16, f"{route} route's checkpoint")
        assert new.checkpoint.dtype == jnp.bfloat16 and not np.asarray(new.cursor).any()


@pytest.mark.parametrize("name", TWO_CASES)
def test_rows_with_different_cursors(name, rng):
    """A window accepted 0, 2 and all W steps puts the rows at three cursors;
    the rows then flush on different steps and still match the recurrence."""
    case = make_case(name, rng)
    L, W = 6, 4
    state = case.initial_state()
    rs = case.replay_init(state, L)
    window = case.draw(W)
    y, rs = case.verify(rs, window)
    accepted = np.array([0, 2, W])
    rs = replay_commit(rs, accepted)
    np.testing.assert_array_equal(rs.cursor, accepted)
    oracle = []
    for row, m in enumerate(accepted):
        s = kept = state[row : row + 1]
        for t in range(W):
            y_ref, s = case.oracle_step(s, take_rows(take_step(window, t), [row]))
            assert_close(y[row : row + 1, t], y_ref, jnp.float32, f"window output row {row} step {t}")
            kept = s if t < m else kept
        oracle.append(kept)
    oracle = np.concatenate(oracle)
    cursors = [np.asarray(rs.cursor)]
    for t in range(2 * L):
        inp = case.draw()
        y, rs = case.replay_step(rs, inp)
        y_ref, oracle = case.oracle_step(oracle, inp)
        assert_close(y, y_ref, jnp.float32, f"output at step {t}")
        cursors.append(np.asarray(rs.cursor))
    assert_close(case.materialize(rs), oracle, jnp.float32, "materialized state")
    flush_steps = [set(np.nonzero(np.stack(cursors)[:, row] == 0)[0]) for row in range(3)]
    assert flush_steps[0] != flush_steps[1] != flush_steps[2], "rows should flush on different steps"


@pytest.mark.parametrize("name", TWO_CASES)
def test_flush_keeps_the_state(name, rng):
    case = make_case(name, rng)
    rs = case.replay_init(case.initial_state(), 8)
    for _ in range(5):
        _, rs = case.replay_step(rs, case.draw())
    flushed = case.flush(rs)
    np.testing.assert_array_equal(flushed.cursor, 0)
    assert_close(flushed.checkpoint, case.materialize(rs), jnp.float32, "flushed checkpoint")
    assert_close(case.materialize(flushed), case.materialize(rs), jnp.float32, "state after flush")


@pytest.mark.parametrize("name", TWO_CASES)
def test_replay_under_jit_and_scan(name, rng):
    """The replay step is jit-able and scan-able with the state as the carry."""
    case = make_case(name, rng)
    steps, L = 11, 4
    seq = case.draw(steps)
    state = case.initial_state()
    y_std, final_std = run_standard(case, state, seq, steps)

    @jax.jit
    def decode(rs, seq):
        def body(rs, inp):
            y, rs = case.replay_step(rs, inp)
            return rs, y

        rs, ys = jax.lax.scan(body, rs, {k: jnp.swapaxes(v, 0, 1) for k, v in seq.items()})
        return jnp.swapaxes(ys, 0, 1), rs

    ys, rs = decode(case.replay_init(state, L), seq)
    assert_close(ys, y_std, jnp.float32, "scanned outputs")
    assert_close(case.materialize(rs), final_std, jnp.float32, "scanned final state")


# --------------------------------------------------------------------------
# Speculative decoding: random sequences of step / verify(W) / commit(m)


@st.composite
def programs(draw):
    L = draw(st.integers(1, 6))
    ops = []
    for _ in range(draw(st.integers(1, 7))):
        if draw(st.booleans()):
            ops.append(("step", draw(st.sampled_from(["output", "state"]))))
        else:
            W = draw(st.integers(1, L))
            ops.append(("verify", W, tuple(draw(st.integers(0, W)) for _ in range(2))))
    return L, ops, draw(st.integers(0, 2**32 - 1))


@pytest.mark.parametrize("name", TWO_CASES)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(program=programs())
def test_speculative_sequences(name, program):
    """Replay state after any sequence of steps, verifies and commits equals the
    recurrence that applies only the accepted steps, row by row."""
    L, ops, seed = program
    case = make_case(name, np.random.default_rng(seed), batch=2)
    state = case.initial_state()
    rs = case.replay_init(state, L)
    rows = [state[i : i + 1].astype(np.float64) for i in range(2)]
    for op in ops:
        if op[0] == "step":
            inp = case.draw()
            y, rs = case.replay_step(rs, inp, route=op[1])
            for i in range(2):
                y_ref, rows[i] = case.oracle_step(rows[i], take_rows(inp, [i]))
                assert_close(y[i : i + 1], y_ref, jnp.float32, f"step output row {i}")
        else:
            _, W, accepted = op
            window = case.draw(W)
            y, rs = case.verify(rs, window)
            assert rs.window == W
            for i in range(2):
                s = rows[i]
                for t in range(W):
                    y_ref, s = case.oracle_step(s, take_rows(take_step(window, t), [i]))
                    assert_close(y[i : i + 1, t], y_ref, jnp.float32, f"window output row {i} step {t}")
                    if t + 1 == accepted[i]:
                        rows[i] = s
            rs = replay_commit(rs, np.array(accepted, np.int32))
        assert np.all((0 <= np.asarray(rs.cursor)) & (np.asarray(rs.cursor) <= L))
        assert_close(case.materialize(rs), np.concatenate(rows), jnp.float32, f"state after {op}")


@pytest.mark.parametrize("name", TWO_CASES)
@pytest.mark.parametrize("route", ["output", "state"])
def test_rejected_non_finite_draft_leaves_no_trace(name, route, rng):
    """A rejected draft step whose inputs overflowed (inf) is a dead record: it
    must not reach later outputs or the state (0 * inf would be NaN)."""
    case = make_case(name, rng, batch=2)
    state = case.initial_state()
    rs = case.replay_init(state, 6)
    window = case.draw(3)
    first = "x" if name.startswith("mamba2") else "v"
    window[first][:, 2] = np.inf
    _, rs = case.verify(rs, window)
    rs = replay_commit(rs, np.array([1, 2], np.int32))
    rows = []
    for i, m in enumerate([1, 2]):
        s = state[i : i + 1]
        for t in range(m):
            _, s = case.oracle_step(s, take_rows(take_step(window, t), [i]))
        rows.append(s)
    inp = case.draw()
    y, rs = case.replay_step(rs, inp, route=route)
    y_ref, s_ref = case.oracle_step(np.concatenate(rows), inp)
    assert_close(y, y_ref, jnp.float32, "output after the rejected draft")
    assert_close(case.materialize(rs), s_ref, jnp.float32, "state after the rejected draft")


def test_commit_counts_are_clipped_inside_jit(rng):
    case = make_case("gdn-HV2H", rng)
    rs = case.replay_init(case.initial_state(), 4)
    _, pending = case.verify(rs, case.draw(2))
    committed = jax.jit(replay_commit)(pending, jnp.array([7, -3, 1], jnp.int32))
    np.testing.assert_array_equal(committed.cursor, [2, 0, 1])
