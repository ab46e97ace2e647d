"""Tree speculation at the op level: `DraftTree`, the tree verify of both
layers (reference on "xla", the kernels in interpret mode) and the commit of
an accepted path (`ops.replay_commit(..., path=)`).

The ground truth of a tree verify: node j's output is the chain verify of
the inputs on j's path (root .. j), from the same state, at its last
position; the tree's records sit at cursor + j in node order, and after the
commit of a path they equal the chain's records of that path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import assert_close
from kernel_checks import GDN, GDNShape, Mamba2, Mamba2Shape
from replayssm_jax import ops
from replayssm_jax.speculative.tree import DraftTree, as_tree

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")

# Awkward shapes: dims that are not powers of two, grouped heads.
SHAPES = {GDN: GDNShape(batch=3, H=1, HV=2, K=12, V=10), Mamba2: Mamba2Shape(batch=3, H=2, P=10, N=12, G=1)}
GPU_SHAPES = {GDN: GDNShape(batch=64, H=16, HV=32, K=128, V=128), Mamba2: Mamba2Shape(batch=64, H=96, P=80, N=128,
                                                                                      G=8)}
BUFFERS = {GDN: ("d", "k", "g"), Mamba2: ("x", "dt", "B")}
# A tree with a chain part, a restart from the root, a restart from an inner node and a leaf last.
TREE = DraftTree((-1, 0, 1, 0, 3, 1, 2))
L = 8
CURSORS = np.array([0, 2, 6], np.int32)  # the last row flushes early (6 + 7 > 8)


def verify(layer, rs, window, backend, tree=None):
    """The verify op on `backend`, jitted once per layer, backend, tree and shapes (the reference's
    ops would otherwise run one by one)."""
    return _jitted_verify(layer, backend, tree)(rs, window)


@functools.lru_cache(maxsize=None)
def _jitted_verify(layer, backend, tree):
    return jax.jit(lambda rs, window: layer._op("replay_verify", backend)(rs, **layer._kw(window), tree=tree))


def window_of(layer, N):
    steps = [layer.draw() for _ in range(N)]
    return {name: jnp.stack([s[name] for s in steps], axis=1) for name in steps[0]}


def path_window(window, path):
    return {name: a[:, list(path)] for name, a in window.items()}


def as_f32(a):
    return np.asarray(jnp.asarray(a, jnp.float32))


# -- the tree -----------------------------------------------------------------------------------


def test_tree_derived_data():
    t = TREE
    assert t.size == 7 and t.depth == (0, 1, 2, 1, 2, 2, 3) and t.max_depth == 3
    assert t.children == ((1, 3), (2, 5), (6,), (4,), (), (), ())
    assert t.per_depth == ((0,), (1, 3), (2, 4, 5), (6,))
    assert t.path(6) == (0, 1, 2, 6) and t.path(4) == (0, 3, 4) and t.path(0) == (0,)
    np.testing.assert_array_equal(t.ancestors[5], [True, True, False, False, False, True, False])
    np.testing.assert_array_equal(t.path_table[4], [0, 3, 4, 4])
    assert not t.is_chain and DraftTree.chain(4).is_chain and DraftTree.chain(4).parents == (-1, 0, 1, 2)
    top = DraftTree.topk(3, 2)  # the first child of each depth expands
    assert top.parents == (-1, 0, 0, 0, 1, 1, 1) and top.size == 1 + 3 * 2
    assert DraftTree.topk(1, 3) == DraftTree.chain(4) and DraftTree.topk(2, 0).size == 1
    assert as_tree((2, 2)) == DraftTree.topk(2, 2) and hash(as_tree(TREE)) == hash(DraftTree(TREE.parents))


@pytest.mark.parametrize("parents, error, match", [
    ((), ValueError, "at least one node"),
    ((0, 0), ValueError, r"`parents\[0\]` must be -1"),
    ((-1, 0, 2), ValueError, r"`parents\[2\]` must be in \[0, 2\).*got 2"),
    ((-1, 0, 3, 1), ValueError, r"`parents\[2\]` must be in \[0, 2\).*got 3"),
    ((-1, 1.0), TypeError, "sequence of ints"),
])
def test_bad_trees(parents, error, match):
    with pytest.raises(error, match=match):
        DraftTree(parents)


def test_bad_tree_arguments():
    with pytest.raises(ValueError, match="`topk` must be an int >= 1"):
        DraftTree.topk(0, 2)
    with pytest.raises(ValueError, match="`window` must be an int >= 1"):
        DraftTree.chain(0)
    with pytest.raises(TypeError, match="`tree` must be a DraftTree or a"):
        as_tree([1, 2])


@pytest.mark.parametrize("layer_cls", [GDN, Mamba2], ids=["gdn", "mamba2"])
def test_verify_refuses_bad_trees_state_usable(layer_cls):
    """A tree of another size than W, more nodes than L, or not a DraftTree: a clear error before any
    computation; the state then verifies as before."""
    layer, rs, window, y_ref, _ = _tree_case(layer_cls)
    short = layer.replay_state(4, jnp.float32, jnp.float32, np.zeros(layer.s.batch, np.int32))
    with pytest.raises(ValueError, match="one node per verified position, N = .* = 3; got a tree of 7 nodes"):
        verify(layer, rs, {name: a[:, :3] for name, a in window.items()}, "xla", TREE)
    with pytest.raises(ValueError, match=r"must be in \[1, L = 4\]; got 7"):
        verify(layer, short, window, "xla", TREE)
    with pytest.raises(TypeError, match="`tree` must be None or a DraftTree; got tuple"):
        verify(layer, rs, window, "xla", TREE.parents)
    with jax.default_matmul_precision("highest"):
        y, new = verify(layer, rs, window, "xla", TREE)
    np.testing.assert_array_equal(as_f32(y), as_f32(y_ref))
    assert new.window == TREE.size


# -- the tree verify --------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _tree_case(layer_cls):
    """(layer, state, window, reference verify) of the tree at L = 8, shared by the tests."""
    layer = layer_cls(SHAPES[layer_cls], np.random.default_rng(11))
    rs = layer.replay_state(L, jnp.float32, jnp.float32, CURSORS)
    window = window_of(layer, TREE.size)
    with jax.default_matmul_precision("highest"):
        y, new = verify(layer, rs, window, "xla", TREE)
    return layer, rs, window, y, new


@functools.lru_cache(maxsize=None)
def _chain_of_path(layer_cls, path):
    """The chain verify (y, state) of the tree case's inputs on `path`, from the same state."""
    layer, rs, window, _, _ = _tree_case(layer_cls)
    with jax.default_matmul_precision("highest"):
        return verify(layer, rs, path_window(window, path), "xla")


@pytest.mark.parametrize("layer_cls", [GDN, Mamba2], ids=["gdn", "mamba2"])
def test_reference_tree_is_the_chain_of_each_path(layer_cls):
    """Node j's output equals the chain verify of its path's inputs, at its last position (every node
    of the leaves' paths: 2, 4, 5, 6; the chain part 0, 1, 2 on the way); the records of the tree sit at
    start + j in node order; the checkpoint is not written (but by the early flush)."""
    layer, rs, window, y, new = _tree_case(layer_cls)
    start = np.where(CURSORS + TREE.size > L, 0, CURSORS)
    np.testing.assert_array_equal(np.asarray(new.cursor), start)
    assert new.window == TREE.size
    for leaf in (4, 5, 6):
        path = TREE.path(leaf)
        y_path, _ = _chain_of_path(layer_cls, path)
        for depth, j in enumerate(path):
            assert_close(y[:, j], y_path[:, depth], what=f"node {j}, path {path}")
    with jax.default_matmul_precision("highest"):
        y_chain, chain = verify(layer, rs, window, "xla")  # records in node order, as a chain's
    for name in BUFFERS[layer_cls]:
        if name in ("d",):  # the update vectors depend on the path
            continue
        np.testing.assert_array_equal(as_f32(getattr(new, name)), as_f32(getattr(chain, name)), err_msg=name)


@pytest.mark.parametrize("layer_cls", [GDN, Mamba2], ids=["gdn", "mamba2"])
def test_chain_tree_is_the_window(layer_cls):
    """DraftTree.chain(W) runs the window's code: bit-identical outputs and state, reference and kernels."""
    layer, rs, window, _, _ = _tree_case(layer_cls)
    window = {name: a[:, :4] for name, a in window.items()}
    for backend in ("xla", "interpret"):
        y, new = verify(layer, rs, window, backend)
        y_tree, new_tree = verify(layer, rs, window, backend, DraftTree.chain(4))
        np.testing.assert_array_equal(as_f32(y), as_f32(y_tree), err_msg=backend)
        for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(new_tree)):
            np.testing.assert_array_equal(as_f32(a), as_f32(b), err_msg=backend)


@pytest.mark.parametrize("layer_cls", [GDN, Mamba2], ids=["gdn", "mamba2"])
def test_kernel_tree_verify(layer_cls):
    """The interpreted kernels against the reference: outputs, cursor, checkpoint, every buffer slot."""
    layer, rs, window, y_ref, new_ref = _tree_case(layer_cls)
    with jax.default_matmul_precision("highest"):
        y, new = verify(layer, rs, window, "interpret", TREE)
    assert_close(y, y_ref, what="tree outputs")
    np.testing.assert_array_equal(np.asarray(new.cursor), np.asarray(new_ref.cursor))
    assert_close(as_f32(new.checkpoint), as_f32(new_ref.checkpoint), what="checkpoint")
    for name in BUFFERS[layer_cls]:
        assert_close(as_f32(getattr(new, name)), as_f32(getattr(new_ref, name)), what=f"buffer {name}")


@pytest.mark.parametrize("layer_cls", [GDN, Mamba2], ids=["gdn", "mamba2"])
def test_sibling_garbage_does_not_reach_other_branches(layer_cls):
    """NaN in node 3's inputs (a branch off the root): the nodes off its subtree keep their outputs."""
    layer, rs, window, y_ref, _ = _tree_case(layer_cls)
    garbage = {name: a.at[:, 3].set(np.nan) for name, a in window.items()}
    with jax.default_matmul_precision("highest"):
        y, _ = verify(layer, rs, garbage, "xla", TREE)
    clean = [j for j in range(TREE.size) if not TREE.ancestors[j, 3]]
    np.testing.assert_array_equal(as_f32(y[:, clean]), as_f32(y_ref[:, clean]))
    assert np.isnan(as_f32(y[:, [3, 4]])).all()


# -- the commit of a path ---------------------------------------------------------------------


@pytest.mark.parametrize("layer_cls", [GDN, Mamba2], ids=["gdn", "mamba2"])
def test_commit_path_equals_the_chain_of_the_path(layer_cls):
    """Rows accept different paths (a last child's, the full depth, an inner restart); after the commit the
    state equals that of the chain verify of each row's path committed in full (the materialized state
    and the output of the next step; the cursor moves by the path's length from the tree's start slot)."""
    layer, rs, window, _, new = _tree_case(layer_cls)
    paths = [(0, 3, 4), (0, 1, 2, 6), (0, 1, 5)]  # per row: a last child, the full depth, a restart
    P = TREE.max_depth + 1
    path = np.array([list(p) + [0] * (P - len(p)) for p in paths], np.int32)
    m = np.array([len(p) for p in paths], np.int32)
    committed = ops.replay_commit(new, m, path=path)
    step = layer.draw()
    with jax.default_matmul_precision("highest"):
        y_next, _ = layer.replay_step(committed, step)
        for b, p in enumerate(paths):
            chain = ops.replay_commit(_chain_of_path(layer_cls, p)[1], np.full(layer.s.batch, len(p), np.int32))
            start = 0 if CURSORS[b] + TREE.size > L else CURSORS[b]  # the tree's early flush, not the chain's
            assert int(committed.cursor[b]) == start + len(p)
            y_chain, _ = layer.replay_step(chain, step)
            assert_close(y_next[b], y_chain[b], what=f"row {b}, path {p}: the next step")
            assert_close(layer.materialize(committed)[b], layer.materialize(chain)[b], what=f"row {b}: state")


@pytest.mark.parametrize("layer_cls", [GDN], ids=["gdn"])
def test_commit_path_checks(layer_cls):
    layer, _, _, _, new = _tree_case(layer_cls)
    m = np.ones(layer.s.batch, np.int32)
    with pytest.raises(ValueError, match=r"`path` must have shape \[batch, P\]"):
        ops.replay_commit(new, m, path=np.zeros((layer.s.batch, 9), np.int32))
    with pytest.raises(ValueError, match=r"`path` must be in \[0, 6\] for every row"):
        ops.replay_commit(new, m, path=np.full((layer.s.batch, 2), 7, np.int32))
    with pytest.raises(ValueError, match="`num_accepted` must be <= the path length P = 2"):
        ops.replay_commit(new, m + 2, path=np.zeros((layer.s.batch, 2), np.int32))
    with pytest.raises(TypeError, match="`path` must have an integer dtype"):
        ops.replay_commit(new, m, path=np.zeros((layer.s.batch, 2), np.float32))
    off_root = np.zeros((layer.s.batch, 2), np.int32)
    off_root[1, 0] = 1
    with pytest.raises(ValueError, match="`path` must start at the root, node 0; row 1 starts at node 1"):
        ops.replay_commit(new, m, path=off_root)
    m[1] = 0  # a row that keeps no node: its path is not read
    assert int(ops.replay_commit(new, m, path=off_root).window) == 0
    assert int(ops.replay_commit(new, m, path=np.zeros((layer.s.batch, 2), np.int32)).window) == 0


@pytest.mark.parametrize("layer_cls", [Mamba2], ids=["mamba2"])
def test_commit_checks_the_path_against_the_verified_tree(layer_cls):
    """The verify records its tree's parents on the state; the commit refuses a path off the tree's edges,
    a repeated node, a missing path after a tree and a path after a chain, before the state changes: the
    same pending state then commits a path of the tree."""
    layer, _, _, _, new = _tree_case(layer_cls)
    assert new.tree == TREE.parents
    batch = layer.s.batch
    m = np.full(batch, 3, np.int32)
    with pytest.raises(ValueError, match=r"row 0: node 2 \(position 1\) has parent 1, not node 0"):
        ops.replay_commit(new, m, path=np.tile([0, 2, 6], (batch, 1)).astype(np.int32))
    with pytest.raises(ValueError, match=r"row 0: node 1 \(position 2\) has parent 0, not node 1"):
        ops.replay_commit(new, m, path=np.tile([0, 1, 1], (batch, 1)).astype(np.int32))
    with pytest.raises(ValueError, match="`path` is required after a draft tree's verify"):
        ops.replay_commit(new, m)
    chain = _chain_of_path(layer_cls, (0, 1, 2))[1]
    assert chain.tree is None
    with pytest.raises(ValueError, match="the pending window is a chain's"):
        ops.replay_commit(chain, m, path=np.tile([0, 1, 2], (batch, 1)).astype(np.int32))
    committed = ops.replay_commit(new, m, path=np.tile([0, 3, 4], (batch, 1)).astype(np.int32))
    assert committed.tree is None and committed.window == 0
    np.testing.assert_array_equal(np.asarray(committed.cursor - new.cursor), m)


@pytest.mark.gpu
@pytest.mark.parametrize("layer_cls", [GDN, Mamba2], ids=["gdn", "mamba2"])
@pytest.mark.parametrize("tree", [DraftTree.topk(2, 3), DraftTree.topk(4, 2)], ids=["topk2-depth3", "topk4-depth2"])
def test_kernel_tree_verify_gpu(layer_cls, tree):
    """The compiled kernels at the model shapes against the reference."""
    layer = layer_cls(GPU_SHAPES[layer_cls], np.random.default_rng(3))
    rs = layer.replay_state(16, jnp.float32, jnp.float32, np.arange(layer.s.batch, dtype=np.int32) % 17)
    window = window_of(layer, tree.size)
    with jax.default_matmul_precision("highest"):
        y, new = verify(layer, rs, window, "pallas", tree)
        y_ref, new_ref = verify(layer, rs, window, "xla", tree)
    assert_close(y, y_ref, what="tree outputs")
    for name in BUFFERS[layer_cls]:
        assert_close(as_f32(getattr(new, name)), as_f32(getattr(new_ref, name)), what=f"buffer {name}")


def test_tree_verify_tiling():
    """A tree that is not a chain holds two state tiles (the window's start and the node's): half the rows
    of the chain's tiling, in the same budget; a chain keeps the window's tiling."""
    from replayssm_jax import kernels

    chain = kernels.default_verify_config(64, 32, 128, 128, jnp.float32, 16, 7)
    assert kernels.default_verify_config(64, 32, 128, 128, jnp.float32, 16, 7, TREE).block_v == chain.block_v // 2
    assert kernels.default_verify_config(64, 32, 128, 128, jnp.float32, 16, 4, DraftTree.chain(4)) == \
        kernels.default_verify_config(64, 32, 128, 128, jnp.float32, 16, 4)
