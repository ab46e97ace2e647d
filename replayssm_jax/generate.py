"""`replayssm-generate` (also `python -m replayssm_jax.generate`): generate text
or token ids from a Hugging Face hybrid checkpoint with the standard state or
ReplaySSM, and compare the two.

With no arguments it runs on a tiny Nemotron-H checkpoint shipped in the
package (random weights: the text is noise, the mechanics are real).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import ops
from replayssm_jax.ops import ROUTES
from replayssm_jax.generation import STATES, GenerationError, Generator
from replayssm_jax.sampling import SamplingParams

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DEFAULT_PROMPT = "ReplaySSM keeps the state as a checkpoint"


def default_checkpoint() -> str:
    """The tiny checkpoint shipped in the package (a Nemotron-H with Mamba-2, attention, MLP and MoE layers)."""
    return os.fspath(resources.files("replayssm_jax") / "checkpoints" / "nemotron_h_tiny")


class UsageError(Exception):
    """An error in the user's input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are UsageErrors: one line, exit status 2, like the command's own."""

    def error(self, message):
        raise UsageError(message)


def parse_args(argv=None) -> argparse.Namespace:
    p = _Parser(prog="replayssm-generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, help="checkpoint folder (config.json + safetensors); default: the shipped tiny Nemotron-H")
    p.add_argument("--random-weights", action="store_true",
                   help="build the model of --checkpoint's config.json with random weights (seeded by --seed); no safetensors needed")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text (tokenizer.json if the checkpoint has one, else UTF-8 bytes as ids)")
    src.add_argument("--prompt-ids", default=None, help='token ids, rows separated by ";" and ids by ",": "1,2,3;4,5"')
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--state", choices=STATES, default="replay")
    p.add_argument("--buffer-len", type=int, default=16, help="ReplaySSM buffer length L")
    p.add_argument("--route", choices=ROUTES, default="auto",
                   help="ReplaySSM step route: output or state (buffered steps, same numbers), direct (the state "
                        "written every step; for batches of 1-4 rows, where buffering saves nothing), or auto "
                        "(default: the kernels pick direct where their grid is latency-bound, else output)")
    p.add_argument("--dtype", default="float32", help="float32 or bfloat16 (weights and activations)")
    p.add_argument("--backend", default=None, help="SSM op backend: pallas, interpret or xla (default: pallas on GPU, else xla)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--stop", default=None, help="comma-separated stop token ids (default: the config's eos_token_id)")
    p.add_argument("--compare", action="store_true", help="run standard and replay; report identical tokens and the speed ratio")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p.parse_args(argv)


def _parse_prompt_ids(text: str) -> list[list[int]]:
    rows = []
    for i, row in enumerate(text.split(";")):
        try:
            ids = [int(t) for t in row.split(",") if t.strip()]
        except ValueError:
            raise UsageError(f"--prompt-ids: row {i} ({row!r}) is not a comma-separated list of integers") from None
        if not ids:
            raise UsageError(f"--prompt-ids: row {i} is empty")
        rows.append(ids)
    return rows


class Tokenizer:
    """tokenizer.json through the `tokenizers` library, or UTF-8 bytes as ids."""

    def __init__(self, checkpoint: str, vocab_size: int):
        path = os.path.join(checkpoint, "tokenizer.json")
        self.hf = None
        if os.path.exists(path):
            from tokenizers import Tokenizer as HFTokenizer

            self.hf = HFTokenizer.from_file(path)
        self.vocab_size = vocab_size

    @property
    def kind(self) -> str:
        return "tokenizer.json" if self.hf else "utf-8 bytes"

    def encode(self, text: str) -> list[int]:
        if not text:
            raise UsageError("--prompt is empty")
        ids = self.hf.encode(text).ids if self.hf else list(text.encode("utf-8"))
        if not ids:
            raise UsageError("--prompt gives no tokens")
        return ids

    def decode(self, ids: list[int]) -> str:
        if self.hf:
            return self.hf.decode(ids)
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _stop_tokens(args, config) -> list[int]:
    if args.stop is not None:
        try:
            return [int(t) for t in args.stop.split(",") if t.strip()]
        except ValueError:
            raise UsageError(f"--stop must be comma-separated integers; got {args.stop!r}") from None
    eos = getattr(config, "eos_token_id", None)
    return [] if eos is None else list(np.atleast_1d(eos).tolist())


def _check_args(args):
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}; got {args.dtype!r}")
    if args.backend is not None and args.backend not in ops.BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(ops.BACKENDS)}; got {args.backend!r}")
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0; got {args.max_new_tokens}")
    if args.buffer_len < 1 and (args.state == "replay" or args.compare):  # the standard state has no buffer
        raise UsageError(f"--buffer-len must be >= 1; got {args.buffer_len}")
    if not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed must be in [0, 2**32); got {args.seed}")
    if args.temperature == 0 and (args.top_k or args.top_p < 1.0):
        raise UsageError("--top-k and --top-p apply to sampling: give --temperature > 0 with them")
    try:
        return SamplingParams(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        raise UsageError(str(e).replace("`temperature`", "--temperature").replace("`top_k`", "--top-k")
                         .replace("`top_p`", "--top-p")) from None


def _run(model, prompts, args, state, sampling, stop, backend):
    gen = Generator(model, state=state, buffer_len=args.buffer_len, backend=backend, route=args.route)
    out = gen.generate(prompts, args.max_new_tokens, sampling=sampling, seed=args.seed, stop_tokens=stop,
                       progress=False if args.no_progress or args.json else None)
    return out


def _summary(out, state, args, backend, tokenizer):
    result = {
        "state": state,
        "buffer_len": args.buffer_len if state == "replay" else None,
        "route": args.route if state == "replay" else None,
        "backend": backend,
        "generated_ids": out.sequences,
        "num_generated": out.num_generated,
        "tokens_per_s": out.tokens_per_s,
        "decode_s": out.decode_s,
        "prefill_s": out.prefill_s,
        "compile_s": out.compile_s,
        "cache_bytes": out.cache_bytes,
    }
    if tokenizer is not None:
        result["text"] = [tokenizer.decode(s) for s in out.sequences]
    return result


# Generator's argument names as this command's flags, for its error messages.
_FLAGS = {"`buffer_len`": "--buffer-len", "`max_new_tokens`": "--max-new-tokens", "`stop_tokens`": "--stop",
          "`seed`": "--seed", "`prompt ": "`--prompt-ids row "}


def _flag_names(message: str) -> str:
    for name, flag in _FLAGS.items():
        message = message.replace(name, flag)
    return message


def run(args) -> dict:
    """Load, generate, and return the report (raises UsageError on bad input)."""
    from models import CheckpointError, CheckpointNotFoundError, ConfigError, load_model
    from models.random_init import init_model

    sampling = _check_args(args)
    try:
        backend = ops.resolve_backend(args.backend)
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None
    checkpoint = args.checkpoint or default_checkpoint()
    try:
        if args.random_weights:
            model = init_model(checkpoint, DTYPES[args.dtype], seed=args.seed)
        else:
            model = load_model(checkpoint, dtype=DTYPES[args.dtype])
    except (CheckpointNotFoundError, ConfigError, CheckpointError, OSError) as e:
        raise UsageError(f"cannot load checkpoint {checkpoint!r}: {e}") from None
    vocab = int(model.config.vocab_size)
    tokenizer = None
    if args.prompt_ids is not None:
        prompts = _parse_prompt_ids(args.prompt_ids)
        if os.path.exists(os.path.join(checkpoint, "tokenizer.json")) or vocab >= 256:
            tokenizer = Tokenizer(checkpoint, vocab)
    else:
        tokenizer = Tokenizer(checkpoint, vocab)
        if tokenizer.hf is None and vocab < 256:
            raise UsageError(f"the checkpoint has no tokenizer.json and a vocabulary of {vocab} < 256 byte ids: use --prompt-ids")
        prompts = [tokenizer.encode(DEFAULT_PROMPT if args.prompt is None else args.prompt)]
    stop = _stop_tokens(args, model.config)
    report = {"checkpoint": checkpoint, "random_weights": args.random_weights, "model_type": model.config.model_type, "dtype": args.dtype,
              "device": jax.devices()[0].device_kind, "tokenizer": tokenizer.kind if tokenizer else None}
    try:
        states = ["standard", "replay"] if args.compare else [args.state]
        runs = {s: _summary(_run(model, prompts, args, s, sampling, stop, backend), s, args, backend, tokenizer)
                for s in states}
    except GenerationError as e:
        raise UsageError(_flag_names(str(e))) from None
    if args.compare:
        std, rep = runs["standard"], runs["replay"]
        timed = std["tokens_per_s"] and rep["tokens_per_s"]
        report.update(runs=runs, identical=std["generated_ids"] == rep["generated_ids"],
                      speedup=rep["tokens_per_s"] / std["tokens_per_s"] if timed else None)
    else:
        report.update(runs[args.state])
    return report


def _print_human(report):
    runs = report.get("runs") or {report["state"]: report}
    print(f"checkpoint: {report['checkpoint']} ({report['model_type']}, {report['dtype']}, {report['device']})")
    for state, r in runs.items():
        label = f"{state}" + (f" L={r['buffer_len']} route={r['route']}" if r["buffer_len"] else "")
        speed = "no decode step" if r["tokens_per_s"] is None else f"{r['tokens_per_s']:.1f} tokens/s decode"
        print(f"\n[{label}] backend={r['backend']}: {speed}, "
              f"prefill {r['prefill_s'] * 1e3:.1f} ms, compile {r['compile_s']:.1f} s")
        for i, ids in enumerate(r["generated_ids"]):
            print(f"  seq {i} ids: {ids}")
            if "text" in r:
                print(f"  seq {i} text: {r['text'][i]!r}")
    if "identical" in report:
        speed = "n/a" if report["speedup"] is None else f"{report['speedup']:.2f}x"
        print(f"\nstandard vs replay: tokens {'identical' if report['identical'] else 'DIFFERENT'}, "
              f"replay/standard speed {speed}")


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        report = run(args)
    except UsageError as e:
        print(f"replayssm-generate: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
    else:
        _print_human(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
