"""Float64 NumPy loops: the literal recurrences, one batch row and head at a time.

These are the test oracle for the JAX reference; they share no code with it.
"""

from __future__ import annotations

import numpy as np


def softplus(x):
    return np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0.0)


def silu(x):
    return x / (1.0 + np.exp(-x))


def mamba2_step(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=True, dt_limit=(0.0, np.inf)):
    """One selective state update. state [b, H, P, N]; returns (y [b, H, P], new state)."""
    state, x, dt, A, B, C = (np.asarray(a, np.float64) for a in (state, x, dt, A, B, C))
    batch, H, P, N = state.shape
    G = B.shape[1]
    new = np.empty_like(state)
    y = np.empty((batch, H, P))
    for b in range(batch):
        for h in range(H):
            grp = h // (H // G)
            step = dt[b, h] + (0.0 if dt_bias is None else float(dt_bias[h]))
            if dt_softplus:
                step = softplus(step)
            step = min(max(step, dt_limit[0]), dt_limit[1])
            s = np.exp(step * A[h]) * state[b, h] + np.outer(step * x[b, h], B[b, grp])
            new[b, h] = s
            out = s @ C[b, grp]
            if D is not None:
                out = out + float(D[h]) * x[b, h]
            if z is not None:
                out = out * silu(np.asarray(z[b, h], np.float64))
            y[b, h] = out
    return y, new


def l2norm(x, eps=1e-6):
    return x / np.sqrt(np.sum(x * x) + eps)


def gdn_step(state, q, k, v, g, beta, scale=None, use_qk_l2norm=True):
    """One gated delta rule step. state [b, HV, V, K]; returns (o [b, HV, V], new state)."""
    state, q, k, v, g, beta = (np.asarray(a, np.float64) for a in (state, q, k, v, g, beta))
    batch, HV, V, K = state.shape
    H = q.shape[1]
    scale = K**-0.5 if scale is None else scale
    new = np.empty_like(state)
    o = np.empty((batch, HV, V))
    for b in range(batch):
        for h in range(HV):
            kh = h // (HV // H)
            qq, kk = q[b, kh], k[b, kh]
            if use_qk_l2norm:
                qq, kk = l2norm(qq), l2norm(kk)
            s = np.exp(g[b, h]) * state[b, h]
            d = beta[b, h] * (v[b, h] - s @ kk)
            s = s + np.outer(d, kk)
            new[b, h] = s
            o[b, h] = s @ (scale * qq)
    return o, new


def run_steps(step, state, seq):
    """The steps of a sequence or a verify window, one after the other.

    step(state, inputs) -> (output, new state) is one of the steps above
    with its parameters bound; `seq` maps each input's name to an array
    [batch, T, ...]. Returns (outputs [batch, T, ...], the state after the
    T steps). For a verify window from state S0, output t is the output of
    draft t given drafts 0..t-1 accepted.
    """
    T = len(next(iter(seq.values()))[0])
    ys = []
    for t in range(T):
        y, state = step(state, {name: np.asarray(a[:, t], np.float64) for name, a in seq.items()})
        ys.append(y)
    return np.stack(ys, axis=1), state
