"""Bad input: a clear error naming the argument, raised before any computation,
leaving the caller's state usable."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cases import GDNCase, Mamba2Case, assert_close
from replayssm_jax import kernels, ops, replay_commit


def with_(inp, **changes):
    return {**inp, **changes}


@pytest.fixture
def mamba(rng):
    case = Mamba2Case(rng, batch=2, nheads=4, head_dim=8, d_state=16, n_groups=2)
    return case, case.initial_state(), case.draw()


@pytest.fixture
def gdn(rng):
    case = GDNCase(rng, batch=2)
    return case, case.initial_state(), case.draw()


MAMBA2_STEP_ERRORS = [
    ("x rank", lambda i, r: with_(i, x=i["x"][0]), ValueError, "`x` must have shape [batch, nheads, head_dim] = (2, 4, 8); got (4, 8)"),
    ("B groups", lambda i, r: with_(i, B=r.normal(size=(2, 3, 16)).astype(np.float32)), ValueError, "nheads = 4 must be divisible by n_groups = B.shape[-2] = 3"),
    ("C shape", lambda i, r: with_(i, C=i["C"][:, :, :8]), ValueError, "`C` must have shape [batch, n_groups, d_state] = (2, 2, 16); got (2, 2, 8)"),
    ("B and C groups", lambda i, r: with_(i, B=r.normal(size=(2, 4, 16)).astype(np.float32)), ValueError, "`B` and `C` must have the same n_groups; got 4 and 2"),
    ("batch mismatch", lambda i, r: with_(i, dt=i["dt"][:1]), ValueError, "`dt` must have shape [batch, nheads] = (2, 4); got (1, 4)"),
    ("integer x", lambda i, r: with_(i, x=i["x"].astype(np.int32)), TypeError, "`x` must have a floating-point dtype; got int32"),
    ("list z", lambda i, r: with_(i, z=i["z"].tolist()), TypeError, "`z` must be an array; got list"),
]


@pytest.mark.parametrize("what, change, error, message", MAMBA2_STEP_ERRORS, ids=[e[0] for e in MAMBA2_STEP_ERRORS])
def test_mamba2_step_errors(mamba, rng, what, change, error, message):
    case, state, inp = mamba
    with pytest.raises(error) as info:
        case.step(state, change(inp, rng))
    assert message in str(info.value)


def test_mamba2_bad_params(mamba):
    case, state, inp = mamba
    with pytest.raises(ValueError, match=r"`A` must have shape \[nheads\] = \(4,\); got \(3,\)"):
        ops.mamba2_step(state, **inp, A=case.A[:3])
    with pytest.raises(ValueError, match="`dt_limit` must satisfy 0 <= low <= high"):
        ops.mamba2_step(state, **inp, A=case.A, dt_limit=(1.0, 0.5))
    with pytest.raises(TypeError, match=r"`state` must have dtype in \(float32, bfloat16\); got float16"):
        ops.mamba2_step(state.astype(np.float16), **inp, A=case.A)
    with pytest.raises(ValueError, match="`chunk_size` must be >= 1; got 0"):
        case.chunked(state, case.draw(5), chunk_size=0)


GDN_STEP_ERRORS = [
    ("HV not divisible", lambda i, r: with_(i, q=r.normal(size=(2, 3, 16)).astype(np.float32)), ValueError, "HV (value heads) = 4 must be divisible by H (key heads) = q.shape[-2] = 3"),
    ("k heads", lambda i, r: with_(i, k=i["k"][:, :1]), ValueError, "`q` and `k` must have the same H (key heads); got 2 and 1"),
    ("k shape", lambda i, r: with_(i, k=i["k"][:, :, :8]), ValueError, "`k` must have shape [batch, H, K] = (2, 2, 16); got (2, 2, 8)"),
    ("v rank", lambda i, r: with_(i, v=i["v"][None]), ValueError, "`v` must have shape [batch, HV, V]"),
    ("integer beta", lambda i, r: with_(i, beta=np.ones((2, 4), np.int64)), TypeError, "`beta` must have a floating-point dtype"),
    ("g batch", lambda i, r: with_(i, g=i["g"][:1]), ValueError, "`g` must have shape [batch, HV] = (2, 4); got (1, 4)"),
]


@pytest.mark.parametrize("what, change, error, message", GDN_STEP_ERRORS, ids=[e[0] for e in GDN_STEP_ERRORS])
def test_gdn_step_errors(gdn, rng, what, change, error, message):
    case, state, inp = gdn
    with pytest.raises(error) as info:
        case.step(state, change(inp, rng))
    assert message in str(info.value)


@pytest.mark.parametrize("name", ["mamba", "gdn"])
def test_replay_errors_leave_state_usable(name, request):
    case, state, inp = request.getfixturevalue(name)
    rs = case.replay_init(state, 4)
    _, rs = case.replay_step(rs, inp)
    before = [np.asarray(a).copy() for a in (rs.checkpoint, rs.cursor)]

    bad_inputs = {key: value[:1] for key, value in inp.items()}  # wrong batch
    with pytest.raises(ValueError, match="must have shape"):
        case.replay_step(rs, bad_inputs)
    with pytest.raises(ValueError,
                       match="`route` must be one of 'output', 'state', 'direct', 'deferred', 'auto', 'append'; got 'fast'"):
        case.replay_step(rs, inp, route="fast")
    # Heads that do not divide the state's: the error names the state's count, not the divisibility.
    grouped, message = ("B", "`B` must have n_groups = 2 (the state's); got 3") if name == "mamba" else \
        ("q", "`q` and `k` must have H = 2 key heads (the state's); got 3")
    with pytest.raises(ValueError, match=re.escape(message)):
        case.replay_step(rs, with_(inp, **{grouped: np.ones((2, 3, inp[grouped].shape[-1]), np.float32)}))
    # Its partner (C, or k) with another count than the state's / q's: named, with both counts.
    partner, message = ("C", "`C` must have n_groups = 2 (the state's); got 3") if name == "mamba" else \
        ("k", "`q` and `k` must have the same H (key heads); got 2 and 3")
    with pytest.raises(ValueError, match=re.escape(message)):
        case.replay_step(rs, with_(inp, **{partner: np.ones((2, 3, inp[partner].shape[-1]), np.float32)}))
    with pytest.raises(ValueError, match=r"the window length W = .* must be in \[1, L = 4\]; got 5"):
        case.verify(rs, case.draw(5))
    with pytest.raises(ValueError, match="no pending verify window"):
        replay_commit(rs, np.zeros(2, np.int32))

    _, pending = case.verify(rs, case.draw(3))
    with pytest.raises(ValueError, match=r"pending verify window \(W = 3\); call replay_commit first"):
        case.replay_step(pending, inp)
    with pytest.raises(ValueError, match=r"`num_accepted` must be in \[0, 3\] for every row; got \[1, 4\]"):
        replay_commit(pending, np.array([1, 4], np.int32))
    with pytest.raises(ValueError, match=r"`num_accepted` must be in \[0, 3\] for every row; got \[-1, 0\]"):
        replay_commit(pending, np.array([-1, 0], np.int32))
    with pytest.raises(ValueError, match=r"`num_accepted` must have shape \[batch\] = \(2,\); got \(3,\)"):
        replay_commit(pending, np.zeros(3, np.int32))
    with pytest.raises(TypeError, match="`num_accepted` must have an integer dtype; got float32"):
        replay_commit(pending, np.zeros(2, np.float32))
    for cursor in ([0, 5], [-1, 0]):
        with pytest.raises(ValueError, match=r"`state.cursor` must be in \[0, 4\] \(the buffer length\) for every row"):
            case.replay_step(rs.replace(cursor=jnp.asarray(cursor, jnp.int32)), inp)
    # Buffers of the wrong dtype (a silent truncation otherwise), a cursor that is not an array.
    record, decay = ("x", "dt") if name == "mamba" else ("d", "g")
    with pytest.raises(TypeError, match=f"`state.{record}` must have a floating-point dtype; got int32"):
        case.replay_step(rs.replace(**{record: getattr(rs, record).astype(jnp.int32)}), inp)
    with pytest.raises(TypeError, match=rf"`state.{decay}` must have dtype in \(float32\); got bfloat16"):
        case.replay_step(rs.replace(**{decay: getattr(rs, decay).astype(jnp.bfloat16)}), inp)
    for cursor, got in (([0, 0], "list [0, 0]"), (0, "int 0")):
        with pytest.raises(TypeError, match=re.escape(f"`state.cursor` must be an int32 array of shape [batch] = (2,); got {got}")):
            case.replay_step(rs.replace(cursor=cursor), inp)
    # A checkpoint of the wrong rank; buffers that disagree on L (every buffer is named, not one blamed).
    dims = "batch, nheads, head_dim, d_state" if name == "mamba" else "batch, HV, V, K"
    with pytest.raises(ValueError, match=re.escape(f"`state.checkpoint` must have rank 4 [{dims}]; got shape")):
        case.replay_step(rs.replace(checkpoint=rs.checkpoint[0]), inp)
    longer = jnp.concatenate([getattr(rs, decay), getattr(rs, decay)[:, :, :1]], axis=2)
    with pytest.raises(ValueError, match=r"`state`'s buffers must have the same number of slots L \(axis 2\); got "
                                         rf"state\.{record} \(2, 4, 4, \d+\), .*state\.{decay} \(2, \d+, 5\)"):
        case.replay_step(rs.replace(**{decay: longer}), inp)
    with pytest.raises(ValueError, match=re.escape(f"`state.{decay}` must have rank 3 [batch, ")):
        case.replay_step(rs.replace(**{decay: getattr(rs, decay)[..., None]}), inp)
    # A checkpoint whose last axis disagrees with the key buffer's: the message says where the shape comes from.
    key = "B" if name == "mamba" else "k"
    short = rs.checkpoint[..., :-2]
    source = f"(from state.checkpoint's shape {tuple(short.shape)} and L = 4)"
    with pytest.raises(ValueError, match=re.escape(f"`state.{key}` must have shape [") + ".*" + re.escape(source)):
        case.replay_step(rs.replace(checkpoint=short), inp)

    # The state that saw all these failures is intact and still decodes.
    np.testing.assert_array_equal(rs.checkpoint, before[0])
    np.testing.assert_array_equal(rs.cursor, before[1])
    expected = case.materialize(rs)
    y, after = case.replay_step(rs, inp)
    y_ref, _ = case.oracle_step(np.asarray(expected, np.float64), inp)
    assert_close(y, y_ref, jnp.float32, "output after the failed calls")


@pytest.mark.parametrize("name", ["mamba", "gdn"])
def test_init_errors(name, request):
    case, state, _ = request.getfixturevalue(name)
    with pytest.raises(ValueError, match="`buffer_len` must be >= 1; got 0"):
        case.replay_init(state, 0)
    with pytest.raises(TypeError, match="`buffer_len` must be an int; got float"):
        case.replay_init(state, 4.0)
    with pytest.raises(TypeError, match="`checkpoint` must have a floating-point dtype; got int32"):
        case.replay_init(state.astype(np.int32), 4)
    with pytest.raises(ValueError, match="`checkpoint` must have rank 4"):
        case.replay_init(state[0], 4)
    with pytest.raises(TypeError, match="`buffer_dtype` must be a floating dtype; got int8"):
        case.replay_init(state, 4, buffer_dtype=np.int8)


def test_init_divisibility(rng):
    with pytest.raises(ValueError, match="nheads = 4 must be divisible by n_groups = 3"):
        ops.mamba2_replay_init(np.ones((1, 4, 8, 16), np.float32), 4, n_groups=3)
    with pytest.raises(ValueError, match=r"HV \(value heads\) = 4 must be divisible by H \(key heads\) = 3"):
        ops.gdn_replay_init(np.ones((1, 4, 8, 16), np.float32), 4, num_k_heads=3)


def test_state_type_is_checked(mamba, gdn):
    (mcase, mstate, _), (gcase, _, ginp) = mamba, gdn
    with pytest.raises(TypeError, match="`state` must be a GDNReplayState; got Mamba2ReplayState"):
        gcase.replay_step(mcase.replay_init(mstate, 2), ginp)


def test_unknown_backend(mamba):
    case, state, inp = mamba
    with pytest.raises(ValueError, match=r"`backend` must be one of \('pallas', 'interpret', 'xla'\) or None; got 'cuda'"):
        ops.mamba2_step(state, **inp, A=case.A, backend="cuda")


def test_check_buffer_len_answers_for_the_kernels_on_any_machine():
    """The kernels' limit on L is a property of the backend asked for, not of this machine: a named
    "pallas" gets the L error on a CPU too; "xla" has no limit; a bad backend name is still named."""
    limit = kernels.MAX_BUFFER_LEN
    for backend in ("pallas", "interpret"):
        with pytest.raises(ValueError, match=f"`buffer_len` must be <= {limit} with backend '{backend}'"):
            ops.check_buffer_len(limit + 1, backend)
    ops.check_buffer_len(limit, "interpret")
    ops.check_buffer_len(limit + 1, "xla")
    with pytest.raises(ValueError, match="`backend` must be one of"):
        ops.check_buffer_len(4, "cuda")
    if jax.default_backend() != "gpu":
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            ops.check_buffer_len(limit, "pallas")


def test_config_needs_a_kernel_backend(mamba):
    case, state, inp = mamba
    from replayssm_jax.kernels import StepConfig

    with pytest.raises(TypeError, match="`config` tunes the Pallas kernels; the 'xla' backend takes none"):
        ops.mamba2_step(state, **inp, A=case.A, backend="xla", config=StepConfig(block_v=8))
    with pytest.raises(TypeError, match="`config` must be a replayssm_jax.kernels.StepConfig or None for the "
                                        "standard step; got dict"):
        ops.mamba2_step(state, **inp, A=case.A, backend="interpret", config={"block_v": 8})
    # config=None (the default) is accepted by every backend, also said explicitly
    y_default, _ = ops.mamba2_step(state, **inp, A=case.A, backend="xla")
    y_none, _ = ops.mamba2_step(state, **inp, A=case.A, backend="xla", config=None)
    np.testing.assert_array_equal(np.asarray(y_none), np.asarray(y_default))
    rs = case.replay_init(state, 4)
    ops.mamba2_replay_materialize(rs, case.A, config=None)
    with pytest.raises(TypeError, match="has no Pallas kernel: it runs the reference on every backend"):
        ops.mamba2_replay_materialize(rs, case.A, config=StepConfig(block_v=8))


def test_flush_with_pending_window_is_refused(mamba, gdn):
    for case, state, _ in (mamba, gdn):
        rs = case.replay_init(state, 4)
        _, pending = case.verify(rs, case.draw(2))
        with pytest.raises(ValueError, match=r"pending verify window \(W = 2\); call replay_commit first"):
            case.flush(pending)
        # materialize is allowed: the state at the window's start
        assert_close(case.materialize(pending), case.materialize(rs), jnp.float32, "state at the window start")


def test_value_checks(mamba, gdn):
    case, state, inp = mamba
    positive = np.full(4, 0.5, np.float32)
    with pytest.raises(ValueError, match=r"`A` must be negative \(A = -exp\(A_log\)\); got max 0.5"):
        ops.mamba2_step(state, **inp, A=positive)
    for op in (ops.mamba2_replay_materialize, ops.mamba2_replay_flush):
        with pytest.raises(ValueError, match=r"`A` must be negative \(A = -exp\(A_log\)\); got max 0.5"):
            op(case.replay_init(state, 4), positive)
    with pytest.raises(ValueError, match=r"`state` must have no empty axis \[batch, nheads, head_dim, d_state\]; got shape \(2, 4, 0, 16\)"):
        ops.mamba2_step(state[:, :, :0], **{**inp, "x": inp["x"][:, :, :0], "z": inp["z"][:, :, :0]}, A=case.A)
    rs = case.replay_init(state, 4)
    _, pending = case.verify(rs, case.draw(3))
    with pytest.raises(ValueError, match=r"`num_accepted` must be in \[0, 3\] for every row; got \[4294967297, 0\]"):
        replay_commit(pending, np.array([2**32 + 1, 0], np.int64))
    gcase, gstate, ginp = gdn
    y, _ = ops.gdn_step(gstate, **ginp, scale=np.float32(0.25))  # NumPy scalars are fine
    with pytest.raises(TypeError, match=re.escape("`scale` must be a finite real number (a concrete scalar) or None; got 'big'")):
        ops.gdn_step(gstate, **ginp, scale="big")
    for scale in (jnp.float32(0.25), np.asarray(0.25)):  # concrete 0-d arrays are scalars too
        np.testing.assert_array_equal(ops.gdn_step(gstate, **ginp, scale=scale)[0], y)
    with pytest.raises(TypeError, match=re.escape("`use_qk_l2norm` must be a bool; got str 'no'")):
        ops.gdn_step(gstate, **ginp, use_qk_l2norm="no")


def _gdn_ops_taking(field, case, state, inp, rs):
    """Every GDN op that takes `field` (g or beta, [batch, HV]), as a function of that input: the step, the
    replay step, a verify window of 2 and the chunked form (the window's steps both take it)."""
    window = case.draw(2)
    both = lambda x: np.stack([x, x], axis=1)  # noqa: E731
    return {
        "gdn_step": lambda x: ops.gdn_step(state, **with_(inp, **{field: x})),
        "gdn_replay_step": lambda x: ops.gdn_replay_step(rs, **with_(inp, **{field: x})),
        "gdn_replay_verify": lambda x: ops.gdn_replay_verify(rs, **with_(window, **{field: both(x)})),
        "gdn_chunked": lambda x: case.chunked(state, with_(window, **{field: both(x)}), chunk_size=2),
    }


def test_gdn_refuses_an_amplifying_gate(gdn):
    """g is a log decay (g <= 0, exp(g) <= 1), as Mamba-2's A < 0: a concrete g > 0 is refused by every op
    that takes g, naming it; g = 0 and g = -inf are allowed, and a traced g is not checked (inside jit only
    shapes and dtypes are)."""
    case, state, inp = gdn
    amplifying = inp["g"].copy()
    amplifying[1, 2] = 0.5
    message = r"`g` must be <= 0 \(a log decay: exp\(g\) > 1 would amplify the state\); got max 0.5"
    rs = case.replay_init(state, 4)
    calls = _gdn_ops_taking("g", case, state, inp, rs)
    allowed = inp["g"].copy()
    allowed[0, 0], allowed[1, 1] = 0.0, -np.inf
    for name, call in calls.items():
        with pytest.raises(ValueError, match=message):
            call(amplifying)
        assert np.isfinite(np.asarray(call(allowed)[0])).all(), name
    assert jax.jit(lambda g: ops.gdn_step(state, **with_(inp, g=g))[0])(amplifying).shape == (2, 4, 24)
    np.testing.assert_array_equal(rs.cursor, 0)  # the refused calls left the state as it was


def test_gdn_refuses_a_write_strength_outside_0_2(gdn):
    """beta is the delta rule's write strength: in [0, 2] the transition I - beta k k^T does not amplify the
    state along a unit k. A concrete beta outside is refused by every op that takes it, naming it; 0, 2 and
    the sigmoid range are allowed, and a traced beta is not checked."""
    case, state, inp = gdn
    rs = case.replay_init(state, 4)
    calls = _gdn_ops_taking("beta", case, state, inp, rs)
    for bad, shown in ((2.5, r"max 2\.5"), (-0.25, r"min -0\.25")):
        beta = inp["beta"].copy()
        beta[1, 2] = bad
        for name, call in calls.items():
            with pytest.raises(ValueError, match=r"`beta` must be in \[0, 2\] \(a delta-rule write strength.*" + shown):
                call(beta)
    allowed = inp["beta"].copy()
    allowed[0, 0], allowed[1, 1] = 0.0, 2.0
    for name, call in calls.items():
        assert np.isfinite(np.asarray(call(allowed)[0])).all(), name
    assert jax.jit(lambda b: ops.gdn_step(state, **with_(inp, beta=b))[0])(inp["beta"] + 5).shape == (2, 4, 24)
    np.testing.assert_array_equal(rs.cursor, 0)  # the refused calls left the state as it was


def test_transposed_states_are_named(rng):
    """A state with its last two axes swapped (K != V): transformers' GDN
    cache is [batch, HV, K, V]. The error names the state, its expected
    value-major layout and the transpose, not `q` (or `x`) for a shape the
    state implies."""
    gcase = GDNCase(rng, batch=2)  # K = 16, V = 24
    inp = gcase.draw()
    cache = np.swapaxes(gcase.initial_state(), -1, -2)  # [batch, HV, K, V]
    expected = ("`state` must have shape [batch, HV, V, K] = (2, 4, 24, 16) (V of `v`, K of `q`); got (2, 4, 16, 24), "
                "its last two axes swapped")
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        ops.gdn_step(cache, **inp)
    assert "transformers' cache is [batch, HV, K, V]: transpose its last two axes" in str(info.value)
    with pytest.raises(ValueError, match=re.escape("`state` must have shape [batch, HV, V, K] = (2, 4, 24, 16) "
                                                   "(V of `v`, K of `k`); got (2, 4, 16, 24)")):
        ops.gdn_chunked(cache, **gcase.draw(3))
    # gdn_replay_init cannot tell K from V; the first op that sees q and v names the checkpoint.
    rs = ops.gdn_replay_init(cache, 4, gcase.num_k_heads)
    checkpoint = "`state.checkpoint` must have shape [batch, HV, V, K] = (2, 4, 24, 16) (V of `v`, K of `q`)"
    with pytest.raises(ValueError, match=re.escape(checkpoint)):
        ops.gdn_replay_step(rs, **inp)
    with pytest.raises(ValueError, match=re.escape(checkpoint)):
        ops.gdn_replay_verify(rs, **gcase.draw(2))

    mcase = Mamba2Case(rng, batch=2, nheads=4, head_dim=8, d_state=16, n_groups=2)
    minp = dict(mcase.draw(), A=mcase.A)
    swapped = np.swapaxes(mcase.initial_state(), -1, -2)  # [batch, nheads, d_state, head_dim]
    expected = ("`state` must have shape [batch, nheads, head_dim, d_state] = (2, 4, 8, 16) (head_dim of `x`, "
                "d_state of `B`); got (2, 4, 16, 8), its last two axes swapped")
    with pytest.raises(ValueError, match=re.escape(expected)):
        ops.mamba2_step(swapped, **minp)
    with pytest.raises(ValueError, match=re.escape(expected)):
        ops.mamba2_chunked(swapped, **mcase.draw(3), A=mcase.A)
    with pytest.raises(ValueError, match=re.escape("`state.checkpoint` must have shape [batch, nheads, head_dim, "
                                                   "d_state] = (2, 4, 8, 16)")):
        ops.mamba2_replay_step(ops.mamba2_replay_init(swapped, 4, 2), **minp)
    # A square head (K == V) cannot be told from its transpose: no layout error, the math runs.
    square = GDNCase(rng, batch=2, head_k_dim=8, head_v_dim=8)
    ops.gdn_step(np.swapaxes(square.initial_state(), -1, -2), **square.draw())


@pytest.mark.parametrize("layer", ["mamba", "gdn"])
def test_x64_runs_the_reference_and_refuses_the_kernels(layer, request):
    """With `jax_enable_x64` on, the replay ops on the XLA backend give the numbers (and dtypes) of x64 off
    (a state's slot indices and cursor stay int32); the kernel backends raise, naming the option, before
    running."""
    case, state, _ = request.getfixturevalue(layer)
    steps = [case.draw() for _ in range(5)]
    window = case.draw(2)

    def run():
        rs = case.replay_init(jnp.asarray(state), 3)
        ys = []
        for inp in steps:
            y, rs = case.replay_step(rs, inp, route="deferred")
            ys.append(y)
        y_window, pending = case.verify(rs, window)
        rs = replay_commit(pending, jnp.array([2, 1], jnp.int32))
        return ys + [y_window, rs.checkpoint, rs.cursor]

    expected = run()
    with jax.enable_x64(True):
        got = run()
        with pytest.raises(RuntimeError, match="do not run with `jax_enable_x64` on; turn it off, or pass "
                                               "backend='xla'"):
            case.replay_step(case.replay_init(jnp.asarray(state), 3), steps[0], backend="interpret")
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
