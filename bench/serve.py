"""Serving a request trace with continuous batching (replayssm_jax.engine.Engine): throughput, time
to first token and per-token latency, with and without prefix caching, standard state vs ReplaySSM.

Trace (one per model, the same for every configuration; seeded): `--requests` requests with
Poisson arrivals at `--rate` requests/s; prompt lengths uniform over the multiples of
`--prompt-granule` in `--prompt-len LO,HI`, output lengths uniform in `--new-tokens LO,HI`; a
fraction `--shared` of the prompts start with one
shared system prompt of `--system-len` tokens (a multiple of `--prefill-chunk`, the prefix
cache's block). Random token ids; greedy decoding; no stop token. The engine compiles one
prefill per distinct chunk length (a prompt's last chunk is its length modulo the chunk): with
the default granule of 64 tokens and chunk of 256, a handful of programs per state, where
lengths of any size would compile one per residue (hundreds, each of a whole model).

Configurations: state standard | replay (L = `--buffer-len`) x prefix caching off | on, each an
Engine of `--capacity` slots and a decode batch of `--batch-size` rows. With `--speculative
ngram` one more row per state (prefix caching off): n-gram speculative rounds of
`--num-draft` K drafts (W = K + 1 <= L with ReplaySSM); with `--state-dtype int8` (or
float8_e4m3fn, bfloat16) one more ReplaySSM row (prefix caching off, no speculation) with
checkpoints of that dtype (round to nearest). Before the timed run
the trace is run once untimed (two new tokens per request), which compiles every prefill chunk
shape and the decode step; its time is reported apart (`warmup_compile_s`). The timed run adds each request at
its arrival time (wall clock since the start) and steps the engine; an idle engine waits for
the next arrival.

Per configuration: `tokens_per_s` (generated tokens over the run's wall time), `ttft_ms`
(first token time less arrival: p50 / p90 / p99), `tpot_ms` (the gaps between a request's
tokens: p50 / p90 / p99), prefix hits and the prompt tokens they skipped. One more row per
state: the fixed-batch `Generator` at the same batch size on `--batch-size` prompts of the mean
prompt length and the mean output length (`generator_tokens_per_s`), the throughput target's
reference; `vs_generator` = engine / Generator tokens/s (the plain f32 Generator of the row's state).
A speculative row also gives `accepted_per_round` (tokens per request per round).

serve.json is written after every configuration, so a run stopped early keeps the rows done.
The defaults are sized for one GPU; a shorter run cuts the trace and the pool, e.g.
``--requests 64 --capacity 16 --prompt-len 64,256 --new-tokens 16,64 --system-len 256``.

Models: bench/e2e.py's (random bfloat16 weights, bench/configs/).

Usage:  python3 bench/serve.py [--models a,b] [--capacity 64] [--batch-size 64] [--requests 256]
                               [--rate 8] [--prompt-len 128,1024] [--prompt-granule 64]
                               [--new-tokens 32,256] [--shared 0.5]
                               [--system-len 512] [--prefill-chunk 256] [--prefill-batch 1] [--buffer-len 16]
                               [--out FOLDER]
                               [--speculative ngram [--num-draft 4]] [--state-dtype int8]
        python3 bench/serve.py --dry-run   (check of the script on the CPU: tiny fixture, backend xla,
                                            4 requests sharing an 8-token system prompt, 3 slots;
                                            its numbers mean nothing)
Writes serve.json and serve.png to --out (default bench/results/DATE-serve).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import sys
import time

import e2e  # noqa: I001  (bench/e2e.py: sets the GPU memory fraction before JAX starts, puts the checkout on sys.path)
import bench_args
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from models import load_model
from models.random_init import init_model
from replayssm_jax.engine import Engine
from replayssm_jax.generation import Generator, SpeculativeConfig

DRY_RUN = dict(folder=os.path.join(e2e.ROOT, "tests", "data"), models="nemotron_h_tiny", capacity=3, batch_size=3,
               requests=4, rate=1000.0, prompt_len="9,10", prompt_granule=1, new_tokens="2,3", shared=1.0,
               system_len=8, prefill_chunk=8, buffer_len=4, backend="xla")


@dataclasses.dataclass
class Request:
    arrival_s: float
    prompt: list[int]
    new_tokens: int


def make_trace(n: int, rate: float, prompt_len: tuple[int, int], new_tokens: tuple[int, int], shared: float,
               system_len: int, vocab: int, seed: int = 0, granule: int = 1) -> list[Request]:
    """The request trace (module docstring): Poisson arrivals, uniform lengths (prompts: multiples of
    `granule` in prompt_len), a shared system prompt."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, vocab, size=system_len).tolist()
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n))
    trace = []
    for arrival in arrivals:
        length = granule * int(rng.integers(-(-prompt_len[0] // granule), prompt_len[1] // granule + 1))
        head = system[:length - 1] if rng.random() < shared else []
        trace.append(Request(float(arrival), head + rng.integers(3, vocab, size=length - len(head)).tolist(),
                             int(rng.integers(new_tokens[0], new_tokens[1] + 1))))
    return trace


def percentiles(values) -> dict:
    """p50 / p90 / p99 of `values` in ms (None for none)."""
    if not len(values):
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{q}": float(np.percentile(np.asarray(values) * 1e3, q)) for q in (50, 90, 99)}


def serve(engine: Engine, trace: list[Request], *, timed: bool, progress: bool) -> tuple[list, float]:
    """Run `trace` through `engine` (arrivals in wall time where `timed`, else all at once with two new
    tokens each: a warm-up that compiles the prefill chunks and the decode step); returns (outputs,
    wall seconds)."""
    pending = list(trace)
    outputs = []
    bar = tqdm(total=len(trace), desc="requests", disable=not progress, leave=False)
    start = time.perf_counter()
    while pending or engine.num_unfinished:
        now = time.perf_counter() - start
        while pending and (not timed or pending[0].arrival_s <= now):
            request = pending.pop(0)
            engine.add_request(request.prompt, request.new_tokens if timed else 2)
        if not engine.num_unfinished:
            time.sleep(max(0.0, pending[0].arrival_s - now))
            continue
        done = engine.step()
        outputs.extend(done)
        bar.update(len(done))
    bar.close()
    return outputs, time.perf_counter() - start


def measure(model, trace, *, state: str, prefix_caching: bool, args, progress: bool, speculative: bool = False,
            state_dtype: str | None = None) -> dict:
    """One configuration's row (`speculative`: n-gram rounds of args.num_draft drafts; `state_dtype`: the
    ReplaySSM checkpoints' dtype, None: the model's)."""
    options = dict(state=state, buffer_len=args.buffer_len if state == "replay" else None,
                   batch_size=args.batch_size, prefill_chunk=args.prefill_chunk, max_len=args.max_len,
                   prefill_batch=args.prefill_batch,
                   prefix_caching=prefix_caching, backend=args.backend, state_dtype=state_dtype,
                   speculative=SpeculativeConfig(args.speculative, args.num_draft) if speculative else None)
    t0 = time.perf_counter()
    serve(Engine(model, args.capacity, **options), trace, timed=False, progress=False)  # compiles every shape
    compile_s = time.perf_counter() - t0
    engine = Engine(model, args.capacity, **options)
    outputs, wall = serve(engine, trace, timed=True, progress=progress)
    generated = sum(o.num_generated for o in outputs)
    ttft = [o.token_s[0] - o.arrival_s for o in outputs]
    tpot = [b - a for o in outputs for a, b in zip(o.token_s, o.token_s[1:])]
    row = dict(state=state, prefix_caching=prefix_caching, requests=len(outputs), generated_tokens=generated,
               wall_s=wall, tokens_per_s=generated / wall, ttft_ms=percentiles(ttft), tpot_ms=percentiles(tpot),
               prefix_hits=engine.stats["prefix_hits"], cached_tokens=engine.stats["cached_tokens"],
               prefill_tokens=engine.stats["prefill_tokens"], decode_steps=engine.stats["decode_steps"],
               warmup_compile_s=compile_s, speculative=f"{args.speculative} K={args.num_draft}" if speculative
               else None, state_dtype=state_dtype)
    if speculative:
        row["accepted_per_round"] = engine.stats["accepted_tokens"] / max(1, engine.stats["round_rows"])
    return row


def configurations(args) -> list[tuple[str, bool, bool, str | None]]:
    """(state, prefix caching, speculative, state_dtype) of each row, in order: per state prefix caching off
    and on, then the speculative row (--speculative), then the 8-bit ReplaySSM row (--state-dtype)."""
    rows = []
    for state in args.states:
        rows += [(state, False, False, None), (state, True, False, None)]
        if args.speculative:
            rows.append((state, False, True, None))
        if args.state_dtype and state == "replay":
            rows.append((state, False, False, args.state_dtype))
    return rows


def generator_tokens_per_s(model, trace, *, state: str, args) -> float:
    """The fixed-batch Generator's decode tokens/s at the engine's batch size (mean prompt and output lengths)."""
    prompt_len = int(np.mean([len(r.prompt) for r in trace]))
    new_tokens = max(2, int(np.mean([r.new_tokens for r in trace])))
    prompts = [r.prompt[:prompt_len] + [3] * (prompt_len - len(r.prompt)) for r in trace[:1]] * args.batch_size
    generator = Generator(model, state=state, buffer_len=args.buffer_len if state == "replay" else None,
                          backend=args.backend)
    generator.generate(prompts, new_tokens, progress=False)  # compiles
    out = generator.generate(prompts, new_tokens, progress=False)
    return sum(out.num_generated) / (out.prefill_s + out.decode_s)


def plot(rows: list[dict], path: str) -> None:
    """Bars of tokens/s, p50 TTFT and p50 TPOT per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model']}\n{r['state']}{' +prefix' if r['prefix_caching'] else ''}"
              f"{' +' + r['speculative'] if r.get('speculative') else ''}"
              f"{' ' + r['state_dtype'] if r.get('state_dtype') else ''}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(4 + 2 * len(rows), 4))
    for ax, (key, title) in zip(axes, [("tokens_per_s", "tokens/s"), ("ttft_ms", "TTFT p50 (ms)"),
                                       ("tpot_ms", "per-token latency p50 (ms)")]):
        values = [r[key] if key == "tokens_per_s" else (r[key]["p50"] or 0.0) for r in rows]
        ax.bar(range(len(rows)), values)
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Continuous batching of a request trace: standard vs ReplaySSM, "
                                            "with and without prefix caching")
    p.add_argument("--models", default=None, help=f"default: {','.join(e2e.MODELS)}")
    p.add_argument("--capacity", type=bench_args.positive_int, default=64, help="state pool slots")
    p.add_argument("--batch-size", type=bench_args.positive_int, default=None,
                   help="decode batch rows (default: capacity)")
    p.add_argument("--requests", type=bench_args.positive_int, default=256)
    p.add_argument("--rate", type=bench_args.positive_float, default=8.0, help="Poisson arrivals per second")
    p.add_argument("--prompt-len", default="128,1024", help="LO,HI: uniform prompt lengths")
    p.add_argument("--prompt-granule", type=bench_args.positive_int, default=64,
                   help="prompt lengths are multiples of this (few prefill shapes to compile)")
    p.add_argument("--new-tokens", default="32,256", help="LO,HI: uniform output lengths")
    p.add_argument("--shared", type=bench_args.fraction, default=0.5,
                   help="fraction of prompts with the shared system prompt")
    p.add_argument("--system-len", type=bench_args.positive_int, default=512, help="system prompt tokens")
    p.add_argument("--prefill-chunk", type=bench_args.positive_int, default=256,
                   help="prefill tokens per step (the prefix block)")
    p.add_argument("--prefill-batch", type=bench_args.positive_int, default=1,
                   help="requests whose chunks one engine step prefills together (Engine's prefill_batch)")
    p.add_argument("--buffer-len", type=bench_args.positive_int, default=16, help="ReplaySSM L")
    p.add_argument("--states", type=bench_args.subset_of("standard", "replay"), default="standard,replay")
    p.add_argument("--speculative", default=None, choices=("ngram",),
                   help="one more row per state: speculative rounds with this drafter")
    p.add_argument("--num-draft", type=bench_args.positive_int, default=4, help="drafts per speculative round (K)")
    p.add_argument("--state-dtype", default=None, choices=("int8", "float8_e4m3fn", "bfloat16"),
                   help="one more ReplaySSM row with checkpoints of this dtype")
    p.add_argument("--backend", default=None, choices=bench_args.BACKENDS)
    p.add_argument("--out", default=None, help="folder for serve.json and serve.png; default "
                                               "bench/results/DATE-serve")
    p.add_argument("--dry-run", action="store_true", help="CPU check of the script on the tiny fixture")
    args = p.parse_args(argv)
    try:  # the plot at the end: refuse before the trace runs, not after
        import matplotlib  # noqa: F401
    except ImportError:
        p.error("the plot needs matplotlib: install the bench extra (pip install -e '.[bench]')")
    folder = None
    if args.dry_run:
        folder = DRY_RUN["folder"]
        for name, value in DRY_RUN.items():
            if name != "folder" and getattr(args, name) == p.get_default(name):
                setattr(args, name, value)
        for name in args.models.split(","):
            if not os.path.isfile(os.path.join(folder, name, "config.json")):
                p.error(f"--models: the dry run takes the fixtures in {folder}; {name!r} is not one of them")
    args.batch_size = args.batch_size or args.capacity
    if args.batch_size > args.capacity:
        p.error(f"--batch-size must be <= --capacity = {args.capacity} (decode rows are pool slots); got "
                f"{args.batch_size}")
    ranges = []
    for flag, text in (("--prompt-len", args.prompt_len), ("--new-tokens", args.new_tokens)):
        try:
            ranges.append(bench_args.int_range(text))
        except argparse.ArgumentTypeError as e:
            p.error(f"argument {flag}: {e}")
    prompt_len, new_tokens = ranges
    if args.prompt_granule < 1 or -(-prompt_len[0] // args.prompt_granule) * args.prompt_granule > prompt_len[1]:
        p.error(f"--prompt-granule must be >= 1 with a multiple of it in --prompt-len {args.prompt_len}; got "
                f"{args.prompt_granule}")
    args.max_len = prompt_len[1] + new_tokens[1]
    out_dir = args.out or os.path.join(e2e.ROOT, "bench", "results",
                                       f"{datetime.date.today().isoformat()}-serve{'-dry-run' if args.dry_run else ''}")
    os.makedirs(out_dir, exist_ok=True)
    if args.speculative and "replay" in args.states and args.num_draft + 1 > args.buffer_len:
        p.error(f"--num-draft + 1 = {args.num_draft + 1} must be <= --buffer-len = {args.buffer_len} (a verify "
                "window fits in the ReplaySSM buffer)")
    progress = sys.stderr.isatty()
    rows, reference = [], []
    result = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=str(jax.devices()[0]),
                  jax=jax.__version__, python=platform.python_version(), commit=e2e._commit(),
                  config=dict(vars(args)), rows=rows, generator=reference)
    for name in (args.models or ",".join(e2e.MODELS)).split(","):
        model = (load_model(os.path.join(folder, name)) if folder
                 else init_model(os.path.join(e2e.CONFIGS, name), jnp.bfloat16))
        trace = make_trace(args.requests, args.rate, prompt_len, new_tokens, args.shared, args.system_len,
                           model.config.vocab_size, granule=args.prompt_granule)
        base = {}
        for state, prefix_caching, speculative, state_dtype in configurations(args):
            if state not in base:
                base[state] = generator_tokens_per_s(model, trace, state=state, args=args)
                reference.append(dict(model=name, state=state, batch=args.batch_size,
                                      generator_tokens_per_s=base[state]))
            row = dict(model=name, **measure(model, trace, state=state, prefix_caching=prefix_caching, args=args,
                                             progress=progress, speculative=speculative, state_dtype=state_dtype))
            row["vs_generator"] = row["tokens_per_s"] / base[state]
            rows.append(row)
            label = (f" {row['speculative']}" if speculative else "") + (f" {state_dtype}" if state_dtype else "")
            print(f"{name} {state:8s} prefix={'on ' if prefix_caching else 'off'}{label} "
                  f"{row['tokens_per_s']:9.1f} tok/s ({row['vs_generator']:.2f}x Generator)  "
                  f"TTFT p50 {row['ttft_ms']['p50']:8.1f} ms  TPOT p50 {row['tpot_ms']['p50'] or 0:7.2f} ms  "
                  f"prefix hits {row['prefix_hits']}", flush=True)
            with open(os.path.join(out_dir, "serve.json"), "w") as f:  # after every row: a stopped run keeps them
                json.dump(result, f, indent=1)
    plot(rows, os.path.join(out_dir, "serve.png"))
    print(f"wrote {os.path.join(out_dir, 'serve.json')} and serve.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
