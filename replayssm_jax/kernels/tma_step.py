"""The Gated DeltaNet steps that write the state, on Mosaic GPU: the replay
step's direct route and the standard step, the state tiles streamed through
shared memory and back by TMA copies, pipelined.

The direct route (:func:`replayssm_jax.kernels.gdn_replay_step`,
route="direct") is the standard step on the checkpoint after the row's
live records: in `Generator`'s lockstep cycle it is the step that flushes
every row (L - 1 records live). Both run as two launches:

- a Triton prelude: for the direct route the append route's prelude on
  route "direct" (`replayssm_jax.kernels.gdn._head_terms`; pure-JAX form
  :func:`direct_terms` and :func:`clear_dead_keys`): q and k L2-normalized
  (q scaled), the live slots' decay weights w_i (0 in dead slots) and exp
  of the live log decays' sum, k . q, exp(g) and beta, each row's cursor at
  entry for the kernel, the dead slots' k records zeroed in rows with live
  records, and the cursor set to 0 in place; for the standard step
  `replayssm_jax.kernels.gdn._step_terms` (pure-JAX form
  :func:`step_terms`): q, k and the scalars only;
- the Mosaic GPU step (:func:`gdn_direct_tma`, :func:`gdn_step_tma`):
  persistent programs, `config.programs_per_sm` per SM, walk the (batch
  row, value head, row tile) items, each exactly once (the state is
  written in place): a program pipelines items program, program +
  programs, ... over the grid's whole rounds, and the programs below the
  remainder take one item more in a second pipeline. `plgpu.emit_pipeline`
  copies an item's state tile [block_v, K], terms, q, k and v (and for the
  direct route its d records [L, block_v] and its key head's k records
  [L, K]) into shared memory ahead of the item it computes, and stores the
  new state tile (in place) and the outputs. An item computes, with S_c
  the state tile (ARCHITECTURE.md, "The math", `replay_math.replay_records`; Yang,
  Kautz & Hatamizadeh, "Gated Delta Networks", ICLR 2025, for the step):

      S = exp(sum of the live g) S_c + sum_{i < cursor} w_i d_i k_i^T   (direct route)
      d = beta (v - exp(g) S k),  S' = exp(g) S + d k^T,  o = S' q

  the fold: for an f32 tile (:func:`folds_in_place`), in a row with live
  records, by `tma_readout.fold_tile` in the tile's shared-memory buffer,
  with bf16 k records and L a multiple of 16 on the tensor cores (the
  weighted d records split in three exact bf16 parts, so each product is
  exact, summed with S in the tensor cores' f32 accumulator; a dead slot's
  record selected out and its key zeroed by the prelude), else as L outer
  products (f32 FMAs, dead slots selected out); for a bf16 tile, which
  that store would round before the step, as L outer products in
  registers.

The standard step is no default: at Qwen3.5-4B's layer, batch 256, f32, on
the H200 it took 287.4 us (prelude included) against the Triton kernel's
282.6 on 32-row tiles and 4 warps (and 288.0 against 274.8 on the 16-row
tiles and one warp that later became its default) (bench/RESULTS.md,
2026-12-03). The direct step took 704 us against 385 with its fold as
outer products, which with one program an SM do not hide under the copies;
on the tensor cores (f32 checkpoint) it took 318 against 383 in the
lockstep cycle (15 live records a row; bench/RESULTS.md, 2026-12-04) and
is the direct route's default where :func:`default_direct_tma` says.

Limits: the direct route's are those of the append route's readout
(:func:`~replayssm_jax.kernels.tma_readout.check_tma_readout`), the
standard step's :func:`check_step_tma`, and for both a program's shared
memory (the state tile in and out, both per stage) within SMEM_BYTES.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from replayssm_jax.kernels.config import MAX_HEAD_DIM
from replayssm_jax.kernels.tma_readout import (COL, ROW, TERMS, TMA_MAX, TMAReadoutConfig, _align, _check_columns,
                                               _check_common, _check_smem, _check_wide, _grid, _item_spec,
                                               _key_transforms, _resident_default, _swizzled, check_tma_readout,
                                               cursor_rows, fold_tile, head_terms, keys_on_tensor_cores,
                                               live_weights, normalized_qk, outer_products)
from replayssm_jax.state import GDNReplayState

f32 = jnp.float32


def _smem_bytes(checkpoint, v, config: TMAReadoutConfig, L: int, terms: int, records: tuple[int, int]) -> int:
    """Shared-memory bytes of a program of the step kernel, counted as `tma_readout.smem_bytes`: the
    checkpoint tile in and out, terms [TERMS, terms], q and k in f32, v and o, and with L > 0 the d and k
    records (item sizes `records`) and the cursor, times the stages."""
    batch, HV, V, K = checkpoint.shape
    BV = config.block_v
    tile = BV * K * checkpoint.dtype.itemsize
    buffers = [tile, TERMS * terms * 4, K * 4, K * 4, BV * v.dtype.itemsize, tile, BV * v.dtype.itemsize]
    if L:
        buffers += [L * BV * records[0], L * K * records[1]]
    stages = min(config.stages, _grid(batch, HV, V, config)[2])
    scratch = plgpu.CompilerParams().reduction_scratch_bytes + 8 * (1 + stages * len(buffers))
    cursor = _align(cursor_rows(batch) * TMA_MAX * 4) if L else 0
    return sum(_align(stages * b) for b in buffers) + cursor + scratch


def step_smem_bytes(state: GDNReplayState, v, config: TMAReadoutConfig) -> int:
    """Shared-memory bytes of a program of :func:`gdn_direct_tma` (`_smem_bytes`)."""
    L = state.buffer_len
    return _smem_bytes(state.checkpoint, v, config, L, L, (state.d.dtype.itemsize, state.k.dtype.itemsize))


def check_direct_tma(state: GDNReplayState, v, config: TMAReadoutConfig, *, interpret: bool, slots) -> None:
    """Raise where the direct route's Mosaic GPU step cannot take this step (before any launch): the
    limits of :func:`~replayssm_jax.kernels.tma_readout.check_tma_readout` (NotImplementedError,
    ValueError), then ValueError for a program's shared memory (:func:`step_smem_bytes`) above
    SMEM_BYTES."""
    check_tma_readout(state, v, config, interpret=interpret, slots=slots)
    _check_smem(step_smem_bytes(state, v, config), config)


def check_step_tma(state, v, config: TMAReadoutConfig, *, interpret: bool, slots) -> None:
    """Raise where the standard step's Mosaic GPU kernel (:func:`gdn_step_tma`) cannot take this step
    (before any launch).

    Raises:
      NotImplementedError: interpret mode, a state pool (slots), a GPU
        other than a Hopper-class one (as `tma_readout.check_tma_readout`).
      ValueError: a state or v that is not f32 or bf16; K not a multiple
        of the swizzled tile's width or above MAX_K; V above MAX_HEAD_DIM
        or not a multiple of config.block_v; a program's shared memory
        above SMEM_BYTES.
    """
    dtype = _check_common(state, None, config, interpret=interpret, slots=slots)
    _check_wide(state=state.dtype, v=v.dtype)
    _, _, V, K = state.shape
    _check_columns(dtype, K, "key dim", "K")
    if V > MAX_HEAD_DIM:
        raise ValueError(f"the TMA step takes V (value dim) at most {MAX_HEAD_DIM}; got V = {V}")
    if V % config.block_v:
        raise ValueError(f"the TMA step takes V (value dim) a multiple of `config.block_v` = {config.block_v}; "
                         f"got V = {V}")
    _check_smem(_smem_bytes(state, v, config, 0, STEP_TERMS, (0, 0)), config)


# The tiling of the runs in bench/RESULTS.md (2026-12-03, 2026-12-04): 3 stages of 64 rows, one program an SM
# (220 KiB a program at K = 128, L = 16 with bf16 records; with f32 records the direct step takes 2 stages). The
# standard step is no default: at batch 256 on the H200 it took 287.4 us against the Triton kernel's 282.6 on
# 32-row tiles and 4 warps (288.0 against 274.8 on its later default, 16 rows and one warp). The direct step
# took 704 us against 385 with its fold as 16 outer products on the tile; with the fold on the tensor cores
# (f32 checkpoint) it is the direct route's default (`default_direct_tma`).
STEP_CONFIG = TMAReadoutConfig(stages=3, programs_per_sm=1)


def folds_in_place(checkpoint_dtype) -> bool:
    """Whether the direct step folds a row's records into its tile in the tile's shared-memory buffer
    (`tma_readout.fold_tile`, on the tensor cores with bf16 keys and L a multiple of 16): an f32 tile, which
    that store keeps exactly. A bf16 tile would round the folded state there before the step rounds it
    again, so it folds in registers, as L outer products."""
    return jnp.dtype(checkpoint_dtype) == f32


def default_direct_tma(state: GDNReplayState, v, *, interpret: bool, slots) -> TMAReadoutConfig | None:
    """The direct route's default Mosaic GPU tiling (STEP_CONFIG), or None where the Triton kernel stays the
    default: where the fold runs on the tensor cores in the tile's buffer (an f32 checkpoint,
    :func:`folds_in_place`; bf16 k records and L a multiple of 16, `tma_readout.keys_on_tensor_cores`) with
    K a multiple of 64 (the key widths its GPU tests cover: 64 and 128), and, as the append route's default
    (`tma_readout.default_tma_readout`), on a Hopper-class GPU for a checkpoint of at least
    DEFAULT_MIN_BATCH rows and V <= MAX_HEAD_DIM, within :func:`check_direct_tma`'s limits with one
    program an SM resident. Raises nothing.

    Measured on the H200 (bench/RESULTS.md, "The direct step's fold on the tensor cores", 2026-12-04):
    Qwen3.5-4B's layer, L = 16, bf16 records, f32 checkpoint, in the lockstep cycle (15 live records a
    row), the direct step's two launches took 88 us against the Triton kernel's 100 at batch 64, 318
    against 383 at 256 and 621 against 759 at 512. Not measured from empty buffers (route "direct" in
    plain decoding), where the step has no fold: there the Mosaic GPU standard step, its nearest
    measured kin, took 1.04x the Triton standard step's kernel time at batch 64 and 256 (same section).
    """
    K, L = state.checkpoint.shape[3], state.buffer_len
    if (state.checkpoint.shape[2] > MAX_HEAD_DIM or K % 64 or not folds_in_place(state.checkpoint.dtype)
            or not keys_on_tensor_cores(state.k.dtype, L)):
        return None
    return _resident_default(check_direct_tma, lambda c: step_smem_bytes(state, v, c), state, v,
                             interpret=interpret, slots=slots, tilings=(STEP_CONFIG,))


STEP_TERMS = 8  # columns of the standard step's terms (TERMS rows of f32: one 128-byte TMA-aligned stage buffer)


def direct_terms(state: GDNReplayState, q, k, g, beta, *, scale: float, use_qk_l2norm: bool):
    """The per-head terms of one direct step in pure JAX: what the prelude launch forms (route "direct"),
    against which it is tested.

    Args: as `tma_readout.head_terms`.

    Returns:
      (qn f32[batch, H, K] normalized and scaled, kn f32[batch, H, K]
      normalized, terms f32[batch, HV, 4, L]): terms[:, :, 0] = w, the
      live slots' decay weights (0 in dead slots); terms[:, :, 1] = 0;
      terms[:, :, 2, :4] = (exp of the live slots' summed log decays,
      k . q, exp(g), beta); terms[:, :, 3] = 0.
    """
    qn, kn, terms = head_terms(state, q, k, g, beta, scale=scale, use_qk_l2norm=use_qk_l2norm)
    return qn, kn, terms.at[:, :, 0].set(live_weights(state)[1]).at[:, :, 1].set(0.0)


def clear_dead_keys(state: GDNReplayState) -> GDNReplayState:
    """The state with the k records of its dead slots (slot >= cursor) zeroed in each row with live records
    (cursor > 0), the rest as it was: the pure-JAX form of the direct prelude's record writes. The step's
    fold reads every slot's key on the tensor cores, where a dead slot's, which may hold anything, must be
    finite (`tma_readout.fold_tile`); the step leaves every slot dead (cursor 0)."""
    slot = jnp.arange(state.buffer_len)[None, None, :, None]
    cursor = state.cursor[:, None, None, None]
    return state.replace(k=jnp.where((slot >= cursor) & (cursor > 0), jnp.zeros_like(state.k), state.k))


def step_terms(q, k, g, beta, *, scale: float, use_qk_l2norm: bool):
    """The per-head terms of one standard step in pure JAX: what the standard step's prelude launch
    (`replayssm_jax.kernels.gdn._step_terms`) forms, against which it is tested.

    Args: q, k [batch, H, K]; g f32[batch, HV]; beta [batch, HV]; scale and
    use_qk_l2norm as :func:`replayssm_jax.kernels.gdn_step`.

    Returns:
      (qn f32[batch, H, K] normalized and scaled, kn f32[batch, H, K]
      normalized, terms f32[batch, HV, 4, STEP_TERMS]): terms[:, :, 2, :4]
      = (1, k . q, exp(g), beta), zeros elsewhere.
    """
    qn, kn = normalized_qk(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm)
    group = g.shape[1] // q.shape[1]
    kq = jnp.repeat(jnp.sum(kn * qn, -1), group, axis=1)
    scalars = jnp.stack([jnp.ones_like(kq), kq, jnp.exp(g.astype(f32)), beta.astype(f32)], -1)
    terms = jnp.zeros((*g.shape, TERMS, STEP_TERMS), f32).at[:, :, 2, :4].set(scalars)
    return qn, kn, terms


def _step_kernel(shape: tuple[int, int, int], L: int, group: int, config: TMAReadoutConfig, checkpoint_dtype):
    """The kernel body over the items of `shape` = (batch, HV, V) (see the module docstring): the direct
    step with L buffer slots, or the standard step (L = 0: no records, no cursor, no fold).

    Each item is stepped exactly once (the state is written in place, so an item stepped twice would
    take the step twice): a program pipelines items program, program + programs, ... over the grid's
    whole rounds, then the programs below the remainder take one item more, in a second pipeline."""
    batch, HV, V = shape
    BV = config.block_v
    NV = V // BV
    count_items, programs, _ = _grid(batch, HV, V, config)
    rounds, rest = divmod(count_items, programs)

    def body(ck_ref, terms_ref, q_ref, k_ref, v_ref, *refs):
        if L:
            cursor_ref, d_ref, krec_ref, o_ref, cursor_smem, barrier = refs
            plgpu.copy_gmem_to_smem(cursor_ref, cursor_smem, barrier.at[0])
            plgpu.barrier_wait(barrier.at[0])
        else:
            (o_ref,) = refs
        program = lax.axis_index("program")
        operands = (ck_ref, terms_ref, q_ref, k_ref, v_ref) + ((d_ref, krec_ref) if L else ()) + (ck_ref, o_ref)
        K = ck_ref.shape[-1]

        def pipeline(first: int, steps: int):  # items (first + step) * programs + program, step < steps
            def item(step):  # (batch row, value head, row tile)
                i = (first + step) * programs + program
                return i // (HV * NV), (i // NV) % HV, i % NV

            tile = _item_spec(item, (None, None, BV, K), lambda b, h, j: (b, h, j, 0), _swizzled(checkpoint_dtype))
            in_specs = [
                tile,
                _item_spec(item, (None, None, TERMS, terms_ref.shape[-1]), lambda b, h, j: (b, h, 0, 0)),
                _item_spec(item, (None, None, K), lambda b, h, j: (b, h // group, 0)),
                _item_spec(item, (None, None, K), lambda b, h, j: (b, h // group, 0)),
                _item_spec(item, (None, None, BV), lambda b, h, j: (b, h, j)),
            ]
            if L:
                keys = _key_transforms(krec_ref.dtype, L) if folds_in_place(checkpoint_dtype) else ()  # WGMMA's B
                in_specs += [_item_spec(item, (None, None, L, BV), lambda b, h, j: (b, h, 0, j)),  # d records
                             _item_spec(item, (None, None, L, K), lambda b, h, j: (b, h // group, 0, 0),
                                        keys)]  # k records
            out_specs = [tile, _item_spec(item, (None, None, BV), lambda b, h, j: (b, h, j))]

            def compute(index, *bufs):
                count = None
                if L:  # the row's live records
                    b = item(index[0])[0]
                    count = cursor_smem[b // TMA_MAX, b % TMA_MAX]
                _step_item(bufs, count, L)

            plgpu.emit_pipeline(compute, grid=(steps,), in_specs=in_specs, out_specs=out_specs,
                                max_concurrent_steps=min(config.stages, steps))(*operands)

        pipeline(0, rounds)
        if rest:
            @pl.when(program < rest)
            def _():
                pipeline(rounds, 1)

    return body


def _step_item(bufs, count, L: int) -> None:
    """One item's step from its shared-memory buffers (the pipeline's order: checkpoint tile, terms, q, k,
    v, with L > 0 the d and k records, then the outputs: the state tile and o): with L > 0 the fold of the
    row's `count` live records, then the gated delta rule; the new state tile and the outputs stored."""
    S_s, terms_s, q_s, k_s, v_s = bufs[:5]
    S_out, o_s = bufs[-2:]
    carried, decay, beta = terms_s[2, 0], terms_s[2, 2], terms_s[2, 3]
    U_s, Kr_s = bufs[5:7] if L else (None, None)
    if L and folds_in_place(S_s.dtype):  # a row with live records (else carried = exp(0) = 1)
        pl.when(count > 0)(lambda: fold_tile(S_s, carried, lambda i: terms_s[0, i], [U_s], Kr_s, count=count))
    S = plgpu.load(S_s, layout=plgpu.Layout.WGMMA).astype(f32)
    if L and not folds_in_place(S_s.dtype):  # the live records' outer products in registers
        S = outer_products(carried * S, lambda i: terms_s[0, i], [U_s], Kr_s, count)
    kv = plgpu.load(k_s, layout=COL)
    qv = plgpu.load(q_s, layout=COL)
    d = beta * (plgpu.load(v_s, layout=ROW).astype(f32) - decay * jnp.sum(S * kv[None, :], axis=1))
    S = decay * S + d[:, None] * kv[None, :]
    S_out[...] = S.astype(S_out.dtype)
    o_s[...] = jnp.sum(S * qv[None, :], axis=1).astype(o_s.dtype)


def _launch(checkpoint, terms, qn, kn, v, config: TMAReadoutConfig, L: int, group: int, name: str, records=()):
    """Run the step kernel (`_step_kernel`) on the checkpoint in place; records: () for the standard step,
    or (entry cursor i32[rows, TMA_MAX], d records, k records) for the direct step. Returns (o, checkpoint)."""
    batch, HV, V, _ = checkpoint.shape
    programs = _grid(batch, HV, V, config)[1]
    body = _step_kernel((batch, HV, V), L, group, config, checkpoint.dtype)
    scratch = [plgpu.SMEM(records[0].shape, jnp.int32), plgpu.Barrier(num_barriers=1)] if L else []
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(v.shape, v.dtype), grid=(programs,),
                          grid_names=("program",), scratch_types=scratch,
                          kernel_name=f"{name}_bv{config.block_v}_st{config.stages}_p{programs}")  # as profiles name it
    ck_ref = jax.new_ref(checkpoint)  # read and written in place
    o = kernel(ck_ref, terms, qn, kn, v, *records)
    return o, ck_ref[...]


def gdn_direct_tma(state: GDNReplayState, qn, kn, terms, entry, v, config: TMAReadoutConfig):
    """The direct step on Mosaic GPU, after its prelude: the outputs and the new checkpoint.

    Takes the prelude's outputs (route "direct"; their pure-JAX form is
    :func:`direct_terms` and :func:`clear_dead_keys`) on validated
    arguments within :func:`check_direct_tma`'s limits. Traced inside the
    caller's jit: the checkpoint's `jax.Ref` is read back here.

    Args:
      state: the GDNReplayState before the step (checkpoint f32 |
        bf16[batch, HV, V, K], d records [batch, HV, L, V], k records
        [batch, H, L, K]; its cursor is not read: `entry` holds it), with
        the prelude's k records: where the fold runs on the tensor cores
        (an f32 checkpoint, `tma_readout.keys_on_tensor_cores`) a dead
        slot's key in a row with live records must be finite, as
        :func:`clear_dead_keys` leaves it (0 times inf is NaN).
      qn, kn: f32[batch, H, K], q normalized and scaled, k normalized.
      terms: f32[batch, HV, TERMS, L], as :func:`direct_terms` returns them.
      entry: i32[rows * TMA_MAX] (rows = cdiv(batch, TMA_MAX)), each row's
        cursor at entry in its first `batch` entries.
      v: [batch, HV, V]; config: a TMAReadoutConfig.

    Returns:
      (o [batch, HV, V] in v.dtype, checkpoint like state.checkpoint): the
      state after the row's live records and this step, written in place.
    """
    H, L = state.k.shape[1], state.buffer_len
    entry = entry.reshape(cursor_rows(state.batch), TMA_MAX)
    group = state.checkpoint.shape[1] // H
    return _launch(state.checkpoint, terms, qn, kn, v, config, L, group, f"gdn_direct_tma_L{L}",
                   (entry, state.d, state.k))


def gdn_step_tma(state, qn, kn, terms, v, config: TMAReadoutConfig):
    """The standard step on Mosaic GPU, after its prelude: the outputs and the new state.

    Takes the prelude's outputs (`replayssm_jax.kernels.gdn._step_terms`;
    their pure-JAX form is :func:`step_terms`) on validated arguments within
    :func:`check_step_tma`'s limits.

    Args:
      state: f32 | bf16[batch, HV, V, K].
      qn, kn: f32[batch, H, K], q normalized and scaled, k normalized.
      terms: f32[batch, HV, TERMS, STEP_TERMS], as :func:`step_terms`.
      v: [batch, HV, V]; config: a TMAReadoutConfig.

    Returns:
      (o [batch, HV, V] in v.dtype, state after the step, written in place).
    """
    return _launch(state, terms, qn, kn, v, config, 0, state.shape[1] // qn.shape[1], "gdn_step_tma")
