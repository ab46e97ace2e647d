"""Unit tests of replayssm_jax.layers: norms, conv, attention, MLP / MoE, Mamba-2 mixer, Gated DeltaNet.

Each layer is checked against a small, literal NumPy formula of the Hugging Face
module it mirrors, and each stateful layer for continuity: a prefill of t tokens
followed by decode steps (standard and ReplaySSM) equals the prefill of all tokens.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernel_checks import jaxpr_equations
from replayssm_jax.layers import (
    MLP,
    Attention,
    CausalConv1d,
    ConvWindow,
    GatedDeltaNet,
    GatedRMSNorm,
    KVCache,
    Mamba2Mixer,
    MoE,
    ReplayLayerState,
    RMSNorm,
    SSMLayerState,
)
from replayssm_jax import ops
from replayssm_jax.state import GDNReplayState, Mamba2ReplayState

TOL = 2e-5


def rand(key, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def randomize(module, seed=0, scale=0.3):
    """Replace every parameter with N(0, scale) noise (norm weights around their init)."""
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [leaf + scale * jax.random.normal(k, leaf.shape, leaf.dtype) for leaf, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def assert_close(a, b, tol=TOL, what=""):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    err = np.max(np.abs(a - b))
    rel = err / max(np.max(np.abs(b)), 1e-30)
    assert err < tol, f"{what}: max abs err {err:.3g} (rel {rel:.3g}) > {tol}"


def np_rms(x, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def np_silu(x):
    return x / (1 + np.exp(-x))


# ------------------------------------------------------------------------------------------------
# norms


def test_rms_norms():
    x = np.asarray(rand(0, (3, 5, 12)))
    n = randomize(RMSNorm(12, eps=1e-5))
    assert_close(n(jnp.asarray(x)), np.asarray(n.weight[...]) * np_rms(x, 1e-5), what="plain")
    z = randomize(RMSNorm(12, eps=1e-6, zero_centered=True))
    assert_close(z(jnp.asarray(x)), (1 + np.asarray(z.weight[...])) * np_rms(x, 1e-6), what="zero-centered")
    assert RMSNorm(4, eps=1e-6, zero_centered=True).weight[...].sum() == 0


def test_gated_rms_norms():
    x, g = np.asarray(rand(1, (2, 3, 12))), np.asarray(rand(2, (2, 3, 12)))
    grouped = randomize(GatedRMSNorm(12, group_size=4, eps=1e-5, norm_before_gate=False))
    w = np.asarray(grouped.weight[...])
    want = (np_rms((x * np_silu(g)).reshape(2, 3, 3, 4), 1e-5)).reshape(2, 3, 12) * w
    assert_close(grouped(jnp.asarray(x), jnp.asarray(g)), want, what="gate-then-norm per group")
    after = randomize(GatedRMSNorm(12, group_size=12, eps=1e-6, norm_before_gate=True))
    want = np.asarray(after.weight[...]) * np_rms(x, 1e-6) * np_silu(g)
    assert_close(after(jnp.asarray(x), jnp.asarray(g)), want, what="norm-then-gate")
    with pytest.raises(ValueError, match="group_size"):
        GatedRMSNorm(12, group_size=5, eps=1e-6, norm_before_gate=False)
    with pytest.raises(ValueError, match="same shape"):
        after(jnp.asarray(x), jnp.asarray(g[..., :6]))


# ------------------------------------------------------------------------------------------------
# conv


@pytest.mark.parametrize("seqlen", [1, 2, 7])
def test_causal_conv1d_prefill_and_step(seqlen):
    conv = randomize(CausalConv1d(6, 4, bias=True))
    x = rand(3, (2, seqlen, 6))
    y, state = conv(x)
    w, b = np.asarray(conv.weight[...])[:, 0], np.asarray(conv.bias[...])
    xp = np.concatenate([np.zeros((2, 3, 6)), np.asarray(x)], axis=1)
    want = np.stack([np_silu(b + sum(w[:, j] * xp[:, t + j] for j in range(4))) for t in range(seqlen)], axis=1)
    assert_close(y, want, what="prefill")
    assert_close(state, np.swapaxes(xp[:, -3:], 1, 2), what="conv_state = last W-1 inputs")
    # token by token from an empty state, through the ring (which wraps after one step at max_window 1)
    s = ConvWindow.from_conv_state(conv.init_state(2))
    for t in range(seqlen):
        yt, s = conv.step(x[:, t], s)
        assert_close(yt, want[:, t], what=f"step {t}")
    assert_close(s.conv_state(), state, what="stepped conv_state")
    # a prefill continued from a state equals one prefill over both parts
    x2 = rand(4, (2, 3, 6))
    y_all, s_all = conv(jnp.concatenate([x, x2], axis=1))
    y2, s2 = conv(x2, state)
    assert_close(y2, y_all[:, seqlen:], what="continued prefill")
    assert_close(s2, s_all)
    with pytest.raises(ValueError, match=r"conv_state.*\(2, 6, 3\)"):
        conv(x, jnp.zeros((2, 6, 4)))
    with pytest.raises(ValueError, match=r"conv_state.*width W = 4.*\(2, S, 6\)"):
        conv.step(x[:, 0], ConvWindow.from_conv_state(jnp.zeros((2, 6, 4))))
    with pytest.raises(TypeError, match="ConvWindow"):
        conv.step(x[:, 0], jnp.zeros((2, 6, 3)))


def test_causal_conv1d_verify_and_rollback():
    """A verify window of T inputs, then a commit of m (advance) for every m: the live inputs are the
    last W - 1 of [before ; the first m], wherever the ring's start is."""
    conv = randomize(CausalConv1d(6, 4, bias=True))
    x = rand(5, (2, 12, 6))
    y_all, _ = conv(x)
    window = ConvWindow.from_conv_state(conv(x[:, :2])[1], max_window=3)
    assert window.columns.shape == (2, 6, 6) and window.max_window == 3
    for t in range(2, 5):  # move the ring's start away from 0
        _, window = conv.step(x[:, t], window)
    y, pending = conv.verify(x[:, 5:8], window)
    assert_close(y, y_all[:, 5:8], what="verify outputs")
    assert_close(pending.conv_state(), window.conv_state(), what="verify leaves the live inputs")
    for m in range(4):
        _, want = conv(x[:, :5 + m])
        assert_close(pending.advance(m).conv_state(), want, what=f"commit {m}")
    committed = pending.advance(jnp.array([0, 3]))  # rows at different positions
    y0, _ = conv.step(x[:, 5], committed)
    assert_close(y0[0], y_all[0, 5], what="row 0 after commit 0")
    assert_close(y0[1], conv(jnp.concatenate([x[1:, :8], x[1:, 5:6]], axis=1))[0][0, 8], what="row 1 after commit 3")
    with pytest.raises(ValueError, match="max_window = 3"):
        conv.verify(x[:, :4], window)


# ------------------------------------------------------------------------------------------------
# attention


def np_attention(layer: Attention, x):
    """Literal transformers math (eager attention, repeat_kv, rotate-half RoPE)."""
    p = lambda m: np.asarray(m.weight[...])  # noqa: E731
    b, T, _ = x.shape
    nh, kvh, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
    q = x @ p(layer.q_proj).T
    gate = None
    if layer.output_gate:
        q = q.reshape(b, T, nh, 2 * d)
        q, gate = q[..., :d], q[..., d:].reshape(b, T, nh * d)
    q = q.reshape(b, T, nh, d)
    k = (x @ p(layer.k_proj).T).reshape(b, T, kvh, d)
    v = (x @ p(layer.v_proj).T).reshape(b, T, kvh, d)
    if layer.q_norm is not None:
        q = np_rms(q, 1e-6) * (1 + p(layer.q_norm))
        k = np_rms(k, 1e-6) * (1 + p(layer.k_norm))
    rd = layer.rotary_dim
    if rd:
        inv = 1.0 / (layer.rope_theta ** (np.arange(0, rd, 2) / rd))
        ang = np.arange(T)[:, None] * inv[None]
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

        def rope(t):
            r, rest = t[..., :rd], t[..., rd:]
            rot = np.concatenate([-r[..., rd // 2:], r[..., :rd // 2]], -1)
            return np.concatenate([r * cos[None, :, None] + rot * sin[None, :, None], rest], -1)

        q, k = rope(q), rope(k)
    k = np.repeat(k, nh // kvh, axis=2)
    v = np.repeat(v, nh // kvh, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, k) / math.sqrt(d)
    s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    s = s / s.sum(-1, keepdims=True)
    o = np.einsum("bhts,bshd->bthd", s, v).reshape(b, T, nh * d)
    if gate is not None:
        o = o / (1 + np.exp(-gate))
    return o @ p(layer.o_proj).T


ATTENTION_VARIANTS = {
    "nemotron": dict(rotary_dim=0),
    "qwen": dict(output_gate=True, qk_norm=True, rotary_dim=4, rope_theta=10000.0),
    "full_rope_bias": dict(rotary_dim=8, bias=True),
}


@pytest.mark.parametrize("variant", sorted(ATTENTION_VARIANTS))
def test_attention_matches_formula_and_decodes(variant):
    layer = randomize(Attention(24, 4, 2, 8, **ATTENTION_VARIANTS[variant]), scale=0.2)
    x = rand(5, (2, 9, 24))
    y = jax.jit(layer)(x)
    if not ATTENTION_VARIANTS[variant].get("bias"):
        assert_close(y, np_attention(layer, np.asarray(x, np.float64)), what=variant)
    # prefill 5 tokens, then decode 4: same outputs as the full forward
    y5, cache = jax.jit(layer.prefill, static_argnums=1)(x[:, :5], 12)
    assert cache.k.shape == (2, 12, 2, 8)
    assert_close(y5, y[:, :5])
    for t in range(5, 9):
        yt, cache = jax.jit(layer.decode)(x[:, t], cache)
        assert_close(yt, y[:, t], what=f"decode {t}")
    np.testing.assert_array_equal(np.asarray(cache.length), [9, 9])


def test_attention_extend_with_ragged_lengths():
    """Rows at different cache lengths: each token attends to its own row's prefix only."""
    layer = randomize(Attention(16, 2, 1, 8, output_gate=True, qk_norm=True, rotary_dim=8), scale=0.2)
    x = rand(6, (2, 6, 16))
    full = jax.jit(layer)(x)
    prefill = jax.jit(layer.prefill, static_argnums=1)
    _, c0 = prefill(x[:1, :2], 8)
    _, c1 = prefill(x[1:, :4], 8)
    cache = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), c0, c1)
    y, cache = jax.jit(layer.extend)(jnp.stack([x[0, 2:4], x[1, 4:6]]), cache)
    assert_close(y[0], full[0, 2:4])
    assert_close(y[1], full[1, 4:6])
    np.testing.assert_array_equal(np.asarray(cache.length), [4, 6])


def test_attention_row_past_the_cache_is_nan_inside_jit():
    """A traced cache length with no room left (eager calls raise): that row's outputs are NaN, the
    other row's equal the full forward."""
    layer = randomize(Attention(16, 2, 1, 8, rotary_dim=8), scale=0.2)
    x = rand(7, (2, 6, 16))
    full = jax.jit(layer)(x)
    _, cache = jax.jit(layer.prefill, static_argnums=1)(x[:, :4], 5)
    cache = cache.replace(length=jnp.array([5, 4], jnp.int32))  # row 0 full
    with pytest.raises(ValueError, match="the KV cache is full"):
        layer.decode(x[:, 4], cache)
    y, cache = jax.jit(layer.decode)(x[:, 4], cache)
    assert np.isnan(np.asarray(y[0])).all()
    assert_close(y[1], full[1, 4])
    np.testing.assert_array_equal(np.asarray(cache.length), [6, 5])


def test_attention_verify_and_commit():
    """Verify W positions per row at ragged lengths, commit m (0 and W included): outputs and the
    following decode steps equal the full forward."""
    layer = randomize(Attention(16, 2, 1, 8, output_gate=True, qk_norm=True, rotary_dim=8), scale=0.2)
    x = rand(21, (2, 12, 16))
    full = jax.jit(layer)(x)
    _, cache = jax.jit(layer.prefill, static_argnums=1)(x[:, :3], 12)
    pos = np.array([3, 3])
    for m in ([3, 0], [1, 3], [0, 2]):
        y, pending = jax.jit(layer.verify)(_ragged(x, pos, 3), cache)
        assert pending.window == 3
        np.testing.assert_array_equal(np.asarray(pending.length), pos)
        assert_close(y, _ragged(full, pos, 3), what=f"verify at {pos}")
        cache = jax.jit(layer.commit)(pending, jnp.asarray(m, jnp.int32))
        pos = pos + np.asarray(m)
        np.testing.assert_array_equal(np.asarray(cache.length), pos)
    y, cache = jax.jit(layer.decode)(_ragged(x, pos, 1)[:, 0], cache)
    assert_close(y, _ragged(full, pos, 1)[:, 0], what="decode after commits")
    with pytest.raises(ValueError, match="no room|KV cache is full"):
        layer.verify(jnp.zeros((2, 5, 16)), cache)
    with pytest.raises(ValueError, match="pending verify window"):
        layer.commit(cache, jnp.array([1, 1]))
    _, pending = layer.verify(_ragged(x, pos + 1, 2), cache)
    with pytest.raises(ValueError, match="pending verify window"):
        layer.decode(x[:, 0], pending)
    with pytest.raises(ValueError, match=r"`num_accepted` must be in \[0, 2\]"):
        layer.commit(pending, jnp.array([0, 3]))


def test_attention_errors():
    with pytest.raises(ValueError, match="num_key_value_heads"):
        Attention(16, 4, 3, 4)
    with pytest.raises(ValueError, match="rotary_dim"):
        Attention(16, 4, 2, 4, rotary_dim=3)
    layer = Attention(16, 4, 2, 4)
    with pytest.raises(ValueError, match="max_len"):
        layer.prefill(jnp.zeros((1, 5, 16)), max_len=4)
    with pytest.raises(ValueError, match="cache.k"):
        layer.decode(jnp.zeros((1, 16)), KVCache.zeros(1, 4, 4, 4))
    with pytest.raises(ValueError, match=r"Attention.prefill: `x` must have shape \[batch, T, hidden\] with "
                                         r"hidden = 16, T >= 1; got shape \(1, 0, 16\)"):
        layer.prefill(rand(1, (1, 0, 16)), max_len=4)
    with pytest.raises(ValueError, match=r"Attention.prefill: `x` must have shape .*; got shape \(5, 16\)"):
        layer(rand(1, (5, 16)))
    with pytest.raises(ValueError, match=r"Attention.decode: `x` must have shape \[batch, hidden\] with hidden = 16, "
                                         r"batch = 1; got shape \(1, 1, 16\)"):
        layer.decode(rand(1, (1, 1, 16)), KVCache.zeros(1, 4, 2, 4))
    with pytest.raises(ValueError, match=r"Attention.verify: `x` must have shape \[batch, W, hidden\]"):
        layer.verify(rand(1, (1, 16)), KVCache.zeros(1, 4, 2, 4))
    with pytest.raises(TypeError, match="Attention.decode: `cache` must be a KVCache; got SSMLayerState"):
        layer.decode(rand(1, (1, 16)), mamba2_layer().init_state(1))
    with pytest.raises(ValueError, match=r"`slots` must have one entry per batch row of `x` \(x.shape\[0\] = 2\); "
                                         "got 3 slots"):
        layer.decode(rand(1, (2, 16)), KVCache.zeros(4, 4, 2, 4), slots=jnp.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"`slots` must be in \[-1, 3\]"):
        layer.decode(rand(1, (2, 16)), KVCache.zeros(4, 4, 2, 4), slots=jnp.array([9, 0]))
    with pytest.raises(TypeError, match="Attention.decode: `x` must have dtype float32 or bfloat16; got float16"):
        layer.decode(rand(1, (1, 16)).astype(jnp.float16), KVCache.zeros(1, 4, 2, 4))
    for sizes, name in [((16, 0, 1, 4), "num_heads"), ((16, 4, 2, 0), "head_dim"), ((0, 4, 2, 4), "hidden_size")]:
        with pytest.raises(ValueError, match=f"Attention: `{name}` must be >= 1; got 0"):
            Attention(*sizes)


# ------------------------------------------------------------------------------------------------
# MLP and MoE


def test_mlps():
    x = np.asarray(rand(7, (3, 16)))
    relu2 = randomize(MLP(16, 24, activation="relu2", gated=False))
    p = lambda m: np.asarray(m.weight[...])  # noqa: E731
    assert_close(relu2(jnp.asarray(x)), (np.maximum(x @ p(relu2.up_proj).T, 0) ** 2) @ p(relu2.down_proj).T)
    swiglu = randomize(MLP(16, 24, activation="silu", gated=True))
    want = (np_silu(x @ p(swiglu.gate_proj).T) * (x @ p(swiglu.up_proj).T)) @ p(swiglu.down_proj).T
    assert_close(swiglu(jnp.asarray(x)), want)
    with pytest.raises(ValueError, match="unknown activation"):
        MLP(4, 4, activation="swoosh", gated=False)


def np_moe(moe: MoE, x):
    """Per-token loop following NemotronHMoE / Qwen3NextSparseMoeBlock."""
    w = np.asarray(moe.gate.weight[...])
    e = moe.experts
    up, down = np.asarray(e.up_proj[...]), np.asarray(e.down_proj[...])
    gate = np.asarray(e.gate_proj[...]) if e.gated else None
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        logits = w @ x[n]
        if moe.router == "softmax":
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            idx = np.argsort(-probs)[:moe.top_k]
            wts = probs[idx]
            if moe.norm_topk_prob:
                wts = wts / wts.sum()
        else:
            scores = 1 / (1 + np.exp(-logits))
            choice = scores + np.asarray(moe.gate.e_score_correction_bias[...])
            per = moe.num_experts // moe.n_group
            grp = np.sort(choice.reshape(moe.n_group, per), axis=-1)[:, -2:].sum(-1)
            keep = np.argsort(-grp)[:moe.topk_group]
            masked = np.full_like(choice, -np.inf)
            for gi in keep:
                masked[gi * per:(gi + 1) * per] = choice[gi * per:(gi + 1) * per]
            idx = np.argsort(-masked)[:moe.top_k]
            wts = scores[idx]
            if moe.norm_topk_prob:
                wts = wts / (wts.sum() + 1e-20)
            wts = wts * moe.routed_scaling_factor
        for i, wt in zip(idx, wts):
            h = up[i] @ x[n]
            h = np_silu(gate[i] @ x[n]) * h if e.gated else np.maximum(h, 0) ** 2
            out[n] += wt * (down[i] @ h)
    shared = getattr(moe, moe.shared_name)
    if shared is not None:
        p = lambda m: np.asarray(m.weight[...])  # noqa: E731
        if shared.gated:
            s = (np_silu(x @ p(shared.gate_proj).T) * (x @ p(shared.up_proj).T)) @ p(shared.down_proj).T
        else:
            s = (np.maximum(x @ p(shared.up_proj).T, 0) ** 2) @ p(shared.down_proj).T
        if moe.shared_expert_gate is not None:
            s = s / (1 + np.exp(-(x @ p(moe.shared_expert_gate).T)))
        out += s
    return out


MOE_VARIANTS = {
    "nemotron_grouped": dict(activation="relu2", gated=False, router="sigmoid", norm_topk_prob=True,
                             routed_scaling_factor=2.5, n_group=4, topk_group=2, shared_intermediate_size=12,
                             shared_name="shared_experts"),
    "nemotron_plain": dict(activation="relu2", gated=False, router="sigmoid", norm_topk_prob=False),
    "qwen3_next": dict(activation="silu", gated=True, router="softmax", norm_topk_prob=True,
                       shared_intermediate_size=12, shared_expert_gate=True),
}


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_moe_matches_formula(variant):
    moe = randomize(MoE(16, 8, 3, 10, **MOE_VARIANTS[variant]), scale=0.3)
    x = np.asarray(rand(8, (2, 5, 16)))
    want = np_moe(moe, x.reshape(10, 16)).reshape(2, 5, 16)
    assert_close(jax.jit(moe)(jnp.asarray(x)), want, what=f"{variant} dense path")
    # few tokens: the gather path (N * k <= E)
    assert_close(jax.jit(moe)(jnp.asarray(x[:, 0])), want[:, 0], what=f"{variant} gather path")


def test_moe_errors():
    with pytest.raises(ValueError, match="router"):
        MoE(8, 4, 2, 8, activation="silu", gated=True, router="topk", norm_topk_prob=True)
    with pytest.raises(ValueError, match="n_group"):
        MoE(8, 4, 2, 8, activation="silu", gated=True, router="sigmoid", norm_topk_prob=True, n_group=3)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoE(8, 4, 5, 8, activation="silu", gated=True, router="softmax", norm_topk_prob=True)


# ------------------------------------------------------------------------------------------------
# SSM layers: continuity of prefill, standard decode and ReplaySSM decode


def mamba2_layer(**kw):
    layer = Mamba2Mixer(24, num_heads=4, head_dim=6, state_size=5, n_groups=2, conv_kernel=4, chunk_size=4,
                        norm_group_size=12, **kw)
    layer = randomize(layer, seed=1, scale=0.3)
    # keep the decay moderate so that the test exercises real state carry-over
    layer.A_log[...] = jnp.log(jnp.linspace(0.2, 1.0, 4))
    return layer


def gdn_layer(packed):
    layer = GatedDeltaNet(24, num_k_heads=2, num_v_heads=4, head_k_dim=6, head_v_dim=5, conv_kernel=4, packed=packed,
                          chunk_size=4)
    return randomize(layer, seed=2, scale=0.3)


SSM_LAYERS = {
    "mamba2": mamba2_layer,
    "gdn_packed": lambda: gdn_layer(True),
    "gdn_separate": lambda: gdn_layer(False),
}
# The two GDN layouts differ in the input projection only (GatedDeltaNet._project, which every path calls),
# and test_gdn_packed_layout_equals_separate checks that they project alike: the decode and verify tests
# run the packed layout by default and the separate one as `slow`.
SSM_LAYER_CASES = ["gdn_packed", pytest.param("gdn_separate", marks=pytest.mark.slow), "mamba2"]


def test_decode_step_cuts_no_operand_of_its_kernels(rng):
    """A decode step on the kernels (interpret) slices no operand of its kernels where the conv kernel's
    block divides the pieces' boundaries: the conv reads xBC inside Mamba-2's in_proj output and returns x,
    B and C apart (GDN: q, k and v), and the SSM kernels read dt there (dt_offset). Left is Mamba-2's z,
    which the gated norm's fusion reads. Each step equals the XLA form's."""
    layers = {"mamba2": (Mamba2Mixer(32, num_heads=4, head_dim=8, state_size=16, n_groups=2), [(2, 32)]),
              "gdn": (GatedDeltaNet(32, num_k_heads=2, num_v_heads=4, head_k_dim=16, head_v_dim=8, packed=False), [])}
    for name, (layer, cuts) in layers.items():
        layer = randomize(layer, seed=int(rng.integers(1 << 30)), scale=0.3)
        u = jnp.asarray(rng.standard_normal((2, 3, 32)), jnp.float32)
        _, state = layer.prefill(u[:, :2])
        jaxpr = jax.make_jaxpr(lambda s, x: layer.decode(x, s, backend="interpret"))(state, u[:, 2])
        slices = sorted(tuple(e.outvars[0].aval.shape) for e in jaxpr_equations(jaxpr.jaxpr)
                        if e.primitive.name in ("slice", "split"))
        assert slices == cuts, (name, slices)
        y, new = layer.decode(u[:, 2], state, backend="interpret")
        want, want_state = layer.decode(u[:, 2], state, backend="xla")
        assert_close(y, want, what=f"{name} decode output")
        assert_close(new.ssm_state, want_state.ssm_state, what=f"{name} ssm_state")
        np.testing.assert_array_equal(np.asarray(new.conv_state.columns), np.asarray(want_state.conv_state.columns))


def np_mamba2(layer: Mamba2Mixer, u):
    """Literal per-step recurrence of transformers' Mamba2Mixer decode path, from zeros."""
    p = lambda a: np.asarray(a[...], np.float64)  # noqa: E731
    b, T, _ = u.shape
    H, P, N, G = layer.num_heads, layer.head_dim, layer.state_size, layer.n_groups
    zxbcdt = u @ p(layer.in_proj.weight).T
    d, c = layer.d_inner, layer.conv_dim
    z, xbc, dt = zxbcdt[..., :d], zxbcdt[..., d:d + c], zxbcdt[..., d + c:]
    w = p(layer.conv1d.weight)[:, 0]
    xp = np.concatenate([np.zeros((b, 3, c)), xbc], 1)
    xbc = np_silu(np.stack([sum(w[:, j] * xp[:, t + j] for j in range(4)) + p(layer.conv1d.bias)
                            for t in range(T)], 1))
    x = xbc[..., :d].reshape(b, T, H, P)
    Bm = np.repeat(xbc[..., d:d + G * N].reshape(b, T, G, N), H // G, axis=2)
    Cm = np.repeat(xbc[..., d + G * N:].reshape(b, T, G, N), H // G, axis=2)
    dt = np.log1p(np.exp(dt + p(layer.dt_bias)))
    A = -np.exp(p(layer.A_log))
    S = np.zeros((b, H, P, N))
    ys = []
    for t in range(T):
        S = S * np.exp(dt[:, t] * A)[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * Bm[:, t, :, None]
        ys.append(np.einsum("bhpn,bhn->bhp", S, Cm[:, t]) + p(layer.D)[:, None] * x[:, t])
    y = (np.stack(ys, 1).reshape(b, T, d) * np_silu(z)).reshape(b, T, 2, 12)
    y = (np_rms(y, 1e-5).reshape(b, T, d)) * p(layer.norm.weight)
    return y @ p(layer.out_proj.weight).T


def test_mamba2_mixer_matches_recurrence():
    layer = mamba2_layer()
    u = rand(9, (2, 7, 24))
    assert_close(jax.jit(layer)(u), np_mamba2(layer, np.asarray(u, np.float64)), tol=5e-5)


@pytest.mark.parametrize("name", SSM_LAYER_CASES)
def test_ssm_layer_continuity(name):
    layer = SSM_LAYERS[name]()
    u = rand(10, (2, 11, 24))
    prefill = jax.jit(layer.prefill)
    full, full_state = prefill(u)
    assert isinstance(full_state, SSMLayerState)
    # prefill 4 tokens, then 7 standard decode steps
    y, state = prefill(u[:, :4])
    assert_close(y, full[:, :4], what="prefill prefix")
    decode = jax.jit(lambda s, x: layer.decode(x, s))
    std = state
    for t in range(4, 11):
        yt, std = decode(std, u[:, t])
        assert_close(yt, full[:, t], what=f"standard step {t}")
    assert_close(std.ssm_state, full_state.ssm_state, what="final ssm_state")
    assert_close(std.conv_state.conv_state(), full_state.conv_state.conv_state(), what="final conv_state")
    # ReplaySSM at buffer lengths 1, 3 (flushes at ragged points) and 8 (no flush); both routes at L = 3
    for L, route in ((1, "output"), (3, "output"), (3, "state"), (8, "output")):
        rep = layer.to_replay(state, L)
        assert isinstance(rep, ReplayLayerState)
        assert isinstance(rep.replay, Mamba2ReplayState if name == "mamba2" else GDNReplayState)
        step = jax.jit(lambda s, x, route=route: layer.decode(x, s, route=route))
        for t in range(4, 11):
            yt, rep = step(rep, u[:, t])
            assert_close(yt, full[:, t], what=f"replay L={L} route={route} step {t}")
        np.testing.assert_array_equal(np.asarray(rep.replay.cursor), [7 % L] * 2)
    # a prefill continued from a state equals the full prefill
    y2, s2 = prefill(u[:, 4:], state)
    assert_close(y2, full[:, 4:], what="continued prefill")
    assert_close(s2.ssm_state, full_state.ssm_state)
    with pytest.raises(TypeError, match="SSMLayerState or ReplayLayerState"):
        layer.decode(u[:, 0], KVCache.zeros(2, 4, 1, 1))


def _ragged(u, starts, width):
    """[batch, width, ...]: row b's inputs starts[b] .. starts[b] + width - 1."""
    return jnp.stack([u[b, s:s + width] for b, s in enumerate(starts)])


# The verify and commit rounds by default: ReplaySSM at L = 5 (W = 3 < L: the rows' buffers flush in
# different rounds) on both layer types and the standard state on Mamba-2; L = 3 (W = L) and GDN's standard
# state `slow`, which tests/test_model_verify.py runs by default through whole models (L = W = 4 and the
# standard state, each on both layer types).
_VERIFY_DEFAULT = {(5, "mamba2"), (5, "gdn_packed"), (None, "mamba2")}
VERIFY_CASES = [pytest.param(name, buffer_len, id=f"{state}-{name}",
                             marks=() if (buffer_len, name) in _VERIFY_DEFAULT else pytest.mark.slow)
                for name in SSM_LAYERS
                for buffer_len, state in ((None, "standard"), (3, "replay-L3"), (5, "replay-L5"))]


@pytest.mark.parametrize("name, buffer_len", VERIFY_CASES)
def test_ssm_layer_verify_and_commit(name, buffer_len):
    """Rounds of verify W = 3 and commit m (rows apart, m = 0 and m = W included), with a decode step
    between them: every output equals the full prefill's at its position; so does the final state."""
    layer = SSM_LAYERS[name]()
    u = rand(19, (2, 16, 24))
    full, full_state = jax.jit(layer.prefill)(u)
    _, state = jax.jit(layer.prefill)(u[:, :3])
    state = layer.with_window(state, 3)
    if buffer_len:
        state = layer.to_replay(state, buffer_len)
    verify, commit = jax.jit(layer.verify), jax.jit(layer.commit)
    step = jax.jit(lambda s, x: layer.decode(x, s))
    pos = np.array([3, 3])
    for m in ([3, 1], [0, 2], "decode", [3, 3], [2, 0], [1, 3]):
        if m == "decode":
            y, state = step(state, _ragged(u, pos, 1)[:, 0])
            assert_close(y, _ragged(full, pos, 1)[:, 0], what=f"decode step at {pos}")
            pos = pos + 1
            continue
        y, pending = verify(_ragged(u, pos, 3), state)
        assert pending.window == 3
        assert_close(y, _ragged(full, pos, 3), what=f"verify at {pos}")
        state = commit(pending, jnp.asarray(m, jnp.int32))
        assert state.window == 0
        pos = pos + np.asarray(m)
        if buffer_len:
            assert np.all(np.asarray(state.replay.cursor) <= buffer_len)
    tail = [16 - p for p in pos]
    assert tail[0] == tail[1], pos  # both rows at the same position: one more verify ends the sequence
    y, pending = verify(_ragged(u, pos, tail[0]), state)
    assert_close(y, full[:, 16 - tail[0]:], what="last verify")
    state = commit(pending, jnp.full((2,), tail[0], jnp.int32))
    ssm = state.current_state() if buffer_len is None else (
        ops.mamba2_replay_materialize(state.replay, layer._op_params()["A"]) if name == "mamba2"
        else ops.gdn_replay_materialize(state.replay))
    assert_close(ssm, full_state.ssm_state, what="final ssm_state")
    assert_close(state.conv_state.conv_state(), full_state.conv_state.conv_state(), what="final conv_state")


def test_ssm_layer_verify_errors():
    layer = mamba2_layer()
    u = rand(20, (2, 6, 24))
    _, state = layer.prefill(u[:, :2])
    with pytest.raises(ValueError, match="max_window = 1"):
        layer.verify(u[:, 2:4], state)
    state = layer.with_window(state, 4)
    with pytest.raises(ValueError, match="buffer length L = 2"):
        layer.verify(u[:, 2:5], layer.to_replay(state, 2))
    with pytest.raises(ValueError, match=r"`u` must have shape \[batch, W, hidden\]"):
        layer.verify(u[:1, 2:4], state)
    with pytest.raises(ValueError, match="no pending verify window"):
        layer.commit(state, jnp.array([1, 1]))
    _, pending = layer.verify(u[:, 2:4], state)
    with pytest.raises(ValueError, match="pending verify window"):
        layer.verify(u[:, 2:4], pending)
    with pytest.raises(ValueError, match="pending verify window"):
        layer.decode(u[:, 2], pending)
    with pytest.raises(ValueError, match=r"`num_accepted` must be in \[0, 2\]"):
        layer.commit(pending, jnp.array([3, 1]))
    with pytest.raises(ValueError, match="max_window"):
        layer.with_window(state, 0)
    # the failed calls left the pending state usable
    assert layer.commit(pending, jnp.array([2, 0])).window == 0


def test_gdn_packed_layout_equals_separate():
    """Qwen3-Next's per-key-head packing of in_proj_qkvz / in_proj_ba, unpacked, gives Qwen3.5's layer."""
    packed, separate = gdn_layer(True), gdn_layer(False)
    H, K, V, HV = 2, 6, 5, 4
    r = HV // H
    Wq, Wk = rand(11, (H, K, 24), 0.3), rand(12, (H, K, 24), 0.3)
    Wv, Wz = rand(13, (H, r * V, 24), 0.3), rand(14, (H, r * V, 24), 0.3)
    Wb, Wa = rand(15, (H, r, 24), 0.3), rand(16, (H, r, 24), 0.3)
    packed.in_proj_qkvz.weight[...] = jnp.concatenate([Wq, Wk, Wv, Wz], axis=1).reshape(-1, 24)
    packed.in_proj_ba.weight[...] = jnp.concatenate([Wb, Wa], axis=1).reshape(-1, 24)
    separate.in_proj_qkv.weight[...] = jnp.concatenate([Wq.reshape(-1, 24), Wk.reshape(-1, 24),
                                                        Wv.reshape(-1, 24)])
    separate.in_proj_z.weight[...] = Wz.reshape(-1, 24)
    separate.in_proj_b.weight[...] = Wb.reshape(-1, 24)
    separate.in_proj_a.weight[...] = Wa.reshape(-1, 24)
    for name in ("conv1d", "norm", "out_proj"):
        nnx.update(getattr(separate, name), nnx.state(getattr(packed, name)))
    separate.A_log[...] = packed.A_log[...]
    separate.dt_bias[...] = packed.dt_bias[...]
    u = rand(17, (2, 6, 24))
    assert_close(jax.jit(separate)(u), jax.jit(packed)(u))


def test_ssm_layer_errors():
    with pytest.raises(ValueError, match="n_groups"):
        Mamba2Mixer(8, num_heads=4, head_dim=2, state_size=4, n_groups=3)
    with pytest.raises(ValueError, match="linear_num_key_heads"):
        GatedDeltaNet(8, num_k_heads=3, num_v_heads=4, head_k_dim=2, head_v_dim=2, packed=False)
    with pytest.raises(ValueError, match="Mamba2Mixer: `num_heads` must be >= 1; got 0"):
        Mamba2Mixer(8, num_heads=0, head_dim=2, state_size=4, n_groups=1)
    with pytest.raises(ValueError, match="Mamba2Mixer: `chunk_size` must be >= 1; got 0"):
        Mamba2Mixer(8, num_heads=4, head_dim=2, state_size=4, n_groups=1, chunk_size=0)
    with pytest.raises(ValueError, match="GatedDeltaNet: `head_k_dim` must be >= 1; got -1"):
        GatedDeltaNet(8, num_k_heads=1, num_v_heads=2, head_k_dim=-1, head_v_dim=2, packed=False)
    with pytest.raises(TypeError, match=r"GatedDeltaNet: `ssm_state_dtype` must be float32 or bfloat16; got 'float16' "
                                        r"\(float16 overflows"):
        GatedDeltaNet(8, num_k_heads=1, num_v_heads=2, head_k_dim=2, head_v_dim=2, packed=False,
                      ssm_state_dtype=jnp.float16)


@pytest.mark.parametrize("name", ["mamba2", "gdn_packed"])
def test_ssm_layer_input_and_state_errors(name):
    """Bad input to a mixer's modes is named at the layer (the input `u`, a state of another type or
    of another layer), before any op runs; the caller's state stays usable."""
    layer, other = SSM_LAYERS[name](), SSM_LAYERS["gdn_packed" if name == "mamba2" else "mamba2"]()
    u = rand(21, (2, 5, 24))
    _, state = layer.prefill(u[:, :3])
    _, other_state = other.prefill(u[:, :3])
    owner = type(layer).__name__
    shape_errors = [
        (lambda: layer.prefill(u[0]), rf"{owner}.prefill: `u` must have shape \[batch, T, hidden\] with hidden = 24, "
                                      r"T >= 1; got shape \(5, 24\)"),
        (lambda: layer(u[:, :0]), r"`u` must have shape \[batch, T, hidden\] .*got shape \(2, 0, 24\)"),
        (lambda: layer.prefill(u[:1], state), r"with hidden = 24, batch = 2, T >= 1; got shape \(1, 5, 24\)"),
        (lambda: layer.decode(u[:, 3:4], state), rf"{owner}.decode: `u` must have shape \[batch, hidden\] with "
                                                 r"hidden = 24, batch = 2; got shape \(2, 1, 24\)"),
        (lambda: layer.decode(u[:, 3, :20], state), r"hidden = 24, batch = 2; got shape \(2, 20\)"),
        (lambda: layer.decode(u[:, 3], state, route="fast"), r"`route` must be one of .*got 'fast'"),
        (lambda: layer.decode(u[:, 3], other_state), rf"{owner}.decode: `state` is not this layer's"),
        (lambda: layer.to_replay(other_state, 4), rf"{owner}.to_replay: `state` is not this layer's"),
        (lambda: layer.prefill(u[:, 3:], other_state), rf"{owner}.prefill: `state` is not this layer's"),
    ]
    for call, message in shape_errors:
        with pytest.raises(ValueError, match=message):
            call()
    with pytest.raises(TypeError, match=rf"{owner}.to_replay: `state` must be SSMLayerState; got ReplayLayerState"):
        layer.to_replay(layer.to_replay(state, 4), 4)
    replay = layer.to_replay(state, 4)
    dtype_errors = [  # the ops refuse these too; the layer names `u` before its projections cast it
        (lambda: layer.prefill(u.astype(jnp.int32)), rf"{owner}.prefill: `u` must have dtype float32 or bfloat16; "
                                                     "got int32"),
        (lambda: layer.decode(u[:, 3].astype(jnp.float16), replay),
         rf"{owner}.decode: `u` must have dtype float32 or bfloat16; got float16 \(float16 overflows"),
        (lambda: layer.verify(u[:, 3:].astype(jnp.int8), state), rf"{owner}.verify: `u` must have dtype"),
    ]
    for call, message in dtype_errors:
        with pytest.raises(TypeError, match=message):
            call()
    pool = jax.tree.map(lambda a: jnp.concatenate([a, a]), state)  # a pool of 4 slots
    with pytest.raises(ValueError, match=r"`slots` must have one entry per batch row of `u` \(u.shape\[0\] = 2\); "
                                         "got 3 slots"):
        layer.decode(u[:, 3], pool, slots=jnp.array([0, 1, 2]))
    with pytest.raises(TypeError, match="`slots` must have an integer dtype; got float32"):
        layer.decode(u[:, 3], pool, slots=jnp.array([0.0, 1.0]))
    y, _ = layer.decode(u[:, 3], state)
    assert y.shape == (2, 24) and np.isfinite(np.asarray(y)).all()


def test_ssm_layer_warnings_name_the_callers_line():
    """A library warning raised deep in the ops (here an unsafe 8-bit checkpoint format) points at the
    caller's own code, not at a library module."""
    layer = gdn_layer(False)
    _, state = layer.prefill(rand(22, (2, 3, 24)))
    with pytest.warns(UserWarning, match="a bfloat16 checkpoint is safer") as record:
        layer.to_replay(state, 4, checkpoint_dtype=jnp.float8_e4m3fn, rounding="nearest")
    assert record[0].filename == __file__


def test_to_replay_shares_the_state_arrays():
    """`to_replay` keeps the standard state's arrays (documented: donating the replay state deletes them);
    a copy first keeps both usable."""
    layer = mamba2_layer()
    _, state = layer.prefill(rand(23, (2, 3, 24)))
    replay = layer.to_replay(state, 4)
    assert replay.replay.checkpoint is state.ssm_state and replay.conv_state is state.conv_state
    kept = jax.tree.map(jnp.copy, state)
    step = jax.jit(lambda s, x: layer.decode(x, s), donate_argnums=0)
    step(layer.to_replay(kept, 4), rand(24, (2, 24)))
    y, _ = layer.decode(rand(24, (2, 24)), state)  # the copy was donated, not `state`
    assert np.isfinite(np.asarray(y)).all()


def test_decode_in_lax_scan_with_split_merge():
    """The functional form a generation loop uses: params split once, state carried by lax.scan."""
    layer = mamba2_layer()
    u = rand(18, (2, 9, 24))
    full = jax.jit(layer)(u)
    graphdef, params = nnx.split(layer)

    @jax.jit
    def run(params, u):
        m = nnx.merge(graphdef, params)
        _, state = m.prefill(u[:, :3])
        state = m.to_replay(state, 4)

        def body(s, x):
            y, s = nnx.merge(graphdef, params).decode(x, s)
            return s, y

        _, ys = jax.lax.scan(body, state, jnp.swapaxes(u[:, 3:], 0, 1))
        return jnp.swapaxes(ys, 0, 1)

    assert_close(run(params, u), full[:, 3:])
