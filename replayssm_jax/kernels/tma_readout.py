"""The replay step's append route on Mosaic GPU, for both layers: the
checkpoint tiles streamed into shared memory by TMA copies, pipelined.

The append route (:func:`replayssm_jax.kernels.gdn_replay_step`,
route="append") reads each row's checkpoint once and appends this step's
record; nothing is flushed. Here it runs as two launches:

- a Triton prelude (`replayssm_jax.kernels.gdn._head_terms`, grid (batch,
  H); its pure-JAX form is :func:`head_terms` and
  :func:`append_shared_records`) forms the per-head terms, which need no
  checkpoint: q and k L2-normalized (q scaled), the live slots' decay
  weights w_i (suffix sums of the buffered log decays, as
  `replay_math.replay_weights`), the buffered keys' weighted scores
  a_k[i] = w_i k_i . k and a_q[i] = w_i k_i . q (0 in dead slots), and
  exp(sum of the live g), k . q, exp(g) and beta; it appends the step's
  shared records (k normalized, not scaled, and g) at each row's cursor,
  in place, writes each row's cursor at entry for the readout, and moves
  the cursor to min(cursor + 1, L) in place (where the batch is a multiple
  of 4 the readout moves it instead: :func:`readout_moves_cursor`);
- the Mosaic GPU readout (:func:`gdn_append_tma`): its programs,
  `config.programs_per_sm` per SM (at most one per item), each walk their
  share of the (batch row, value head, row tile) items, strided over the
  grid; `plgpu.emit_pipeline` copies an item's
  checkpoint tile [block_v, K], its d records [L, block_v] (in copies of
  `config.record_slots` slots; a copy whose slots all lie at or past the
  row's cursor reads the first ones again, a block the same step copies; a
  full row's copies are all its slots, which the deferred route's flush
  takes), terms, q, k and
  v into shared memory up to `config.stages` - 1 items ahead of the one it
  computes (TMA; the stages capped at the most steps a program runs), and the
  item's compute forms, with
  S_c the checkpoint tile and d_i its buffered update vectors (ARCHITECTURE.md,
  "The math", `replay_math`'s form of the replay):

      Sk = exp(g) (carried S_c k + sum_i a_k[i] d_i),   d = beta (v - Sk),
      o  = exp(g) (carried S_c q + sum_i a_q[i] d_i) + (k . q) d,

  and the pipeline stores o and the row's new d record at slot `cursor`.

Mamba-2 (:func:`replayssm_jax.kernels.mamba2_replay_step`, route="append")
runs the other way round: the Mosaic GPU kernel first
(:func:`mamba2_readout_tma`), which reads the checkpoint as its rows
[batch, H P, N] in items of block_v rows (each within one group, so one C
an item; an item may cross heads, so P = 80 reads as 64-row items) and
writes S_c C, f32[batch, H, P]; then a Triton launch
(`replayssm_jax.kernels.mamba2._after_readout`, grid (batch, H / heads))
does the Triton append kernel's per-head work on it (the live slots' decay
weights, the buffered B's scores against C, the buffer terms from the x
records, the skip and the gate), appends the x, dt and B records and moves
the cursor in place: where the batch is a multiple of 4 the readout copies
each row's cursor at entry to a fresh array (one program, TMA copies), which
the launch after it reads instead of the cursor, so that one program a row
stores the new cursor, with no atomics (:func:`readout_moves_cursor`);
elsewhere each program counts its arrival (`advance_cursor`).

The deferred route (route="deferred") reads the rows that entered full
(cursor L) as empty after flushing them: their record goes to slot 0 and
their cursor to 1. The Mamba-2 readout flushes them itself
(:func:`mamba2_deferred_readout_tma`, where
:func:`mamba2_flushes_in_readout` says; elsewhere the same launches run
after the replay step's flush launch for those rows,
`launch.flush_full_launch`): an item of a full row copies its heads' x
and dt records and its group's B records into shared memory and applies
them to its checkpoint tile there, as below. The GDN readout
flushes them itself (:func:`gdn_append_tma` given `k0`): the prelude also
forms a full row's flush terms (its L slots' decay weights and their total
decay) and keeps its slot-0 k record aside before this step's replaces it;
the pipeline copies a full row's d records (its tile's columns) with its
item; the row's key-head k records are copied either a step ahead, into
one of two shared-memory buffers while the program computes its item before
(a program's first item: at its own step; the default with an f32
checkpoint), or at the flush, into one buffer, and waited for there (the
default with a bf16 one; `TMAReadoutConfig.flush_keys_ahead`); the item
applies the L records to the checkpoint tile there (with bf16 k records and
L a multiple of WGMMA_K, on the tensor cores: the weighted d records w_i d_i
split in three exact bf16 parts, three WGMMAs of a part times the keys, into
the f32 tile; else f32 outer products; `fold_tile`), writes the tile back
(a TMA store, in place) and reads it as the checkpoint. Each item then runs exactly once (the full rounds, then one
more step on the first programs: a traced step count, one pipeline body),
where the append route's programs past the last item repeat it. On the append route a row
that entered full (cursor == L) has no free slot: its outputs are NaN
and its state is kept bit for bit (its last d record is written back as it
was; its k and g records are not written), as on the Triton route.

On the H200 at batch 256 with an f32 checkpoint (Qwen3.5-4B's layer, L =
16) the readout took 138-141 us a launch and the prelude launch 10, where
the Triton append kernel took 172 (bench/RESULTS.md, 2026-12-03, "The TMA
readout's prelude in one launch"); with the d records in copies of 4 slots
(`TMAReadoutConfig.record_slots`), 135.3 in the lockstep cycle ("The
readout's record copies").

Limits (checked before the prelude and the launch, :func:`check_tma_readout`):
f32 or bf16 checkpoint, d records and v (no 8-bit checkpoint), no state
pool, the compiled GPU kernel only (Mosaic GPU's interpreter has no
predicated copies, which the pipeline's stores use), K a multiple of the
swizzled tile's width (32 columns of f32, 64 of bf16) and at most 256 (one
TMA copy), V a multiple of block_v, L a multiple of 8 (with f32 or bf16
records, every shared-memory stage buffer a multiple of 128 bytes, the TMA
copies' alignment) and at most 64, `config.record_slots` dividing L,
and a program's shared memory
(:func:`smem_bytes`: Mosaic GPU rounds each allocation up to 1 KiB) within
227 KiB. Above about 113 KiB a program, two no longer share an SM: the
grid then runs in more than one wave.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from replayssm_jax.kernels.config import MAX_BUFFER_LEN, MAX_HEAD_DIM, num_sms
from replayssm_jax.kernels.cursor import MAX_ROW_PROGRAMS, live_count
from replayssm_jax.state import GDNReplayState, Mamba2ReplayState

f32 = jnp.float32
ROW = plgpu.Layout.WGMMA.reduce(1)  # a vector over the rows of a [rows, cols] WGMMA-layout tile
COL = plgpu.Layout.WGMMA.reduce(0)  # a vector over its columns
SMEM_BYTES = 227 * 1024  # shared memory a program may hold (H100, H200)
SMEM_ALIGN = 1024  # bytes: Mosaic GPU rounds each shared-memory allocation up to this
TMA_ALIGN = 128  # bytes: each stage's buffer starts on this boundary
TMA_MAX = 256  # elements along any dimension of one TMA copy
SWIZZLE = 128  # bytes: the checkpoint tile's shared-memory swizzle
KEY_SWIZZLE = 32  # bytes: the swizzle of bf16 k records folded on the tensor cores, the WGMMA's B operand [L, K]
WGMMA_K = KEY_SWIZZLE // 2  # slots a WGMMA instruction takes of 2-byte records at that swizzle
TERMS = 4  # rows of an item's terms: a_k, a_q, the scalars, padding
MAX_K = 256  # key dim: q and k are one copy each
MAX_L = MAX_BUFFER_LEN  # buffer slots, as the other kernels (the readout's slot loop is unrolled)


@dataclasses.dataclass(frozen=True)
class TMAReadoutConfig:
    """Tiling of the Mosaic GPU kernels: the append route's readout of
    either layer (:func:`gdn_append_tma`, :func:`mamba2_readout_tma`), the
    GDN direct route's step and the GDN standard step
    (:mod:`replayssm_jax.kernels.tma_step`).

    Attributes:
      block_v: checkpoint rows of a work item, 64 or 128 (the WGMMA
        register layout's tiles are 64 rows).
      stages: items a program holds in shared memory, >= 1 (the pipeline
        copies up to stages - 1 items ahead of the one it computes).
      programs_per_sm: persistent programs per SM, >= 1 (the grid is
        num_sms() * programs_per_sm programs, at most one per item; they
        run at once only where that many programs' shared memory fits an
        SM).
      record_slots: slots of the d records one copy of the GDN readout
        moves, dividing L (0: all L in one copy). A copy whose slots are
        all past the row's cursor (dead) reads the item's first slots
        again instead, a block the same step copies too, so that it need
        not come from memory (a second read of those bytes, expected to
        hit the L2; not measured with counters). The kernel selects dead
        slots out, whatever they hold. Read by the GDN readout (and
        checked with the direct route's Mosaic GPU step, which shares its
        checks). The default 4 took the readout from 138.1 to 135.3 us a
        launch in the lockstep cycle at batch 256, f32 checkpoint, bf16
        records (2 slots: 135.2, 8: 136.1; H200, bench/RESULTS.md,
        2026-12-03); other shapes are not measured with it.
      flush_keys_ahead: where the deferred route's readout copies a
        flushing item's k records: True, into one of two shared-memory
        buffers while the program computes its item before; False, at the
        flush, waited for there (one buffer); None (the default): ahead
        with an f32 checkpoint, at the flush with a bf16 one. Measured on
        the H200 at batch 256 (Qwen3.5-4B's layer, L = 16,
        bench/RESULTS.md, "A bf16 checkpoint's GDN readout", 2026-12-04):
        ahead, the readout took 2.8 us a step less in step and 1.4 more
        from staggered cursors with an f32 checkpoint, 4.9-5.4 more in both
        with a bf16 one. Read by the GDN deferred readout only.

    Raises:
      TypeError: a field that is not an int (numpy ints accepted), or
        flush_keys_ahead not a bool (numpy bools accepted) or None.
      ValueError: block_v not 64 or 128, stages or programs_per_sm < 1,
        record_slots < 0.
    """

    block_v: int = 64
    stages: int = 2
    programs_per_sm: int = 2
    record_slots: int = 4
    flush_keys_ahead: bool | None = None

    def __post_init__(self):
        ahead = self.flush_keys_ahead
        if not isinstance(ahead, (bool, np.bool_, type(None))):
            raise TypeError(f"`config.flush_keys_ahead` must be a bool or None; got {type(ahead).__name__} {ahead!r}")
        object.__setattr__(self, "flush_keys_ahead", None if ahead is None else bool(ahead))
        for field in dataclasses.fields(self):
            if field.name == "flush_keys_ahead":
                continue
            value = getattr(self, field.name)
            if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
                raise TypeError(f"`config.{field.name}` must be an int; got {type(value).__name__} {value!r}")
            object.__setattr__(self, field.name, int(value))
        if self.block_v not in (64, 128):
            raise ValueError(f"`config.block_v` must be 64 or 128 (WGMMA-layout rows); got {self.block_v}")
        for name in ("stages", "programs_per_sm"):
            if getattr(self, name) < 1:
                raise ValueError(f"`config.{name}` must be >= 1; got {getattr(self, name)}")
        if self.record_slots < 0:
            raise ValueError(f"`config.record_slots` must be >= 0 (0: all L slots in one copy); got "
                             f"{self.record_slots}")

    def keys_ahead(self, checkpoint_dtype) -> bool:
        """Whether the deferred readout copies a flushing item's k records a step ahead (`flush_keys_ahead`,
        its default resolved by the checkpoint's dtype)."""
        if self.flush_keys_ahead is None:
            return jnp.dtype(checkpoint_dtype) == jnp.float32
        return self.flush_keys_ahead

    def slots_per_copy(self, L: int) -> int:
        """Slots of the d records a copy of the GDN readout moves at buffer length L (record_slots, or L
        for 0); unchecked: :func:`check_tma_readout` refuses a value that does not divide L."""
        return self.record_slots or L


def _align(n: int, to: int = SMEM_ALIGN) -> int:
    return -(-n // to) * to


def _grid(batch: int, HV: int, V: int, config: TMAReadoutConfig) -> tuple[int, int, int]:
    """(items, programs, steps): the (batch row, value head, row tile) items, the persistent programs (at most
    one per item) and the pipeline steps of a program."""
    items = batch * HV * (V // config.block_v)
    programs = min(items, num_sms() * config.programs_per_sm)
    return items, programs, -(-items // programs)


def smem_bytes(state: GDNReplayState, v, config: TMAReadoutConfig, deferred: bool = False) -> int:
    """Shared-memory bytes of a program: each pipelined buffer (the item's checkpoint tile, d records, terms, q
    and k in f32, v; its outputs o and the d record) times the stages the pipeline keeps (`config.stages`,
    at most the program's steps) and the cursors (at entry; after the step too where
    `readout_moves_cursor`), each allocation rounded up to SMEM_ALIGN, and Mosaic GPU's reduction
    scratch and barriers (8 bytes each; counted for every buffer's stages, a bound). The d records
    count as L / R buffers of R slots (R = `config.slots_per_copy(L)`), each rounded up on its own, as the
    lowering allocates them. With one copy of the records (R = L), within 0.2 KiB above what the lowering
    allocates at the shapes tried (2026-12-02); each further copy adds 8 bytes a stage to the bound.
    `deferred`: the deferred route's readout, which also holds one or (`config.keys_ahead`) two buffers of a
    flushing item's k records [L, K] and slot-0 key [K] (not staged) and four more barriers."""
    batch, HV, V, K = state.checkpoint.shape
    BV, L = config.block_v, state.buffer_len
    d_size, v_size = state.d.dtype.itemsize, v.dtype.itemsize
    R = config.slots_per_copy(L)
    buffers = (BV * K * state.checkpoint.dtype.itemsize, *[R * BV * d_size] * (L // R), TERMS * L * 4, K * 4, K * 4,
               BV * v_size, BV * v_size, BV * d_size)
    stages = min(config.stages, _grid(batch, HV, V, config)[2])
    scratch = plgpu.CompilerParams().reduction_scratch_bytes + 8 * (1 + 4 * deferred + stages * len(buffers))
    key_buffers = 1 + config.keys_ahead(state.checkpoint.dtype)
    flush = _align(key_buffers * L * K * state.k.dtype.itemsize) + _align(key_buffers * K * state.k.dtype.itemsize)
    flush = flush if deferred else 0
    cursors = (1 + readout_moves_cursor(batch)) * _align(cursor_rows(batch) * TMA_MAX * 4)  # at entry, after the step
    return sum(_align(stages * b) for b in buffers) + cursors + scratch + flush


def mamba2_smem_bytes(checkpoint, C, config: TMAReadoutConfig, flush: Mamba2ReplayState | None = None) -> int:
    """Shared-memory bytes of a program of :func:`mamba2_readout_tma`, counted as :func:`smem_bytes`: the
    item's checkpoint tile [block_v, N], its C [N] and its readout f32[block_v], times the stages, and where
    :func:`readout_moves_cursor` the cursors and one more barrier. `flush`: the state of the deferred route's
    readout (:func:`mamba2_deferred_readout_tma`), which also holds the cursor, A, and a flushing item's x
    records [nh L, P], B records [L, N] and dt records f32[nh, L] (nh = `heads_per_item`; one buffer each, not
    staged), and four more barriers."""
    batch, H, P, N = checkpoint.shape
    BV = config.block_v
    buffers = (BV * N * checkpoint.dtype.itemsize, N * C.dtype.itemsize, BV * 4)
    stages = min(config.stages, _grid(batch, 1, H * P, config)[2])
    scratch = plgpu.CompilerParams().reduction_scratch_bytes + 8 * (1 + 4 * (flush is not None) + stages * len(buffers))
    extra = (_align(cursor_rows(batch) * TMA_MAX * 4) + 8) * readout_moves_cursor(batch)
    if flush is not None:
        L = flush.buffer_len
        nh = heads_per_item(P, BV)
        extra = sum(_align(b) for b in (cursor_rows(batch) * TMA_MAX * 4, H * 4, nh * L * P * flush.x.dtype.itemsize,
                                        L * N * flush.B.dtype.itemsize, nh * L * 4))  # flushes: batch % 4 == 0
    return sum(_align(stages * b) for b in buffers) + scratch + extra


def readout_moves_cursor(batch: int) -> bool:
    """Whether the readout (append and deferred routes) takes the cursors over from the atomics, in TMA copies of
    up to TMA_MAX rows: each copy's bytes a multiple of 16, so batch a multiple of 4. GDN: the readout stores the
    cursors after the step, from one program. Mamba-2: the readout copies the cursors at entry to a fresh array,
    from one program, and the launch after it, which reads that copy, stores each row's new cursor from the row's
    first program. Elsewhere the launch that reads the cursor in every program of a row moves it
    (`cursor.advance_cursor`: an atomic add a program, a store by the row's last)."""
    return batch % 4 == 0


def cursor_rows(batch: int) -> int:
    """Rows of TMA_MAX entries the cursor is copied to shared memory in (one copy of [rows, TMA_MAX])."""
    return -(-batch // TMA_MAX)


def _compute_capability() -> str | None:
    """The compute capability of JAX's first device ("9.0" on an H100 or H200); None off a GPU."""
    device = jax.devices()[0]
    return str(getattr(device, "compute_capability", "")) if device.platform == "gpu" else None


def _check_common(checkpoint, scale, config: TMAReadoutConfig, *, interpret: bool, slots) -> jnp.dtype:
    """The limits every Mosaic GPU kernel of the library shares (see :func:`check_tma_readout`); returns
    the checkpoint's (or state's) dtype."""
    other = "use a StepConfig or ReplayConfig"
    if interpret:
        raise NotImplementedError(f"the Mosaic GPU kernels (a TMAReadoutConfig) run compiled on a GPU only: Mosaic "
                                  f"GPU's interpreter has no predicated copies; {other} to interpret")
    if slots is not None:
        raise NotImplementedError(f"the Mosaic GPU kernels (a TMAReadoutConfig) take no state pool (`slots`); {other}")
    capability = _compute_capability()
    if capability is not None and not capability.startswith("9."):
        raise NotImplementedError(f"the Mosaic GPU kernels (a TMAReadoutConfig) run on a Hopper-class GPU (compute "
                                  f"capability 9.x); this GPU's is {capability!r}; {other}")
    if scale is not None:
        raise NotImplementedError(f"the Mosaic GPU kernels take an f32 or bf16 checkpoint; got an 8-bit checkpoint "
                                  f"({checkpoint.dtype}); use a ReplayConfig")
    return jnp.dtype(checkpoint.dtype)


def _check_wide(**arrays) -> None:
    """f32 or bf16 arrays, named by their keywords (spaces for underscores)."""
    for name, dtype in arrays.items():
        if jnp.dtype(dtype) not in (jnp.dtype(f32), jnp.dtype(jnp.bfloat16)):
            what = name.replace("_", " ")
            raise ValueError(f"the Mosaic GPU kernels take f32 or bf16 {what}; got {jnp.dtype(dtype)}")


def _check_columns(dtype, cols: int, what: str, letter: str) -> None:
    """The checkpoint's columns `letter` (`what`, e.g. "key dim"): a multiple of the swizzled tile's width."""
    width = SWIZZLE // dtype.itemsize
    if cols % width or cols > MAX_K:
        raise ValueError(f"the Mosaic GPU kernels take {letter} ({what}) a multiple of {width} for a {dtype} "
                         f"checkpoint (its swizzled tile's columns), at most {MAX_K}; got {letter} = {cols}")


def _check_smem(need: int, config: TMAReadoutConfig) -> None:
    if need > SMEM_BYTES:
        raise ValueError(f"the Mosaic GPU kernel's {config.stages} stages of {config.block_v} rows need {need} bytes "
                         f"of shared memory, above a program's {SMEM_BYTES}; lower `config.stages` or `config.block_v`")


def check_tma_readout(state: GDNReplayState, v, config: TMAReadoutConfig, *, interpret: bool, slots,
                      deferred: bool = False) -> None:
    """Raise where the GDN append route's Mosaic GPU kernel cannot take this step (before any launch).

    Args: the validated state and v of :func:`gdn_append_tma`, its config,
    the caller's `interpret` and `slots` (a state pool), and `deferred`
    (the deferred route's readout, which flushes: its shared memory).

    Raises:
      NotImplementedError: interpret mode, a state pool (slots), an 8-bit
        checkpoint, a GPU other than a Hopper-class one (compute capability
        9.x: the kernel's TMA copies and WGMMA register layouts; off a GPU,
        as when lowering for CUDA on a CPU host, nothing is checked here).
      ValueError: a checkpoint, d records or v that are not f32 or bf16;
        more key heads than MAX_ROW_PROGRAMS (the prelude's cursor); K
        not a multiple of the swizzled tile's width (32 f32 or 64 bf16
        columns) or above MAX_K; V not a multiple of config.block_v; L not a
        multiple of 8 or above MAX_L; `config.record_slots` not dividing L
        (the GDN direct route's Mosaic GPU step, which shares these checks,
        too); with `deferred`, K times the k records' item size not a
        multiple of TMA_ALIGN; a program's shared memory
        (:func:`smem_bytes`) above SMEM_BYTES.
    """
    dtype = _check_common(state.checkpoint, state.scale, config, interpret=interpret, slots=slots)
    _check_wide(checkpoint=state.checkpoint.dtype, d_records=state.d.dtype, v=v.dtype)
    _, _, V, K = state.checkpoint.shape
    _check_columns(dtype, K, "key dim", "K")
    if V % config.block_v:
        raise ValueError(f"the TMA readout takes V (value dim) a multiple of `config.block_v` = {config.block_v}; "
                         f"got V = {V}")
    if state.k.shape[1] > MAX_ROW_PROGRAMS:
        raise ValueError(f"the TMA readout takes at most {MAX_ROW_PROGRAMS} key heads (its prelude's programs, one "
                         f"per key head, count their arrivals in the cursor where they move it); got "
                         f"H = {state.k.shape[1]}")
    L = state.buffer_len
    if L % 8 or L > MAX_L:
        raise ValueError(f"the TMA readout takes L (buffer length) a multiple of 8 (each shared-memory stage "
                         f"{TMA_ALIGN}-byte aligned), at most {MAX_L}; got L = {L}")
    if deferred and K * state.k.dtype.itemsize % TMA_ALIGN:
        raise ValueError(f"the deferred route's TMA readout takes K (key dim) * the k records' item size a multiple "
                         f"of {TMA_ALIGN} bytes (the second of a flushing item's slot-0 key buffers, one record of "
                         f"K entries each, starts K entries in); got K = {K} of {jnp.dtype(state.k.dtype)}")
    if L % config.slots_per_copy(L):  # (a copy of block_v >= 64 rows of 2-byte records is >= TMA_ALIGN bytes)
        raise ValueError(f"the TMA readout takes `config.record_slots` dividing L (buffer length) = {L}; got "
                         f"record_slots = {config.record_slots}")
    _check_smem(smem_bytes(state, v, config, deferred), config)


def check_mamba2_tma(state: Mamba2ReplayState, C, config: TMAReadoutConfig, *, interpret: bool, slots) -> None:
    """Raise where the Mamba-2 append route's Mosaic GPU readout (:func:`mamba2_readout_tma`) cannot take
    this step (before any launch).

    Args: the validated state and C [batch, G, N] of the step, its config,
    and the caller's `interpret` and `slots` (a state pool).

    Raises:
      NotImplementedError: as :func:`check_tma_readout`.
      ValueError: a checkpoint or C that is not f32 or bf16; N not a
        multiple of the swizzled tile's width or above MAX_K, or N C's
        bytes not a multiple of TMA_ALIGN; P above MAX_HEAD_DIM; L above
        MAX_L; more heads than MAX_ROW_PROGRAMS; a group's
        rows, (H // G) P, not a multiple of config.block_v (a work item's
        rows share one C); a program's shared memory
        (:func:`mamba2_smem_bytes`) above SMEM_BYTES.
    """
    dtype = _check_common(state.checkpoint, state.scale, config, interpret=interpret, slots=slots)
    _check_wide(checkpoint=state.checkpoint.dtype, C=C.dtype)
    _, H, P, N = state.checkpoint.shape
    _check_columns(dtype, N, "d_state", "N")
    if N * C.dtype.itemsize % TMA_ALIGN:
        raise ValueError(f"the TMA readout takes N (d_state) * C's item size a multiple of {TMA_ALIGN} bytes (each "
                         f"shared-memory stage aligned); got N = {N} of {jnp.dtype(C.dtype)}")
    if P > MAX_HEAD_DIM:
        raise ValueError(f"the TMA readout takes P (head_dim) at most {MAX_HEAD_DIM} (the Triton launch after it); "
                         f"got P = {P}")
    L = state.buffer_len
    if L > MAX_L:
        raise ValueError(f"the TMA readout takes L (buffer length) at most {MAX_L}; got L = {L}")
    if H > MAX_ROW_PROGRAMS:
        raise ValueError(f"the TMA readout takes at most {MAX_ROW_PROGRAMS} heads (the launch after it moves the "
                         f"cursor once the row's programs, one per head, have read it); got H = {H}")
    group = H // C.shape[1]
    if group * P % config.block_v:
        raise ValueError(f"the TMA readout takes a group's rows, (H // G) * P = {group} * {P}, a multiple of "
                         f"`config.block_v` = {config.block_v} (an item's rows share one C); got {group * P}")
    _check_smem(mamba2_smem_bytes(state.checkpoint, C, config), config)


def mamba2_flushes_in_readout(state: Mamba2ReplayState, C, config: TMAReadoutConfig) -> bool:
    """Whether the deferred route's Mosaic GPU readout flushes the full rows itself
    (:func:`mamba2_deferred_readout_tma`), where :func:`check_mamba2_tma` takes the step: whole TMA copies
    of the cursor, of A and of the dt records (batch, H and L multiples of 4, H <= TMA_MAX), of an item's
    heads' x records (`heads_per_item` L rows of P, P's bytes a multiple of 16), and a program's shared
    memory (:func:`mamba2_smem_bytes` with the flush) within SMEM_BYTES. Elsewhere the deferred route runs
    the flush launch before the readout. Raises nothing."""
    batch, H, P, _ = state.checkpoint.shape
    L = state.buffer_len
    return (batch % 4 == 0 and H % 4 == 0 and H <= TMA_MAX and L % 4 == 0
            and heads_per_item(P, config.block_v) * L <= TMA_MAX and P * state.x.dtype.itemsize % 16 == 0
            and mamba2_smem_bytes(state.checkpoint, C, config, state) <= SMEM_BYTES)


DEFAULT_MIN_BATCH = 64  # batch rows from which the append route takes this kernel by default (the least measured)


def default_tma_readout(state: GDNReplayState, v, *, interpret: bool, slots,
                        deferred: bool = False) -> TMAReadoutConfig | None:
    """The append route's default Mosaic GPU tiling, or None where the
    Triton append kernel stays the default: on a Hopper-class GPU (compute
    capability 9.x) for an f32 or bf16 checkpoint of at least
    DEFAULT_MIN_BATCH rows and V <= MAX_HEAD_DIM (the Triton kernels'
    bound), the first of BF16_TILINGS (a bf16 checkpoint) or
    TMAReadoutConfig() that :func:`check_tma_readout`
    takes and whose programs' shared memory lets all of them run at once
    (`programs_per_sm` a SM); `deferred`: for the deferred route's
    readout, which flushes (its checks and shared memory). Raises nothing.

    Measured on the H200 (bench/RESULTS.md, 2026-12-03, "The TMA readout's
    prelude in one launch"): Qwen3.5-4B's GDN layer in the lockstep cycle,
    L = 16, wall time over the original's with it 1.09 (f32, batch 64),
    1.06 (256), 1.04 (512), 0.96 (bf16, 64), 0.88 (256) and 0.88 (512);
    on the Triton append kernel 1.21, 1.19, 1.18, 1.03, 0.93 and 0.90.
    Batches below 64 were not measured. The bf16 tiling: see BF16_TILINGS.
    """
    if state.checkpoint.shape[2] > MAX_HEAD_DIM:
        return None
    check = functools.partial(check_tma_readout, deferred=deferred)
    tilings = BF16_TILINGS if state.checkpoint.dtype == jnp.bfloat16 else (TMAReadoutConfig(),)
    return _resident_default(check, lambda c: smem_bytes(state, v, c, deferred), state, v, interpret=interpret,
                             slots=slots, tilings=tilings)


BF16_TILINGS = (TMAReadoutConfig(block_v=128), TMAReadoutConfig())
"""The GDN readout's default tilings with a bf16 checkpoint (both routes), in order of preference: rows
of 128 (a tile of the f32 default's bytes: twice the checkpoint bytes in flight an SM), else 64. At
batch 256 (Qwen3.5-4B's layer, L = 16, H200) the deferred readout took 81.4 us a step from staggered
cursors and 90.3 in step with 128 rows, 100.1 and 100.0 with 64 (bench/RESULTS.md, "A bf16
checkpoint's GDN readout", 2026-12-04); on the append route, 128 rows took the lockstep cycle from
109.0 to 100.8 us a step of kernels (same section). Deeper tilings of 128 rows (3 or 4 stages, or 3
programs an SM) were slower: the deferred readout by 16-31%, the append readout by 3-17%
(bench/RESULTS.md, "The append route's readout on 128 bf16 rows", 2026-12-04)."""


def _resident_default(check, program_smem, state, other, *, interpret: bool, slots,
                      tilings=(TMAReadoutConfig(),)) -> TMAReadoutConfig | None:
    """The first of `tilings` that a default may take: on a Hopper-class GPU, a checkpoint of at least
    DEFAULT_MIN_BATCH rows, within `check`(state, other, config, ...)'s limits (an 8-bit checkpoint is
    refused there), with all programs resident at once (`program_smem(config)`, a program's shared memory,
    within an SM's share); else None."""
    if _compute_capability() is None or state.checkpoint.shape[0] < DEFAULT_MIN_BATCH:
        return None
    for config in tilings:
        try:
            check(state, other, config, interpret=interpret, slots=slots)
        except (ValueError, NotImplementedError):
            continue
        if program_smem(config) <= SMEM_BYTES // config.programs_per_sm:
            return config  # (else its programs would not all fit the SMs at once, a shape not measured)
    return None


def default_mamba2_tma(state: Mamba2ReplayState, C, *, interpret: bool, slots,
                       deferred: bool = False) -> TMAReadoutConfig | None:
    """The Mamba-2 append route's default Mosaic GPU tiling, or None where
    the Triton append kernel stays the default: a TMAReadoutConfig() on a
    Hopper-class GPU for an f32 or bf16 checkpoint of at least
    DEFAULT_MIN_BATCH rows, within :func:`check_mamba2_tma`'s limits with
    all programs resident at once. Raises nothing.

    Measured on the H200 (bench/RESULTS.md, 2026-12-03, "Mosaic GPU steps"):
    Nemotron-3-Nano-4B's Mamba-2 layer in the lockstep cycle, L = 16, ours
    over the original's kernel time (wall in brackets) 0.93 (1.00) at batch
    64, 0.91 (0.97) at 256 and 0.91 (0.95) at 512 with an f32 checkpoint,
    0.83 (0.91) at 64 and 0.78 (0.83) at 256 with a bf16 one; on the Triton
    append kernel 1.03 (1.10), 1.06 (1.11), 1.06 (1.10), 0.93 (1.02) and
    0.90 (0.94). The Nemotron-like model at batch 256, f32: 1.34x over its
    standard step (1.23x before). Batches below 64 were not measured.
    `deferred`: for the deferred route's readout, whose programs also hold
    the flush's buffers where it flushes (:func:`mamba2_flushes_in_readout`).
    """
    def program_smem(config):
        flush = state if deferred and mamba2_flushes_in_readout(state, C, config) else None
        return mamba2_smem_bytes(state.checkpoint, C, config, flush)

    return _resident_default(check_mamba2_tma, program_smem, state, C, interpret=interpret, slots=slots)


def check_tma_route(route: str, routes: tuple[str, ...] = ("append", "deferred", "direct")) -> None:
    """Raise TypeError unless `route` is one of `routes`, those a TMAReadoutConfig tiles for the layer (GDN:
    the append, deferred and direct routes; Mamba-2: the append and deferred routes)."""
    if route not in routes:
        raise TypeError(f"a TMAReadoutConfig tiles the {', '.join(map(repr, routes))} routes only; "
                        f"got route {route!r} (use a {'StepConfig' if route == 'direct' else 'ReplayConfig'})")


def normalized_qk(q, k, *, scale: float, use_qk_l2norm: bool):
    """(q, k) in f32, L2-normalized over the last axis (eps 1e-6) if use_qk_l2norm, q then scaled: the
    preludes' q and k in pure JAX."""
    qn, kn = q.astype(f32), k.astype(f32)
    if use_qk_l2norm:
        qn = qn * lax.rsqrt(jnp.sum(qn * qn, -1, keepdims=True) + 1e-6)
        kn = kn * lax.rsqrt(jnp.sum(kn * kn, -1, keepdims=True) + 1e-6)
    return qn * scale, kn


def live_weights(state: GDNReplayState, count=None):
    """(live bool[batch, 1, L], w f32[batch, HV, L], total f32[batch, HV]) of the buffered slots in pure
    JAX, as `replay_math.replay_weights`: w_i = exp(sum of the live log decays after slot i) for live i, 0
    for dead slots (which may hold anything), formed as suffix sums without cancellation; total = the
    live log decays' sum. count: i32[batch], the live slots (None: the cursor)."""
    count = state.cursor if count is None else count
    live = jnp.arange(state.buffer_len) < count[:, None, None]
    lg = jnp.where(live, state.g, 0.0)
    suffix = jnp.flip(jnp.cumsum(jnp.flip(lg, -1), -1), -1)  # sum over slots j >= i
    later = jnp.concatenate([suffix[..., 1:], jnp.zeros_like(suffix[..., :1])], -1)  # j > i: no cancellation
    return live, jnp.where(live, jnp.exp(later), 0.0), suffix[..., 0]


def _live_count(state: GDNReplayState, deferred: bool):
    """Each row's live records as the step reads them: on the deferred route a full row has none."""
    return jnp.where(state.cursor >= state.buffer_len, 0, state.cursor) if deferred else state.cursor


def head_terms(state: GDNReplayState, q, k, g, beta, *, scale: float, use_qk_l2norm: bool, deferred: bool = False):
    """The per-head terms of one append (or deferred) step in pure JAX (no checkpoint read): what the
    Triton prelude launch forms, against which it is tested.

    Args:
      state: the GDNReplayState before the step (its k and g records and
        cursor are read; dead slots may hold anything, inf included).
      q, k [batch, H, K]; g f32[batch, HV]; beta [batch, HV]: the step's
        inputs; scale, use_qk_l2norm: as :func:`replayssm_jax.ops.gdn_step`.
      deferred: the deferred route's terms: a full row (cursor L) read as
        empty, with its flush terms.

    Returns:
      (qn f32[batch, H, K] normalized and scaled, kn f32[batch, H, K]
      normalized, terms f32[batch, HV, 4, L]): terms[:, :, 0] = a_k and
      terms[:, :, 1] = a_q, the live slots' weighted key scores (0 in dead
      slots); terms[:, :, 2, :4] = (exp of the live slots' summed log
      decays, k . q, exp(g), beta); terms[:, :, 3] = 0. With deferred, a
      full row's flush terms: terms[:, :, 3] the decay weights of its L
      slots and terms[:, :, 2, 4] exp of their log decays' sum (0 for other
      rows; L >= 5).
    """
    L, (_, H, _), HV = state.buffer_len, q.shape, g.shape[1]
    qn, kn = normalized_qk(q, k, scale=scale, use_qk_l2norm=use_qk_l2norm)
    live, w, total = live_weights(state, _live_count(state, deferred))
    keys = state.k.astype(f32)  # elementwise products and sums: f32 on every GPU (no TF32 dot)

    def scores(x):
        return jnp.repeat(jnp.sum(keys * x[:, :, None, :], -1), HV // H, axis=1)

    a_k = jnp.where(live, w * scores(kn), 0.0)
    a_q = jnp.where(live, w * scores(qn), 0.0)
    kq = jnp.repeat(jnp.sum(kn * qn, -1), HV // H, axis=1)
    scalars = jnp.stack([jnp.exp(total), kq, jnp.exp(g.astype(f32)), beta.astype(f32)], -1)
    scalars = jnp.pad(scalars, ((0, 0), (0, 0), (0, L - scalars.shape[-1])))
    flush_w = jnp.zeros_like(a_k)
    if deferred:
        full = (state.cursor >= L)[:, None]
        _, w_all, total_all = live_weights(state, jnp.full_like(state.cursor, L))
        flush_w = jnp.where(full[..., None], w_all, 0.0)
        scalars = scalars.at[..., 4].set(jnp.where(full, jnp.exp(total_all), 0.0))
    return qn, kn, jnp.stack([a_k, a_q, scalars, flush_w], 2)


def append_shared_records(state: GDNReplayState, kn, g, deferred: bool = False) -> GDNReplayState:
    """The state with this step's k record (kn [batch, H, K], normalized, in the buffer's dtype) and g record
    (f32[batch, HV]) at each row's cursor (scatters; the pure-JAX form of the prelude launch's writes); a
    row full at entry (cursor == L) writes neither, or (deferred) writes them at slot 0."""
    batch, H, HV = state.batch, kn.shape[1], g.shape[1]
    slot = _live_count(state, deferred)[:, None]  # slot L is out of bounds: dropped
    rows = jnp.arange(batch)[:, None]
    k = state.k.at[rows, jnp.arange(H)[None, :], slot].set(kn.astype(state.k.dtype), mode="drop")
    g_rec = state.g.at[rows, jnp.arange(HV)[None, :], slot].set(g.astype(f32), mode="drop")
    return state.replace(k=k, g=g_rec)


def _swizzled(dtype):
    """Shared-memory transforms of a checkpoint tile read in the WGMMA register layout."""
    return (plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(SWIZZLE))


def keys_on_tensor_cores(k_dtype, L: int) -> bool:
    """Whether `fold_tile` forms its products on the tensor cores (the GDN deferred readout's flush, the
    direct step's fold of an f32 tile): k records in bf16 and L a multiple of WGMMA_K."""
    return jnp.dtype(k_dtype) == jnp.bfloat16 and L % WGMMA_K == 0


def bf16_parts(x):
    """Three bfloat16 arrays (hi, mid, lo) whose sum, in exact arithmetic, is the float32 array x: hi = x
    rounded to bf16, mid the remainder rounded, lo the remainder of that (each remainder exact in f32; 8
    mantissa bits a part cover an f32's 24). Values below about 2^-110, where lo would be subnormal, lose
    their last bits."""
    parts = []
    for _ in range(3):
        part = x.astype(jnp.bfloat16)
        parts.append(part)
        x = x - part.astype(f32)
    return parts


def _key_transforms(k_dtype, L: int):
    """Shared-memory transforms of k records [L, K] that `fold_tile` folds: the WGMMA's swizzled B operand
    where `keys_on_tensor_cores`, else none (rows read one at a time)."""
    if not keys_on_tensor_cores(k_dtype, L):
        return ()
    return plgpu.TilingTransform((8, WGMMA_K)), plgpu.SwizzleTransform(KEY_SWIZZLE)


def _live(count, i, x):
    """x where slot i is live (i < count, a traced scalar; every slot where count is None), else 0."""
    return x if count is None else jnp.where(jnp.broadcast_to(i < count, x.shape), x, jnp.zeros_like(x))


def _each_slot(U_s, first: int, body, carry):
    """body(i, d_i f32[block_v], carry) over slots first .. L - 1 of the d records held as L / R buffers U_s
    of R slots each: one loop body a buffer (the L slots unrolled took 14 s to lower, 2026-12-03)."""
    R = U_s[0].shape[0]
    for c in range(len(U_s)):
        def step(r, x, c=c):
            return body(c * R + r, plgpu.load(U_s[c].at[r], layout=ROW).astype(f32), x)
        carry = lax.fori_loop(first if c == 0 else 0, R, step, carry)
    return carry


def outer_products(S, weight, U_s, kf_s, count=None, first: int = 0):
    """f32 S [block_v, K] (registers, WGMMA layout) plus the live slots' outer products weight(i) d_i k_i^T
    over slots first .. L - 1, in f32 FMAs: d_i from the buffers U_s (as `fold_tile`), k_i row i of kf_s
    [L, K]. A dead slot's d record and key, which may hold anything (inf), are selected out."""
    def outer(i, u, S):
        key = _live(count, i, plgpu.load(kf_s.at[i], layout=COL).astype(f32))
        return S + _live(count, i, weight(i) * u)[:, None] * key[None, :]
    return _each_slot(U_s, first, outer, S)


def fold_tile(S_s, scale, weight, U_s, kf_s, k0_s=None, count=None):
    """A checkpoint tile S_s (shared memory) replaced by the tile after buffered records,
    S <- scale S + sum_i weight(i) d_i k_i^T over the live slots i (all L where `count` is None, else
    i < count, a traced scalar), stored in the tile's dtype (`replay_math`'s fold; ARCHITECTURE.md, "The math").

    d_i: the item's d records, the pipeline's L / R buffers U_s of R slots
    each; k_i: row i of kf_s [L, K], but for slot 0 the key k0_s [K] where
    given (the deferred readout's: this step's record has replaced row 0);
    weight(i): slot i's f32 scalar (traced i). A dead slot's d record,
    which may hold anything, is selected out. With bf16 keys
    (`keys_on_tensor_cores`) the products run on the tensor cores: A
    [block_v, L] holding weight(i) d_i in column i (0 for a dead slot, and
    column 0 where k0_s takes slot 0) split into three bf16 parts
    (`bf16_parts`, whose sum is A), one WGMMA of M = block_v, k = L a part
    times the swizzled keys, accumulated into the f32 tile; a dead slot's
    key there must be finite (0 times inf is NaN: the direct route's
    prelude zeroes them). Else f32 outer products (:func:`outer_products`),
    a dead slot's key selected out too. Slot 0 with k0_s is one f32 outer
    product."""
    L = U_s[0].shape[0] * len(U_s)
    first = 0 if k0_s is None else 1
    S = scale * plgpu.load(S_s, layout=plgpu.Layout.WGMMA).astype(f32)
    if k0_s is not None:
        u = _live(count, 0, weight(0) * plgpu.load(U_s[0].at[0], layout=ROW).astype(f32))
        S = S + u[:, None] * _live(count, 0, plgpu.load(k0_s, layout=COL).astype(f32))[None, :]
    if not keys_on_tensor_cores(kf_s.dtype, L):
        S_s[...] = outer_products(S, weight, U_s, kf_s, count, first).astype(S_s.dtype)
        return

    BV = S_s.shape[0]
    column = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (BV, L), 1), plgpu.Layout.WGMMA)

    def put(i, u, A):  # column i of A <- weight(i) d_i
        return jnp.where(column == i, lax.broadcast_in_dim(_live(count, i, weight(i) * u), (BV, L), [0]), A)

    zeros = plgpu.layout_cast(jnp.zeros((BV, L), f32), plgpu.Layout.WGMMA)
    parts = bf16_parts(_each_slot(U_s, first, put, zeros))

    def products(acc):  # acc <- S + sum of the parts' products, on the tensor cores
        acc[...] = S
        for part in parts:
            plgpu.wgmma(acc, part, kf_s)
        return acc[...]

    S_s[...] = pl.run_scoped(products, plgpu.ACC(S.shape, f32)).astype(S_s.dtype)


def _steps_each_item_once(count_items: int, programs: int, program):
    """This program's pipeline steps such that each item runs exactly once: the full rounds, plus one step
    on the first `rest` programs (a traced count where `rest` > 0, so the pipeline body is emitted once). A
    kernel that flushes needs this: a flushing item read twice, as past the end of a rounded-up grid, could
    flush twice."""
    rounds, rest = divmod(count_items, programs)
    return rounds + (program < rest).astype(jnp.int32) if rest else rounds


def _readout_kernel(shape: tuple[int, int, int], L: int, group: int, config: TMAReadoutConfig, checkpoint_dtype,
                    deferred: bool = False):
    """The kernel body over the items of `shape` = (batch, HV, V) (see the module docstring); `deferred`: a
    row at cursor L flushes first (the deferred route's readout)."""
    batch, HV, V = shape
    BV = config.block_v
    NV = V // BV
    R = config.slots_per_copy(L)
    count_items, programs, steps = _grid(batch, HV, V, config)
    ahead = deferred and config.keys_ahead(checkpoint_dtype)
    moves = readout_moves_cursor(batch)

    route = "deferred" if deferred else "append"

    def body(ck_ref, terms_ref, entry_ref, q_ref, k_ref, v_ref, d_ref, *refs):
        # inputs after d: [k records, slot-0 keys] (deferred), [the cursor, moved here] (moves); the output o;
        # scratch: the entry cursors, [the cursors after the step] (moves), [key buffers] (deferred), barriers
        extra = 2 * deferred + moves
        (*inputs, o_ref, cursor_smem), (*scratch, barrier) = refs[:extra + 2], refs[extra + 2:]
        if deferred:
            krec_ref, k0_ref = inputs[:2]
            kf_smem, k0_smem = scratch[moves:]
        program = lax.axis_index("program")
        plgpu.copy_gmem_to_smem(entry_ref, cursor_smem, barrier.at[0])
        plgpu.barrier_wait(barrier.at[0])

        def move_cursors(cursor_out, next_smem):
            """The cursors after the step, min(live + 1, L) of the entry cursors, stored in place in TMA copies
            of up to TMA_MAX rows. None is 0: a full row stays full on the append route, and on the deferred
            route it flushes first, its record then going to slot 0 (cursor 1)."""
            for r in range(cursor_rows(batch)):
                next_smem[r] = jnp.minimum(live_count(cursor_smem[r], L, route) + 1, L)
            plgpu.commit_smem()
            for r in range(cursor_rows(batch)):
                n = min(TMA_MAX, batch - r * TMA_MAX)
                plgpu.copy_smem_to_gmem(next_smem.at[r, pl.ds(0, n)], cursor_out.at[pl.ds(r * TMA_MAX, n)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        if moves:
            cursor_out, next_smem = inputs[-1], scratch[0]
            pl.when(program == 0)(lambda: move_cursors(cursor_out, next_smem))

        def cursor_of(b):  # the row's cursor at entry (L: a full row, which the deferred route flushes first)
            return cursor_smem[b // TMA_MAX, b % TMA_MAX]

        def live_of(b):  # the live records the readout reads: none in a full row on the deferred route
            cursor = cursor_of(b)
            return jnp.where(cursor >= L, 0, cursor) if deferred else cursor

        def record_slot(b):  # a full row writes its last record back unchanged (append route)
            return jnp.minimum(live_of(b), L - 1)

        def item(step):  # (batch row, value head, row tile) of this program's step; past the end (append
            i = step * programs + program  # route only): the last item again, the same writes
            i = i if deferred else jnp.minimum(i, count_items - 1)
            return i // (HV * NV), (i // NV) % HV, i % NV

        def pipeline(n):  # this program's first n steps
            def spec(shape, index, transforms=()):
                return plgpu.BlockSpec(shape, lambda step: index(*item(step)), transforms=transforms)

            def record_copy(c):  # the d records' c-th copy: its slot block, or block 0 where all its slots are empty
                return spec((None, None, R, BV), lambda b, h, j: (b, h, jnp.where(c * R < cursor_of(b), c, 0), j))

            K = ck_ref.shape[-1]
            in_specs = [
                spec((None, None, BV, K), lambda b, h, j: (b, h, j, 0), _swizzled(checkpoint_dtype)),
                *[record_copy(c) for c in range(L // R)],
                spec((None, None, TERMS, L), lambda b, h, j: (b, h, 0, 0)),
                spec((None, None, K), lambda b, h, j: (b, h // group, 0)),
                spec((None, None, K), lambda b, h, j: (b, h // group, 0)),
                spec((None, None, BV), lambda b, h, j: (b, h, j)),
            ]
            out_specs = [spec((None, None, BV), lambda b, h, j: (b, h, j)),
                         spec((None, None, None, BV), lambda b, h, j: (b, h, record_slot(b), j))]
            plgpu.emit_pipeline(functools.partial(compute, n), grid=(n,), in_specs=in_specs, out_specs=out_specs,
                                max_concurrent_steps=min(config.stages, steps))(
                ck_ref, *[d_ref] * (L // R), terms_ref, q_ref, k_ref, v_ref, o_ref, d_ref)

        def compute(n, index, S_s, *bufs):
            *U_s, terms_s, q_s, k_s, v_s, o_s, d_s = bufs
            record = lambda i: U_s[i // R].at[i % R]  # noqa: E731  (slot i's d record)
            step = index[0]
            b, h, j = item(step)
            count = live_of(b)
            if ahead:
                pl.when(step == 0)(lambda: fetch_keys(step))
                pl.when(step + 1 < n)(lambda: fetch_keys(step + 1))
            if deferred:
                flush_item(S_s, terms_s, U_s, b, h, j, step % 2 if ahead else 0)
            carried, kq, decay, beta = terms_s[2, 0], terms_s[2, 1], terms_s[2, 2], terms_s[2, 3]
            acc_k = acc_q = plgpu.layout_cast(jnp.zeros((BV,), f32), ROW)
            for i in range(L):  # static: independent loads; the slot's weights are scalars in shared memory
                u = plgpu.load(record(i), layout=ROW).astype(f32)
                u = jnp.where(jnp.broadcast_to(i < count, u.shape), u, jnp.zeros_like(u))  # dead slots: 0
                acc_k = acc_k + terms_s[0, i] * u
                acc_q = acc_q + terms_s[1, i] * u
            qv = plgpu.load(q_s, layout=COL)
            kv = plgpu.load(k_s, layout=COL)
            S = plgpu.load(S_s, layout=plgpu.Layout.WGMMA).astype(f32)
            Sk = decay * (carried * jnp.sum(S * kv[None, :], axis=1) + acc_k)
            Sq = decay * (carried * jnp.sum(S * qv[None, :], axis=1) + acc_q)
            d = beta * (plgpu.load(v_s, layout=ROW).astype(f32) - Sk)
            if deferred:  # no row is full after its flush
                o_s[...] = (Sq + kq * d).astype(o_s.dtype)
                d_s[...] = d.astype(d_s.dtype)
                return
            full = jnp.broadcast_to(count >= L, d.shape)
            o = jnp.where(full, jnp.full_like(d, jnp.nan), Sq + kq * d)
            o_s[...] = o.astype(o_s.dtype)
            d_s[...] = jnp.where(full, plgpu.load(record(L - 1), layout=ROW), d.astype(d_s.dtype))

        def copy_keys(b, h, slot):
            """Start the copies of row b's key-head k records that its flush takes into key buffer `slot`: the
            L records (slot 0's already this step's, unused) and the slot-0 key (the prelude's k0)."""
            plgpu.copy_gmem_to_smem(krec_ref.at[b, h // group], kf_smem.at[slot], barrier.at[1 + 2 * slot])
            plgpu.copy_gmem_to_smem(k0_ref.at[b, h // group], k0_smem.at[slot], barrier.at[2 + 2 * slot])

        def fetch_keys(step):
            """`copy_keys` for `step`'s item where its row is full, into key buffer step % 2 (the buffer the
            flush two steps before read, behind its commit_smem)."""
            b, h, _ = item(step)
            pl.when(cursor_of(b) >= L)(lambda: copy_keys(b, h, step % 2))

        def flush_item(S_s, terms_s, U_s, b, h, j, slot):
            """A full row's tile flushed in shared memory (then read as the checkpoint) and written back. The
            pipeline copied its d records with the item (each record copy reads its own slot block:
            `record_copy` keys on the cursor at entry, L); its k records are in key buffer `slot`, copied a
            step ahead (`fetch_keys`) or here (`config.flush_keys_ahead`)."""
            @pl.when(cursor_of(b) >= L)
            def _():
                if not ahead:
                    copy_keys(b, h, slot)
                for i in (1, 2):
                    plgpu.barrier_wait(barrier.at[i + 2 * slot])
                fold_tile(S_s, terms_s[2, 4], lambda i: terms_s[3, i], U_s, kf_smem.at[slot], k0_smem.at[slot])
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(S_s, ck_ref.at[b, h, pl.ds(j * BV, BV)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pipeline(_steps_each_item_once(count_items, programs, program) if deferred else steps)

    return body


def _item_spec(item, shape, index, transforms=()):
    """A pipeline BlockSpec of `shape` at block `index(*item(step))`."""
    return plgpu.BlockSpec(shape, lambda step: index(*item(step)), transforms=transforms)


def heads_per_item(P: int, block_v: int) -> int:
    """The most heads a Mamba-2 readout item of `block_v` rows spans (its rows are P-row heads in order)."""
    return max(-(-(start + block_v) // P) for start in {k * block_v % P for k in range(P)})


def _mamba2_flush_tile(S_s, records, h0, p0, *, P: int, L: int, H: int):
    """A flushing item's checkpoint tile S_s (shared memory; rows p0 .. of head h0, then the next heads')
    replaced by the tile after the row's L buffered records: for each row of head h,
    S <- exp(A T) S + sum_i exp(A T_i) dt_i x_i B_i^T, T the head's dt records' sum and T_i that of the slots
    after i (the Mamba-2 flush of `replay_math`, its log decays summed as A times the summed dt), in f32
    products and sums, stored in the tile's dtype. `records` = (A_s f32[H], x_s [nh L, P]: the x records of
    heads h0 .. h0 + nh - 1, dt_s f32[nh, L]: their dt records, B_s [L, N]: the group's B records), nh =
    `heads_per_item`. One loop body, over the slots from the last (the suffix sums need no subtraction)."""
    A_s, x_s, dt_s, B_s = records
    BV, nh = S_s.shape[0], dt_s.shape[0]
    x_flat = x_s.reshape(nh * L * P)
    row = plgpu.broadcasted_iota(jnp.int32, (BV,), 0, layout=ROW)
    mine = [(row >= j * P - p0) & (row < (j + 1) * P - p0) for j in range(nh)]  # the rows of head h0 + j
    A = [A_s[jnp.minimum(h0 + j, H - 1)] for j in range(nh)]

    def add(r, carry):
        acc, later = carry
        i = L - 1 - r
        u = plgpu.layout_cast(jnp.zeros((BV,), f32), ROW)
        for j in range(nh):  # head j's x_i as the window of x_flat whose row p0 + r - j P is the tile's row r
            x = plgpu.load(x_flat.at[pl.ds((j * (L - 1) + i) * P + p0, BV)], layout=ROW).astype(f32)
            u = jnp.where(mine[j], (jnp.exp(A[j] * later[j]) * dt_s[j, i]) * x, u)
        B = plgpu.load(B_s.at[i], layout=COL).astype(f32)
        return acc + u[:, None] * B[None, :], tuple(later[j] + dt_s[j, i] for j in range(nh))

    zeros = plgpu.layout_cast(jnp.zeros((BV, B_s.shape[1]), f32), plgpu.Layout.WGMMA)
    acc, total = lax.fori_loop(0, L, add, (zeros, (jnp.float32(0.0),) * nh))
    decay = plgpu.layout_cast(jnp.zeros((BV,), f32), ROW)
    for j in range(nh):
        decay = jnp.where(mine[j], jnp.exp(A[j] * total[j]), decay)
    S = decay[:, None] * plgpu.load(S_s, layout=plgpu.Layout.WGMMA).astype(f32) + acc
    S_s[...] = S.astype(S_s.dtype)


def _mamba2_readout_kernel(shape: tuple[int, int], rows_per_group: int, config: TMAReadoutConfig, checkpoint_dtype,
                           flush: tuple[int, int] | None = None, copies_cursor: bool = False):
    """The readout's body over the (batch row, row tile) items of `shape` = (batch, rows); `flush` = (P, L):
    the deferred route's readout, whose item of a full row (cursor L) flushes its tile first (see
    :func:`mamba2_deferred_readout_tma`); `copies_cursor` (always with `flush`): one program copies the
    cursors at entry to the output `entry`."""
    batch, rows = shape
    BV = config.block_v
    tiles = rows // BV
    count_items, programs, steps = _grid(batch, 1, rows, config)

    def body(ck_ref, c_ref, *refs):
        if flush:
            cursor_ref, x_ref, dt_ref, B_ref, A_ref, o_ref, entry_ref, cursor_s, A_s, x_s, B_s, dt_s, barrier = refs
        elif copies_cursor:
            cursor_ref, o_ref, entry_ref, cursor_s, barrier = refs
        else:
            (o_ref,) = refs
        program = lax.axis_index("program")

        def load_cursors():  # the cursors at entry into shared memory (one TMA copy of up to TMA_MAX rows each)
            for r in range(cursor_rows(batch)):
                n = min(TMA_MAX, batch - r * TMA_MAX)
                plgpu.copy_gmem_to_smem(cursor_ref.at[pl.ds(r * TMA_MAX, n)], cursor_s.at[r, pl.ds(0, n)],
                                        barrier.at[0])
                plgpu.barrier_wait(barrier.at[0])

        def store_entry():  # ... and from there into `entry`; its reads of shared memory done when this returns
            for r in range(cursor_rows(batch)):
                n = min(TMA_MAX, batch - r * TMA_MAX)
                plgpu.copy_smem_to_gmem(cursor_s.at[r, pl.ds(0, n)], entry_ref.at[pl.ds(r * TMA_MAX, n)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def item(step):  # (batch row, row tile) of this program's step; past the end (no flush): the last item
            i = step * programs + program  # again, the same writes
            i = i if flush else jnp.minimum(i, count_items - 1)
            return i // tiles, i % tiles

        def pipeline(n):  # this program's first n steps
            N = ck_ref.shape[-1]
            in_specs = [_item_spec(item, (None, BV, N), lambda b, t: (b, t, 0), _swizzled(checkpoint_dtype)),
                        _item_spec(item, (None, None, N), lambda b, t: (b, t * BV // rows_per_group, 0))]
            out_specs = [_item_spec(item, (None, BV), lambda b, t: (b, t))]
            plgpu.emit_pipeline(compute, grid=(n,), in_specs=in_specs, out_specs=out_specs,
                                max_concurrent_steps=min(config.stages, steps))(ck_ref, c_ref, o_ref)

        def compute(index, S_s, c_s, o_s):
            if flush:
                flush_item(S_s, *item(index[0]))
            S = plgpu.load(S_s, layout=plgpu.Layout.WGMMA).astype(f32)
            c = plgpu.load(c_s, layout=COL).astype(f32)
            o_s[...] = jnp.sum(S * c[None, :], axis=1)

        def flush_item(S_s, b, t):
            """A full row's tile flushed in shared memory (then read as the checkpoint) and written back. The
            x and dt records of its heads and its group's B records are copied in for it (rows past the
            last head's read as zeros, unused)."""
            P, L = flush
            nh = dt_s.shape[0]

            @pl.when(cursor_s[b // TMA_MAX, b % TMA_MAX] >= L)
            def _():
                h0, p0 = t * BV // P, t * BV % P
                plgpu.copy_gmem_to_smem(x_ref.at[b, pl.ds(h0 * L, nh * L)], x_s, barrier.at[1])
                plgpu.copy_gmem_to_smem(B_ref.at[b, t * BV // rows_per_group], B_s, barrier.at[2])
                plgpu.copy_gmem_to_smem(dt_ref.at[b, pl.ds(h0, nh)], dt_s, barrier.at[3])
                for i in (1, 2, 3):
                    plgpu.barrier_wait(barrier.at[i])
                _mamba2_flush_tile(S_s, (A_s, x_s, dt_s, B_s), h0, p0, P=P, L=L, H=A_s.shape[0])
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(S_s, ck_ref.at[b, pl.ds(t * BV, BV)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        if not flush:
            pipeline(steps)
            if copies_cursor:  # by the last program, after its items (it has the fewest where they differ)

                @pl.when(program == programs - 1)
                def _():
                    load_cursors()
                    store_entry()
            return
        load_cursors()  # the cursor, then A, into shared memory
        pl.when(program == programs - 1)(store_entry)
        plgpu.copy_gmem_to_smem(A_ref, A_s, barrier.at[0])
        plgpu.barrier_wait(barrier.at[0])
        pipeline(_steps_each_item_once(count_items, programs, program))

    return body


def _mamba2_readout_call(checkpoint, C, config: TMAReadoutConfig, flush: Mamba2ReplayState | None = None,
                         copies_cursor: bool = False):
    """The Mosaic GPU kernel of :func:`mamba2_readout_tma` (flush None) or of
    :func:`mamba2_deferred_readout_tma` (flush: the state), over the checkpoint's rows [batch, H P, N]; its
    outputs the readout f32[batch, H P] and, with `copies_cursor` or `flush`, the cursors at entry i32[batch]."""
    batch, H, P, N = checkpoint.shape
    rows = H * P
    programs = _grid(batch, 1, rows, config)[1]
    copies_cursor = copies_cursor or flush is not None
    body = _mamba2_readout_kernel((batch, rows), H // C.shape[1] * P, config, checkpoint.dtype,
                                  None if flush is None else (P, flush.buffer_len), copies_cursor)
    route = "append" if flush is None else "deferred"
    name = f"mamba2_{route}_tma_bv{config.block_v}_st{config.stages}_p{programs}"  # as the profiles name it
    scratch = [plgpu.SMEM((cursor_rows(batch), TMA_MAX), jnp.int32)] if copies_cursor else []
    if flush is not None:
        L = flush.buffer_len
        nh = heads_per_item(P, config.block_v)
        scratch += [plgpu.SMEM((H,), f32), plgpu.SMEM((nh * L, P), flush.x.dtype), plgpu.SMEM((L, N), flush.B.dtype),
                    plgpu.SMEM((nh, L), f32), plgpu.Barrier(num_barriers=4)]
    elif copies_cursor:
        scratch.append(plgpu.Barrier(num_barriers=1))
    out_type = jax.ShapeDtypeStruct((batch, rows), f32)
    if copies_cursor:
        out_type = (out_type, jax.ShapeDtypeStruct((batch,), jnp.int32))
    return plgpu.kernel(body, out_type=out_type, grid=(programs,), grid_names=("program",), kernel_name=name,
                        scratch_types=scratch)


def mamba2_readout_tma(checkpoint, C, config: TMAReadoutConfig, cursor=None):
    """The Mamba-2 checkpoint's readout S_c C on Mosaic GPU: every head's checkpoint rows against its
    group's C, one persistent kernel whose TMA copies stream the checkpoint tiles through shared memory.
    Given the cursor, its last program also copies it (:func:`readout_moves_cursor`).

    The checkpoint [batch, H, P, N] is read as its rows [batch, H P, N] (a
    reshape, no copy), in items of `config.block_v` rows; an item's rows
    are one group's (the caller checked :func:`check_mamba2_tma`), so it
    takes one C. Products and sums in f32 (no tensor-core rounding).

    Args:
      checkpoint: f32 | bf16[batch, H, P, N].
      C: f32 | bf16[batch, G, N], G dividing H (head h reads group
        h // (H // G)).
      config: a TMAReadoutConfig.
      cursor: None, or i32[batch] (the state's cursor), batch a multiple
        of 4.

    Returns:
      f32[batch, H, P]: sum over n of checkpoint[b, h, p, n] C[b, h // (H // G), n]; given the cursor,
      (that, a copy of the cursor i32[batch]).

    Raises:
      ValueError: a cursor given where batch is not a multiple of 4.
    """
    batch, H, P, N = checkpoint.shape
    if cursor is not None and not readout_moves_cursor(batch):
        raise ValueError(f"the readout copies the cursor in TMA copies of whole 16 bytes: batch a multiple of 4; "
                         f"got batch = {batch}")
    kernel = _mamba2_readout_call(checkpoint, C, config, copies_cursor=cursor is not None)
    rows = checkpoint.reshape(batch, H * P, N)
    if cursor is None:
        return kernel(rows, C).reshape(batch, H, P)
    o, entry = kernel(rows, C, cursor)
    return o.reshape(batch, H, P), entry


def mamba2_deferred_readout_tma(state: Mamba2ReplayState, C, A, config: TMAReadoutConfig):
    """The deferred route's Mamba-2 readout on Mosaic GPU: :func:`mamba2_readout_tma`, whose item of a row
    that entered full (cursor L) first flushes its tile, in place.

    Such an item copies its heads' x and dt records (`heads_per_item`
    heads from its first) and its group's B records into shared memory, applies
    the L records to the checkpoint tile there (`_mamba2_flush_tile`: f32
    products and sums, then the checkpoint's dtype), writes the tile back
    (a TMA store) and reads it as the checkpoint. Each item runs exactly
    once. The caller checked :func:`check_mamba2_tma` and
    :func:`mamba2_flushes_in_readout`; the records are those before the
    step (the launch after the readout writes this step's).

    Args:
      state: the Mamba2ReplayState before the step (checkpoint f32 |
        bf16[batch, H, P, N], records x [batch, H, L, P], dt f32[batch, H,
        L], B [batch, G, L, N], cursor i32[batch] in 0..L).
      C: f32 | bf16[batch, G, N]; A: f32[H]; config: a TMAReadoutConfig.

    Returns:
      (f32[batch, H, P] the readout S_c C of the checkpoint after the
      flush, the checkpoint with the full rows flushed (in place), a copy
      of the cursor at entry i32[batch] (:func:`readout_moves_cursor`)).
    """
    batch, H, P, N = state.checkpoint.shape
    kernel = _mamba2_readout_call(state.checkpoint, C, config, state)
    ck_ref = jax.new_ref(state.checkpoint.reshape(batch, H * P, N))  # the full rows' tiles written in place
    L = state.buffer_len
    x = state.x.reshape(batch, H * L, P)  # a head's records are L rows: an item's heads are one copy
    o, entry = kernel(ck_ref, C, state.cursor, x, state.dt, state.B, A.astype(f32))
    return o.reshape(batch, H, P), ck_ref[...].reshape(state.checkpoint.shape), entry


def gdn_append_tma(state: GDNReplayState, qn, kn, terms, entry, v, config: TMAReadoutConfig, k0=None):
    """The append step's readout on Mosaic GPU, after its prelude: the outputs and the state after the step
    (its d records, and the cursor where :func:`readout_moves_cursor`); with `k0`, the deferred route's
    readout, which first flushes the full rows, in place.

    Takes the prelude's outputs (the Triton launch of
    :func:`replayssm_jax.kernels.gdn_replay_step`'s append route; their
    pure-JAX form is :func:`head_terms`) on validated arguments whose
    limits the caller checked (:func:`check_tma_readout`). Traced inside
    the caller's jit: the `jax.Ref`s written in place are read back here.

    Args:
      state: the GDNReplayState before the step (checkpoint f32 |
        bf16[batch, HV, V, K], d records [batch, HV, L, V]), but with the
        prelude's k and g records and cursor: moved already, or where
        :func:`readout_moves_cursor` as it entered, then moved here (its
        values are not read: `entry` holds them).
      qn, kn: f32[batch, H, K], q normalized and scaled, k normalized.
      terms: f32[batch, HV, TERMS, L], as :func:`head_terms` returns them.
      entry: i32[rows * TMA_MAX] (rows = cdiv(batch, TMA_MAX)), each row's
        cursor at entry in its first `batch` entries (the rest unread).
      v: [batch, HV, V]; config: a TMAReadoutConfig.
      k0: None (the append route), or (the deferred route) [batch, H, K]
        in the k records' dtype, each full row's slot-0 k record before the
        prelude wrote this step's there (the prelude's stash; other rows' unread). state.k
        then holds the records after the prelude, and terms the flush
        terms (`head_terms` with deferred=True).

    Returns:
      (o [batch, HV, V] in v.dtype, the GDNReplayState after the step): the
      step's d record at each row's cursor, in place; a row full at entry
      (cursor == L): NaN outputs, its d records unchanged; where
      :func:`readout_moves_cursor`, program 0 stores the cursors
      min(live + 1, L) in place. With k0, a full row's checkpoint tile,
      read into shared memory, takes its L buffered records there (the
      products on the tensor cores where `keys_on_tensor_cores`, summed in
      their f32 accumulator; else f32 products and sums: `fold_tile`;
      then the checkpoint's dtype), is written back in place and read as
      the checkpoint of an empty row, whose record goes to slot 0.
    """
    batch, HV, V, K = state.checkpoint.shape
    H, L = state.k.shape[1], state.buffer_len
    programs = _grid(batch, HV, V, config)[1]
    deferred, moves = k0 is not None, readout_moves_cursor(batch)
    body = _readout_kernel((batch, HV, V), L, HV // H, config, state.checkpoint.dtype, deferred)
    R = config.slots_per_copy(L)
    copies = f"_r{R}" if R < L else ""
    route = "deferred" if deferred else "append"
    keys = "_kf" if deferred and not config.keys_ahead(state.checkpoint.dtype) else ""  # the flush's keys at the flush
    name = f"gdn_{route}_tma_L{L}_bv{config.block_v}_st{config.stages}_p{programs}{copies}{keys}"  # as profiles name it
    rows = cursor_rows(batch)
    scratch = [plgpu.SMEM((rows, TMA_MAX), jnp.int32)] * (1 + moves)  # the cursors at entry, after the step
    if deferred:  # a flushing item's key-head k records and slot-0 key (a second buffer: the next item's)
        n = 1 + config.keys_ahead(state.checkpoint.dtype)
        scratch += [plgpu.SMEM((n, L, K), state.k.dtype, transforms=_key_transforms(state.k.dtype, L)),
                    plgpu.SMEM((n, K), state.k.dtype)]
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(v.shape, v.dtype), grid=(programs,),
                          grid_names=("program",), kernel_name=name,
                          scratch_types=[*scratch, plgpu.Barrier(num_barriers=5 if deferred else 1)])
    # written in place: the d records; on the deferred route the full rows' checkpoint tiles; where `moves`,
    # the cursor
    refs = {"d": jax.new_ref(state.d)}
    if deferred:
        refs["checkpoint"] = jax.new_ref(state.checkpoint)
    if moves:
        refs["cursor"] = jax.new_ref(state.cursor)
    flush = (state.k, k0) if deferred else ()
    o = kernel(refs.get("checkpoint", state.checkpoint), terms, entry.reshape(rows, TMA_MAX), qn, kn, v, refs["d"],
               *flush, *([refs["cursor"]] if moves else []))
    return o, state.replace(**{field: ref[...] for field, ref in refs.items()})
