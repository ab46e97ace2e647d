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
import re
import sys
import unicodedata
import warnings
from importlib import resources

import jax
import jax.numpy as jnp

from replayssm_jax import ops
from replayssm_jax.ops import ROUTES
from replayssm_jax.generation import (
    STATES,
    GenerationError,
    Generator,
    SpeculativeConfig,
    default_compile_cache,
    format_bytes,
    free_memory,
    set_compile_cache,
    status,
)
from replayssm_jax.sampling import SamplingParams
from replayssm_jax.text import ChatTemplate, TextError, TextStream, Tokenizer

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
DEFAULT_PROMPT = "ReplaySSM keeps the state as a checkpoint"
DEFAULT_BUFFER_LEN = 16
DEFAULT_NUM_DRAFT = 3

# Why --compare may find different tokens: printed with the first difference, and in the README.
NEAR_TIES = ("ReplaySSM computes the same recurrence as the standard state with its sums in another order, so the "
             "logits differ by rounding (in bfloat16 about 1e-2 relative, in float32 about 1e-6); where the two "
             "most likely tokens nearly tie, greedy decoding can pick the other one, and the sequences go apart "
             "from there. The tokens before that position are identical.")


def default_checkpoint() -> str:
    """The tiny checkpoint shipped in the package (a Nemotron-H with Mamba-2, attention, MLP and MoE layers)."""
    return os.fspath(resources.files("replayssm_jax") / "checkpoints" / "nemotron_h_tiny")


class UsageError(Exception):
    """An error in the user's input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are UsageErrors: one line, exit status 2, like the command's own."""

    def error(self, message):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The command's options (see the README's "Generating" section); its errors raise UsageError."""
    p = _Parser(prog="replayssm-generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=None, help="checkpoint folder (config.json + safetensors); default: the shipped tiny Nemotron-H")
    p.add_argument("--random-weights", action="store_true",
                   help="build the model of --checkpoint's config.json with random weights (seeded by --seed); no safetensors needed")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="prompt text (tokenizer.json if the checkpoint has one, else UTF-8 bytes as ids)")
    src.add_argument("--prompt-ids", default=None, help='token ids, rows separated by ";" and ids by ",": "1,2,3;4,5"')
    p.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the checkpoint's chat template "
                        "(chat_template.jinja, else tokenizer_config.json's chat_template)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    p.add_argument("--state", choices=STATES, default=None, help="default: replay")
    p.add_argument("--buffer-len", type=int, default=None, help=f"ReplaySSM buffer length L (default {DEFAULT_BUFFER_LEN})")
    p.add_argument("--route", choices=ROUTES, default=None,
                   help="ReplaySSM step route: output, state or deferred (buffered steps, same numbers; deferred "
                        "flushes a full row in its next step), direct (the state written every step; for batches "
                        "of 1-4 rows, where buffering saves nothing), or auto (default: the kernels pick direct "
                        "where their grid is latency-bound, else deferred from batch 64 with an f32 or bf16 "
                        "state, else output)")
    p.add_argument("--dtype", default="float32", metavar="{" + ",".join(DTYPES) + "}",
                   help="float32 (default, whatever the checkpoint's dtype) or bfloat16: the weights and "
                        "activations (a bfloat16 checkpoint is upcast unless --dtype bfloat16)")
    p.add_argument("--state-dtype", choices=("float32", "bfloat16", "int8", "float8_e4m3fn"), default=None,
                   help="ReplaySSM checkpoint dtype (default: the SSM state's; 8-bit: per-row scales, quantized at "
                        "each flush); --state replay only")
    p.add_argument("--state-rounding", choices=("nearest", "stochastic"), default=None,
                   help="rounding of an 8-bit checkpoint at each flush (default nearest); --state-dtype int8 or "
                        "float8_e4m3fn only")
    p.add_argument("--backend", default=None, metavar="{" + ",".join(ops.BACKENDS) + "}",
                   help="SSM op backend: pallas, interpret or xla (default: pallas on GPU, else xla)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (and of --random-weights)")
    p.add_argument("--temperature", type=float, default=None,
                   help="0: greedy (default: generation_config.json's, greedy without one)")
    p.add_argument("--top-k", type=int, default=None, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling mass (1.0: all)")
    p.add_argument("--stop", default=None,
                   help="comma-separated stop token ids; '' for none (default: the checkpoint's eos_token_id)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel devices: heads, intermediate sizes and vocabulary split over them "
                        "(models.sharding; default: one device, no mesh)")
    p.add_argument("--dp", type=int, default=None,
                   help="data-parallel device groups: the batch rows split over them (default 1 with --tp)")
    p.add_argument("--block-size", type=int, default=16,
                   help="decode steps (speculative rounds) per compiled block (default 16)")
    p.add_argument("--lockstep", choices=("auto", "on", "off"), default=None,
                   help="flush every row's buffer in one direct step per cycle of L steps (Generator's lockstep): "
                        "auto (default: where it applies), on (an error where it cannot: --block-size not a "
                        "multiple of --buffer-len, --speculative, --route direct, an 8-bit --state-dtype), off; "
                        "--state replay only")
    p.add_argument("--speculative", type=_speculative_method, default=None, metavar="{ngram,mtp,draft:DIR}",
                   help="speculative decoding: a drafter proposes --num-draft tokens per round, the model verifies "
                        "them in one call. ngram: prompt lookup; mtp: the checkpoint's multi-token prediction head "
                        "(its mtp.* tensors); draft:DIR: the model of checkpoint folder DIR, of the same vocabulary "
                        "(with --random-weights, random weights of DIR's config.json)")
    p.add_argument("--num-draft", type=int, default=None,
                   help="drafts per speculative round K >= 1 (default 3); K + 1 <= --buffer-len with --state replay")
    p.add_argument("--tree", type=_tree_shape, default=None, metavar="TOPK,DEPTH",
                   help="tree speculation: each round verifies a draft tree of TOPK candidates per depth (the "
                        "first one expanding), DEPTH levels deep, 1 + TOPK * DEPTH nodes (<= --buffer-len with "
                        "--state replay), and keeps the longest accepted path; --num-draft is DEPTH")
    p.add_argument("--compare", action="store_true", help="run standard and replay; report identical tokens and the speed ratio")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--new-only", action="store_true", help="print only the generated tokens, not the prompt")
    cache = p.add_mutually_exclusive_group()
    cache.add_argument("--compile-cache", default=None, metavar="DIR",
                       help="JAX's persistent compilation cache (default: $XDG_CACHE_HOME/replayssm-jax/jax, "
                            "~/.cache/replayssm-jax/jax)")
    cache.add_argument("--no-compile-cache", action="store_true", help="compile without the persistent cache")
    p.add_argument("--no-progress", action="store_true", help="no status lines or progress bar on stderr")
    return p


SPECULATIVE = ("ngram", "mtp", "draft:DIR")


def _speculative_method(text: str) -> str:
    """--speculative's value: "ngram", "mtp" or "draft:DIR" (DIR not empty)."""
    if text in ("ngram", "mtp") or (text.startswith("draft:") and text[len("draft:"):].strip()):
        return text
    raise argparse.ArgumentTypeError(f"must be one of {', '.join(SPECULATIVE)}; got {text!r}")


def _tree_shape(text: str) -> tuple[int, int]:
    """--tree's value: "TOPK,DEPTH", two ints >= 1."""
    parts = text.split(",")
    try:
        topk, depth = (int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be TOPK,DEPTH (two ints >= 1); got {text!r}") from None
    if topk < 1 or depth < 1:
        raise argparse.ArgumentTypeError(f"TOPK and DEPTH must be >= 1; got {text!r}")
    return topk, depth


def _num_draft(args) -> int:
    """K: --num-draft, else --tree's DEPTH, else the default."""
    if args.num_draft is not None:
        return args.num_draft
    return DEFAULT_NUM_DRAFT if args.tree is None else args.tree[1]


def _draft_folder(args) -> str | None:
    """The draft model's folder of --speculative draft:DIR, else None."""
    spec = args.speculative
    return spec[len("draft:"):] if spec and spec.startswith("draft:") else None


# Options whose value may start with "-" (a negative id, which argparse would take for an option).
_ID_OPTIONS = ("--prompt-ids", "--stop")


def parse_args(argv=None) -> argparse.Namespace:
    """The parsed options; raises UsageError."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for i in range(len(argv) - 2, -1, -1):  # `--prompt-ids -1,2` as `--prompt-ids=-1,2`: a value, not an option
        if argv[i] in _ID_OPTIONS and re.fullmatch(r"-\d[\d,;\s-]*", argv[i + 1]):
            argv[i:i + 2] = [f"{argv[i]}={argv[i + 1]}"]
    return build_parser().parse_args(argv)


def _warn(message: str) -> None:
    print(f"replayssm-generate: warning: {message}", file=sys.stderr)


def _int_list(text: str) -> list[int] | None:
    """The comma-separated integers of `text`, or None if an item is not one."""
    try:
        return [int(t) for t in text.split(",")]
    except ValueError:
        return None


def _parse_prompt_ids(text: str) -> list[list[int]]:
    rows = []
    for i, row in enumerate(text.split(";")):
        if not row.strip():
            raise UsageError(f"--prompt-ids: row {i} is empty")
        ids = _int_list(row)
        if ids is None:
            raise UsageError(f"--prompt-ids: row {i} ({row!r}) is not a comma-separated list of integers")
        rows.append(ids)
    return rows


def _check_ids(rows: list[list[int]], vocab: int, name) -> None:
    """Raise UsageError for an id outside [0, vocab); `name(i)` names row i."""
    for i, ids in enumerate(rows):
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise UsageError(f"{name(i)} has token id {bad} outside the vocabulary [0, {vocab})")


def _stop_tokens(text: str | None, generation_config) -> list[int]:
    if text is None:
        return list(generation_config.eos_token_id or ())
    if not text.strip():
        return []
    ids = _int_list(text)
    if ids is None:
        raise UsageError(f"--stop must be comma-separated token ids ('' for none); got {text!r}")
    return ids


def _flag_names(message: str) -> str:
    """Generator's argument names as this command's options, for its error messages."""
    for name, flag in (("`buffer_len`", "--buffer-len"), ("`max_new_tokens`", "--max-new-tokens"),
                       ("`stop_tokens`", "--stop"), ("`seed`", "--seed"), ("`block_size`", "--block-size"),
                       ("`temperature`", "--temperature"), ("`top_k`", "--top-k"), ("`top_p`", "--top-p"),
                       ("`prompts`", "the prompts"), ("`lockstep=True`", "--lockstep on")):
        message = message.replace(name, flag)
    return message


def _check_args(args) -> list[str]:
    """Validate the options that need no file; return the states to run."""
    if args.dtype not in DTYPES:
        raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}; got {args.dtype!r}")
    if args.checkpoint is not None and not args.checkpoint.strip():
        raise UsageError("--checkpoint must name a folder; got an empty path (leave the option out for the shipped "
                         "tiny Nemotron-H)")
    if args.backend is not None and args.backend not in ops.BACKENDS:
        raise UsageError(f"--backend must be one of {', '.join(ops.BACKENDS)}; got {args.backend!r}")
    if args.max_new_tokens < 0:
        raise UsageError(f"--max-new-tokens must be >= 0; got {args.max_new_tokens}")
    if args.block_size < 1:
        raise UsageError(f"--block-size must be >= 1; got {args.block_size}")
    if not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed must be in [0, 2**32); got {args.seed}")
    for flag, value in (("--tp", args.tp), ("--dp", args.dp)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1; got {value}")
    if (args.tp is not None or args.dp is not None) and args.speculative is not None and \
            args.speculative != "ngram":
        raise UsageError(f"--tp / --dp run --speculative ngram only (the drafter of {args.speculative!r} has a "
                         f"model of its own, not sharded)")
    if args.compare and args.state is not None:
        raise UsageError(f"--compare runs both states: leave out --state (got --state {args.state})")
    if args.chat and args.prompt_ids is not None:
        raise UsageError("--chat applies the chat template to text: give --prompt, not --prompt-ids")
    states = ["standard", "replay"] if args.compare else [args.state or "replay"]
    if states == ["standard"]:
        for flag, value in (("--buffer-len", args.buffer_len), ("--route", args.route),
                            ("--state-dtype", args.state_dtype), ("--lockstep", args.lockstep)):
            if value is not None:
                _warn(f"{flag} applies to --state replay only; the standard state ignores it")
    if args.state_rounding is not None and args.state_dtype not in ("int8", "float8_e4m3fn"):
        _warn(f"--state-rounding applies to 8-bit checkpoints (--state-dtype int8 or float8_e4m3fn) only; "
              f"it is ignored with --state-dtype {args.state_dtype or 'unset'}")
    if states != ["standard"] and args.buffer_len is not None and args.buffer_len < 1:
        raise UsageError(f"--buffer-len must be >= 1; got {args.buffer_len}")
    if args.speculative is None and args.num_draft is not None:
        _warn("--num-draft applies to --speculative only; it is ignored")
    if args.speculative is None and args.tree is not None:
        raise UsageError("--tree applies to --speculative: give --speculative {ngram,mtp,draft:DIR}")
    if args.speculative is not None:
        k = _num_draft(args)
        if k < 1:
            raise UsageError(f"--num-draft must be >= 1; got {k}")
        if args.tree is not None and k != args.tree[1]:
            raise UsageError(f"--num-draft must equal --tree's DEPTH = {args.tree[1]} (the drafts along the "
                             f"tree's first branch); got {k}")
        buffer_len = args.buffer_len or DEFAULT_BUFFER_LEN
        verified = k + 1 if args.tree is None else 1 + args.tree[0] * args.tree[1]
        what = "--num-draft + 1" if args.tree is None else "--tree's 1 + TOPK * DEPTH"
        if "replay" in states and verified > buffer_len:
            raise UsageError(f"{what} = {verified} verified positions must be <= --buffer-len = {buffer_len} "
                             f"with --state replay (raise --buffer-len or lower "
                             f"{'--num-draft' if args.tree is None else 'TOPK or DEPTH'})")
    if args.new_only and args.json:
        _warn("--new-only applies to the text output; the JSON has both generated_ids and new_ids")
    return states


def _sampling(args, generation_config) -> SamplingParams:
    """The checkpoint's sampling defaults (their ranges checked as generation_config.json is read) with the
    explicit options winning; UsageError naming the options for a bad combination."""
    try:
        return SamplingParams.from_generation_config(generation_config, temperature=args.temperature,
                                                     top_k=args.top_k, top_p=args.top_p)
    except ValueError as e:
        raise UsageError(_flag_names(str(e))) from None


def _prompts(args, checkpoint, vocab) -> tuple[list[list[int]], Tokenizer | None]:
    """The prompt ids, and the tokenizer that decodes the output (None: ids only)."""
    has_tokenizer = os.path.exists(os.path.join(checkpoint, "tokenizer.json"))
    if args.prompt_ids is not None:
        prompts = _parse_prompt_ids(args.prompt_ids)
        _check_ids(prompts, vocab, lambda i: f"--prompt-ids row {i}")
        return prompts, Tokenizer(checkpoint) if has_tokenizer or vocab >= 256 else None
    tokenizer = Tokenizer(checkpoint)
    if tokenizer.hf is None and vocab < 256:
        raise UsageError(f"the checkpoint has no tokenizer.json and a vocabulary of {vocab} < 256 byte ids: use --prompt-ids")
    text = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if args.chat:
        tokenizer.encode(text, what="--prompt")  # not empty, valid UTF-8
        try:
            text = ChatTemplate(checkpoint).render([{"role": "user", "content": text}])
        except TextError as e:
            raise UsageError(f"--chat: {e}") from None
        ids = tokenizer.encode(text, what="--chat's rendered prompt", add_special_tokens=False)
    else:
        ids = tokenizer.encode(text, what="--prompt")
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise UsageError(f"{'--chat' if args.chat else '--prompt'}: the checkpoint's {tokenizer.kind} gives token id "
                         f"{bad}, outside the model's vocabulary [0, {vocab}) (config.json's vocab_size): the "
                         f"tokenizer does not belong to this model")
    return [ids], tokenizer


def _check_memory(abstract, states, args, prompts, backend, draft=None, mesh=None) -> None:
    """Before loading: refuse a run whose weights (a draft model's included: `draft`, abstract)
    plus decode cache exceed the free memory (of one device of `mesh`: the weights over tp,
    the cache over tp x dp)."""
    estimates = []
    for state in states:
        gen = _generator(abstract, state, args, backend, draft_model=draft)
        estimates.append(gen.memory_estimate(prompts, args.max_new_tokens))
    estimate = max(estimates, key=lambda e: e.total_bytes)
    weights = gen.weights_bytes
    free, where = free_memory()
    if mesh is not None and weights // mesh.shape["tp"] + estimate.total_bytes // mesh.size <= free:
        return
    if weights + estimate.total_bytes <= free:
        return
    rows = f"{len(prompts)} prompt{'s' if len(prompts) > 1 else ''}"
    head = (f"the model does not fit: the weights need {format_bytes(weights)} ({args.dtype}) and the decode cache "
            f"of {rows} x {estimate.max_len} positions needs {estimate.describe()}; the {where} is "
            f"{format_bytes(free)}")
    if weights >= free:
        raise UsageError(f"{head}; the weights alone do not fit" + ("" if args.dtype == "bfloat16" else
                                                                   " (--dtype bfloat16 halves them)"))
    fits = estimate.fits(free - weights, longest_prompt=max(map(len, prompts)), block_size=args.block_size)
    sizes = ([f"--buffer-len = {args.buffer_len or DEFAULT_BUFFER_LEN}"] if "replay" in states else []) + (
        [] if args.speculative is None else ["--tree" if args.tree else f"--num-draft = {_num_draft(args)}"])
    if estimate.state_bytes > estimate.kv_bytes and sizes:
        fits += f"; the SSM states, buffers and conv windows take the most, and grow with {' and '.join(sizes)}"
    raise UsageError(_flag_names(f"{head}; {fits}"))


def _speculative(args, draft_model=None) -> SpeculativeConfig | None:
    """The SpeculativeConfig of --speculative; `draft_model` (loaded or abstract) for draft:DIR."""
    if args.speculative is None:
        return None
    k = _num_draft(args)
    if _draft_folder(args) is not None:
        return SpeculativeConfig("draft", k, draft_model=draft_model, tree=args.tree)
    return SpeculativeConfig(args.speculative, k, tree=args.tree)


# --lockstep's choices as Generator's `lockstep`.
_LOCKSTEP = {"auto": None, "on": True, "off": False}


def _generator(model, state, args, backend, generation_config=None, draft_model=None, mesh=None) -> Generator:
    replay = state == "replay"
    return Generator(model, state=state, buffer_len=(args.buffer_len or DEFAULT_BUFFER_LEN) if replay else None,
                     backend=backend, route=(args.route or "auto") if replay else "auto",
                     block_size=args.block_size, generation_config=generation_config,
                     speculative=_speculative(args, draft_model), state_dtype=args.state_dtype if replay else None,
                     state_rounding=(args.state_rounding or "nearest") if replay and args.state_dtype in
                     ("int8", "float8_e4m3fn") else "nearest", mesh=mesh,
                     lockstep=_LOCKSTEP[args.lockstep or "auto"] if replay else None)


def _mesh(args, config):
    """The ("dp", "tp") mesh of --tp / --dp (None without them), checked against `config` before any
    weight is read."""
    if args.tp is None and args.dp is None:
        return None
    from models import sharding

    try:
        mesh = sharding.make_mesh(args.tp or 1, args.dp or 1)
        sharding.check_config(config, mesh.shape["tp"])
    except ValueError as e:
        raise UsageError(f"--tp / --dp: {e}") from None
    return mesh


def _printable(text: str) -> str:
    """`text` with control characters other than newline and tab escaped (safe on a terminal)."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else repr(c)[1:-1] for c in text)


class _Printer:
    """Prints row 0's new tokens as they come (`on_token`): text with a tokenizer (decoded after the
    prompt's ids, as the whole sequence decodes), else ids."""

    # The prompt ids the new ones are decoded after: enough left context for spacing and a split UTF-8
    # character, without decoding a long prompt again at every block.
    CONTEXT = 16

    def __init__(self, tokenizer, stop_tokens, prompt):
        self.stream = TextStream(tokenizer, prompt[-self.CONTEXT:]) if tokenizer else None
        self.stops, self.stopped = set(stop_tokens), False

    def _write(self, text):
        sys.stdout.write(_printable(text))
        sys.stdout.flush()

    def __call__(self, step, tokens):
        ids = []
        for t in tokens[:, 0].tolist():
            if self.stopped:
                break
            self.stopped = t in self.stops
            if not self.stopped:  # the stop token ends the text; it is not printed
                ids.append(t)
        self._write(self.stream.push(ids) if self.stream else "".join(f" {t}" for t in ids))

    def finish(self):
        self._write((self.stream.finish() if self.stream else "") + "\n")


def _label(r) -> str:
    method = r.get("speculative")
    method = f"draft:{r['draft_checkpoint']}" if method == "draft" and r.get("draft_checkpoint") else method
    tree = f" tree={r['tree'][0]},{r['tree'][1]}" if r.get("tree") else ""
    spec = f" speculative={method} K={r['num_draft']}{tree}" if method else ""
    dtype = f" state_dtype={r['state_dtype']}" + (f" ({r['state_rounding']})" if r.get("state_rounding") else "") \
        if r.get("state_dtype") else ""
    return r["state"] + (f" L={r['buffer_len']} route={r['route']}" if r["buffer_len"] else "") + dtype + spec


def _speed(r) -> str:
    speed = "no decode speed (fewer than 2 new tokens)" if r["tokens_per_s"] is None else \
        f"{r['tokens_per_s']:.1f} tokens/s decode"
    accepted = "" if r.get("mean_accepted") is None else f", {r['mean_accepted']:.2f} tokens per round"
    cache = f", cache {r['cache_bytes_per_sequence'] / 2**20:.2f} MiB a sequence" if r.get("cache_bytes_per_sequence") \
        else ""
    return f"{speed}{accepted}, prefill {r['prefill_s'] * 1e3:.1f} ms, compile {r['compile_s']:.1f} s{cache}"


def _state_format(gen) -> dict:
    """The report's state_dtype (None: the model's ssm_state_dtype) and state_rounding (8-bit checkpoints only)."""
    dtype = gen.state_dtype
    return {"state_dtype": None if dtype is None else dtype.name,
            "state_rounding": gen.state_rounding if dtype is not None and dtype.itemsize == 1 else None}


def _tree_of(spec) -> list[int] | None:
    """[topk, depth] of a SpeculativeConfig's tree, else None."""
    if spec is None or spec.tree is None:
        return None
    depth = spec.tree.max_depth
    return [(spec.tree.size - 1) // depth, depth]


def _summary(out, gen, tokenizer, draft_checkpoint=None) -> dict:
    result = {
        "state": gen.state,
        "buffer_len": gen.buffer_len,
        "route": gen.route if gen.state == "replay" else None,
        "lockstep": out.lockstep,
        "backend": gen.backend,
        "generated_ids": out.sequences,
        "new_ids": out.new_ids,
        "num_generated": out.num_generated,
        "tokens_per_s": out.tokens_per_s,
        "decode_s": out.decode_s,
        "decode_steps": out.decode_steps,
        "prefill_s": out.prefill_s,
        "compile_s": out.compile_s,
        "cache_bytes": out.cache_bytes,
        "cache_bytes_per_sequence": out.cache_bytes_per_sequence,
        **_state_format(gen),
        "speculative": gen.speculative.method if gen.speculative else None,
        "num_draft": gen.speculative.num_draft if gen.speculative else None,
        "tree": _tree_of(gen.speculative),
        "tree_nodes": gen.speculative.window if gen.speculative and gen.speculative.tree else None,
        "mean_accepted": out.accepted_per_round,
        "row_mean_accepted": out.row_accepted_per_round,
        "draft_checkpoint": draft_checkpoint,
    }
    if tokenizer is not None:
        result["text"] = [tokenizer.decode(s) for s in out.sequences]
        result["new_text"] = [tokenizer.decode(s) for s in out.new_ids]
    return result


def first_difference(standard: list[list[int]], replay: list[list[int]], prompt_lengths: list[int]) -> dict | None:
    """Where two runs' outputs first differ: {"row", "step" (0: the first new token),
    "standard", "replay" (the two tokens there; None past a sequence's end)}, or None."""
    for row, (a, b, n) in enumerate(zip(standard, replay, prompt_lengths)):
        if a != b:
            step = next((i for i, (x, y) in enumerate(zip(a[n:], b[n:])) if x != y), min(len(a), len(b)) - n)
            at = n + step
            return {"row": row, "step": step, "standard": a[at] if at < len(a) else None,
                    "replay": b[at] if at < len(b) else None}
    return None


def run(args, stream: bool = False) -> dict:
    """Load, generate, and return the report (raises UsageError on bad input).

    `stream`: print row 0's text on stdout as it is generated (a single prompt
    and state).
    """
    from flax import nnx

    from models import CheckpointError, CheckpointNotFoundError, ConfigError, load_generation_config, load_model
    from models.mtp import add_mtp_head
    from models.random_init import init_model
    from replayssm_jax.speculative.draft_model import check_draft_model

    states = _check_args(args)
    try:
        backend = ops.resolve_backend(args.backend)
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None
    try:
        cache_dir = set_compile_cache(None if args.no_compile_cache else args.compile_cache or default_compile_cache())
    except GenerationError as e:
        raise UsageError(f"--compile-cache: {e}") from None
    checkpoint = args.checkpoint or default_checkpoint()
    dtype = DTYPES[args.dtype]
    progress = False if args.no_progress or args.json else None
    mtp = args.speculative == "mtp"
    draft_dir = _draft_folder(args)

    def load(path, what, with_mtp=False):
        """The model of `path`: random weights (seeded by --seed), or its safetensors; with the MTP head."""
        try:
            with status(f"loading {'random ' if args.random_weights else ''}weights from {path}", progress):
                if not args.random_weights:
                    return load_model(path, dtype=dtype, mtp=with_mtp, mesh=mesh)
                model = init_model(path, dtype, seed=args.seed, mesh=mesh)
                return add_mtp_head(model, param_dtype=dtype) if with_mtp else model
        except (CheckpointNotFoundError, ConfigError, CheckpointError, OSError) as e:
            raise UsageError(f"cannot load {what} {path!r}: {e}") from None

    try:
        generation_config = load_generation_config(checkpoint)
        abstract = nnx.eval_shape(lambda: add_mtp_head(init_model(checkpoint, dtype), param_dtype=dtype) if mtp
                                  else init_model(checkpoint, dtype))
    except (CheckpointNotFoundError, ConfigError, OSError) as e:
        raise UsageError(f"cannot load checkpoint {checkpoint!r}: {e}") from None
    draft_abstract = None
    if draft_dir is not None:
        try:
            draft_abstract = nnx.eval_shape(lambda: init_model(draft_dir, dtype))
            check_draft_model(abstract.config, draft_abstract.config, target_checkpoint=checkpoint,
                              draft_checkpoint=draft_dir)
        except (CheckpointNotFoundError, ConfigError, OSError, ValueError) as e:
            raise UsageError(f"--speculative draft:{draft_dir}: {e}") from None
    mesh = _mesh(args, abstract.config)
    sampling = _sampling(args, generation_config)
    vocab = int(abstract.config.vocab_size)
    stop = _stop_tokens(args.stop, generation_config)
    _check_ids([stop], vocab, lambda i: "--stop")
    try:
        prompts, tokenizer = _prompts(args, checkpoint, vocab)
        _check_memory(abstract, states, args, prompts, backend, draft_abstract, mesh)
    except TextError as e:
        raise UsageError(str(e)) from None
    except GenerationError as e:
        raise UsageError(_flag_names(str(e))) from None
    del abstract, draft_abstract
    model = load(checkpoint, "checkpoint", with_mtp=mtp)
    draft = None if draft_dir is None else load(draft_dir, "the draft model's checkpoint")
    report = {"checkpoint": checkpoint, "random_weights": args.random_weights, "model_type": model.config.model_type,
              "dtype": args.dtype, "device": jax.devices()[0].device_kind,
              "mesh": None if mesh is None else {"dp": mesh.shape["dp"], "tp": mesh.shape["tp"]},
              "tokenizer": tokenizer.kind if tokenizer else None, "chat": args.chat, "prompt_ids": prompts,
              "max_new_tokens": args.max_new_tokens, "stop_tokens": stop,
              "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p},
              "seed": args.seed, "block_size": args.block_size, "compile_cache": cache_dir,
              "draft_checkpoint": draft_dir}
    runs = {}
    try:
        for state in states:
            gen = _generator(model, state, args, backend, generation_config, draft, mesh)
            printer = _Printer(tokenizer, stop, prompts[0]) if stream else None
            if printer:
                _print_header(report, gen, prompts[0], tokenizer, args.new_only)
            out = gen.generate(prompts, args.max_new_tokens, sampling=sampling, seed=args.seed, stop_tokens=stop,
                               progress=progress, on_token=printer)
            if printer:
                printer.finish()
            runs[state] = _summary(out, gen, tokenizer, draft_dir)
            del gen, out
    except GenerationError as e:
        raise UsageError(_flag_names(str(e))) from None
    if args.compare:
        std, rep = runs["standard"], runs["replay"]
        timed = std["tokens_per_s"] and rep["tokens_per_s"]
        report.update(runs=runs, identical=std["generated_ids"] == rep["generated_ids"],
                      first_difference=first_difference(std["generated_ids"], rep["generated_ids"],
                                                        [len(p) for p in prompts]),
                      speedup=rep["tokens_per_s"] / std["tokens_per_s"] if timed else None)
    else:
        report.update(runs[states[0]])
    return report


def _print_header(report, gen, prompt, tokenizer, new_only):
    print(f"checkpoint: {report['checkpoint']} ({report['model_type']}, {report['dtype']}, {report['device']})")
    spec = gen.speculative
    label = _label({"state": gen.state, "buffer_len": gen.buffer_len, "route": gen.route,
                    "speculative": spec and spec.method, "num_draft": spec and spec.num_draft,
                    "tree": _tree_of(spec), "draft_checkpoint": report["draft_checkpoint"], **_state_format(gen)})
    print(f"[{label}] backend={gen.backend}")
    if not new_only:
        sys.stdout.write(_printable(tokenizer.decode(prompt)) if tokenizer else " ".join(map(str, prompt)))
    sys.stdout.flush()


def _print_human(report, new_only: bool, streamed: bool):
    if streamed:  # the text is out already
        print(f"{report['num_generated'][0]} new tokens: {_speed(report)}")
        return
    runs = report.get("runs") or {report["state"]: report}
    print(f"checkpoint: {report['checkpoint']} ({report['model_type']}, {report['dtype']}, {report['device']})")
    ids_key, text_key = ("new_ids", "new_text") if new_only else ("generated_ids", "text")
    for r in runs.values():
        print(f"\n[{_label(r)}] backend={r['backend']}: {_speed(r)}")
        for i, ids in enumerate(r[ids_key]):
            print(f"  seq {i} {'new ' if new_only else ''}ids: {ids}")
            if text_key in r:
                print(f"  seq {i} {'new ' if new_only else ''}text: {r[text_key][i]!r}")
    if "identical" in report:
        speed = "n/a" if report["speedup"] is None else f"{report['speedup']:.2f}x"
        diff = report["first_difference"]
        same = "identical" if report["identical"] else (
            f"DIFFERENT from row {diff['row']}, new token {diff['step']} (standard {diff['standard']}, replay "
            f"{diff['replay']}): {NEAR_TIES}")
        print(f"\nstandard vs replay: tokens {same}; replay/standard speed {speed}")


def main(argv=None) -> int:
    """The command: returns the exit status (0, or 2 after a one-line error on stderr)."""
    try:
        args = parse_args(argv)
        streamed = not (args.json or args.compare) and _single_prompt(args)
        with warnings.catch_warnings():  # the library's warnings as one line each, as the command's own
            warnings.simplefilter("default", UserWarning)  # once per call site and run
            warnings.showwarning = lambda message, *_, **__: _warn(str(message))
            report = run(args, stream=streamed)
        if args.json:
            print(json.dumps(report))
        else:
            _print_human(report, args.new_only, streamed=streamed)
        sys.stdout.flush()
    except UsageError as e:
        print(f"replayssm-generate: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`| head`): no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


def _single_prompt(args) -> bool:
    return args.prompt_ids is None or ";" not in args.prompt_ids


if __name__ == "__main__":
    sys.exit(main())
