"""A self-check of the ReplaySSM ops: `python -m replayssm_jax.demo`.

Decodes random inputs through one Mamba-2 and one Gated DeltaNet layer with
the standard state and with ReplaySSM (several buffer lengths, both routes),
runs a speculative verify / commit round, and prints, for each check, the
largest difference from the standard recurrence. Exits 1 if a check fails,
2 on a bad argument (one line on stderr).

`--backend` applies to the ops that have a Pallas kernel
(`replayssm_jax.ops.KERNEL_OPS`); the others (materialize) run the
"xla" reference on every backend, and the output says which ran where.
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
        ops=dict(step="mamba2_step", replay_step="mamba2_replay_step", verify="mamba2_replay_verify",
                 materialize="mamba2_replay_materialize"),
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
        ops=dict(step="gdn_step", replay_step="gdn_replay_step", verify="gdn_replay_verify",
                 materialize="gdn_replay_materialize"),
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


def op_backends(layer, backend: str) -> dict[str, str]:
    """role -> the backend its op runs on: `backend` for an op with a Pallas kernel, else "xla"."""
    return {role: backend if name in ops.KERNEL_OPS else "xla" for role, name in layer["ops"].items()}


def check_layer(layer, key, backend, buffer_lens=(1, 4, 16)):
    """Yield (check, relative error) pairs for one layer type."""
    kw = {role: dict(backend=b) for role, b in op_backends(layer, backend).items()}
    step, replay_step, verify, materialize = layer["step"], layer["replay_step"], layer["verify"], layer["materialize"]
    for L in buffer_lens:
        steps = 3 * L + 1
        seq = layer["draw"](jax.random.fold_in(key, L), steps)
        y_std, s_std = jax.jit(lambda s, q: _scan(lambda c, i: step(c, i, **kw["step"]), s, q))(layer["state"], seq)
        for route in ("output", "state"):
            run = jax.jit(lambda rs, q, route=route: _scan(
                lambda c, i: replay_step(c, i, route=route, **kw["replay_step"]), rs, q))
            y_rep, rs = run(layer["init"](layer["state"], L), seq)
            yield f"L={L:2d} route={route:6s} {steps:2d} steps: outputs", _rel_err(y_rep, y_std)
            s_rep = jax.jit(lambda rs: materialize(rs, **kw["materialize"]))(rs)
            yield f"L={L:2d} route={route:6s} {steps:2d} steps: state", _rel_err(s_rep, s_std)
    L, W = 8, 5

    @jax.jit
    def speculate(state, seq):
        """3 replay steps, a verify window of W, commit 2 of them; and the standard recurrence to compare."""
        y_std, _ = _scan(lambda c, i: step(c, i, **kw["step"]), state, seq)
        rs = layer["init"](state, L)
        _, rs = _scan(lambda c, i: replay_step(c, i, **kw["replay_step"]), rs, {k: v[:, :3] for k, v in seq.items()})
        y_win, rs = verify(rs, {k: v[:, 3:] for k, v in seq.items()}, **kw["verify"])
        rs = ops.replay_commit(rs, jnp.full((rs.batch,), 2, jnp.int32))
        _, s_two = _scan(lambda c, i: step(c, i, **kw["step"]), state, {k: v[:, :5] for k, v in seq.items()})
        return y_win, y_std[:, 3:], materialize(rs, **kw["materialize"]), s_two

    y_win, y_ref, s_commit, s_two = speculate(layer["state"], layer["draw"](jax.random.fold_in(key, 99), 3 + W))
    yield f"verify W={W} after 3 steps: outputs", _rel_err(y_win, y_ref)
    yield "commit 2 of 5: state", _rel_err(s_commit, s_two)


class UsageError(Exception):
    """A bad command-line argument: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _positive_ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers; got {text!r}")
    return values


def _parse(argv):
    parser = _Parser(prog="replayssm-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=ops.BACKENDS, default=None,
                        help="backend of the ops with a Pallas kernel (the others run 'xla'); "
                             "default: pallas on GPU, xla on CPU")
    parser.add_argument("--batch", type=int, default=3, help="sequences per check (>= 1)")
    parser.add_argument("--buffer-lens", type=_positive_ints, default=(1, 4, 16), metavar="L,L,...",
                        help="ReplaySSM buffer lengths to check (default: 1,4,16)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.batch < 1:
        raise UsageError(f"--batch must be a positive integer; got {args.batch}")
    try:
        args.backend = ops.resolve_backend(args.backend)
    except (ValueError, RuntimeError) as e:
        raise UsageError(f"--backend {args.backend}: {e}") from None
    for L in args.buffer_lens:
        try:
            ops.check_buffer_len(L, args.backend, name="--buffer-lens")
        except ValueError as e:
            raise UsageError(str(e)) from None
    return args


def main(argv=None) -> int:
    """Run the self-check; returns the exit status (0 passed, 1 a check failed, 2 a bad argument)."""
    try:
        args = _parse(argv)
    except UsageError as e:
        print(f"replayssm-demo: error: {e}", file=sys.stderr)
        return 2
    backend = args.backend
    key = jax.random.key(args.seed)
    print(f"replayssm-jax self-check: backend={backend}, device={jax.devices()[0].device_kind}, batch={args.batch}")
    failures = 0
    for layer in (_mamba2_layer(key, args.batch), _gdn_layer(jax.random.fold_in(key, 1), args.batch)):
        print(f"\n{layer['name']}: ReplaySSM vs the standard recurrence (max relative difference)")
        placed = op_backends(layer, backend)
        on_xla = [layer["ops"][role] for role, b in placed.items() if b != backend]
        if on_xla:
            print(f"  ({', '.join(on_xla)}: no Pallas kernel, run on the 'xla' reference)")
        for check, err in check_layer(layer, key, backend, args.buffer_lens):
            ok = np.isfinite(err) and err <= TOLERANCE
            failures += not ok
            print(f"  {check:42s} {err:9.2e}  {'ok' if ok else 'FAIL'}")
    print(f"\n{'all checks passed' if not failures else f'{failures} checks FAILED'} (tolerance {TOLERANCE:g})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
