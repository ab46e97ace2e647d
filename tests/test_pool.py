"""The state pool (replayssm_jax.pool, the ops' and the model's `slots`): the kernels step the slots of
a pool in place and nothing else: a padding row (-1) and the slots outside the batch keep every bit;
the stepped slots equal the reference on those rows. So do the verify launches of a speculative round
(the replay verify's early flush and verify kernel, the per-draft verify), an int8 checkpoint pool's
replay step, and a model's verify and commit over a pool (every layer's state, conv window, KV cache and
position). Bad slots are refused before any kernel runs. A model's decode over a pool is tested through
the engine (tests/test_engine.py)."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import load_model
from kernel_checks import lower_for_cuda
from replayssm_jax import kernels, ops
from replayssm_jax.kernels import ReplayConfig, StepConfig
from replayssm_jax.pool import PoolError, StatePool
from replayssm_jax.sequence_state import SequenceStateError

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
DATA = Path(__file__).parent / "data"
CAPACITY, L = 5, 4
SLOTS = np.array([3, -1, 1], np.int32)  # a padding row between two slots, out of order
INPUT_ROWS = np.array([0, 2])  # the batch rows that step a slot
STEPPED, UNTOUCHED = np.array([3, 1]), np.array([0, 2, 4])
# Cursors per slot: slot 1 fills its buffer with this step (a flush), slot 3 appends.
CURSORS = np.array([0, L - 1, 2, 1, L - 1], np.int32)


def _mamba2_case(rng, H=2, P=16, N=8, G=1, lead=(3,)):
    """(pool state f32[CAPACITY, H, P, N], inputs of a batch of 3 (`lead`: (3, W) for a verify window),
    params, the replay state's extra arg)."""
    state = jnp.asarray(rng.normal(size=(CAPACITY, H, P, N)), jnp.float32)
    inputs = dict(x=rng.normal(size=(*lead, H, P)), dt=rng.normal(size=(*lead, H)), B=rng.normal(size=(*lead, G, N)),
                  C=rng.normal(size=(*lead, G, N)), z=rng.normal(size=(*lead, H, P)))
    inputs = {k: jnp.asarray(v, jnp.float32) for k, v in inputs.items()}
    params = dict(A=-jnp.exp(jnp.asarray(rng.normal(size=H), jnp.float32)), D=jnp.ones((H,), jnp.float32),
                  dt_bias=jnp.zeros((H,), jnp.float32))
    return state, inputs, params, G


def _gdn_case(rng, H=1, HV=2, K=8, V=16, lead=(3,)):
    """As `_mamba2_case` for a Gated DeltaNet layer: state f32[CAPACITY, HV, V, K]."""
    state = jnp.asarray(rng.normal(size=(CAPACITY, HV, V, K)) * 0.3, jnp.float32)
    inputs = dict(q=jnp.asarray(rng.normal(size=(*lead, H, K)), jnp.float32),
                  k=jnp.asarray(rng.normal(size=(*lead, H, K)), jnp.float32),
                  v=jnp.asarray(rng.normal(size=(*lead, HV, V)), jnp.float32),
                  g=-jnp.asarray(rng.uniform(0.05, 1.0, size=(*lead, HV)), jnp.float32),
                  beta=jnp.asarray(rng.uniform(0.1, 0.9, size=(*lead, HV)), jnp.float32))
    return state, inputs, {}, H


LAYERS = {"mamba2": (_mamba2_case, ops.mamba2_step, ops.mamba2_replay_step, ops.mamba2_replay_init),
          "gdn": (_gdn_case, ops.gdn_step, ops.gdn_replay_step, ops.gdn_replay_init)}
VERIFY_OPS = {"mamba2": (ops.mamba2_replay_verify, ops.mamba2_verify), "gdn": (ops.gdn_replay_verify, ops.gdn_verify)}


def _with_random_records(pool, rng):
    """`pool` with random records in its buffers, so that the cursors' live slots hold data."""
    return pool.replace(**{name: jnp.asarray(rng.uniform(-0.1, 0.1, getattr(pool, name).shape),
                                             getattr(pool, name).dtype) for name in pool.buffer_fields()})


def _assert_slots(new, pool, want_rows):
    """The stepped slots of `new` equal `want_rows` (the reference's state of batch rows INPUT_ROWS), the
    other slots of `new` equal `pool` bit for bit."""
    for got, before, want in zip(jax.tree.leaves(new), jax.tree.leaves(pool), jax.tree.leaves(want_rows)):
        np.testing.assert_array_equal(np.asarray(got)[UNTOUCHED], np.asarray(before)[UNTOUCHED])
        np.testing.assert_allclose(np.asarray(got)[STEPPED], np.asarray(want)[INPUT_ROWS], rtol=2e-5, atol=2e-5)


def _reference_on_rows(op, pool, inputs, params, **kw):
    """The reference step of `op` on the pool's rows SLOTS (the padding row on slot 0's values)."""
    return op(ops.take_slots(pool, jnp.asarray(SLOTS)), **inputs, **params, backend="xla", **kw)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_standard_step_writes_only_its_slots(layer):
    """The standard step's kernel over a pool: each batch row's slot stepped as the reference steps it; the
    padding row and the slots outside the batch unchanged."""
    case, step, _, _ = LAYERS[layer]
    pool, inputs, params, _ = case(np.random.default_rng(1))
    y, new = step(pool, **inputs, **params, backend="interpret", config=StepConfig(block_v=8),
                  slots=jnp.asarray(SLOTS))
    want_y, want = _reference_on_rows(step, pool, inputs, params)
    np.testing.assert_allclose(np.asarray(y)[INPUT_ROWS], np.asarray(want_y)[INPUT_ROWS], rtol=2e-5, atol=2e-5)
    _assert_slots(new, pool, want)


@pytest.mark.parametrize("layer, route, config", [
    ("mamba2", "output", ReplayConfig(block_v=8, fused_flush=True)),
    ("mamba2", "output", ReplayConfig(block_v=8)),
    ("mamba2", "direct", StepConfig(block_v=8)),
    ("gdn", "output", ReplayConfig(block_v=8)),
    ("gdn", "direct", StepConfig(block_v=8)),
    ("mamba2", "deferred", ReplayConfig(block_v=8)),
    ("gdn", "deferred", ReplayConfig(block_v=8, flush_block_v=16)),
], ids=["mamba2-fused-flush", "mamba2-flush-launch", "mamba2-direct", "gdn-flush-launch", "gdn-direct",
        "mamba2-deferred", "gdn-deferred"])
def test_replay_step_writes_only_its_slots(layer, route, config):
    """The replay step's launches over a pool (a flushing slot and an appending one, a padding row):
    checkpoint, buffers and cursor of each stepped slot as the reference's; every other slot's bits
    unchanged, the cursors included (moved in place by the flush launch of a two-launch step). On the
    deferred route the first stepped slot and a slot outside the batch enter full: its flush launch over
    the pool flushes the one and leaves the other."""
    case, _, replay_step, init = LAYERS[layer]
    checkpoint, inputs, params, shared = case(np.random.default_rng(2))
    rng = np.random.default_rng(5)
    full = np.isin(np.arange(len(CURSORS)), [SLOTS[0], 0]) & (route == "deferred")  # slot 0: not in the batch
    cursors = np.where(full, L, CURSORS)
    pool = _with_random_records(init(checkpoint, L, shared).replace(cursor=jnp.asarray(cursors, jnp.int32)), rng)
    y, new = replay_step(pool, **inputs, **params, route=route, backend="interpret", config=config,
                         slots=jnp.asarray(SLOTS))
    want_y, want = _reference_on_rows(replay_step, pool, inputs, params, route=route)
    np.testing.assert_allclose(np.asarray(y)[INPUT_ROWS], np.asarray(want_y)[INPUT_ROWS], rtol=2e-5, atol=2e-5)
    _assert_slots(new, pool, want)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_a_traced_slot_out_of_range_is_a_padding_row(layer):
    """Under jit slots are not checked: a slot past the pool (here CAPACITY + 2 where SLOTS has its padding
    row) reads and writes nothing in the kernels, as -1, where a clamped index would step the last slot."""
    case, _, replay_step, init = LAYERS[layer]
    checkpoint, inputs, params, shared = case(np.random.default_rng(3))
    pool = _with_random_records(init(checkpoint, L, shared).replace(cursor=jnp.asarray(CURSORS)),
                                np.random.default_rng(6))
    slots = jnp.asarray(np.where(SLOTS < 0, CAPACITY + 2, SLOTS))
    step = jax.jit(functools.partial(replay_step, **params, backend="interpret"))  # the default: flush in the launch
    y, new = step(pool, **inputs, slots=slots)
    want_y, want = _reference_on_rows(replay_step, pool, inputs, params)
    np.testing.assert_allclose(np.asarray(y)[INPUT_ROWS], np.asarray(want_y)[INPUT_ROWS], rtol=2e-5, atol=2e-5)
    _assert_slots(new, pool, want)


@pytest.mark.parametrize("route, config, calls", [
    ("output", ReplayConfig(block_v=8, fused_flush=True), 1),
    ("output", ReplayConfig(block_v=8), 2),
    ("direct", StepConfig(block_v=8), 1),
    ("deferred", ReplayConfig(block_v=8), 2),
], ids=["fused-flush", "flush-launch", "direct", "deferred"])
def test_pool_launches_lower_for_cuda_with_the_pool_in_place(route, config, calls):
    """The Triton lowering takes the pool's launches (kernel_checks.lower_for_cuda: the whole Pallas ->
    Triton lowering short of PTX), and each aliases every pool array it writes to its operand: the
    checkpoint and buffers (operands 1..4, after the slots), the cursor in place in one launch; in a
    two-launch step the flush launch's checkpoint and the cursor (its last operand), and the replay
    kernel's cursors at entry are a fresh array; on the deferred route the flush launch of the full slots
    (its checkpoint in place, no cursor written) and the replay kernel (its checkpoint and buffers in place;
    the cursor moved by an XLA op over the batch's slots)."""
    checkpoint, inputs, params, G = _mamba2_case(np.random.default_rng(6))
    pool = ops.mamba2_replay_init(checkpoint, L, G).replace(cursor=jnp.asarray(CURSORS))

    text = lower_for_cuda(lambda pool, slots: kernels.mamba2_replay_step(
        pool, inputs["x"], inputs["dt"], params["A"], inputs["B"], inputs["C"], params["D"], inputs["z"],
        params["dt_bias"], dt_softplus=True, dt_limit=(0.0, float("inf")), route=route, config=config,
        slots=slots), pool, jnp.asarray(SLOTS))
    found = [line for line in text.splitlines() if "custom_call" in line and "triton" in line]
    assert len(found) == calls and all("_pool" in line for line in found), found
    aliases = sorted((int(o), int(i)) for o, i in
                     re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", found[0]))
    operands = re.search(r"custom_call @\S+\(([^)]*)\)", found[0]).group(1).count(",") + 1
    if route == "direct":  # outputs y, checkpoint, cursor: the checkpoint and the cursor (last operand)
        assert aliases == [(1, 1), (2, operands - 1)], found[0][:2000]
        return
    if route == "deferred":  # the flush launch's one output, the checkpoint; the replay kernel's as appending
        flush, replay = sorted(found, key=lambda line: "deferred_flush" not in line)
        assert "mamba2_deferred_flush" in flush and "mamba2_replay_deferred" in replay, found
        assert re.findall(r"output_tuple_indices = \[\], operand_index = (\d+)", flush) == ["1"], flush[:2000]
        assert sorted((int(o), int(i)) for o, i in re.findall(
            r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", replay)) == [(1, 1), (2, 2), (3, 3), (4, 4)]
        return
    assert aliases == [(1, 1), (2, 2), (3, 3), (4, 4)] + ([(5, 5)] if calls == 1 else []), found[0][:2000]
    if calls == 2:
        flush = sorted((int(o), int(i)) for o, i in
                       re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", found[1]))
        last = re.search(r"custom_call @\S+\(([^)]*)\)", found[1]).group(1).count(",")
        assert flush == [(0, 1), (1, last)], found[1][:2000]


# A verify over the pool: W = 3 at the slots [2, -1, 0]; slot 2's cursor (2) + W > L flushes early, slot 0's
# window fits behind its cursor (0); slots 1, 3, 4 are outside the batch.
W = 3
VERIFY_SLOTS = np.array([2, -1, 0], np.int32)
VERIFY_STEPPED, VERIFY_UNTOUCHED = np.array([2, 0]), np.array([1, 3, 4])


def _assert_verified_slots(y, new, pool, want_y, want_rows):
    """The verify over the pool: the outputs of the stepped batch rows and the stepped slots' arrays equal
    the verify on the gathered rows (`want_y`, `want_rows`), the other slots keep every bit."""
    np.testing.assert_allclose(np.asarray(y)[INPUT_ROWS], np.asarray(want_y)[INPUT_ROWS], rtol=2e-5, atol=2e-5)
    for got, before, want in zip(jax.tree.leaves(new), jax.tree.leaves(pool), jax.tree.leaves(want_rows)):
        np.testing.assert_array_equal(np.asarray(got)[VERIFY_UNTOUCHED], np.asarray(before)[VERIFY_UNTOUCHED])
        np.testing.assert_allclose(np.asarray(got)[VERIFY_STEPPED], np.asarray(want)[INPUT_ROWS], rtol=2e-5,
                                   atol=2e-5)


@pytest.mark.parametrize("layer, checkpoint_dtype", [("gdn", None), ("mamba2", None), ("mamba2", jnp.int8)],
                         ids=["gdn", "mamba2", "mamba2-int8"])
def test_replay_verify_writes_only_its_slots(layer, checkpoint_dtype):
    """The replay verify's launches over a pool (the early flush of slot 2, the verify kernel; interpret):
    outputs, checkpoint, records and cursor of the batch's slots as the verify of the gathered rows (the
    reference); every other slot's bits unchanged, its cursor included. An int8 pool: the flushed slot's
    values, scales and write count as the reference's."""
    case, _, _, init = LAYERS[layer]
    checkpoint, inputs, params, shared = case(np.random.default_rng(8), lead=(3, W))
    pool = _with_random_records(init(checkpoint, L, shared, checkpoint_dtype=checkpoint_dtype).replace(
        cursor=jnp.asarray(CURSORS)), np.random.default_rng(9))
    slots = jnp.asarray(VERIFY_SLOTS)
    replay_verify = VERIFY_OPS[layer][0]
    y, new = replay_verify(pool, **inputs, **params, backend="interpret", config=ReplayConfig(block_v=8),
                           slots=slots)
    want_y, want = replay_verify(ops.take_slots(pool, slots), **inputs, **params, backend="xla")
    assert new.window == W
    _assert_verified_slots(y, new, pool, want_y, want)
    if checkpoint_dtype is not None:
        np.testing.assert_array_equal(np.asarray(new.counter), np.isin(np.arange(CAPACITY), 2))  # slot 2 flushed


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_per_draft_verify_writes_only_its_slots(layer):
    """The per-draft standard verify over a pool [CAPACITY, W + 1, heads, V, K] with its index per slot
    (interpret): the batch's slots' W draft states and outputs as the verify of the gathered rows; the
    other slots, and the current state of every slot, unchanged bit for bit."""
    case = LAYERS[layer][0]
    state, inputs, params, _ = case(np.random.default_rng(10), lead=(3, W))
    rng = np.random.default_rng(11)
    pool = jnp.asarray(rng.normal(size=(CAPACITY, W + 1, *state.shape[1:])) * 0.3, jnp.float32)
    index = jnp.asarray([1, 0, 3, 2, 0], jnp.int32)
    slots = jnp.asarray(VERIFY_SLOTS)
    verify = VERIFY_OPS[layer][1]
    y, new = verify(pool, index, **inputs, **params, backend="interpret", config=StepConfig(block_v=8), slots=slots)
    want_y, want = verify(pool[np.maximum(VERIFY_SLOTS, 0)], index[np.maximum(VERIFY_SLOTS, 0)], **inputs, **params,
                          backend="xla")
    _assert_verified_slots(y, new, pool, want_y, want)
    current = np.asarray(new)[np.arange(CAPACITY), np.asarray(index)]
    np.testing.assert_array_equal(current, np.asarray(pool)[np.arange(CAPACITY), np.asarray(index)])


# (output, operand) aliases per launch (-1: a launch's only output); operand 0 is the slots. The early flush
# writes the checkpoint, the verify kernel the three buffers; the per-draft verify its slotted state; the int8
# replay step's replay kernel its values, scales and buffers, its flush launch the values, the scales and (its
# last operand, 15) the cursor.
EXPECTED_ALIASES = {"replay-verify": [[(-1, 1)], [(1, 2), (2, 3), (3, 4)]], "per-draft": [[(1, 1)]],
                    "int8-step": [[(1, 1), (2, 2), (3, 3), (4, 4), (5, 5)], [(0, 1), (1, 2), (2, 15)]]}


@pytest.mark.parametrize("launch", ["replay-verify", "per-draft", "int8-step"])
def test_pooled_verify_and_8bit_launches_lower_for_cuda(launch):
    """The Triton lowering takes the pooled launches of a speculative round (the replay verify's early flush
    and verify kernel, the per-draft verify) and an int8 checkpoint pool's replay step (kernel_checks.
    lower_for_cuda); each launch is a pool launch ("_pool" in its name) that aliases the pool arrays it writes
    to their operands."""
    case = _mamba2_case(np.random.default_rng(15), lead=(3,) if launch == "int8-step" else (3, W))
    state, inputs, params, G = case
    kw = dict(dt_softplus=True, dt_limit=(0.0, float("inf")))
    args = (inputs["x"], inputs["dt"], params["A"], inputs["B"], inputs["C"], params["D"], inputs["z"],
            params["dt_bias"])
    if launch == "per-draft":
        pool = (jnp.zeros((CAPACITY, W + 1, *state.shape[1:]), jnp.float32), jnp.zeros((CAPACITY,), jnp.int32))
    else:
        pool = ops.mamba2_replay_init(state, L, G, checkpoint_dtype=jnp.int8 if launch == "int8-step" else None)
        pool = pool.replace(cursor=jnp.asarray(CURSORS))

    def fn(pool, slots):
        if launch == "replay-verify":
            return kernels.mamba2_replay_verify(pool, *args, config=ReplayConfig(block_v=8), slots=slots, **kw)
        if launch == "per-draft":
            return kernels.mamba2_verify(*pool, *args, config=StepConfig(block_v=8), slots=slots, **kw)
        return kernels.mamba2_replay_step(pool, *args, route="output", config=ReplayConfig(block_v=8), slots=slots,
                                          **kw)

    text = lower_for_cuda(fn, pool, jnp.asarray(VERIFY_SLOTS))
    found = [line for line in text.splitlines() if "custom_call" in line and "triton" in line]
    assert all("_pool" in line for line in found), found
    aliases = [sorted((int(o or -1), int(i)) for o, i in
                      re.findall(r"output_tuple_indices = \[(\d*)\], operand_index = (\d+)", line)) for line in found]
    assert aliases == EXPECTED_ALIASES[launch], found


# The models' layer shapes (bench/configs: Nemotron-3-Nano-4B's Mamba-2, Qwen3.5-4B's GDN).
GPU_DIMS = {"mamba2": dict(H=96, P=80, N=128, G=8), "gdn": dict(H=16, HV=32, K=128, V=128)}


@pytest.mark.gpu
@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize("route", [None, "output", "direct"], ids=["standard", "replay-output", "replay-direct"])
def test_pool_kernels_compiled_at_model_shapes(layer, route):
    """Compiled (backend pallas, default tilings) at the models' layer shapes: the standard and replay
    steps over a pool with random buffered records (a flushing slot, an appending one, a padding row)
    equal the reference on the stepped slots; every other slot keeps every bit."""
    from replayssm_jax.testing import assert_close

    case, step, replay_step, init = LAYERS[layer]
    rng = np.random.default_rng(7)
    state, inputs, params, shared = case(rng, **GPU_DIMS[layer])
    kw = {} if route is None else {"route": route}
    if route is None:
        op, pool = step, state
    else:
        op, pool = replay_step, _with_random_records(init(state, L, shared).replace(cursor=jnp.asarray(CURSORS)), rng)
    y, new = op(pool, **inputs, **params, backend="pallas", slots=jnp.asarray(SLOTS), **kw)
    want_y, want = _reference_on_rows(op, pool, inputs, params, **kw)
    assert_close(np.asarray(y)[INPUT_ROWS], np.asarray(want_y)[INPUT_ROWS], what="y")
    for got, before, ref in zip(jax.tree.leaves(new), jax.tree.leaves(pool), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got)[UNTOUCHED], np.asarray(before)[UNTOUCHED])
        assert_close(np.asarray(got)[STEPPED], np.asarray(ref)[INPUT_ROWS], what="stepped slots")


@pytest.mark.gpu
@pytest.mark.parametrize("layer", sorted(LAYERS))
@pytest.mark.parametrize("kind", ["replay-verify", "per-draft"])
def test_pool_verify_kernels_compiled_at_model_shapes(layer, kind):
    """Compiled (backend pallas, default tilings) at the models' layer shapes: a verify of W = 3 over a pool
    at slots [2, -1, 0] (the replay verify with random buffered records, slot 2 flushing early; the
    per-draft verify on a slotted state) equals the verify of the gathered rows on the reference; every
    other slot keeps every bit."""
    _check_pool_verify(layer, kind, "pallas", GPU_DIMS[layer])


def _check_pool_verify(layer, kind, backend, dims):
    """`test_pool_verify_kernels_compiled_at_model_shapes` on `backend` at layer shapes `dims`."""
    from replayssm_jax.testing import assert_close

    case, _, _, init = LAYERS[layer]
    rng = np.random.default_rng(16)
    state, inputs, params, shared = case(rng, **dims, lead=(3, W))
    replay_verify, per_draft = VERIFY_OPS[layer]
    slots = jnp.asarray(VERIFY_SLOTS)
    rows = np.maximum(VERIFY_SLOTS, 0)
    if kind == "replay-verify":
        pool = _with_random_records(init(state, L, shared).replace(cursor=jnp.asarray(CURSORS)), rng)
        y, new = replay_verify(pool, **inputs, **params, backend=backend, slots=slots)
        want_y, want = replay_verify(ops.take_slots(pool, slots), **inputs, **params, backend="xla")
    else:
        pool = jnp.asarray(rng.normal(size=(CAPACITY, W + 1, *state.shape[1:])) * 0.3, jnp.float32)
        index = jnp.asarray([1, 0, 3, 2, 0], jnp.int32)
        y, new = per_draft(pool, index, **inputs, **params, backend=backend, slots=slots)
        want_y, want = per_draft(pool[rows], index[rows], **inputs, **params, backend="xla")
    assert_close(np.asarray(y)[INPUT_ROWS], np.asarray(want_y)[INPUT_ROWS], what="y")
    for got, before, ref in zip(jax.tree.leaves(new), jax.tree.leaves(pool), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got)[VERIFY_UNTOUCHED], np.asarray(before)[VERIFY_UNTOUCHED])
        assert_close(np.asarray(got)[VERIFY_STEPPED], np.asarray(ref)[INPUT_ROWS], what="verified slots")


@pytest.mark.parametrize("slots, error, match", [
    (np.array([0, 5, 1], np.int32), ValueError, r"\[-1, 4\]"),
    (np.array([0, -2, 1], np.int32), ValueError, r"\[-1, 4\]"),
    (np.array([2, -1, 2], np.int32), ValueError, "slot 2 .*twice|twice.*slot 2"),
    (np.array([0, 1], np.int32), ValueError, r"`slots` must have one entry per batch row of `x` \(x.shape\[0\] = 3\); "
                                             "got 2 slots"),
    (np.array([[0, 1, 2]], np.int32), ValueError, r"shape \[batch\]"),
    (np.array([0.0, 1.0, 2.0], np.float32), TypeError, "integer"),
], ids=["above", "below", "twice", "short", "rank", "float"])
def test_bad_slots_raise_before_any_kernel(slots, error, match):
    """Slots out of range, used twice, of another batch or shape, or not integers: a clear error naming
    `slots` (or the batch) before any kernel runs; the pool is unchanged."""
    pool, inputs, params, _ = _mamba2_case(np.random.default_rng(3))
    before = np.asarray(pool).copy()
    with pytest.raises(error, match=match):
        ops.mamba2_step(pool, **inputs, **params, backend="interpret", slots=slots)
    np.testing.assert_array_equal(np.asarray(pool), before)


@pytest.mark.parametrize("layer, route, config", [
    ("mamba2", "output", ReplayConfig(block_v=8)),
    ("gdn", "output", ReplayConfig(block_v=8, fused_flush=True)),
], ids=["mamba2-flush-launch", "gdn-fused-flush"])
@pytest.mark.filterwarnings("ignore:a replay checkpoint of int8:UserWarning")
def test_replay_step_over_an_int8_pool(layer, route, config):
    """An int8 checkpoint pool (its scales f32[CAPACITY, heads, V] and write counts i32[CAPACITY] pool arrays
    too; launch.Quantized over the pool): the stepped slots' values, scales, counts, buffers and cursors as
    the reference's on those rows (the flushing slot requantized, its write count advanced); every other
    slot's bits unchanged."""
    case, _, replay_step, init = LAYERS[layer]
    checkpoint, inputs, params, shared = case(np.random.default_rng(13))
    pool = init(checkpoint, L, shared, checkpoint_dtype=jnp.int8).replace(cursor=jnp.asarray(CURSORS))
    pool = _with_random_records(pool, np.random.default_rng(14))
    y, new = replay_step(pool, **inputs, **params, route=route, backend="interpret", config=config,
                         slots=jnp.asarray(SLOTS))
    want_y, want = _reference_on_rows(replay_step, pool, inputs, params, route=route)
    np.testing.assert_allclose(np.asarray(y)[INPUT_ROWS], np.asarray(want_y)[INPUT_ROWS], rtol=2e-5, atol=2e-5)
    _assert_slots(new, pool, want)
    np.testing.assert_array_equal(np.asarray(new.counter), np.asarray(pool.counter) + np.isin(np.arange(CAPACITY), 1))


@pytest.fixture(scope="module")
def model():
    return load_model(DATA / "nemotron_h_tiny")


def test_pool_errors(model):
    """A full pool, a slot not in use, a row or a restored state of another layout, slots of another shape
    than the tokens or with a slot twice: each refused before anything is written (the pool unchanged)."""
    pool = StatePool(model, 1, max_len=16, buffer_len=L, backend="xla")
    slot = pool.allocate()
    with pytest.raises(PoolError, match=r"`model` must be a model of this package .*got str 'x'"):
        StatePool("x", 2, max_len=8)
    with pytest.raises(PoolError, match="full"):
        pool.allocate()
    with pytest.raises(PoolError, match="in use"):
        pool.release(slot + 1)
    other = StatePool(model, 1, max_len=16, backend="xla")  # standard states
    with pytest.raises(PoolError, match="structure"):
        pool.write(slot, other.cache)  # a batch-1 cache of another layout
    row = jax.tree.map(lambda a: a[:1], pool.cache)
    narrow = jax.tree_util.tree_map_with_path(  # the f32 checkpoints as bf16: once cast in silence
        lambda path, a: a.astype(jnp.bfloat16) if "checkpoint" in jax.tree_util.keystr(path) else a, row)
    assert sum(a.dtype != b.dtype for a, b in zip(jax.tree.leaves(narrow), jax.tree.leaves(row))) > 0
    with pytest.raises(PoolError, match=r"`row.*checkpoint.*` has dtype bfloat16 where the pool's is float32"):
        pool.write(slot, narrow)
    with pytest.raises(PoolError, match=r"`row.*` has shape \(2, .* where the pool's rows are"):
        pool.write(slot, jax.tree.map(lambda a: jnp.concatenate([a, a]), row))
    exported = other.export(other.allocate())
    before = jax.tree.map(np.asarray, pool.cache)
    with pytest.raises(SequenceStateError, match="structure"):
        pool.restore(slot, exported)
    with pytest.raises(ValueError, match="`slots` must have the shape of `tokens`"):
        model.decode(jnp.asarray([1, 2], jnp.int32), pool.cache, slots=jnp.asarray([0], jnp.int32), backend="xla")
    with pytest.raises(ValueError, match="twice"):
        model.decode(jnp.asarray([1, 2], jnp.int32), pool.cache, slots=jnp.asarray([0, 0], jnp.int32), backend="xla")
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, pool.cache), before)
    pool.release(slot)
    assert pool.free_slots == 1


@pytest.mark.parametrize("buffer_len", [L, None], ids=["replay", "standard"])
def test_model_verify_and_commit_over_a_pool(model, buffer_len):
    """`model.verify(tokens, pool, slots=)` and `model.commit(cache, m, slots=)` at slots [2, -1, 0] (xla): the
    logits and the committed state of the batch's slots (SSM states, conv windows, KV caches, positions) equal
    a verify and commit of the gathered rows; every other slot's arrays keep every bit. Slot 2 flushes early,
    slot 0's window fits behind its cursor; the standard state runs the per-draft verify on its slots. A
    draft tree with slots is refused."""
    rng = np.random.default_rng(12)
    ids = jnp.asarray(rng.integers(3, 250, size=(CAPACITY, 6)), jnp.int32)
    graphdef, params = nnx.split(model)

    @functools.partial(jax.jit, static_argnames=("prefill",))
    def run(params, tokens, cache, counts, slots, prefill=False):  # compiled: eager XLA ops are slow here
        lm = nnx.merge(graphdef, params)
        if prefill:
            return lm.prefill(tokens, 24, replay_buffer_len=buffer_len, max_window=W, backend="xla",
                              last_logits_only=True)
        logits, cache = lm.verify(tokens, cache, backend="xla", slots=slots)
        return logits, lm.commit(cache, counts, slots=slots)

    _, pool = run(params, ids, None, None, None, prefill=True)
    # Different cursors, indices, lengths and conv starts per slot (a round at slots 0, 2, 4: the same program).
    _, pool = run(params, jnp.asarray(rng.integers(3, 250, size=(3, W)), jnp.int32), pool,
                  jnp.asarray([1, 3, 2], jnp.int32), jnp.asarray([0, 2, 4], jnp.int32))
    tokens = jnp.asarray(rng.integers(3, 250, size=(3, W)), jnp.int32)
    slots = jnp.asarray(VERIFY_SLOTS)
    counts = jnp.asarray([2, 3, 3], jnp.int32)  # the padding row's count is dropped
    logits, committed = run(params, tokens, pool, counts, slots)
    want_logits, want = run(params, tokens, ops.take_slots(pool, slots), counts, None)
    np.testing.assert_allclose(np.asarray(logits)[INPUT_ROWS], np.asarray(want_logits)[INPUT_ROWS], rtol=1e-5,
                               atol=1e-5)
    assert committed.window == 0
    for got, before, ref in zip(jax.tree.leaves(committed), jax.tree.leaves(pool), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(got)[VERIFY_UNTOUCHED], np.asarray(before)[VERIFY_UNTOUCHED])
        np.testing.assert_allclose(np.asarray(got)[VERIFY_STEPPED], np.asarray(ref)[INPUT_ROWS], rtol=1e-5,
                                   atol=1e-5)
    from replayssm_jax.speculative.tree import DraftTree

    with pytest.raises(ValueError, match="`tree` with `slots`"):
        model.verify(tokens, pool, backend="xla", slots=slots, tree=DraftTree.topk(1, W - 1))
    with pytest.raises(ValueError, match=r"`slots` must have shape \[batch\] = \(3,\)"):
        model.verify(tokens, pool, backend="xla", slots=slots[:2])
