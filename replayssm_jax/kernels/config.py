"""Tiling configs of the kernel launches, their default heuristics, and the kernels' size limits.

One frozen config per launch kind:

- :class:`StepConfig`: the standard step's kernel (also the replay step's
  direct route, which runs that kernel): one [block_v, K] state tile per
  program.
- :class:`ReplayConfig`: the replay kernel (`tiles` row tiles per program)
  and its flush: fused into the replay kernel, or a second launch with
  tiling fields of its own.

The heuristics plan for the streaming multiprocessors of JAX's first
device (:func:`num_sms`).
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax.kernels.cursor import MAX_ROW_PROGRAMS

# Sizes the kernels tile: K and N (the full row of a state tile), V and P;
# the buffer's slots.
MAX_HEAD_DIM = 256
MAX_BUFFER_LEN = 64

# Streaming multiprocessors planned for where JAX's first device is not a
# GPU that reports its count (H100 / H200: 132), so that interpret runs on
# the CPU build the configs of those GPUs.
DEFAULT_NUM_SMS = 132

NUM_WARPS = (1, 2, 4, 8, 16)

# The routes of a replay step in the kernels ("auto" is resolved by replayssm_jax.ops).
ROUTES = ("output", "state", "direct", "append", "deferred")

# The routes whose replay kernel flushes no row: "append" (a row that fills
# its buffer stays full) and "deferred" (the append route after a flush
# launch for the rows that entered full).
NO_FLUSH_ROUTES = ("append", "deferred")

# Batch rows per program of the flush launch (at most; a power of two that
# divides the batch). A flush program returns at once for a row that does not
# flush, but a launch of one program per row and tile spent ~30 us per step
# on those programs alone at batch 256 (bench/RESULTS.md, 2026-11-30).
MAX_FLUSH_ROWS = 8

# The deferred route's flush launch of an f32 checkpoint: (rows, warps) of
# its tile. Its flushing rows are few (staggered cursors: 1 in L), and the
# replay kernel's tile, 64 rows on 4 warps (GDN) or 16 on 2 (Mamba-2's P =
# 80), left it at 60% of the copy rate. On the H200, L = 16, flush launch us
# a step from staggered cursors at batch 64 / 256 / 512 (bench/RESULTS.md,
# 2026-12-03, "The deferred flush's tiling"): GDN 7.9 / 27.1 / 53.2 -> 8.0 /
# 25.8 / 49.3, Mamba-2 15.6 / 54.0 / 107.1 -> 15.2 / 50.1 / 98.7 (rows in
# step: Mamba-2 about 4 us faster at batch 256, GDN unchanged). The output route's
# flush launch (which also applies the step) got slower on this tile, and
# bf16 checkpoints were mixed (GDN 18.5 -> 15.8, Mamba-2 30.3 -> 33.5 us at
# batch 256), so both keep the replay kernel's tile.
DEFERRED_FLUSH_TILE = (32, 4)

# Rows of the fused flush's sub-tiles (at most): a flushing program
# re-reads its checkpoint rows in tiles this small (an L2 hit, it has just
# read them), so its rank-L update holds a small tile (at batch 1-4 the
# default replay tile has 16 rows anyway). At large grids the fused step
# stays slower than two launches all the same (bench/RESULTS.md,
# 2026-11-30), so the heuristic fuses only small grids.
FUSED_FLUSH_ROWS = 16


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive ints."""
    return -(-a // b)


@functools.cache
def num_sms() -> int:
    """Streaming multiprocessors of JAX's first device: its `core_count` on a
    GPU, DEFAULT_NUM_SMS (132) elsewhere or where the device does not say."""
    device = jax.devices()[0]
    count = getattr(device, "core_count", None) if device.platform == "gpu" else None
    return int(count) if count else DEFAULT_NUM_SMS


def _is_power_of_two(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@dataclasses.dataclass(frozen=True)
class _Tiling:
    """Fields and checks shared by the configs: the tile rows and the Triton launch parameters."""

    block_v: int
    num_warps: int = 4
    num_stages: int = 1
    memory_order: bool = True

    _FLAGS: ClassVar[tuple[str, ...]] = ("memory_order",)  # bool fields; every other field is an int

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name in self._FLAGS:
                if not isinstance(value, (bool, np.bool_)):
                    raise TypeError(f"`config.{field.name}` must be a bool; got {type(value).__name__}")
                object.__setattr__(self, field.name, bool(value))  # a numpy bool is stored as a bool
            else:
                if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)):
                    raise TypeError(f"`config.{field.name}` must be an int; got {type(value).__name__} {value!r}")
                object.__setattr__(self, field.name, int(value))  # a numpy int (from a sweep) is stored as an int
        if not _is_power_of_two(self.block_v):
            raise ValueError(f"`config.block_v` must be a power of two; got {self.block_v}")
        if self.num_warps not in NUM_WARPS:
            raise ValueError(f"`config.num_warps` must be one of 1, 2, 4, 8, 16; got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"`config.num_stages` must be >= 1; got {self.num_stages}")

    def _launch_tag(self, tiles: int) -> str:
        order = "" if self.memory_order else "_bfirst"
        return f"bv{self.block_v}_w{self.num_warps}_s{self.num_stages}_t{tiles}{order}"


@dataclasses.dataclass(frozen=True)
class StepConfig(_Tiling):
    """Static tiling of the standard step's kernel (and of the replay step's
    direct route, which runs it): grid (batch, heads, cdiv(V, block_v)), one
    state tile per program.

    Attributes:
      block_v: rows of a state tile (V for GDN, P = head_dim for Mamba-2); a
        power of two.
      num_warps: Triton warps per program, one of 1, 2, 4, 8, 16.
      num_stages: Triton software-pipelining stages, >= 1.
      memory_order: True: the programs are launched in the state's memory
        order (row tiles fastest, then heads, then batch rows; the launch
        grid is the kernel grid reversed); False: batch rows fastest.
      dot_fold: the direct route's fold of a row's live records into its
        tile (the standard step ignores it). False: one record per loop
        iteration, whose registers are a state tile and one record. True:
        the whole buffer as one rank-L update on the tensor cores, as the
        flush (`replay_math.replay_records`): for full buffers at large
        grids, as Generator's lockstep flush step, where the loop's
        dependent loads take a latency each (batch 256, f32, 15 live
        records: GDN 387 us a step against 596 with the loop, Mamba-2 730
        against 1308; the standard steps 286 and 536; bench/RESULTS.md,
        2026-12-02). Either way a row without records (count 0, plain
        decoding) skips the fold.

    Raises:
      TypeError: a field that is not an int (numpy ints are taken), or
        memory_order or dot_fold not a bool.
      ValueError: block_v not a power of two, num_warps not in {1, 2, 4, 8,
        16}, or num_stages < 1.
    """

    dot_fold: bool = False

    _FLAGS: ClassVar[tuple[str, ...]] = ("memory_order", "dot_fold")

    def tag(self) -> str:
        """The tiling in a kernel's name, e.g. "bv32_w4_s1_t1" (t1: one tile per program; "_dotfold" with
        dot_fold)."""
        return self._launch_tag(1) + ("_dotfold" if self.dot_fold else "")


@dataclasses.dataclass(frozen=True)
class ConvConfig(_Tiling):
    """Static tiling of the conv update's kernel (:func:`replayssm_jax.kernels.conv_update`): grid (batch,
    cdiv(C, block_v)), `block_v` channels per program (a power of two); num_warps, num_stages as
    :class:`StepConfig`. Its grid has two axes, so `memory_order` does not apply. Raises as StepConfig."""

    def tag(self) -> str:
        """The tiling in the kernel's name, e.g. "bc512_w4_s1"."""
        return f"bc{self.block_v}_w{self.num_warps}_s{self.num_stages}"


# Channels per program of the conv update: 4 KiB of bf16 inputs a column, a
# few hundred programs per wave at the models' conv_dim (8192, 9728).
CONV_BLOCK = 512

# The narrowest block the conv update takes so that it reads its input at a
# column offset of a packed projection and writes its output in pieces
# (`kernels.conv_update`'s offset and splits): the models' boundaries are
# multiples of 512 (Nemotron-3-Nano-4B: 7680, 8704; Qwen3.5-4B: 2048, 4096) or
# 128 (Mamba-2 2.7B: 5120, 5248); below it the pieces are cut by XLA.
MIN_PIECE_BLOCK = 32


def default_conv_config(channels: int, boundaries: tuple[int, ...] = ()) -> ConvConfig:
    """The conv update's tiling for `channels` (C): CONV_BLOCK channels (C rounded up to a power of two
    where smaller) on 4 warps, halved down to MIN_PIECE_BLOCK until the block divides every one of
    `boundaries` (the input's column offset and the output's split points), and left at its widest
    where no such block divides them all (the kernel's caller then cuts the pieces in XLA)."""
    widest = min(CONV_BLOCK, next_pow2(channels))
    block = widest
    while block > MIN_PIECE_BLOCK and any(b % block for b in boundaries):
        block //= 2
    return ConvConfig(block_v=block if not any(b % block for b in boundaries) else widest, num_warps=4)


@dataclasses.dataclass(frozen=True)
class AttentionConfig(_Tiling):
    """Static tiling of the decode attention's kernel (:func:`replayssm_jax.kernels.attention_decode`):
    grid (batch, HK, parts); `block_v` key positions per block (a power of two >= 16: the dots' extent),
    `parts` programs sharing a row's live positions (flash decoding; > 1: XLA joins their softmax
    statistics); num_warps, num_stages, memory_order as :class:`StepConfig`. Raises as StepConfig, and
    ValueError for block_v < 16 or parts < 1."""

    parts: int = 1

    def __post_init__(self):
        super().__post_init__()
        if self.block_v < 16:
            raise ValueError(f"`config.block_v` (key positions per block) must be >= 16; got {self.block_v}")
        if self.parts < 1:
            raise ValueError(f"`config.parts` must be >= 1; got {self.parts}")

    def tag(self) -> str:
        """The tiling in the kernel's name, e.g. "bt32_w8_s1_p1"."""
        return f"bt{self.block_v}_w{self.num_warps}_s{self.num_stages}_p{self.parts}"


# Key positions per block of the decode attention, by head_dim: K and V blocks of 16 KiB each in bf16 (not
# timed against other tilings).
ATTENTION_BLOCK = {64: 128, 128: 64, 256: 32}


def default_attention_config(batch: int, kv_heads: int, max_len: int, head_dim: int) -> AttentionConfig:
    """The decode attention's tiling: ATTENTION_BLOCK positions (16 for head_dim above 256), 8 warps for
    head_dim 256 or more (else 4), and parts enough for two programs an SM where batch x kv_heads
    programs are fewer, at most one part per block of the cache."""
    width = next_pow2(head_dim)
    block = ATTENTION_BLOCK.get(width, 128 if width < 64 else 16)
    programs = batch * kv_heads
    parts = max(1, min(cdiv(2 * num_sms(), programs), cdiv(max_len, block)))
    return AttentionConfig(block_v=block, num_warps=8 if width >= 256 else 4, parts=parts)


@dataclasses.dataclass(frozen=True)
class ReplayConfig(_Tiling):
    """Static tiling of the replay step's output and state routes: the
    replay kernel and its flush.

    Attributes:
      block_v, num_warps, num_stages, memory_order: the replay kernel's tile
        rows (a power of two), Triton warps, pipelining stages and launch
        order, as :class:`StepConfig` (the flush launch takes the same
        order).
      tiles: row tiles per program, >= 1. A replay program forms the
        per-head quantities (buffer scores, decay weights) once and then
        loops over its `tiles` row tiles, so the grid is
        (batch, heads, cdiv(cdiv(V, block_v), tiles)).
      fused_flush: True: the replay kernel also writes the state of its
        flushing rows: after its readout, a program of such a row re-reads
        its checkpoint rows in sub-tiles (:meth:`fused_flush_tiling`) and
        writes them (one launch per step). The flush's code still sets the
        register budget, hence the occupancy, of every program, which only
        small grids can afford (bench/RESULTS.md, 2026-11-30). False: the
        flush is a second launch, one tile and a block of batch rows per
        program, that skips rows which do not flush (the checkpoint tiles of
        flushing rows are read twice per flush cycle). Both run the same
        flush: the row's buffered records, then this step.
      flush_block_v, flush_warps, flush_rows: the flush launch's own tiling
        (0: its default, the replay kernel's block_v and num_warps and
        `default_flush_rows(batch)` batch rows per program; on the deferred
        route with an f32 checkpoint, when all three are 0,
        DEFERRED_FLUSH_TILE's rows and warps: `deferred_flush_default`). flush_block_v
        a power of two, flush_warps as num_warps, flush_rows a power of two
        that must divide the batch. With fused_flush only flush_block_v may
        be set: the rows of the fused flush's sub-tiles, at most block_v
        (0: min(block_v, FUSED_FLUSH_ROWS)).

    Raises:
      TypeError: a field of the wrong type (ints, numpy ints included;
        fused_flush a bool, numpy bools included).
      ValueError: block_v not a power of two, num_warps not in {1, 2, 4,
        8, 16}, num_stages or tiles < 1, a flush field out of range, or,
        with fused_flush, flush_warps or flush_rows set (that step has no
        flush launch) or flush_block_v above block_v.
    """

    tiles: int = 1
    fused_flush: bool = False
    flush_block_v: int = 0
    flush_warps: int = 0
    flush_rows: int = 0

    _FLAGS: ClassVar[tuple[str, ...]] = ("memory_order", "fused_flush")

    def __post_init__(self):
        super().__post_init__()
        if self.tiles < 1:
            raise ValueError(f"`config.tiles` must be >= 1; got {self.tiles}")
        for name in ("flush_block_v", "flush_rows"):
            value = getattr(self, name)
            if value and not _is_power_of_two(value):
                raise ValueError(f"`config.{name}` must be 0 (default) or a power of two; got {value}")
        if self.flush_warps and self.flush_warps not in NUM_WARPS:
            raise ValueError(f"`config.flush_warps` must be 0 (default) or one of 1, 2, 4, 8, 16; "
                             f"got {self.flush_warps}")
        if self.fused_flush and (self.flush_warps or self.flush_rows):
            raise ValueError("`config.flush_warps` and `flush_rows` tile the flush launch, which a "
                             f"`fused_flush=True` step does not have; got {self.flush_warps}, {self.flush_rows}")
        if self.fused_flush and self.flush_block_v > self.block_v:
            raise ValueError("`config.flush_block_v` of a `fused_flush=True` step sub-tiles the program's "
                             f"block_v = {self.block_v} rows, so must be <= it; got {self.flush_block_v}")

    @property
    def has_flush_tiling(self) -> bool:
        """Whether a flush field is set (not 0)."""
        return bool(self.flush_block_v or self.flush_warps or self.flush_rows)

    def tag(self) -> str:
        """The tiling in a kernel's name, e.g. "bv64_w4_s1_t2", "bv16_w4_s1_t1_fused_f8x0x0"."""
        fused = "_fused" if self.fused_flush else ""
        flush = f"_f{self.flush_block_v}x{self.flush_warps}x{self.flush_rows}" if self.has_flush_tiling else ""
        return f"{self._launch_tag(self.tiles)}{fused}{flush}"

    def splits(self, V: int) -> int:
        """Programs per head along the rows: cdiv(cdiv(V, block_v), tiles)."""
        return cdiv(cdiv(V, self.block_v), self.tiles)

    def fused_flush_tiling(self) -> ReplayConfig:
        """The tiling of the fused flush inside a replay program: the program's
        block_v * tiles rows in sub-tiles of flush_block_v rows (0:
        min(block_v, FUSED_FLUSH_ROWS))."""
        rows = self.flush_block_v or min(self.block_v, FUSED_FLUSH_ROWS)
        return ReplayConfig(block_v=rows, num_warps=self.num_warps, num_stages=self.num_stages,
                            memory_order=self.memory_order,
                            tiles=self.tiles * self.block_v // rows)

    def flush_launch_tiling(self) -> ReplayConfig:
        """The tiling of the flush launch: one tile per program, of flush_block_v
        rows on flush_warps warps (0: the replay kernel's)."""
        return ReplayConfig(block_v=self.flush_block_v or self.block_v, num_warps=self.flush_warps or self.num_warps,
                            num_stages=self.num_stages, memory_order=self.memory_order)


def deferred_flush_default(config: ReplayConfig, state_dtype, V: int) -> ReplayConfig:
    """`config` with the deferred route's flush tiling where its flush
    fields are unset (0) and not fused: for an f32 checkpoint,
    DEFERRED_FLUSH_TILE (rows at most V rounded up to a power of two);
    otherwise `config` as given (the replay kernel's tile)."""
    if config.fused_flush or config.has_flush_tiling or jnp.dtype(state_dtype) != jnp.dtype(jnp.float32):
        return config
    rows, warps = DEFERRED_FLUSH_TILE
    return dataclasses.replace(config, flush_block_v=min(rows, next_pow2(V)), flush_warps=warps)


def default_flush_rows(batch: int) -> int:
    """Batch rows per flush program: the largest power of two <= MAX_FLUSH_ROWS dividing `batch`."""
    return min(MAX_FLUSH_ROWS, batch & -batch)


def _divisor_rows(rows: int, V: int) -> int:
    """`rows`, or a smaller power of two that divides V (no padded rows: V =
    80 -> 16) if one within a factor 4 exists."""
    if V % rows == 0:
        return rows
    divides = next_pow2(V & -V) if V & -V < rows else rows
    return divides if divides * 4 >= rows else rows


def _fill_rows(rows: int, programs_per_row: int, V: int) -> int:
    """`rows` halved (down to 4) until one tile per program gives at least ~8
    programs per SM; programs_per_row = batch x heads."""
    while rows > 4 and programs_per_row * cdiv(V, rows) < 8 * num_sms():
        rows //= 2
    return rows


def _warps(rows: int, K: int) -> int:
    """Warps for a [rows, next_pow2(K)] tile: about 32 elements per thread, 1 to 4 warps."""
    return max(1, min(4, next_pow2(max(1, rows * next_pow2(K) // (32 * 32)))))


# The standard step's tile (rows, warps) per layer and state itemsize: the fastest of 16 x 1, 32 x 1,
# 16 x 2 and the generic rule's 32 x 4 (GDN), of 8 x 1, 8 x 2, 16 x 1, 32 x 2 and the generic 16 x 2
# (Mamba-2) at batch 64, 256 and 512 (Qwen3.5-4B's and Nemotron-3-Nano-4B's layers, H200, 2026-12-03,
# bench/RESULTS.md, "... the standard step on one warp"): the same tile won at all three batches. GDN on
# 16 x 1 ran 2.7-3.2% faster than on 32 x 4 in f32 and 1.3-1.9% in bf16; Mamba-2 f32 on 8 x 1 3.6-3.8%
# faster than on 16 x 2, while its bf16 state stays on 16 x 2 (16 x 1 ran 15-20% slower there).
# Both layers were measured at 128 columns (GDN's K, Mamba-2's N); other widths take the generic rule.
# GDN on 8 x 1 (H200, 2026-12-05, "The GDN standard step on the H200"): 1.6% faster than 16 x 1 at batch
# 64 on an f32 state, 0.2-0.6% slower at 256 and 512, 3.4-3.8% slower on bf16.
STANDARD_TILES = {"gdn": {4: (16, 1), 2: (16, 1)}, "mamba2": {4: (8, 1), 2: (16, 2)}}
STANDARD_TILE_COLS = 128


# The largest batch at which a GDN layer's standard decode step runs its conv inside the step's launch
# (`gdn.gdn_conv_step`), per state itemsize: none. Qwen3.5-4B's layer on an H100 (2026-12-05, bench/RESULTS.md,
# "The GDN conv fused into the standard step"): in bench/conv_step.py's cycle a step at batch 1 took 5.40 us
# fused against 9.63 for the two launches (f32 state), 5.28 against 6.12 (bf16), and 6-22% longer from batch 8;
# end to end (bench/e2e.py --fuse-conv, Qwen3.5-4B-like, f32 state) the decode step took 4.21 ms fused against
# 3.97 at batch 1 and 4.68 against 4.66 at batch 8.
FUSED_CONV_MAX_BATCH: dict[int, int] = {}


def fuse_conv_default(batch: int, state_dtype) -> bool:
    """Whether a GDN layer's standard decode step of `batch` rows on a state of `state_dtype` runs its conv
    inside the step's launch (`FUSED_CONV_MAX_BATCH`; other dtypes: no)."""
    return batch <= FUSED_CONV_MAX_BATCH.get(jnp.dtype(state_dtype).itemsize, 0)


def default_step_config(batch: int, heads: int, V: int, K: int, state_dtype, layer: str | None = None) -> StepConfig:
    """The frozen heuristic of the standard step (and, with layer None, of the direct route and the per-draft
    verify).

    With `layer` ("gdn" or "mamba2"), an f32 or bf16 state and K of 65 to
    128 (the measured width, STANDARD_TILE_COLS, once rounded up to a power
    of two), the layer's measured tile (STANDARD_TILES), fewer rows where V
    is smaller or the grid small (as below). Otherwise the generic rule: a tile holds about
    4096 state elements (32 per thread: 16 KiB in f32, 8 KiB in bf16),
    preferring a row count that divides V (V = 80 -> 16), on at most 4 warps
    (8 warps on a 64-row bf16 tile ran 16% slower); one tile per program,
    shrunk until there are at least ~8 programs per SM. (A bf16
    tile of 16 KiB, 64 rows of K = 128, ran 2-4% slower than 32 rows at
    batch 64-256 and equal at 512: bench/RESULTS.md, 2026-11-30.) The
    programs are launched in memory order (`StepConfig.memory_order`): at
    batch 256, 5-9% faster than batch rows first (2026-12-02).

    Args: batch, heads (GDN: HV), V (rows: GDN V, Mamba-2 P) and K (columns:
    GDN K, Mamba-2 N) of the state; state_dtype: its dtype (the generic
    rule is the same for every dtype); layer: "gdn", "mamba2" or None.

    Raises ValueError for a `layer` other than those.
    """
    if layer is not None and (not isinstance(layer, str) or layer not in STANDARD_TILES):
        raise ValueError(f"`layer` must be one of {sorted(STANDARD_TILES)} or None; got {layer!r}")
    measured = layer is not None and next_pow2(K) == STANDARD_TILE_COLS
    tile = STANDARD_TILES[layer].get(jnp.dtype(state_dtype).itemsize) if measured else None
    if tile is None:
        rows = next_pow2(max(1, 4096 // next_pow2(K)))
    else:
        rows, warps = tile
    rows = _fill_rows(_divisor_rows(min(next_pow2(V), rows), V), batch * heads, V)
    return StepConfig(block_v=rows, num_warps=_warps(rows, K) if tile is None else min(warps, _warps(rows, K)),
                      num_stages=1)


def default_direct_config(batch: int, heads: int, V: int, K: int, state_dtype) -> StepConfig:
    """The frozen heuristic of the replay step's direct route: the generic
    tiling of :func:`default_step_config` (layer None), folding the live records
    with one rank-L dot (`StepConfig.dot_fold`) where the grid is not
    latency-bound (batch x heads above the number of SMs): there a direct
    step runs where buffers are full (Generator's lockstep flush). Latency-
    bound grids, where "auto" takes the direct route at every step (count 0,
    or a few records after a speculative commit), keep the loop. Args: as
    :func:`default_step_config`."""
    config = default_step_config(batch, heads, V, K, state_dtype)
    return dataclasses.replace(config, dot_fold=batch * heads > num_sms())


def default_replay_config(batch: int, heads: int, V: int, K: int, state_dtype, buffer_len: int) -> ReplayConfig:
    """The frozen heuristic of the replay step (output and state routes).

    Tiles of up to 64 rows (again preferring a divisor of V) on at most 4
    warps (2 for a 64-row tile of a 2-byte state, whose programs are
    launched in memory order; f32 and 8-bit states' batch rows first), and
    one program loops over all tiles of a head, so the per-head
    work on the buffer (the buffered keys' scores, the decay weights) is
    done once per head, as long as that leaves at least ~4 programs per SM;
    otherwise the head is split over more programs, and with one tile per
    program the tile shrinks as in the standard rule. When one wave holds
    every head (batch x heads <= the number of SMs: batch 1 to 4 at the
    models' shapes), the step is bound by latency, not by occupancy: the
    flush is fused into the replay kernel, on 16-row tiles and 4 warps.
    The sweeps in bench/RESULTS.md chose these numbers.

    Args: as :func:`default_step_config`, and buffer_len (L; the rule does
    not depend on it).
    """
    del buffer_len  # the same tiling for every buffer length
    BK, rows_pow2 = next_pow2(K), next_pow2(V)
    if batch * heads <= num_sms():
        return ReplayConfig(block_v=_divisor_rows(min(rows_pow2, 16), V), num_warps=4, num_stages=1, tiles=1,
                            fused_flush=True)
    # About 32 KiB of state per tile when V is a power of two (f32: 64 rows,
    # 8-bit: 128); 64 rows otherwise (Mamba-2's P = 80: the divisor rule
    # takes 16). A 2-byte state holds 64 rows on half the warps and launches
    # its programs in memory order (GDN bf16: 134.6 us at batch 256 and 45.9
    # us at 64, against 146.7 and 50.1 on 128 rows and 4 warps and 157 and
    # 48 on 64 rows and 4; Mamba-2 bf16 245.6 against 257.3 us batch rows
    # first); f32 and 8-bit states launch batch rows first (f32 at batch
    # 256: GDN 218.4 against 219.5 us, Mamba-2 402.4 against 409.8 us in
    # memory order). bench/RESULTS.md, 2026-12-02.
    itemsize = jnp.dtype(state_dtype).itemsize
    two_byte = itemsize == 2
    rows = min(rows_pow2, 64 if two_byte or V != rows_pow2 else max(64, 32768 // itemsize // BK))
    rows = _divisor_rows(rows, V)
    n_tiles = tiles = cdiv(V, rows)
    while tiles > 1 and batch * heads * cdiv(n_tiles, tiles) < 4 * num_sms():
        tiles = cdiv(tiles, 2)
    if tiles == 1:
        rows = _fill_rows(rows, batch * heads, V)
    warps = _warps(rows, K)
    if two_byte and rows == 64:
        warps = max(1, warps // 2)
    return ReplayConfig(block_v=rows, num_warps=warps, num_stages=1, tiles=tiles, memory_order=two_byte)


def replay_is_one_launch(batch: int, heads: int, V: int, K: int, state_dtype, buffer_len: int) -> bool:
    """Whether the default replay step at this shape is one launch (its flush
    fused: a latency-bound grid, batch x heads <= the number of SMs).

    Args: as :func:`default_replay_config`. With the H200's 132 SMs: the
    Qwen3.5-4B GDN layer (32 value heads) at batch 1-4, the
    Nemotron-3-Nano-4B Mamba-2 layer (96 heads) at batch 1.
    """
    return default_replay_config(batch, heads, V, K, state_dtype, buffer_len).fused_flush


# ----------------------------------------------------------------------------
# The kernels' limits and a config's fit to a shape, checked before any launch.


def _check_tileable(what: str, name: str, size: int, limit: int) -> None:
    """Raise ValueError if `size` (the `name` dimension, e.g. "value dim" `V`) is above `limit`."""
    if size > limit:
        raise ValueError(f"the Pallas kernels support {what} `{name}` <= {limit}; got {size} (use backend='xla')")


def _check_type(config, cls: type, step: str) -> None:
    if config is not None and type(config) is not cls:
        raise TypeError(f"`config` must be a replayssm_jax.kernels.{cls.__name__} or None for {step}; "
                        f"got {type(config).__name__}")


def _check_tile_rows(config, fields: tuple[str, ...], rows: int, rows_name: str) -> None:
    """A tile (the `fields` of config) of at most the state's rows, rounded up to a power of two."""
    limit = next_pow2(rows)
    for field in fields:
        value = getattr(config, field)
        if value > limit:
            raise ValueError(f"`config.{field}` must be <= {limit} (the state's {rows_name} = {rows} rows, rounded "
                             f"up to a power of two); got {value}")


def _check_row_programs(config, programs: int) -> None:
    """A one-launch step counts its programs per batch row above the cursor's bits (`cursor.advance_cursor`)."""
    if programs > MAX_ROW_PROGRAMS:
        raise ValueError(f"a one-launch replay step counts at most {MAX_ROW_PROGRAMS} programs per batch row; "
                         f"the tiling {config.tag()} has {programs} (pass a `config` with larger row tiles)")


def _check_replay_fit(config, batch: int, V: int, rows_name: str) -> None:
    """A ReplayConfig's tiles (block_v, flush_block_v) within the state's rows, its flush_rows dividing the batch."""
    _check_tile_rows(config, ("block_v", "flush_block_v"), V, rows_name)
    if config.flush_rows and batch % config.flush_rows:
        raise ValueError(f"`config.flush_rows` must divide the batch ({batch}); got {config.flush_rows}")


def _check_dims(state, dims) -> str:
    """Check the state's rows and columns against MAX_HEAD_DIM; returns the rows' name, e.g. "value dim V"."""
    (rows_what, rows_name), (cols_what, cols_name) = dims
    _, _, V, K = state.shape
    _check_tileable(rows_what, rows_name, V, MAX_HEAD_DIM)
    _check_tileable(cols_what, cols_name, K, MAX_HEAD_DIM)
    return f"{rows_what} {rows_name}"


def step_config_for(config: StepConfig | None, state, dims, *, direct: bool = False,
                    layer: str | None = None) -> StepConfig:
    """The standard step's tiling (direct=True: the replay step's direct route)
    for `state` [batch, heads, V, K]: `config`, checked against the shape, or
    the default (:func:`default_step_config` of `layer`, "gdn", "mamba2" or
    None; the direct route's :func:`default_direct_config`, which takes no
    layer).

    dims: ((what, letter) of the rows, (what, letter) of the columns), e.g.
    (("value dim", "V"), ("key dim", "K")), for the messages.

    Raises:
      ValueError: V or K above MAX_HEAD_DIM; block_v above V rounded up to a
        power of two; (direct route, a one-launch step) more than
        MAX_ROW_PROGRAMS programs per batch row; a `layer` other than those,
        or one given with direct=True.
      TypeError: a `config` that is not a StepConfig.
    """
    if direct and layer is not None:
        raise ValueError(f"`layer` names the standard step's measured tile; the direct route takes none, got {layer!r}")
    return _fit_step_config(config, state, _check_dims(state, dims), direct, layer)


def per_draft_config_for(config: StepConfig | None, state, dims) -> StepConfig:
    """The per-draft verify's tiling for a slotted state [batch, slots, heads, V, K]: the standard step's
    (:func:`step_config_for`, the generic rule) for one slot's state [batch, heads, V, K]; errors as there."""
    return step_config_for(config, jax.ShapeDtypeStruct((state.shape[0], *state.shape[2:]), state.dtype), dims)


def _fit_step_config(config, state, rows_name: str, direct: bool, layer: str | None = None) -> StepConfig:
    _check_type(config, StepConfig, "the replay step's direct route (the standard step's kernel)" if direct
                else "the standard step")
    batch, heads, V, K = state.shape
    if config is None:
        config = (default_direct_config(batch, heads, V, K, state.dtype) if direct
                  else default_step_config(batch, heads, V, K, state.dtype, layer))
    _check_tile_rows(config, ("block_v",), V, rows_name)
    if direct:
        _check_row_programs(config, heads * cdiv(V, config.block_v))
    return config


def replay_config_for(config: StepConfig | ReplayConfig | None, checkpoint, buffer_len: int, dims, *,
                      route: str) -> StepConfig | ReplayConfig:
    """The replay step's tiling for `route` on a replay state with this
    `checkpoint` [batch, heads, V, K] and buffer length: `config`, checked
    against the shape, or the default. The direct route takes a StepConfig
    (:func:`step_config_for`), the output, state, append and deferred
    routes a ReplayConfig (the append route reads only its replay kernel's
    fields, the deferred route also its flush launch's).

    Raises:
      ValueError: a route not in ROUTES ("auto" is resolved before the
        kernels); V or K above MAX_HEAD_DIM; L above MAX_BUFFER_LEN;
        block_v or flush_block_v above V rounded up to a power of two;
        flush_rows not dividing the batch; or (fused flush, direct route:
        one-launch steps) more than MAX_ROW_PROGRAMS programs per batch row.
      TypeError: a `config` of the other class.
    """
    if route not in ROUTES:
        raise ValueError(f"`route` must be one of {', '.join(map(repr, ROUTES))} (the kernels take a resolved "
                         f"route); got {route!r}")
    rows_name = _check_dims(checkpoint, dims)
    _check_tileable("buffer length", "L", buffer_len, MAX_BUFFER_LEN)
    if route == "direct":
        return _fit_step_config(config, checkpoint, rows_name, direct=True)
    _check_type(config, ReplayConfig, f"the replay step's {route} route")
    batch, heads, V, K = checkpoint.shape
    config = config or default_replay_config(batch, heads, V, K, checkpoint.dtype, buffer_len)
    if route == "deferred":
        config = deferred_flush_default(config, checkpoint.dtype, V)
    _check_replay_fit(config, batch, V, rows_name)
    if config.fused_flush:
        _check_row_programs(config, heads * config.splits(V))
    return config


# State elements of a verify program's tile, [block_v, K], which it holds
# through the window's W steps: 32 KiB of f32. Swept on the H200
# (bench/RESULTS.md, 2026-12-01, W = 4, L = 16, batch 64 and 256): 64 rows
# of K = 128 on 4 warps were the fastest GDN tiling of those timed (8 to 64
# rows) for both state dtypes, 16 rows on 2 warps Mamba-2's (P = 80).
VERIFY_TILE_ELEMENTS = 8192


def default_verify_config(batch: int, heads: int, V: int, K: int, state_dtype, buffer_len: int,
                          window: int, tree=None) -> ReplayConfig:
    """The frozen heuristic of the verify launch (a ReplayConfig; its flush
    fields tile the early-flush launch, `fused_flush` is False).

    A program holds one [block_v, K] state tile through the window's steps:
    block_v is the power of two that keeps it near VERIFY_TILE_ELEMENTS
    (preferring a divisor of V, as the standard rule: V = 80 -> 16), shrunk
    as in the standard rule until there are ~8 programs per SM; one tile per
    program, about 64 elements per thread (1 to 4 warps). A draft tree that
    is not a chain keeps the window's start state beside the node's state
    (two tiles, `launch.walk_tree`): the same budget then holds two tiles
    of half the rows (a rule of the register budget, not yet swept).

    Args: as :func:`default_replay_config`, window (W, 1 <= W <= L) and tree
    (a DraftTree or None).
    """
    del state_dtype, buffer_len, window  # the same tiling for both state dtypes, every L and W
    held = 1 if tree is None or tree.is_chain else 2  # state tiles held through the steps
    budget = VERIFY_TILE_ELEMENTS // held
    rows = _divisor_rows(min(next_pow2(V), next_pow2(max(1, budget // next_pow2(K)))), V)
    rows = _fill_rows(rows, batch * heads, V)
    return ReplayConfig(block_v=rows, num_warps=_warps(rows, K), num_stages=1)


def verify_config_for(config: ReplayConfig | None, checkpoint, buffer_len: int, window: int, dims,
                      tree=None) -> ReplayConfig:
    """The verify launch's tiling for a window of `window` steps (of a draft
    `tree`'s nodes) on a replay state with this `checkpoint` [batch, heads,
    V, K] and buffer length: `config`, checked against the shape, or
    :func:`default_verify_config`.

    Raises:
      ValueError: V or K above MAX_HEAD_DIM; L above MAX_BUFFER_LEN; W
        outside [1, L]; block_v or flush_block_v above V rounded up to a
        power of two; flush_rows not dividing the batch; fused_flush True
        (the verify's early flush is a launch of its own).
      TypeError: a `config` that is not a ReplayConfig.
    """
    rows_name = _check_dims(checkpoint, dims)
    _check_tileable("buffer length", "L", buffer_len, MAX_BUFFER_LEN)
    if not 1 <= window <= buffer_len:
        raise ValueError(f"the verify window `W` must be in [1, L = {buffer_len}]; got {window}")
    _check_type(config, ReplayConfig, "the verify window")
    batch, heads, V, K = checkpoint.shape
    config = config or default_verify_config(batch, heads, V, K, checkpoint.dtype, buffer_len, window, tree)
    if config.fused_flush:
        raise ValueError("`config.fused_flush` must be False for the verify window (its early flush is a launch "
                         "of its own); got True")
    _check_replay_fit(config, batch, V, rows_name)
    return config
