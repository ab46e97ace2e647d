"""`replayssm-demo` in-process (`demo.main(argv)`): the checks pass on the kernel and reference
backends, and bad arguments give one line on stderr and exit status 2."""

from __future__ import annotations

import jax
import pytest

from replayssm_jax import demo, ops


@pytest.mark.parametrize("backend", [pytest.param("interpret", marks=pytest.mark.slow), "xla"])
def test_demo_passes(backend, capsys):
    assert demo.main(["--backend", backend, "--batch", "1", "--buffer-lens", "2"]) == 0
    out = capsys.readouterr().out
    assert f"backend={backend}" in out and "all checks passed" in out and "FAIL" not in out
    assert out.count(" ok\n") == 2 * 6  # per layer: 2 routes x (outputs, state), verify, commit
    for layer in (demo._mamba2_layer(jax.random.key(0), 1), demo._gdn_layer(jax.random.key(0), 1)):
        no_kernel = [name for name in layer["ops"].values() if name not in ops.KERNEL_OPS]
        line = f"({', '.join(no_kernel)}: no Pallas kernel, run on the 'xla' reference)"
        assert (line in out) == (backend != "xla" and bool(no_kernel)), line


def test_op_backends_keep_ops_without_a_kernel_on_xla():
    layer = demo._gdn_layer(jax.random.key(0), 1)
    placed = demo.op_backends(layer, "interpret")
    for role, name in layer["ops"].items():
        assert placed[role] == ("interpret" if name in ops.KERNEL_OPS else "xla")
    assert placed["step"] == "interpret" and placed["replay_step"] == "interpret"


ARGV_ERRORS = [
    (["--batch", "0"], "--batch must be a positive integer; got 0"),
    (["--batch", "-2"], "--batch must be a positive integer; got -2"),
    (["--batch", "x"], "argument --batch: invalid int value: 'x'"),
    (["--buffer-lens", "4,0"], "argument --buffer-lens: expected comma-separated positive integers; got '4,0'"),
    (["--backend", "cuda"], "argument --backend: invalid choice: 'cuda'"),
    (["--backend", "interpret", "--buffer-lens", "4,65"],
     "`--buffer-lens` must be <= 64 with backend 'interpret' (the kernels' limit); got 65"),
]
if jax.default_backend() != "gpu":
    ARGV_ERRORS.append((["--backend", "pallas"], "--backend pallas: `backend='pallas'` needs a CUDA GPU"))


@pytest.mark.parametrize("argv, message", ARGV_ERRORS, ids=[" ".join(a) for a, _ in ARGV_ERRORS])
def test_bad_arguments_are_one_line_and_exit_2(argv, message, capsys):
    assert demo.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"replayssm-demo: error: {message}")
    assert captured.err.count("\n") == 1
