"""The GDN standard step with its conv fused (`ops.gdn_conv_step`, one launch): against the references (the
conv's and the step's), against the two launches it replaces, interpreted on the CPU at small shapes and
compiled on a GPU at Qwen3.5-4B's (`-m gpu`); its Triton lowering, its argument checks, and
`GatedDeltaNet.decode`, which takes it where `kernels.fuse_conv_default` says.

Inputs are drawn fresh per test (never zeros), the ring's start at random slots. The ring must equal the
reference's bit for bit (a copy of x); o and the state within the tolerance of the coarsest of the
activation and state dtypes (`testing.TOLERANCES`).
"""

from __future__ import annotations

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hlo_checks import work_besides_kernels
from kernel_checks import lower_for_cuda
from replayssm_jax import kernels, ops
from replayssm_jax.kernels import config as kernel_config
from models import load_model
from models.common import make_decode_step, make_prefill, split_params
from replayssm_jax.layers.gdn import GatedDeltaNet
from replayssm_jax.testing import assert_close, tolerance_dtype

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

f32, bf16 = jnp.float32, jnp.bfloat16


def draw(rng, batch, H, HV, K, V, W, max_window, x_dtype, state_dtype, gates="raw"):
    """(state, x, columns, start, weight, keywords: the gates and num_k_heads), random."""
    C, S = 2 * H * K + HV * V, W - 1 + max_window

    def normal(shape, dtype, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype)

    if gates == "raw":
        gate_kw = dict(num_k_heads=H, a=normal((batch, HV), x_dtype), b=normal((batch, HV), x_dtype),
                       A_log=jnp.asarray(np.log(rng.uniform(1.0, 16.0, HV)), f32), dt_bias=normal((HV,), f32))
    else:
        gate_kw = dict(num_k_heads=H, g=jnp.asarray(-rng.uniform(0.01, 2.0, (batch, HV)), f32),
                       beta=jnp.asarray(rng.uniform(0.05, 0.95, (batch, HV)), x_dtype))
    return (normal((batch, HV, V, K), state_dtype, 0.3), normal((batch, C), x_dtype), normal((batch, S, C), x_dtype),
            jnp.asarray(rng.integers(0, S, batch), jnp.int32), normal((C, W), f32, 0.5), gate_kw)


def assert_matches_reference(args, backend, config=None):
    state, x, columns, start, weight, gate_kw = args
    o, new_state, new_columns = ops.gdn_conv_step(state, x, columns, start, weight, **gate_kw, backend=backend,
                                                  config=config)
    want_o, want_state, want_columns = ops.gdn_conv_step(state, x, columns, start, weight, **gate_kw, backend="xla")
    np.testing.assert_array_equal(np.asarray(new_columns, f32), np.asarray(want_columns, f32))
    tol = tolerance_dtype(x.dtype, state.dtype)
    assert_close(o, want_o, tol, "o")
    assert_close(new_state, want_state, tol, "state")


CPU_CASES = [  # (batch, H, HV, K, V, W, max_window, x dtype, state dtype, gates, block_v)
    (3, 2, 4, 32, 32, 4, 1, f32, f32, "raw", 16),
    (2, 2, 4, 32, 32, 4, 3, bf16, bf16, "raw", 8),  # a verify-sized ring: S = 6
    (2, 1, 2, 64, 32, 3, 1, bf16, f32, "gates", 16),  # W = 3 (taps padded to 4), g and beta given
    (1, 2, 2, 16, 16, 2, 2, f32, bf16, "raw", 16),  # one key head per value head
    # the live ring slots loaded at the start (`conv_channels`' other form): a ring of 9 slots, more than
    # WHOLE_RING_SLOTS; a grid of batch x HV = 144 rows of heads, more than the SMs (DEFAULT_NUM_SMS on a CPU)
    (2, 2, 4, 16, 16, 4, 6, bf16, f32, "raw", 8),
    (3, 12, 48, 8, 8, 4, 1, bf16, f32, "raw", 8),
]


@pytest.mark.parametrize("case", CPU_CASES,
                         ids=lambda c: f"b{c[0]}-H{c[1]}-HV{c[2]}-K{c[3]}-W{c[5]}-S{c[5] - 1 + c[6]}")
def test_kernel_matches_reference(case, rng):
    *shape, gates, block = case
    assert_matches_reference(draw(rng, *shape, gates), "interpret", kernels.StepConfig(block_v=block, num_warps=1))


@st.composite
def shapes(draw_from):
    """(batch, H, HV, K, V, W, max_window, x dtype, state dtype, gates, block_v): small shapes, K and V powers
    of two, block_v a power of two dividing V and 2 H K."""
    H, group = draw_from(st.integers(1, 3)), draw_from(st.sampled_from([1, 2, 4]))
    K, V = (draw_from(st.sampled_from([8, 16, 32])) for _ in range(2))
    rows = [r for r in (2, 4, 8, 16) if V % r == 0 and (2 * H * K) % r == 0]
    batch, W, max_window = draw_from(st.integers(1, 3)), draw_from(st.integers(2, 4)), draw_from(st.integers(1, 3))
    return (batch, H, H * group, K, V, W, max_window,
            draw_from(st.sampled_from([f32, bf16])), draw_from(st.sampled_from([f32, bf16])),
            draw_from(st.sampled_from(["raw", "gates"])), draw_from(st.sampled_from(rows)))


@pytest.mark.slow  # breadth: CPU_CASES cover each path
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=shapes())
def test_kernel_matches_reference_on_drawn_shapes(case, rng):
    *shape, gates, block = case
    assert_matches_reference(draw(rng, *shape, gates), "interpret", kernels.StepConfig(block_v=block, num_warps=1))


@pytest.mark.parametrize("state_dtype", [f32, bf16])
def test_kernel_equals_the_two_launches(state_dtype, rng):
    """The fused launch computes what `conv_update` then `gdn_step` compute, bit for bit (interpreted): the
    same f32 arithmetic, y rounded to x's dtype before the step reads it."""
    batch, H, HV, K, V = 3, 2, 4, 32, 32
    state, x, columns, start, weight, gate_kw = draw(rng, batch, H, HV, K, V, 4, 1, bf16, state_dtype)
    config = kernels.StepConfig(block_v=16, num_warps=1)
    o, new_state, new_columns = ops.gdn_conv_step(state, x, columns, start, weight, **gate_kw, backend="interpret",
                                                  config=config)
    (q, k, v), want_columns = ops.conv_update(x, columns, start, weight, splits=(H * K, 2 * H * K),
                                              backend="interpret")
    del gate_kw["num_k_heads"]
    want_o, want_state = ops.gdn_step(state, q.reshape(batch, H, K), k.reshape(batch, H, K), v.reshape(batch, HV, V),
                                      **gate_kw, backend="interpret", config=config)
    for got, want in ((o, want_o), (new_state, want_state), (new_columns, want_columns)):
        np.testing.assert_array_equal(np.asarray(got, f32), np.asarray(want, f32))


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("state_dtype", [f32, bf16])
def test_compiled_kernel_matches_reference(batch, state_dtype, rng):
    """Compiled at Qwen3.5-4B's layer (H = 16, HV = 32, K = V = 128, C = 8192, W = 4), the default tiling."""
    assert_matches_reference(draw(rng, batch, 16, 32, 128, 128, 4, 1, bf16, state_dtype), "pallas")


@pytest.mark.gpu
def test_compiled_step_is_one_launch_in_place(rng):
    """Jitted with the state and ring donated: the one kernel, nothing else (no copy of either)."""
    state, x, columns, start, weight, gate_kw = draw(rng, 64, 16, 32, 128, 128, 4, 1, bf16, f32)

    def step(state, columns, x, start):
        return ops.gdn_conv_step(state, x, columns, start, weight, **gate_kw, backend="pallas")

    text = jax.jit(step, donate_argnums=(0, 1)).lower(state, columns, x, start).compile().as_text()
    assert not work_besides_kernels(text), work_besides_kernels(text)
    assert len(re.findall(r"custom-call\(", text)) == 1, text[:3000]


def test_kernel_lowers_for_cuda(rng):
    """The Triton lowering on the CPU at Qwen3.5-4B's layer: one launch, the state (operand 0 -> output 1)
    and the ring (operand 8, after the state, the three views of x, a, b, A_log, dt_bias -> output 2) in place."""
    state, x, columns, start, weight, gate_kw = draw(rng, 8, 16, 32, 128, 128, 4, 1, bf16, f32)
    del gate_kw["num_k_heads"]  # the kernel's arguments are validated: H follows from C
    text = lower_for_cuda(lambda *a: kernels.gdn_conv_step(*a, **gate_kw, scale=128 ** -0.5, use_qk_l2norm=True),
                          state, x, columns, start, weight)
    calls = [line for line in text.splitlines() if "custom_call" in line and "triton" in line]
    assert len(calls) == 1 and "gdn_step_conv_bv16_w1" in calls[0], calls
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", calls[0])
    assert sorted(aliases) == [("1", "0"), ("2", "8")], calls[0][:2000]


@pytest.mark.parametrize("change, error, message", [
    (dict(x=np.ones((2, 80), np.float32), columns=np.ones((2, 4, 80), np.float32), weight=np.ones((80, 4), np.float32)),
     ValueError, "`x` must have C = 2 H K + HV V = 64 columns (H = 2 `num_k_heads`, HV = 4, V = 8, K = 8 from "
     "`state` [batch, HV, V, K]); got 80"),
    (dict(num_k_heads=3), ValueError, "HV (axis 1 of `state`) = 4 must be divisible by `num_k_heads` = 3"),
    (dict(num_k_heads=0), ValueError, "`num_k_heads` must be >= 1; got 0"),
    (dict(num_k_heads=2.0), TypeError, "`num_k_heads` must be an int; got float"),
    (dict(x=np.ones((3, 64), np.float32)), ValueError,
     "`columns` must have shape [batch, S, C] = (3, 4, 64) (batch of `x`); got (2, 4, 64)"),
    (dict(x=np.ones((2, 80), np.float32)), ValueError,
     "`x` must have C = 64 columns (axis 2 of `columns`: the conv's channels); got 80"),
    (dict(columns=np.ones((3, 4, 64), np.float32)), ValueError, "`columns` must have shape [batch, S, C]"),
    (dict(state=np.ones((3, 4, 8, 8), np.float32)), ValueError, "`state` must have shape [batch, HV, V, K]"),
    (dict(weight=np.ones((96, 4), np.float32)), ValueError, "`weight` must have shape [C, W] with C = 64"),
    (dict(start=np.array([0, 4])), ValueError, "`start` must be in [0, 3] for every row; got [0, 4]"),
    (dict(activation="tanh"), ValueError, "`activation` must be one of"),
    (dict(activation="gelu", backend="interpret"), ValueError, "`activation` 'gelu': the conv kernel computes"),
    (dict(config=kernels.StepConfig(block_v=8), backend="xla"), TypeError, "`config` tunes the Pallas kernels"),
    (dict(config=kernels.ReplayConfig(block_v=8), backend="interpret"), TypeError,
     "`config` must be a StepConfig for the fused conv step; got ReplayConfig"),
    (dict(a=None), TypeError, "gates"),
    (dict(state=np.ones((2, 4, 8, 6), np.float32), x=np.ones((2, 56), np.float32),
          columns=np.ones((2, 4, 56), np.float32), weight=np.ones((56, 4), np.float32), backend="interpret"),
     ValueError, "gdn_conv_step: the key dim K = 6 (axis 3 of `state`) is not a power of two, which the fused "
     "launch needs (backend='xla' takes any)"),
    (dict(state=np.ones((2, 4, 8, 2), np.float32), config=kernels.StepConfig(block_v=8), x=np.ones((2, 36), np.float32),
          columns=np.ones((2, 4, 36), np.float32), weight=np.ones((36, 4), np.float32), num_k_heads=1,
          backend="interpret"), ValueError,
     "`config.block_v` = 8 must divide V = 8 and 2 H K = 4, the tile's rows lying in one piece of the conv's "
     "channels (e.g. 4)"),
    (dict(config=kernels.StepConfig(block_v=16), backend="interpret"), ValueError,
     "`config.block_v` must be <= 8 (the state's value dim V = 8 rows, rounded up to a power of two); got 16"),
])
def test_bad_arguments_raise_before_any_work(change, error, message, rng):
    """H = 2, HV = 4, K = V = 8 (C = 64), W = 4, S = 4, batch 2; the caller's arrays are untouched."""
    state, x, columns, start, weight, gate_kw = draw(rng, 2, 2, 4, 8, 8, 4, 1, f32, f32)
    args = dict(state=state, x=x, columns=columns, start=start, weight=weight, **gate_kw)
    kept = {k: np.array(v) for k, v in args.items()}
    args.update(change)
    with pytest.raises(error, match=re.escape(message)):
        ops.gdn_conv_step(**{k: v for k, v in args.items() if v is not None})
    for name, value in kept.items():
        np.testing.assert_array_equal(np.asarray(dict(state=state, x=x, columns=columns, start=start, weight=weight,
                                                      **gate_kw)[name]), value)


def test_a_state_in_transformers_layout_is_named(rng):
    """H = 1, HV = 4, K = 8, V = 16: with the state's last two axes swapped, x's 2 H K + HV V = 80 columns read
    as 2 H V + HV K; the error says so (where HV = 2 H both read the same: the layouts cannot be told apart)."""
    state, x, columns, start, weight, kw = draw(rng, 2, 1, 4, 8, 16, 4, 1, f32, f32)
    with pytest.raises(ValueError, match=re.escape("got 80 (K and V swapped: a state in transformers' [batch, HV, "
                                                   "K, V] layout; transpose its last two axes)")):
        ops.gdn_conv_step(jnp.swapaxes(state, 2, 3), x, columns, start, weight, **kw, backend="xla")


def test_default_tiling_divides_the_pieces():
    """H = HV = 1, K = 8, V = 256 at batch 256: the standard step's default tile (32 rows) does not divide
    2 H K = 16; the fused step's default halves it to 16 (`kernels.conv_step_config`), so the op and the layer
    take the shape; an explicit 32 is refused."""
    state, C = jax.ShapeDtypeStruct((256, 1, 256, 8), f32), 2 * 8 + 256
    assert kernels.default_step_config(256, 1, 256, 8, f32, layer="gdn").block_v == 32
    assert kernels.conv_step_config(state, C).block_v == 16
    assert kernels.conv_step_fits(state, C) is None
    assert "(e.g. 16)" in kernels.conv_step_fits(state, C, kernels.StepConfig(block_v=32))


def test_reference_takes_shapes_the_kernel_does_not(rng):
    """K = 6 (not a power of two): the "xla" backend runs the two references; the kernel backends raise."""
    state, x, columns, start, weight, gate_kw = draw(rng, 2, 2, 4, 6, 8, 4, 1, f32, f32)
    o, new_state, _ = ops.gdn_conv_step(state, x, columns, start, weight, **gate_kw, backend="xla")
    assert o.shape == (2, 4, 8) and new_state.shape == state.shape and bool(jnp.all(jnp.isfinite(o)))


def _layer(rng):
    layer = GatedDeltaNet(32, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=16, packed=False,
                          rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    layer.A_log[...] = jnp.asarray(np.log(rng.uniform(1.0, 16.0, 4)), f32)
    layer.dt_bias[...] = jnp.asarray(rng.standard_normal(4), f32)
    return layer


@pytest.mark.parametrize("state_dtype", [f32, bf16])
def test_layer_decode_takes_the_fused_step(state_dtype, rng, monkeypatch):
    """`GatedDeltaNet.decode` on a standard state (f32 activations): with the fused step taken
    (`fuse_conv_default`) the outputs and states of the conv and the step as two kernels, within the
    tolerance of the state's dtype (interpreted, XLA on the CPU may contract the conv's products and sums
    differently in the two kernels), over 3 steps from a prefill, the rings equal; the fused op called once
    a step, and not at all where the default declines."""
    layer = _layer(rng)
    layer.ssm_state_dtype = state_dtype
    u = jnp.asarray(rng.standard_normal((2, 5, 32)), f32)
    _, state0 = layer.prefill(u[:, :2], backend="xla")
    calls = []
    fused_op = ops.gdn_conv_step
    monkeypatch.setattr(ops, "gdn_conv_step", lambda *a, **k: calls.append(1) or fused_op(*a, **k))
    runs = {}
    for fuse in (True, False):
        monkeypatch.setattr(kernel_config, "FUSED_CONV_MAX_BATCH", {4: 2 if fuse else 0, 2: 2 if fuse else 0})
        state, outs = state0, []
        for t in range(2, 5):
            out, state = layer.decode(u[:, t], state, backend="interpret")
            outs.append(out)
        runs[fuse] = (outs, state)
        assert len(calls) == (3 if fuse else 0)
        calls.clear()
    (outs, fused), (want_outs, unfused) = runs[True], runs[False]
    tol = tolerance_dtype(f32, state_dtype)
    for t, (got, want) in enumerate(zip(outs, want_outs)):
        assert_close(got, want, tol, f"out {t}")
    assert_close(fused.ssm_state, unfused.ssm_state, tol, "ssm_state")
    np.testing.assert_array_equal(np.asarray(fused.conv_state.columns), np.asarray(unfused.conv_state.columns))
    np.testing.assert_array_equal(np.asarray(fused.conv_state.start),
                                  np.asarray(state0.conv_state.start + 3) % state0.conv_state.slots)


def test_fuse_conv_default_follows_the_batches_per_itemsize(monkeypatch):
    monkeypatch.setattr(kernel_config, "FUSED_CONV_MAX_BATCH", {4: 64, 2: 8})
    assert kernels.fuse_conv_default(64, f32) and not kernels.fuse_conv_default(65, f32)
    assert kernels.fuse_conv_default(8, bf16) and not kernels.fuse_conv_default(9, bf16)
    assert not kernels.fuse_conv_default(1, jnp.int8)
    monkeypatch.setattr(kernel_config, "FUSED_CONV_MAX_BATCH", {})
    assert not kernels.fuse_conv_default(1, f32)


def test_model_decode_with_the_fused_step_matches_transformers(monkeypatch):
    """The Qwen3.5 fixture (tests/data/qwen3_5_tiny: its GDN layers H = 2, HV = 4, K = V = 16), prefilled on
    "xla" and decoded 4 greedy steps on "interpret" with every GDN layer's conv fused into its step: the
    logits within the model tests' 1e-4 of transformers' and the same tokens."""
    monkeypatch.setattr(kernel_config, "FUSED_CONV_MAX_BATCH", {4: 1 << 30, 2: 1 << 30})
    folder = os.path.join(os.path.dirname(__file__), "data", "qwen3_5_tiny")
    model, ref = load_model(folder), dict(np.load(os.path.join(folder, "reference.npz")))
    calls = []
    fused_op = ops.gdn_conv_step
    monkeypatch.setattr(ops, "gdn_conv_step", lambda *a, **k: calls.append(1) or fused_op(*a, **k))
    graphdef, params = split_params(model)
    T = ref["prompt_ids"].shape[1]
    logits, cache = make_prefill(graphdef, max_len=T + 4, last_logits_only=True)(params, jnp.asarray(ref["prompt_ids"]))
    step = make_decode_step(graphdef, backend="interpret")
    for j in range(4):
        assert float(np.max(np.abs(np.asarray(logits, np.float64) - ref["step_logits"][j]))) < 1e-4, j
        np.testing.assert_array_equal(np.asarray(jnp.argmax(logits, axis=-1)), ref["generated_ids"][:, T + j])
        logits, cache = step(params, cache, jnp.asarray(ref["generated_ids"][:, T + j]))
    assert calls, "no GDN layer took the fused step"
