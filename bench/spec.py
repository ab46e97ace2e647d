"""Speculative decoding through hybrid models of real shape: AR and speculative
decode throughput with the standard state and with ReplaySSM, on a GPU.

Models: bench/e2e.py's (random bfloat16 weights, bench/configs/).

Method: for each model and batch, random prompts are decoded greedily four ways
by `replayssm_jax.generation.Generator`:
  ar-standard     one token per step, standard SSM state (the baseline)
  ar-replay       one token per step, ReplaySSM with buffer length L
  spec-standard   speculative rounds of W = K + 1 verified positions; the
                  standard state keeps the state after each of the W positions
                  and commits the m-th (`state="standard"`)
  spec-replay     the same rounds with ReplaySSM (commit is `cursor += m`)
The speculative rows use the oracle drafter (`SpeculativeConfig("oracle")`): at
each position it proposes the target's own greedy token with probability
alpha, else another token; its reference continuation is ar-standard's output
for the same prompts, so greedy speculative tokens must equal it exactly (each
row is checked; a mismatch is printed to stderr and recorded as
`identical_to_ar: false`). Each configuration runs `--repeats` times (a
warm-up first) and the fastest decode counts; decode tokens/s excludes the
prefill and compilation (compile seconds are reported apart: the oracle's
reference is part of its compiled program, so every speculative call compiles
its round again). Speedup is against ar-standard at the same model and batch.

Memory, from the cache's shapes (`jax.eval_shape`, bytes of every leaf of one
row): `cache_bytes_per_seq`, the decode cache between steps or rounds;
`round_bytes_per_seq`, the cache while a verified window is pending (the
standard state's W per-position states, ReplaySSM's records in its buffer),
which the speculative paths hold every round. `max_sequences` = the rows whose
`round_bytes_per_seq` fit `--budget-gib` (the weights and temporaries
excluded).

Usage:  python3 bench/spec.py [--models a,b] [--batches 1,16,64,256] [--num-draft 3]
                              [--buffer-len 16] [--alphas 0.6,0.8] [--prompt-len 128]
                              [--new-tokens 64] [--budget-gib 100] [--out FOLDER]
        python3 bench/spec.py --dry-run   (check of the script on the CPU: tiny fixture, backend xla, batch 2,
                                           8 prompt and 6 new tokens, L 4, one run each; its time is compilation)
Prints a table last; writes spec.json to --out (default bench/results/DATE-spec) after
every configuration; a configuration that runs out of device memory is logged and skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import sys
import tempfile

import e2e  # noqa: I001  (bench/e2e.py: sets the GPU memory fraction before JAX starts, puts the checkout on sys.path)
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.random_init import init_model
from replayssm_jax import ops
from replayssm_jax.generation import GenerationError, Generator, InsufficientMemoryError, SpeculativeConfig

MODES = ("ar-standard", "ar-replay", "spec-standard", "spec-replay")
DRY_RUN = dict(folder=os.path.join(e2e.ROOT, "tests", "data"), models="qwen3_5_tiny", batches="2", prompt_len=8,
               new_tokens=6, buffer_len=4, dtype=jnp.float32, backend="xla", repeats=1)


@dataclasses.dataclass
class Row:
    model: str
    batch: int
    mode: str
    alpha: float | None
    tokens_per_s: float
    step_ms: float  # ms per decode step (AR) or round (speculative)
    compile_s: float
    prefill_s: float
    accepted_per_round: float | None
    cache_bytes_per_seq: int
    round_bytes_per_seq: int
    max_sequences: int
    peak_gib: float
    identical_to_ar: bool | None
    speedup: float | None = None


def _nbytes(tree) -> int:
    return sum(int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def cache_bytes_per_sequence(gen: Generator, prompt_len: int, new_tokens: int) -> tuple[int, int]:
    """(between steps or rounds, with a verified window pending) bytes of one row's decode cache.

    From shapes only (`jax.eval_shape` of a one-row prefill, then of a verify of
    W = K + 1 positions for a speculative Generator; AR: both the prefilled
    cache), with the KV caches sized as `gen` sizes them for prompts of
    `prompt_len` tokens and `new_tokens` new ones (`Generator.memory_estimate`).
    """
    max_len = gen.memory_estimate([[1] * prompt_len], new_tokens).max_len
    window = 1 if gen.speculative is None else gen.speculative.window

    def caches(params):
        model = nnx.merge(gen.graphdef, params)
        _, cache = model.prefill(jnp.ones((1, prompt_len), jnp.int32), max_len, replay_buffer_len=gen.buffer_len,
                                 buffer_dtype=gen.buffer_dtype, backend=gen.backend, last_logits_only=True,
                                 max_window=window)
        if window == 1:
            return cache, cache
        return cache, model.verify(jnp.ones((1, window), jnp.int32), cache, backend=gen.backend)[1]

    committed, pending = jax.eval_shape(caches, gen.params)
    return _nbytes(committed), _nbytes(pending)


def _rows_differing(tokens, reference) -> int:
    return sum(a != b for a, b in zip(tokens, reference))


def bench_model(name, config_dir, batches, *, num_draft, buffer_len, alphas, prompt_len, new_tokens, backend,
                dtype, budget_bytes, repeats, prefill_rows, log, save=lambda rows: None):
    """Rows of one model over batches x MODES (the speculative ones per alpha); `save(rows)` after each."""
    model = init_model(config_dir, dtype)
    rows = []
    rng = np.random.default_rng(0)
    for batch in batches:
        prompts = rng.integers(3, model.config.vocab_size, size=(batch, prompt_len)).astype(np.int32)
        reference = None
        for mode in MODES:
            if reference is None and mode != "ar-standard":
                log(f"{name} batch={batch} {mode}: skipped (no ar-standard reference at this batch)")
                continue
            state = mode.split("-")[1]
            for alpha in (alphas if mode.startswith("spec") else (None,)):
                speculative = None if alpha is None else SpeculativeConfig(
                    "oracle", num_draft, alpha=alpha, reference=reference)
                label = f"{name} batch={batch} {mode}" + ("" if alpha is None else f" alpha={alpha}")
                try:
                    gen = Generator(model, state=state, buffer_len=buffer_len, backend=backend, block_size=new_tokens,
                                    prefill_rows=prefill_rows, speculative=speculative)
                    outs = [gen.generate(prompts, new_tokens, stop_tokens=None, progress=False)
                            for _ in range(repeats)]
                except (jax.errors.JaxRuntimeError, InsufficientMemoryError) as err:
                    if not isinstance(err, InsufficientMemoryError) and "RESOURCE_EXHAUSTED" not in str(err):
                        raise
                    log(f"{label}: out of device memory, skipped ({str(err).splitlines()[0][:160]})")
                    gc.collect()
                    continue
                best = min(outs, key=lambda o: o.decode_s)
                if mode == "ar-standard":
                    reference = best.sequences
                    same = None
                else:
                    differing = _rows_differing(best.sequences, reference)
                    same = differing == 0
                    if not same:
                        log(f"MISMATCH: {label}: greedy tokens differ from ar-standard's in {differing} of "
                            f"{batch} rows")
                per_seq, per_round = cache_bytes_per_sequence(gen, prompt_len, new_tokens)
                rows.append(Row(name, batch, mode, alpha, best.tokens_per_s, best.decode_s / best.decode_steps * 1e3,
                                outs[0].compile_s, best.prefill_s, best.accepted_per_round, per_seq, per_round,
                                int(budget_bytes // per_round), e2e._peak_gib(), same))
                r = rows[-1]
                log(f"{label}: {r.tokens_per_s:.0f} tok/s, accepted/round {r.accepted_per_round or 1:.2f}, "
                    f"compile {r.compile_s:.1f} s, {per_round / 2**20:.1f} MiB/seq, identical={same}")
                save(rows)
                del gen, outs, best
                gc.collect()
        base = next((r for r in rows if r.batch == batch and r.mode == "ar-standard"), None)
        for r in rows:
            if base is not None and r.batch == batch:
                r.speedup = r.tokens_per_s / base.tokens_per_s
    return rows


def print_table(meta, rows):
    print(f"\n{meta['date']} {meta['device']} backend={meta['backend']} commit={meta['commit']} "
          f"prompt={meta['prompt_len']} new={meta['new_tokens']} K={meta['num_draft']} W={meta['num_draft'] + 1} "
          f"L={meta['buffer_len']} {meta['dtype']} budget={meta['budget_gib']} GiB")
    print(f"{'model':26s} {'batch':>5s} {'mode':>13s} {'alpha':>5s} {'tok/s':>10s} {'speedup':>7s} {'acc/rnd':>7s} "
          f"{'MiB/seq':>8s} {'max seqs':>8s} {'compile s':>9s} same")
    for r in rows:
        same = "-" if r.identical_to_ar is None else ("yes" if r.identical_to_ar else "MISMATCH")
        print(f"{r.model:26s} {r.batch:5d} {r.mode:>13s} {'-' if r.alpha is None else f'{r.alpha:.2f}':>5s} "
              f"{r.tokens_per_s:10.0f} {(r.speedup or float('nan')):7.2f} {r.accepted_per_round or 1.0:7.2f} "
              f"{r.round_bytes_per_seq / 2**20:8.2f} {r.max_sequences:8d} {r.compile_s:9.1f} {same}")


def _floats(text: str, name: str) -> list[float]:
    try:
        values = [float(a) for a in text.split(",")]
    except ValueError:
        raise ValueError(f"{name}: expected comma-separated numbers; got {text!r}") from None
    bad = [a for a in values if not 0.0 <= a <= 1.0]
    if bad:
        raise ValueError(f"{name}: every alpha must be in [0, 1]; got {bad[0]}")
    return values


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Speculative decoding: AR and speculative, standard state and ReplaySSM")
    p.add_argument("--models", default=None, help=f"default: {','.join(e2e.MODELS)} (with --dry-run: qwen3_5_tiny)")
    p.add_argument("--batches", default=None, help="default: 1,16,64,256 (with --dry-run: 2)")
    p.add_argument("--num-draft", type=int, default=3, help="K drafts per round (W = K + 1 verified positions)")
    p.add_argument("--buffer-len", type=int, default=None, help="ReplaySSM L (default 16; with --dry-run: 4)")
    p.add_argument("--alphas", default="0.6,0.8", help="oracle drafter: probability that a draft is the target's token")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (with --dry-run: 8)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (with --dry-run: 6)")
    p.add_argument("--budget-gib", type=float, default=100.0, help="cache memory budget for max_sequences")
    p.add_argument("--repeats", type=int, default=None, help="runs per configuration, the fastest counts (default 2)")
    p.add_argument("--backend", default=None)
    p.add_argument("--prefill-rows", type=int, default=64, help="rows per prefill pass; 0: all at once")
    p.add_argument("--out", default=None, help="folder for spec.json; default bench/results/DATE-spec "
                                               "(with --dry-run: a new temporary folder)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny fixture (tests/data/qwen3_5_tiny) with backend xla, to check the script on the CPU")
    args = p.parse_args(argv)
    dry = DRY_RUN if args.dry_run else {}
    folder = dry.get("folder", e2e.CONFIGS)
    names = args.models or dry.get("models", ",".join(e2e.MODELS))
    batches_text = args.batches or dry.get("batches", "1,16,64,256")
    given = lambda value, key, default: dry.get(key, default) if value is None else value  # noqa: E731
    prompt_len = given(args.prompt_len, "prompt_len", 128)
    new_tokens = given(args.new_tokens, "new_tokens", 64)
    buffer_len = given(args.buffer_len, "buffer_len", 16)
    repeats = given(args.repeats, "repeats", 2)
    dtype = dry.get("dtype", jnp.bfloat16)
    try:
        batches = [int(b) for b in batches_text.split(",")]
    except ValueError:
        p.error(f"--batches: expected comma-separated ints; got {batches_text!r}")
    for flag, value, low in [("--batches", min(batches), 1), ("--num-draft", args.num_draft, 1),
                             ("--prompt-len", prompt_len, 1), ("--new-tokens", new_tokens, 2),
                             ("--buffer-len", buffer_len, 1), ("--repeats", repeats, 1),
                             ("--prefill-rows", args.prefill_rows, 0)]:
        if value < low:
            p.error(f"{flag}: must be >= {low}; got {value}")
    if args.num_draft + 1 > buffer_len:
        p.error(f"--num-draft + 1 = {args.num_draft + 1} verified positions must be <= --buffer-len = {buffer_len}")
    if not args.budget_gib > 0:
        p.error(f"--budget-gib: must be > 0; got {args.budget_gib}")
    try:
        alphas = _floats(args.alphas, "--alphas")
        backend = ops.resolve_backend(args.backend or dry.get("backend"))
        ops.check_buffer_len(buffer_len, backend)
    except (ValueError, RuntimeError) as e:
        p.error(str(e))
    configs = {m: os.path.join(folder, m) for m in names.split(",")}
    missing = [m for m, path in configs.items() if not os.path.isdir(path)]
    if missing:
        p.error(f"--models: no config folder {os.path.join(folder, missing[0])}")
    out = args.out or (tempfile.mkdtemp(prefix="spec_dry_run_") if dry else
                       os.path.join(e2e.ROOT, "bench", "results", f"{datetime.date.today().isoformat()}-spec"))
    meta = dict(date=datetime.date.today().isoformat(), device=jax.devices()[0].device_kind, backend=backend,
                jax=jax.__version__, python=platform.python_version(), commit=e2e._commit(), prompt_len=prompt_len,
                new_tokens=new_tokens, num_draft=args.num_draft, buffer_len=buffer_len, alphas=alphas,
                drafter="oracle", repeats=repeats, budget_gib=args.budget_gib, dtype=jnp.dtype(dtype).name,
                command=" ".join(sys.argv))
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "spec.json")
    rows = []

    def save(more):
        with open(path, "w") as f:
            json.dump(dict(meta=meta, rows=[dataclasses.asdict(r) for r in rows + more]), f, indent=1)

    try:
        for name, config_dir in configs.items():
            rows += bench_model(name, config_dir, batches, num_draft=args.num_draft, buffer_len=buffer_len,
                                alphas=alphas, prompt_len=prompt_len, new_tokens=new_tokens, backend=backend,
                                dtype=dtype, budget_bytes=args.budget_gib * 2**30, repeats=repeats,
                                prefill_rows=args.prefill_rows or None,
                                log=lambda s: print(s, file=sys.stderr, flush=True), save=save)
            save([])
    except GenerationError as e:
        p.error(str(e))
    print_table(meta, rows)
    mismatches = [r for r in rows if r.identical_to_ar is False]
    if mismatches:
        print(f"MISMATCH: {len(mismatches)} rows' greedy tokens differ from ar-standard's: "
              + ", ".join(f"{r.model} {r.batch} {r.mode} {r.alpha}" for r in mismatches))
    print(f"JSON: {path}")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
