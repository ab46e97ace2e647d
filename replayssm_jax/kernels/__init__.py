"""Pallas GPU kernels of the decode ops (Triton lowering), compiled for the
GPU or, with `interpret=True`, interpreted on any platform.

The entry points take validated arguments (:mod:`replayssm_jax.ops`
validates every argument and resolves route="auto") and check only the
kernels' own limits, before any launch: head dims up to MAX_HEAD_DIM, a
buffer of up to MAX_BUFFER_LEN slots, and the config's class and fit to
the shape.

Launches and their configs:

- standard step (:func:`gdn_step`, :func:`mamba2_step`): one launch,
  :class:`StepConfig`, the state updated in place. The GDN standard step
  also runs on Mosaic GPU (:mod:`replayssm_jax.kernels.tma_step`, given a
  :class:`TMAReadoutConfig`; not a default, 2% slower at batch 256): a
  Triton prelude (q and k normalized) and a persistent kernel that streams
  each state tile through shared memory and back.
- standard GDN step with its conv fused (:func:`gdn_conv_step`): one
  launch forms q, k and v from the packed conv input and the conv's ring
  (writing the ring's new column in place) and steps the state; the
  decode layer's conv launch goes away (the layers take it where
  :func:`~replayssm_jax.kernels.config.fuse_conv_default` says).
- per-draft standard verify (:func:`gdn_verify`, :func:`mamba2_verify`):
  the standard step's tiling (:class:`StepConfig`) on a slotted state
  [batch, slots, heads, V, K]; one launch reads the current slot's tile
  once and writes W outputs and W states to the draft slots, in place.
- replay step, direct route: the standard step's kernel on the checkpoint,
  each row's live records folded into its checkpoint tile first (a loop over
  the live slots, in a branch that plain decoding never takes); the cursor
  set to 0 in place. :class:`StepConfig` (for GDN, where
  :func:`~replayssm_jax.kernels.tma_step.default_direct_tma` says, the
  Mosaic GPU step below instead).
- replay step, output and state routes: :class:`ReplayConfig`. The replay
  kernel computes the outputs, appends the new record at the cursor and
  writes each row's next cursor. At large grids the flush is a second
  launch, whose programs (one state tile, a block of batch rows each) skip
  rows whose buffer is not full after the step and materialize the state of
  the others from the checkpoint and the L records, in place: keeping the
  flush out of the replay kernel keeps that kernel's register budget (so its
  occupancy) that of the readout alone, at the price of a second read of the
  flushing rows' checkpoint (|S| / L per step on average). At small grids
  (latency-bound, :func:`replay_is_one_launch`) the replay kernel writes the
  flushing rows' state itself (`fused_flush`), after its readout, re-reading
  their checkpoint rows in sub-tiles. Both flushes apply a row's buffered
  records and then this step from its inputs, so neither reads the slot
  this launch writes. A row that enters with a full buffer (cursor == L,
  possible only after a speculative commit) has no slot for this step's
  record: the flush absorbs the L records and this step at once (cursor 0
  afterwards), as the reference does. No program reads a slot that another
  rewrites in the same launch.

- verify window (:func:`gdn_replay_verify`, :func:`mamba2_replay_verify`):
  :class:`ReplayConfig` (:func:`default_verify_config`). The rows whose
  window does not fit behind the cursor (cursor + W > L) flush first, in
  the replay step's flush launch (their buffered records only); then one
  verify launch reads each checkpoint tile once for the window's W outputs
  and writes the W records at slots cursor .. cursor + W - 1 (0 .. W - 1
  for the flushed rows, whose cursor becomes 0). The checkpoint of the
  other rows and every cursor are left as they are until
  :func:`replayssm_jax.state.replay_commit`.
- replay step, deferred route: the flush launch for the rows that entered
  full (cursor == L), their L records only, as a verify window's early
  flush, no cursor moved; then the append route's launches (below, or the
  Triton replay kernel without a flush), which read those rows as empty
  (`cursor.live_count`) and move their cursor to 1. A row that fills its
  buffer stays full until its next step: the output route's numbers with
  each row's flush a launch later, so that the step's readout runs on the
  append route's kernels.
- replay step, append route, on Mosaic GPU
  (:mod:`replayssm_jax.kernels.tma_readout`, :class:`TMAReadoutConfig`):
  GDN: a Triton prelude launch forms the per-head terms, appends the shared k
  and g records and moves the cursor, in place; one persistent kernel
  pipelines each work item's checkpoint tile and d records into shared
  memory by TMA copies and writes the outputs and d records. Mamba-2: the
  persistent kernel reads the checkpoint's rows for S_c C, then a Triton
  launch does the per-head work, appends the records and moves the cursor.
- GDN replay step, direct route, on Mosaic GPU
  (:mod:`replayssm_jax.kernels.tma_step`, :class:`TMAReadoutConfig`; the
  default where :func:`~replayssm_jax.kernels.tma_step.default_direct_tma`
  says: an f32 checkpoint, bf16 k records, L a multiple of 16, K a
  multiple of 64, batch >= 64 on a Hopper-class GPU): the prelude launch
  (the dead slots' keys zeroed in rows with live records, the cursor set
  to 0), then a persistent kernel that folds the live records into each
  checkpoint tile (an f32 tile with bf16 keys on the tensor cores: the
  weighted d records in three exact bf16 parts), runs the step and writes
  the tile back in place. Compiled GPU only; f32 and bf16 checkpoints.

8-bit checkpoints (int8, float8_e4m3fn; :mod:`replayssm_jax.state`) take
the same kernels: a launch gets the checkpoint as a
:class:`~replayssm_jax.kernels.tiles.Quantized` operand (values, per-row
f32 scales, and for stochastic rounding the rows' seeds), every checkpoint
tile is dequantized at its load (`tiles.load_checkpoint`) and quantized row
by row where it is written (`tiles.store_checkpoint`: the flush launch, the
fused flush, the direct route, the verify window's early flush), with the
reference's rounding bit for bit. The scales are written in place with the
values; the rows' write counts advance outside the launches. An f32 or
bf16 checkpoint is a plain array: those kernels are unchanged.

Around the SSM kernels of a decode step: the conv update
(:func:`conv_update`, :class:`ConvConfig`: one launch, the ring in place;
it reads a packed projection at its column offset and writes its output in
pieces) and the decode attention (:func:`attention_decode`,
:class:`AttentionConfig`: one launch over each row's live cache positions,
flash decoding's parts where the rows are few).

Every replay step moves the cursor in place
(:mod:`replayssm_jax.kernels.cursor`): a one-launch step (fused flush,
direct route) by counting arrivals, a two-launch step in its flush launch,
which reads the replay kernel's copy of the cursors at entry.

Modules: :mod:`~.config` (configs, heuristics, limits), :mod:`~.launch`
(pallas_call plumbing), :mod:`~.tiles` (ref views, masked loads,
mat-vecs), :mod:`~.replay_math` (replay weights, rank-L update, record
fold), :mod:`~.cursor` (the cursor protocol), :mod:`~.gdn` and
:mod:`~.mamba2` (the kernels of each layer), :mod:`~.tma_readout` and
:mod:`~.tma_step` (the Mosaic GPU kernels), :mod:`~.conv` and
:mod:`~.attention`.
"""

from __future__ import annotations

from replayssm_jax.kernels.attention import attention_decode
from replayssm_jax.kernels.config import (
    MAX_BUFFER_LEN,
    MAX_HEAD_DIM,
    AttentionConfig,
    ConvConfig,
    ReplayConfig,
    StepConfig,
    default_attention_config,
    default_conv_config,
    default_direct_config,
    default_replay_config,
    default_step_config,
    default_verify_config,
    fuse_conv_default,
    replay_is_one_launch,
)
from replayssm_jax.kernels.conv import ACTIVATIONS as CONV_ACTIVATIONS
from replayssm_jax.kernels.conv import conv_update
from replayssm_jax.kernels.gdn import (conv_step_config, conv_step_fits, gdn_conv_step, gdn_replay_step, gdn_replay_verify, gdn_step,
                                      gdn_verify)
from replayssm_jax.kernels.mamba2 import mamba2_replay_step, mamba2_replay_verify, mamba2_step, mamba2_verify
from replayssm_jax.kernels.tma_readout import TMAReadoutConfig

__all__ = [
    "AttentionConfig",
    "CONV_ACTIVATIONS",
    "ConvConfig",
    "MAX_BUFFER_LEN",
    "MAX_HEAD_DIM",
    "ReplayConfig",
    "StepConfig",
    "TMAReadoutConfig",
    "attention_decode",
    "conv_step_config",
    "conv_step_fits",
    "conv_update",
    "default_attention_config",
    "default_conv_config",
    "default_direct_config",
    "default_replay_config",
    "default_step_config",
    "default_verify_config",
    "fuse_conv_default",
    "gdn_conv_step",
    "gdn_replay_step",
    "gdn_replay_verify",
    "gdn_step",
    "gdn_verify",
    "mamba2_replay_step",
    "mamba2_replay_verify",
    "mamba2_step",
    "mamba2_verify",
    "replay_is_one_launch",
]
