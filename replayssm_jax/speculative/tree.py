"""A static draft tree: the shape of one round of tree speculation.

Tree speculation (SpecInfer: Miao et al., 2024, "SpecInfer: Accelerating
Large Language Model Serving with Tree-based Speculative Inference and
Verification"; ARCHITECTURE.md, "The verify window") verifies several continuations at once.
The N tree nodes are the positions of one verify call: node 0 is the root,
the last accepted token (parent -1); every other node j is a draft token
that follows its parent `parents[j] < j`. Node j's output is the target's
next-token distribution after the path root .. j, so the verify of node j
reads the state after its ancestors only (an ancestor mask in place of the
causal mask), and the records of the N nodes go to the buffer in node order.
A round accepts one path from the root; its records are then gathered to
contiguous slots (:func:`replayssm_jax.state.replay_commit` with `path`).

The chain of W positions (:meth:`DraftTree.chain`) is the special case
parents = (-1, 0, 1, ..., W - 2): every op given a chain runs the chain's
code (`is_chain`), so the chain's results are those of a plain window.

The tree is static (hashable, part of a compiled function's signature);
its derived data are NumPy arrays and Python tuples.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

__all__ = ["DraftTree", "as_tree"]


@dataclasses.dataclass(frozen=True)
class DraftTree:
    """A static tree of N draft positions given by parent indices.

    Attributes:
      parents: tuple of N ints: parents[0] = -1 (the root, the last accepted
        token); 0 <= parents[j] < j for j >= 1 (a parent comes before its
        children, so node order is a topological order).

    Derived (static): `size` N; `depth` (per node, root 0); `max_depth`;
    `ancestors` bool[N, N] (ancestors[i, j]: node j is on the path root .. i,
    i itself included); `children` (per node, in node order); `per_depth`
    (the nodes of each depth, in node order); `path(j)` (root .. j);
    `is_chain`.

    Raises:
      TypeError: `parents` not a sequence of ints.
      ValueError: no node (N < 1), parents[0] != -1, or a parent index not
        in [0, j) for node j (the error names the node, the expected range
        and the given index).
    """

    parents: tuple[int, ...]

    def __post_init__(self):
        try:
            parents = tuple(self.parents)
        except TypeError:
            raise TypeError(f"`parents` must be a sequence of ints; got {type(self.parents).__name__}") from None
        if any(isinstance(p, bool) or not isinstance(p, (int, np.integer)) for p in parents):
            raise TypeError(f"`parents` must be a sequence of ints; got {parents!r}")
        parents = tuple(int(p) for p in parents)
        if len(parents) < 1:
            raise ValueError("a draft tree needs at least one node (the root); got `parents` = ()")
        if parents[0] != -1:
            raise ValueError(f"`parents[0]` must be -1 (node 0 is the root, the last accepted token); "
                             f"got {parents[0]}")
        for j, p in enumerate(parents[1:], start=1):
            if not 0 <= p < j:
                raise ValueError(f"`parents[{j}]` must be in [0, {j}) (a parent comes before its child); got {p}")
        object.__setattr__(self, "parents", parents)

    # -- constructors -------------------------------------------------------------------------
    @classmethod
    def chain(cls, window: int) -> "DraftTree":
        """The chain of `window` positions (the root and window - 1 drafts): parents (-1, 0, ..., window - 2).

        Raises:
          ValueError: window < 1.
        """
        _check_count("window", window, 1)
        return cls(tuple(range(-1, window - 1)))

    @classmethod
    def topk(cls, topk: int, depth: int) -> "DraftTree":
        """The "first child expands" tree of `topk` candidates per depth.

        At each depth 1 .. depth the first (most likely) candidate of the
        previous depth gets `topk` children, the drafter's top-k tokens
        after it; the other candidates are leaves. N = 1 + topk * depth
        nodes; node order: the root, then depth 1's candidates in rank
        order, then depth 2's, ... (node 1 + topk * (d - 1) + r is the rank-r
        candidate at depth d, a child of node 1 + topk * (d - 2), the root
        for d = 1). topk = 1 is the chain of depth + 1 positions.

        Raises:
          ValueError: topk < 1 or depth < 0.
        """
        _check_count("topk", topk, 1)
        _check_count("depth", depth, 0)
        parents = [-1]
        for d in range(1, depth + 1):
            expanding = 0 if d == 1 else 1 + topk * (d - 2)
            parents += [expanding] * topk
        return cls(tuple(parents))

    # -- derived data -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        """N, the number of nodes (the verify call's positions)."""
        return len(self.parents)

    @functools.cached_property
    def depth(self) -> tuple[int, ...]:
        """Per node, the number of edges from the root (root 0)."""
        depth: list[int] = []
        for p in self.parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        return tuple(depth)

    @property
    def max_depth(self) -> int:
        """The deepest node's depth (0: the root alone)."""
        return max(self.depth)

    @functools.cached_property
    def ancestors(self) -> np.ndarray:
        """bool[N, N]: ancestors[i, j] is True where node j is on the path root .. i (j = i included)."""
        mask = np.zeros((self.size, self.size), bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        mask.setflags(write=False)
        return mask

    @functools.cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Per node, its children in node order."""
        return tuple(tuple(j for j, p in enumerate(self.parents) if p == i) for i in range(self.size))

    @functools.cached_property
    def per_depth(self) -> tuple[tuple[int, ...], ...]:
        """Per depth 0 .. max_depth, its nodes in node order."""
        return tuple(tuple(j for j, d in enumerate(self.depth) if d == level) for level in range(self.max_depth + 1))

    def path(self, node: int) -> tuple[int, ...]:
        """The nodes root .. `node`, in order (node order increases along it)."""
        return tuple(int(j) for j in np.flatnonzero(self.ancestors[node]))

    @property
    def is_chain(self) -> bool:
        """True for the chain (every node's parent is the node before it)."""
        return all(p == j - 1 for j, p in enumerate(self.parents))

    @functools.cached_property
    def path_table(self) -> np.ndarray:
        """i32[N, max_depth + 1]: row j is path(j), padded with j (the node itself) after its end."""
        table = np.zeros((self.size, self.max_depth + 1), np.int32)
        for j in range(self.size):
            path = self.path(j)
            table[j] = list(path) + [j] * (table.shape[1] - len(path))
        table.setflags(write=False)
        return table

    def tag(self) -> str:
        """A short name of the tree for kernel names: N nodes, depth, and a hash of the parents."""
        return f"tree{self.size}d{self.max_depth}h{hash(self.parents) & 0xFFFF:04x}"

    def __hash__(self):
        return hash(self.parents)

    def __eq__(self, other):
        return isinstance(other, DraftTree) and self.parents == other.parents

    def __repr__(self):
        return f"DraftTree(parents={self.parents})"


def _check_count(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"`{name}` must be an int >= {low}; got {value!r}")


def as_tree(tree, name: str = "tree") -> DraftTree:
    """`tree` as a DraftTree: a DraftTree as it is, or (topk, depth) as :meth:`DraftTree.topk`.

    Raises:
      TypeError: anything else (the error names `name`).
      ValueError: as :meth:`DraftTree.topk`.
    """
    if isinstance(tree, DraftTree):
        return tree
    if isinstance(tree, tuple) and len(tree) == 2:
        return DraftTree.topk(*tree)
    raise TypeError(f"`{name}` must be a DraftTree or a (topk, depth) pair; got {tree!r}")
