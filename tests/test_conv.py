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
from kernel_checks import jaxpr_equations, lower_for_cuda
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
    (dict(weight=np.ones((7, 4), np.float32)), ValueError, "`weight` must have shape [C, W] with C = 8 (axis 2 of `columns`)"),
    (dict(columns=np.ones((2, 3, 8), np.float32)), ValueError, "`columns` must hold at least W = 4 slots"),
    (dict(columns=np.ones((3, 5, 8), np.float32)), ValueError, "`columns` must have shape [batch, S, C] = (2, 5, 8)"),
    (dict(start=np.array([0, 5])), ValueError, "`start` must be in [0, 4] for every row; got [0, 5]"),
    (dict(bias=np.ones((9,), np.float32)), ValueError, "`bias` must have shape [C] = (8,); got (9,)"),
    (dict(activation="tanh"), ValueError, "`activation` must be one of"),
    (dict(activation="gelu", backend="interpret"), ValueError, "`activation` 'gelu': the conv kernel computes"),
    (dict(config=kernels.ConvConfig(block_v=8), backend="xla"), TypeError, "`config` tunes the Pallas kernels"),
    (dict(x=np.ones((2, 9), np.float32)), ValueError, "`x` must have C = 8 columns (the conv's channels); got 9"),
    (dict(offset=-1), ValueError, "`offset` must be in [0, X - C] = [0, 0]"),
    (dict(offset=1), ValueError, "`offset` must be in [0, X - C] = [0, 0] (X = 8 columns of `x`, C = 8"),
    (dict(offset=2.0), TypeError, "`offset` must be an int; got float 2.0"),
    (dict(splits=(4, 2)), ValueError, "`splits` must be increasing channel indices in (0, C = 8); got (4, 2)"),
    (dict(splits=(0, 4)), ValueError, "`splits` must be increasing channel indices in (0, C = 8); got (0, 4)"),
    (dict(splits=(8,)), ValueError, "`splits` must be increasing channel indices in (0, C = 8); got (8,)"),
    (dict(splits=4), TypeError, "`splits` must be a list, tuple or 1-D NumPy array of ints; got int"),
    (dict(splits={2, 4}), TypeError, "`splits` must be a list, tuple or 1-D NumPy array of ints; got set"),
    (dict(splits=(2.5,)), TypeError, "each of `splits` must be an int; got float 2.5"),
    (dict(splits=[jnp.int32(2)]), TypeError, "each of `splits` must be an int; got ArrayImpl"),
    (dict(x=np.ones((2, 6), np.float32), offset=0), ValueError,
     "`x` must have at least C = 8 columns (the conv's channels) to read them at `offset`; got 6"),
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
    (np.ones((2, 1, 8), np.float32), "`x` must be an array of shape [batch, 8] (or [batch, X] with `offset`); "
                                     "got (2, 1, 8)"),
    (np.ones((8,), np.float32), "`x` must be an array of shape [batch, 8] (or [batch, X] with `offset`); got (8,)"),
    ([[1.0] * 8], "`x` must be an array of shape [batch, 8] (or [batch, X] with `offset`); got list"),
    (np.ones((2, 9), np.float32), "CausalConv1d.step: `x` must have C = 8 columns (the conv's channels); got 9"),
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


# ---------------------------------------------------------------------------
# Packed operands: x read at a column offset of a wider array, y written in pieces

PACKED_CASES = [  # (batch, X, offset, C, splits, dtype, bias, block of channels)
    (2, 132, 32, 96, (32, 64), jnp.float32, True, 32),  # Mamba-2's zxbcdt: xBC at d_inner, cut into x, B, C
    (3, 100, 0, 100, (32, 64), jnp.bfloat16, False, 32),  # GDN's q, k, v; v's last block past C
    (2, 150, 20, 96, (40,), jnp.float32, True, 32),  # boundaries off the block: XLA cuts around the launch
]
PACKED_IDS = ["mamba2-layout", "gdn-layout", "off-the-block"]


def draw_packed(rng, case):
    """(x [batch, X], the ring's arguments of C channels, offset, splits, config) of a packed case."""
    batch, X, offset, C, splits, dtype, bias, block = case
    x = jnp.asarray(rng.standard_normal((batch, X)), dtype)
    return x, draw(rng, batch, C, 4, 2, dtype, jnp.float32, bias)[1:], offset, splits, kernels.ConvConfig(
        block_v=block, num_warps=2)


@pytest.mark.parametrize("case", PACKED_CASES, ids=PACKED_IDS)
def test_packed_kernel_matches_reference(case, rng):
    """The kernel reading x at its offset and writing y's pieces equals the reference on x's C columns."""
    x, ring, offset, splits, config = draw_packed(rng, case)
    C = ring[0].shape[2]
    pieces, columns = ops.conv_update(x, *ring, offset=offset, splits=splits, backend="interpret", config=config)
    want_y, want_columns = ops.conv_update(x[:, offset:offset + C], *ring, backend="xla")
    assert [p.shape for p in pieces] == [w.shape for w in jnp.split(want_y, splits, axis=1)]
    np.testing.assert_array_equal(np.asarray(columns, np.float32), np.asarray(want_columns, np.float32))
    tol = TOLERANCE[x.dtype.type]
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, axis=1), np.float32),
                               np.asarray(want_y, np.float32), rtol=tol, atol=tol)
    xla_pieces, _ = ops.conv_update(x, *ring, offset=offset, splits=splits, backend="xla")
    for got, want in zip(pieces, xla_pieces):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ["xla", "interpret"])
def test_layer_step_on_packed_operands(backend, rng):
    """CausalConv1d.step on a packed x (its inputs at offset 8 of 64 columns), splits given as a NumPy array:
    the pieces of the step's y, equal to the step on x's 40 columns cut there; a one-shot iterator of splits
    is refused (its entries would be read twice)."""
    conv = CausalConv1d(40, 4, bias=True, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    window = ConvWindow.from_conv_state(jnp.asarray(rng.standard_normal((2, 40, 3)), jnp.float32), max_window=2)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    pieces, packed_window = conv.step(x, window, offset=8, splits=np.array([16, 32]), backend=backend)
    y, want_window = conv.step(x[:, 8:48], window, backend=backend)
    assert [p.shape for p in pieces] == [(2, 16), (2, 16), (2, 8)]
    np.testing.assert_array_equal(np.asarray(jnp.concatenate(pieces, axis=1)), np.asarray(y))
    np.testing.assert_array_equal(np.asarray(packed_window.columns), np.asarray(want_window.columns))
    with pytest.raises(TypeError, match=re.escape("CausalConv1d.step: `splits` must be a list, tuple or 1-D NumPy "
                                                 "array of ints; got list_iterator")):
        conv.step(x, window, offset=8, splits=iter([16, 32]), backend=backend)


@pytest.mark.parametrize("case", PACKED_CASES, ids=PACKED_IDS)
def test_packed_kernel_cuts_nothing_in_xla(case, rng):
    """Where the block divides the offset and the split points, the launch takes the packed x itself and
    returns the pieces: no slice before or after it; off the block, XLA slices x and cuts y."""
    x, ring, offset, splits, config = draw_packed(rng, case)
    jaxpr = jax.make_jaxpr(lambda x, *ring: ops.conv_update(x, *ring, offset=offset, splits=splits,
                                                            backend="interpret", config=config))(x, *ring)
    equations = list(jaxpr_equations(jaxpr.jaxpr))
    (launch,) = [e for e in equations if e.primitive.name == "pallas_call"]
    cuts = [e for e in equations if e.primitive.name in ("slice", "split")]
    on_block = all(b % config.block_v == 0 for b in (offset, *splits))
    assert launch.invars[0].aval.shape == (x.shape if on_block else (x.shape[0], ring[0].shape[2]))
    assert len(launch.outvars) == (len(splits) + 2 if on_block else 2)
    assert bool(cuts) != on_block, cuts


def test_packed_kernel_lowers_for_cuda(rng):
    """Nemotron-3-Nano-4B's layout lowered for CUDA on the CPU: one launch that reads xBC at column 7680 of
    in_proj's output and writes x, B and C apart; the ring (operand 1) aliased to output 3."""
    batch, d_inner, gn, heads = 8, 7680, 1024, 96
    C = d_inner + 2 * gn
    x = jnp.asarray(rng.standard_normal((batch, d_inner + C + heads)), jnp.bfloat16)
    ring = draw(rng, batch, C, 4, 1, jnp.bfloat16, jnp.bfloat16, True)[1:]
    text = lower_for_cuda(lambda x, *a: kernels.conv_update(x, *a, offset=d_inner, splits=(d_inner, d_inner + gn)),
                          x, *ring)
    calls = [line for line in text.splitlines() if "custom_call" in line and "triton" in line]
    assert len(calls) == 1 and "conv_update_w4_bc512_w4_s1_p7680_1024_1024" in calls[0], calls
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", calls[0])
    assert aliases == [("3", "1")], calls[0][:2000]
    assert "stablehlo.slice" not in text


@pytest.mark.parametrize("C, boundaries, block", [
    (9728, (7680, 7680, 8704), 512),  # Nemotron-3-Nano-4B: xBC at d_inner = 7680, cut at 7680 and 8704
    (8192, (0, 2048, 4096), 512),  # Qwen3.5-4B: q, k, v
    (5376, (5120, 5120, 5248), 128),  # Mamba-2 2.7B: d_inner 5120, G N = 128
    (96, (32, 32, 64), 32),  # the tiny checkpoints
    (9728, (7680, 7690), 512),  # no block of 32 or more divides 7690: the widest, XLA cuts the pieces
])
def test_default_config_fits_the_pieces(C, boundaries, block):
    assert kernels.default_conv_config(C, boundaries).block_v == block


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 256])
def test_compiled_packed_kernel_matches_reference(batch, rng):
    """Compiled at Nemotron-3-Nano-4B's layout (xBC at column 7680 of in_proj's 17504, cut into x, B, C)."""
    d_inner, gn = 7680, 1024
    case = (batch, d_inner + d_inner + 2 * gn + 96, d_inner, d_inner + 2 * gn, (d_inner, d_inner + gn),
            jnp.bfloat16, True, 512)
    x, ring, offset, splits, _ = draw_packed(rng, case)
    pieces, columns = ops.conv_update(x, *ring, offset=offset, splits=splits, backend="pallas")
    want, want_columns = ops.conv_update(x, *ring, offset=offset, splits=splits, backend="xla")
    np.testing.assert_array_equal(np.asarray(columns, np.float32), np.asarray(want_columns, np.float32))
    for got, ref in zip(pieces, want, strict=True):
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=8e-3, atol=8e-3)


@pytest.mark.gpu
def test_compiled_packed_step_is_the_kernel_in_place(rng):
    """`CausalConv1d.step` on a packed projection (Nemotron-3-Nano-4B's layout), jitted with the window
    donated: the kernel and the start's advance, no slice of x or of y and no copy of the ring."""
    batch, d_inner, gn = 64, 7680, 1024
    C = d_inner + 2 * gn
    conv = CausalConv1d(C, 4, bias=True, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    conv.bias.value = jnp.asarray(rng.standard_normal(C), jnp.float32)  # not zeros: XLA would launch a broadcast
    window = ConvWindow.from_conv_state(jnp.asarray(rng.standard_normal((batch, C, 3)), jnp.bfloat16))
    x = jnp.asarray(rng.standard_normal((batch, d_inner + C + 96)), jnp.bfloat16)
    step = jax.jit(lambda w, x: conv.step(x, w, backend="pallas", offset=d_inner, splits=(d_inner, d_inner + gn))[::-1],
                   donate_argnums=0)
    found = [line for line in work_besides_kernels(step.lower(window, x).compile().as_text())
             if f"= s32[{batch}]" not in line]
    assert not found, found

