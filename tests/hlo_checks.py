"""Inspection of optimized HLO: copies of protected arrays inside loop bodies.

A decode loop that updates its state in place compiles to a while loop whose
body (and the computations it calls) holds no `copy` / `copy-start` producing
an array of the state's shape and dtype.
"""

from __future__ import annotations

import re

import jax.numpy as jnp

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_CALLEE = re.compile(
    r"\b(?:body|condition|calls|to_apply|true_computation|false_computation|branch_computations)="
    r"\{?(%?[\w.\-]+(?:, %?[\w.\-]+)*)\}?"
)
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")
_HLO_DTYPE = {"float32": "f32", "bfloat16": "bf16", "int32": "s32"}
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


def per_step_copies(hlo: str, protected) -> list[str]:
    """Copies inside while-loop bodies (and everything they call) whose result
    has the shape and dtype of one of `protected` (arrays or ShapeDtypeStructs)."""
    comps = _computations(hlo)
    targets = {(_HLO_DTYPE[jnp.dtype(a.dtype).name], tuple(a.shape)) for a in protected}
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
    found = []
    for name in seen:
        for line in comps[name]:
            m = _COPY.search(line)
            if m and (m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)) in targets:
                found.append(f"{name}: {line[:160]}")
    return found
