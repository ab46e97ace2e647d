"""The decode attention (`ops.attention_decode`): the kernel against the reference (the attention
layers' math), interpreted on the CPU (small shapes) and compiled on a GPU (the models' attention
shapes, `-m gpu`); its Triton lowering, its tiling heuristic and its argument checks.

Inputs are drawn fresh per test (never zeros), each row's live length at random in [1, S]. The kernel's
probabilities enter the second product unnormalised and the reference's normalised, each rounded to
V's dtype: outputs agree within that rounding (TOLERANCE, relative to the outputs' scale).
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kernel_checks import jaxpr_equations, lower_for_cuda
from models import load_model
from replayssm_jax import kernels, ops, reference
from replayssm_jax.generation import Generator
from replayssm_jax.layers import Attention

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

# f32: sums in another order (online softmax); bf16 / f16: the probabilities rounded in another place.
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2, jnp.float16: 4e-3}


def draw(rng, batch, HQ, HK, D, S, dtype):
    """Random (q, k, v, length): a cache of S positions, each row live up to a random length (row 0: S)."""
    def normal(shape):
        return jnp.asarray(rng.standard_normal(shape), dtype)

    length = rng.integers(1, S + 1, batch)
    length[0] = S
    return normal((batch, HQ, D)), normal((batch, S, HK, D)), normal((batch, S, HK, D)), jnp.asarray(length, jnp.int32)


def assert_matches_reference(args, backend, config=None, scale=None):
    got = ops.attention_decode(*args, scale=scale, backend=backend, config=config)
    want = ops.attention_decode(*args, scale=scale, backend="xla")
    assert got.shape == want.shape and got.dtype == want.dtype == args[0].dtype
    tol = TOLERANCE[args[0].dtype.type] * max(1.0, float(jnp.max(jnp.abs(want.astype(jnp.float32)))))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0, atol=tol)


CPU_CASES = [  # (batch, HQ, HK, D, S, dtype, config: (positions per block, parts) or None)
    (3, 8, 2, 32, 40, jnp.float32, None),
    (2, 6, 2, 24, 37, jnp.bfloat16, (16, 1)),  # 3 query heads a KV head, D and S off the powers of two
    (4, 4, 4, 16, 70, jnp.float32, (16, 3)),  # one query head a KV head, three parts of each row
    (2, 16, 4, 64, 33, jnp.bfloat16, (16, 5)),  # more parts than a short row's blocks: empty parts
    (1, 2, 1, 80, 9, jnp.float16, (32, 2)),  # the cache shorter than one block
    (2, 5, 1, 8, 20, jnp.float32, (16, 1)),  # head_dim below a dot's 16: padded
]


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"b{c[0]}-hq{c[1]}-hk{c[2]}-d{c[3]}-s{c[4]}-{c[6]}")
def test_kernel_matches_reference(case, rng):
    batch, HQ, HK, D, S, dtype, tiling = case
    config = None if tiling is None else kernels.AttentionConfig(block_v=tiling[0], num_warps=2, parts=tiling[1])
    assert_matches_reference(draw(rng, batch, HQ, HK, D, S, dtype), "interpret", config)


def test_kernel_takes_a_scale(rng):
    assert_matches_reference(draw(rng, 2, 4, 2, 16, 20, jnp.float32), "interpret", scale=0.37)


def test_live_positions_only(rng):
    """Values past a row's length (here NaN) change nothing on either backend: neither reads them into its
    sums nor lets a masked score through."""
    q, k, v, length = draw(rng, 3, 4, 2, 16, 50, jnp.float32)
    length = jnp.asarray([50, 17, 1], jnp.int32)
    dead = jnp.arange(50)[None, :, None, None] >= length[:, None, None, None]
    poisoned = [jnp.where(dead, jnp.nan, a) for a in (k, v)]
    config = kernels.AttentionConfig(block_v=16, num_warps=2, parts=2)
    want = ops.attention_decode(q, k, v, length, backend="xla")
    for backend, kw in (("interpret", dict(config=config)), ("xla", {})):
        got = ops.attention_decode(q, *poisoned, length, backend=backend, **kw)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=TOLERANCE[jnp.float32],
                                   err_msg=backend)


@pytest.mark.parametrize("parts", [1, 3])
def test_scores_of_minus_infinity(parts, rng):
    """A block of scores that are all -inf (keys of -inf) before the finite ones gets no weight: no NaN from
    a running maximum of -inf, in a part or where the parts are joined."""
    q = jnp.abs(jnp.asarray(rng.standard_normal((1, 2, 16)), jnp.float32)) + 0.5
    k = jnp.asarray(rng.standard_normal((1, 40, 1, 16)), jnp.float32).at[:, :16].set(-jnp.inf)
    v = jnp.asarray(rng.standard_normal((1, 40, 1, 16)), jnp.float32)
    length = jnp.asarray([40], jnp.int32)
    config = kernels.AttentionConfig(block_v=16, num_warps=2, parts=parts)
    got = ops.attention_decode(q, k, v, length, backend="interpret", config=config)
    want = ops.attention_decode(q, k[:, 16:], v[:, 16:], length - 16, backend="xla")
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=TOLERANCE[jnp.float32])


def test_a_traced_length_past_the_cache_reads_no_further(rng):
    """Inside jit a length above S is not checked; the kernel reads S positions, as with length S."""
    q, k, v, _ = draw(rng, 2, 4, 2, 16, 40, jnp.float32)
    config = kernels.AttentionConfig(block_v=16, num_warps=2, parts=2)

    def run(length):
        return ops.attention_decode(q, k, v, length, backend="interpret", config=config)

    got = jax.jit(run)(jnp.asarray([41, 1000], jnp.int32))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(run(jnp.asarray([40, 40], jnp.int32))))


def test_reference_is_the_attention_layers_math(rng):
    """The reference equals an Attention layer's decode step (its scores, mask and softmax) on the cache
    that step writes: the op takes the layer's queries over the same cache."""
    layer = Attention(32, 4, 2, 16, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    prompt = jnp.asarray(rng.standard_normal((2, 5, 32)), jnp.float32)
    _, cache = layer.prefill(prompt, max_len=12)
    x = jnp.asarray(rng.standard_normal((2, 32)), jnp.float32)
    y, written = layer.decode(x, cache)
    q, _, _, _ = layer._project(x[:, None], cache.length[:, None])
    o = reference.attention_decode(q[:, 0], written.k, written.v, written.length, 16 ** -0.5)
    np.testing.assert_allclose(np.asarray(layer._output(o.reshape(2, 1, 64), None)[:, 0]), np.asarray(y),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype, precision", [(jnp.float32, jax.lax.Precision.HIGHEST), (jnp.bfloat16, None)])
def test_reference_products_are_ieee_f32_for_f32_operands(dtype, precision, rng):
    """Each product of the reference with an f32 operand requests IEEE f32 products (XLA's default on a
    GPU takes TF32, 2e-4 to 2e-3 off at the models' head_dims: the H200 run of 2026-12-05), the others
    XLA's default (bf16 and f16 products are exact in f32 accumulation)."""
    args = draw(rng, 2, 4, 2, 16, 9, dtype)
    jaxpr = jax.make_jaxpr(lambda *a: reference.attention_decode(*a, 0.25))(*args).jaxpr
    dots = [e for e in jaxpr_equations(jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 2
    for dot in dots:
        assert dot.params["precision"] == (None if precision is None else (precision, precision))
    if dtype == jnp.float32:  # a product with one f32 operand is IEEE f32 too: bf16 q and k, f32 v
        q, k, v, length = args
        mixed = jax.make_jaxpr(lambda *a: reference.attention_decode(*a, 0.25))(
            q.astype(jnp.bfloat16), k.astype(jnp.bfloat16), v, length).jaxpr
        assert [e.params["precision"] for e in jaxpr_equations(mixed) if e.primitive.name == "dot_general"] == [
            None, (precision, precision)]


@pytest.mark.parametrize("batch, kv_heads, max_len, head_dim, config", [
    (256, 4, 192, 256, kernels.AttentionConfig(block_v=32, num_warps=8, parts=1)),  # Qwen3.5-4B, batch 256
    (1, 4, 4096, 256, kernels.AttentionConfig(block_v=32, num_warps=8, parts=66)),  # one row: 2 x 132 programs
    (8, 8, 100, 128, kernels.AttentionConfig(block_v=64, num_warps=4, parts=2)),  # Nemotron-3-Nano-4B: 2 blocks
    (2, 2, 40, 32, kernels.AttentionConfig(block_v=128, num_warps=4, parts=1)),
])
def test_default_config(batch, kv_heads, max_len, head_dim, config):
    assert kernels.default_attention_config(batch, kv_heads, max_len, head_dim) == config


def test_config_checks():
    with pytest.raises(ValueError, match=re.escape("`config.block_v` (key positions per block) must be >= 16")):
        kernels.AttentionConfig(block_v=8)
    with pytest.raises(ValueError, match=re.escape("`config.parts` must be >= 1; got 0")):
        kernels.AttentionConfig(block_v=16, parts=0)
    with pytest.raises(ValueError, match=re.escape("`config.block_v` must be a power of two; got 48")):
        kernels.AttentionConfig(block_v=48)
    assert kernels.AttentionConfig(block_v=32, num_warps=8, parts=3).tag() == "bt32_w8_s1_p3"


@pytest.mark.parametrize("change, error, message", [
    (dict(q=np.ones((2, 4, 16), np.int32)), TypeError, "`q` must have a floating-point dtype"),
    (dict(q=np.ones((2, 4), np.float32)), ValueError, "`q` must have rank 3 [batch, HQ, D]"),
    (dict(k=np.ones((2, 10, 2, 16), np.float16)), TypeError, "`k` must have dtype in (float32); got float16"),
    (dict(k=np.ones((3, 10, 2, 16), np.float32)), ValueError,
     "`k` must have shape [batch, S, HK, D] = (2, 10, 2, 16) (batch and D of `q`); got (3, 10, 2, 16)"),
    (dict(v=np.ones((2, 11, 2, 16), np.float32)), ValueError, "`v` must have shape [batch, S, HK, D] = (2, 10, 2, 16)"),
    (dict(k=np.ones((2, 10, 3, 16), np.float32), v=np.ones((2, 10, 3, 16), np.float32)), ValueError,
     "HQ (axis 1 of `q`) = 4 must be divisible by HK (axis 2 of `k`) = 3"),
    (dict(length=np.array([0, 4])), ValueError, "`length` must be in [1, 10] for every row; got [0, 4]"),
    (dict(length=np.array([3, 11])), ValueError, "`length` must be in [1, 10] for every row; got [3, 11]"),
    (dict(length=np.array([3.0, 4.0])), TypeError, "`length` must have an integer dtype"),
    (dict(scale=float("nan")), TypeError, "`scale` must be a finite real number"),
    (dict(config=kernels.AttentionConfig(block_v=16), backend="xla"), TypeError, "`config` tunes the Pallas kernels"),
    (dict(config=kernels.ConvConfig(block_v=16)), TypeError, "`config` must be an AttentionConfig; got ConvConfig"),
])
def test_bad_arguments_raise_before_any_work(change, error, message, rng):
    q, k, v, _ = draw(rng, 2, 4, 2, 16, 10, jnp.float32)
    kw = dict(q=q, k=k, v=v, length=np.array([10, 4]), backend="interpret") | change
    with pytest.raises(error, match=re.escape(message)):
        ops.attention_decode(**kw)


def test_kernel_refuses_a_head_dim_above_its_limit(rng):
    args = draw(rng, 1, 2, 1, 320, 4, jnp.bfloat16)
    with pytest.raises(ValueError, match=re.escape("the decode attention kernel takes head_dim D <= 256; got 320")):
        ops.attention_decode(*args, backend="interpret")
    assert ops.attention_decode(*args, backend="xla").shape == (1, 2, 320)


@pytest.mark.parametrize("batch, parts", [(8, 1), (1, 4)])
def test_kernel_lowers_for_cuda(batch, parts):
    """The Triton lowering on the CPU at Qwen3.5-4B's attention (16 query heads, 4 KV heads, head_dim 256,
    bf16): one launch; with parts, XLA's join after it."""
    q = jax.ShapeDtypeStruct((batch, 16, 256), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((batch, 192, 4, 256), jnp.bfloat16)
    config = kernels.AttentionConfig(block_v=32, num_warps=8, parts=parts)
    text = lower_for_cuda(lambda q, k, v, n: kernels.attention_decode(q, k, v, n, config=config), q, cache, cache,
                          jax.ShapeDtypeStruct((batch,), jnp.int32))
    calls = [line for line in text.splitlines() if "custom_call" in line and "triton" in line]
    assert len(calls) == 1 and f"attention_decode_bt32_w8_s1_p{parts}" in calls[0], calls


# The models' attention layers: (query heads, KV heads, head_dim).
GPU_SHAPES = {"qwen3.5-4b": (16, 4, 256), "nemotron3-nano-4b": (32, 8, 128)}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("batch", [1, 64, 256])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_compiled_kernel_matches_reference(shape, batch, dtype, rng):
    """Compiled at the models' attention shapes, a cache of 192 positions live to random lengths (batch 1:
    the default tiling's parts of the row)."""
    HQ, HK, D = GPU_SHAPES[shape]
    assert_matches_reference(draw(rng, batch, HQ, HK, D, 192, dtype), "pallas")


@pytest.mark.gpu
def test_compiled_kernel_with_parts_matches_reference(rng):
    """A long cache (4096 positions) of one row in 66 parts joined by XLA."""
    HQ, HK, D = GPU_SHAPES["qwen3.5-4b"]
    assert_matches_reference(draw(rng, 1, HQ, HK, D, 4096, jnp.bfloat16), "pallas")


# ---------------------------------------------------------------------------
# The attention layers on the kernel (decode_backend)

DATA = pathlib.Path(__file__).parent / "data"


def _layer(rng, backend):
    """Qwen3.5's attention form (q/k norms, output gate, partial RoPE) at a small shape."""
    return Attention(32, 4, 2, 16, qk_norm=True, output_gate=True, rotary_dim=8, decode_backend=backend,
                     rngs=nnx.Rngs(int(rng.integers(1 << 30))))


def test_layer_decode_on_the_kernel(rng):
    """An Attention layer with decode_backend "interpret": a decode step (also over a state pool's slots)
    launches the kernel and equals the XLA form's output and cache; a verify window (W = 3) keeps XLA's
    products."""
    layer = _layer(rng, "interpret")
    prompt = jnp.asarray(rng.standard_normal((3, 5, 32)), jnp.float32)
    _, cache = layer.prefill(prompt, max_len=12)
    x = jnp.asarray(rng.standard_normal((3, 32)), jnp.float32)
    y, new = layer.decode(x, cache)
    layer.decode_backend = "xla"
    want, want_cache = layer.decode(x, cache)
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(want_cache)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    slots = jnp.asarray([2, 0], jnp.int32)
    want_pool = layer.decode(x[:2], cache, slots=slots)
    layer.decode_backend = "interpret"
    got_pool = layer.decode(x[:2], cache, slots=slots)
    np.testing.assert_allclose(np.asarray(got_pool[0]), np.asarray(want_pool[0]), rtol=1e-5, atol=1e-5)
    launches = [e for e in jaxpr_equations(jax.make_jaxpr(lambda x, c: layer.decode(x, c))(x, cache).jaxpr)
                if e.primitive.name == "pallas_call"]
    assert len(launches) == 1
    window = jnp.asarray(rng.standard_normal((3, 3, 32)), jnp.float32)
    assert not [e for e in jaxpr_equations(jax.make_jaxpr(lambda w, c: layer.verify(w, c))(window, cache).jaxpr)
                if e.primitive.name == "pallas_call"]


# Qwen3.5's fixture in the default run (its attention layer of the richer form: q/k norms, output gate,
# partial RoPE); Nemotron-H's `slow`: its attention layer calls the same kernel at the same heads and
# head_dim (4 query heads, 2 KV heads, 16), set through the same `HybridCausalLM.set_attention_decode_backend`.
@pytest.mark.parametrize("name", ["qwen3_5_tiny", pytest.param("nemotron_h_tiny", marks=pytest.mark.slow)])
def test_model_decodes_the_reference_tokens_on_the_kernel(name):
    """A fixture model with its attention layers on the kernel (interpreted) decodes transformers' greedy
    tokens, with both states."""
    model = load_model(DATA / name)
    model.set_attention_decode_backend("interpret")
    ref = np.load(DATA / name / "reference.npz")
    prompts, expected = ref["prompt_ids"], ref["generated_ids"]
    for state in ("standard", "replay"):
        replay = dict(buffer_len=4) if state == "replay" else {}
        out = Generator(model, state=state, backend="interpret", **replay).generate(
            prompts, expected.shape[1] - prompts.shape[1])
        np.testing.assert_array_equal(np.array(out.sequences), expected, err_msg=state)


def test_decode_backend_is_checked(rng):
    """A bad decode_backend raises naming it, at construction and in the model's setter (before any layer
    changes); a kernel backend is refused for a head_dim above the kernel's."""
    with pytest.raises(ValueError, match=re.escape("`decode_backend` must be one of 'pallas', 'interpret', 'xla' or "
                                                  "None; got 'gpu'")):
        _layer(rng, "gpu")
    with pytest.raises(TypeError, match=re.escape("`decode_backend` must be a str ('pallas', 'interpret', 'xla') or "
                                                 "None; got int 5")):
        _layer(rng, 5)
    with pytest.raises(ValueError, match=re.escape("`decode_backend` 'interpret' takes the decode attention kernel, "
                                                  "which takes head_dim <= 256; this layer's is 320 (use 'xla')")):
        Attention(64, 2, 1, 320, decode_backend="interpret")
    assert Attention(64, 2, 1, 320).decode_backend == "xla"
    model = load_model(DATA / "nemotron_h_tiny")
    with pytest.raises(ValueError, match=re.escape("`backend` must be one of 'pallas', 'interpret', 'xla' or None")):
        model.set_attention_decode_backend("triton")
    assert {m.decode_backend for _, m in nnx.iter_modules(model) if isinstance(m, Attention)} == {"xla"}

