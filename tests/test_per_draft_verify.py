"""The per-draft standard verify (`ops.mamba2_verify`, `ops.gdn_verify`): the
standard-state baseline of speculative decoding, one state per draft
position in a slotted state, committed by an index move.

The reference against a loop of standard steps; the kernel (backend
"interpret" on the CPU, "pallas" under `-m gpu`) against the reference at
awkward shapes (heads and rows not multiples of the tile, batch 3, W in
{1, 2, 4}, chain and tree, f32 and bf16 states); its Triton lowering and
aliasing; the commit's index semantics; bad input.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import assert_close
from kernel_checks import DTYPES, GDN, GDNShape, Mamba2, Mamba2Shape, lower_for_cuda, tol_dtype
from replayssm_jax import kernels, ops
from replayssm_jax.layers.cache import ConvWindow, SSMLayerState, commit_layer_state, committed_index
from replayssm_jax.speculative.tree import DraftTree

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

TREE = DraftTree((-1, 0, 0, 1))  # the root, two children of it, a grandchild under the first
SHAPES = {  # batch 3; heads, rows and columns not multiples of the tiles
    GDN: GDNShape(batch=3, H=2, HV=6, K=20, V=24),
    Mamba2: Mamba2Shape(batch=3, H=3, P=24, N=10, G=1, dt_limit=(0.05, 0.8)),
}
GPU_SHAPES = {  # the Qwen3.5-4B GDN layer and the Nemotron-3-Nano-4B Mamba-2 layer
    GDN: GDNShape(batch=8, H=16, HV=32, K=128, V=128),
    Mamba2: Mamba2Shape(batch=8, H=96, P=80, N=128, G=8),
}


def verify(layer, state, index, window, backend, tree=None, config=None):
    """(y, state) of the layer's per-draft verify op on `backend`."""
    kw = {} if config is None else {"config": config}
    return getattr(ops, f"{layer.layer}_verify")(state, index, **layer._kw(window), tree=tree, backend=backend, **kw)


def slotted(layer, slots, dtype):
    """A random slotted state [batch, slots, ...] in `dtype` (every slot random) and the index 0, 2, 4, ... mod
    slots."""
    state = jnp.stack([jnp.asarray(layer.state(dtype)) for _ in range(slots)], axis=1)
    return state, jnp.arange(0, 2 * layer.s.batch, 2, dtype=jnp.int32) % slots


@pytest.mark.parametrize("adapter, tree", [(GDN, None), (Mamba2, TREE)], ids=["gdn-chain", "mamba2-tree"])
def test_reference_keeps_each_standard_step_in_its_slot(adapter, tree, rng):
    layer = adapter(SHAPES[adapter], rng)
    W, slots = 4, 6
    state, index = slotted(layer, slots, jnp.float32)
    window = layer.draw(W)
    y, new = verify(layer, state, index, window, "xla", tree)
    rows = np.arange(layer.s.batch)
    parents = range(-1, W - 1) if tree is None else tree.parents
    after = []
    for t, parent in enumerate(parents):  # node t: one standard step from its parent's state
        y_t, s_t = layer.step(state[rows, index] if parent < 0 else after[parent],
                              {k: a[:, t] for k, a in window.items()})
        after.append(s_t)
        assert_close(y[:, t], y_t, what=f"y of node {t}")
        assert_close(new[rows, (np.asarray(index) + 1 + t) % slots], s_t, what=f"state of node {t}")
    untouched = [(np.asarray(index) + 1 + W + i) % slots for i in range(slots - W)]  # the current slot among them
    for s in untouched:
        np.testing.assert_array_equal(np.asarray(new[rows, s]), np.asarray(state[rows, s]))


# (adapter, W, tree, dtypes, block_v): the tile rows 16 leave a partial tile of V = P = 24.
KERNEL_CASES = [
    (GDN, 1, None, "f32", None),
    (GDN, 4, TREE, "bf16in-bf16state", 16),
    (Mamba2, 2, None, "bf16in-f32state", 16),
    (Mamba2, 4, TREE, "f32", None),
]


def check_kernel(layer, W, tree, dtypes, backend, config=None):
    state, index = slotted(layer, W + 1, DTYPES[dtypes].state)
    window = layer.draw(W)
    y_k, s_k = verify(layer, state, index, window, backend, tree, config)
    with jax.default_matmul_precision("highest"):
        y_r, s_r = verify(layer, state, index, window, "xla", tree)
    tol = tol_dtype(*DTYPES[dtypes][:2])
    assert s_k.dtype == state.dtype and y_k.dtype == y_r.dtype
    assert_close(y_k, y_r, tol, what="y")
    assert_close(s_k, s_r, tol, what="the slots")
    rows = np.arange(layer.s.batch)
    np.testing.assert_array_equal(np.asarray(s_k[rows, index], np.float32), np.asarray(state[rows, index], np.float32))


@pytest.mark.parametrize("adapter, W, tree, dtypes, block_v", KERNEL_CASES,
                         ids=["gdn-W1-f32", "gdn-W4-tree-bf16", "mamba2-W2-bf16in", "mamba2-W4-tree-f32"])
def test_kernel_matches_reference(adapter, W, tree, dtypes, block_v, rng):
    layer = adapter(SHAPES[adapter], rng, DTYPES[dtypes].input)
    check_kernel(layer, W, tree, dtypes, "interpret", None if block_v is None else kernels.StepConfig(block_v=block_v))


@pytest.mark.parametrize("adapter, tree", [(GDN, TREE), (Mamba2, None)], ids=["gdn-tree", "mamba2-chain"])
def test_one_launch_in_place_lowers_for_cuda(adapter, tree, rng):
    """The Triton lowering of the launch at the model's shape: one kernel, the state operand 0 aliased to
    output 1."""
    layer = adapter(GPU_SHAPES[adapter].with_batch(2), rng, jnp.bfloat16)
    state, index = slotted(layer, 5, jnp.float32)
    window = layer.draw(4)
    if adapter is GDN:
        fn = lambda s, i, w: kernels.gdn_verify(s, i, **w, scale=0.1, use_qk_l2norm=True, tree=tree)  # noqa: E731
    else:
        fn = lambda s, i, w: kernels.mamba2_verify(s, i, **layer._kernel_args(w), tree=tree)  # noqa: E731
    text = lower_for_cuda(fn, state, index, window)
    calls = [line for line in text.splitlines() if "custom_call" in line and "triton" in line]
    assert len(calls) == 1 and f"{layer.layer}_per_draft_W4_S5" in text, calls
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", calls[0])
    assert [(int(o), int(i)) for o, i in aliases] == [(1, 0)], calls[0][:2000]


@pytest.mark.gpu
@pytest.mark.parametrize("adapter", [GDN, Mamba2], ids=["gdn", "mamba2"])
@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("dtypes", ["f32", "bf16in-bf16state"])
def test_kernel_matches_reference_gpu(adapter, tree, dtypes, rng):
    layer = adapter(GPU_SHAPES[adapter], rng, DTYPES[dtypes].input)
    check_kernel(layer, 4, tree, dtypes, "pallas")


def window_state(slots=5, W=4, batch=4):
    """A slotted SSMLayerState with a pending window of W positions (random slots, index 0..batch-1)."""
    conv = ConvWindow.from_conv_state(jnp.zeros((batch, 3, 2)), max_window=W)
    return SSMLayerState(conv_state=conv, ssm_state=jnp.asarray(np.random.default_rng(0).normal(
        size=(batch, slots, 2, 3, 2)), jnp.float32), index=jnp.arange(batch, dtype=jnp.int32) % slots, window=W)


def test_commit_moves_the_index_only():
    state = window_state()
    m = jnp.asarray([0, 4, 1, 2], jnp.int32)  # mixed rows: m = 0 keeps the current slot, m = W the last draft's
    new = commit_layer_state(state, m)
    assert new.window == 0 and new.ssm_state is state.ssm_state  # no state copied
    np.testing.assert_array_equal(np.asarray(new.index), [0, (1 + 4) % 5, (2 + 1) % 5, (3 + 2) % 5])
    np.testing.assert_array_equal(np.asarray(new.conv_state.start), np.asarray(m) % new.conv_state.slots)
    np.testing.assert_array_equal(np.asarray(new.current_state()),
                                  np.asarray(state.ssm_state)[np.arange(4), np.asarray(new.index)])
    # a tree path: the accepted node path[m - 1]'s slot (node j at index + 1 + j)
    path = jnp.asarray([[0, 1, 3], [0, 2, 3], [0, 1, 3], [0, 2, 3]], jnp.int32)
    new = commit_layer_state(state, jnp.asarray([0, 2, 3, 1], jnp.int32), path)
    np.testing.assert_array_equal(np.asarray(new.index), [0, (1 + 1 + 2) % 5, (2 + 1 + 3) % 5, (3 + 1 + 0) % 5])
    assert new.ssm_state is state.ssm_state
    np.testing.assert_array_equal(np.asarray(committed_index(jnp.asarray([4]), 5, jnp.asarray([4]))), [3])


@pytest.mark.parametrize("change, error, message", [
    (dict(x=lambda a: a[:, :0]), ValueError, r"`x` must have no empty axis \[batch, W, nheads, head_dim\]"),
    (dict(state=lambda s: s[:, :4], index=lambda i: i % 4), ValueError,
     r"the window length W = x.shape\[1\] must be in \[1, slots - 1 = 3\]"),
    (dict(state=lambda s: s[:, 0]), ValueError, r"`state` must have rank 5 \[batch, slots, nheads, head_dim, "),
    (dict(state=lambda s: s.astype(jnp.int8)), TypeError, "`state` must have dtype float32 or bfloat16; got int8: "
                                                          "8-bit states are supported as replay checkpoints only"),
    (dict(state=lambda s: s.astype(jnp.float16)), TypeError, r"`state` must have dtype in \(float32, bfloat16\)"),
    (dict(index=lambda i: i[:2]), ValueError, r"`index` must have shape \[batch\] = \(3,\); got \(2,\)"),
    (dict(index=lambda i: i + 5), ValueError, r"`index` must be in \[0, 4\] for every row"),
    (dict(index=lambda i: i.astype(jnp.float32)), TypeError, "`index` must have an integer dtype"),
    (dict(tree=DraftTree((-1, 0))), ValueError, r"`tree` must have one node per verified position, N = x.shape\[1\] "
                                                r"= 4; got a tree of 2 nodes"),
], ids=["W0", "too-few-slots", "rank", "int8", "float16", "index-shape", "index-range", "index-dtype", "tree-size"])
def test_bad_input_is_refused_before_any_kernel(change, error, message, rng):
    layer = Mamba2(SHAPES[Mamba2], rng)
    state, index = slotted(layer, 5, jnp.float32)
    before = np.asarray(state)
    args = dict(state=state, index=index, x=None, tree=None)
    window = layer.draw(4)
    for name, fn in change.items():
        if name == "x":
            window["x"] = fn(window["x"])
        elif name == "tree":
            args["tree"] = fn
        else:
            args[name] = fn(args[name])
    with pytest.raises(error, match=message):
        ops.mamba2_verify(args["state"], args["index"], **layer._kw(window), tree=args["tree"], backend="interpret")
    np.testing.assert_array_equal(np.asarray(state), before)  # the caller's state is usable, unchanged


def test_gdn_bad_window_names_v(rng):
    layer = GDN(SHAPES[GDN], rng)
    state, index = slotted(layer, 3, jnp.float32)
    with pytest.raises(ValueError, match=r"the window length W = v.shape\[1\] must be in \[1, slots - 1 = 2\] "
                                         r"\(`state` has 3 slots: the current state's and one per draft position\); "
                                         r"got 4"):
        verify(layer, state, index, layer.draw(4), "xla")
