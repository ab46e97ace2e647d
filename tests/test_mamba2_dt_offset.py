"""Mamba-2's dt read in place (`dt_offset`): the ops take dt as columns of a wider array, Mamba-2's in_proj
output zxbcdt, and the kernels read those columns where they lie (no slice launch before the step).

Every op given dt inside a wider array, its other columns NaN, is checked against the same op given dt
itself, bit for bit, on the reference, the interpreted kernels and (GPU marker) the compiled kernels at
Nemotron-3-Nano-4B's layer, where the append and deferred routes run their Mosaic GPU readout and the
Triton launch after it. Which of these cases the default run takes (the others `slow`): `input_forms.FORM_CASES`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from input_forms import FORM_CASES, L, cursors, lowered_params, run_both_forms
from kernel_checks import lower_for_cuda
from replayssm_jax import kernels, ops
from replayssm_jax.testing import Mamba2, Mamba2Shape

f32, bf16 = jnp.float32, jnp.bfloat16
CPU_SHAPE = Mamba2Shape(batch=4, H=6, P=24, N=20, G=2, dt_limit=(0.05, 0.8))
GPU_SHAPE = Mamba2Shape(batch=64, H=96, P=80, N=128, G=8)  # Nemotron-3-Nano-4B's layer; batch 64: Mosaic GPU routes
OFFSET, TAIL = 37, 5  # dt's columns in the wide array: not aligned, not its end


def widen(dt):
    """(dt inside a wider array [..., OFFSET + H + TAIL] whose other columns are NaN, its dt_offset)."""
    filler = jnp.full((*dt.shape[:-1], OFFSET + dt.shape[-1] + TAIL), jnp.nan, dt.dtype)
    return filler.at[..., OFFSET:OFFSET + dt.shape[-1]].set(dt), OFFSET


def assert_equal(got, want, what):
    """Every leaf of `got` equal to `want`'s, bit for bit (NaN where NaN)."""
    for i, (x, y) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32), err_msg=f"{what}, leaf {i}")


def _run(name, layer, rng, backend, route=None, tree=None, config=None):
    """(op with dt inside a wider array, its other columns NaN, op with dt)."""

    def forms(inp):
        wide, offset = widen(inp["dt"])
        return dict(inp, dt=wide, dt_offset=offset), inp

    return run_both_forms(layer, name, rng, backend, forms, route, tree, config)


@pytest.mark.parametrize("name, route, tree, config, backend", FORM_CASES)
def test_dt_in_a_wider_array_equals_dt(name, route, tree, config, backend, rng):
    """Each Mamba-2 op given dt at an offset of a wider array (its other columns NaN) equals the op given dt,
    outputs and states bit for bit, with a dt clamp (CPU shape) and mixed cursors (a full row on all
    routes but append): the kernels read dt's columns only. Compiled at Nemotron-3-Nano-4B's layer, batch
    64, the append and deferred routes run their default Mosaic GPU readout and the Triton launch after
    it, which reads dt."""
    layer = Mamba2(GPU_SHAPE if backend == "pallas" else CPU_SHAPE, rng)
    got, want = _run(name, layer, rng, backend, route, tree, config)
    assert_equal(got, want, f"{name} {route or ''} on {backend}")


@pytest.mark.parametrize("dt_offset, width, error, match", [
    (3.0, 12, TypeError, r"`dt_offset` must be an int; got float"),
    (-1, 12, ValueError, r"`dt_offset` must be >= 0; got -1"),
    (7, 12, ValueError, r"`dt` with dt_offset = 7 must have shape \[batch, X\] with leading axes \(4,\) and "
                        r"X >= dt_offset \+ nheads = 13; got \(4, 12\)"),
])
def test_dt_offset_errors_name_the_argument(dt_offset, width, error, match, rng):
    """A dt_offset that is not an int >= 0, or a dt too narrow for it, is named with the expected and the
    given, before any kernel; the replay state given stays usable."""
    layer = Mamba2(CPU_SHAPE, rng)
    rs, inp = layer.replay_state(L, f32, bf16, cursors("output", CPU_SHAPE.batch)), layer.draw()
    wide = jnp.asarray(rng.standard_normal((CPU_SHAPE.batch, width)), f32)
    with pytest.raises(error, match=match):
        ops.mamba2_replay_step(rs, **dict(inp, dt=wide), **layer.params, dt_offset=dt_offset, backend="interpret")
    y, _ = ops.mamba2_replay_step(rs, **inp, **layer.params, backend="interpret")
    assert np.isfinite(np.asarray(y)).all()


LOWERED = [("step", None, None), ("verify", None, None), ("replay_verify", None, None)] + [
    ("replay_step", route, None) for route in ("output", "state", "direct", "append", "deferred")] + [
    ("replay_step", route, kernels.TMAReadoutConfig()) for route in ("append", "deferred")]


@pytest.mark.parametrize("name, route, config", lowered_params(LOWERED))
def test_dt_offset_kernels_lower_for_cuda(name, route, config, rng):
    """Each kernel op with dt inside zxbcdt lowers for CUDA at Nemotron-3-Nano-4B's layout (dt the last
    nheads columns of in_proj's output), batch 64: kernels only, no slice of dt."""
    layer, s = Mamba2(GPU_SHAPE, rng), GPU_SHAPE
    W = 4 if "verify" in name else None
    inp = layer.draw() if W is None else layer.draw(W)
    offset = 2 * s.H * s.P + 2 * s.G * s.N  # d_inner + conv_dim
    zxbcdt = jnp.zeros((*inp["dt"].shape[:-1], offset + s.H), bf16)
    kw = dict(D=layer.D, dt_bias=layer.dt_bias, dt_softplus=True, dt_limit=s.dt_limit, dt_offset=offset,
              config=config)
    args = (inp["x"], zxbcdt, layer.A, inp["B"], inp["C"])
    if name == "step":
        text = lower_for_cuda(lambda st, *a: kernels.mamba2_step(st, *a, z=inp["z"], **kw), layer.state(f32), *args)
    elif name == "verify":
        state = jnp.zeros((s.batch, W + 1, s.H, s.P, s.N), f32)
        text = lower_for_cuda(lambda st, i, *a: kernels.mamba2_verify(st, i, *a, z=inp["z"], **kw), state,
                              jnp.zeros((s.batch,), jnp.int32), *args)
    else:
        rs = layer.replay_state(16, f32, bf16, np.zeros(s.batch, np.int32))
        op = kernels.mamba2_replay_step if name == "replay_step" else kernels.mamba2_replay_verify
        extra = dict(route=route) if name == "replay_step" else {}
        text = lower_for_cuda(lambda r, *a: op(r, *a, z=inp["z"], **kw, **extra), rs, *args)
    targets = set(re.findall(r"stablehlo\.custom_call @([\w$.]+)", text))
    assert targets == ({"__gpu$xla.gpu.triton", "mosaic_gpu_v2"} if config else {"__gpu$xla.gpu.triton"}), targets
    assert "stablehlo.slice" not in text


def test_dt_offset_of_numpy_and_traced_types(rng):
    """A NumPy integer dt_offset (a uint8 whose sum with nheads would wrap) is taken as its value on every
    backend; a traced one is refused as not static."""
    layer = Mamba2(CPU_SHAPE, rng)
    state, inp = layer.state(f32), layer.draw()
    filler = jnp.zeros((CPU_SHAPE.batch, 250 + CPU_SHAPE.H), f32)
    wide = filler.at[:, 250:].set(inp["dt"])
    for backend in ("xla", "interpret"):
        got = ops.mamba2_step(state, **dict(inp, dt=wide), **layer.params, dt_offset=np.uint8(250), backend=backend)
        assert_equal(got, ops.mamba2_step(state, **inp, **layer.params, backend=backend), backend)
    with pytest.raises(TypeError, match=r"`dt_offset` must be a static int .*; got a traced value"):
        jax.jit(lambda o: ops.mamba2_step(state, **dict(inp, dt=wide), **layer.params, dt_offset=o,
                                          backend="xla"))(250)
