"""The raw gates of the Gated DeltaNet ops: g = -exp(A_log) softplus(a + dt_bias) and beta = sigmoid(b)
formed by the ops from the layer's projections a, b and its parameters A_log, dt_bias (in the reference,
and inside the kernels: no XLA launch for them in a decode step).

Every op given the raw gates is checked against the same op given g and beta formed in float64 by NumPy,
on the reference, the interpreted kernels and (GPU marker) the compiled kernels at Qwen3.5-4B's layer,
where the append, deferred and direct routes run their Mosaic GPU kernels behind the Triton prelude. Which
of these cases the default run takes (the others `slow`): `input_forms.FORM_CASES`.
"""

from __future__ import annotations

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from cases import assert_close
from input_forms import FORM_CASES, L, cursors, lowered_params, run_both_forms
from kernel_checks import lower_for_cuda
from test_layers import randomize  # the layers' random weights
from replayssm_jax import kernels, ops, reference
from replayssm_jax.kernels import gdn as gdn_kernels
from replayssm_jax.layers import GatedDeltaNet
from replayssm_jax.testing import GDN, GDNShape

f32, bf16 = jnp.float32, jnp.bfloat16
CPU_SHAPE = GDNShape(batch=4, H=2, HV=4, K=20, V=24)
GPU_SHAPE = GDNShape(batch=64, H=16, HV=32, K=128, V=128)  # Qwen3.5-4B's layer; batch 64: the Mosaic GPU routes


def np_gates(a, b, A_log, dt_bias):
    """(g, beta) in float64 (softplus without a threshold)."""
    a, b, A_log, dt_bias = (np.asarray(x, np.float64) for x in (a, b, A_log, dt_bias))
    return -np.exp(A_log) * np.logaddexp(0.0, a + dt_bias), 1.0 / (1.0 + np.exp(-b))


def raw_gates(rng, lead, HV, dtype=bf16):
    """a, b [*lead, HV] N(0, 2^2) in `dtype` (the projections' dtype), A_log f32[HV] in [0, 2.5), dt_bias
    f32[HV] N(0, 1)."""
    return dict(a=jnp.asarray(2 * rng.standard_normal((*lead, HV)), dtype),
                b=jnp.asarray(2 * rng.standard_normal((*lead, HV)), dtype),
                A_log=jnp.asarray(rng.uniform(0.0, 2.5, HV), f32),
                dt_bias=jnp.asarray(rng.standard_normal(HV), f32))


def given_gates(raw):
    """The raw gates' g and beta, formed in float64 and rounded to float32 (the ops' other form)."""
    g, beta = np_gates(**raw)
    return dict(g=jnp.asarray(g, f32), beta=jnp.asarray(beta, f32))


def assert_same(got, want, what):
    """Every array leaf of `got` within the tolerance of its dtype of `want`'s (integer leaves equal): the two
    forms' gates differ in f32 rounding, which may move a bf16 record to the next bf16 value."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves), what
    for i, (x, y) in enumerate(zip(got_leaves, want_leaves)):
        dtype = jnp.asarray(y).dtype
        if jnp.issubdtype(dtype, jnp.integer):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{what}, leaf {i}")
        else:
            assert_close(jnp.asarray(x, f32), jnp.asarray(y, f32), dtype, what=f"{what}, leaf {i}")


def _run(name, layer, rng, backend, route=None, tree=None, config=None):
    """(op with the raw gates, op with g and beta formed from them in float64)."""

    def forms(inp):
        q_k_v = {key: inp[key] for key in ("q", "k", "v")}
        raw = raw_gates(rng, inp["v"].shape[:-2], layer.s.HV)
        return dict(q_k_v, **raw), dict(q_k_v, **given_gates(raw))

    return run_both_forms(layer, name, rng, backend, forms, route, tree, config)


def test_gates_match_float64(rng):
    """`reference.gdn_gates` and the kernels' form (`kernels.gdn.raw_gates`, in XLA) against float64, over
    random values and the extremes: softplus's linear range and its underflow, beta at 0 and 1."""
    raw = raw_gates(rng, (5,), 9, f32)
    extremes = dict(a=jnp.asarray([-90.0, -25.0, 0.0, 19.0, 21.0, 90.0]), b=jnp.asarray([-90.0, -20.0, 0.0, 3.0,
                                                                                          20.0, 90.0]),
                    A_log=jnp.full((6,), 1.5, f32), dt_bias=jnp.full((6,), 0.5, f32))
    for case in (raw, extremes):
        want_g, want_beta = np_gates(**case)
        kernel_form = jax.jit(lambda a, b, A_log, dt_bias: gdn_kernels.raw_gates(a, b, A_log, dt_bias))
        for name, (g, beta) in (("reference", reference.gdn_gates(**case)), ("kernels", kernel_form(**case))):
            assert g.dtype == beta.dtype == f32, name
            np.testing.assert_allclose(np.asarray(g), want_g, rtol=2e-6, atol=1e-30, err_msg=f"{name} g")
            np.testing.assert_allclose(np.asarray(beta), want_beta, rtol=2e-6, atol=1e-30, err_msg=f"{name} beta")
            assert (np.asarray(g) <= 0).all() and np.isfinite(np.asarray(g)).all(), name


@pytest.mark.parametrize("name, route, tree, config, backend", FORM_CASES)
def test_raw_gates_equal_given_gates(name, route, tree, config, backend, rng):
    """Each GDN op given a, b, A_log and dt_bias equals the op given g and beta (float64-formed), outputs and
    states, with bf16 projections and mixed cursors (a full row on all routes but append); compiled at
    Qwen3.5-4B's layer, batch 64, the append, deferred and direct routes run their default Mosaic GPU
    kernels, whose Triton prelude forms the gates."""
    layer = GDN(GPU_SHAPE if backend == "pallas" else CPU_SHAPE, rng)
    got, want = _run(name, layer, rng, backend, route, tree, config)
    assert_same(got, want, f"{name} {route or ''} on {backend}")


@pytest.mark.parametrize("given, match", [
    (dict(g="g"), r"got `g`$"),
    (dict(g="g", beta="beta", a="a"), r"got `g`, `beta`, `a`$"),
    (dict(a="a", b="b", A_log="A_log"), r"got `a`, `b`, `A_log`$"),
    (dict(), r"got none of them$"),
])
def test_one_whole_form_of_the_gates(given, match, rng):
    """Gates of neither form or of both raise TypeError naming what was given, before any kernel."""
    layer = GDN(CPU_SHAPE, rng)
    inp, raw = layer.draw(), raw_gates(rng, (CPU_SHAPE.batch,), CPU_SHAPE.HV)
    values = dict(inp, **raw)
    with pytest.raises(TypeError, match=r"the gates must be given as `g` and `beta`, or the raw `a`, `b`, "
                                        r"`A_log` and `dt_bias` .*" + match):
        ops.gdn_step(layer.state(f32), inp["q"], inp["k"], inp["v"], **{k: values[k] for k in given},
                     backend="interpret")


@pytest.mark.parametrize("arg, bad, match", [
    ("a", lambda x: x[:, :-1], r"`a` must have shape \[batch, HV\] = \(4, 4\); got \(4, 3\)"),
    ("b", lambda x: x.astype(jnp.float16), r"`b` must not be float16"),
    ("A_log", lambda x: x[None], r"`A_log` must have shape \[HV\] = \(4,\); got \(1, 4\)"),
    ("dt_bias", lambda x: x.astype(jnp.int32), r"`dt_bias` must have a floating-point dtype"),
])
def test_raw_gate_errors_name_the_argument(arg, bad, match, rng):
    """A raw gate of the wrong shape or dtype is named, with the expected and the given, before any kernel;
    the replay state given stays usable."""
    layer = GDN(CPU_SHAPE, rng)
    rs = layer.replay_state(L, f32, bf16, cursors("output", CPU_SHAPE.batch))
    inp, raw = layer.draw(), raw_gates(rng, (CPU_SHAPE.batch,), CPU_SHAPE.HV)
    error = TypeError if arg in ("b", "dt_bias") else ValueError
    with pytest.raises(error, match=match):
        ops.gdn_replay_step(rs, inp["q"], inp["k"], inp["v"], **dict(raw, **{arg: bad(raw[arg])}),
                            backend="interpret")
    y, _ = ops.gdn_replay_step(rs, inp["q"], inp["k"], inp["v"], **raw, backend="interpret")
    assert np.isfinite(np.asarray(y)).all()


def _outside_kernels(jaxpr):
    """The equations of a jaxpr and its calls, not those inside a pallas_call's kernel."""
    for eqn in jaxpr.eqns:
        yield eqn
        if eqn.primitive.name != "pallas_call":
            for inner in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from _outside_kernels(inner)


@pytest.mark.parametrize("ssm_state", ["standard", "replay"])
def test_decode_step_forms_no_gate_outside_its_kernels(ssm_state, rng):
    """A GDN layer's decode step on the kernels has no transcendental op on a [batch, HV] operand outside
    the kernels (the gates' exp, softplus and sigmoid run inside them), where its XLA form has them; its
    output and state equal the XLA form's."""
    layer = GatedDeltaNet(32, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8, packed=True)
    layer = randomize(layer, seed=int(rng.integers(1 << 30)), scale=0.3)
    u = jnp.asarray(rng.standard_normal((2, 3, 32)), f32)
    _, state = layer.prefill(u[:, :2])
    route = {}
    if ssm_state == "replay":  # the output route on both backends (route "auto" takes the direct one on kernels)
        state, route = layer.to_replay(state, buffer_len=4), dict(route="output")

    def gate_ops(backend):
        jaxpr = jax.make_jaxpr(lambda s, x: layer.decode(x, s, backend=backend, **route))(state, u[:, 2])
        return [e.primitive.name for e in _outside_kernels(jaxpr.jaxpr)
                if e.primitive.name in ("exp", "log1p", "logistic")
                and any(tuple(v.aval.shape) == (2, 4) for v in e.outvars)]

    assert gate_ops("interpret") == []
    assert "logistic" in gate_ops("xla")  # the check sees the gates where XLA forms them
    y, new = layer.decode(u[:, 2], state, backend="interpret", **route)
    want, want_state = layer.decode(u[:, 2], state, backend="xla", **route)
    assert_close(y, want, f32, what="decode output")
    assert_same(new.ssm_state if ssm_state == "standard" else new.replay,
                want_state.ssm_state if ssm_state == "standard" else want_state.replay, "decode state")


def test_kernel_ops_take_the_gates_as_the_ops(rng):
    """The kernel entry points (replayssm_jax.kernels) take the raw gates by the ops' names."""
    layer = GDN(CPU_SHAPE, rng)
    state, inp = layer.state(f32), layer.draw()
    raw = raw_gates(rng, (CPU_SHAPE.batch,), CPU_SHAPE.HV)
    kw = dict(scale=CPU_SHAPE.K ** -0.5, use_qk_l2norm=True, interpret=True)
    got = kernels.gdn_step(state, inp["q"], inp["k"], inp["v"], **raw, **kw)
    want = kernels.gdn_step(state, inp["q"], inp["k"], inp["v"], **given_gates(raw), **kw)
    assert_same(got, want, "kernels.gdn_step")


LOWERED = [("step", None, None), ("verify", None, None)] + [
    ("replay_step", route, None) for route in ("output", "state", "direct", "append", "deferred")] + [
    ("replay_step", route, kernels.TMAReadoutConfig()) for route in ("append", "deferred", "direct")] + [
    ("replay_verify", None, None), ("step", None, kernels.TMAReadoutConfig())]


@pytest.mark.parametrize("name, route, config", lowered_params(LOWERED))
def test_raw_gate_kernels_lower_for_cuda(name, route, config, rng):
    """Each kernel op with the raw gates lowers for CUDA (the whole Pallas -> Triton lowering of the gates'
    exp, softplus and sigmoid; with a TMAReadoutConfig the Triton prelude before the Mosaic GPU kernel), at
    Qwen3.5-4B's layer, batch 64, bf16 records: kernels only, no gate formed in XLA."""
    layer, s = GDN(GPU_SHAPE, rng), GPU_SHAPE
    W = 4 if "verify" in name else None
    lead = (s.batch,) if W is None else (s.batch, W)
    inp, raw = layer.draw(*lead[1:]), raw_gates(rng, lead, s.HV)
    args = (inp["q"], inp["k"], inp["v"])
    kw = dict(raw, scale=s.K ** -0.5, use_qk_l2norm=True, config=config)
    if name == "step":
        text = lower_for_cuda(lambda st, *a: kernels.gdn_step(st, *a, **kw), layer.state(f32), *args)
    elif name == "verify":
        state = jnp.zeros((s.batch, W + 1, s.HV, s.V, s.K), f32)
        text = lower_for_cuda(lambda st, i, *a: kernels.gdn_verify(st, i, *a, **kw), state,
                              jnp.zeros((s.batch,), jnp.int32), *args)
    else:
        rs = layer.replay_state(16, f32, bf16, np.zeros(s.batch, np.int32))
        op = kernels.gdn_replay_step if name == "replay_step" else kernels.gdn_replay_verify
        extra = dict(route=route) if name == "replay_step" else {}
        text = lower_for_cuda(lambda r, *a: op(r, *a, **kw, **extra), rs, *args)
    targets = set(re.findall(r"stablehlo\.custom_call @([\w$.]+)", text))
    assert targets == ({"__gpu$xla.gpu.triton", "mosaic_gpu_v2"} if config else {"__gpu$xla.gpu.triton"}), targets
    assert not re.search(r"stablehlo\.(logistic|log_plus_one|exponential)\b", text)  # no gate formed by XLA
