"""Mamba-2 Pallas kernels against the reference.

On the CPU the kernels run in interpret mode at small, awkward shapes
(head_dim 24 and 100, d_state 20, n_groups < nheads, with and without the
z gate and a dt clamp, L in {1, 4, 16}, rows at mixed cursors, bf16 inputs
with f32 or bf16 state). The same checks run compiled at the model's shapes
on a GPU (`pytest -m gpu`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import DTYPES, lower_for_cuda, Mamba2, Mamba2Shape, check_replay, check_standard
from replayssm_jax import kernels, ops

CPU_SHAPES = [
    Mamba2Shape(batch=4, H=4, P=24, N=20, G=2),
    Mamba2Shape(batch=4, H=3, P=100, N=16, G=1, gated=False, dt_limit=(0.05, 0.8)),
]
GPU_SHAPES = [Mamba2Shape(batch=8, H=96, P=80, N=128, G=8), Mamba2Shape(batch=5, H=6, P=100, N=64, G=2, gated=False)]

# The Pallas Triton backend warns that it is deprecated when a kernel is lowered.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtypes", DTYPES)
def test_step(shape, dtypes, rng):
    input_dtype, state_dtype, _ = DTYPES[dtypes]
    check_standard(Mamba2(shape, rng, input_dtype), state_dtype, "interpret")


@pytest.mark.parametrize("shape", CPU_SHAPES[:1], ids=str)
@pytest.mark.parametrize("L", [1, 4, 16])
@pytest.mark.parametrize("route", ["output", "state"])
def test_replay_step_f32(shape, L, route, rng):
    check_replay(Mamba2(shape, rng), L, route, *DTYPES["f32"], "interpret")


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtypes", ["bf16in-f32state", "bf16in-bf16state"])
@pytest.mark.parametrize("route", ["output", "state"])
def test_replay_step_bf16(shape, dtypes, route, rng):
    input_dtype, state_dtype, buffer_dtype = DTYPES[dtypes]
    check_replay(Mamba2(shape, rng, input_dtype), 4, route, input_dtype, state_dtype, buffer_dtype, "interpret")


# Tilings the heuristic picks only at other shapes: several row tiles per
# program (a static and a dynamic trip count, rows padded past V), and the
# flush's rank-L update as a dot (block_v, L and K >= 16) or unrolled.
TILINGS = [
    (kernels.Config(block_v=8, num_warps=2, tiles=3), 4),
    (kernels.Config(block_v=8, num_warps=2, tiles=2), 16),
    (kernels.Config(block_v=16, num_warps=4, tiles=2), 16),
    (kernels.Config(block_v=16, num_warps=4, tiles=1), 4),
]


@pytest.mark.parametrize(("config", "L"), TILINGS, ids=str)
@pytest.mark.parametrize("route", ["output", "state"])
def test_replay_tilings(config, L, route, rng):
    layer = Mamba2(CPU_SHAPES[0], rng, jnp.bfloat16)
    check_replay(layer, L, route, *DTYPES["bf16in-f32state"], "interpret", steps=L // 2 + 2, config=config)


@pytest.mark.parametrize("route", ["output", "state"])
def test_replay_dead_slots_never_read(route, rng):
    """NaN and inf in the dead slots (a rejected draft's records) reach no output or state."""
    check_replay(Mamba2(CPU_SHAPES[0], rng), 8, route, *DTYPES["f32"], "interpret", steps=6, poison=True)


def test_errors_before_any_kernel(rng):
    layer = Mamba2(CPU_SHAPES[0], rng)
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
    with pytest.raises(ValueError, match="`config.tiles` must be 1"):
        ops.mamba2_step(state, **inp, **layer.params, backend="interpret", config=kernels.Config(block_v=8, tiles=2))


@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("L", [1, 32])
@pytest.mark.parametrize("dtypes", ["f32", "bf16in-bf16state"])
def test_kernels_lower_for_cuda(shape, L, dtypes, rng):
    """The Triton lowering of every kernel at the GPU test shapes, on the CPU."""
    input_dtype, state_dtype, buffer_dtype = DTYPES[dtypes]
    layer = Mamba2(shape, rng, input_dtype)
    rs = layer.replay_state(L, state_dtype, buffer_dtype, np.zeros(shape.batch))
    inp = layer.draw()
    text = lower_for_cuda(lambda s, i: kernels.mamba2_step(s, **i, **layer.params), rs.checkpoint, inp)
    for route in ("output", "state"):
        text += lower_for_cuda(lambda r, i: kernels.mamba2_replay_step(r, **i, **layer.params, route=route), rs, inp)
    assert text.count("__gpu$xla.gpu.triton") == 5  # standard, then (replay, flush) per route


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtypes", DTYPES)
def test_step_gpu(shape, dtypes, rng):
    input_dtype, state_dtype, _ = DTYPES[dtypes]
    check_standard(Mamba2(shape, rng, input_dtype), state_dtype, "pallas")


# Model shape: every dtype and route, a short and a long buffer; the awkward
# shape (head dims 100 and 80 or 64, not powers of two): bf16 inputs only.
GPU_REPLAY_CASES = [(GPU_SHAPES[0], L, dtypes) for L in (4, 32) for dtypes in DTYPES] + [
    (GPU_SHAPES[1], L, "bf16in-f32state") for L in (1, 8)
]


@pytest.mark.gpu
@pytest.mark.parametrize(("shape", "L", "dtypes"), GPU_REPLAY_CASES, ids=str)
@pytest.mark.parametrize("route", ["output", "state"])
def test_replay_step_gpu(shape, L, route, dtypes, rng):
    input_dtype, state_dtype, buffer_dtype = DTYPES[dtypes]
    check_replay(Mamba2(shape, rng, input_dtype), L, route, input_dtype, state_dtype, buffer_dtype, "pallas",
                 steps=L // 2 + 2)


# The replay tilings at the model shape, compiled; dead slots poisoned.
GPU_TILINGS = [kernels.Config(block_v=bv, num_warps=w, tiles=t) for bv, w, t in [(16, 2, 5), (32, 4, 3), (16, 2, 2)]]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_TILINGS, ids=str)
@pytest.mark.parametrize("L", [8, 32])
@pytest.mark.parametrize("route", ["output", "state"])
def test_replay_tilings_gpu(config, L, route, rng):
    layer = Mamba2(GPU_SHAPES[0], rng, jnp.bfloat16)
    check_replay(layer, L, route, *DTYPES["bf16in-f32state"], "pallas", steps=L // 2 + 2, config=config, poison=True)
