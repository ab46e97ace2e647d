"""The verify-window kernels (`kernels.mamba2_replay_verify`,
`kernels.gdn_replay_verify`, through `ops` with backend "interpret" on the
CPU and "pallas" under `-m gpu`) against the reference's verify.

Each check starts from a replay state with staggered cursors (empty rows,
rows whose window just fits, rows that must flush early, full rows) and
compares the W outputs, the cursor, the checkpoint (flushed rows against
the reference, the other rows bit for bit), every buffer slot (the window's
slots against the reference, the others bit for bit), and then a commit and
the following replay step. Drafts of a window may be garbage (NaN, inf):
no earlier output may see them.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import assert_close
from kernel_checks import DTYPES, GDN, GDNShape, Mamba2, Mamba2Shape, lower_for_cuda, poison_dead_slots, tol_dtype
from replayssm_jax import kernels, ops

CPU_SHAPES = {
    GDN: [GDNShape(batch=5, H=2, HV=4, K=20, V=12), GDNShape(batch=5, H=1, HV=3, K=9, V=40)],
    Mamba2: [
        Mamba2Shape(batch=5, H=4, P=12, N=20, G=2),
        Mamba2Shape(batch=5, H=3, P=40, N=9, G=1, gated=False, dt_limit=(0.05, 0.8)),
    ],
}
GPU_SHAPES = {  # the Qwen3.5-4B GDN layer and the Nemotron-3-Nano-4B Mamba-2 layer
    GDN: [GDNShape(batch=b, H=16, HV=32, K=128, V=128) for b in (1, 64, 256)],
    Mamba2: [Mamba2Shape(batch=b, H=96, P=80, N=128, G=8) for b in (1, 64, 256)],
}
BUFFERS = {GDN: ("d", "k", "g"), Mamba2: ("x", "dt", "B")}

# The Pallas Triton backend warns that it is deprecated when a kernel is lowered.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
# (L, W, state and buffer dtypes): W in {1, 2, 4, L} at L in {4, 8, 16}, a
# window that is not a power of two, f32 and bf16 states and buffers. Four
# are `slow` (SLOW_WINDOWS): W = 2 at L = 8 (W = 2 runs at L = 4, L = 8 with
# W = 3), the bf16 twin of (16, 4) (bf16 states and buffers run at L = 4), and
# W = L at L = 8 and 16 (a window that fills the buffer runs at L = 4).
WINDOWS = [(4, 1, "f32"), (4, 2, "bf16in-bf16state"), (4, 4, "f32"), (8, 2, "f32"), (8, 3, "bf16in-f32state"),
           (8, 8, "bf16in-bf16state"), (16, 4, "f32"), (16, 4, "bf16in-bf16state"), (16, 16, "f32")]
SLOW_WINDOWS = {(8, 2, "f32"), (8, 8, "bf16in-bf16state"), (16, 4, "bf16in-bf16state"), (16, 16, "f32")}
# Of the other windows, those that run on one layer only by default (on the other `slow`), so that each layer
# runs every dtype combination and a window that is not a power of two: the window of one step, the window
# that fills the buffer and the long buffer (the window's start and the rows that flush early are decided by
# the shared launch code, `launch.window_start` and the flush launch, and the CPU shapes' 4-row tiles take
# the record loop at every L).
ONE_LAYER_WINDOWS = {(4, 1, "f32"): Mamba2, (4, 4, "f32"): GDN, (16, 4, "f32"): Mamba2}


def cases(shapes, first_only=False):
    return [(layer, s) for layer, group in shapes.items() for s in (group[:1] if first_only else group)]


def case_id(case):
    return str(case[1])


def staggered_cursors(batch: int, L: int, W: int) -> np.ndarray:
    """Per-row cursors: empty (0), the window just fits (L - W), one past
    that (early flush), full (L, as after a commit) and half full."""
    pattern = [0, L - W, min(L, L - W + 1), L, L // 2]
    return np.array([pattern[i % len(pattern)] for i in range(batch)], np.int32)


def accepted(batch: int, W: int, round_: int) -> jnp.ndarray:
    """Steps to accept per row: all, none, one and half of the window, varied by round."""
    pattern = [W, 0, 1, W // 2, W]
    return jnp.asarray([pattern[(i + round_) % len(pattern)] for i in range(batch)], jnp.int32)


def draw_window(layer, W: int) -> dict:
    """W fresh steps of the layer's inputs, stacked on a window axis after batch."""
    steps = [layer.draw() for _ in range(W)]
    return {name: jnp.stack([step[name] for step in steps], axis=1) for name in steps[0]}


def verify(layer, rs, window, backend, config=None):
    kw = {} if config is None else {"config": config}
    if isinstance(layer, GDN):
        return ops.gdn_replay_verify(rs, **window, backend=backend, **kw)
    return ops.mamba2_replay_verify(rs, **window, **layer.params, backend=backend, **kw)


def as_f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32))


def check_verify(layer, L, W, dtypes, backend, rounds=1, config=None):
    """`rounds` x (verify W steps, commit some) and then a replay step, kernel backend vs reference."""
    with jax.default_matmul_precision("highest"):  # no TF32 in the reference on a GPU
        _check_verify(layer, L, W, dtypes, backend, rounds, config)


def _check_verify(layer, L, W, dtypes, backend, rounds, config):
    input_dtype, state_dtype, buffer_dtype = DTYPES[dtypes]
    tol = tol_dtype(input_dtype, state_dtype)
    batch = layer.s.batch
    rs = rs_ref = layer.replay_state(L, state_dtype, buffer_dtype, staggered_cursors(batch, L, W))
    for r in range(rounds):
        window = draw_window(layer, W)
        y, new = verify(layer, rs, window, backend, config)
        y_ref, new_ref = verify(layer, rs_ref, window, "xla")
        what = f"round {r}"
        assert y.shape == y_ref.shape and y.dtype == y_ref.dtype, what
        assert_close(y, y_ref, tol, what=f"outputs, {what}")
        cursor = np.asarray(rs.cursor)
        flush = cursor + W > L
        start = np.where(flush, 0, cursor)
        assert new.window == W, what
        np.testing.assert_array_equal(np.asarray(new.cursor), start, err_msg=f"cursor, {what}")
        np.testing.assert_array_equal(np.asarray(new.cursor), np.asarray(new_ref.cursor), err_msg=what)
        assert new.checkpoint.dtype == rs.checkpoint.dtype, what
        assert_close(as_f32(new.checkpoint)[flush], as_f32(new_ref.checkpoint)[flush], tol,
                     what=f"checkpoint of the rows that flushed early, {what}")
        np.testing.assert_array_equal(as_f32(new.checkpoint)[~flush], as_f32(rs.checkpoint)[~flush],
                                      err_msg=f"checkpoint of the other rows changed, {what}")
        in_window = (np.arange(L)[None, :] >= start[:, None]) & (np.arange(L)[None, :] < start[:, None] + W)
        for name in BUFFERS[type(layer)]:
            buf, buf_ref, old = (as_f32(getattr(s, name)) for s in (new, new_ref, rs))
            assert getattr(new, name).dtype == getattr(rs, name).dtype, name
            written = in_window[:, None, :] if buf.ndim == 3 else in_window[:, None, :, None]
            written = np.broadcast_to(written, buf.shape)
            assert_close(buf[written], buf_ref[written], tol, what=f"buffer {name}, window slots, {what}")
            np.testing.assert_array_equal(buf[~written], old[~written],
                                          err_msg=f"buffer {name}: a slot outside the window changed, {what}")
        m = accepted(batch, W, r)
        rs, rs_ref = ops.replay_commit(new, m), ops.replay_commit(new_ref, m)
    inp = layer.draw()
    y, new = layer.replay_step(rs, inp, "output", backend)
    y_ref, new_ref = layer.replay_step(rs_ref, inp, "output", "xla")
    assert_close(y, y_ref, tol, what="output of the replay step after the commit")
    assert_close(layer.materialize(new), layer.materialize(new_ref), tol, what="state after the replay step")
    np.testing.assert_array_equal(np.asarray(new.cursor), np.asarray(new_ref.cursor))


# The first CPU shapes at WINDOWS.
VERIFY_CASES = [
    pytest.param(case, L, W, dtypes, id=f"L{L}-W{W}-{dtypes}-{case_id(case)}",
                 marks=[pytest.mark.slow] if (L, W, dtypes) in SLOW_WINDOWS
                 or ONE_LAYER_WINDOWS.get((L, W, dtypes), case[0]) is not case[0] else [])
    for L, W, dtypes in WINDOWS for case in cases(CPU_SHAPES, first_only=True)]


@pytest.mark.parametrize(("case", "L", "W", "dtypes"), VERIFY_CASES)
def test_verify(case, L, W, dtypes, rng):
    layer = case[0](case[1], rng, DTYPES[dtypes][0])
    check_verify(layer, L, W, dtypes, "interpret")


# Every CPU shape; the first shapes `slow`: two rounds run on each layer's second shape (which runs
# nowhere else), the first shapes' windows in test_verify.
@pytest.mark.parametrize("case", [pytest.param((layer, shape), id=case_id((layer, shape)),
                                               marks=[] if index else [pytest.mark.slow])
                                  for layer, shapes in CPU_SHAPES.items() for index, shape in enumerate(shapes)])
def test_verify_two_rounds(case, rng):
    """Verify, commit m, verify again from the moved cursors, commit, step."""
    check_verify(case[0](case[1], rng), 8, 3, "f32", "interpret", rounds=2)


# GDN's first shape; Mamba-2's `slow`: the row tiles are `launch.run_verify_program`'s
# (`tiles.for_each_row_tile`), the early flush's tile and batch rows the flush launch's, the same for both
# layers.
@pytest.mark.parametrize("case", [pytest.param(case, id=case_id(case),
                                               marks=[pytest.mark.slow] if case[0] is Mamba2 else [])
                                  for case in cases(CPU_SHAPES, first_only=True)])
def test_verify_tilings(case, rng):
    """Non-default tilings: one-row tiles, several tiles per program, and
    the early flush on its own tile and batch rows."""
    layer = case[0](case[1], rng)
    for config in (kernels.ReplayConfig(block_v=1, num_warps=1),
                   kernels.ReplayConfig(block_v=4, tiles=2, flush_block_v=2, flush_rows=1)):
        check_verify(layer, 4, 2, "f32", "interpret", config=config)


@pytest.mark.parametrize("case", cases(CPU_SHAPES, first_only=True), ids=case_id)
def test_later_drafts_do_not_reach_earlier_outputs(case, rng):
    """Drafts t .. W - 1 all NaN (t = 1) or inf (t = W - 1), and NaN / inf
    in every dead buffer slot: outputs 0 .. t - 1 are finite and equal to
    those of the clean window on the clean buffer, as is the state after
    accepting t steps and taking one more step."""
    layer = case[0](case[1], rng)
    L, W = 8, 4
    rs = layer.replay_state(L, jnp.float32, jnp.float32, staggered_cursors(layer.s.batch, L, W))
    window = draw_window(layer, W)
    # One compiled verify for the clean and the garbage windows: a concrete g > 0 (GDN's garbage inf) is
    # refused (test_validation.py), a traced one is not checked, as in a compiled decode loop.
    compiled_verify = jax.jit(lambda rs, window: verify(layer, rs, window, "interpret"))
    with jax.default_matmul_precision("highest"):
        y_clean, clean = compiled_verify(rs, window)
        y_ref, _ = verify(layer, rs, window, "xla")
    assert_close(y_clean, y_ref, what="outputs of the clean window")
    m = jnp.full((layer.s.batch,), 0, jnp.int32)
    for t, bad in ((1, np.nan), (W - 1, np.inf)):
        garbage = {name: a.at[:, t:].set(bad) for name, a in window.items()}
        with jax.default_matmul_precision("highest"):
            y, new = compiled_verify(poison_dead_slots(rs), garbage)
        np.testing.assert_array_equal(as_f32(y[:, :t]), as_f32(y_clean[:, :t]), err_msg=f"drafts {t}.. garbage")
        assert np.isfinite(as_f32(new.checkpoint)).all()
        step = layer.draw()
        y_next, after = layer.replay_step(ops.replay_commit(new, m + t), step, "output", "interpret")
        y_next_clean, after_clean = layer.replay_step(ops.replay_commit(clean, m + t), step, "output", "interpret")
        np.testing.assert_array_equal(as_f32(y_next), as_f32(y_next_clean), err_msg=f"step after accepting {t}")
        np.testing.assert_array_equal(as_f32(layer.materialize(after)), as_f32(layer.materialize(after_clean)))


# GDN's first shape; Mamba-2's `slow`: the limits are checked by `config.verify_config_for` (the layer's
# dims named in the messages), the same for both layers, as test_kernels.py checks the replay step's on GDN.
@pytest.mark.parametrize("case", [pytest.param(case, id=case_id(case),
                                               marks=[pytest.mark.slow] if case[0] is Mamba2 else [])
                                  for case in cases(CPU_SHAPES, first_only=True)])
def test_verify_limits_before_any_launch(case, rng):
    """The kernels' own limits and config checks, before any launch; the state stays usable."""
    layer = case[0](case[1], rng)
    rs = layer.replay_state(4, jnp.float32, jnp.float32, np.zeros(layer.s.batch))
    entry = kernels.gdn_replay_verify if isinstance(layer, GDN) else kernels.mamba2_replay_verify

    def call(rs, window, config=None):
        if isinstance(layer, GDN):
            return entry(rs, **window, scale=0.5, use_qk_l2norm=True, config=config, interpret=True)
        return entry(rs, **layer._kernel_args(window), config=config, interpret=True)

    with pytest.raises(ValueError, match=re.escape("the verify window `W` must be in [1, L = 4]; got 5")):
        call(rs, draw_window(layer, 5))
    window = draw_window(layer, 2)
    with pytest.raises(ValueError, match=re.escape("`config.fused_flush` must be False for the verify window")):
        call(rs, window, kernels.ReplayConfig(block_v=4, fused_flush=True))
    with pytest.raises(TypeError, match=re.escape("`config` must be a replayssm_jax.kernels.ReplayConfig or None "
                                                  "for the verify window; got StepConfig")):
        verify(layer, rs, window, "interpret", kernels.StepConfig(block_v=4))
    with pytest.raises(ValueError, match=r"`config.block_v` must be <= 16 \(the state's \w+( \w+)? [VP] = 12 rows"):
        call(rs, window, kernels.ReplayConfig(block_v=128))
    with pytest.raises(ValueError, match=re.escape("`config.flush_rows` must divide the batch (5); got 2")):
        call(rs, window, kernels.ReplayConfig(block_v=4, flush_rows=2))
    long = layer.replay_state(kernels.MAX_BUFFER_LEN + 1, jnp.float32, jnp.float32, np.zeros(layer.s.batch))
    with pytest.raises(ValueError, match="the Pallas kernels support buffer length `L` <= 64; got 65"):
        call(long, window)
    y, new = verify(layer, rs, window, "interpret")  # the state is still usable
    assert new.window == 2 and np.isfinite(as_f32(y)).all()


def test_verify_ops_take_the_kernel_backends():
    assert {"mamba2_replay_verify", "gdn_replay_verify"} <= ops.KERNEL_OPS
    config = kernels.default_verify_config(64, 32, 128, 128, jnp.bfloat16, 16, 4)
    assert not config.fused_flush and config.block_v * 128 <= kernels.config.VERIFY_TILE_ELEMENTS
    assert kernels.default_verify_config(256, 96, 80, 128, jnp.float32, 16, 4).block_v == 16  # a divisor of P = 80


# L = 16 with W = 4 `slow`: L = 16 lowers with W = 3 (a window padded to 4 steps), W = 4 at L = 4.
@pytest.mark.parametrize("case", cases({GDN: GPU_SHAPES[GDN][:1], Mamba2: GPU_SHAPES[Mamba2][:1]}), ids=case_id)
@pytest.mark.parametrize("L, W", [pytest.param(16, 4, marks=pytest.mark.slow), (16, 3), (4, 4)],
                         ids=["L16-W4", "L16-W3", "L4-W4"])
def test_verify_lowers_for_cuda(case, L, W, rng):
    """The Triton lowering of the verify launches at the model shapes, on the CPU:
    the early flush and the verify kernel."""
    layer = case[0](dataclasses.replace(case[1], batch=2), rng, jnp.bfloat16)
    rs = layer.replay_state(L, jnp.float32, jnp.bfloat16, np.array([0, L]))
    window = draw_window(layer, W)
    if isinstance(layer, GDN):
        fn = lambda r, w: kernels.gdn_replay_verify(r, **w, scale=0.1, use_qk_l2norm=True)  # noqa: E731
    else:
        fn = lambda r, w: kernels.mamba2_replay_verify(r, **layer._kernel_args(w))  # noqa: E731
    text = lower_for_cuda(fn, rs, window)
    calls = [line for line in text.splitlines() if "custom_call" in line and "triton" in line]
    assert len(calls) == 2 and text.count("__gpu$xla.gpu.triton") == 2, calls
    assert f"verify_flush_W{W}_L{L}" in text and f"verify_W{W}_L{L}" in text
    # In place: the early flush's one output (the checkpoint) aliases operand 0; the verify
    # kernel's outputs 1..3 (the three buffers) alias operands 1..3 (after the checkpoint).
    assert re.search(r"output_operand_aliases = \[#stablehlo.output_operand_alias<output_tuple_indices = \[\], "
                     r"operand_index = 0", calls[0]), calls[0][:2000]
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", calls[1])
    assert sorted((int(o), int(i)) for o, i in aliases) == [(1, 1), (2, 2), (3, 3)], calls[1][:2000]


@pytest.mark.gpu
@pytest.mark.parametrize("case", cases(GPU_SHAPES), ids=case_id)
@pytest.mark.parametrize("dtypes", ["f32", "bf16in-f32state", "bf16in-bf16state"])
def test_verify_gpu(case, dtypes, rng):
    layer = case[0](case[1], rng, DTYPES[dtypes][0])
    check_verify(layer, 16, 4, dtypes, "pallas", rounds=2)
