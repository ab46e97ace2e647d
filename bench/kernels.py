"""Decode-step kernel benchmark: standard vs ReplaySSM, one layer, on a GPU.

Shapes (one layer each; the `model` shapes of the case tables in replayssm_jax.testing, which the tests
share, as they share its random inputs and its tolerance table):
  qwen3.5-4b-gdn       Gated DeltaNet, H = 16 key heads, HV = 32 value heads, K = V = 128
  nemotron3-nano-4b    Mamba-2, 96 heads, head_dim P = 80, d_state N = 128, 8 groups
Activations bf16, buffers bf16 (the activation dtype), state f32 or bf16.

Method (the settings are a TimingOptions):
  * correctness first, in the same run, at the same shape: 2 standard steps
    against the reference, and for each L one full flush cycle of replay
    steps (all rows in step, cursor 0 -> L) whose outputs are compared with
    the reference standard step and whose final checkpoint (every row has
    flushed) is compared with the reference state, within the tests'
    tolerance (replayssm_jax.testing.TOLERANCES) of the bench's dtypes;
    where the GDN append route's Mosaic GPU kernel applies, also one
    lockstep cycle (L - 1 append steps on it, then the direct step) against
    the same reference. A timing counts only if its shape passed.
  * timing: a jitted, fully unrolled cycle of the L steps of a flush cycle
    (cursor through 0..L-1, flushes included; the standard step uses 16
    steps), with the carry donated. The carry holds `n_sets` independent
    copies of the layer's state ("layers"), each stepped once per step, so
    that the states together exceed the L2 (>= 240 MB, at most 64 copies)
    and every step reads its state from HBM. Each step of the cycle takes
    its own inputs (q/k/v/gates, or x/B/C/dt; `steps` separate non-donated
    arguments, shared by the sets): a decode step's inputs come from the
    projection GEMM, and slicing step t's inputs out of a stacked [L, ...]
    array, or a while loop around the steps, adds XLA memcpy launches and
    gaps that are the benchmark's, not the step's (2026-12-02: 5-15 us a
    step at batch 256, bench/results/2026-12-02-prefetch/hlo); and with one
    input for every step XLA computes a pure launch once for the cycle (the
    Mamba-2 Mosaic GPU readout, which writes nothing but S_c C, on
    2026-12-03). Wall clock around `chained_calls` calls dispatched back to
    back (each on the last one's carry) and
    `block_until_ready`, median of repeats after a compile and warm-up run;
    per-step time = median / (calls * steps * n_sets), where a chain has
    at least `chained_calls` calls and lasts at least `min_chain_s` by the
    warm-up call's time. A chain pays the first call's dispatch and the
    final sync once, 0.2-1.2 ms on the H200 (2026-12-04), where a trace of the
    chain shows no gap between the calls' kernels; a decode loop pays it
    once for all its steps.
  * replay rows at staggered cursors (row r starts at r mod L) unless the
    variant says "in-step" (all rows start at 0 and flush together) or
    "lockstep" (from cursors 0, a cycle of L - 1 replay steps without a
    flush and one direct step that flushes every row: Generator's
    `lockstep` schedule, its append steps at the library's default, which
    is the Mosaic GPU kernel kernels.TMAReadoutConfig for either layer's
    f32 or bf16 checkpoint at batch >= 64 on a Hopper-class GPU; where that
    kernel takes the shape, the other append kernel beside it:
    "-lockstep-triton" (the Triton kernel's default ReplayConfig) or
    "-lockstep-tma"); at batches where the default replay step is one
    launch, also the direct route from empty buffers (plain decoding: the
    state written every step), elsewhere also the deferred route
    ("-deferred" from staggered cursors, "-in-step-deferred": a flush
    launch for the rows that entered full, then the append route's kernels
    at their default). Where the GDN standard step's Mosaic GPU
    kernel takes the shape, "standard-tma" times it beside the default
    standard step.
  * bytes per step from a traffic model (each array the kernels touch,
    once: state read (+ write for standard; for replay + the flush launch's
    re-read and write, / L), the full L-slot buffer tiles read, one record
    written, inputs and outputs),
    achieved GB/s = bytes / time, against the device's copy bandwidth measured
    in the run (bench/device_rates.py: the fastest of PyTorch's device copy,
    where PyTorch sees the GPU, XLA's copy and an XLA elementwise pass).
  * with --profile, the traced time of the layer's kernels alone
    (`kernel_us`) beside the step's wall time (`wall_over_kernel`); with
    --orig, each standard and replay row over the original's same variant
    from a ../shared/anchors harness JSON of the same GPU run
    (`kernel_over_original`, `wall_over_original`; `against_original`).

  * 8-bit checkpoints (--state-dtypes with int8 or float8_e4m3fn): the
    replay variants only (no standard step takes an 8-bit state), the
    checkpoint quantized at init with per-row scales; the check runs the
    flush cycles against the reference standard step on the f32 state within
    the 8-bit tolerance; each row gives its time against the f32 and bf16
    checkpoints' same variant of this run (`vs_float32`, `vs_bfloat16`),
    and the traffic model counts 1 byte per element plus the f32 scales.

Usage (GPU):  python3 bench/kernels.py [--layers gdn,mamba2] [--batches 1,8,...]
              [--state-dtypes float32,bfloat16] [--lengths 8,16,32] [--out DIR] [--tag NAME]
  8-bit rows: --state-dtypes float32,bfloat16,int8,float8_e4m3fn --batches 64,128,256,512
  --sweep     time the standard and replay kernels over the fixed tilings of
              SWEEP_CONFIGS (or --standard-configs / --replay-configs) instead
              of the table (after the same check), then print the default and
              the fastest tiling of each variant;
              its results are how the frozen heuristics in kernels/config.py are chosen;
              --sweep-routes output,state times each replay tiling on both routes,
              --sweep-cursors staggered,in-step from both kinds of cursors.
  --profile   also trace one more run of each variant (bench/step_profile.py)
              and report the GPU time per step of each kernel (replay, flush
              launch, standard step, XLA fusions): where a step's time goes.
  --verify W  also time speculative verify windows of W positions per row
              (all accepted), per window, at each L >= W: ReplaySSM's verify
              kernel plus its commit (a cursor move) against the per-draft
              standard path that the standard state takes (as vLLM's: one
              launch per layer reads the current state once and writes the
              state after each of the W positions to its own slot of a slotted
              state, W + 1 slots; the commit moves the slot index), over a
              flush cycle of L // W windows. The per-draft launch is checked
              against the reference first, in the same run (`check_per_draft`);
              the ReplaySSM verify kernels' correctness is the GPU tests'
              (tests/test_verify_kernels.py).
  --orig JSON the anchors harness's JSON (harness_orig.py run, same GPU command): ratios to the original.
  --gdn-gates raw | given  the GDN kernels' gate form: raw (default; a, b, A_log, dt_bias, formed
              in the kernels) or given (g and beta as inputs): the two side by side show the
              cost of forming the gates in the kernels.
  --dry-run   run the script on the CPU in interpret mode (numbers meaningless).
Prints a table; writes JSON to DIR/NAME.json (default DIR: bench/results/DATE-NAME).
Results: bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

# This checkout's package comes last on the path: a replayssm_jax importable
# already (installed, or another code tree put first on PYTHONPATH to compare
# with this one) is the one measured; put first, the checkout would shadow
# such a tree. (Run as `python3 bench/kernels.py`, this folder is already
# first on the path, for step_profile.)
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import bench_args  # noqa: E402  (bench/bench_args.py)
import device_rates  # noqa: E402  (bench/device_rates.py)
import step_profile  # noqa: E402  (bench/step_profile.py)

from replayssm_jax import kernels, ops, testing  # noqa: E402
from replayssm_jax.kernels import ReplayConfig, StepConfig, tma_readout, tma_step  # noqa: E402
from replayssm_jax.kernels.config import deferred_flush_default  # noqa: E402
from replayssm_jax.layers.cache import committed_index  # noqa: E402
from replayssm_jax.state import CHECKPOINT_DTYPES, dequantize, is_quantized  # noqa: E402
from replayssm_jax.testing import (CASE_TABLES, GDNShape, Mamba2Shape,  # noqa: E402,F401
                                   closeness_on_device, tolerance_dtype)

f32, bf16 = jnp.float32, jnp.bfloat16
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BATCHES = (1, 8, 32, 64, 128, 256, 512)
LENGTHS = (8, 16, 32)
BACKENDS = ("pallas", "interpret")


def results_folder(name: str) -> str:
    """bench/results/DATE-NAME, today's date (UTC): the default folder of a run's raw files."""
    return os.path.join(RESULTS, f"{datetime.datetime.now(datetime.UTC).date().isoformat()}-{name}")


@dataclasses.dataclass(frozen=True)
class TimingOptions:
    """How a variant is run and timed (the method in this module's docstring).

    backend: "pallas" (the compiled kernels, on a GPU) or "interpret" (Pallas
        interpret mode: a CPU check of a script, whose times mean nothing).
    repeats: timed repeats of a cycle; the median counts.
    min_sets, max_sets, l2_target_bytes: a step steps n_sets_for(bench)
        copies of the layer's state, as many as hold l2_target_bytes together
        (far above the H200's 50 MiB L2, so every step reads its state from
        HBM), within [min_sets, max_sets].
    standard_steps: steps of a timed standard cycle (a replay cycle is a
        flush cycle: L steps).
    chained_calls: the fewest calls of the jitted cycle a repeat, each on the last
        one's carry. One call alone also times the host's dispatch of its
        arguments (about 1 ms for the 64 sets of replay states at batch 1,
        over 1.1 us per step: bench/RESULTS.md, 2026-11-30); in a chain that
        work overlaps the previous call's kernels, as in a decode loop. With
        4 calls of 32 steps, the chain's one-time cost was 2-14 us a step
        (bench/RESULTS.md, 2026-12-04).
    min_chain_s: the least seconds of a repeat's chain, by the warm-up call's
        time (more calls than `chained_calls` where its calls are short).
    profile: also trace one more run of each variant and report the GPU time
        per step of each kernel (bench/step_profile.py).

    Raises ValueError for another backend, a count below 1, or min_sets
    above max_sets.
    """

    backend: str = "pallas"
    repeats: int = 7
    min_sets: int = 2
    max_sets: int = 64
    l2_target_bytes: float = 240e6
    standard_steps: int = 16
    chained_calls: int = 16
    min_chain_s: float = 0.1
    profile: bool = False

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"`backend` must be one of {', '.join(BACKENDS)}; got {self.backend!r}")
        for name in ("repeats", "min_sets", "max_sets", "standard_steps", "chained_calls"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"`{name}` must be an int >= 1; got {getattr(self, name)!r}")
        if not (isinstance(self.min_chain_s, (int, float)) and self.min_chain_s >= 0):
            raise ValueError(f"`min_chain_s` must be >= 0; got {self.min_chain_s!r}")
        if self.min_sets > self.max_sets:
            raise ValueError(f"`min_sets` must be <= `max_sets` = {self.max_sets}; got {self.min_sets}")

    @classmethod
    def dry_run(cls, **changes) -> TimingOptions:
        """Interpret mode, one state set, one repeat of one call: a CPU check of a script (numbers meaningless)."""
        return cls(**{**dict(backend="interpret", repeats=1, min_sets=1, max_sets=1, chained_calls=1,
                            min_chain_s=0.0), **changes})


class _LayerBench:
    """One layer at one batch and state dtype: the adapter of replayssm_jax.testing (its random states and
    inputs, drawn by jax.random, fast at 1 GB; its steps) with bf16 activations, plus the traffic model's byte
    counts. `shape`: a GDNShape or Mamba2Shape (its batch replaced by `batch`); `rng`: a numpy Generator
    whose first draw seeds the key (None: key 0)."""

    def __init__(self, shape, batch: int, state_dtype, rng):
        key = jax.random.key(0 if rng is None else int(rng.integers(2**31)))
        super().__init__(shape.with_batch(batch), key, bf16)
        self.b, self.sd = batch, jnp.dtype(state_dtype)
        self.quantized = is_quantized(self.sd)  # an 8-bit replay checkpoint: replay variants only

    def state(self, dtype=None):
        """A random state in the bench's state dtype (or `dtype`); f32 for an 8-bit checkpoint (quantized by
        `replay_init`)."""
        return super().state((f32 if self.quantized else self.sd) if dtype is None else dtype)

    def replay_init(self, checkpoint, L, buffer_dtype=f32, cursor=None):
        """The adapter's replay state; with an 8-bit state dtype, its checkpoint quantized (nearest)."""
        if not self.quantized:
            return super().replay_init(checkpoint, L, buffer_dtype, cursor)
        init = getattr(ops, f"{self.layer}_replay_init")
        rs = init(checkpoint, L, self._key_groups(), buffer_dtype, checkpoint_dtype=self.sd)
        return rs if cursor is None else rs.replace(cursor=jnp.asarray(cursor, jnp.int32))

    def inputs(self, T):
        """T steps of inputs, time-major ([T, batch, ...]: the scan's layout)."""
        return self.random_inputs((T, self.b))

    def slotted_state(self, slots: int):
        """(state [batch, slots, ...], index i32[batch]): the slotted standard state of the per-draft verify,
        a random state at slot 0 (the other slots zero)."""
        state = self.state()
        slotted = jnp.zeros((self.b, slots, *state.shape[1:]), state.dtype).at[:, 0].set(state)
        return slotted, jnp.zeros((self.b,), jnp.int32)

    def per_draft_verify(self, state, index, window, backend="xla", config=None):
        """(y [batch, W, ...], new slotted state) of the per-draft standard verify (ops.*_verify) on `backend`."""
        return self._op("verify", backend, config)(state, index, **self._kw(window))

    def state_bytes(self):
        """The state's (checkpoint's) bytes; an 8-bit checkpoint's f32 scales included."""
        heads, rows, _ = self.heads_dims()
        scales = self.b * heads * rows * 4 if self.quantized else 0
        return self.b * math.prod(self.heads_dims()) * self.sd.itemsize + scales


class GDNBench(_LayerBench, testing.GDN):
    """The GDN layer's ops as the layers call them: the gates raw (a, b bf16[batch, HV]; A_log f32[HV] =
    log(linspace(1, 16)) as the layer's init, dt_bias -3: log decays of about -0.05 to -0.8 a step), which
    the kernels form into g and beta, as the original ReplaySSM kernels do. raw_gates False: g f32 and
    beta bf16 [batch, HV] given instead, as the adapter draws them (the kernels' other form; the benchmark
    before the raw gates)."""

    def __init__(self, shape, batch: int, state_dtype, rng, raw_gates: bool = True):
        super().__init__(shape, batch, state_dtype, rng)
        self.raw_gates = raw_gates
        self.A_log = jnp.log(jnp.linspace(1.0, 16.0, self.s.HV, dtype=f32))
        self.dt_bias = jnp.full((self.s.HV,), -3.0, f32)

    def random_inputs(self, lead):
        """q, k, v as the adapter's; a, b [*lead, HV] N(0, 1) in the activations' dtype (raw gates), else the
        adapter's g and beta."""
        inp = super().random_inputs(lead)
        if not self.raw_gates:
            return inp
        del inp["g"], inp["beta"]
        HV = self.s.HV
        return dict(inp, a=jnp.asarray(self._n(*lead, HV), self.dtype), b=jnp.asarray(self._n(*lead, HV), self.dtype))

    def _kw(self, inp):
        return dict(inp, A_log=self.A_log, dt_bias=self.dt_bias) if self.raw_gates else inp

    def io_bytes(self):
        s, b = self.s, self.b
        gates = 2 + 2 if self.raw_gates else 4 + 2  # a, b bf16 or g f32, beta bf16
        return b * (2 * s.H * s.K * 2 + s.HV * s.V * 2 * 2 + s.HV * gates)  # q, k, v, o, the gates

    def buffer_bytes(self, L):
        """(read per step, written per step): the full L-slot tiles of d, k, g; one record."""
        s, b = self.s, self.b
        rec = b * (s.HV * s.V * 2 + s.H * s.K * 2 + s.HV * 4)
        return L * rec, rec


class Mamba2Bench(_LayerBench, testing.Mamba2):
    def io_bytes(self):
        s, b = self.s, self.b
        return b * (3 * s.H * s.P * 2 + s.H * 2 + 2 * s.G * s.N * 2)  # x, z, y, dt, B, C

    def buffer_bytes(self, L):
        s, b = self.s, self.b
        rec = b * (s.H * s.P * 2 + s.H * 4 + s.G * s.N * 2)
        return L * rec, rec


# ---------------------------------------------------------------------------


def _take(xs, t):
    return jax.tree.map(lambda a: a[t], xs)


def _compared(pairs, dtype) -> dict:
    """The comparison of each (actual, expected) of `pairs` with the tolerance of `dtype`
    (replayssm_jax.testing.TOLERANCES): the worst one's errors, and `ok` if all passed."""
    cs = [closeness_on_device(a, e, dtype) for a, e in pairs]
    worst = max(cs, key=lambda c: (not c.ok, c.max_abs / max(c.allowed, 1e-30)))
    return dict(worst.as_dict(), ok=all(c.ok for c in cs))


def check(bench, lengths, backend="pallas", config_std=None):
    """Correctness at this shape of the kernels run on `backend` ("pallas" or "interpret") against the
    reference in float32 (no TF32), with the tests' tolerance of the bench's input and state dtypes. Returns
    a dict of errors and `ok`."""
    with jax.default_matmul_precision("highest"):
        return _check(bench, lengths, backend, config_std)


def _check(bench, lengths, backend, config_std):
    out = {}
    tol = tolerance_dtype(bench.dtype, bench.sd)
    state = bench.state()
    xs = bench.inputs(max(lengths) + 4)
    s_k, s_r = state, state.astype(f32)
    ys, states = [], []
    for t in range(0 if bench.quantized else 2):  # no standard step takes an 8-bit state
        y_k, s_k = bench.step(s_k, _take(xs, t), backend, config_std)
        y_r, s_r = bench.step(s_r, _take(xs, t), "xla")
        ys.append((y_k, y_r))
        states.append((s_k, s_r))
    out["standard_y"], out["standard_state"] = ((dict(ok=True), dict(ok=True)) if bench.quantized
                                                else (_compared(ys, tol), _compared(states, tol)))
    # Per L one flush cycle from empty buffers; then, at the longest L, the
    # direct route after buffered steps: the first direct step folds the
    # records, and the checkpoint then follows the standard state.
    # Where the TMA readout applies, one lockstep cycle on each append
    # kernel (and the direct step that flushes them), at the timed
    # variants' lockstep L. The deferred route (its default kernels) at that
    # L: L + 1 steps, the last one flushing every row first, then a direct
    # step.
    L = max(lengths)
    runs = [(f"replay_L{L}", ["output"] * L, None) for L in lengths] + [
        (f"direct_L{L}", ["output"] * (L // 2 + 1) + ["direct"] * 3, None)]
    runs_L = list(lengths) + [L]
    L = lockstep_length(lengths)
    runs.append((f"deferred_L{L}", ["deferred"] * (L + 1) + ["direct"], None))
    runs_L.append(L)
    if tma_applies(bench, L, backend):
        triton = kernels.default_replay_config(bench.b, *bench.heads_dims(), bench.sd, L)
        for name, config in (("tma", kernels.TMAReadoutConfig()), ("triton", triton)):
            runs.append((f"{name}_lockstep_L{L}", ["append"] * (L - 1) + ["direct"], config))
            runs_L.append(L)
    for (name, routes, tma), L in zip(runs, runs_L):
        rs = bench.replay_init(state, L, bench.dtype, np.zeros(bench.b))
        s_r, ys = state.astype(f32), []
        for t, route in enumerate(routes):
            y_k, rs = bench.replay_step(rs, _take(xs, t), route, backend, tma if route == "append" else None)
            y_r, s_r = bench.step(s_r, _take(xs, t), "xla")
            ys.append((y_k, y_r))
        checkpoint = dequantize(rs.checkpoint, rs.scale)  # an 8-bit checkpoint as read; else as it is
        out[name] = {"y": _compared(ys, tol), "checkpoint": _compared([(checkpoint, s_r)], tol),
                     "cursor_zero": bool((np.asarray(rs.cursor) == 0).all())}
    out["ok"] = all(out[key]["ok"] for key in ("standard_y", "standard_state")) and all(
        out[name]["y"]["ok"] and out[name]["checkpoint"]["ok"] and out[name]["cursor_zero"] for name, *_ in runs)
    return out


BENCHES = {"gdn": GDNBench, "mamba2": Mamba2Bench}
GDN_GATES = ("raw", "given")  # the GDN ops' gate forms: a, b, A_log, dt_bias (the layers'), or g and beta


def make_bench(layer: str, batch: int, state_dtype, rng, shape=None, gdn_gates: str = "raw"):
    """The benchmark of one layer ('gdn' or 'mamba2') at `shape` (default: its model shape, the case table's
    `model`); `gdn_gates` "raw" (a, b, A_log, dt_bias) or "given" (g, beta): the GDN ops' gate form.
    Raises ValueError for another layer name or gate form."""
    if layer not in BENCHES:
        raise ValueError(f"unknown layer {layer!r}; choose from {', '.join(BENCHES)}")
    if gdn_gates not in GDN_GATES:
        raise ValueError(f"`gdn_gates` must be one of {', '.join(GDN_GATES)}; got {gdn_gates!r}")
    extra = dict(raw_gates=gdn_gates == "raw") if layer == "gdn" else {}
    return BENCHES[layer](shape or CASE_TABLES[layer].model, batch, state_dtype, rng, **extra)


def n_sets_for(bench, options: TimingOptions) -> int:
    """Copies of the bench's state that together hold `options.l2_target_bytes`, within the options' bounds."""
    per = bench.state_bytes()
    return int(min(options.max_sets, max(options.min_sets, math.ceil(options.l2_target_bytes / per))))


ALL_KERNELS = "(all kernels)"  # kernel_times' entry summing every kernel of the step


def kernel_times(f, carries, inp, per):
    """GPU microseconds per step of the 12 longest kernels of one traced run of f, of all its kernels
    (ALL_KERNELS) and of idle time ("(idle)"); None without a GPU trace."""
    out = []
    trace = step_profile.trace(lambda: out.append(jax.block_until_ready(f(carries, inp))))
    b = step_profile.decode_breakdown(trace, module="jit_cycle", top=12)
    if b is None:
        return None, out[0][0]
    times = {name: dict(us=ns / per / 1e3, launches_per_step=n / per) for name, ns, n in b["top"]}
    every = b["kernels"].values()  # every kernel of the cycle, not only the `top` longest
    times[ALL_KERNELS] = dict(us=sum(ns for ns, _ in every) / per / 1e3, launches_per_step=sum(n for _, n in every) / per)
    times["(idle)"] = dict(us=b["ns"]["idle"] / per / 1e3, launches_per_step=0)
    return times, out[0][0]


def time_cycle(step, carries, inp, steps, options: TimingOptions, chain: bool = False, per_step: bool = False):
    """Median seconds per (step x set) of a jitted, donated cycle of `steps`
    unrolled steps (`step`, or step[t] at step t where `step` is a sequence
    of `steps` step functions), each stepping every carry on the same inputs `inp`
    (`per_step`: `inp` is a sequence of `steps` inputs, step t's inputs[t];
    `chain`: on the output of the step before, as layers follow each other,
    so that XLA cannot fuse the steps of independent carries into one
    launch; the output must then have the inputs' structure)
    (a chain of calls per repeat: TimingOptions), its spread, the compile
    seconds, and (`options.profile`) the kernel times per step."""

    schedule = list(step) if isinstance(step, (list, tuple)) else [step] * steps
    if len(schedule) != steps:
        raise ValueError(f"`step` must be one function or {steps} (one per step); got {len(schedule)}")
    if per_step and len(inp) != steps:
        raise ValueError(f"`inp` must hold {steps} steps' inputs with per_step; got {len(inp)}")

    def cycle(carries, inp):
        y = None
        inputs = list(inp) if per_step else [inp] * steps
        for t, step_t in enumerate(schedule):
            new = []
            for c in carries:
                y, c = step_t(c, y if chain and y is not None else inputs[t])
                new.append(c)
            carries = tuple(new)
        return carries, y

    f = jax.jit(cycle, donate_argnums=0)
    t0 = time.perf_counter()
    carries, y = f(carries, inp)
    jax.block_until_ready((carries, y))
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    carries, y = f(carries, inp)
    jax.block_until_ready((carries, y))
    calls = max(options.chained_calls, math.ceil(options.min_chain_s / (time.perf_counter() - t0)))
    times = []
    for _ in range(options.repeats):
        t0 = time.perf_counter()
        for _ in range(calls):  # dispatched back to back: the host's work hides behind the GPU's
            carries, y = f(carries, inp)
        jax.block_until_ready((carries, y))
        times.append((time.perf_counter() - t0) / calls)
    per = steps * len(carries)
    profile = None
    if options.profile:
        profile, carries = kernel_times(f, carries, inp, per)
    return statistics.median(times) / per, (max(times) - min(times)) / per, compile_s, profile


# The checks and defaults of the append route's Mosaic GPU kernels, per layer.
TMA_CHECKS = {"gdn": (tma_readout.check_tma_readout, tma_readout.default_tma_readout),
              "mamba2": (tma_readout.check_mamba2_tma, tma_readout.default_mamba2_tma)}


def _abstract_step(bench, L):
    """(replay state, v or C) of the bench at buffer length L as shapes (nothing drawn): what the layer's
    TMA check and default take besides the state (GDN v [batch, HV, V], Mamba-2 C [batch, G, N])."""
    checkpoint = jax.ShapeDtypeStruct((bench.b, *bench.heads_dims()), f32 if bench.quantized else bench.sd)
    state = jax.eval_shape(lambda c: bench.replay_init(c, L, bench.dtype), checkpoint)
    s = bench.s
    other = (bench.b, s.HV, s.V) if bench.layer == "gdn" else (bench.b, s.G, s.N)
    return state, jax.ShapeDtypeStruct(other, bench.dtype)


def tma_applies(bench, L, backend) -> bool:
    """Whether the layer's append route on Mosaic GPU (kernels.TMAReadoutConfig) takes this bench's state
    at buffer length L on `backend` (compiled only; checked on the state's shapes, nothing drawn)."""
    if backend != "pallas":
        return False
    try:
        TMA_CHECKS[bench.layer][0](*_abstract_step(bench, L), kernels.TMAReadoutConfig(), interpret=False,
                                   slots=None)
    except (ValueError, NotImplementedError):
        return False
    return True


def tma_is_default(bench, L) -> bool:
    """Whether the append route takes the Mosaic GPU kernels by default here (tma_readout's
    default_tma_readout, default_mamba2_tma: f32 or bf16 checkpoints of batch >= 64 on a Hopper-class GPU)."""
    return TMA_CHECKS[bench.layer][1](*_abstract_step(bench, L), interpret=False, slots=None) is not None


def standard_tma_applies(bench, backend) -> bool:
    """Whether the GDN standard step's Mosaic GPU kernel (tma_step.STEP_CONFIG, not a default) takes this
    bench's state on `backend` (compiled only; checked on shapes)."""
    if bench.layer != "gdn" or backend != "pallas" or bench.quantized:
        return False
    state = jax.ShapeDtypeStruct((bench.b, *bench.heads_dims()), bench.sd)
    try:
        tma_step.check_step_tma(state, _abstract_step(bench, 16)[1], tma_step.STEP_CONFIG, interpret=False,
                                slots=None)
    except (ValueError, NotImplementedError):
        return False
    return True


def lockstep_length(lengths) -> int:
    """The buffer length of the in-step and lockstep variants: 16 where timed, else the first length."""
    return 16 if 16 in lengths else lengths[0]


def variants(bench, lengths, backend="pallas"):
    """(name, L, cursors, route, config) of the variants timed at a shape:
    the standard step, and where the GDN standard step's Mosaic GPU kernel
    takes the shape (`standard_tma_applies`) "standard-tma" on it; the
    replay step at each L (staggered cursors) and at one L in step, and,
    where the default replay step is one launch (a latency-bound batch), the
    direct route from empty buffers, elsewhere the deferred route from
    staggered cursors and in step ("-deferred", "-in-step-deferred"), the
    lockstep schedule (`run_variant`), and, where the Mosaic GPU append kernel takes the
    shape (`tma_applies`), the lockstep schedule on the append kernel the
    default does not take: "-lockstep-triton" (and "-deferred-triton")
    where the default is the Mosaic GPU kernel (`tma_is_default`), else
    "-lockstep-tma". An 8-bit
    checkpoint: the replay variants on the output route only. config None:
    the kernels' heuristic."""
    if bench.quantized:
        yield from ((f"replay-L{L}", L, "staggered", "output", None) for L in lengths)
        return
    yield ("standard", None, None, None, None)
    if standard_tma_applies(bench, backend):
        yield ("standard-tma", None, None, None, tma_step.STEP_CONFIG)
    for L in lengths:
        yield (f"replay-L{L}", L, "staggered", "output", None)
    L = lockstep_length(lengths)
    yield (f"replay-L{L}-in-step", L, "in-step", "output", None)
    if kernels.replay_is_one_launch(bench.b, *bench.heads_dims(), bench.sd, L):
        yield (f"replay-L{L}-direct", L, "empty", "direct", None)
    else:  # Generator's lockstep applies where some layer is not on the direct route
        yield (f"replay-L{L}-deferred", L, "staggered", "deferred", None)
        yield (f"replay-L{L}-in-step-deferred", L, "in-step", "deferred", None)
        yield (f"replay-L{L}-lockstep", L, "lockstep", "output", None)
        if tma_applies(bench, L, backend) and tma_is_default(bench, L):  # the Triton append kernel beside it
            triton = kernels.default_replay_config(bench.b, *bench.heads_dims(), bench.sd, L)
            yield (f"replay-L{L}-lockstep-triton", L, "lockstep", "output", triton)
            yield (f"replay-L{L}-deferred-triton", L, "staggered", "deferred", triton)
        elif tma_applies(bench, L, backend):
            yield (f"replay-L{L}-lockstep-tma", L, "lockstep", "output", kernels.TMAReadoutConfig())


def standard_bytes(bench) -> float:
    """Traffic model of one standard step: the state read and written, inputs and outputs."""
    return 2 * bench.state_bytes() + bench.io_bytes()


def replay_bytes(bench, L, lockstep: bool = False) -> float:
    """Traffic model of one ReplaySSM step, averaged over a flush cycle: the
    checkpoint read once, re-read and written by the flush launch once per L
    steps (lockstep: read by L - 1 replay steps and read and written by one
    direct step a cycle), the L-slot buffer tiles read and one record
    written, inputs and outputs."""
    read, written = bench.buffer_bytes(L)
    return bench.state_bytes() * (1 + (1 if lockstep else 2) / L) + read + written + bench.io_bytes()


def run_variant(bench, L, cursors, options: TimingOptions, config=None, route="output", direct_config=None):
    """Time one variant: the standard step (L None) or the replay step with
    buffer length L from `cursors` ("staggered": row r at r mod L; "in-step"
    or "empty": all at 0; "lockstep": all at 0, and the cycle's last step on
    the direct route at its default tiling, which flushes every row, the
    L - 1 others on the append route where `route` is "output") on
    `route`, with the kernels' `config` (None: the heuristic; the lockstep
    cycle's direct step: `direct_config`, None its heuristic). Returns
    seconds per step, spread, compile seconds, the number of state sets,
    bytes per step and GB/s from the traffic model, and the kernel times per
    step (None unless `options.profile`)."""
    n = n_sets_for(bench, options)
    if L is None:
        carries = tuple(bench.state() for _ in range(n))
        step = lambda c, inp: bench.step(c, inp, options.backend, config)  # noqa: E731
        steps = options.standard_steps
        bytes_step = standard_bytes(bench)
    else:
        cur = np.arange(bench.b) % L if cursors == "staggered" else np.zeros(bench.b)
        carries = tuple(bench.replay_init(bench.state(), L, bench.dtype, cur) for _ in range(n))
        step = lambda c, inp: bench.replay_step(c, inp, route, options.backend, config)  # noqa: E731
        steps = L
        bytes_step = standard_bytes(bench) if route == "direct" else replay_bytes(bench, L, cursors == "lockstep")
        if cursors == "lockstep":  # as Generator's lockstep: the output route's buffered steps without a flush
            buffered = "append" if route == "output" else route
            step = [lambda c, inp: bench.replay_step(c, inp, buffered, options.backend, config)] * (L - 1)
            step.append(lambda c, inp: bench.replay_step(c, inp, "direct", options.backend, direct_config))
    inputs = tuple(bench.random_inputs((bench.b,)) for _ in range(steps))  # each step its own, as in decoding
    t, spread, compile_s, profile = time_cycle(step, carries, inputs, steps, options, per_step=True)
    return dict(seconds=t, spread=spread, compile_s=compile_s, n_sets=n, bytes=bytes_step, gbps=bytes_step / t / 1e9,
                kernels_us=profile)


def _per_draft_verify(bench, carry, window, num_accepted, options: TimingOptions):
    """The per-draft standard path of one verify window, as `SSMMixer.verify` / `commit` run it on the
    standard state (and vLLM's spec path on its per-draft state slots): one launch reads each row's current
    state once and writes the state after each of the W positions to its own slot; the commit moves the
    index to the accepted position's slot. carry: (slotted state, index). Returns (the last output, the
    committed carry)."""
    state, index = carry
    y, state = bench.per_draft_verify(state, index, window, options.backend)
    return y[:, -1], (state, committed_index(index, state.shape[1], num_accepted))


def check_per_draft(bench, W: int, backend="pallas") -> dict:
    """Correctness at this shape of the per-draft verify launch on `backend` against the reference (float32,
    no TF32), a window of W positions from random rows' slots, within the tests' tolerance of the bench's
    dtypes: the W outputs, the W slots written and the current slot untouched. Returns a dict of errors
    and `ok`."""
    state, _ = bench.slotted_state(W + 1)
    index = jnp.arange(bench.b, dtype=jnp.int32) % (W + 1)
    window = bench.random_inputs((bench.b, W))
    with jax.default_matmul_precision("highest"):
        y_k, s_k = bench.per_draft_verify(state, index, window, backend)
        y_r, s_r = bench.per_draft_verify(state.astype(f32), index, window, "xla")
    rows = jnp.arange(bench.b)
    tol = tolerance_dtype(bench.dtype, bench.sd)
    out = {"y": _compared([(y_k, y_r)], tol), "states": _compared([(s_k, s_r)], tol),
           "current_untouched": bool(jnp.array_equal(s_k[rows, index], state[rows, index]))}
    out["ok"] = out["y"]["ok"] and out["states"]["ok"] and out["current_untouched"]
    return out


def run_verify_variant(bench, L, W, per_draft: bool, options: TimingOptions, config=None):
    """Time one speculative verify window of W positions per row, all W accepted, over a flush cycle of
    L // W windows (cursor 0 -> L, the early flush of the next cycle included): ReplaySSM's verify kernel
    and `replay_commit` (per_draft False) or the per-draft standard path (`_per_draft_verify`). The
    accepted counts are a runtime input, as in a decode loop. Returns the `run_variant` fields, per
    window; `config`: the verify launch's ReplayConfig (None: the heuristic); bytes from the traffic
    model (replay: the checkpoint read once per window and re-read and written once per cycle, the buffer
    tiles read, W records written; per-draft: the current state read once and W states written)."""
    n = n_sets_for(bench, options)
    windows = max(1, L // W)
    window = bench.random_inputs((bench.b, W))
    window["num_accepted"] = jnp.full((bench.b,), W, jnp.int32)
    if per_draft:
        carries = tuple(bench.slotted_state(W + 1) for _ in range(n))

        def step(c, inp):
            inp = dict(inp)
            return _per_draft_verify(bench, c, inp, inp.pop("num_accepted"), options)

        bytes_window = (1 + W) * bench.state_bytes() + W * bench.io_bytes()
    else:
        carries = tuple(bench.replay_init(bench.state(), L, bench.dtype) for _ in range(n))

        def step(c, inp):
            inp = dict(inp)
            m = inp.pop("num_accepted")
            y, c = bench.verify(c, inp, options.backend, config)
            return y[:, -1], ops.replay_commit(c, m)

        read, written = bench.buffer_bytes(L)
        bytes_window = bench.state_bytes() * (1 + 2 / windows) + read + W * written + W * bench.io_bytes()
    t, spread, compile_s, profile = time_cycle(step, carries, window, windows, options)
    return dict(seconds=t, spread=spread, compile_s=compile_s, n_sets=n, bytes=bytes_window,
                gbps=bytes_window / t / 1e9, kernels_us=profile)


# (block_v, num_warps) of the standard step; (block_v, num_warps, tiles) of
# the replay step (with the flush launch). The replay sweep also times the
# default config and the default with `fused_flush` flipped.
SWEEP_CONFIGS = {
    ("gdn", "standard"): [(32, 4), (64, 8)],
    ("mamba2", "standard"): [(16, 2), (16, 4)],
    ("gdn", "replay"): [(32, 4, 4), (64, 4, 2), (32, 4, 1)],
    ("mamba2", "replay"): [(16, 2, 5), (32, 4, 3), (16, 2, 1)],
}


def parse_config(spec: str, kind: str = "replay") -> StepConfig | ReplayConfig:
    """A tiling spec -> the config of `kind`'s launch. "replay": 'BVxWxT',
    'BVxWxTxS' (S: num_stages), 'BVxWxTf' (f: fused flush) or
    'BVxWxT:FBVxFWxFR' (the flush launch's block_v, warps and batch rows per
    program, 0 for the default) -> ReplayConfig. "standard": 'BVxW' or
    'BVxWx1xS' (one tile per program, no flush) -> StepConfig. A 'b' after
    the main fields (e.g. '64x4x2b', '64x4x2fb') launches the batch rows
    fastest (`memory_order=False`). Missing
    trailing fields take their defaults. Raises ValueError for a spec that
    does not parse or (standard) has tiles or flush fields."""
    head, colon, flush = spec.partition(":")
    suffix = head[len(head.rstrip("fb")):]  # f: fused flush; b: batch rows launched fastest
    fused, memory_order = "f" in suffix, "b" not in suffix
    main = _spec_ints(spec, head[:len(head) - len(suffix)], 4)
    bv, warps, tiles, stages = main + [None, 4, 1, 1][len(main):]  # the configs' defaults
    fbv, fwarps, frows = (_spec_ints(spec, flush, 3) + [0, 0, 0])[:3] if colon else (0, 0, 0)
    if kind == "standard":
        if tiles != 1 or fused or colon:
            raise ValueError(f"config spec {spec!r}: the standard step takes one tile per program and no flush "
                             "('BVxW' or 'BVxWx1xSTAGES', optionally 'b')")
        return StepConfig(block_v=bv, num_warps=warps, num_stages=stages, memory_order=memory_order)
    return ReplayConfig(block_v=bv, num_warps=warps, num_stages=stages, tiles=tiles, fused_flush=fused,
                        flush_block_v=fbv, flush_warps=fwarps, flush_rows=frows, memory_order=memory_order)


def _spec_ints(spec: str, part: str, most: int) -> list[int]:
    fields = part.split("x")
    if not 1 <= len(fields) <= most or not all(f.isdigit() for f in fields):
        raise ValueError(f"config spec {spec!r}: expected 'BVxWxT', 'BVxWxTxSTAGES' or 'BVxWxTf', then optionally "
                         f"':FBVxFWxROWS' (1-{most} 'x'-separated integers in {part!r})")
    return [int(f) for f in fields]


def sweep_configs(bench, L, overrides=None):
    """(default config, configs to time) of the standard step (L None) or the replay step: the tilings of
    `overrides` ({"standard": [StepConfig, ...], "replay": [ReplayConfig, ...]}, from --standard-configs /
    --replay-configs) or else SWEEP_CONFIGS, after the default (and, for the replay step, the default with
    fused_flush flipped)."""
    kind = "standard" if L is None else "replay"
    override = (overrides or {}).get(kind)
    if L is None:
        default = kernels.default_step_config(bench.b, *bench.heads_dims(), bench.sd, bench.layer)
        fixed = override or [StepConfig(bv, warps) for bv, warps in SWEEP_CONFIGS[(bench.layer, "standard")]]
        return default, list(dict.fromkeys([default] + fixed))
    default = kernels.default_replay_config(bench.b, *bench.heads_dims(), bench.sd, L)
    fixed = override or [ReplayConfig(bv, warps, tiles=tiles)
                         for bv, warps, tiles in SWEEP_CONFIGS[(bench.layer, "replay")]]
    flipped = dataclasses.replace(default, fused_flush=not default.fused_flush)
    return default, list(dict.fromkeys([default, flipped] + fixed))


def sweep(bench, base, rows, lengths, options: TimingOptions, overrides=None, routes=("output",),
          cursors=("staggered",)):
    """Time the standard and replay kernels over the tilings of sweep_configs, the replay step on each of
    `routes` ("output", "state", "deferred") from each of `cursors` ("staggered", "in-step": the rows of a decode loop
    that started together, which all flush in the same step; "lockstep": `run_variant`'s cycle, the swept
    tiling on its L - 1 replay steps, and then, at the default tiling, each of the direct step's tilings
    `overrides["direct"]`, if any); variants "replay-L16", "replay-L16-state", "replay-L16-in-step", ...;
    append a row each to `rows`."""
    replays = [(f"replay-L{L}" + "".join(f"-{x}" for x in (route, start) if x not in ("output", "staggered")),
                L, route, start) for L in lengths for route in routes for start in cursors]
    for kind, L, route, start in [("standard", None, None, None)] + replays:
        default, configs = sweep_configs(bench, L, overrides)
        runs = [(cfg, None) for cfg in configs]
        if start == "lockstep":
            runs += [(default, direct) for direct in (overrides or {}).get("direct", [])]
        for cfg, direct in runs:
            r = run_variant(bench, L, start, options, cfg, route=route or "output", direct_config=direct)
            is_default = cfg == default and direct is None
            ran = deferred_flush_default(cfg, bench.sd, bench.heads_dims()[1]) if route == "deferred" else cfg
            rows.append(dict(base, variant=kind, L=L, config=dataclasses.asdict(ran), default=is_default,
                             direct_config=direct and dataclasses.asdict(direct), **r))
            tag = ran.tag() + ("" if direct is None else f" direct {direct.tag()}")  # the tiling that ran
            print(f"sweep {bench.layer:7s} {bench.sd.name:9s} b{bench.b:<4d} {kind:12s} {tag:24s}"
                  f" {r['seconds'] * 1e6:9.2f} us {r['gbps']:7.0f} GB/s{'  (default)' if is_default else ''}",
                  flush=True)
            print_kernel_times(r["kernels_us"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=bench_args.subset_of("gdn", "mamba2"), default="gdn,mamba2")
    p.add_argument("--batches", type=bench_args.positive_ints, default=",".join(map(str, BATCHES)))
    p.add_argument("--state-dtypes", type=bench_args.subset_of(*(d.name for d in CHECKPOINT_DTYPES)),
                   default="float32,bfloat16")
    p.add_argument("--lengths", type=bench_args.positive_ints, default=",".join(map(str, LENGTHS)))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None,
                   help="default: bench/results/DATE-TAG (with --dry-run: a new temporary folder)")
    p.add_argument("--tag", default="kernels")
    p.add_argument("--sweep", action="store_true", help="time block_v x num_warps at each shape instead")
    p.add_argument("--standard-configs", default="",
                   help="with --sweep: standard tilings to time instead of SWEEP_CONFIGS, e.g. '64x8,128x8' "
                        "(BVxW or BVxWx1xSTAGES)")
    p.add_argument("--replay-configs", default="",
                   help="with --sweep: replay tilings instead of SWEEP_CONFIGS, e.g. '16x4x1f,64x4x2,64x4x2:32x2x4' "
                        "(BVxWxT or BVxWxTxSTAGES, f: fused; after ':' the flush launch's BVxWxROWS)")
    p.add_argument("--sweep-routes", type=bench_args.subset_of("output", "state", "deferred"), default=("output",),
                   help="with --sweep: the replay step's routes to time, of output,state,deferred (the state route "
                        "forms the state tile with the rank-L dot, on the tensor cores; the deferred route's "
                        "flush launch takes the tiling's flush fields, or where all are unset its own default, "
                        "which the printed tag shows)")
    p.add_argument("--sweep-cursors", type=bench_args.subset_of("staggered", "in-step", "lockstep"),
                   default=("staggered",),
                   help="with --sweep: the replay rows' cursors at the start, of staggered,in-step,lockstep (in "
                        "step: every row flushes in the same step, as in a decode loop whose rows started together; "
                        "lockstep: in step, the cycle's last step on the direct route at its default tiling)")
    p.add_argument("--profile", action="store_true", help="trace a run of each variant: GPU time per kernel and step")
    p.add_argument("--direct-configs", default="",
                   help="with --sweep and --sweep-cursors lockstep: the lockstep cycle's direct step at these tilings "
                        "(as --standard-configs; folding with the rank-L dot, StepConfig.dot_fold)")
    p.add_argument("--verify", type=bench_args.non_negative_int, default=0, metavar="W",
                   help="also time speculative verify windows of W positions (all accepted) at each L >= W: "
                        "ReplaySSM's verify kernel + commit against the per-draft standard path; times per window")
    p.add_argument("--verify-configs", default="",
                   help="with --verify: also time the verify launch at these tilings, e.g. '8x4x1,16x2x1' (BVxWxT, "
                        "as --replay-configs; not fused)")
    p.add_argument("--gdn-gates", default="raw", choices=GDN_GATES,
                   help="the GDN kernels' gates: raw (default; a, b, A_log, dt_bias, formed into g and beta in the "
                        "kernels, as the layers and the original's kernels take them) or given (g and beta as inputs; "
                        "--orig's ratios then leave the gates out of our side)")
    p.add_argument("--orig", default=None, metavar="JSON",
                   help="a ../shared/anchors harness_orig.py JSON of the same run: each row's time over the original's")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU smoke test of this script: interpret mode, 1 state set, 1 repeat, the real shapes "
                        "(minutes per layer and state dtype; numbers meaningless)")
    args = p.parse_args(argv)
    if max(args.lengths) > kernels.MAX_BUFFER_LEN:
        p.error(f"argument --lengths: the kernels take L <= {kernels.MAX_BUFFER_LEN}; got {max(args.lengths)}")
    overrides = {}  # --standard-configs / --replay-configs
    for kind, specs in (("standard", args.standard_configs), ("replay", args.replay_configs),
                        ("verify", args.verify_configs), ("direct", args.direct_configs)):
        if specs:
            try:
                overrides[kind] = [parse_config(x, "replay" if kind in ("replay", "verify") else "standard")
                                   for x in specs.split(",")]
                if kind == "direct":
                    overrides[kind] = [dataclasses.replace(c, dot_fold=True) for c in overrides[kind]]
            except (ValueError, TypeError) as e:
                p.error(f"--{kind}-configs: {e}")
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="kernels_dry_run_") if args.dry_run else results_folder(args.tag)
    try:
        options = TimingOptions(repeats=args.repeats, profile=args.profile)
    except ValueError as e:
        p.error(f"--repeats: {e}")
    if args.dry_run:  # the real shapes in interpret mode: minutes per layer and state dtype
        options = TimingOptions.dry_run(profile=args.profile)
    elif jax.default_backend() != "gpu":
        sys.exit("bench/kernels.py needs a GPU (JAX default backend is %r)" % jax.default_backend())
    rng = np.random.default_rng(0)
    lengths = tuple(args.lengths)
    dev = jax.devices()[0]
    meta = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), device=dev.device_kind,
                jax=jax.__version__, python=platform.python_version(),
                argv=sys.argv[1:] if argv is None else list(argv), timing=dataclasses.asdict(options),
                gdn_gates=args.gdn_gates)
    meta["bandwidth_gbps"] = device_rates.copy_bandwidth(nbytes=(1 << 20) if args.dry_run else (2 << 30))
    copy_bw = max(meta["bandwidth_gbps"].values())  # the device's copy ceiling (bench/device_rates.py)
    print(f"# {meta['device']}  jax {meta['jax']}  copy {copy_bw:.0f} GB/s  (" +
          ", ".join(f"{k} {v:.0f}" for k, v in meta["bandwidth_gbps"].items()) + f")  GDN gates {args.gdn_gates}",
          flush=True)
    original = load_original(args.orig) if args.orig else []
    rows = []
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{args.tag}.json")
    for layer in args.layers:
        for sd in args.state_dtypes:
            for batch in args.batches:
                bench = make_bench(layer, batch, sd, rng, gdn_gates=args.gdn_gates)
                shape_name = str(bench.s)
                t0 = time.perf_counter()
                chk = check(bench, lengths, options.backend)
                check_s = time.perf_counter() - t0
                base = dict(layer=layer, shape=shape_name, batch=batch, state_dtype=sd, check=chk, check_s=check_s,
                            gates=args.gdn_gates if layer == "gdn" else None)
                if not chk["ok"]:
                    print(f"FAILED correctness {layer} {sd} b{batch}: {chk}", flush=True)
                    rows.append(dict(base, variant="check", passed=False))
                    continue
                if args.sweep:
                    sweep(bench, base, rows, lengths, options, overrides, args.sweep_routes, args.sweep_cursors)
                std = None
                for kind, L, cursors, route, config in [] if args.sweep else variants(bench, lengths, options.backend):
                    r = run_variant(bench, L, cursors, options, config=config, route=route)
                    if kind == "standard":
                        std = r["seconds"]
                    row = dict(base, variant=kind, L=L, cursors=cursors, route=route, **r,
                               speedup=None if std is None else std / r["seconds"],
                               pct_copy=100 * r["gbps"] / copy_bw, passed=True)
                    if bench.quantized:  # against the f32 and bf16 checkpoints' same variant, if run before
                        row.update(_against_wider_checkpoints(rows, row))
                    row.update(against_original(row, original))
                    rows.append(row)
                    versus = ("" if row["speedup"] is None else f"x{row['speedup']:.2f} vs std") + "".join(
                        f" x{row[k]:.2f} {k}" for k in ("vs_float32", "vs_bfloat16") if row.get(k)) + "".join(
                        f" {row[k]:.2f} {k}" for k in ("kernel_over_original", "wall_over_original") if row.get(k))
                    print(f"{layer:7s} {sd:9s} b{batch:<4d} {kind:22s} {r['seconds'] * 1e6:9.2f} us "
                          f"{r['gbps']:7.0f} GB/s {row['pct_copy']:5.1f}% copy  {versus}"
                          f"  (sets {r['n_sets']}, compile {r['compile_s']:.1f}s)", flush=True)
                    print_kernel_times(r["kernels_us"])
                if args.verify and not args.sweep:
                    verify_rows(bench, base, rows, lengths, args.verify, options, overrides.get("verify", ()))
                with open(path, "w") as fh:
                    json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    with open(path, "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=1)
    if args.sweep:
        sweep_summary(rows)
    else:
        summary(rows, copy_bw)
    print(f"JSON: {path}")
    return 0


def verify_rows(bench, base, rows, lengths, W, options: TimingOptions, configs=()):
    """Append the verify rows of one shape: per L >= W, the per-draft standard path and ReplaySSM's
    verify with the heuristic's tiling, then with each of `configs` (speedup: per-draft time / this
    row's time)."""
    checked = check_per_draft(bench, W, options.backend)
    if not checked["ok"]:
        print(f"{base['layer']:7s} {base['state_dtype']:9s} b{base['batch']:<4d} the per-draft verify FAILED its "
              f"check: {checked}; no verify row", flush=True)
        rows.append(dict(base, variant=f"verify-W{W}-per-draft", W=W, passed=False, check=checked))
        return
    for L in (L for L in lengths if L >= W):
        per_draft = None
        runs = [(f"verify-W{W}-per-draft", True, None), (f"verify-W{W}-L{L}", False, None)]
        runs += [(f"verify-W{W}-L{L}-{c.tag()}", False, c) for c in configs]
        for kind, flag, config in runs:
            r = run_verify_variant(bench, L, W, flag, options, config)
            per_draft = per_draft or r["seconds"]
            rows.append(dict(base, variant=kind, L=L, W=W, **r, speedup=per_draft / r["seconds"], passed=True,
                             config=None if config is None else dataclasses.asdict(config)))
            print(f"{base['layer']:7s} {base['state_dtype']:9s} b{base['batch']:<4d} {kind:22s} "
                  f"{r['seconds'] * 1e6:9.2f} us/window {r['gbps']:7.0f} GB/s  x{per_draft / r['seconds']:.2f} vs "
                  f"per-draft  (sets {r['n_sets']}, compile {r['compile_s']:.1f}s)", flush=True)
            print_kernel_times(r["kernels_us"])


def load_original(path: str) -> list[dict]:
    """The timed rows of a ../shared/anchors harness_orig.py JSON (the original ReplaySSM kernels and vLLM's)."""
    with open(path) as fh:
        return [r for r in json.load(fh)["rows"] if "us" in r]


def against_original(row: dict, original: list[dict]) -> dict:
    """This row's time over the original's same variant in `original` (harness rows; none: {}).

    Standard step (and standard-tma): vLLM's kernel at the best config of its tuning grid; replay-L{L}
    (staggered) and replay-L{L}-in-step: the fork's replay kernel at its shipped config, same L and cursors;
    replay-L{L}-lockstep (and -lockstep-tma, -lockstep-triton): the same against its rows in step (every row
    flushes in one step of L). kernel_over_original: the traced time of our SSM kernels (replay + flush
    launch; --profile; a row whose step ran a Mosaic GPU kernel (named *_tma_*): every kernel of its step,
    the Triton launch beside it and any XLA op included, ALL_KERNELS) over the original's
    CUPTI kernel time; wall_over_original: our cycle's step time over its CUDA-graph replay time; our
    kernel_us and wall_over_kernel beside them. > 1: ours slower."""
    variant = row["variant"]
    if variant in ("standard", "standard-tma"):
        match = dict(variant="standard", which="best")
    elif variant.startswith("replay-L") and not variant.endswith("-direct"):
        cursors = "in-step" if row["cursors"] == "lockstep" else row["cursors"]
        match = dict(variant="replay", L=row["L"], cursors=cursors, config="default")
    else:
        return {}
    key = dict(layer=row["layer"], state_dtype=row["state_dtype"], batch=row["batch"], **match)
    peer = next((r for r in original if all(r.get(k) == v for k, v in key.items())), None)
    if peer is None:
        return {}
    times = row.get("kernels_us") or {}
    if any("_tma_" in name for name in times):  # a Mosaic GPU kernel's step: the whole step, its Triton launch too
        ours = times[ALL_KERNELS]["us"] if ALL_KERNELS in times else sum(  # before ALL_KERNELS: the longest only
            v["us"] for name, v in times.items() if name != "(idle)")
    else:
        ours = sum(v["us"] for name, v in times.items() if name.startswith(("gdn_", "mamba2_")))
    out = dict(original_us=peer["us"], original_kernel_us=peer.get("kernel_us"),
               wall_over_original=row["seconds"] * 1e6 / peer["us"])
    if ours:
        out.update(kernel_us=ours, wall_over_kernel=row["seconds"] * 1e6 / ours)
        if peer.get("kernel_us"):
            out["kernel_over_original"] = ours / peer["kernel_us"]
    return out


def _against_wider_checkpoints(rows, row) -> dict:
    """{vs_float32, vs_bfloat16}: the same layer, batch and variant's time with an f32 / bf16 checkpoint in
    `rows` (this run) over `row`'s (an 8-bit checkpoint's): its speedup; None where not run."""
    out = {}
    for sd in ("float32", "bfloat16"):
        wider = next((r for r in rows if r.get("passed") and "seconds" in r and r["state_dtype"] == sd
                      and (r["layer"], r["batch"], r["variant"]) == (row["layer"], row["batch"], row["variant"])),
                     None)
        out[f"vs_{sd}"] = None if wider is None else wider["seconds"] / row["seconds"]
    return out


def print_kernel_times(times):
    for name, t in (times or {}).items():
        print(f"      {t['us']:9.2f} us/step  {t['launches_per_step']:5.2f} launches/step  {name[:90]}", flush=True)


def timed_form(label: str, timing, nbytes: int, sets: int, copy_bw: float) -> dict:
    """A benchmark row's entry for one timed form: `timing` (`time_cycle`'s result), its bytes per step and their
    time at the copy rate `copy_bw` (GB/s); printed as one line after `label`, then its kernel times."""
    t, spread, compile_s, profile = timing
    print(f"{label} {t * 1e6:8.2f} us  (bytes at copy rate {nbytes / copy_bw / 1e3:7.2f} us)", flush=True)
    print_kernel_times(profile)
    return dict(us=t * 1e6, spread_us=spread * 1e6, compile_s=compile_s, sets=sets, bytes=nbytes,
                at_copy_us=nbytes / copy_bw / 1e3, kernels_us=profile)


def write_json(out: str, name: str, rows: list, options: TimingOptions, copy_bw: float, argv) -> str:
    """Write `out`/`name`.json: the rows and the run's meta (date, device, copy rate, timing, arguments).
    Returns its path."""
    meta = dict(date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                device=jax.devices()[0].device_kind, copy_gbps=copy_bw, timing=dataclasses.asdict(options),
                argv=sys.argv[1:] if argv is None else list(argv))
    path = os.path.join(out, f"{name}.json")
    with open(path, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return path


def report_against_xla(out: str, name: str, rows: list, options: TimingOptions, copy_bw: float, argv,
                       kernel: str) -> int:
    """Write `out`/`name`.json (the rows and the run's meta) and print the table of a benchmark that times
    an op's XLA form against its kernel (rows with "shape", "batch", "check" {"ok"} and, where timed, "xla"
    and `kernel` {"us", "at_copy_us"}). Returns the exit status: 0 where every row's check passed."""
    path = write_json(out, name, rows, options, copy_bw, argv)
    print("\n| shape | batch | XLA us | kernel us | XLA / kernel | kernel's bytes at copy rate us |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        if kernel in r:
            print(f"| {r['shape']} | {r['batch']} | {r['xla']['us']:.2f} | {r[kernel]['us']:.2f} | "
                  f"{r['xla']['us'] / r[kernel]['us']:.2f} | {r[kernel]['at_copy_us']:.2f} |")
    print("JSON:", path)
    return 0 if all(r["check"]["ok"] for r in rows) else 1


def summary(rows, copy_bw):
    print("\n| layer | state | batch | standard us | std % copy | best replay | replay us | replay/standard |")
    print("|---|---|---|---|---|---|---|---|")
    keyed = {}
    for r in rows:
        if r.get("passed") and "seconds" in r:
            keyed.setdefault((r["layer"], r["state_dtype"], r["batch"]), []).append(r)
    for (layer, sd, b), rs in keyed.items():
        std = next((r for r in rs if r["variant"] == "standard"), None)
        rep = [r for r in rs if r["variant"].startswith("replay") and r.get("cursors") in ("staggered", "empty")]
        if not std or not rep:
            continue
        best = min(rep, key=lambda r: r["seconds"])
        print(f"| {layer} | {sd} | {b} | {std['seconds'] * 1e6:.2f} | {std['pct_copy']:.1f} | {best['variant']} | "
              f"{best['seconds'] * 1e6:.2f} | {std['seconds'] / best['seconds']:.2f} |")


def sweep_summary(rows):
    """The default and the fastest tiling of each swept variant."""
    print("\n| layer | state | batch | variant | default | us | fastest | us | default / fastest |")
    print("|---|---|---|---|---|---|---|---|---|")
    keyed = {}
    for r in rows:
        if "config" in r:
            keyed.setdefault((r["layer"], r["state_dtype"], r["batch"], r["variant"]), []).append(r)

    def tag(r):
        return (StepConfig if r["variant"] == "standard" else ReplayConfig)(**r["config"]).tag()

    for (layer, sd, b, variant), rs in keyed.items():
        default = next((r for r in rs if r["default"]), None)
        best = min(rs, key=lambda r: r["seconds"])
        d_tag, d_us = (tag(default), f"{default['seconds'] * 1e6:.2f}") if default else ("-", "-")
        ratio = f"{default['seconds'] / best['seconds']:.2f}" if default else "-"
        print(f"| {layer} | {sd} | {b} | {variant} | {d_tag} | {d_us} | {tag(best)} | {best['seconds'] * 1e6:.2f} | "
              f"{ratio} |")


if __name__ == "__main__":
    sys.exit(main())
