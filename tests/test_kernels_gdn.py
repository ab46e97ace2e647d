"""Gated DeltaNet Pallas kernels against the reference.

On the CPU the kernels run in interpret mode at small, awkward shapes
(head dims 20, 24 and 100, HV = 2H, L in {1, 4, 16}, rows at mixed cursors,
bf16 inputs with f32 or bf16 state). The same checks run compiled at the
model's shapes on a GPU (`pytest -m gpu`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernel_checks import DTYPES, lower_for_cuda, GDN, GDNShape, check_replay, check_standard
from replayssm_jax import kernels, ops

CPU_SHAPES = [GDNShape(batch=4, H=2, HV=4, K=20, V=24), GDNShape(batch=4, H=1, HV=1, K=100, V=16)]
GPU_SHAPES = [
    GDNShape(batch=8, H=16, HV=32, K=128, V=128),  # row-block tiles
    GDNShape(batch=20, H=16, HV=32, K=128, V=128),  # whole-head replay tiles (batch * HV >= 4 * 132)
    GDNShape(batch=5, H=2, HV=6, K=100, V=80),
]

# The Pallas Triton backend warns that it is deprecated when a kernel is lowered.
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtypes", DTYPES)
def test_step(shape, dtypes, rng):
    input_dtype, state_dtype, _ = DTYPES[dtypes]
    check_standard(GDN(shape, rng, input_dtype), state_dtype, "interpret")


@pytest.mark.parametrize("shape", CPU_SHAPES[:1], ids=str)
@pytest.mark.parametrize("L", [1, 4, 16])
@pytest.mark.parametrize("route", ["output", "state"])
def test_replay_step_f32(shape, L, route, rng):
    check_replay(GDN(shape, rng), L, route, *DTYPES["f32"], "interpret")


@pytest.mark.parametrize("shape", CPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtypes", ["bf16in-f32state", "bf16in-bf16state"])
@pytest.mark.parametrize("route", ["output", "state"])
def test_replay_step_bf16(shape, dtypes, route, rng):
    input_dtype, state_dtype, buffer_dtype = DTYPES[dtypes]
    check_replay(GDN(shape, rng, input_dtype), 4, route, input_dtype, state_dtype, buffer_dtype, "interpret")


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
    layer = GDN(CPU_SHAPES[0], rng, jnp.bfloat16)
    check_replay(layer, L, route, *DTYPES["bf16in-f32state"], "interpret", steps=L // 2 + 2, config=config)


@pytest.mark.parametrize("route", ["output", "state"])
def test_replay_dead_slots_never_read(route, rng):
    """NaN and inf in the dead slots (a rejected draft's records) reach no output or state."""
    check_replay(GDN(CPU_SHAPES[0], rng), 8, route, *DTYPES["f32"], "interpret", steps=6, poison=True)


def test_errors_before_any_kernel(rng):
    layer = GDN(CPU_SHAPES[0], rng)
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
    with pytest.raises(ValueError, match="`config.tiles` must be 1"):
        ops.gdn_step(state, **inp, backend="interpret", config=kernels.Config(block_v=8, tiles=2))


@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("L", [1, 32])
@pytest.mark.parametrize("dtypes", ["f32", "bf16in-bf16state"])
def test_kernels_lower_for_cuda(shape, L, dtypes, rng):
    """The Triton lowering of every kernel at the GPU test shapes, on the CPU."""
    input_dtype, state_dtype, buffer_dtype = DTYPES[dtypes]
    layer = GDN(shape, rng, input_dtype)
    rs = layer.replay_state(L, state_dtype, buffer_dtype, np.zeros(shape.batch))
    inp = layer.draw()
    text = lower_for_cuda(lambda s, i: kernels.gdn_step(s, **i), rs.checkpoint, inp)
    for route in ("output", "state"):
        text += lower_for_cuda(lambda r, i: kernels.gdn_replay_step(r, **i, route=route), rs, inp)
    assert text.count("__gpu$xla.gpu.triton") == 5  # standard, then (replay, flush) per route


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("dtypes", DTYPES)
def test_step_gpu(shape, dtypes, rng):
    input_dtype, state_dtype, _ = DTYPES[dtypes]
    check_standard(GDN(shape, rng, input_dtype), state_dtype, "pallas")


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
    check_replay(GDN(shape, rng, input_dtype), L, route, input_dtype, state_dtype, buffer_dtype, "pallas",
                 steps=L // 2 + 2)


# The replay tilings at the model shape, compiled; dead slots poisoned.
GPU_TILINGS = [kernels.Config(block_v=bv, num_warps=w, tiles=t) for bv, w, t in [(32, 4, 4), (64, 8, 2), (16, 2, 3)]]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_TILINGS, ids=str)
@pytest.mark.parametrize("L", [8, 32])
@pytest.mark.parametrize("route", ["output", "state"])
def test_replay_tilings_gpu(config, L, route, rng):
    layer = GDN(GPU_SHAPES[0], rng, jnp.bfloat16)
    check_replay(layer, L, route, *DTYPES["bf16in-f32state"], "pallas", steps=L // 2 + 2, config=config, poison=True)
