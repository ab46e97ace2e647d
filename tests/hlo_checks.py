"""Inspection of optimized HLO: copies of protected arrays inside loop bodies,
and the work of a compiled step besides its kernels.

A decode loop that updates its state in place compiles to a while loop whose
body (and the computations it calls) holds no `copy` / `copy-start` producing
an array of the state's shape and dtype. A decode step that is its kernels
alone compiles to an entry computation of Triton custom calls and plumbing
(`work_besides_kernels`).
"""

from __future__ import annotations

import itertools
import re

import jax.numpy as jnp

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_CALLEE = re.compile(
    r"\b(?:body|condition|calls|to_apply|true_computation|false_computation|branch_computations)="
    r"\{?(%?[\w.\-]+(?:, %?[\w.\-]+)*)\}?"
)
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16", "int32": "s32", "uint32": "u32", "bool": "pred"}
_COPY = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} copy(?:-start)?\(")


def _computations(hlo: str) -> dict[str, list[str]]:
    comps, name = {}, None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m and not line.startswith(" "):
            name = m.group(1)
            comps[name] = []
        elif line.startswith("}"):
            name = None
        elif name is not None:
            comps[name].append(line.strip())
    return comps


def _in_loops(comps: dict[str, list[str]]) -> set[str]:
    """The computations that run inside a while loop: the loop bodies and everything they call."""
    todo = [m.group(1) for lines in comps.values() for line in lines if (m := _WHILE_BODY.search(line))]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in comps:
            continue
        seen.add(name)
        for line in comps[name]:
            for m in _CALLEE.finditer(line):
                todo += [c.strip().lstrip("%") for c in m.group(1).split(",")]
    return seen


def per_step_copies(hlo: str, protected) -> list[str]:
    """Copies inside while-loop bodies (and everything they call) whose result
    has the shape and dtype of one of `protected` (arrays or ShapeDtypeStructs)."""
    return _in_loop_results(hlo, _COPY, {(_HLO_DTYPE[jnp.dtype(a.dtype).name], tuple(a.shape)) for a in protected})


def _in_loop_results(hlo: str, pattern: re.Pattern, targets: set) -> list[str]:
    """The instructions inside while-loop bodies (and everything they call) that `pattern` matches (its
    groups: HLO dtype, dims) with a (dtype, shape) in `targets`, one line each."""
    comps = _computations(hlo)
    found = []
    for name in _in_loops(comps):
        for line in comps[name]:
            m = pattern.search(line)
            if m and (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)) in targets:
                found.append(f"{name}: {line[:160]}")
    return found


_INSTRUCTION = re.compile(r"^(?:ROOT )?%?([\w.\-]+) = (.*?) (\w[\w\-]*)\((.*?)\)(?:, |$)")
_INDUCTION = re.compile(r'"known_induction_variable":\{"tuple_index":"(\d+)"\}')
_GTE_INDEX = re.compile(r"\bindex=(\d+)")
_COMMENT = re.compile(r"/\*.*?\*/")


def carry_copies(hlo: str, staged: bool = True) -> list[str]:
    """Copies of the carry of the outermost while loops (the decode loop, not
    the loops inside it), one line per copy of a carry element.

    In each such loop body, a `copy` / `copy-start` whose operand is (through
    bitcasts) element i of the body's parameter, or whose result is (through
    bitcasts) element i of the returned tuple, copies element i every
    iteration. The induction variable (from the loop's
    `known_induction_variable`) is not carry of the program and not reported.
    With `staged=False`, the copies into the initial state of a while loop
    nested in the body, or out of its result, are left out: the Pallas
    interpreter runs a kernel's grid as such a loop, holding each aliased
    operand and its output as two elements of its own state, so that an
    aliased operand is copied into that loop and back by design.
    """
    comps = _computations(hlo)
    inner = _in_loops(comps)
    outer = [(m.group(1), line) for name, lines in comps.items() if name not in inner for line in lines
             if (m := _WHILE_BODY.search(line))]
    found = []
    for body, line in outer:
        skip = {int(m.group(1))} if (m := _INDUCTION.search(line)) else set()
        found += [f"{body}: carry element {i}: {text[:160]}" for i, text, nested in _copied_elements(comps[body])
                  if i not in skip and (staged or not nested)]
    return found


def _copied_elements(lines: list[str]):
    """(tuple index, instruction, at a nested loop) of each copy of a parameter
    or root tuple element in one loop body; `at a nested loop`: the copy reads
    a nested while's result or feeds only the initial state of one."""
    defs, users, root = {}, {}, None
    for line in lines:
        m = _INSTRUCTION.match(_COMMENT.sub("", line))
        if m:
            args = [a.strip().split(" ")[-1].lstrip("%") for a in m.group(4).split(",")]
            defs[m.group(1)] = (m.group(3), args, line)
            for a in args:
                users.setdefault(a, []).append(m.group(1))
            if line.startswith("ROOT "):
                root = m.group(1)

    def through_bitcasts(name):
        while name in defs and defs[name][0] == "bitcast":
            name = defs[name][1][0]
        return name

    def element_of(name, producer):
        op, args, line = defs.get(through_bitcasts(name), (None, [], ""))
        if op == "get-tuple-element" and defs.get(args[0], ("",))[0] == producer:
            return int(_GTE_INDEX.search(line).group(1))
        return None

    def feeds_loop(name):
        tuples = users.get(name, [])
        return bool(tuples) and all(defs[t][0] == "tuple" and users.get(t) and
                                    all(defs[w][0] == "while" for w in users[t]) for t in tuples)

    returned = {}
    if root is not None and defs[root][0] == "tuple":
        returned = {through_bitcasts(a): i for i, a in enumerate(defs[root][1])}
    for name, (op, args, line) in defs.items():
        if op not in ("copy", "copy-start"):
            continue
        i = element_of(args[0], "parameter")
        nested = feeds_loop(name)
        if i is None:
            i = returned.get(name)
            nested = element_of(args[0], "while") is not None
        if i is not None:
            yield i, line, nested


_CONCAT = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} concatenate\(")


def merged_weights(hlo: str, weights) -> list[str]:
    """Concatenations of weight matrices inside while-loop bodies (and everything they call): a
    `concatenate` whose result is [o_1 + ... + o_k, in] (or its transpose) for k >= 2 of `weights`
    (2-D arrays [o_i, in] of one dtype and in): XLA's dot merger joining the projections of one
    input (replayssm_jax.compilation)."""
    by_input = {}
    for w in weights:
        by_input.setdefault((_HLO_DTYPE[jnp.dtype(w.dtype).name], w.shape[1]), []).append(w.shape[0])
    targets = set()
    for (dtype, cols), outs in by_input.items():
        for k in range(2, min(len(outs), 4) + 1):
            for rows in {sum(c) for c in itertools.combinations(outs, k)}:
                targets |= {(dtype, (rows, cols)), (dtype, (cols, rows))}
    return _in_loop_results(hlo, _CONCAT, targets)


# Entry instructions that launch nothing: arguments, constants, views of a buffer, tuples.
PLUMBING = frozenset({"parameter", "constant", "bitcast", "tuple", "get-tuple-element"})
KERNELS = ("__gpu$xla.gpu.triton", "mosaic_gpu_v2")  # custom-call targets of Pallas Triton and Mosaic GPU kernels


def work_besides_kernels(hlo: str) -> list[str]:
    """The entry computation's instructions that are neither a Pallas kernel (a custom call to a target of
    KERNELS: Triton or Mosaic GPU) nor plumbing (PLUMBING): every copy, fusion, memcpy or other launch that
    a compiled step runs besides its kernels."""
    entry = next(line for line in hlo.splitlines() if line.startswith("ENTRY "))
    name = _COMPUTATION.match(entry).group(1)
    found = []
    for line in _computations(hlo)[name]:
        m = _INSTRUCTION.match(_COMMENT.sub("", line))
        if m is None:
            continue
        op = m.group(3)
        if op in PLUMBING or (op == "custom-call" and any(f'custom_call_target="{t}"' in line for t in KERNELS)):
            continue
        found.append(line[:300])
    return found


_SLICE_WORK = frozenset({"parameter", "slice", "bitcast", "tuple"})


def slice_launches(hlo: str) -> list[str]:
    """The entry computation's launches that only cut arrays: a `slice`, or a fusion whose computation holds
    nothing but parameters, slices, bitcasts and tuples (a slice that no consumer's fusion took in)."""
    comps = _computations(hlo)
    entry = _COMPUTATION.match(next(line for line in hlo.splitlines() if line.startswith("ENTRY "))).group(1)

    def ops(lines):
        return {m.group(3) for line in lines if (m := _INSTRUCTION.match(_COMMENT.sub("", line)))}

    found = []
    for line in comps[entry]:
        m = _INSTRUCTION.match(_COMMENT.sub("", line))
        if m is None:
            continue
        callee = re.search(r"\bcalls=%?([\w.\-]+)", line) if m.group(3) == "fusion" else None
        inner = ops(comps.get(callee.group(1), [])) if callee else set()
        if m.group(3) == "slice" or ("slice" in inner and inner <= _SLICE_WORK):
            found.append(line[:300])
    return found


def assert_step_alone_and_in_a_loop(step, state, draws, protected) -> None:
    """Compile `step(state, inputs) -> (y, new state)` on GPU inputs twice and assert (1) jitted alone with
    its state donated, its entry computation is its kernels and plumbing (`work_besides_kernels`), and (2)
    in a `lax.scan` decode loop over the stacked `draws` (a list of inputs) with the state carried and
    donated, no step copies an array of the shape and dtype of one of `protected` (`per_step_copies`)
    nor an element of the carry (`carry_copies`)."""
    import jax

    hlo = jax.jit(step, donate_argnums=0).lower(state, draws[0]).compile().as_text()
    found = work_besides_kernels(hlo)
    assert not found, "work besides the kernels:\n" + "\n".join(found)
    xs = jax.tree.map(lambda *a: jnp.stack(a), *draws)
    loop = jax.jit(lambda s, xs: jax.lax.scan(lambda c, inp: step(c, inp)[::-1], s, xs), donate_argnums=0)
    hlo = loop.lower(state, xs).compile().as_text()
    copies = per_step_copies(hlo, protected) + carry_copies(hlo)
    assert not copies, "per-step copies of the state:\n" + "\n".join(copies)
