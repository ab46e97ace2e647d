"""Causal self-attention with GQA, (partial) RoPE, optional output gate and q/k norms.

Covers the attention layers of the supported hybrids:

- Nemotron-H (`NemotronHAttention`): q/k/v/o projections, GQA, *no* positional
  encoding (the Mamba-2 layers carry position), no norms, no gate.
- Qwen3-Next / Qwen3.5 (`Qwen3NextAttention`, `Qwen3_5Attention`): ``q_proj``
  produces [query | gate] per head (2 * head_dim each), zero-centered RMSNorm
  ``q_norm`` / ``k_norm`` over head_dim, RoPE on the first
  ``rotary_dim = head_dim * partial_rotary_factor`` dims (rotate-half form),
  output multiplied by sigmoid(gate) before ``o_proj``.

Dimension names: batch, T = seqlen, num_heads, num_kv_heads (query head h uses
kv head h // (num_heads // num_kv_heads)), head_dim, max_len (KV cache length).

Scores use scale head_dim ** -0.5 and a float32 softmax, as transformers'
eager attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from replayssm_jax import kernels, ops
from replayssm_jax.layers.cache import KVCache, check_input, check_num_accepted, check_sizes, commit_layer_state
from replayssm_jax.ops import take_slots
from replayssm_jax.ops.validate import check_backend_name, check_commit_path, check_slots, check_tree, tree_parents
from replayssm_jax.reference.attention import attend
from replayssm_jax.layers.linear import Linear, default_rngs
from replayssm_jax.layers.norms import RMSNorm
from replayssm_jax.state import in_order

__all__ = ["Attention", "rope_inv_freq", "apply_rope"]


# The name scope of the attention scores and values (softmax(q k^T) v) over the KV cache.
ATTENTION_SCOPE = "attention"


def rope_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    """Default RoPE inverse frequencies, f32[rotary_dim // 2]: theta ** (-2i / rotary_dim)."""
    exponents = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate-half RoPE on the first 2 * len(inv_freq) dims of the last axis.

    Args:
      x: [batch, T, heads, head_dim].
      positions: int[batch, T].
      inv_freq: f32[rotary_dim // 2].

    Returns:
      [batch, T, heads, head_dim] of x.dtype; dims >= rotary_dim pass through.
    """
    rotary_dim = 2 * inv_freq.shape[0]
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [b, T, rd/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]  # [b, T, 1, rd]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


class Attention(nnx.Module):
    """Multi-head causal attention with GQA and a fixed-length KV cache.

    Args:
      hidden_size: model width.
      num_heads, num_kv_heads, head_dim: config `num_attention_heads`,
        `num_key_value_heads`, `head_dim`. num_kv_heads must divide num_heads.
      bias: `attention_bias` (q/k/v/o biases).
      output_gate: q_proj also produces a per-head gate; output *= sigmoid(gate).
      qk_norm: zero-centered RMSNorm over head_dim on queries and keys (eps = norm_eps).
      rotary_dim: number of rotated dims (0: no RoPE). Even, <= head_dim.
      rope_theta: RoPE base.
      decode_backend: the backend of a one-position step's attention over the cache
        (`replayssm_jax.ops.attention_decode`: "pallas", "interpret" or None, by platform, for its
        kernel, which reads the live positions only), or "xla" (the default: XLA's products over
        all max_len positions, as every other mode; the kernel has not yet been timed against them
        in a model). Settable afterwards (`HybridCausalLM.set_attention_decode_backend`).

    Parameters (Hugging Face names): ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``
    (`Linear`), and with qk_norm ``q_norm``, ``k_norm`` (`RMSNorm`, [head_dim]).

    Raises:
      ValueError: inconsistent sizes, an unknown decode_backend.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool = False,
                 output_gate: bool = False, qk_norm: bool = False, norm_eps: float = 1e-6, rotary_dim: int = 0,
                 rope_theta: float = 10000.0, decode_backend: str | None = "xla", param_dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        check_sizes("Attention", hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                    head_dim=head_dim)
        rngs = default_rngs(rngs)
        if num_heads % num_kv_heads:
            raise ValueError(f"Attention: `num_key_value_heads` must divide num_attention_heads = {num_heads}; "
                             f"got {num_kv_heads}")
        if rotary_dim < 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"Attention: `rotary_dim` must be even and in [0, head_dim = {head_dim}]; "
                             f"got {rotary_dim}")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.output_gate = output_gate
        self.rotary_dim = rotary_dim
        self.rope_theta = float(rope_theta)
        self.decode_backend = self.check_decode_backend(decode_backend)
        q_out = num_heads * head_dim * (2 if output_gate else 1)
        kw = dict(bias=bias, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = Linear(hidden_size, q_out, **kw)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, **kw)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, **kw)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, **kw)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=norm_eps, zero_centered=True, param_dtype=param_dtype)
            self.k_norm = RMSNorm(head_dim, eps=norm_eps, zero_centered=True, param_dtype=param_dtype)
        else:
            self.q_norm = None
            self.k_norm = None

    def check_decode_backend(self, backend: str | None, name: str = "decode_backend") -> str | None:
        """`backend` checked as this layer's decode_backend: a backend name (`check_backend_name`), and a
        kernel backend ("pallas", "interpret", None) only for a head_dim the decode attention kernel takes.

        Raises:
          TypeError, ValueError: naming `name`.
        """
        check_backend_name(name, backend)
        if backend != "xla" and self.head_dim > kernels.MAX_HEAD_DIM:
            raise ValueError(f"`{name}` {backend!r} takes the decode attention kernel, which takes head_dim <= "
                             f"{kernels.MAX_HEAD_DIM}; this layer's is {self.head_dim} (use 'xla')")
        return backend

    # -- pieces -------------------------------------------------------------------------------
    def _project(self, x: jax.Array, positions: jax.Array):
        """q [b, T, nh, D], k/v [b, T, kvh, D], gate [b, T, nh * D] | None."""
        batch, seqlen, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x)
        gate = None
        if self.output_gate:
            q = q.reshape(batch, seqlen, self.num_heads, 2 * d)
            q, gate = q[..., :d], q[..., d:].reshape(batch, seqlen, self.num_heads * d)
        else:
            q = q.reshape(batch, seqlen, self.num_heads, d)
        k = self.k_proj(x).reshape(batch, seqlen, self.num_kv_heads, d)
        v = self.v_proj(x).reshape(batch, seqlen, self.num_kv_heads, d)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k)
        if self.rotary_dim:
            inv_freq = rope_inv_freq(self.rotary_dim, self.rope_theta)
            q = apply_rope(q, positions, inv_freq)
            k = apply_rope(k, positions, inv_freq)
        return q, k, v, gate

    def _attend(self, q, k, v, mask):
        """q [b, T, nh, D]; k, v [b, S, kvh, D]; mask bool[b, T, S] -> [b, T, nh * D]. Its ops carry the
        name scope `ATTENTION_SCOPE` (profiles and bench/step_roofline.py tell attention apart by it)."""
        batch, seqlen, _, d = q.shape
        with jax.named_scope(ATTENTION_SCOPE):
            return attend(q, k, v, mask, d ** -0.5).reshape(batch, seqlen, self.num_heads * d)

    def _output(self, attn, gate):
        if gate is not None:
            attn = attn * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(attn.dtype)
        return self.o_proj(attn)

    # -- modes --------------------------------------------------------------------------------
    def __call__(self, x: jax.Array) -> jax.Array:
        """Full causal forward, no cache. x: [batch, T, hidden] -> [batch, T, hidden]."""
        y, _ = self._prefill(x, max_len=None)
        return y

    def prefill(self, x: jax.Array, max_len: int, cache: KVCache | None = None) -> tuple[jax.Array, KVCache]:
        """Causal forward over a prompt that starts at position 0, filling a new KV cache; or, given
        `cache`, over the next part of a prompt after the cached positions (`extend`: a chunked prefill).

        Args:
          x: [batch, T, hidden].
          max_len: cache length (>= T), static; with `cache`, its max_len is kept.
          cache: None, or the KVCache of the prompt's earlier parts.

        Returns:
          (y [batch, T, hidden], KVCache with length T for every row (with `cache`: length + T)).

        Raises:
          TypeError: `x` not float32 or bfloat16.
          ValueError: T > max_len; with `cache`, as `extend`.
        """
        if cache is not None:
            self._check_cache(cache, "prefill")
            return self.extend(x, cache)
        return self._prefill(x, max_len)

    @staticmethod
    def _check_cache(cache, what: str) -> None:
        if not isinstance(cache, KVCache):
            raise TypeError(f"Attention.{what}: `cache` must be a KVCache; got {type(cache).__name__}")

    def _prefill(self, x, max_len):
        check_input("Attention.prefill", "x", x, self.hidden_size, None, "T")
        batch, seqlen, _ = x.shape
        if max_len is not None and seqlen > max_len:
            raise ValueError(f"Attention.prefill: prompt length T = {seqlen} exceeds `max_len` = {max_len}")
        positions = jnp.broadcast_to(jnp.arange(seqlen, dtype=jnp.int32), (batch, seqlen))
        q, k, v, gate = self._project(x, positions)
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((seqlen, seqlen), bool)), (batch, seqlen, seqlen))
        y = self._output(self._attend(q, k, v, mask), gate)
        if max_len is None:
            return y, None
        pad = ((0, 0), (0, max_len - seqlen), (0, 0), (0, 0))
        cache = KVCache(k=jnp.pad(k, pad), v=jnp.pad(v, pad), length=jnp.full((batch,), seqlen, jnp.int32))
        return y, cache

    def extend(self, x: jax.Array, cache: KVCache, tree=None) -> tuple[jax.Array, KVCache]:
        """Append T tokens per row after its cached ones and attend causally.

        Args:
          x: [batch, T, hidden]; token t of row b gets position cache.length[b] + t.
          cache: KVCache.
          tree: None, or a :class:`~replayssm_jax.speculative.tree.DraftTree`
            of T nodes: token t gets position length + depth(t) and attends
            to the cache and to the window's tokens on its path root .. t
            (the ancestor mask); its K/V still go to length + t.

        Returns:
          (y [batch, T, hidden], cache with the new keys/values written and length += T). A row
          without room for T more positions: ValueError where `cache.length` is concrete; inside
          jit that row's y is NaN (its writes land on the last positions).
        """
        self._check_cache(cache, "extend")
        check_input("Attention.extend", "x", x, self.hidden_size, cache.k.shape[0], "T")
        batch, seqlen, _ = x.shape
        if cache.window:
            raise ValueError(f"Attention: `cache` has a pending verify window (W = {cache.window}); commit it first")
        if cache.k.shape[0] != batch or cache.k.shape[2:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"Attention: `cache.k` must have shape [batch, max_len, num_kv_heads, head_dim] = "
                             f"({batch}, max_len, {self.num_kv_heads}, {self.head_dim}); got {cache.k.shape}")
        if not isinstance(cache.length, jax.core.Tracer) and int(np.max(cache.length)) + seqlen > cache.max_len:
            raise ValueError(f"Attention: the KV cache is full: a row holds {int(np.max(cache.length))} of "
                             f"max_len = {cache.max_len} positions and {seqlen} more were given (the cache's "
                             f"length: a model's prefill with max_window W holds max_len + W - 1; prefill with a "
                             f"larger max_len; inside jit such a row's outputs are NaN)")
        offsets = jnp.arange(seqlen, dtype=jnp.int32) if tree is None else jnp.asarray(tree.depth, jnp.int32)
        positions = cache.length[:, None] + offsets[None, :]
        q, k, v, gate = self._project(x, positions)

        def write(buf, new, start):
            return jax.lax.dynamic_update_slice_in_dim(buf, new.astype(buf.dtype), start, axis=0)

        k_all = jax.vmap(write)(cache.k, k, cache.length)
        v_all = jax.vmap(write)(cache.v, v, cache.length)
        key_pos = jnp.arange(cache.max_len, dtype=jnp.int32)
        if tree is None:
            mask = key_pos[None, None, :] <= positions[:, :, None]
        else:  # the cache, and the window's entries (node order) on each token's path
            node = key_pos[None, :] - cache.length[:, None]  # [batch, max_len]: the window node of each entry
            on_path = jnp.take(jnp.asarray(tree.ancestors), jnp.clip(node, 0, seqlen - 1), axis=1)  # [T, b, max]
            in_window = (node >= 0) & (node < seqlen)
            mask = (node < 0)[:, None, :] | (in_window[:, None, :] & jnp.moveaxis(on_path, 0, 1))
        if seqlen == 1 and tree is None and self.decode_backend != "xla":  # one position: the op's kernel
            with jax.named_scope(ATTENTION_SCOPE):
                o = ops.attention_decode(q[:, 0], k_all.astype(q.dtype), v_all.astype(q.dtype), cache.length + 1,
                                         backend=self.decode_backend)
            y = self._output(o.reshape(batch, 1, self.num_heads * self.head_dim), gate)
        else:
            y = self._output(self._attend(q, k_all.astype(q.dtype), v_all.astype(q.dtype), mask), gate)
        # A traced length past the cache (checked above where concrete): the row's writes landed on the last
        # positions, so its outputs are NaN rather than silently wrong.
        y = jnp.where((cache.length + seqlen > cache.max_len)[:, None, None], jnp.nan, y).astype(y.dtype)
        length, y = in_order(cache.length, y)  # read before it moves: XLA updates it in place
        return y, KVCache(k=k_all, v=v_all, length=length + seqlen)

    def decode(self, x: jax.Array, cache: KVCache, slots=None) -> tuple[jax.Array, KVCache]:
        """One decode step. x: [batch, hidden] -> (y [batch, hidden], updated cache).

        slots: None, or i32[batch] (checked first:
        replayssm_jax.ops.validate.check_slots, ValueError or TypeError):
        `cache` is a state pool of capacity rows and row b decodes slot
        slots[b] (-1: a padding row, which changes nothing). XLA indexing:
        the slots' K/V rows are gathered (a copy of batch x max_len entries, which the
        attention reads anyway), and only each row's new entry and length
        are scattered back.
        """
        self._check_cache(cache, "decode")
        slots = check_slots(slots, cache.k.shape[0], None, ("x", x))
        check_input("Attention.decode", "x", x, self.hidden_size, cache.k.shape[0] if slots is None else None)
        if slots is None:
            y, cache = self.extend(x[:, None, :], cache)
            return y[:, 0], cache
        rows = take_slots(cache, slots)
        y, written = self.extend(x[:, None, :], rows)
        rows = jnp.arange(slots.shape[0])
        target = jnp.where(slots < 0, cache.k.shape[0], slots)  # padding rows: out of range, dropped
        at = (target, written.length - 1)
        k = cache.k.at[at].set(written.k[rows, written.length - 1], mode="drop")
        v = cache.v.at[at].set(written.v[rows, written.length - 1], mode="drop")
        return y[:, 0], cache.replace(k=k, v=v, length=cache.length.at[target].set(written.length, mode="drop"))

    def verify(self, x: jax.Array, cache: KVCache, tree=None, slots=None) -> tuple[jax.Array, KVCache]:
        """W speculative positions: K/V written at length..length+W-1, length not moved.

        Position t of row b has position cache.length[b] + t and attends to the
        row's cache and to window positions 0..t (causal mask); with a draft
        `tree` of W nodes, position length + depth(t) and the window's nodes
        on t's path (the ancestor mask, `extend`).

        Args:
          x: [batch, W, hidden].
          cache: KVCache without a pending window, with room: length + W <= max_len
            (checked where the lengths are concrete).
          tree: None or a DraftTree of W nodes.
          slots: None, or i32[batch] (checked as in `decode`): `cache` is a
            state pool of capacity rows and row b verifies slot slots[b] (-1:
            a padding row, which changes nothing); a chain window only. XLA
            indexing, as `decode`: the slots' K/V rows gathered (batch x
            max_len entries, which the attention reads anyway) and only the
            W new entries of each row scattered back.

        Returns:
          (y [batch, W, hidden], the cache with K/V written and ``window = W``;
          `commit` moves the length).

        Raises:
          TypeError: `x` not float32 or bfloat16.
          ValueError: a pending window, a cache of another shape, or no room.
        """
        self._check_cache(cache, "verify")
        slots = check_slots(slots, cache.k.shape[0], None, ("x", x))
        check_input("Attention.verify", "x", x, self.hidden_size, cache.k.shape[0] if slots is None else None, "W")
        window = x.shape[1]
        tree = check_tree(tree, window, "x.shape[1]")
        if slots is None:
            y, written = self.extend(x, cache, tree)
            return y, written.replace(length=cache.length, window=window, tree=tree_parents(tree))
        rows = take_slots(cache, slots)
        y, written = self.extend(x, rows)
        batch = jnp.arange(slots.shape[0])[:, None]
        positions = rows.length[:, None] + jnp.arange(window)[None, :]  # [batch, W]
        at = (jnp.where(slots < 0, cache.k.shape[0], slots)[:, None], positions)  # padding rows: dropped
        k = cache.k.at[at].set(written.k[batch, positions], mode="drop")
        v = cache.v.at[at].set(written.v[batch, positions], mode="drop")
        return y, cache.replace(k=k, v=v, window=window)

    def commit(self, cache: KVCache, num_accepted, path=None) -> KVCache:
        """Keep the first `num_accepted` (int[batch], 0..W) positions of the pending window:
        ``length += num_accepted`` (the rejected K/V are overwritten by later writes). With `path`
        (int[batch, P] after a tree verify: the accepted nodes, root first), the K/V of nodes
        path[:, :m] are first compacted to positions length .. length + m - 1.

        Raises:
          TypeError: non-integer counts or path.
          ValueError: no pending window, counts not [batch] or (concrete) outside 0..W; a path after a
            chain's verify or none after a tree's; a path not [batch, P] with P <= W, or (concrete) out of
            range or off the verified tree.
        """
        if not isinstance(cache, KVCache) or cache.window == 0:
            raise ValueError("Attention.commit: `cache` must be a KVCache with a pending verify window; got "
                             + ("window = 0" if isinstance(cache, KVCache) else type(cache).__name__))
        m = check_num_accepted(num_accepted, cache.k.shape[0], cache.window)
        return commit_layer_state(cache, m, check_commit_path(path, m, cache.window, cache.tree))

