"""Speculative decoding through hybrid models of real shape: AR and speculative
decode throughput with the standard state and with ReplaySSM, on a GPU.

Models: bench/e2e.py's (random bfloat16 weights, bench/configs/).

Method: for each model and batch, random prompts are decoded greedily four ways
by `replayssm_jax.generation.Generator`:
  ar-standard     one token per step, standard SSM state (the baseline)
  ar-replay       one token per step, ReplaySSM with buffer length L
  spec-standard   speculative rounds of W = K + 1 verified positions; the
                  standard state keeps W + 1 state slots per row, one launch
                  per layer writes the state after each of the W positions to
                  its slot, and the commit moves the row's slot index to the
                  m-th (`state="standard"`, the per-draft path of vLLM)
  spec-replay     the same rounds with ReplaySSM (commit is `cursor += m`)
With `--tree TOPK,DEPTH` two more modes run (tree speculation, the same
oracle reference method):
  tree-standard   rounds that verify a draft tree of 1 + TOPK * DEPTH nodes
                  (`DraftTree.topk`: TOPK candidates per depth, the first one
                  expanding) and keep the longest accepted path; the standard
                  state keeps one state slot per node and commits the accepted
                  node's slot
  tree-replay     the same rounds with ReplaySSM (the tree's records in the
                  buffer; commit gathers the path's records, then moves the
                  cursor)
Their oracle proposes at each depth the draft (right with probability alpha)
and TOPK - 1 more candidates, each in turn right with probability alpha where
the draft is not; `ideal_accepted` is then 1 + sum_{d < DEPTH} alpha^d (alpha +
(1 - alpha)(1 - (1 - alpha)^(TOPK - 1))). Compare a chain and a tree of about
equal verified tokens per round (`--num-draft 3`, W = 4, against `--tree 3,2`,
7 nodes, or `--tree 7,1`, 8 nodes).

The speculative rows use the oracle drafter (`SpeculativeConfig("oracle")`) and a
random-weight MTP head (`SpeculativeConfig("mtp")`, `--drafters`; its drafts are
almost never accepted, so its rows show a round's cost with the MTP head's steps
in it at about one token a round; chain modes only). The oracle: at
each position it proposes a reference continuation's token with probability
alpha, else another token. The reference is the continuation that the same
state's speculative path itself computes when every draft is accepted
(`self_consistent_reference`: from that state's AR greedy output, runs at
alpha = 1 until the output reproduces its reference). In bfloat16 the verify
window sums its terms in another order than the AR step, and the random
weights' top two logits are often within that rounding: the AR greedy output
of one state, used as every mode's reference (as this script did first),
agreed with the speculative paths for only a few tokens, and the drafts were
wrong from there on (1.1 tokens a round at alpha 0.8). The same rounding can
still make an alpha < 1 run leave its reference (its windows fall elsewhere):
each speculative row records whether its greedy tokens equal the reference
(`identical_to_reference`), the measured tokens per round beside the ideal
(1 - alpha^W) / (1 - alpha), and `projected_speedup` = ideal tokens per round x
AR step time / round time (same state). Token-for-token equality of greedy
speculative and plain decoding is what the float32 tests check (tests/); here a
float32 run (`--dry-run`) exits 1 on a mismatch. Each configuration runs
`--repeats` times (a warm-up first) and the fastest decode counts; decode
tokens/s excludes the prefill and compilation (compile seconds are reported
apart, in the row of a mode's first run; the drafter, the oracle's reference
and alpha included, is an argument of the compiled round, and a mode's runs at
one batch share one Generator (`Generator.with_speculative`), so a mode traces
and compiles its round once for its reference runs and every alpha; the run
also keeps its programs in a compilation cache of its own). `speedup` is against ar-standard,
`speedup_same_state` against the AR run of the same state.

`--profile` adds per configuration the GPU time of a step or round by kernel
category (bench/step_profile.py, as bench/e2e.py --profile): a traced run less
a prefill-only run.

Memory, from the cache's shapes (`jax.eval_shape`, bytes of every leaf of one
row): `cache_bytes_per_seq`, the decode cache between steps or rounds;
`round_bytes_per_seq`, the cache while a verified window is pending (the
standard state's W + 1 state slots, which its per-draft layout holds between
rounds too; ReplaySSM's records in its buffer), which the speculative paths
hold every round. `max_sequences` = the rows whose
`round_bytes_per_seq` fit `--budget-gib` (the weights and temporaries
excluded).

Usage:  python3 bench/spec.py [--models a,b] [--batches 1,16,64,256] [--num-draft 3] [--drafters oracle,mtp]
                              [--buffer-len 16] [--alphas 0.6,0.8] [--prompt-len 128]
                              [--new-tokens 64] [--budget-gib 100] [--out FOLDER] [--profile]
                              [--tree TOPK,DEPTH]
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
import time

import e2e  # noqa: I001  (bench/e2e.py: sets the GPU memory fraction before JAX starts, puts the checkout on sys.path)
import step_profile  # bench/step_profile.py
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.mtp import add_mtp_head
from models.random_init import init_model
from replayssm_jax import ops
from replayssm_jax.generation import (GenerationError, Generator, InsufficientMemoryError, SpeculativeConfig,
                                      set_compile_cache)

MODES = ("ar-standard", "ar-replay", "spec-standard", "spec-replay")
TREE_MODES = ("tree-standard", "tree-replay")  # with --tree
DRY_RUN = dict(folder=os.path.join(e2e.ROOT, "tests", "data"), models="qwen3_5_tiny", batches="2", prompt_len=8,
               new_tokens=6, buffer_len=4, dtype=jnp.float32, backend="xla", repeats=1)


@dataclasses.dataclass
class Row:
    model: str
    batch: int
    mode: str
    alpha: float | None  # the oracle's; None for AR rows and the MTP drafter's
    tokens_per_s: float
    step_ms: float  # ms per decode step (AR) or round (speculative)
    compile_s: float
    prefill_s: float
    accepted_per_round: float | None
    cache_bytes_per_seq: int
    round_bytes_per_seq: int
    max_sequences: int
    peak_gib: float
    identical_to_reference: bool | None  # speculative rows: greedy tokens equal to the oracle's reference's
    ideal_accepted: float | None = None  # (1 - alpha^W) / (1 - alpha)
    reference_runs: int | None = None  # alpha-1 runs to a self-consistent reference
    reference_converged: bool | None = None
    ar_agreeing_tokens: float | None = None  # mean tokens where that reference agrees with the same state's AR
    speedup: float | None = None  # tokens/s over ar-standard's
    speedup_same_state: float | None = None  # over the AR run of the same state
    projected_speedup: float | None = None  # ideal_accepted x AR step ms / round ms, same state
    profile: dict | None = None  # ms per step or round by kernel category (bench/step_profile.py)
    drafter: str | None = None  # speculative rows: "oracle" or "mtp"
    verified_per_round: int | None = None  # positions (tree nodes) each round verifies


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


def _first_difference(tokens, reference, prompt_len) -> float:
    """Mean over rows of the first generated position where `tokens` and `reference` differ
    (the generated length where they agree)."""
    firsts = []
    for a, b in zip(tokens, reference):
        n = min(len(a), len(b))
        diff = next((i for i in range(prompt_len, n) if a[i] != b[i]), n)
        firsts.append(diff - prompt_len)
    return float(np.mean(firsts))


def ideal_acceptance(alpha: float, window: int, topk: int = 1) -> float:
    """Expected new tokens per round when each draft is right with probability alpha, independently:
    sum_{j<W} alpha^j = (1 - alpha^W) / (1 - alpha) (the accepted drafts plus the target's token).
    With topk > 1 (a tree of depth W - 1, the oracle's topk - 1 other candidates per depth): 1 +
    sum_{d < W - 1} alpha^d (alpha + (1 - alpha)(1 - (1 - alpha)^(topk - 1))) (a right draft goes
    deeper, a right other candidate ends the path)."""
    if topk == 1:
        return float(window) if alpha == 1.0 else (1.0 - alpha**window) / (1.0 - alpha)
    step = alpha + (1.0 - alpha) * (1.0 - (1.0 - alpha) ** (topk - 1))
    return 1.0 + sum(alpha**d * step for d in range(window - 1))


class _Runner:
    """Runs one configuration `repeats` times (the fastest decode counts), out-of-memory logged and skipped.
    The configurations of one state and compiled round (the oracle's reference runs and alphas) share one
    Generator's compiled programs (`Generator.with_speculative`): each is traced and compiled once."""

    def __init__(self, model, prompts, new_tokens, *, buffer_len, backend, prefill_rows, repeats, log):
        self.model, self.prompts, self.new_tokens = model, prompts, new_tokens
        self.kw = dict(backend=backend, block_size=new_tokens, prefill_rows=prefill_rows)
        self.buffer_len, self.repeats, self.log = buffer_len, repeats, log
        self._generators = {}  # (state, the round's program key): a Generator whose programs later runs reuse

    def _generator(self, state, speculative):
        key = (state, None if speculative is None else speculative.program_key)
        if key not in self._generators:
            self._generators[key] = Generator(self.model, state=state, speculative=speculative,
                                              buffer_len=self.buffer_len if state == "replay" else None, **self.kw)
        gen = self._generators[key]
        return gen if speculative is None else gen.with_speculative(speculative)

    def __call__(self, label, state, speculative=None, repeats=None):
        try:
            gen = self._generator(state, speculative)
            outs = [gen.generate(self.prompts, self.new_tokens, stop_tokens=None, progress=False)
                    for _ in range(repeats or self.repeats)]
        except (jax.errors.JaxRuntimeError, InsufficientMemoryError) as err:
            if not isinstance(err, InsufficientMemoryError) and "RESOURCE_EXHAUSTED" not in str(err):
                raise
            self.log(f"{label}: out of device memory, skipped ({str(err).splitlines()[0][:160]})")
            gc.collect()
            return None, None
        best = min(outs, key=lambda o: o.decode_s)  # its compile_s: the first run's (the others reuse it)
        return gen, dataclasses.replace(best, compile_s=max(o.compile_s for o in outs))


def self_consistent_reference(run, label, state, num_draft, reference, prompt_len, rounds=3, tree=None):
    """The greedy continuation that the speculative path of `state` reproduces when every draft is
    accepted (alpha = 1): starting from `reference` (the same state's AR greedy output), run with the
    oracle at alpha 1 and take its output as the next reference, until the output equals the reference
    (at most `rounds` runs). In bfloat16 the verify window sums its terms in another order than the
    AR step, and a random-weight model's top two logits are often within that rounding, so the AR
    output drifts from what the speculative path computes; a stale reference would make the oracle's
    drafts wrong from the first drift on. Returns (reference, runs, converged, mean agreeing
    positions with the AR output)."""
    ar = reference
    for runs in range(1, rounds + 1):
        _, out = run(f"{label} (alpha 1 reference, run {runs})", state,
                     SpeculativeConfig("oracle", num_draft, alpha=1.0, reference=reference, tree=tree), repeats=1)
        if out is None:
            return reference, runs, False, None
        converged = _rows_differing(out.sequences, reference) == 0
        reference = out.sequences
        if converged:
            break
    return reference, runs, converged, _first_difference(reference, ar, prompt_len)


def bench_model(name, config_dir, batches, *, num_draft, buffer_len, alphas, prompt_len, new_tokens, backend,
                dtype, budget_bytes, repeats, prefill_rows, log, save=lambda rows: None, profile=False, modes=MODES,
                drafters=("oracle",), tree=None):
    """Rows of one model over batches x `modes` (the speculative ones per drafter, the oracle's per
    alpha; each after the AR mode of its state); `save(rows)` after each. With "mtp" in `drafters`
    the model gets a random MTP head (`models.mtp.add_mtp_head`, seed 1). tree: (topk, depth) of the
    tree modes."""
    model = init_model(config_dir, dtype)
    if "mtp" in drafters:
        add_mtp_head(model, param_dtype=dtype, rngs=nnx.Rngs(1))
    rows, cache_bytes = [], {}
    rng = np.random.default_rng(0)
    for batch in batches:
        prompts = rng.integers(3, model.config.vocab_size, size=(batch, prompt_len)).astype(np.int32)
        run = _Runner(model, prompts, new_tokens, buffer_len=buffer_len, backend=backend,
                      prefill_rows=prefill_rows, repeats=repeats, log=log)
        ar = {}
        for mode in modes:
            kind, state = mode.split("-")
            if kind != "ar" and state not in ar:
                log(f"{name} batch={batch} {mode}: skipped (no ar-{state} run at this batch)")
                continue
            # The tree modes: K = the tree's depth; W the draft positions along one path plus the root.
            k, topk, spec_tree = (num_draft, 1, None) if kind != "tree" else (tree[1], tree[0], tree)
            window = k + 1
            reference, ref_info = None, {}
            if kind != "ar":
                reference, runs, converged, agree = self_consistent_reference(
                    run, f"{name} batch={batch} {mode}", state, k, ar[state].sequences, prompt_len, tree=spec_tree)
                ref_info = dict(reference_runs=runs, reference_converged=converged, ar_agreeing_tokens=agree)
            for drafter, alpha in _drafts(kind, drafters, alphas):
                speculative = None if drafter is None else SpeculativeConfig(
                    drafter, k, tree=spec_tree,
                    **(dict(alpha=alpha, reference=reference) if drafter == "oracle" else {}))
                label = f"{name} batch={batch} {mode}" + dict(oracle=f" alpha={alpha}", mtp=" mtp").get(drafter, "")
                gen, best = run(label, state, speculative)
                if best is None:
                    continue
                same = None
                if kind == "ar":
                    ar[state] = best
                else:
                    differing = _rows_differing(best.sequences, reference)
                    same = differing == 0
                    if not same:
                        log(f"{label}: greedy tokens differ from the reference's in {differing} of {batch} rows "
                            f"(agreeing for {_first_difference(best.sequences, reference, prompt_len):.1f} "
                            f"tokens on average)")
                if mode not in cache_bytes:  # per sequence: the same at every batch and drafter
                    cache_bytes[mode] = cache_bytes_per_sequence(gen, prompt_len, new_tokens)
                per_seq, per_round = cache_bytes[mode]
                prof = e2e._profile(gen, prompts, new_tokens) if profile else None
                rows.append(Row(name, batch, mode, alpha, best.tokens_per_s, best.decode_s / best.decode_steps * 1e3,
                                best.compile_s, best.prefill_s, best.accepted_per_round, per_seq, per_round,
                                int(budget_bytes // per_round), e2e._peak_gib(), same,
                                ideal_accepted=None if alpha is None else ideal_acceptance(alpha, window, topk),
                                verified_per_round=None if speculative is None else speculative.window,
                                profile=prof, drafter=drafter, **ref_info))
                r = rows[-1]
                log(f"{label}: {r.tokens_per_s:.0f} tok/s, {r.step_ms:.2f} ms a {'round' if drafter else 'step'}, "
                    f"accepted/round {r.accepted_per_round or 1:.2f}, compile {r.compile_s:.1f} s, "
                    f"{per_round / 2**20:.1f} MiB/seq, identical={same}")
                save(rows)
                del gen, best
                gc.collect()
        for r in rows:
            if r.batch == batch:
                base = next((b for b in rows if b.batch == batch and b.mode == f"ar-{r.mode.split('-')[1]}"), None)
                std = next((b for b in rows if b.batch == batch and b.mode == "ar-standard"), None)
                r.speedup = std and r.tokens_per_s / std.tokens_per_s
                r.speedup_same_state = base and r.tokens_per_s / base.tokens_per_s
                if r.ideal_accepted is not None and base is not None:
                    r.projected_speedup = r.ideal_accepted * base.step_ms / r.step_ms
    return rows


def _drafts(kind, drafters, alphas):
    """(drafter, alpha) pairs of one mode: AR (None, None); speculative: the oracle per alpha, then (chain
    modes) the MTP head."""
    if kind == "ar":
        return [(None, None)]
    return [("oracle", a) for a in alphas if "oracle" in drafters] + [("mtp", None)] * ("mtp" in drafters
                                                                                        and kind == "spec")


def print_table(meta, rows):
    print(f"\n{meta['date']} {meta['device']} backend={meta['backend']} commit={meta['commit']} "
          f"prompt={meta['prompt_len']} new={meta['new_tokens']} K={meta['num_draft']} W={meta['num_draft'] + 1} "
          f"L={meta['buffer_len']} {meta['dtype']} budget={meta['budget_gib']} GiB")
    print(f"{'model':26s} {'batch':>5s} {'mode':>13s} {'draft':>5s} {'tok/s':>10s} {'ms/step':>8s} {'vs std':>6s} "
          f"{'vs AR':>6s} {'verif':>5s} {'acc/rnd':>7s} {'ideal':>5s} {'proj.':>5s} {'MiB/seq':>8s} {'max seqs':>8s} "
          f"same")
    nan = float("nan")
    for r in rows:
        same = "-" if r.identical_to_reference is None else ("yes" if r.identical_to_reference else "no")
        draft = "mtp" if r.drafter == "mtp" else ("-" if r.alpha is None else f"{r.alpha:.2f}")
        print(f"{r.model:26s} {r.batch:5d} {r.mode:>13s} {draft:>5s} "
              f"{r.tokens_per_s:10.0f} {r.step_ms:8.2f} {r.speedup or nan:6.2f} {r.speedup_same_state or nan:6.2f} "
              f"{r.verified_per_round or 1:5d} {r.accepted_per_round or 1.0:7.2f} {r.ideal_accepted or 1.0:5.2f} {r.projected_speedup or nan:5.2f} "
              f"{r.round_bytes_per_seq / 2**20:8.2f} {r.max_sequences:8d} {same}")
    profiled = [r for r in rows if r.profile]
    if profiled:
        step_profile.print_breakdowns([(f"{r.model[:16]:16s} b{r.batch:<4d} {r.mode:>13s} {r.alpha or r.drafter or '':>4}",
                                        r.profile)
                                       for r in profiled], "step or round", top=4)


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
    p.add_argument("--drafters", default="oracle,mtp", help="speculative rows' drafters: oracle (per alpha) and/or "
                                                          "mtp (a random MTP head: it accepts almost nothing)")
    p.add_argument("--prompt-len", type=int, default=None, help="default 128 (with --dry-run: 8)")
    p.add_argument("--new-tokens", type=int, default=None, help="default 64 (with --dry-run: 6)")
    p.add_argument("--budget-gib", type=float, default=100.0, help="cache memory budget for max_sequences")
    p.add_argument("--repeats", type=int, default=None, help="runs per configuration, the fastest counts (default 2)")
    p.add_argument("--backend", default=None)
    p.add_argument("--prefill-rows", type=int, default=64, help="rows per prefill pass; 0: all at once")
    p.add_argument("--out", default=None, help="folder for spec.json; default bench/results/DATE-spec "
                                               "(with --dry-run: a new temporary folder)")
    p.add_argument("--modes", default=",".join(MODES), help=f"a subset of {','.join(MODES)} (a spec mode needs the "
                                                            "AR mode of its state)")
    p.add_argument("--tree", default=None, metavar="TOPK,DEPTH",
                   help=f"also run {','.join(TREE_MODES)} (each beside its AR mode): rounds of a draft tree of TOPK "
                        "candidates per depth, DEPTH deep (1 + TOPK * DEPTH <= --buffer-len)")
    p.add_argument("--profile", action="store_true",
                   help="GPU time of a step or round by kernel category, from a traced run")
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
    tree = None
    if args.tree is not None:
        try:
            tree = tuple(int(x) for x in args.tree.split(","))
        except ValueError:
            tree = ()
        if len(tree) != 2 or min(tree) < 1:
            p.error(f"--tree: expected TOPK,DEPTH (two ints >= 1); got {args.tree!r}")
        if 1 + tree[0] * tree[1] > buffer_len:
            p.error(f"--tree: 1 + TOPK * DEPTH = {1 + tree[0] * tree[1]} verified positions must be <= "
                    f"--buffer-len = {buffer_len}")
    known = MODES + (TREE_MODES if tree else ())
    asked = args.modes.split(",")
    asked += [m for m in TREE_MODES if tree and "ar-" + m.split("-", 1)[1] in asked]  # a tree mode beside its AR mode
    modes = [m for m in known if m in asked]
    unknown = set(args.modes.split(",")) - set(known)
    if unknown or not modes:
        p.error(f"--modes: choose from {','.join(known)}; got {args.modes!r}")
    alone = [m for m in modes if not m.startswith("ar-") and "ar-" + m.split("-", 1)[1] not in modes]
    if alone:
        p.error(f"--modes: {alone[0]} needs ar-{alone[0].split('-', 1)[1]} beside it (the drafts' reference and the "
                f"speedup come from that AR run); got {args.modes!r}")
    drafters = args.drafters.split(",")
    if not drafters or set(drafters) - {"oracle", "mtp"}:
        p.error(f"--drafters: choose from oracle,mtp; got {args.drafters!r}")
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
                new_tokens=new_tokens, num_draft=args.num_draft, tree=tree, buffer_len=buffer_len, alphas=alphas,
                drafters=drafters, repeats=repeats, budget_gib=args.budget_gib, dtype=jnp.dtype(dtype).name,
                command=" ".join(sys.argv))
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "spec.json")
    rows = []

    def save(more):
        with open(path, "w") as f:
            json.dump(dict(meta=meta, rows=[dataclasses.asdict(r) for r in rows + more]), f, indent=1)

    if jax.config.jax_compilation_cache_dir is None:
        # Each program compiles once in this run: a mode's alpha-1 reference runs, its alphas and repeats
        # build new Generators of the same program, which then load it (a fresh folder: no earlier entries).
        set_compile_cache(tempfile.mkdtemp(prefix="spec_compile_cache_"))
    t0 = time.perf_counter()
    try:
        for name, config_dir in configs.items():
            rows += bench_model(name, config_dir, batches, num_draft=args.num_draft, buffer_len=buffer_len,
                                alphas=alphas, prompt_len=prompt_len, new_tokens=new_tokens, backend=backend,
                                dtype=dtype, budget_bytes=args.budget_gib * 2**30, repeats=repeats,
                                prefill_rows=args.prefill_rows or None,
                                log=lambda s: print(f"[{time.perf_counter() - t0:6.0f} s] {s}", file=sys.stderr,
                                                    flush=True), save=save,
                                profile=args.profile, modes=modes, drafters=drafters, tree=tree)
            save([])
    except GenerationError as e:
        p.error(str(e))
    print_table(meta, rows)
    mismatches = [r for r in rows if r.identical_to_reference is False]
    if mismatches:
        print(f"{len(mismatches)} speculative rows' greedy tokens left their reference ({meta['dtype']}): "
              + ", ".join(f"{r.model} {r.batch} {r.mode} {r.alpha}" for r in mismatches))
    print(f"JSON: {path}")
    return 1 if mismatches and jnp.dtype(dtype) == jnp.float32 else 0


if __name__ == "__main__":
    sys.exit(main())
