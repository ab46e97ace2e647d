"""Causal depthwise conv1d with a rolling `conv_state` (the short conv of Mamba-2 and GDN).

Dimension letters: batch, T = seqlen, C = conv_dim (channels), W = conv width
(config `conv_kernel` / `linear_conv_kernel_dim`, typically 4).

The conv state holds the last W - 1 *inputs* (before the conv), channel-major:
``conv_state: [batch, C, W - 1]``, oldest first. This is mamba_ssm's
``causal_conv1d_update`` convention with one slot fewer than transformers'
cache (which keeps W slots, the oldest of them never read). The prefill
(``__call__``) takes and returns that array; the decode step and the verify
window work on a `replayssm_jax.layers.cache.ConvWindow`, a ring of
(W - 1) + max_window inputs into which each call writes only its new ones.

Math (torch ``nn.Conv1d(C, C, W, groups=C, padding=W-1)`` cut to the first T
outputs): with xp = [conv_state ; x] along time,

    y[b, t, c] = act(bias[c] + sum_{j < W} weight[c, 0, j] * xp[b, t + j, c]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax import ops
from replayssm_jax.layers.cache import ConvWindow
from replayssm_jax.layers.linear import default_rngs
from replayssm_jax.ops.validate import check_pieces
from replayssm_jax.reference.conv import ACTIVATIONS
from replayssm_jax.state import in_order

__all__ = ["CausalConv1d", "ACTIVATIONS"]


def get_activation(name: str):
    """The activation function for a transformers `hidden_act` name.

    Raises:
      ValueError: an unknown name (lists the known ones).
    """
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}") from None


class CausalConv1d(nnx.Module):
    """Depthwise causal conv1d over time, Hugging Face parameter names.

    Args:
      channels: C (conv_dim).
      kernel_size: W.
      bias: whether there is a ``bias`` parameter (Mamba-2 `use_conv_bias`; GDN has none).
      activation: applied to the conv output ("silu" in all supported models).

    Parameters: ``weight``: [C, 1, W] (torch Conv1d layout); ``bias``: [C].
    """

    def __init__(self, channels: int, kernel_size: int, *, bias: bool, activation: str = "silu",
                 param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = default_rngs(rngs)
        if kernel_size < 1:
            raise ValueError(f"CausalConv1d: `kernel_size` must be >= 1; got {kernel_size}")
        self.channels = channels
        self.kernel_size = kernel_size
        self.activation = activation
        self._act = get_activation(activation)
        self.weight = nnx.Param(
            (kernel_size ** -0.5) * jax.random.normal(rngs.params(), (channels, 1, kernel_size), param_dtype))
        self.bias = nnx.Param(jnp.zeros((channels,), param_dtype)) if bias else None

    def init_state(self, batch: int, dtype=jnp.float32) -> jax.Array:
        """Zeros, [batch, C, W - 1]: the conv state of an empty prefix."""
        return jnp.zeros((batch, self.channels, self.kernel_size - 1), dtype)

    def _check_state(self, conv_state, batch):
        want = (batch, self.channels, self.kernel_size - 1)
        if conv_state.shape != want:
            raise ValueError(f"CausalConv1d: `conv_state` must have shape [batch, C, W-1] = {want}; "
                             f"got {conv_state.shape}")

    def _check_window(self, window, batch, seqlen, what):
        if not isinstance(window, ConvWindow):
            raise TypeError(f"CausalConv1d.{what}: `conv_state` must be a ConvWindow; got {type(window).__name__}")
        if window.width != self.kernel_size or window.columns.shape[::2] != (batch, self.channels):
            raise ValueError(f"CausalConv1d.{what}: `conv_state` must be a ConvWindow of width W = "
                             f"{self.kernel_size} with columns [batch, S, C] = ({batch}, S, {self.channels}) (batch: "
                             f"axis 0 of `x`); got width {window.width}, columns {window.columns.shape}")
        if seqlen > window.max_window:
            raise ValueError(f"CausalConv1d.{what}: `x` has {seqlen} positions; the conv window holds at most "
                             f"max_window = {window.max_window} (prefill with a larger max_window)")

    def _convolve(self, xp, seqlen, dtype, taps=None):
        """y [batch, T, C] of `dtype` from xp [batch, W - 1 + T, C] (the inputs before and of the T outputs).

        taps: None (output t reads xp[t .. t + W - 1]), or a static int array [T, W]: output t reads
        xp[taps[t]] (a draft tree's paths, `tree_taps`)."""
        w = self.weight[...][:, 0, :].astype(jnp.float32)  # [C, W]

        def tap(j):
            return xp[:, j:j + seqlen, :] if taps is None else xp[:, taps[:, j], :]

        acc = sum(tap(j).astype(jnp.float32) * w[:, j] for j in range(self.kernel_size))
        if self.bias is not None:
            acc = acc + self.bias[...].astype(jnp.float32)
        return self._act(acc).astype(dtype)

    def _check_x(self, x, offset, splits, what: str, rank: int) -> tuple[int, tuple[int, ...]]:
        """(offset, splits) checked for an input x of `rank` axes whose C conv inputs are
        x[..., offset:offset + C] (offset None: 0, x exactly C wide).

        Raises:
          ValueError: x of another rank; x not C columns wide without an offset, an offset or splits
            outside x or C (`check_pieces`)."""
        if getattr(x, "ndim", None) != rank:
            axes = "[batch, " + "T, " * (rank == 3)
            raise ValueError(f"CausalConv1d.{what}: `x` must be an array of shape {axes}{self.channels}] (or "
                             f"{axes}X] with `offset`); got {getattr(x, 'shape', type(x).__name__)}")
        try:
            offset, splits = check_pieces(offset, splits, x.shape[-1], self.channels)
        except (TypeError, ValueError) as e:
            raise type(e)(f"CausalConv1d.{what}: {e}") from None
        return offset, splits

    def __call__(self, x: jax.Array, conv_state: jax.Array | None = None, *, offset: int | None = None,
                 splits=()) -> tuple[jax.Array | tuple[jax.Array, ...], jax.Array]:
        """Prefill: convolve a whole sequence.

        Args:
          x: [batch, T, C]; with `offset`, [batch, T, X] holding the C inputs at columns
            offset .. offset + C - 1 (a packed projection).
          conv_state: [batch, C, W - 1] inputs preceding x, or None (zeros).
          splits: increasing channel indices in (0, C): y comes back cut into pieces there.

        Returns:
          (y [batch, T, C] of x.dtype, after the activation, or its pieces with `splits`; new conv_state
          [batch, C, W - 1] of x.dtype: the last W - 1 inputs of [conv_state ; x]).

        Raises:
          ValueError: x not [batch, T, C] (or X wide with an offset inside it), bad splits, a conv_state of
            another shape.
        """
        offset, splits = self._check_x(x, offset, splits, "__call__", 3)
        x = x[..., offset:offset + self.channels]
        batch, seqlen, _ = x.shape
        width = self.kernel_size
        if conv_state is None:
            conv_state = self.init_state(batch, x.dtype)
        self._check_state(conv_state, batch)
        xp = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2).astype(x.dtype), x], axis=1)  # [b, W-1+T, C]
        new_state = jnp.swapaxes(xp[:, xp.shape[1] - (width - 1):, :], 1, 2)
        return _cut(self._convolve(xp, seqlen, x.dtype), splits), new_state

    def verify(self, x: jax.Array, conv_state: ConvWindow, tree=None, *, offset: int | None = None,
               splits=()) -> tuple[jax.Array | tuple[jax.Array, ...], ConvWindow]:
        """A verify window: T new inputs after the live ones, written into the ring, start unchanged.

        Args:
          x: [batch, T, C], 1 <= T <= conv_state.max_window; with `offset`, [batch, T, X] holding the C
            inputs at columns offset .. offset + C - 1.
          conv_state: `ConvWindow` of this conv's width and channels.
          tree: None, or a :class:`~replayssm_jax.speculative.tree.DraftTree`
            of T nodes: output t convolves the inputs on t's path root .. t
            (after the live ones), not the T positions before it.
          splits: increasing channel indices in (0, C): y comes back cut into pieces there.

        Returns:
          (y [batch, T, C] of x.dtype (its pieces with `splits`): output t assumes inputs 0..t-1 of the
          window (of a tree: t's ancestors) are accepted; the ConvWindow with
          the T inputs written in node order, for ``advance(m)`` to keep the
          first m, after ``keep_path`` for a tree).

        Raises:
          TypeError: `conv_state` not a ConvWindow.
          ValueError: shapes that do not match, bad offset or splits, or T > max_window.
        """
        offset, splits = self._check_x(x, offset, splits, "verify", 3)
        x = x[..., offset:offset + self.channels]
        batch, seqlen, _ = x.shape
        self._check_window(conv_state, batch, seqlen, "verify")
        xp = jnp.concatenate([conv_state.live().astype(x.dtype), x], axis=1)  # [b, W-1+T, C]
        y = self._convolve(xp, seqlen, x.dtype, None if tree is None or tree.is_chain else tree_taps(tree,
                                                                                                   self.kernel_size))
        conv_state, y = in_order(conv_state, y)  # the live inputs are read before the ring is written
        return _cut(y, splits), conv_state.write(x)

    def step(self, x: jax.Array, conv_state: ConvWindow, *, backend: str | None = None, offset: int | None = None,
             splits=()) -> tuple[jax.Array | tuple[jax.Array, ...], ConvWindow]:
        """Decode: one new time step, its input written into the ring in place
        (`replayssm_jax.ops.conv_update`: one kernel launch on the kernel backends, which reads a packed x
        at its offset and writes y's pieces where its channel block divides their boundaries).

        Args:
          x: [batch, C], the new input; with `offset`, [batch, X] holding it at columns
            offset .. offset + C - 1 (a decode layer's packed projection).
          conv_state: `ConvWindow` of this conv's width and channels.
          backend: passed to `ops.conv_update`.
          splits: increasing channel indices in (0, C): y comes back cut into pieces there.

        Returns:
          (y [batch, C] of x.dtype (its pieces with `splits`), the ConvWindow with x live and the oldest
          input dropped).

        Raises:
          TypeError, ValueError: as `verify`.
        """
        offset, splits = self._check_x(x, offset, splits, "step", 2)
        self._check_window(conv_state, x.shape[0], 1, "step")
        y, columns = ops.conv_update(x, conv_state.columns, conv_state.start, self.weight[...][:, 0, :],
                                     None if self.bias is None else self.bias[...], self.activation, offset=offset,
                                     splits=splits, backend=backend)
        window = conv_state.replace(columns=columns)
        window, y = in_order(window, y)  # the write has read start before start moves
        return y, window.advance(1)


def _cut(y, splits: tuple[int, ...]):
    """y, or the tuple of its pieces along the channel axis at `splits`."""
    return tuple(jnp.split(y, splits, axis=-1)) if splits else y


def tree_taps(tree, width: int) -> np.ndarray:
    """i32[N, width]: per node t of a draft tree, the positions in [live inputs (width - 1); the N nodes'
    inputs] that its conv output reads, oldest first: the last `width` of the live inputs followed by
    the inputs of the nodes on t's path root .. t (static)."""
    taps = np.zeros((tree.size, width), np.int32)
    for t in range(tree.size):
        sequence = list(range(width - 1)) + [width - 1 + j for j in tree.path(t)]
        taps[t] = sequence[-width:]
    return taps
