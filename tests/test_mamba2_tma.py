"""The Mamba-2 append route on Mosaic GPU (replayssm_jax.kernels.tma_readout.mamba2_readout_tma and the
Triton launch after it, replayssm_jax.kernels.mamba2._after_readout).

On the CPU: the limits' errors (raised before any launch), the default's
choice, the launch after the readout (interpreted, given S_c C in jnp)
against the reference's append step from staggered cursors with inf in the
dead slots and a full row, and the step lowered for CUDA (two custom calls,
the records and the cursor aliased in place). On a GPU (`pytest -m gpu`):
the readout kernel against S_c C in f32, the compiled step against the
reference, a full row under a trace, and the compiled step is its two
kernels with no copy of the state in a decode loop.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import assert_close
from hlo_checks import assert_step_alone_and_in_a_loop
from kernel_checks import (Mamba2, Mamba2Shape, check_auto_is_deferred, check_deferred_step_kernels,
                           check_deferred_steps, lower_for_cuda, poison_dead_slots)
from replayssm_jax import kernels, ops
from replayssm_jax.kernels import mamba2 as mamba2_kernels
from replayssm_jax.kernels import tma_readout
from replayssm_jax.testing import MAMBA2_CASES, tolerance_dtype
from test_tma_readout import _Device  # a device stand-in

f32, bf16 = jnp.float32, jnp.bfloat16
L = 8
SHAPE = Mamba2Shape(batch=5, H=8, P=64, N=64, G=2)  # a group's rows, 4 * 64, are whole 64-row items
MODEL = MAMBA2_CASES.model  # Nemotron-3-Nano-4B's layer: 96 heads of 80 rows, N = 128, 8 groups


def _layer(rng, shape=SHAPE, dtype=bf16):
    return Mamba2(shape, rng, dtype)


def _state(layer, checkpoint_dtype, buffer_dtype, cursor, buffer_len=L):
    """A replay state whose dead slots (slot >= cursor) hold inf and NaN in every record (a rejected
    draft's; `kernel_checks.poison_dead_slots`)."""
    return poison_dead_slots(layer.replay_state(buffer_len, checkpoint_dtype, buffer_dtype, cursor))


def _reference(layer, rs, inp, cursor, buffer_len=L):
    """The reference append step ("xla") on the rows with a free slot (the op refuses a full row; a full
    row's entries of the result are its state at entry)."""
    free = np.asarray(cursor) < buffer_len
    y, new = ops.mamba2_replay_step(rs.replace(cursor=jnp.where(jnp.asarray(free), rs.cursor, 0)),
                                    **layer._kw(inp), route="append", backend="xla")
    keep = lambda a, b: jnp.where(jnp.asarray(free).reshape((-1,) + (1,) * (a.ndim - 1)), a, b)  # noqa: E731
    return y, new.replace(x=keep(new.x, rs.x), dt=keep(new.dt, rs.dt), B=keep(new.B, rs.B),
                          cursor=jnp.minimum(rs.cursor + 1, buffer_len))


def _readout(rs, C):
    """S_c C in f32: f32[batch, H, P]."""
    group = rs.checkpoint.shape[1] // C.shape[1]
    return jnp.einsum("bhpn,bhn->bhp", rs.checkpoint.astype(f32), jnp.repeat(C.astype(f32), group, 1),
                      precision="highest")


def _check_step(y, new, y_ref, rs_ref, rs, cursor, tol, buffer_len=L):
    """Outputs of the rows with a free slot within `tol`, NaN in a full row's; the x and B records bit for
    bit (the inputs as buffered), the new dt records within the f32 tolerance and every other dt slot bit for
    bit; the checkpoint unchanged; the cursor moved."""
    free = np.asarray(cursor) < buffer_len
    y, y_ref = np.asarray(y, np.float32), np.asarray(y_ref, np.float32)
    assert_close(y[free], y_ref[free], tol, what="outputs")
    assert np.isnan(y[~free]).all(), "a full row's outputs are not NaN"
    for name in ("x", "B"):  # the inputs as buffered: bit for bit
        np.testing.assert_array_equal(np.asarray(getattr(new, name), np.float32),
                                      np.asarray(getattr(rs_ref, name), np.float32), err_msg=f"{name} records")
    dt, dt_ref = np.asarray(new.dt), np.asarray(rs_ref.dt)  # the processed dt: softplus within f32 rounding
    slot = np.arange(buffer_len) == np.asarray(cursor)[:, None, None]
    assert_close(dt[np.broadcast_to(slot, dt.shape)], dt_ref[np.broadcast_to(slot, dt.shape)], f32,
                 what="the new dt records")
    np.testing.assert_array_equal(dt[~np.broadcast_to(slot, dt.shape)], dt_ref[~np.broadcast_to(slot, dt.shape)],
                                  err_msg="dt records at other slots")
    np.testing.assert_array_equal(np.asarray(new.checkpoint), np.asarray(rs.checkpoint))
    np.testing.assert_array_equal(np.asarray(new.cursor), np.minimum(cursor + 1, buffer_len))


# ---------------------------------------------------------------------------
# CPU: the launch after the readout, limits, default, lowering


@pytest.mark.parametrize(("shape", "buffer_len", "buffer_dtype", "act"), [
    (SHAPE, L, bf16, bf16),
    (Mamba2Shape(batch=5, H=12, P=24, N=20, G=1), 6, f32, f32),
    (Mamba2Shape(batch=4, H=10, P=100, N=16, G=2, gated=False, dt_limit=(0.05, 0.8)), 24, bf16, f32),
], ids=["bf16-group4", "f32-group12-L6", "group5-P100-ungated-dtlimit-L24"])
@pytest.mark.parametrize("entry", [False, True], ids=["atomics", "entry-copy"])
def test_launch_after_the_readout_matches_the_reference(shape, buffer_len, buffer_dtype, act, entry, rng):
    """The Triton launch after the readout (interpreted), given S_c C, against the reference's append step:
    from staggered cursors with inf and NaN in the dead slots and one row that entered full (NaN outputs, its
    records kept), groups of 4, 12 and 5 heads, dims and L not powers of two; the cursor read and moved with
    atomics, or read from the readout's copy of it at entry and moved by each row's first program."""
    layer = _layer(rng, shape, act)
    cursor = (np.arange(shape.batch) * 5 % buffer_len).astype(np.int32)
    cursor[-1] = buffer_len
    rs, inp = _state(layer, f32, buffer_dtype, cursor, buffer_len), layer.draw()
    y_ref, rs_ref = _reference(layer, rs, inp, cursor, buffer_len)
    kw = layer._kernel_args(inp)
    inputs = mamba2_kernels._with_defaults(mamba2_kernels.Inputs(*(kw[n] for n in mamba2_kernels.Inputs._fields)))
    y, records, cursor_next = mamba2_kernels._after_readout(
        _readout(rs, inp["C"]), mamba2_kernels.Records(rs.x, rs.dt, rs.B), rs.cursor, inputs,
        jnp.array(rs.cursor) if entry else None, dt_softplus=True, dt_limit=tuple(map(float, shape.dt_limit)),
        interpret=True)
    new = rs.replace(x=records.x, dt=records.dt, B=records.B, cursor=cursor_next)
    _check_step(y, new, y_ref, rs_ref, rs, cursor, tolerance_dtype(act, f32, buffer_dtype), buffer_len)


def test_limits_raise_before_any_launch(rng):
    """The route's and the kernel's limits are errors naming them, raised before a launch (on the CPU too)."""
    layer = _layer(rng)
    rs, inp = layer.replay_state(L, f32, bf16, np.zeros(SHAPE.batch, np.int32)), layer.draw()
    config = kernels.TMAReadoutConfig()
    with pytest.raises(NotImplementedError, match="compiled on a GPU only"):
        kernels.mamba2_replay_step(rs, **layer._kernel_args(inp), route="append", config=config, interpret=True)
    with pytest.raises(NotImplementedError, match="no state pool"):
        kernels.mamba2_replay_step(rs, **layer._kernel_args(inp), route="append", config=config,
                                   slots=jnp.arange(SHAPE.batch, dtype=jnp.int32))
    with pytest.raises(TypeError,
                       match=r"'append', 'deferred' routes only; got route 'output' \(use a ReplayConfig\)"):
        layer.kernel_replay_step(rs, inp, "output", config)
    odd = _layer(rng, Mamba2Shape(batch=2, H=6, P=80, N=64, G=3))
    with pytest.raises(ValueError, match=r"\(H // G\) \* P = 2 \* 80, a multiple of `config.block_v` = 64.*"
                                         r"got 160"):
        odd.kernel_replay_step(odd.replay_state(L, f32, bf16, np.zeros(2, np.int32)), odd.draw(), "append", config)
    with pytest.raises(TypeError, match="'xla' backend"):
        ops.mamba2_replay_step(rs, **layer._kw(inp), route="append", backend="xla", config=config)


def _abstract(batch, shape=MODEL, L=16, checkpoint=f32, buffers=bf16, act=bf16):
    """(abstract replay state, abstract C) of a Mamba-2 layer: shapes only, nothing allocated."""
    H, P, N, G = shape.H, shape.P, shape.N, shape.G
    wide = checkpoint in (f32, bf16)
    state = jax.eval_shape(lambda: ops.mamba2_replay_init(jnp.zeros((batch, H, P, N), checkpoint if wide else f32),
                                                          L, G, buffers,
                                                          **({} if wide else dict(checkpoint_dtype=checkpoint))))
    return state, jax.ShapeDtypeStruct((batch, G, N), act)


@pytest.mark.parametrize(("case", "config", "match"), [
    (dict(shape=Mamba2Shape(batch=4, H=4, P=64, N=512, G=1)), None,
     r"N \(d_state\) a multiple of 32 for a float32 checkpoint.*at most 256; got N = 512"),
    (dict(shape=Mamba2Shape(batch=4, H=4, P=64, N=64, G=1), checkpoint=bf16, act=f32), None, None),
    (dict(shape=Mamba2Shape(batch=4, H=4, P=64, N=32, G=1), act=bf16), None,
     r"N \(d_state\) \* C's item size a multiple of 128 bytes .*got N = 32 of bfloat16"),
    (dict(act=jnp.float16), None, "f32 or bf16 C; got float16"),
    (dict(checkpoint=jnp.int8), None, "8-bit checkpoint"),
    (dict(shape=Mamba2Shape(batch=4, H=4, P=128, N=256, G=1)), dict(block_v=128, stages=4),
     r"4 stages of 128 rows need \d+ bytes of shared memory, above a program's 232448"),
], ids=["N-512", "bf16-N64-f32-C-fits", "bf16-C-N32", "f16-C", "int8", "smem"])
def test_limits_on_shapes(case, config, match):
    """The shape limits, on abstract states (None: the case fits)."""
    state, C = _abstract(**{"batch": 256, **case})
    check = lambda: tma_readout.check_mamba2_tma(state, C, kernels.TMAReadoutConfig(**(config or {})),  # noqa: E731
                                                 interpret=False, slots=None)
    if match is None:
        check()
        return
    with pytest.raises(NotImplementedError if "8-bit" in match else ValueError, match=match):
        check()


@pytest.mark.parametrize(("device", "case", "kw", "takes"), [
    (_Device(), dict(batch=256), {}, True),
    (_Device(), dict(batch=64), {}, True),
    (_Device(), dict(batch=63), {}, False),
    (_Device(), dict(batch=64, checkpoint=bf16), {}, True),
    (_Device(), dict(batch=256, checkpoint=jnp.int8), {}, False),
    (_Device(), dict(batch=256), dict(interpret=True), False),
    (_Device(), dict(batch=256), dict(slots=jnp.arange(256)), False),
    (_Device(compute_capability="8.0"), dict(batch=256), {}, False),
    (_Device(platform="cpu"), dict(batch=256), {}, False),
    (_Device(), dict(batch=256, shape=Mamba2Shape(batch=1, H=6, P=80, N=128, G=3)), {}, False),
], ids=["b256", "b64", "b63", "bf16-b64", "int8", "interpret", "pool", "sm80", "cpu", "group-rows-160"])
def test_default_tiling_of_the_append_route(device, case, kw, takes, monkeypatch):
    """config=None on the append route takes the Mosaic GPU readout where `default_mamba2_tma` says, what
    was measured: a Hopper-class GPU, batch >= 64, an f32 or bf16 checkpoint, within the kernel's limits."""
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    state, C = _abstract(**case)
    config = tma_readout.default_mamba2_tma(state, C, interpret=kw.get("interpret", False), slots=kw.get("slots"))
    assert config == (kernels.TMAReadoutConfig() if takes else None)


def test_default_tiling_of_the_deferred_route_counts_the_flush(monkeypatch):
    """On the deferred route the default counts the flush's buffers in a program's shared memory: N = 192,
    L = 32 (102456 bytes a program on the append route, 128088 with the flush's, above an SM's half of
    232448) takes the Mosaic GPU readout on the append route only; N = 128, L = 16 on both."""
    monkeypatch.setattr(jax, "devices", lambda *a: [_Device()])
    for N, L, deferred_takes in ((192, 32, False), (128, 16, True)):
        state, C = _abstract(256, Mamba2Shape(batch=1, H=96, P=80, N=N, G=8), L=L)
        assert tma_readout.mamba2_flushes_in_readout(state, C, kernels.TMAReadoutConfig())
        for deferred, takes in ((False, True), (True, deferred_takes)):
            config = tma_readout.default_mamba2_tma(state, C, interpret=False, slots=None, deferred=deferred)
            assert config == (kernels.TMAReadoutConfig() if takes else None), (N, L, deferred)


@pytest.mark.parametrize(("checkpoint_dtype", "act", "config", "batch"), [
    (f32, bf16, kernels.TMAReadoutConfig(), 300),
    (bf16, bf16, kernels.TMAReadoutConfig(stages=3, programs_per_sm=3), 8),
    (f32, f32, kernels.TMAReadoutConfig(), 301),
], ids=["f32-b300", "bf16-3stages-b8", "f32-b301-atomics"])
def test_kernel_lowers_for_cuda(checkpoint_dtype, act, config, batch, rng):
    """The step's whole lowering on the CPU at the model's shape (abstract inputs), short of compiling: two
    custom calls, the Mosaic GPU readout and the Triton launch after it (its x, dt and B records and its
    cursor aliased in place), and nothing else but the checkpoint's reshape to rows. The cursor moves with
    atomics only where the batch is not a multiple of 4 (elsewhere the readout copies it at entry for the
    launch after it: `tma_readout.readout_moves_cursor`)."""
    layer = _layer(rng, MODEL.with_batch(batch), act)
    state, _ = _abstract(batch, checkpoint=checkpoint_dtype)
    text = lower_for_cuda(lambda rs, inp: layer.kernel_replay_step(rs, inp, "append", config), state,
                          jax.eval_shape(layer.draw))
    calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)\(", text)
    assert sorted(calls) == ["__gpu$xla.gpu.triton", "mosaic_gpu_v2"], calls
    aliases = re.search(r"@__gpu\$xla\.gpu\.triton\([^\n]*output_operand_aliases = \[(.*?)\]\}", text).group(1)
    pairs = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", aliases)
    assert sorted(pairs) == [("1", "1"), ("2", "2"), ("3", "3"), ("4", "4")], pairs
    assert ("atomic" in text) == (batch % 4 != 0)


@pytest.mark.parametrize(("checkpoint_dtype", "batch"), [(f32, 64), (bf16, 64), (f32, 66)],
                         ids=["f32", "bf16", "b66-flush-launch"])
def test_deferred_step_lowers_for_cuda(checkpoint_dtype, batch, rng):
    """The deferred route's lowering on the CPU at the model's shape (abstract inputs; 64-row items across
    its 80-row heads): the readout, which flushes the full rows itself (its checkpoint aliased in place), and
    the launch after it. At batch 66 (not a multiple of 4: `mamba2_flushes_in_readout` says no) the flush
    launch of the full rows runs first (its checkpoint aliased; an f32 one's on 32-row tiles). No other
    custom call."""
    layer = _layer(rng, MODEL.with_batch(batch))
    state, C = _abstract(batch, checkpoint=checkpoint_dtype)
    fused = batch % 4 == 0
    assert tma_readout.mamba2_flushes_in_readout(state, C, kernels.TMAReadoutConfig()) == fused
    text = lower_for_cuda(lambda rs, inp: layer.kernel_replay_step(rs, inp, "deferred", kernels.TMAReadoutConfig()),
                          state, jax.eval_shape(layer.draw))
    calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)\(([^\n]*)", text)
    want = ["__gpu$xla.gpu.triton"] * (1 + (not fused)) + ["mosaic_gpu_v2"]
    assert sorted(c for c, _ in calls) == want, calls
    assert ("atomic" in text) == (not fused)  # the cursor copied at entry by the readout (batch % 4 == 0)
    flush = [line for _, line in calls if "mamba2_deferred_flush_L16" in line]
    assert len(flush) == (not fused), "a flush launch beside the readout that flushes" if fused else "no flush launch"
    if fused:
        readout = next(line for c, line in calls if c == "mosaic_gpu_v2")
        assert "mamba2_deferred_tma" in readout
        pairs = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", readout)
        assert pairs == [("2", "0")], pairs  # the checkpoint in place (after the readout and the entry cursors)
        return
    tile = "_bv32_w4_" if checkpoint_dtype == f32 else "_bv16_w2_"  # config.DEFERRED_FLUSH_TILE for f32 only
    assert f"mamba2_deferred_flush_L16{tile}" in flush[0], flush[0]
    assert re.search(r"output_operand_aliases = \[#stablehlo\.output_operand_alias<output_tuple_indices = \[\], "
                     r"operand_index = 0", flush[0]), "the flush launch's checkpoint is not aliased"


@pytest.mark.parametrize(("P", "block_v", "heads"), [(64, 64, 1), (80, 64, 2), (64, 128, 2), (80, 128, 3),
                                                     (128, 64, 1), (96, 64, 2)])
def test_heads_per_item(P, block_v, heads):
    """The most heads a readout item spans, against a count over every item of 16 heads."""
    assert tma_readout.heads_per_item(P, block_v) == heads
    spans = {len({row // P for row in range(t * block_v, (t + 1) * block_v)}) for t in range(16 * P // block_v)}
    assert max(spans) == heads


# ---------------------------------------------------------------------------
# GPU: the compiled kernels


@pytest.mark.gpu
@pytest.mark.parametrize(("checkpoint_dtype", "config", "shape"), [
    (f32, kernels.TMAReadoutConfig(), MODEL.with_batch(8)),
    (bf16, kernels.TMAReadoutConfig(block_v=128, stages=3), SHAPE),
    (f32, kernels.TMAReadoutConfig(programs_per_sm=1, stages=1), Mamba2Shape(batch=300, H=4, P=64, N=128, G=2)),
], ids=["model-f32", "bf16-128x3", "b300-f32-1stage"])
def test_compiled_readout_is_the_checkpoint_times_C(checkpoint_dtype, config, shape, rng):
    """The Mosaic GPU readout alone against S_c C in f32 (products and sums in f32: the f32 tolerance)."""
    layer = _layer(rng, shape)
    rs, inp = layer.replay_state(L, checkpoint_dtype, bf16, np.zeros(shape.batch, np.int32)), layer.draw()
    got = jax.jit(lambda c, C: tma_readout.mamba2_readout_tma(c, C, config))(rs.checkpoint, inp["C"])
    assert_close(got, _readout(rs, inp["C"]), f32, what="S_c C")


@pytest.mark.gpu
@pytest.mark.parametrize(("checkpoint_dtype", "buffer_dtype", "act", "config", "shape"), [
    (f32, bf16, bf16, kernels.TMAReadoutConfig(), MODEL.with_batch(8)),
    (f32, f32, f32, kernels.TMAReadoutConfig(block_v=128, programs_per_sm=1), SHAPE),
    (bf16, bf16, bf16, kernels.TMAReadoutConfig(stages=3), SHAPE),
    (f32, bf16, bf16, kernels.TMAReadoutConfig(), Mamba2Shape(batch=300, H=4, P=64, N=128, G=2, gated=False)),
], ids=["model-f32-bf16", "f32-f32-f32act-128", "bf16-3stages", "b300-ungated"])
def test_compiled_append_step_matches_the_reference(checkpoint_dtype, buffer_dtype, act, config, shape, rng):
    """From staggered cursors with inf and NaN in the dead slots and a row that entered full: outputs within the
    tolerance of the case's dtypes, records and checkpoint as the reference's, the cursor moved."""
    layer = _layer(rng, shape, act)
    cursor = (np.arange(shape.batch) * 3 % L).astype(np.int32)
    cursor[1] = L
    rs, inp = _state(layer, checkpoint_dtype, buffer_dtype, cursor), layer.draw()
    y_ref, rs_ref = _reference(layer, rs, inp, cursor)
    y, new = jax.jit(lambda s, i: layer.kernel_replay_step(s, i, "append", config))(rs, inp)
    _check_step(y, new, y_ref, rs_ref, rs, cursor, tolerance_dtype(act, checkpoint_dtype, buffer_dtype))


@pytest.mark.gpu
@pytest.mark.parametrize(("checkpoint_dtype", "buffer_dtype", "act", "config", "shape"), [
    (f32, bf16, bf16, kernels.TMAReadoutConfig(), MODEL.with_batch(8)),
    (bf16, bf16, bf16, kernels.TMAReadoutConfig(stages=3), SHAPE.with_batch(8)),
    (f32, f32, f32, kernels.TMAReadoutConfig(block_v=128), Mamba2Shape(batch=68, H=4, P=64, N=128, G=2, gated=False)),
    (f32, bf16, bf16, kernels.TMAReadoutConfig(block_v=128), Mamba2Shape(batch=12, H=16, P=80, N=64, G=2)),
    (f32, f32, f32, kernels.TMAReadoutConfig(block_v=128), Mamba2Shape(batch=67, H=4, P=64, N=128, G=2, gated=False)),
    # 800 items over 264 programs: the first 8 take a 4th step (a traced step count), 3 stages
    (f32, f32, f32, kernels.TMAReadoutConfig(stages=3), Mamba2Shape(batch=200, H=4, P=64, N=128, G=2, gated=False)),
], ids=["model-f32-bf16", "bf16-b8", "b68-f32-ungated", "p80-bv128-3-heads", "b67-flush-launch", "b200-3stages"])
def test_compiled_deferred_steps_match_the_reference(checkpoint_dtype, buffer_dtype, act, config, shape, rng):
    """The deferred route on Mosaic GPU (the readout, which flushes the full rows itself, or the flush launch
    before it where `mamba2_flushes_in_readout` says no, as at batch 67; the launch after it): L + 2 steps
    from staggered cursors, full rows among them, inf and NaN in the dead slots, against the reference's
    deferred route (`kernel_checks.check_deferred_steps`)."""
    rs = _abstract(shape.batch, shape, L, checkpoint_dtype, buffer_dtype, act)
    assert tma_readout.mamba2_flushes_in_readout(*rs, config) == (shape.batch % 4 == 0)
    layer = _layer(rng, shape, act)
    cursor = (np.arange(shape.batch) * 3 % (L + 1)).astype(np.int32)
    check_deferred_steps(layer, _state(layer, checkpoint_dtype, buffer_dtype, cursor), config, L + 2,
                         tolerance_dtype(act, checkpoint_dtype, buffer_dtype))


@pytest.mark.gpu
def test_auto_route_at_batch_256_is_deferred(rng):
    """route="auto" at batch 256 with an f32 checkpoint: the deferred route, on the Mosaic GPU kernel on a
    Hopper-class GPU, within the tolerance of the reference (`kernel_checks.check_auto_is_deferred`)."""
    check_auto_is_deferred(_layer(rng, Mamba2Shape(batch=256, H=8, P=64, N=128, G=2)), "mamba2", L)


@pytest.mark.gpu
def test_default_append_route_at_batch_256(rng):
    """config=None on the append route at batch 256: the Mosaic GPU readout on a Hopper-class GPU (the
    Triton kernel elsewhere), within the tolerance of the reference."""
    shape = Mamba2Shape(batch=256, H=8, P=64, N=128, G=2)
    layer = _layer(rng, shape)
    cursor = (np.arange(shape.batch) * 5 % 16).astype(np.int32)
    rs, inp = layer.replay_state(16, f32, bf16, cursor), layer.draw()
    step = jax.jit(lambda s, i: layer.kernel_replay_step(s, i, "append", None))
    calls = re.findall(r"custom_call @(\w+)\(", step.trace(rs, inp).lower().as_text())
    hopper = str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")
    assert ("mosaic_gpu_v2" in calls) == hopper, calls
    y, new = step(rs, inp)
    y_ref, _ = _reference(layer, rs, inp, cursor, 16)
    assert_close(y, y_ref, tolerance_dtype(bf16, f32), what="outputs")
    np.testing.assert_array_equal(np.asarray(new.cursor), np.minimum(cursor + 1, 16))


@pytest.mark.gpu
def test_compiled_step_is_its_two_kernels(rng):
    """The append step on Mosaic GPU, jitted alone with its state donated and compiled: its entry computation
    is the readout and the launch after it and nothing else; in a decode loop (`lax.scan` of 2 L steps) no
    step copies the checkpoint, the records or the cursor."""
    layer = _layer(rng)
    rs = layer.replay_state(L, f32, bf16, np.zeros(SHAPE.batch, np.int32))
    config = kernels.TMAReadoutConfig()

    def step(rs, inp):
        return layer.kernel_replay_step(rs, inp, "append", config)

    assert_step_alone_and_in_a_loop(step, rs, [layer.draw() for _ in range(2 * L)], jax.tree.leaves(rs))


@pytest.mark.gpu
@pytest.mark.parametrize(("shape", "triton_launches"), [(SHAPE.with_batch(8), 1), (SHAPE, 2)],
                         ids=["flushing-readout", "b5-flush-launch"])
def test_compiled_deferred_step_is_its_kernels(shape, triton_launches, rng):
    """The deferred step on Mosaic GPU: the readout (which flushes the full rows itself; at batch 5, not a
    multiple of 4, after the flush launch) and the launch after it and nothing else, and no copy of the
    state in a decode loop (`kernel_checks.check_deferred_step_kernels`)."""
    check_deferred_step_kernels(_layer(rng, shape), L, triton_launches=triton_launches)
