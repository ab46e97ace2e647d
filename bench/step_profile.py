"""Where the time of compiled decode steps goes, from a JAX profiler trace (GPU).

`trace(fn)` runs `fn()` under `jax.profiler.trace` and returns the parsed
trace (`jax.profiler.ProfileData`). `decode_breakdown(profile)` then sums the
GPU kernels that ran inside the decode modules (the XLA module whose name
contains "jit_block": `Generator`'s compiled `lax.scan` block of decode
steps) by category:

  ssm    the Pallas SSM kernels (names mamba2_* / gdn_*: standard step, append,
         replay, flush, the direct and deferred routes, verify windows and
         their flush, the per-draft verify; the conv update is "other");
  attention  the kernels of the attention layers' scores, softmax and values
         over the KV caches (the XLA fusions whose ops carry the attention
         layers' name scope in the compiled HLO given as `hlo`; none without)
         and the decode attention kernel (names attention_decode_*);
  gemm   matrix products (cuBLAS / CUTLASS / XLA's Triton GEMMs): the
         projections, the MLP or experts, the LM head;
  other  every other kernel: XLA fusions for norms, activations, the causal
         conv, softmax, RoPE, cache writes, sampling;
  idle   time inside the module windows with no kernel running (launch
         latency and host gaps),

and lists the kernels that took longest. Kernel names come from CUPTI, so
"gemm" and "other" are told apart by name patterns; a kernel name the
patterns miss counts as "other" (the top list shows what was there). A
kernel whose name says nothing of its source (XLA's `memcpy*` launches for
HLO copies) is traced to the HLO instructions that issued it: the trace's
`hlo_op` stat of each launch, looked up in the compiled HLO (`issuers`).
"""

from __future__ import annotations

import collections
import glob
import os
import re
import tempfile

import jax
from jax.profiler import ProfileData

CATEGORIES = ("ssm", "gemm", "attention", "other", "idle")
_SSM = re.compile(r"^(mamba2|gdn)_(step|replay|direct|verify|per_draft|append|deferred)")
_GEMM = re.compile(r"gemm|xmma|cutlass|nvjet|cublas|wgmma|matmul", re.IGNORECASE)


def category(kernel: str, attention: frozenset = frozenset()) -> str:
    """"ssm", "attention" (a name in `attention`, or the decode attention kernel's), "gemm" or "other" for a
    GPU kernel name."""
    from replayssm_jax.kernels.attention import KERNEL_NAME

    if _SSM.match(kernel):
        return "ssm"
    if kernel in attention or kernel.startswith(KERNEL_NAME):
        return "attention"
    return "gemm" if _GEMM.search(kernel) else "other"


_OP_NAME = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*\bop_name="([^"]*)"', re.MULTILINE)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = ")


def attention_kernels(hlo_texts) -> frozenset:
    """The kernel names of the instructions in compiled HLO texts whose op_name carries the attention
    layers' name scope (replayssm_jax.layers.attention.ATTENTION_SCOPE); XLA names a fusion's kernel
    after the instruction, '.' and '-' written '_'."""
    from replayssm_jax.layers.attention import ATTENTION_SCOPE

    scope = f"/{ATTENTION_SCOPE}/"
    return frozenset(m.group(1).replace(".", "_").replace("-", "_") for text in hlo_texts
                     for m in _OP_NAME.finditer(text) if scope in m.group(2))


def trace(fn) -> ProfileData:
    """Run fn() under the JAX profiler; the parsed trace."""
    with tempfile.TemporaryDirectory() as logdir:
        with jax.profiler.trace(logdir):
            fn()
        files = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
        if not files:
            raise RuntimeError(f"the profiler wrote no trace under {logdir}")
        return ProfileData.from_file(max(files, key=os.path.getmtime))


def _merged_length(intervals) -> float:
    """Total length covered by a set of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def decode_breakdown(profile: ProfileData, module: str = "jit_block", top: int = 8, hlo=()) -> dict | None:
    """GPU time of the `module`'s kernels by category, in nanoseconds: the kernels whose `hlo_module`
    stat names `module`, and those without the stat that run inside the module's windows; `hlo`: the
    compiled HLO texts of the traced programs (their attention kernels: `attention_kernels`).

    Returns None when the trace has no GPU plane (a CPU run). Otherwise a dict:
      window_ns: summed duration of the module's executions (all of them when
        the trace has no "XLA Modules" line: then the span of all kernels);
      ns: {category: nanoseconds} for CATEGORIES (idle = window - union of kernels);
      top: [(kernel name, nanoseconds, launches)], longest first;
      kernels: {kernel name: (nanoseconds, launches)}, all of them;
      hlo_ops: {kernel name: sorted names of the HLO instructions its
        launches ran for (the trace's `hlo_op` stat)}, where the trace says.
    """
    planes = [p for p in profile.planes if p.name.startswith("/device:GPU")]
    if not planes:
        return None
    windows, kernels = [], []
    for plane in planes:
        for line in plane.lines:
            if line.name == "XLA Modules":
                windows += [(e.start_ns, e.end_ns) for e in line.events if module in e.name]
            elif line.name.startswith("Stream"):
                kernels += [(e.start_ns, e.end_ns, e.name, _stat(e, "hlo_op"), _stat(e, "hlo_module"))
                            for e in line.events]
    if not windows and kernels:
        windows = [(min(k[0] for k in kernels), max(k[1] for k in kernels))]
    # A kernel whose launch names its module (the `hlo_module` stat) counts by that name: on the H200
    # (2026-12-05) the windows also held kernels of the prefill, about 0.5 ms a decode step at batch 256,
    # which the difference against a shorter run's prefill (another program) did not cancel. A kernel
    # without the stat counts by the windows.
    inside = [k[:4] for k in kernels
              if (module in k[4] if k[4] is not None else any(s <= k[0] and k[1] <= e for s, e in windows))]
    ns = dict.fromkeys(CATEGORIES, 0.0)
    per_kernel = collections.defaultdict(lambda: [0.0, 0])
    ops = collections.defaultdict(set)
    attention = attention_kernels(hlo)
    for start, end, name, op in inside:
        ns[category(name, attention)] += end - start
        per_kernel[name][0] += end - start
        per_kernel[name][1] += 1
        if op:
            ops[name].add(op)
    window_ns = sum(e - s for s, e in windows)
    ns["idle"] = max(0.0, window_ns - _merged_length([(s, e) for s, e, _, _ in inside]))
    ranked = sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(window_ns=window_ns, ns=ns, top=[(name, t, n) for name, (t, n) in ranked],
                kernels={name: (t, n) for name, (t, n) in per_kernel.items()},
                hlo_ops={name: sorted(v) for name, v in ops.items()})


def _stat(event, key: str) -> str | None:
    """A stat of a kernel event, as text, or None: `hlo_op` (the HLO instruction XLA ran it for),
    `hlo_module` (the module of that instruction)."""
    return next((str(value) for name, value in event.stats if name == key), None)


def issuers(profile: dict, hlo_texts, pattern: str = r"^memcpy", limit: int = 6) -> dict:
    """For each kernel of a breakdown (`decode_breakdown` or `difference`) whose name matches `pattern`
    (by default XLA's copy launches), the HLO instructions that issued it: {kernel: [the instruction's
    line in the compiled HLO `hlo_texts` (its shape, operands and op_name), or its name where the text
    lacks it]}, at most `limit` a kernel. Empty where the trace carries no `hlo_op` stats. A launch
    inside one of XLA's command buffers (CUDA graphs, on by default) carries the command buffer's name
    (`command_buffer_N`) instead: run with `XLA_FLAGS=--xla_gpu_enable_command_buffer=` to see the
    instruction itself."""
    lines = {}
    for text in hlo_texts:
        for line in text.splitlines():
            m = _INSTRUCTION.match(line)
            if m:
                lines.setdefault(m.group(1), line.strip()[:400])
    found = {}
    for name, op_names in profile.get("hlo_ops", {}).items():
        if re.search(pattern, name):
            found[name] = [lines.get(op, op) for op in op_names[:limit]]
    return found


def difference(full: dict, base: dict, top: int = 8) -> dict:
    """The breakdown of `full` less that of `base` (two `decode_breakdown`s):
    per category and per kernel, floored at 0.

    For a run whose trace cannot tell the decode module from the prefill (no
    "XLA Modules" line: every kernel counts), the difference between a run
    with n decode steps and the same run with none leaves the decode's share.
    """
    ns = {c: max(0.0, full["ns"][c] - base["ns"][c]) for c in CATEGORIES}
    kernels = {}
    for name, (t, n) in full["kernels"].items():
        t0, n0 = base["kernels"].get(name, (0.0, 0))
        if t - t0 > 0:
            kernels[name] = (t - t0, max(0, n - n0))
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    hlo_ops = {name: ops for name, ops in full.get("hlo_ops", {}).items() if name in kernels}
    return dict(window_ns=max(0.0, full["window_ns"] - base["window_ns"]), ns=ns,
                top=[(name, t, n) for name, (t, n) in ranked], kernels=kernels, hlo_ops=hlo_ops)


def print_breakdowns(entries, what: str = "decode step", top: int = 3) -> None:
    """Print one line per (label, profile) of `entries` (a profile: {"ms": {category: ms}, "top":
    [(kernel, ms, launches)]}, per `what`, and optionally "copies", `issuers`' dict): ms by CATEGORIES,
    then the `top` longest kernels; under it, the HLO instructions behind each copy launch."""
    print(f"\nms per {what}: {' '.join(f'{c:>7s}' for c in CATEGORIES)}   (then the longest kernels)")
    for label, profile in entries:
        longest = ", ".join(f"{n[:40]} {t:.3f}" for n, t, _ in profile["top"][:top])
        print(f"{label} {' '.join(f'{profile['ms'][c]:7.3f}' for c in CATEGORIES)}   {longest}")
        for kernel, instructions in profile.get("copies", {}).items():
            for instruction in instructions:
                print(f"    {kernel} <- {instruction[:200]}")
