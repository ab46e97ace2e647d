"""The jaxpr of every Pallas kernel variant the tests build, as text, for a
before/after comparison of a refactoring that must not change the kernels.

    python tests/kernel_jaxprs.py --out jaxprs.json          # write
    python tests/kernel_jaxprs.py --compare jaxprs.json      # exit 1 on any difference

A variant that the compared snapshot lacks is reported as new, not as a
difference; one that it has and this tree lacks is missing (a difference).

Variants: both layers; the standard step; the replay step on the output,
state, direct and deferred routes; the verify window (W = 2 and 4); f32 and bf16
states (f32 and bf16 buffers); L = 4 and 16; batch 1 (one launch: fused
flush) and 64 (replay kernel plus flush launch); the realistic head shapes
of the benchmarks and a small awkward one. Only the public ops
(backend="interpret") are called, so the same script runs on any tree that
has them. Inputs are abstract (`jax.ShapeDtypeStruct`): nothing is computed
or allocated.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys

import jax
import jax.extend
import jax.numpy as jnp

# The checkout this script is in comes after the path's own entries: run as
# `python tests/kernel_jaxprs.py`, it measures its own tree (and not an
# installed package found only by its import hook, such as an editable
# install of another checkout); a tree put first on PYTHONPATH still wins.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from replayssm_jax import ops  # noqa: E402

f32, bf16 = jnp.float32, jnp.bfloat16
S = jax.ShapeDtypeStruct

# name: (batch sizes, GDN (H, HV, K, V) or Mamba-2 (H, P, N, G))
GDN_SHAPES = {"qwen35": (16, 32, 128, 128), "awkward": (2, 4, 20, 24)}
MAMBA2_SHAPES = {"nemotron": (96, 80, 128, 8), "awkward": (4, 24, 16, 2)}
BATCHES = (1, 64)
LENGTHS = (4, 16)
ROUTES = ("output", "state", "direct", "deferred")
WINDOWS = (2, 4)  # verify windows
STATE_DTYPES = {"f32": (f32, f32), "bf16": (bf16, bf16)}  # (state, buffer)


def _gdn(batch, shape, state_dtype, buffer_dtype, L, route, W=None):
    H, HV, K, V = shape
    x = bf16
    lead = (batch,) if W is None else (batch, W)
    q = S((*lead, H, K), x)
    v = S((*lead, HV, V), x)
    gb = S((*lead, HV), f32)
    state = S((batch, HV, V, K), state_dtype)
    if L is None:
        return jax.make_jaxpr(lambda s, q, k, v, g, b: ops.gdn_step(s, q, k, v, g, b, backend="interpret"))(
            state, q, q, v, gb, gb)

    def step(ck, q, k, v, g, b):
        rs = ops.gdn_replay_init(ck, L, H, buffer_dtype=buffer_dtype)
        if W is not None:
            return ops.gdn_replay_verify(rs, q, k, v, g, b, backend="interpret")
        return ops.gdn_replay_step(rs, q, k, v, g, b, route=route, backend="interpret")

    return jax.make_jaxpr(step)(state, q, q, v, gb, gb)


def _mamba2(batch, shape, state_dtype, buffer_dtype, L, route, W=None):
    H, P, N, G = shape
    lead = (batch,) if W is None else (batch, W)
    x = S((*lead, H, P), bf16)
    dt = S((*lead, H), bf16)
    B = S((*lead, G, N), bf16)
    A = S((H,), f32)
    state = S((batch, H, P, N), state_dtype)
    if L is None:
        return jax.make_jaxpr(lambda s, x, dt, A, B, C, D, z, db: ops.mamba2_step(
            s, x, dt, A, B, C, D=D, z=z, dt_bias=db, backend="interpret"))(state, x, dt, A, B, B, A, x, A)

    def step(ck, x, dt, A, B, C, D, z, db):
        rs = ops.mamba2_replay_init(ck, L, G, buffer_dtype=buffer_dtype)
        if W is not None:
            return ops.mamba2_replay_verify(rs, x, dt, A, B, C, D=D, z=z, dt_bias=db, backend="interpret")
        return ops.mamba2_replay_step(rs, x, dt, A, B, C, D=D, z=z, dt_bias=db, route=route, backend="interpret")

    return jax.make_jaxpr(step)(state, x, dt, A, B, B, A, x, A)


def variants():
    """Yield (name, build, args): build(*args) is the ClosedJaxpr."""
    for layer, shapes, build in (("gdn", GDN_SHAPES, _gdn), ("mamba2", MAMBA2_SHAPES, _mamba2)):
        for sname, shape in shapes.items():
            for batch in BATCHES:
                for dname, (sd, bd) in STATE_DTYPES.items():
                    yield (f"{layer}-{sname}-b{batch}-{dname}-standard",
                           build, (batch, shape, sd, bd, None, None))
                    for L in LENGTHS:
                        for route in ROUTES:
                            yield (f"{layer}-{sname}-b{batch}-{dname}-L{L}-{route}",
                                   build, (batch, shape, sd, bd, L, route))
                        for W in WINDOWS:
                            yield (f"{layer}-{sname}-b{batch}-{dname}-L{L}-verify-W{W}",
                                   build, (batch, shape, sd, bd, L, None, W))


def _pallas_texts(jaxpr) -> list[str]:
    """The text of every pallas_call equation, nested jaxprs included, in order."""
    out = []

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "pallas_call":
                out.append(str(eqn))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                walk(sub)

    walk(jaxpr.jaxpr)
    return out


def _normalize(text: str) -> str:
    # Object addresses (e.g. of closed-over functions) differ from run to run.
    return re.sub(r" at 0x[0-9a-f]+", "", text)


def snapshot() -> dict[str, dict]:
    result = {}
    for name, build, args in variants():
        texts = [_normalize(t) for t in _pallas_texts(build(*args))]
        result[name] = {"launches": len(texts),
                        "sha256": [hashlib.sha256(t.encode()).hexdigest() for t in texts],
                        "text": texts}
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", help="write the snapshot (JSON) here")
    g.add_argument("--compare", help="compare with this snapshot; exit 1 on a difference")
    args = p.parse_args(argv)
    print(f"replayssm_jax of {os.path.dirname(os.path.dirname(os.path.abspath(ops.__file__)))}")
    snap = snapshot()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(snap, f)
        print(f"{len(snap)} variants, {sum(v['launches'] for v in snap.values())} launches -> {args.out}")
        return 0
    with open(args.compare) as f:
        base = json.load(f)
    new = sorted(set(snap) - set(base))  # variants the snapshot predates: reported, not a difference
    bad = [n for n in sorted(set(base) | set(snap))
           if n not in new and (n not in snap or base[n]["sha256"] != snap[n]["sha256"])]
    for n in new:
        print(f"NEW: {n}")
    for n in bad:
        print(f"DIFFERS: {n}" if n in snap else f"MISSING: {n}")
    print(f"{len(new)} new variants (not in the snapshot)")
    print(f"{len(snap) - len(new)} variants compared, {len(bad)} differ")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
