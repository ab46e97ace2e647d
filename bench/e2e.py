"""End-to-end decode throughput of hybrid models of real shape: standard state
against ReplaySSM, on a GPU.

Models (random bfloat16 weights, from the config files in bench/configs/):
  nemotron3_nano_4b_like   52 layers: 24 Mamba-2 (96 heads of 80, d_state 128, 8 groups),
                           4 attention (32 q / 8 kv heads of 128), 24 relu2 MLP (12288)
  qwen3_5_4b_like          32 layers: 24 Gated DeltaNet (16 key / 32 value heads of 128),
                           8 gated attention (16 q / 4 kv heads of 256), SwiGLU MLP

Method: for each model, batch and state mode, `replayssm_jax.generation.Generator`
prefills a random prompt and decodes the new tokens in one compiled
`lax.scan` block (jit, carry donated); the run is repeated after a warm-up
and the faster decode wall time counts. Throughput = batch x decode steps /
decode seconds. Beside it: compile seconds, the decode cache's size and the
process's peak GPU memory, and the share of a decode step spent in the SSM
kernels: with --profile, their traced time in the step; otherwise estimated
by timing the layer's SSM op alone (same batch, state dtype and checkpoint
format; bench/kernels.py's timing cycle) times the number of SSM layers, over
the measured step time. Greedy tokens of every mode are compared with the
standard state's.

Usage:  python3 bench/e2e.py [--models a,b] [--batches 1,16,64,128,256,512]
                             [--modes standard,8,16,32,16f,16d,16:int8] [--prompt-len 512] [--new-tokens 256]
                             [--prefill-rows 64] [--profile] [--budget-gib 100] [--buffer-dtype exact]
                             [--fuse-conv default|on|off]
        python3 bench/e2e.py --memory-only [--modes ...]   (bytes per sequence from shapes, any device)
        python3 bench/e2e.py --smoke     (CPU check of the script on a tiny fixture)
--fuse-conv on|off runs the GDN layers' standard decode steps with their conv inside the step's launch
(ops.gdn_conv_step) at every batch, or never, in place of kernels.fuse_conv_default's choice.
--profile adds, per configuration, a breakdown of a decode step by kernel
category (SSM kernels, GEMMs, attention, other kernels, idle): the profiler trace of a
third run less that of a prefill-only run (bench/step_profile.py).
Every row (without a mesh) also gives the step's roofline: its GEMMs at the
device's bf16 matmul rate and its weights, attention KV reads and SSM state
traffic at the device's copy bandwidth, both measured at the start of the run
(bench/device_rates.py, bench/step_roofline.py), and the step time over it.
Prints a table; writes JSON to --out (default bench/results/DATE-e2e/e2e.json) after every
configuration, so a run cut short keeps what it measured; a configuration that
runs out of device memory is logged and skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import warnings
from typing import NamedTuple

# JAX takes 75% of the GPU by default (104 GiB of the H200's 139): batch 512
# needs more (the prefill's temporaries beside the finished cache: ReplaySSM
# at batch 512 ran out of memory at 75%, bench/RESULTS.md, 2026-11-30). An
# explicit setting wins.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.append(ROOT)  # last: an importable replayssm_jax (installed, or a tree first on PYTHONPATH) wins

import bench_args  # noqa: E402  (bench/bench_args.py; this folder leads sys.path)
import device_rates  # noqa: E402  (bench/device_rates.py)
import kernels as kernel_bench  # noqa: E402  (bench/kernels.py: its timing cycle)
import step_profile  # noqa: E402  (bench/step_profile.py)
import step_roofline  # noqa: E402  (bench/step_roofline.py)
from models import registry, sharding  # noqa: E402
from models.loading import read_config  # noqa: E402
from models.random_init import init_model  # noqa: E402
from replayssm_jax import ops  # noqa: E402
from replayssm_jax.kernels import config as kernel_config  # noqa: E402
from replayssm_jax.generation import Generator, InsufficientMemoryError  # noqa: E402

CONFIGS = os.path.join(ROOT, "bench", "configs")
MODELS = ("nemotron3_nano_4b_like", "qwen3_5_4b_like")
SHARE_SETS = 8  # state copies of the SSM share's timing (`_ssm_op_time`): its compile grows with them
# --smoke: the SSM share timed on one state copy over 4 steps (a flush at L <= 3), the same code as 8 copies
# over 16 steps at a 32nd of the unrolled cycle to compile (test_e2e_smoke 46 -> 14 s on a 2-core CPU, 2026-12-03),
# one call a repeat
SMOKE_SHARE_TIMING = dict(steps=4, max_sets=1, chained_calls=1)


@dataclasses.dataclass
class Row:
    model: str
    batch: int
    mode: str
    tokens_per_s: float
    step_ms: float
    compile_s: float
    prefill_s: float
    cache_gib: float
    peak_gib: float
    ssm_share: float
    identical_to_standard: bool | None
    cache_bytes_per_seq: int = 0  # the decode cache's bytes per sequence
    max_sequences: int = 0  # the sequences whose decode caches fit --budget-gib (weights and temporaries excluded)
    lockstep: bool = False  # whether the decode ran in Generator's lockstep (GenerationOutput.lockstep)
    speedup: float | None = None
    profile: dict | None = None  # ms per decode step by category (step_profile.CATEGORIES), and top kernels
    roofline: dict | None = None  # the step's bound on this device (bench/step_roofline.py; None on a mesh)
    over_roofline: float | None = None  # step_ms / roofline["ms"]
    tp: int | None = None  # the mesh's tensor-parallel and data-parallel sizes (None: no mesh, one device)
    dp: int | None = None


# The checkpoint formats of a --modes entry's ':FORMAT' suffix: (state_dtype, rounding).
CHECKPOINT_FORMATS = {"f32": ("float32", "nearest"), "bf16": ("bfloat16", "nearest"), "int8": ("int8", "nearest"),
                      "int8sr": ("int8", "stochastic"), "fp8": ("float8_e4m3fn", "nearest"),
                      "fp8sr": ("float8_e4m3fn", "stochastic")}


class Mode(NamedTuple):
    state: str
    L: int | None
    route: str
    state_dtype: str | None = None  # the ReplaySSM checkpoints' (None: the model's ssm_state_dtype, float32)
    rounding: str = "nearest"
    lockstep: bool | None = None  # Generator's `lockstep` (None: its default, on where it applies)


def _mode(mode: str) -> Mode:
    """The Mode of a --modes entry: 'standard' (route "auto", which the standard
    state ignores); 'L', ReplaySSM with buffer length L on the output route
    (Generator's default `lockstep`: every row's flush in one direct step a
    cycle, where it applies); 'Lf', the same with the replay step's own
    flush launch (lockstep off); 'Ld', the direct route; each followed
    optionally by ':FORMAT', the checkpoints' dtype and rounding
    (`CHECKPOINT_FORMATS`: f32, bf16, int8, int8sr, fp8, fp8sr; 'sr':
    stochastic rounding), e.g. '16:int8'. Raises ValueError for anything else."""
    if mode == "standard":
        return Mode("standard", None, "auto")
    length, sep, fmt = mode.partition(":")
    suffix = length[-1:] if length[-1:] in ("d", "f") else ""
    digits = length.removesuffix(suffix) if suffix else length
    if not (digits.isascii() and digits.isdigit()) or int(digits) < 1 or (sep and fmt not in CHECKPOINT_FORMATS):
        raise ValueError(f"mode {mode!r}: expected 'standard', a buffer length L >= 1, or L then 'd' (the direct "
                         f"route, e.g. '16d') or 'f' (the replay step's own flush, no lockstep, e.g. '16f'), "
                         f"optionally then ':' and a checkpoint format of {', '.join(CHECKPOINT_FORMATS)} "
                         f"(e.g. '16:int8')")
    dtype, rounding = CHECKPOINT_FORMATS[fmt] if fmt else (None, "nearest")
    return Mode("replay", int(digits), "direct" if suffix == "d" else "output", dtype, rounding,
                False if suffix == "f" else None)


def _peak_gib() -> float:
    """Peak device memory of the process so far (not reset between runs)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 2**30


def _ssm_layers(config):
    return [i for i, t in enumerate(config.layer_types) if t in ("mamba", "gdn")]


def _ssm_op_time(c, batch, mode: Mode, backend, state_dtype, steps=16, max_sets=SHARE_SETS,
                 chained_calls=kernel_bench.TimingOptions.chained_calls, buffer_dtype=None) -> float:
    """Seconds per decode step of one SSM layer's op alone (config `c`, same batch, state dtype,
    checkpoint format, backend, records in `buffer_dtype` (None: the layer's exact dtype, as the models':
    GDN's f32, Mamba-2's bf16 activations'); on a mesh, one device's shard: the local config and batch / dp),
    timed as bench/kernels.py times a layer (`time_cycle`: an unrolled cycle on fixed inputs over
    copies of the state, here at most `max_sets`, `chained_calls` calls a repeat; at small batches
    they fit in the L2, so the estimate is then low)."""
    state, L, route = mode.state, mode.L or 1, mode.route
    fmt = dict(checkpoint_dtype=mode.state_dtype, rounding=mode.rounding)
    k = jax.random.split(jax.random.key(1), 6)
    bf16 = jnp.bfloat16
    if "mamba" in c.layer_types:
        H, P, N, G = c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size, c.n_groups
        shape, groups = (batch, H, P, N), G
        inputs = dict(x=jax.random.normal(k[1], (batch, H, P), bf16), dt=jax.random.normal(k[2], (batch, H), bf16),
                      B=jax.random.normal(k[3], (batch, G, N), bf16), C=jax.random.normal(k[4], (batch, G, N), bf16))
        A = -jnp.exp(jax.random.normal(k[5], (H,)))
        init, step = ops.mamba2_replay_init, functools.partial(ops.mamba2_step, A=A, backend=backend)
        replay = functools.partial(ops.mamba2_replay_step, A=A, route=route, backend=backend)
    else:
        H, HV, K, V = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim
        shape, groups = (batch, HV, V, K), H
        inputs = dict(q=jax.random.normal(k[1], (batch, H, K), bf16), k=jax.random.normal(k[2], (batch, H, K), bf16),
                      v=jax.random.normal(k[3], (batch, HV, V), bf16), a=jax.random.normal(k[4], (batch, HV), bf16),
                      b=jax.random.normal(k[5], (batch, HV), bf16))
        gates = dict(A_log=jnp.log(jnp.linspace(1.0, 16.0, HV)), dt_bias=jnp.zeros((HV,)))  # raw, as the layers
        init, step = ops.gdn_replay_init, functools.partial(ops.gdn_step, **gates, backend=backend)
        replay = functools.partial(ops.gdn_replay_step, **gates, route=route, backend=backend)
    options = kernel_bench.TimingOptions(repeats=3, min_sets=min(2, max_sets), max_sets=max_sets,
                                         chained_calls=chained_calls)
    sets = max(1, min(max_sets, math.ceil(options.l2_target_bytes / (math.prod(shape) * state_dtype.itemsize))))
    states = [jax.random.normal(key, shape, jnp.float32).astype(state_dtype) * 0.1
              for key in jax.random.split(k[0], sets)]
    if state == "standard":
        carries, fn = tuple(states), lambda st, i: step(st, **i)
    else:
        records = buffer_dtype or (bf16 if "mamba" in c.layer_types else jnp.float32)
        carries = tuple(init(s, L, groups, buffer_dtype=records, **fmt) for s in states)
        fn = lambda st, i: replay(st, **i)  # noqa: E731
    seconds, *_ = kernel_bench.time_cycle(fn, carries, inputs, steps, options)
    return seconds


def _profile(gen, prompts, new_tokens):
    """ms per decode step by category, the longest kernels, and the HLO instructions behind the decode's
    copy launches (`step_profile.issuers`; empty where the trace does not say) (None on a CPU).

    Two traced runs: the configuration's, and the same prompts with one new
    token (the prefill alone, no decode step); the decode's share is their
    difference (step_profile.difference), so kernels of the prefill never
    count, whether or not the trace tells the two compiled modules apart.
    """
    out = []
    traced = step_profile.trace(lambda: out.append(gen.generate(prompts, new_tokens, progress=False)))
    hlo = gen.decode_hlo()
    full = step_profile.decode_breakdown(traced, hlo=hlo)
    if full is None:
        return None
    base = step_profile.decode_breakdown(step_profile.trace(lambda: gen.generate(prompts, 1, progress=False)), hlo=hlo)
    b = step_profile.difference(full, base)
    steps = out[0].decode_steps
    return dict(ms={k: v / steps / 1e6 for k, v in b["ns"].items()},
                top=[(name, t / steps / 1e6, n // steps) for name, t, n in b["top"]],
                copies=step_profile.issuers(b, hlo))


def bench_model(name, config_dir, batches, modes, prompt_len, new_tokens, backend, dtype, log, prefill_rows=None,
                save=lambda rows: None, profile=False, budget_bytes=100 * 2**30, mesh=None, rates=None,
                ssm_state_dtype=jnp.float32, share_timing=None, attention_backend="xla", buffer_dtype=None):
    """Rows of one model over batches x modes; `save(rows)` after each row. A
    configuration that runs out of device memory is logged and skipped (the
    others still run). `profile`: also break a decode step down by kernel
    category (bench/step_profile.py), from a third, traced run. `mesh`: a
    ("dp", "tp") mesh the model runs sharded on (models.sharding), or None.
    `rates`: {"copy_gbps", "matmul_tflops"} of the device (bench/device_rates.py),
    for each row's roofline (bench/step_roofline.py; not on a mesh). `ssm_state_dtype`: the model's
    SSM state dtype (float32 or bfloat16), which the standard state and the checkpoints of a mode
    without ':FORMAT' keep. `share_timing`: `_ssm_op_time`'s `steps`, `max_sets` and `chained_calls` where not its
    defaults (--smoke: SMOKE_SHARE_TIMING). `attention_backend`: the attention layers' decode_backend
    ("xla": XLA's products; "pallas": the decode attention kernel). `buffer_dtype`: the ReplaySSM
    records' dtype (Generator's buffer_dtype; None: each layer's exact one)."""
    model = init_model(config_dir, dtype, mesh=mesh, ssm_state_dtype=ssm_state_dtype)
    model.set_attention_decode_backend(attention_backend)
    tp, dp = (None, None) if mesh is None else (mesh.shape["tp"], mesh.shape["dp"])
    shard_config = model.config if mesh is None else sharding.local_config(model.config, tp)
    n_ssm = len(_ssm_layers(model.config))
    rows = []
    rng = np.random.default_rng(0)
    for batch in batches:
        prompts = rng.integers(3, model.config.vocab_size, size=(batch, prompt_len)).astype(np.int32)
        reference_tokens = None
        for mode in modes:
            m = _mode(mode)
            gen = _generator(model, m, backend=backend, block_size=new_tokens, prefill_rows=prefill_rows,
                             buffer_dtype=buffer_dtype)
            try:
                out = gen.generate(prompts, new_tokens, progress=False)
                again = gen.generate(prompts, new_tokens, progress=False)
            except (jax.errors.JaxRuntimeError, InsufficientMemoryError) as err:
                if not isinstance(err, InsufficientMemoryError) and "RESOURCE_EXHAUSTED" not in str(err):
                    raise
                log(f"{name} batch={batch} {mode}: out of device memory, skipped ({str(err).splitlines()[0][:160]})")
                del gen
                gc.collect()
                continue
            best = min((out, again), key=lambda o: o.decode_s)
            step_s = best.decode_s / best.decode_steps
            breakdown = _profile(gen, prompts, new_tokens) if profile else None
            if breakdown is not None:  # measured: the SSM kernels' time in the traced step
                ssm_share = breakdown["ms"]["ssm"] / (step_s * 1e3)
            else:
                ssm_share = n_ssm * _ssm_op_time(shard_config, max(batch // (dp or 1), 1), m, backend,
                                                 ssm_state_dtype, **(share_timing or {}),
                                                 buffer_dtype=buffer_dtype) / step_s
            tokens = np.array(best.sequences)
            if m.state == "standard":
                reference_tokens = tokens
            same = None if reference_tokens is None else bool(np.array_equal(tokens, reference_tokens))
            roofline = None if mesh is not None or rates is None else \
                step_roofline.decode_roofline(gen, batch, prompt_len, new_tokens, **rates)
            rows.append(Row(name, batch, mode, best.tokens_per_s, step_s * 1e3, out.compile_s, best.prefill_s,
                            best.cache_bytes / 2**30, _peak_gib(), ssm_share, same,
                            cache_bytes_per_seq=best.cache_bytes_per_sequence,
                            max_sequences=int(budget_bytes // best.cache_bytes_per_sequence), lockstep=best.lockstep,
                            profile=breakdown, tp=tp, dp=dp,
                            roofline=roofline, over_roofline=roofline and step_s * 1e3 / roofline["ms"]))
            log(f"{name} batch={batch} {mode}: {best.tokens_per_s:.0f} tok/s, step {step_s * 1e3:.2f} ms, "
                f"compile {out.compile_s:.1f} s, SSM share {ssm_share:.0%}, identical={same}")
            save(rows)
            del gen, out, again
            gc.collect()
        standard = next((r for r in rows if r.batch == batch and r.model == name and r.mode == "standard"), None)
        for r in rows:
            if standard and r.batch == batch and r.model == name:
                r.speedup = r.tokens_per_s / standard.tokens_per_s
    return rows


def _generator(model, m: Mode, **kw) -> Generator:
    return Generator(model, state=m.state, buffer_len=m.L, route=m.route, state_dtype=m.state_dtype,
                     state_rounding=m.rounding, lockstep=m.lockstep, **kw)


def memory_rows(name, config_dir, modes, prompt_len, new_tokens, dtype, budget_bytes,
                ssm_state_dtype=jnp.float32, buffer_dtype=None) -> list[dict]:
    """Per mode, the decode cache's bytes per sequence for prompts of `prompt_len` tokens and
    `new_tokens` new ones, and the sequences that fit `budget_bytes`: from shapes alone (an
    abstract model, `Generator.memory_estimate` of one row; nothing allocated, any device), the
    ReplaySSM records in `buffer_dtype` (None: each layer's exact one)."""
    from flax import nnx

    model = nnx.eval_shape(lambda: init_model(config_dir, dtype, ssm_state_dtype=ssm_state_dtype))
    rows = []
    for mode in modes:
        with warnings.catch_warnings():  # the fp8 formats warn: measured all the same
            warnings.simplefilter("ignore", UserWarning)
            gen = _generator(model, _mode(mode), block_size=new_tokens, buffer_dtype=buffer_dtype)
            estimate = gen.memory_estimate([[1] * prompt_len], new_tokens)
        per_seq = (estimate.kv_bytes + estimate.state_bytes) // estimate.rows
        rows.append(dict(model=name, mode=mode, cache_bytes_per_seq=per_seq, max_sequences=int(budget_bytes // per_seq)))
    return rows


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="End-to-end decode throughput: standard vs ReplaySSM")
    p.add_argument("--models", default=None, help=f"default: {','.join(MODELS)} (with --smoke: the tiny fixtures)")
    p.add_argument("--batches", type=bench_args.positive_ints, default=None,
                   help="default: 1,16,64,128,256,512 (with --smoke: 1,2)")
    p.add_argument("--modes", default="standard,8,16,32",
                   help="'standard' and ReplaySSM buffer lengths (Generator's default lockstep flush where it "
                        "applies); 'Lf' (e.g. '16f'): the replay step's own flush, no lockstep; 'Ld': the direct "
                        f"route; ':FORMAT' after any: the checkpoints' dtype and rounding "
                        f"({', '.join(CHECKPOINT_FORMATS)}; e.g. '16:int8')")
    p.add_argument("--ssm-state-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="the models' SSM state dtype: the standard state's, and the checkpoints' of a mode without "
                        "':FORMAT'")
    p.add_argument("--buffer-dtype", default="exact", choices=("exact", "bfloat16", "float32"),
                   help="the ReplaySSM records' dtype: exact (default: each layer's narrowest exact one, f32 for "
                        "GDN's normalized keys and deltas, the activations' for Mamba-2's x and B) or one for all "
                        "layers (bfloat16: the original ReplaySSM kernels' records)")
    p.add_argument("--budget-gib", type=float, default=100.0, help="cache memory budget for max_sequences")
    p.add_argument("--memory-only", action="store_true",
                   help="only the caches' bytes per sequence and the sequences in --budget-gib, from shapes "
                        "(no weights allocated, no decoding; any device)")
    p.add_argument("--prompt-len", type=bench_args.positive_int, default=None, help="default: 512 (with --smoke: 8)")
    p.add_argument("--new-tokens", type=bench_args.positive_int, default=None, help="default: 256 (with --smoke: 6)")
    p.add_argument("--backend", default=None, choices=bench_args.BACKENDS)
    p.add_argument("--attention-backend", default="xla", choices=bench_args.BACKENDS,
                   help="the attention layers' decode steps: xla (XLA's products, the layers' default) or the "
                        "decode attention kernel (pallas; interpret on the CPU)")
    p.add_argument("--fuse-conv", default="default", choices=("default", "on", "off"),
                   help="the GDN layers' standard decode steps: their conv inside the step's launch where "
                        "kernels.fuse_conv_default says (default), at every batch (on), or never (off)")
    p.add_argument("--prefill-rows", type=bench_args.non_negative_int, default=64,
                   help="rows per prefill pass (the prefill of 512 x 512 tokens at once may not fit); 0: all at once")
    p.add_argument("--profile", action="store_true",
                   help="also break one decode step down by kernel category (a third, traced run per configuration)")
    p.add_argument("--out", default=None,
                   help="a JSON path (ending in .json), or a folder, new or not, to write e2e.json in; default: "
                        "bench/results/DATE-e2e/e2e.json (with --smoke: in a new temporary folder)")
    p.add_argument("--smoke", action="store_true", help="tiny fixture on any device, to check the script")
    p.add_argument("--tp", type=bench_args.positive_int, default=None,
                   help="run on a mesh with this tensor-parallel size (models.sharding; default: no mesh)")
    p.add_argument("--dp", type=bench_args.positive_int, default=None,
                   help="the mesh's data-parallel size (default 1 with --tp)")
    args = p.parse_args(argv)
    mesh = None
    if args.tp is not None or args.dp is not None:
        try:
            mesh = sharding.make_mesh(args.tp or 1, args.dp or 1)
        except ValueError as e:
            p.error(f"--tp / --dp: {e}")
    if args.out is None:
        folder = (tempfile.mkdtemp(prefix="e2e_smoke_") if args.smoke else
                  os.path.join(ROOT, "bench", "results", f"{datetime.date.today().isoformat()}-e2e"))
        args.out = os.path.join(folder, "e2e.json")
    elif not args.out.endswith(".json"):  # a folder, new or not
        args.out = os.path.join(args.out, "e2e.json")
    if args.smoke:
        folder, dtype = os.path.join(ROOT, "tests", "data"), jnp.float32
        names = args.models or "qwen3_next_tiny,nemotron_h_tiny"
        batches, prompt_len, new_tokens = args.batches or [1, 2], args.prompt_len or 8, args.new_tokens or 6
    else:
        folder, names, dtype = CONFIGS, args.models or ",".join(MODELS), jnp.bfloat16
        batches = args.batches or [1, 16, 64, 128, 256, 512]
        prompt_len, new_tokens = args.prompt_len or 512, args.new_tokens or 256
    configs = {m: os.path.join(folder, m) for m in names.split(",")}
    known = sorted(d for d in os.listdir(folder) if os.path.isfile(os.path.join(folder, d, "config.json")))
    for name, path in configs.items():
        if not os.path.isfile(os.path.join(path, "config.json")):
            p.error(f"--models: {name!r} has no config.json in {folder} (models there: {', '.join(known)})")
        if mesh is not None:
            try:
                sharding.check_config(registry.parse(read_config(path), path)[1], mesh.shape[sharding.TP])
            except ValueError as e:
                p.error(f"--tp: {name}: {e}")
    modes = args.modes.split(",")
    backend = ops.resolve_backend(args.backend)
    if args.fuse_conv != "default":  # the heuristic's table, for this process
        kernel_config.FUSED_CONV_MAX_BATCH = {4: 1 << 30, 2: 1 << 30} if args.fuse_conv == "on" else {}
    for mode in modes:
        try:
            L = _mode(mode).L
            if L is not None:
                ops.check_buffer_len(L, backend)
        except ValueError as e:
            p.error(f"--modes: {e}")
    if not args.budget_gib > 0:
        p.error(f"--budget-gib: must be > 0; got {args.budget_gib}")
    budget = args.budget_gib * 2**30
    buffer_dtype = None if args.buffer_dtype == "exact" else jnp.dtype(args.buffer_dtype)
    if args.memory_only:
        print(f"decode cache per sequence (prompt {prompt_len}, {new_tokens} new tokens, SSM state "
              f"{args.ssm_state_dtype}, records {args.buffer_dtype}) and sequences in {args.budget_gib:g} GiB, "
              "from shapes:")
        print(f"{'model':26s} {'mode':>10s} {'MiB/seq':>9s} {'max seqs':>8s}")
        memory = [r for name, path in configs.items()
                  for r in memory_rows(name, path, modes, prompt_len, new_tokens, dtype, budget,
                                       jnp.dtype(args.ssm_state_dtype), buffer_dtype)]
        for r in memory:
            print(f"{r['model']:26s} {r['mode']:>10s} {r['cache_bytes_per_seq'] / 2**20:9.2f} {r['max_sequences']:8d}")
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(meta=dict(date=datetime.date.today().isoformat(), commit=_commit(), prompt_len=prompt_len,
                                     new_tokens=new_tokens, budget_gib=args.budget_gib,
                                     ssm_state_dtype=args.ssm_state_dtype, buffer_dtype=args.buffer_dtype,
                                     command=" ".join(sys.argv)),
                           memory=memory), f, indent=1)
        print(f"JSON: {args.out}")
        return 0
    meta = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind, backend=backend,
                jax=jax.__version__, python=platform.python_version(), commit=_commit(), prompt_len=prompt_len,
                new_tokens=new_tokens, dtype=jnp.dtype(dtype).name, ssm_state_dtype=args.ssm_state_dtype,
                attention_backend=args.attention_backend, buffer_dtype=args.buffer_dtype, fuse_conv=args.fuse_conv,
                command=" ".join(sys.argv),
                mesh=None if mesh is None else dict(dp=mesh.shape["dp"], tp=mesh.shape["tp"]))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    small = jax.default_backend() == "cpu"  # the smoke run's rates only exercise the code
    copy = device_rates.copy_bandwidth(nbytes=(8 << 20) if small else (2 << 30))
    matmul = device_rates.matmul_tflops(n=256 if small else 8192)
    meta.update(copy_gbps=copy, matmul_tflops=matmul)
    rates = dict(copy_gbps=max(copy.values()), matmul_tflops=max(matmul.values()))
    rows = []

    def save(more):
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, rows=[dataclasses.asdict(r) for r in rows + more]), f, indent=1)

    for name, path in configs.items():
        rows += bench_model(name, path, batches, modes, prompt_len, new_tokens, backend, dtype,
                            lambda s: print(s, file=sys.stderr, flush=True), args.prefill_rows or None, save,
                            args.profile, budget, mesh, rates, jnp.dtype(args.ssm_state_dtype),
                            SMOKE_SHARE_TIMING if args.smoke else None, args.attention_backend, buffer_dtype)
        save([])
    print(f"\n{meta['date']} {meta['device']} backend={backend} commit={meta['commit']} "
          f"prompt={prompt_len} new={new_tokens} {meta['dtype']} ssm_state={args.ssm_state_dtype} "
          f"records={args.buffer_dtype}"
          + ("" if mesh is None else f" mesh dp={mesh.shape['dp']} tp={mesh.shape['tp']}"))
    print(f"{'model':26s} {'batch':>5s} {'mode':>10s} {'tok/s':>10s} {'step ms':>8s} {'speedup':>7s} "
          f"{'SSM%':>5s} {'cache GiB':>9s} {'MiB/seq':>8s} {'max seqs':>8s} {'peak GiB':>8s} {'compile s':>9s} same")
    for r in rows:
        print(f"{r.model:26s} {r.batch:5d} {r.mode:>10s} {r.tokens_per_s:10.0f} {r.step_ms:8.2f} "
              f"{(r.speedup or float('nan')):7.2f} {r.ssm_share:5.0%} {r.cache_gib:9.2f} "
              f"{r.cache_bytes_per_seq / 2**20:8.2f} {r.max_sequences:8d} {r.peak_gib:8.1f} {r.compile_s:9.1f} "
              f"{'-' if r.identical_to_standard is None else r.identical_to_standard}")
    bounded = [r for r in rows if r.roofline]
    if bounded:
        print(f"\nroofline (copy {rates['copy_gbps']:.0f} GB/s, bf16 matmul {rates['matmul_tflops']:.3g} TFLOP/s): "
              "ms per step, its terms, and the step over it")
        print(f"{'model':26s} {'batch':>5s} {'mode':>10s} {'step ms':>8s} {'bound ms':>8s} {'GEMM':>7s} {'attn':>7s} "
              f"{'states':>7s} {'x bound':>7s}")
        for r in bounded:
            b = r.roofline
            print(f"{r.model:26s} {r.batch:5d} {r.mode:>10s} {r.step_ms:8.2f} {b['ms']:8.2f} {b['gemm_ms']:7.2f} "
                  f"{b['attention_ms']:7.2f} {b['state_ms']:7.2f} {r.over_roofline:7.2f}")
    profiled = [r for r in rows if r.profile]
    if profiled:
        step_profile.print_breakdowns([(f"{r.model[:18]:18s} {r.batch:4d} {r.mode:>8s}", r.profile) for r in profiled])
    elif args.profile:
        print("\n--profile: the trace has no GPU plane (a CPU run): no breakdown")
    print(f"JSON: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
