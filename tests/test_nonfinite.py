"""Non-finite inputs and float16, against the float64 loops of numpy_loops.py.

Three failure patterns of decoding engines:
  - a NaN or inf in a later draft of a verify window (a padded or garbage
    draft) must not reach the outputs of the drafts before it, nor the state
    committed from them;
  - g = -inf (Gated DeltaNet; Mamba-2 through A = -inf), a step that forgets
    the state completely, must give the recurrence's numbers on every path;
  - float16 arrays are refused before any computation (float16 overflows in
    these recurrences).
Both layer types through the adapters of cases.py, at small shapes; the ops
with a kernel run on "xla" and "interpret".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_loops
from cases import GDNCase, Mamba2Case, assert_close, take_step
from replayssm_jax import ops, replay_commit

LAYERS = {
    "mamba2": lambda rng: Mamba2Case(rng, batch=2, nheads=2, head_dim=8, d_state=16, n_groups=1),
    "gdn": lambda rng: GDNCase(rng, batch=2, num_k_heads=1, num_v_heads=2, head_k_dim=16, head_v_dim=8),
}
ROUTES = ["output", "state", "direct", "deferred"]


def on_backend(case, backend):
    """`case` with its kernel ops (ops.KERNEL_OPS) called on `backend`, the others on "xla"."""

    def op(name):
        if name.endswith("_init"):
            return getattr(ops, name)
        return functools.partial(getattr(ops, name), backend=backend if name in ops.KERNEL_OPS else "xla")

    case.op = op
    return case


def oracle(case, state, seq):
    """(outputs [batch, T, ...], final state) of the float64 loop over `seq` from `state`."""
    return numpy_loops.run_steps(case.oracle_step, np.asarray(state, np.float64), seq)


def forget(case, seq, steps):
    """`seq` with the steps `steps` of head 0 forgetting the state: g = -inf
    (GDN); Mamba-2 has dt A = -inf on every step of a head with A = -inf,
    which `case.A` gets instead."""
    if isinstance(case, Mamba2Case):
        case.A = case.A.copy()
        case.A[0] = -np.inf
        return seq
    g = seq["g"].copy()
    g[:, steps, 0] = -np.inf
    return dict(seq, g=g)


# --------------------------------------------------------------------------
# A non-finite later draft

BAD_INPUTS = {"mamba2": ["x", "dt", "B", "C"], "gdn": ["q", "k", "v", "g", "beta"]}
OWN_OUTPUT_ONLY = ("C", "q")  # they enter their step's output, no state
BAD_CASES = [(layer, name) for layer, names in BAD_INPUTS.items() for name in names]


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("layer, name", BAD_CASES)
def test_later_draft_does_not_reach_earlier_drafts(layer, name, value, rng):
    """Draft 1 of a window of 3 has a NaN or inf in one input: draft 0's
    output is the recurrence's, drafts 1 and 2 are NaN (C, q: draft 1 only;
    they enter no state), and after accepting draft 0 the state and the
    next steps (with a flush) match the recurrence."""
    case = LAYERS[layer](rng)
    state = case.initial_state()
    rs = case.replay_init(state, 4)
    first = case.draw(1)
    _, rs = case.replay_step(rs, take_step(first, 0))
    _, start = oracle(case, state, first)
    window = case.draw(3)
    window[name] = window[name].copy()
    window[name][:, 1] = value
    # a concrete g > 0 or beta = +-inf is refused (test_validation.py); a traced one, as in a compiled decode
    # loop, is not checked
    refused = (name == "g" and value > 0) or (name == "beta" and np.isinf(value))
    verify = jax.jit(case.verify) if refused else case.verify
    y, rs = verify(rs, window)
    y_ref, after = oracle(case, start, {key: a[:, :1] for key, a in window.items()})
    assert_close(y[:, 0], y_ref[:, 0], what="output of draft 0")
    poisoned = np.asarray(y[:, 1:2] if name in OWN_OUTPUT_ONLY else y[:, 1:])
    assert np.isnan(poisoned).all(), "the outputs from the bad draft on should be NaN"
    rs = replay_commit(rs, np.ones(case.batch, np.int32))
    assert_close(case.materialize(rs), after, what="state after accepting draft 0")
    seq = case.draw(4)
    ys = []
    for t in range(4):
        out, rs = case.replay_step(rs, take_step(seq, t))
        ys.append(out)
    y_ref, final = oracle(case, after, seq)
    assert_close(jnp.stack(ys, axis=1), y_ref, what="outputs after the commit")
    np.testing.assert_array_equal(rs.cursor, 2)  # cursor 2, then 4 steps: a flush at the 2nd
    assert_close(case.materialize(rs), final, what="state after the commit")


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("layer", LAYERS)
def test_dead_nonfinite_records(layer, backend, rng):
    """A window whose drafts 1 and 2 are NaN, none accepted: the dead slots
    hold NaN records, which no replay step (each route, a flush among the
    steps) may read."""
    case = on_backend(LAYERS[layer](rng), backend)
    state = case.initial_state()
    rs = case.replay_init(state, 4)
    window = case.draw(3)
    bad = "x" if layer == "mamba2" else "k"
    window[bad] = window[bad].copy()
    window[bad][:, 1:] = np.nan
    _, rs = case.verify(rs, window)
    rs = replay_commit(rs, np.ones(case.batch, np.int32))
    _, expected = oracle(case, state, {key: a[:, :1] for key, a in window.items()})
    seq = case.draw(6)
    y_ref, _ = oracle(case, expected, seq)
    for t in range(6):
        y, rs = case.replay_step(rs, take_step(seq, t), route=ROUTES[t % len(ROUTES)])
        assert_close(y, y_ref[:, t], what=f"output at step {t} ({ROUTES[t % len(ROUTES)]})")
    _, final = oracle(case, expected, seq)
    assert_close(case.materialize(rs), final, what="final state")


# --------------------------------------------------------------------------
# g = -inf


@pytest.mark.parametrize("chunk_size", [1, 3, 8])
@pytest.mark.parametrize("layer", LAYERS)
def test_forget_chunked(layer, chunk_size, rng):
    """Chunked prefill of 7 steps with steps 1 and 3 forgetting the state
    (one of them a chunk's first step for chunk_size 3)."""
    case = LAYERS[layer](rng)
    state = case.initial_state()
    seq = forget(case, case.draw(7), [1, 3])
    y, final = case.chunked(jnp.asarray(state), seq, chunk_size)
    y_ref, final_ref = oracle(case, state, seq)
    assert_close(y, y_ref, what="outputs")
    assert_close(final, final_ref, what="final state")


@pytest.mark.parametrize("layer", LAYERS)
def test_forget_verify_commit_flush(layer, rng):
    """A window of 3 from a state with 2 buffered steps, draft 1 forgetting
    the state: outputs, the committed state (materialized), and the flush."""
    case = LAYERS[layer](rng)
    state = case.initial_state()
    seq = forget(case, case.draw(5), [0, 3])
    rs = case.replay_init(state, 5)
    for t in range(2):
        _, rs = case.replay_step(rs, take_step(seq, t))
    y, rs = case.verify(rs, {key: a[:, 2:] for key, a in seq.items()})
    y_ref, final_ref = oracle(case, state, seq)
    assert_close(y, y_ref[:, 2:], what="window outputs")
    rs = replay_commit(rs, np.full(case.batch, 3, np.int32))
    assert_close(case.materialize(rs), final_ref, what="committed state")
    flushed = case.flush(rs)
    np.testing.assert_array_equal(flushed.cursor, 0)
    assert_close(flushed.checkpoint, final_ref, what="flushed checkpoint")


@pytest.mark.parametrize("backend", ["xla", "interpret"])
@pytest.mark.parametrize("layer", LAYERS)
def test_forget_steps(layer, backend, rng):
    """Standard steps and replay steps on each route (L = 3: flushes among
    them) with steps 1 and 4 forgetting the state."""
    case = on_backend(LAYERS[layer](rng), backend)
    state = case.initial_state()
    seq = forget(case, case.draw(6), [1, 4])
    y_ref, final_ref = oracle(case, state, seq)
    S = jnp.asarray(state)
    for route in ROUTES:
        rs = case.replay_init(state, 3)
        for t in range(6):
            y, rs = case.replay_step(rs, take_step(seq, t), route=route)
            assert_close(y, y_ref[:, t], what=f"replay output at step {t} ({route})")
        assert_close(case.materialize(rs), final_ref, what=f"replay state ({route})")
    for t in range(6):
        y, S = case.step(S, take_step(seq, t))
        assert_close(y, y_ref[:, t], what=f"standard output at step {t}")
    assert_close(S, final_ref, what="standard state")


# --------------------------------------------------------------------------
# float16


def _f16(inputs, name):
    return dict(inputs, **{name: jnp.asarray(inputs[name], jnp.float16)})


F16_CASES = [("mamba2", name) for name in ["x", "dt", "B", "C", "z"]] + [
    ("gdn", name) for name in ["q", "k", "v", "g", "beta"]]


@pytest.mark.parametrize("op", ["step", "chunked", "replay_step", "verify"])
@pytest.mark.parametrize("layer, name", F16_CASES)
def test_float16_refused(layer, name, op, rng):
    """A float16 activation raises a TypeError naming it, before any
    computation: the replay state passed in stays usable."""
    case = LAYERS[layer](rng)
    state = jnp.asarray(case.initial_state())
    rs = case.replay_init(state, 4)
    calls = {
        "step": lambda: case.step(state, _f16(case.draw(), name)),
        "chunked": lambda: case.chunked(state, _f16(case.draw(3), name), 2),
        "replay_step": lambda: case.replay_step(rs, _f16(case.draw(), name)),
        "verify": lambda: case.verify(rs, _f16(case.draw(2), name)),
    }
    with pytest.raises(TypeError, match=rf"`{name}` must not be float16: float16 overflows in these recurrences"):
        calls[op]()
    inp = case.draw()
    y, _ = case.replay_step(rs, inp)
    assert_close(y, case.oracle_step(np.asarray(state, np.float64), inp)[0], what="step after the refused call")


@pytest.mark.parametrize("layer", LAYERS)
def test_float16_state_and_buffers_refused(layer, rng):
    case = LAYERS[layer](rng)
    state = jnp.asarray(case.initial_state())
    with pytest.raises(TypeError, match=r"`state` must have dtype in \(float32, bfloat16\); got float16"):
        case.step(state.astype(jnp.float16), case.draw())
    with pytest.raises(TypeError, match="`buffer_dtype` must not be float16: float16 overflows"):
        case.replay_init(state, 4, buffer_dtype=jnp.float16)
    rs = case.replay_init(state, 4)
    record = "x" if layer == "mamba2" else "d"
    rs = rs.replace(**{record: getattr(rs, record).astype(jnp.float16)})
    with pytest.raises(TypeError, match=f"`state.{record}` must not be float16"):
        case.replay_step(rs, case.draw())
