"""A self-check of the ReplaySSM ops: `python -m replayssm_jax.demo`.

Decodes random inputs through one Mamba-2 and one Gated DeltaNet layer with
the standard state and with ReplaySSM (several buffer lengths, both routes),
runs a speculative verify / commit round, and prints, for each check, the
largest difference from the standard recurrence. Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from replayssm_jax import ops

TOLERANCE = 1e-4  # float32, relative to max |standard output|


def _mamba2_layer(key, batch, nheads=8, head_dim=24, d_state=16, n_groups=2):
    k = jax.random.split(key, 4)
    params = dict(
        A=-jnp.exp(jax.random.uniform(k[0], (nheads,), minval=-1.0, maxval=0.5)),
        D=jax.random.normal(k[1], (nheads,)),
        dt_bias=jax.random.normal(k[2], (nheads,)) - 1.0,
    )
    state = 0.5 * jax.random.normal(k[3], (batch, nheads, head_dim, d_state))

    def draw(key, T):
        k = jax.random.split(key, 5)
        return dict(
            x=jax.random.normal(k[0], (batch, T, nheads, head_dim)),
            dt=jax.random.normal(k[1], (batch, T, nheads)),
            B=jax.random.normal(k[2], (batch, T, n_groups, d_state)),
            C=jax.random.normal(k[3], (batch, T, n_groups, d_state)),
            z=jax.random.normal(k[4], (batch, T, nheads, head_dim)),
        )

    return dict(
        name=f"Mamba-2 (H={nheads}, P={head_dim}, N={d_state}, G={n_groups})",
        state=state,
        draw=draw,
        step=lambda s, inp, **kw: ops.mamba2_step(s, **inp, **params, **kw),
        init=lambda s, L: ops.mamba2_replay_init(s, L, n_groups),
        replay_step=lambda rs, inp, **kw: ops.mamba2_replay_step(rs, **inp, **params, **kw),
        verify=lambda rs, win, **kw: ops.mamba2_replay_verify(rs, **win, **params, **kw),
        materialize=lambda rs, **kw: ops.mamba2_replay_materialize(rs, params["A"], **kw),
    )


def _gdn_layer(key, batch, num_k_heads=2, num_v_heads=4, head_k_dim=32, head_v_dim=24):
    state = 0.5 * jax.random.normal(key, (batch, num_v_heads, head_v_dim, head_k_dim))

    def draw(key, T):
        k = jax.random.split(key, 5)
        return dict(
            q=jax.random.normal(k[0], (batch, T, num_k_heads, head_k_dim)),
            k=jax.random.normal(k[1], (batch, T, num_k_heads, head_k_dim)),
            v=jax.random.normal(k[2], (batch, T, num_v_heads, head_v_dim)),
            g=-jnp.exp(jax.random.normal(k[3], (batch, T, num_v_heads)) - 1.0),
            beta=jax.nn.sigmoid(jax.random.normal(k[4], (batch, T, num_v_heads))),
        )

    return dict(
        name=f"Gated DeltaNet (H={num_k_heads}, HV={num_v_heads}, K={head_k_dim}, V={head_v_dim})",
        state=state,
        draw=draw,
        step=lambda s, inp, **kw: ops.gdn_step(s, **inp, **kw),
        init=lambda s, L: ops.gdn_replay_init(s, L, num_k_heads),
        replay_step=lambda rs, inp, **kw: ops.gdn_replay_step(rs, **inp, **kw),
        verify=lambda rs, win, **kw: ops.gdn_replay_verify(rs, **win, **kw),
        materialize=lambda rs, **kw: ops.gdn_replay_materialize(rs, **kw),
    )


def _scan(step_fn, carry, seq):
    """Run step_fn over the seqlen axis of `seq` under lax.scan."""

    def body(carry, inp):
        y, carry = step_fn(carry, inp)
        return carry, y

    carry, ys = jax.lax.scan(body, carry, {k: jnp.swapaxes(v, 0, 1) for k, v in seq.items()})
    return jnp.swapaxes(ys, 0, 1), carry


def _rel_err(a, b) -> float:
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(jnp.max(jnp.abs(b)), 1e-30))


def check_layer(layer, key, backend):
    """Yield (check, relative error) pairs for one layer type."""
    kw = dict(backend=backend)
    for L in (1, 4, 16):
        steps = 3 * L + 1
        seq = layer["draw"](jax.random.fold_in(key, L), steps)
        y_std, s_std = jax.jit(lambda s, q: _scan(lambda c, i: layer["step"](c, i, **kw), s, q))(layer["state"], seq)
        for route in ("output", "state"):
            run = jax.jit(lambda rs, q, route=route: _scan(lambda c, i: layer["replay_step"](c, i, route=route, **kw), rs, q))
            y_rep, rs = run(layer["init"](layer["state"], L), seq)
            yield f"L={L:2d} route={route:6s} {steps:2d} steps: outputs", _rel_err(y_rep, y_std)
            yield f"L={L:2d} route={route:6s} {steps:2d} steps: state", _rel_err(layer["materialize"](rs, **kw), s_std)
    L, W = 8, 5
    seq = layer["draw"](jax.random.fold_in(key, 99), 3 + W)
    y_std, _ = _scan(lambda c, i: layer["step"](c, i, **kw), layer["state"], seq)
    rs = layer["init"](layer["state"], L)
    _, rs = _scan(lambda c, i: layer["replay_step"](c, i, **kw), rs, {k: v[:, :3] for k, v in seq.items()})
    y_win, rs = layer["verify"](rs, {k: v[:, 3:] for k, v in seq.items()}, **kw)
    yield f"verify W={W} after 3 steps: outputs", _rel_err(y_win, y_std[:, 3:])
    rs = ops.replay_commit(rs, jnp.full((rs.batch,), 2, jnp.int32))
    _, s_two = _scan(lambda c, i: layer["step"](c, i, **kw), layer["state"], {k: v[:, :5] for k, v in seq.items()})
    yield "commit 2 of 5: state", _rel_err(layer["materialize"](rs, **kw), s_two)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=ops.BACKENDS, default=None, help="default: pallas on GPU, xla on CPU")
    parser.add_argument("--batch", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    backend = ops.resolve_backend(args.backend)
    key = jax.random.key(args.seed)
    print(f"replayssm-jax self-check: backend={backend}, device={jax.devices()[0].device_kind}, batch={args.batch}")
    failures = 0
    for layer in (_mamba2_layer(key, args.batch), _gdn_layer(jax.random.fold_in(key, 1), args.batch)):
        print(f"\n{layer['name']}: ReplaySSM vs the standard recurrence (max relative difference)")
        for check, err in check_layer(layer, key, backend):
            ok = np.isfinite(err) and err <= TOLERANCE
            failures += not ok
            print(f"  {check:42s} {err:9.2e}  {'ok' if ok else 'FAIL'}")
    print(f"\n{'all checks passed' if not failures else f'{failures} checks FAILED'} (tolerance {TOLERANCE:g})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
