"""The conv update (`ops.conv_update`): the kernel against the reference, interpreted on the CPU (small
shapes) and compiled on a GPU (the models' conv_dim, `-m gpu`); its Triton lowering, its argument checks,
and `CausalConv1d.step` on each backend.

Inputs are drawn fresh per test (never zeros), the ring's start at random slots. The ring the kernel
writes must equal the reference's bit for bit (a copy of x); y within the tolerance of its dtype: float32
arithmetic on both sides, summed in another order, rounded once to x's dtype.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hlo_checks import work_besides_kernels
from kernel_checks import lower_for_cuda
from replayssm_jax import kernels, ops
from replayssm_jax.layers.cache import ConvWindow
from replayssm_jax.layers.conv import CausalConv1d

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

# y: float32 sums of W products in another order (a few ulps of f32); bf16 outputs: one rounding to bf16.
TOLERANCE = {jnp.float32: 2e-6, jnp.bfloat16: 8e-3}


def draw(rng, batch, C, W, max_window, dtype, weight_dtype=jnp.float32, bias=True):
    """Random (x, columns, start, weight, bias) of a conv update."""
    S = W - 1 + max_window

    def normal(shape, dt):
        return jnp.asarray(rng.standard_normal(shape), dt)

    return (normal((batch, C), dtype), normal((batch, S, C), dtype),
            jnp.asarray(rng.integers(0, S, batch), jnp.int32), normal((C, W), weight_dtype),
            normal((C,), weight_dtype) if bias else None)


def assert_matches_reference(args, activation, backend, config=None):
    y, columns = ops.conv_update(*args, activation, backend=backend, config=config)
    want_y, want_columns = ops.conv_update(*args, activation, backend="xla")
    np.testing.assert_array_equal(np.asarray(columns, np.float32), np.asarray(want_columns, np.float32))
    tol = TOLERANCE[args[0].dtype.type]
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want_y, np.float32), rtol=tol, atol=tol)


CPU_CASES = [  # (batch, C, W, max_window, dtype, weight dtype, bias, activation, block of channels)
    (3, 96, 4, 1, jnp.float32, jnp.float32, True, "silu", None),
    (2, 100, 4, 3, jnp.bfloat16, jnp.float32, False, "silu", 32),  # channels past the last block
    (4, 64, 2, 1, jnp.bfloat16, jnp.bfloat16, True, "relu2", 16),
    (1, 40, 3, 5, jnp.float32, jnp.bfloat16, False, "identity", None),  # S = 7: the ring padded to 8
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"b{c[0]}-C{c[1]}-W{c[2]}-mw{c[3]}-{c[7]}")
def test_kernel_matches_reference(case, rng):
    batch, C, W, max_window, dtype, weight_dtype, bias, activation, block = case
    args = draw(rng, batch, C, W, max_window, dtype, weight_dtype, bias)
    config = None if block is None else kernels.ConvConfig(block_v=block, num_warps=2)
    assert_matches_reference(args, activation, "interpret", config)


@pytest.mark.gpu
@pytest.mark.parametrize("C, bias", [(8192, False), (9728, True)], ids=["qwen3.5-4b-gdn", "nemotron3-nano-4b"])
@pytest.mark.parametrize("batch", [1, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_compiled_kernel_matches_reference(C, bias, batch, dtype, rng):
    """Compiled at the models' conv_dim (GDN: 2 H K + HV V = 8192, no bias; Mamba-2: d_inner + 2 G N = 9728)."""
    assert_matches_reference(draw(rng, batch, C, 4, 1, dtype, jnp.bfloat16, bias), "silu", "pallas")


@pytest.mark.gpu
def test_compiled_step_is_the_kernel_in_place(rng):
    """`CausalConv1d.step` on "pallas", jitted with the window donated: the kernel and the start's advance
    (i32[batch]), nothing else: no copy of the ring."""
    batch, C = 64, 8192
    conv = CausalConv1d(C, 4, bias=False, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    window = ConvWindow.from_conv_state(jnp.asarray(rng.standard_normal((batch, C, 3)), jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((batch, C)), jnp.bfloat16)
    hlo = jax.jit(lambda w, x: conv.step(x, w, backend="pallas")[::-1], donate_argnums=0).lower(window, x)
    found = [line for line in work_besides_kernels(hlo.compile().as_text()) if f"= s32[{batch}]" not in line]
    assert not found, found


def test_kernel_lowers_for_cuda(rng):
    """The Triton lowering on the CPU at a model shape: one launch, the ring aliased in place."""
    args = draw(rng, 8, 8192, 4, 1, jnp.bfloat16, jnp.bfloat16, False)
    text = lower_for_cuda(lambda *a: kernels.conv_update(*a), *args)
    calls = [line for line in text.splitlines() if "custom_call" in line and "triton" in line]
    assert len(calls) == 1 and "conv_update_w4_bc512_w4_s1" in calls[0], calls
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", calls[0])
    assert aliases == [("1", "1")], calls[0][:2000]


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_layer_step_on_each_backend(backend, rng):
    """CausalConv1d.step: y as the layer's prefill gives it for the next position, and the window
    advanced (its live inputs end with x)."""
    batch, C, W = 2, 48, 4
    conv = CausalConv1d(C, W, bias=True, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    conv.bias[...] = jnp.asarray(rng.standard_normal(C), jnp.float32)
    history = jnp.asarray(rng.standard_normal((batch, 5, C)), jnp.float32)
    _, conv_state = conv(history[:, :4])
    window = ConvWindow.from_conv_state(conv_state, max_window=2).advance(0)
    y, window = conv.step(history[:, 4], window, backend=backend)
    want, _ = conv(history)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want[:, 4]), rtol=2e-6, atol=2e-6)
    np.testing.assert_array_equal(np.asarray(window.live()), np.asarray(history[:, 2:]))


@pytest.mark.parametrize("change, error, message", [
    (dict(x=np.ones((2, 8), np.float16)), TypeError, "`x` must not be float16"),
    (dict(weight=np.ones((7, 4), np.float32)), ValueError, "`weight` must have shape [C, W] with C = 8 (axis 1 of `x`)"),
    (dict(columns=np.ones((2, 3, 8), np.float32)), ValueError, "`columns` must hold at least W = 4 slots"),
    (dict(columns=np.ones((3, 5, 8), np.float32)), ValueError, "`columns` must have shape [batch, S, C] = (2, 5, 8)"),
    (dict(start=np.array([0, 5])), ValueError, "`start` must be in [0, 4] for every row; got [0, 5]"),
    (dict(bias=np.ones((9,), np.float32)), ValueError, "`bias` must have shape [C] = (8,); got (9,)"),
    (dict(activation="tanh"), ValueError, "`activation` must be one of"),
    (dict(activation="gelu", backend="interpret"), ValueError, "`activation` 'gelu': the conv kernel computes"),
    (dict(config=kernels.ConvConfig(block_v=8), backend="xla"), TypeError, "`config` tunes the Pallas kernels"),
])
def test_bad_arguments_raise_before_any_work(change, error, message, rng):
    """Each bad argument raises naming it, before anything runs (the ring is left as it was)."""
    x, columns, start, weight, bias = draw(rng, 2, 8, 4, 2, jnp.float32)
    kw = dict(x=x, columns=columns, start=start, weight=weight, bias=bias, activation="silu", backend="interpret")
    kw.update(change)
    before = np.asarray(columns).copy()
    with pytest.raises(error, match=re.escape(message)):
        ops.conv_update(**kw)
    np.testing.assert_array_equal(np.asarray(columns), before)


def test_backend_none_runs_other_activations_on_xla(rng):
    """backend=None with an activation the kernel does not compute (gelu) runs the reference."""
    args = draw(rng, 2, 8, 4, 1, jnp.float32)
    y, _ = ops.conv_update(*args, "gelu")
    want, _ = ops.conv_update(*args, "gelu", backend="xla")
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


@pytest.mark.parametrize("x, message", [
    (np.ones((2, 1, 8), np.float32), "`x` must be an array of shape [batch, 8]; got (2, 1, 8)"),
    (np.ones((8,), np.float32), "`x` must be an array of shape [batch, 8]; got (8,)"),
    ([[1.0] * 8], "`x` must be an array of shape [batch, 8]; got list"),
    (np.ones((3, 8), np.float32), "columns [batch, S, C] = (3, S, 8) (batch: axis 0 of `x`); got width 4"),
])
def test_layer_step_names_a_bad_x(x, message, rng):
    conv = CausalConv1d(8, 4, bias=False, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    window = ConvWindow.from_conv_state(jnp.asarray(rng.standard_normal((2, 8, 3)), jnp.float32))
    with pytest.raises(ValueError, match=re.escape(message)):
        conv.step(x, window, backend="interpret")


def test_config_with_an_activation_the_kernel_does_not_compute(rng):
    """backend=None with gelu runs the reference, so a ConvConfig there is refused, naming the activation."""
    with pytest.raises(TypeError, match=re.escape("`config` tunes the conv kernel, which does not compute "
                                                  "`activation` 'gelu'")):
        ops.conv_update(*draw(rng, 2, 8, 4, 1, jnp.float32), "gelu", config=kernels.ConvConfig(block_v=8))
