"""The benchmark scripts run end to end on the CPU in their check modes
(tiny shapes, interpret mode): their numbers mean nothing here, but a script
that no longer runs is caught before a GPU run finds out. Each script is
loaded with bench/ first on sys.path, as `python3 bench/x.py` runs it."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).parent.parent / "bench"

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")
SCRIPTS_IMPORTING_THE_PACKAGE = ["kernels", "e2e", "spec", "buffer_length", "bounds", "profile_step", "roofline",
                                 "serve"]


@pytest.fixture(autouse=True)
def bench_first_on_path(monkeypatch):
    """bench/ leads sys.path, as for a script run as `python3 bench/x.py` (its imports of each other need it)."""
    monkeypatch.syspath_prepend(str(BENCH))


def load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_bench_scripts_measure_the_tree_on_pythonpath(tmp_path):
    """A code tree put first on PYTHONPATH (to compare with this checkout) is the one the bench scripts
    import: they add the checkout at the end of sys.path, not in front of the tree (each script checked
    after its import, in one process)."""
    shutil.copytree(BENCH.parent / "replayssm_jax", tmp_path / "tree" / "replayssm_jax")
    tree, checkout = str(tmp_path / "tree"), str(BENCH.parent)
    code = "\n".join([
        "import importlib, sys",
        f"sys.path.insert(0, {str(BENCH)!r})",
        f"for script in {SCRIPTS_IMPORTING_THE_PACKAGE!r}:",
        "    importlib.import_module(script)",
        f"    assert {checkout!r} not in sys.path or sys.path.index({tree!r}) < sys.path.index({checkout!r}), script",
        "import replayssm_jax",
        "print(replayssm_jax.__file__)",
    ])
    env = dict(os.environ, PYTHONPATH=tree, JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == str(tmp_path / "tree" / "replayssm_jax" / "__init__.py")


def test_e2e_smoke(tmp_path, capsys):
    """The three kinds of mode: the standard state, ReplaySSM, ReplaySSM on the direct route ('Ld'); the
    same greedy tokens in each. With --ssm-state-dtype bfloat16: the states in bf16, half the f32 states'
    bytes per sequence (from shapes, --memory-only). The attention layers' decode steps on the decode
    attention kernel (--attention-backend, interpreted)."""
    out = tmp_path / "e2e.json"
    assert load("e2e").main(["--smoke", "--models", "nemotron_h_tiny", "--batches", "2", "--modes",
                             "standard,2,3d", "--ssm-state-dtype", "bfloat16", "--attention-backend", "interpret",
                             "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["meta"]["ssm_state_dtype"] == "bfloat16"
    assert result["meta"]["attention_backend"] == "interpret"
    rows = result["rows"]
    assert [r["mode"] for r in rows] == ["standard", "2", "3d"]
    assert all(r["tokens_per_s"] > 0 and r["identical_to_standard"] for r in rows)
    assert not any(r["lockstep"] for r in rows)  # the smoke's xla backend: Generator's default keeps it off
    # the GEMMs of the bound are the model's: the SSM ops' reference dots (xla) are the state term's
    assert len({(r["roofline"]["weights_gib"], r["roofline"]["gemm_tflop"]) for r in rows}) == 1, rows
    assert "nemotron_h_tiny" in capsys.readouterr().out
    assert load("e2e").main(["--smoke", "--models", "nemotron_h_tiny", "--memory-only", "--modes", "standard",
                             "--out", str(tmp_path / "new" / "e2e")]) == 0  # not .json: a folder, made
    assert (tmp_path / "new" / "e2e" / "e2e.json").is_file()
    per_seq = {}
    for dtype in ("float32", "bfloat16"):
        path = tmp_path / f"memory_{dtype}.json"
        assert load("e2e").main(["--smoke", "--models", "nemotron_h_tiny", "--memory-only", "--modes", "standard",
                                 "--ssm-state-dtype", dtype, "--out", str(path)]) == 0
        per_seq[dtype] = json.loads(path.read_text())["memory"][0]["cache_bytes_per_seq"]
    assert per_seq["bfloat16"] < per_seq["float32"], per_seq


def test_e2e_checkpoint_formats_and_memory_only(tmp_path, capsys):
    """--modes 'L:FORMAT' (the checkpoints' dtype and rounding) and --memory-only: bytes per sequence from
    shapes, smaller for each narrower checkpoint, the sequences in the budget from them."""
    e2e = load("e2e")
    assert e2e._mode("16d:int8sr") == e2e.Mode("replay", 16, "direct", "int8", "stochastic")
    assert e2e._mode("8:bf16") == e2e.Mode("replay", 8, "output", "bfloat16", "nearest")
    assert e2e._mode("16f") == e2e.Mode("replay", 16, "output", lockstep=False)  # the replay step's own flush
    assert e2e._mode("16").lockstep is None
    out = tmp_path / "memory.json"
    assert e2e.main(["--smoke", "--models", "qwen3_5_tiny", "--memory-only", "--modes", "standard,4,4:bf16,4:int8",
                     "--budget-gib", "1", "--out", str(out)]) == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["memory"]}
    f32, bf16, int8 = (rows[m]["cache_bytes_per_seq"] for m in ("4", "4:bf16", "4:int8"))
    assert f32 > bf16 > int8 > 0 and rows["standard"]["cache_bytes_per_seq"] > 0
    assert all(r["max_sequences"] == 2**30 // r["cache_bytes_per_seq"] for r in rows.values())
    assert "4:int8" in capsys.readouterr().out
    folder = tmp_path / "results"  # --out a folder: e2e.json in it
    folder.mkdir()
    assert e2e.main(["--smoke", "--models", "qwen3_5_tiny", "--memory-only", "--modes", "4", "--out", str(folder)]) == 0
    assert json.loads((folder / "e2e.json").read_text())["memory"][0]["mode"] == "4"
    new = tmp_path / "new"  # a folder that does not exist yet, named with a trailing separator
    assert e2e.main(["--smoke", "--models", "qwen3_5_tiny", "--memory-only", "--modes", "4", "--out", f"{new}/"]) == 0
    assert (new / "e2e.json").is_file()


def test_e2e_buffer_dtype(tmp_path):
    """--buffer-dtype: the ReplaySSM records' dtype for every layer. Qwen3.5's exact records (its GDN layers')
    are f32, so bfloat16 records take fewer bytes a sequence, float32 the same, the standard state no other."""
    e2e = load("e2e")
    per_seq = {}
    for dtype in ("exact", "bfloat16", "float32"):
        out = tmp_path / f"{dtype}.json"
        assert e2e.main(["--smoke", "--models", "qwen3_5_tiny", "--memory-only", "--modes", "standard,4",
                         "--buffer-dtype", dtype, "--out", str(out)]) == 0
        data = json.loads(out.read_text())
        assert data["meta"]["buffer_dtype"] == dtype
        per_seq[dtype] = {r["mode"]: r["cache_bytes_per_seq"] for r in data["memory"]}
    assert per_seq["bfloat16"]["4"] < per_seq["exact"]["4"] == per_seq["float32"]["4"]
    assert per_seq["bfloat16"]["standard"] == per_seq["exact"]["standard"] == per_seq["float32"]["standard"]


@pytest.mark.parametrize("mode", ["16x", "d", "0", "-4", "16dd", "16fd", "f", "\u00b2", "16:int4", "16:"])
def test_e2e_rejects_bad_modes(mode, tmp_path, capsys):
    with pytest.raises(SystemExit):
        load("e2e").main(["--smoke", "--modes", f"standard,{mode}", "--out", str(tmp_path / "e2e.json")])
    expected = f"--modes: mode {mode!r}: expected 'standard', a buffer length L >= 1, or L then 'd'"
    assert expected in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran


@pytest.mark.parametrize("args, expected", [
    (["--batches", "-2"], "argument --batches: expected integers >= 1; got '-2'"),
    (["--batches", "1,,2"], "argument --batches: expected comma-separated integers >= 1 (e.g. '1,64,256'); got '1,,2'"),
    (["--new-tokens", "0"], "argument --new-tokens: expected integers >= 1; got '0'"),
    (["--prompt-len", "4,8"], "argument --prompt-len: expected one integer >= 1; got '4,8'"),
    (["--models", "no_such_model"], "--models: 'no_such_model' has no config.json in"),
])
def test_e2e_rejects_bad_sizes_and_models(args, expected, tmp_path, capsys):
    with pytest.raises(SystemExit):
        load("e2e").main(["--smoke", *args, "--out", str(tmp_path / "e2e.json")])
    assert expected in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_e2e_rejects_a_buffer_above_the_kernels_limit(tmp_path, capsys):
    with pytest.raises(SystemExit):
        load("e2e").main(["--smoke", "--modes", "standard,65d", "--backend", "interpret",
                          "--out", str(tmp_path / "e2e.json")])
    assert "--modes: `buffer_len` must be <= 64 with backend 'interpret'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_kernels_direct_variant_and_check(monkeypatch):
    """bench/kernels.py times the direct route where the default replay step is one launch (small batches), and
    its correctness check covers it: buffered steps, then direct steps that fold them (interpret mode, small shape)."""
    kb = load("kernels")
    small = kb.GDNShape(H=2, HV=4, K=16, V=32)
    bench = kb.make_bench("gdn", 2, "float32", kb.np.random.default_rng(0), shape=small)
    assert [v[0] for v in kb.variants(bench, (4, 8))] == ["standard", "replay-L4", "replay-L8", "replay-L4-in-step",
                                                          "replay-L4-direct"]
    device = type("Device", (), dict(platform="cpu", compute_capability="", core_count=None))()
    monkeypatch.setattr(kb.jax, "devices", lambda *a: [device])  # a CPU host, wherever the suite runs
    large = kb.make_bench("gdn", 256, "float32", None)
    assert [v[0] for v in kb.variants(large, (16,), "interpret")] == [  # no direct route
        "standard", "replay-L16", "replay-L16-in-step", "replay-L16-deferred", "replay-L16-in-step-deferred",
        "replay-L16-lockstep"]
    tma = [v for v in kb.variants(large, (16,), "pallas") if v[0].endswith("-lockstep-tma")]  # compiled only
    assert [(v[0], v[2], type(v[4]).__name__) for v in tma] == [("replay-L16-lockstep-tma", "lockstep",
                                                                  "TMAReadoutConfig")]
    mamba2 = kb.make_bench("mamba2", 256, "float32", None)
    assert kb.tma_applies(mamba2, 16, "pallas") and not kb.tma_applies(mamba2, 16, "interpret")
    assert kb.tma_applies(mamba2, 4, "pallas")  # Mamba-2's readout takes any L
    assert not kb.tma_applies(large, 4, "pallas")  # L not a multiple of 8
    assert not kb.tma_is_default(large, 16)  # no Hopper-class GPU here
    assert large.inputs(1)["v"].shape == (1, 256, 32, 128)  # the checks drew nothing: the bench's key stays usable
    device.platform, device.compute_capability, device.core_count = "gpu", "9.0", 132  # an H200: the append
    # route's default is the Mosaic GPU kernel
    triton = [v for v in kb.variants(large, (16,), "pallas") if v[0].endswith("-triton")]
    assert [(v[0], v[3], type(v[4]).__name__) for v in triton] == [
        ("replay-L16-lockstep-triton", "output", "ReplayConfig"), ("replay-L16-deferred-triton", "deferred",
                                                                    "ReplayConfig")]
    standard = [v[0] for v in kb.variants(large, (16,), "pallas") if v[0].startswith("standard")]
    assert standard == ["standard", "standard-tma"]  # the Mosaic GPU standard step beside the default
    monkeypatch.undo()
    out = kb.check(bench, (4,), "interpret")
    assert out["ok"] and out["direct_L4"]["cursor_zero"] and out["direct_L4"]["y"]["ok"]
    assert out["deferred_L4"]["y"]["ok"] and out["deferred_L4"]["checkpoint"]["ok"]
    # the check is live: a "direct" step that buffers instead (cursor not 0) fails it
    step = bench.replay_step
    monkeypatch.setattr(bench, "replay_step", lambda rs, inp, route, backend, config=None: step(
        rs, inp, "output" if route == "direct" else route, backend, config))
    assert not kb.check(bench, (4,), "interpret")["ok"]


def test_kernels_gdn_gate_forms():
    """make_bench's gdn_gates: "raw" hands the GDN ops a, b, A_log and dt_bias, "given" g and beta; one
    replay step of each (interpret mode, small shape) matches the reference on its own inputs, and the raw
    form's outputs equal the given form's on the gates the raw ones make. Mamba-2 takes no gate form."""
    import numpy as np

    from replayssm_jax import reference

    kb = load("kernels")
    small = kb.GDNShape(H=2, HV=4, K=16, V=32)
    raw, given = (kb.make_bench("gdn", 2, "float32", None, shape=small, gdn_gates=g) for g in kb.GDN_GATES)
    step = raw.inputs(1)
    assert {"a", "b"} <= set(step) and not {"g", "beta"} & set(step)
    assert {"g", "beta"} <= set(given.inputs(1)) and "A_log" not in given._kw(given.inputs(1))
    inp = {k: v[0] for k, v in step.items()}
    g, beta = reference.gdn_gates(inp["a"], inp["b"], raw.A_log, raw.dt_bias)
    rs = given.replay_init(given.state(), 4)
    formed = dict({k: v for k, v in inp.items() if k not in ("a", "b")}, g=g, beta=beta.astype(inp["b"].dtype))
    y_raw, _ = raw.replay_step(rs, inp, "output", "interpret")
    y_given, _ = given.replay_step(rs, formed, "output", "interpret")
    y_ref, _ = raw.replay_step(rs, inp, "output", "xla")
    np.testing.assert_allclose(np.asarray(y_raw, np.float32), np.asarray(y_ref, np.float32), rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(np.asarray(y_raw, np.float32), np.asarray(y_given, np.float32), rtol=2e-2, atol=2e-2)
    assert raw.io_bytes() < given.io_bytes()  # a and b bf16 against g f32 and beta bf16
    with pytest.raises(ValueError, match="gdn_gates"):
        kb.make_bench("gdn", 2, "float32", None, shape=small, gdn_gates="sigmoid")
    assert not hasattr(kb.make_bench("mamba2", 2, "float32", None, gdn_gates="given"), "raw_gates")


def test_kernels_timing_options(monkeypatch):
    """How a variant is timed is a TimingOptions passed down to the cycle: its state sets, its standard
    cycle's length, its backend (interpret mode here, tiny shape)."""
    kb = load("kernels")
    bench = kb.make_bench("gdn", 2, "float32", None, shape=kb.GDNShape(H=1, HV=2, K=16, V=16))
    per = bench.state_bytes()
    assert kb.n_sets_for(bench, kb.TimingOptions()) == 64  # 240 MB of 4 KiB states: max_sets
    assert kb.n_sets_for(bench, kb.TimingOptions(l2_target_bytes=3 * per, max_sets=8)) == 3
    assert kb.n_sets_for(bench, kb.TimingOptions(l2_target_bytes=1.0)) == 2  # min_sets
    seen, cycle = [], kb.time_cycle
    monkeypatch.setattr(kb, "time_cycle", lambda step, carries, xs, steps, options, per_step: seen.append(
        (steps, len(carries), options, per_step, len({id(x["q"]) for x in xs}))) or cycle(
        step, carries, xs, steps, options, per_step=per_step))
    options = kb.TimingOptions.dry_run(standard_steps=3)
    std = kb.run_variant(bench, None, None, options)
    replay = kb.run_variant(bench, 4, "staggered", options)
    assert seen == [(3, 1, options, True, 3), (4, 1, options, True, 4)]  # each step its own inputs
    assert std["bytes"] == kb.standard_bytes(bench) and replay["bytes"] == kb.replay_bytes(bench, 4)
    assert std["seconds"] > 0 and replay["seconds"] > 0 and std["kernels_us"] is None  # no profile asked
    # lockstep: from cursors 0, L - 1 replay steps on the append route (the output route without a flush), then
    # the direct step that flushes every row.
    routes, starts, step, init = [], [], bench.replay_step, bench.replay_init
    monkeypatch.setattr(bench, "replay_step", lambda *args: routes.append(args[2]) or step(*args))
    monkeypatch.setattr(bench, "replay_init", lambda *args: starts.append(tuple(int(c) for c in args[3])) or init(*args))
    lockstep = kb.run_variant(bench, 4, "lockstep", options)
    assert routes == ["append"] * 3 + ["direct"] and starts == [(0, 0)]
    assert lockstep["bytes"] == kb.replay_bytes(bench, 4, lockstep=True) < replay["bytes"]
    with pytest.raises(ValueError, match="`step` must be one function or 4"):
        cycle([step] * 3, (), None, 4, options)
    with pytest.raises(ValueError, match="`inp` must hold 4 steps' inputs with per_step; got 3"):
        cycle(step, (), (None,) * 3, 4, options, per_step=True)


def test_kernels_sweep_times_each_route_and_cursors(monkeypatch):
    """`--sweep --sweep-routes output,state --sweep-cursors staggered,in-step`: each replay tiling is timed on
    both routes from both kinds of cursors (interpret mode, tiny shape), as variants of their own; the state
    route's rows run the replay step with route "state", the in-step rows start with every cursor at 0. The
    deferred route's rows give the tiling that ran (the flush launch's default filled in)."""
    from replayssm_jax.kernels import ReplayConfig, StepConfig

    kb = load("kernels")
    bench = kb.make_bench("gdn", 2, "float32", None, shape=kb.GDNShape(H=1, HV=2, K=16, V=16))
    routes, starts, replay, init = [], [], bench.replay_step, bench.replay_init
    monkeypatch.setattr(bench, "replay_step", lambda *args: routes.append(args[2]) or replay(*args))
    monkeypatch.setattr(bench, "replay_init",
                        lambda *args: starts.append(tuple(int(c) for c in args[3])) or init(*args))
    rows = []
    overrides = {"standard": [StepConfig(16, 1)], "replay": [ReplayConfig(16, 1, tiles=1)]}
    kb.sweep(bench, dict(layer="gdn"), rows, (4,), kb.TimingOptions.dry_run(standard_steps=2), overrides,
             ("output", "state"), ("staggered", "in-step"))
    variants = [r["variant"] for r in rows]
    replays = ("replay-L4", "replay-L4-state", "replay-L4-in-step", "replay-L4-state-in-step")
    assert variants.count("standard") >= 1 and len({variants.count(v) for v in replays}) == 1
    assert set(routes) == {"output", "state"} and set(starts) == {(0, 1), (0, 0)}
    assert all(r["seconds"] > 0 for r in rows)
    for flag in ("--sweep-routes", "--sweep-cursors"):
        with pytest.raises(SystemExit):
            kb.main([flag, "output,direct", "--dry-run"])
    # lockstep cursors: each replay tiling on the cycle's append steps, then the direct step's tilings
    # (`--direct-configs`) at the default replay tiling
    calls, rows = [], []
    monkeypatch.setattr(bench, "replay_step", lambda *args: calls.append(args[2:]) or replay(*args))
    direct = StepConfig(16, 1, dot_fold=True)
    kb.sweep(bench, dict(layer="gdn"), rows, (4,), kb.TimingOptions.dry_run(standard_steps=2),
             dict(overrides, direct=[direct]), ("output",), ("lockstep",))
    lockstep = [r for r in rows if r["variant"] == "replay-L4-lockstep"]
    assert [r["direct_config"] for r in lockstep] == [None] * (len(lockstep) - 1) + [dataclasses.asdict(direct)]
    assert {c[0] for c in calls} == {"append", "direct"} and ("direct", "interpret", direct) in calls
    # the deferred route: rows name the tiling that ran, its flush launch's default filled in (f32)
    routes.clear()
    monkeypatch.setattr(bench, "replay_step", lambda *args: routes.append(args[2]) or replay(*args))
    rows = []
    kb.sweep(bench, dict(layer="gdn"), rows, (4,), kb.TimingOptions.dry_run(standard_steps=2), overrides,
             ("deferred",), ("staggered",))
    deferred = [r["config"] for r in rows if r["variant"] == "replay-L4-deferred"]
    assert set(routes) == {"deferred"} and deferred
    assert all((c["flush_block_v"], c["flush_warps"]) == ((0, 0) if c["fused_flush"] else (16, 4)) for c in deferred)


def test_kernels_verify_rows_time_the_per_draft_launch(monkeypatch, capsys):
    """`bench/kernels.py --verify W` checks the per-draft standard verify launch against the reference, then
    times it (one launch per window on a slotted state, the commit an index move; traffic: the state read
    once, W states written) beside ReplaySSM's verify kernel (interpret mode, tiny shape); a per-draft
    launch that fails its check gives no timing."""
    kb = load("kernels")
    bench = kb.make_bench("gdn", 2, "float32", None, shape=kb.GDNShape(H=1, HV=2, K=16, V=16))
    assert kb.check_per_draft(bench, 2, "interpret")["ok"]
    r = kb.run_verify_variant(bench, 4, 2, True, kb.TimingOptions.dry_run())
    assert r["bytes"] == 3 * bench.state_bytes() + 2 * bench.io_bytes() and r["seconds"] > 0
    # the check is live: a launch that leaves the slots as they were fails it, and nothing is timed
    verify = bench.per_draft_verify
    monkeypatch.setattr(bench, "per_draft_verify", lambda state, index, window, backend="xla", config=None: (
        verify(state, index, window, backend)[0], state) if backend == "interpret" else verify(state, index, window))
    monkeypatch.setattr(kb, "run_verify_variant", lambda *args, **kw: pytest.fail("timed after a failed check"))
    rows = []
    kb.verify_rows(bench, dict(layer="gdn", shape=str(bench.s), batch=2, state_dtype="float32"), rows, (4,), 2,
                   kb.TimingOptions.dry_run())
    assert len(rows) == 1 and not rows[0]["passed"] and not rows[0]["check"]["states"]["ok"]
    assert rows[0]["check"]["y"]["ok"] and rows[0]["check"]["current_untouched"]
    assert "the per-draft verify FAILED its check" in capsys.readouterr().out


@pytest.mark.parametrize("fields, message", [
    (dict(backend="xla"), "`backend` must be one of pallas, interpret; got 'xla'"),
    (dict(repeats=0), "`repeats` must be an int >= 1; got 0"),
    (dict(chained_calls=1.5), "`chained_calls` must be an int >= 1; got 1.5"),
    (dict(min_chain_s=-0.1), "`min_chain_s` must be >= 0; got -0.1"),
    (dict(min_sets=8, max_sets=4), "`min_sets` must be <= `max_sets` = 4; got 8"),
], ids=["backend", "repeats", "chained calls", "chain seconds", "sets"])
def test_kernels_timing_options_errors(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load("kernels").TimingOptions(**fields)


def test_kernels_chain_lasts_min_chain_s():
    """A repeat's chain has `chained_calls` calls, more where the warm-up call is shorter than
    `min_chain_s`; a call that steps twice on its carry runs each step once."""
    kb = load("kernels")
    steps = []

    def step(c, inp):
        kb.jax.debug.callback(lambda: steps.append(1))
        return c + inp, c + inp

    def calls(**options):
        steps.clear()
        seconds, *_ = kb.time_cycle(step, (kb.jnp.ones(4),), kb.jnp.full(4, 0.5), 2,
                                    kb.TimingOptions.dry_run(**options))
        kb.jax.effects_barrier()
        assert seconds > 0
        return len(steps) // 2 - 2  # less the compile and warm-up calls

    assert calls(chained_calls=3) == 3
    assert calls(chained_calls=1, min_chain_s=0.2) > 1


BAD_ARGUMENTS = [
    ("e2e", ["--smoke", "--backend", "foo"], "argument --backend: invalid choice: 'foo'"),
    ("e2e", ["--smoke", "--prefill-rows", "-1"], "argument --prefill-rows: expected one integer >= 0; got '-1'"),
    ("serve", ["--dry-run", "--rate", "0"], "argument --rate: expected a number > 0; got '0'"),
    ("serve", ["--dry-run", "--shared", "1.5"], "argument --shared: expected a number in [0, 1]; got '1.5'"),
    ("serve", ["--dry-run", "--prompt-len", "5,2"], "argument --prompt-len: expected LO,HI with 1 <= LO <= HI"),
    ("serve", ["--dry-run", "--states", "fast"], "argument --states: expected names of standard, replay"),
    ("serve", ["--dry-run", "--models", "nosuch"], "--models: the dry run takes the fixtures in"),
    ("serve", ["--dry-run", "--batch-size", "9", "--capacity", "4"], "--batch-size must be <= --capacity = 4"),
    ("kernels", ["--dry-run", "--batches", "0"], "argument --batches: expected integers >= 1; got '0'"),
    ("kernels", ["--dry-run", "--state-dtypes", "float16"], "argument --state-dtypes: expected names of float32"),
    ("buffer_length", ["--dry-run", "--layers", "foo"], "argument --layers: expected names of gdn, mamba2"),
    ("state_drift", ["--quick", "--lengths", "8,0"], "argument --lengths: expected integers >= 1; got '8,0'"),
    ("spec", ["--dry-run", "--modes", "spec-replay"], "--modes: spec-replay needs ar-replay beside it"),
    ("ncu_table", ["/nonexistent/report.txt"], "report '/nonexistent/report.txt': no such file"),
]


@pytest.mark.parametrize("script, argv, message", BAD_ARGUMENTS,
                         ids=[f"{s}-{a[-2] if len(a) > 1 else a[0]}" for s, a, _ in BAD_ARGUMENTS])
def test_bench_scripts_refuse_bad_arguments_in_one_line(script, argv, message, tmp_path, capsys):
    """A bad option value is refused by argparse (exit status 2, one usage line and one error line naming
    the option), before the script writes anything."""
    with pytest.raises(SystemExit) as exit_info:
        load(script).main(argv + (["--out", str(tmp_path / "out")] if script not in ("state_drift", "ncu_table")
                                  else []))
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Traceback" not in err and message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("script", ["kernels", "buffer_length"])
def test_timed_scripts_reject_bad_repeats_before_running(script, tmp_path, capsys):
    with pytest.raises(SystemExit):
        load(script).main(["--repeats", "0", "--out", str(tmp_path)])
    assert "--repeats: `repeats` must be an int >= 1; got 0" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran


@pytest.mark.slow
def test_e2e_profile_without_a_gpu_plane(tmp_path, capsys):
    """--profile on the CPU: the traced runs have no GPU plane, which the run says (and goes on)."""
    assert load("e2e").main(["--smoke", "--models", "nemotron_h_tiny", "--batches", "1", "--modes", "2",
                             "--out", str(tmp_path / "cpu.json"), "--profile"]) == 0
    assert "no GPU plane" in capsys.readouterr().out


def test_e2e_profile_table(tmp_path, capsys, monkeypatch):
    """--profile: traced runs per configuration (with and without decode), broken
    down per decode step (fixed breakdowns stand in for the GPU plane the CPU's trace
    lacks: test_e2e_profile_without_a_gpu_plane, `slow`)."""
    e2e = load("e2e")
    # The traced runs alternate: the configuration's (prefill + decode), then the prefill alone.
    full = dict(window_ns=9e6, ns=dict(ssm=2e6, gemm=3e6, attention=1e6, other=1e6, idle=2e6),
                kernels={"gdn_replay_x": (2e6, 5), "gemm_a": (3e6, 8), "trsm": (1e6, 1)})
    prefill = dict(window_ns=4e6, ns=dict(ssm=0.0, gemm=2e6, attention=0.0, other=1e6, idle=1e6),
                   kernels={"gemm_a": (2e6, 3), "trsm": (1e6, 1)})
    breakdowns = iter([full, prefill] * 4)
    monkeypatch.setattr(e2e.step_profile, "decode_breakdown", lambda profile, hlo=(): next(breakdowns))
    assert e2e.main(["--smoke", "--models", "nemotron_h_tiny", "--batches", "1", "--modes", "2",
                     "--out", str(tmp_path / "e2e.json"), "--profile"]) == 0
    row = json.loads((tmp_path / "e2e.json").read_text())["rows"][0]
    steps = 5  # --smoke: 6 new tokens, the first from the prefill
    assert row["profile"]["ms"] == {k: (full["ns"][k] - prefill["ns"][k]) / steps / 1e6 for k in full["ns"]}
    # the prefill's kernels are gone from the decode's list
    assert [name for name, _, _ in row["profile"]["top"]] == ["gdn_replay_x", "gemm_a"]
    assert "ms per decode step" in capsys.readouterr().out


def test_step_profile_attention_kernels():
    """Kernels of HLO instructions under the attention layers' name scope count as attention, named as XLA
    names a fusion's kernel ('.' and '-' as '_'); others keep their category by name."""
    step_profile = load("step_profile")
    hlo = ('  %gemm_fusion_dot.224 = f32[16,256,64]{2,1,0} fusion(%a, %b), kind=kCustom, '
           'metadata={op_name="jit(block)/while/body/attention/dot_general"}\n'
           '  ROOT %loop_reduce-fusion.3 = f32[4]{0} fusion(%c), kind=kLoop, '
           'metadata={op_name="jit(block)/while/body/attention/reduce_max"}\n'
           '  %gemm_fusion_dot.113 = bf16[256,128]{1,0} fusion(%x, %w), kind=kCustom, '
           'metadata={op_name="jit(block)/while/body/dot_general"}\n')
    attention = step_profile.attention_kernels([hlo])
    assert attention == {"gemm_fusion_dot_224", "loop_reduce_fusion_3"}
    assert [step_profile.category(k, attention) for k in ("gemm_fusion_dot_224", "gemm_fusion_dot_113",
                                                          "gdn_replay_output_L16", "loop_reduce_fusion_3")] == \
        ["attention", "gemm", "ssm", "attention"]
    # Every Pallas SSM kernel, the direct and deferred routes' included; the conv update not.
    ssm = ("mamba2_step_bv16_w2_s1_t1", "gdn_replay_flush_L16_bv64_w4_s1_t1_r8", "mamba2_direct_bv16_w2_s1_t1_dotfold",
           "gdn_verify_W4_L16_bv64_w4_s1_t1", "gdn_verify_flush_W4_L16_bv64_w4_s1_t1_r8", "mamba2_per_draft_W4_S5_x",
           "mamba2_deferred_flush_L16_bv32_w4_s1_t1_bfirst_r8", "gdn_deferred_terms_L16",
           "gdn_deferred_tma_L16_bv64_st2_p264_r4_mosaic_gpu_kernel")
    assert {step_profile.category(k) for k in ssm} == {"ssm"}
    assert step_profile.category("conv_update_w4_bc512_w4_s1") == "other"
    assert step_profile.category("attention_decode_bt32_w8_s1_p1") == "attention"  # the decode attention kernel


def test_step_profile_breakdown():
    """Kernel time by category inside the decode module's windows, and the idle rest."""
    from jax.profiler import ProfileData

    step_profile = load("step_profile")
    names = ["jit_block(7)", "mamba2_replay_output_L8", "sm90_xmma_gemm_bf16", "loop_multiply_fusion", "jit_start(3)"]
    metadata = "".join(f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}\n'
                       for i, n in enumerate(names, 1))
    events = lambda spans: "".join(f"events {{ metadata_id: {m} offset_ps: {o} duration_ps: {d} }}"  # noqa: E731
                                   for m, o, d in spans)
    text = (f'planes {{ id: 1 name: "/device:GPU:0"\n'
            f'lines {{ id: 1 name: "XLA Modules" timestamp_ns: 1000 {events([(1, 0, 10**7), (5, 2 * 10**7, 5 * 10**6)])} }}\n'
            f'lines {{ id: 2 name: "Stream #13(Compute)" timestamp_ns: 1000 '
            f'{events([(2, 10**6, 3 * 10**6), (3, 2 * 10**6, 2 * 10**6), (4, 6 * 10**6, 10**6), (3, 21 * 10**6, 10**6)])} }}\n'
            f'{metadata}}}')
    b = step_profile.decode_breakdown(ProfileData.from_text_proto(text))
    # the module ran 10 us; kernels covered [1, 4] and [6, 7] us of it (the GEMM overlapping
    # the SSM kernel counts once in the union); the GEMM at 21 us belongs to jit_start
    assert b["window_ns"] == 10_000
    assert b["ns"] == dict(ssm=3000, gemm=2000, attention=0.0, other=1000, idle=6000)
    assert b["top"][0] == ("mamba2_replay_output_L8", 3000, 1)
    assert b["hlo_ops"] == {}  # these events carry no hlo_op stat
    assert step_profile.decode_breakdown(ProfileData.from_text_proto('planes { id: 1 name: "/host:CPU" }')) is None


def _one_module_trace(names, kernels, stat: str) -> str:
    """A GPU plane in text proto: one window of module names[0] (0-10 us), and `kernels` [(index in
    `names`, start us, duration us, the launch's `stat` value or None)] on one stream."""
    metadata = "".join(f'event_metadata {{ key: {i} value {{ id: {i} name: "{n}" }} }}\n'
                       for i, n in enumerate(names, 1))
    events = "".join(f"events {{ metadata_id: {i + 1} offset_ps: {t * 10**6} duration_ps: {d * 10**6} "
                     + ("" if v is None else f'stats {{ metadata_id: 99 str_value: "{v}" }} ') + "} "
                     for i, t, d, v in kernels)
    return (f'planes {{ id: 1 name: "/device:GPU:0"\n'
            f'lines {{ id: 1 name: "XLA Modules" timestamp_ns: 1000 '
            f'events {{ metadata_id: 1 offset_ps: 0 duration_ps: {10**7} }} }}\n'
            f'lines {{ id: 2 name: "Stream #13(Compute)" timestamp_ns: 1000 {events}}}\n'
            f'{metadata}stat_metadata {{ key: 99 value {{ id: 99 name: "{stat}" }} }}\n}}')


def test_step_profile_copy_issuers():
    """A copy launch is traced to the HLO instructions it ran for (the events' hlo_op stats), named with
    their line of the compiled HLO; launches outside the decode module and other kernels are left out."""
    from jax.profiler import ProfileData

    step_profile = load("step_profile")
    text = _one_module_trace(["jit_block(7)", "memcpy128", "loop_add_fusion"],
                             [(1, 1, 1, "copy.7"), (1, 3, 1, "copy.9"), (2, 5, 1, "add.1"), (1, 20, 1, "copy.99")],
                             "hlo_op")
    b = step_profile.decode_breakdown(ProfileData.from_text_proto(text))
    assert b["hlo_ops"] == {"memcpy128": ["copy.7", "copy.9"], "loop_add_fusion": ["add.1"]}
    hlo = ('  %copy.7 = bf16[256,4,192,256]{3,2,1,0} copy(%param.3), metadata={op_name="jit(block)/while/body/x"}\n'
           '  ROOT %add.1 = f32[4]{0} add(%a, %b)\n')
    assert step_profile.issuers(b, [hlo]) == {"memcpy128": [hlo.splitlines()[0].strip(), "copy.9"]}
    assert step_profile.issuers(step_profile.difference(b, dict(window_ns=0, ns=dict.fromkeys(
        step_profile.CATEGORIES, 0.0), kernels={})), [hlo])["memcpy128"][0].startswith("%copy.7 = bf16[256,4,192,256]")


def test_step_profile_counts_a_kernel_by_its_module():
    """A kernel whose launch names its module (the `hlo_module` stat) counts by that name, inside the module's
    window or not: another program's kernel inside the window is left out; one without the stat counts by
    the window."""
    from jax.profiler import ProfileData

    step_profile = load("step_profile")
    text = _one_module_trace(["jit_block(7)", "loop_add_fusion", "input_reduce_fusion", "loop_select_fusion"],
                             [(1, 1, 1, "jit_block"), (2, 3, 2, "jit_start"), (3, 6, 1, None), (1, 20, 1, "jit_block")],
                             "hlo_module")
    b = step_profile.decode_breakdown(ProfileData.from_text_proto(text))
    assert b["kernels"] == {"loop_add_fusion": (2000, 2), "loop_select_fusion": (1000, 1)}
    assert b["ns"]["other"] == 3000


def test_buffer_length_dry_run(tmp_path, capsys):
    assert load("buffer_length").main(["--dry-run", "--layers", "mamba2", "--state-dtypes", "float32",
                                       "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "buffer_length.json").read_text())["rows"]
    assert {r["L"] for r in rows} == {1, 2} and all(r["passed"] for r in rows)
    assert (tmp_path / "buffer_length_vs_L.png").stat().st_size > 0
    out = capsys.readouterr().out
    assert "best L per shape" in out and "timings and speedups are not measurements" in out
    meta = json.loads((tmp_path / "buffer_length.json").read_text())["meta"]
    timing = meta["timing"]
    assert (timing["backend"], timing["repeats"], timing["max_sets"], timing["standard_steps"]) == ("interpret", 1, 1, 2)
    assert meta["timings_meaningful"] is False and "not measurements" in meta["note"]


@pytest.mark.parametrize(("spec", "fields"), [
    ("32", dict(block_v=32)),
    ("64x4", dict(block_v=64, num_warps=4)),
    ("64x4x2", dict(block_v=64, num_warps=4, tiles=2)),
    ("16x2x5x3", dict(block_v=16, num_warps=2, tiles=5, num_stages=3)),
    ("16x4x1f", dict(block_v=16, num_warps=4, fused_flush=True)),
    ("64x4x2:32x2x4", dict(block_v=64, num_warps=4, tiles=2, flush_block_v=32, flush_warps=2, flush_rows=4)),
    ("16x2x5:8", dict(block_v=16, num_warps=2, tiles=5, flush_block_v=8)),
])
def test_kernels_sweep_config_spec(spec, fields):
    """`bench/kernels.py --standard-configs / --replay-configs` specs (f: fused flush; the flush
    launch's tiling after ':')."""
    from replayssm_jax.kernels import ReplayConfig

    assert load("kernels").parse_config(spec) == ReplayConfig(**fields)


def test_kernels_sweep_standard_config_spec():
    """`--standard-configs` specs give StepConfigs: one tile per program, no flush."""
    from replayssm_jax.kernels import StepConfig

    kb = load("kernels")
    assert kb.parse_config("64x8", "standard") == StepConfig(block_v=64, num_warps=8)
    assert kb.parse_config("32x4x1x2", "standard") == StepConfig(block_v=32, num_warps=4, num_stages=2)
    for spec in ("64x4x2", "16x4x1f", "64x4x1:32x2x4"):
        with pytest.raises(ValueError, match="the standard step takes one tile per program and no flush"):
            kb.parse_config(spec, "standard")


@pytest.mark.parametrize("spec", ["16x2x5x2x9", "16x2x5x", "", "axb", "16x2:1x2x3x4", "16x2:"])
def test_kernels_sweep_config_spec_errors(spec):
    with pytest.raises(ValueError, match=r"config spec .*: expected 'BVxWxT'"):
        load("kernels").parse_config(spec)


def test_kernels_sweep_summary(capsys):
    """--sweep ends with the default and the fastest tiling of each variant."""
    from replayssm_jax.kernels import ReplayConfig, StepConfig

    kb = load("kernels")
    base = dict(layer="mamba2", state_dtype="float32", batch=256)
    rows = [dict(base, variant="replay-L16", config=ReplayConfig(16, 2, tiles=5).__dict__, default=True,
                 seconds=429e-6),
            dict(base, variant="replay-L16", config=ReplayConfig(16, 2, tiles=5, flush_block_v=16, flush_warps=1,
                                                                 flush_rows=8).__dict__, default=False, seconds=422e-6),
            dict(base, variant="standard", config=StepConfig(16, 2).__dict__, default=True, seconds=594e-6)]
    kb.sweep_summary(rows)
    lines = capsys.readouterr().out.splitlines()
    assert "| mamba2 | float32 | 256 | replay-L16 | bv16_w2_s1_t5 | 429.00 | bv16_w2_s1_t5_f16x1x8 | 422.00 | 1.02 |" in lines
    assert "| mamba2 | float32 | 256 | standard | bv16_w2_s1_t1 | 594.00 | bv16_w2_s1_t1 | 594.00 | 1.00 |" in lines


NCU_REPORT = """==PROF== Disconnected from process 457
  mamba2_replay_output_L16_bv16_w2_s1_t5 (256, 96, 1)x(64, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    ----------------------- ----------- ------------
    DRAM Throughput                   %        71.05
    Duration                         ms         0.33
    Section: Memory Workload Analysis
    Memory Throughput                Gbyte/s     3,420.50
    Section: Launch Statistics
    Registers Per Thread             register/thread          72
  gdn_step_bv32_w4_s1 (256, 32, 4)x(128, 1, 1), Context 1, Stream 14, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    Duration                         us       294.72
"""


def test_ncu_table_reads_an_ncu_report(tmp_path, capsys):
    """bench/ncu_table.py: one row per launch, units normalised (ms -> us, Gbyte/s -> TB/s), '-' where a
    section was not collected."""
    nt = load("ncu_table")
    launches = nt.parse(NCU_REPORT)
    assert [x["kernel"] for x in launches] == ["mamba2_replay_output_L16_bv16_w2_s1_t5", "gdn_step_bv32_w4_s1"]
    assert launches[0]["grid"] == (256, 96, 1) and launches[0]["block"] == 64
    m = launches[0]["metrics"]
    assert m[("Duration", "us")] == pytest.approx(330.0)
    assert m[("Memory Throughput", "Tbyte/s")] == pytest.approx(3.4205)
    assert m[("Registers Per Thread", "register/thread")] == 72
    report = tmp_path / "ncu.txt"
    report.write_text(NCU_REPORT)
    assert nt.main([str(report)]) == 0
    rows = capsys.readouterr().out.splitlines()[2:]
    assert rows[0].split() == ["mamba2_replay_output_L16_bv16_w2_s1_t5", "330", "3.421", "71.05", "72", "-", "-", "-",
                               "-"]
    assert rows[1].split() == ["gdn_step_bv32_w4_s1", "294.7"] + ["-"] * 7
    empty = tmp_path / "empty.txt"
    empty.write_text("==PROF== nothing profiled\n")
    assert nt.main([str(empty)]) == 1


def test_profile_step_rejects_unknown_layers(capsys):
    with pytest.raises(SystemExit):
        load("profile_step").main(["--layers", "mamba", "--backend", "interpret"])
    assert "argument --layers: expected names of gdn, mamba2; got 'mamba'" in capsys.readouterr().err


def test_roofline_checks_its_kernels(tmp_path, capsys):
    """bench/roofline.py in interpret mode: both streaming kernels give their
    results (checked inside the script against numpy) and a table per kind."""
    out = tmp_path / "rl"
    assert load("roofline").main(["--backend", "interpret", "--mib", "1", "--repeats", "1",
                                  "--configs", "16x2x2,8x1x1", "--out", str(out)]) == 0
    rows = json.loads((out / "roofline.json").read_text())["rows"]
    assert {(r["kind"], r["dtype"], r["config"]) for r in rows} == {
        (k, d, c) for k in ("read", "update") for d in ("float32", "bfloat16")
        for c in ("bv16_w2_s1_t2", "bv8_w1_s1_t1")}
    rows_per_program = {"bv16_w2_s1_t2": 32, "bv8_w1_s1_t1": 8}
    for r in rows:  # 1 MiB in programs of rows_per_program x 128 elements
        assert r["programs"] == (1 << 20) // (rows_per_program[r["config"]] * 128 * (4 if r["dtype"] == "float32" else 2))
        assert r["mib"] == 1 and r["gbps"] > 0
    assert "| read | float32 |" in capsys.readouterr().out


def test_roofline_catches_a_wrong_kernel(monkeypatch):
    """The result check is live: a read kernel that drops a tile fails it."""
    rl = load("roofline")
    monkeypatch.setattr(rl, "_read_kernel", lambda x_ref, o_ref, *, config: o_ref.__setitem__((), 0.0))
    with pytest.raises(AssertionError, match="wrong result"):
        rl.measure("read", rl.ReplayConfig(block_v=8, num_warps=1, tiles=2), rl.jnp.float32, 1, 1, True)


@pytest.mark.parametrize("args, message", [
    (["--configs", "12x2x1"], "--configs: "),
    (["--configs", "16x2x2f"], "--configs: flush fields mean nothing here (no flush); got bv16_w2_s1_t2_fused"),
    (["--configs", "16x2x2:8x1x1"], "--configs: flush fields mean nothing here"),
    (["--kinds", "write"], "--kinds: unknown write; choose from read, update"),
    (["--dtypes", "float32,flaot32"], "--dtypes: unknown flaot32; choose from float32, bfloat16, float16"),
    (["--dtypes", "int8"], "--dtypes: unknown int8"),
    (["--repeats", "0"], "--repeats: must be >= 1; got 0"),
    (["--mib", "-5"], "--mib: must be >= 1; got -5"),
], ids=["tiling", "fused", "flush", "kinds", "dtype typo", "int8", "repeats", "mib"])
def test_roofline_rejects_bad_arguments(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        load("roofline").main(["--backend", "interpret", "--out", str(tmp_path), *args])
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # refused before anything ran


def test_roofline_needs_a_gpu_by_default(capsys):
    with pytest.raises(SystemExit):
        load("roofline").main([])
    assert "the pallas backend needs a GPU (JAX's default backend is 'cpu'); on the CPU use --backend interpret" \
        in capsys.readouterr().err


def test_bounds_table(tmp_path, capsys):
    """bench/bounds.py: each kernel's bytes at its ceiling, the rest of the step as measured."""
    bounds = load("bounds")
    rows = [dict(layer="gdn", state_dtype="float32", batch=2, L=None, cursors=None, seconds=100e-6, passed=True,
                 kernels_us={"gdn_step_bv32_w4_s1_t1": dict(us=90.0, launches_per_step=1.0)}),
            dict(layer="gdn", state_dtype="float32", batch=2, L=4, cursors="staggered", seconds=80e-6, passed=True,
                 kernels_us={"gdn_replay_output_L4_bv64_w4_s1_t2": dict(us=50.0, launches_per_step=1.0),
                             "gdn_replay_flush_L4_bv64_w4_s1_t1_r2": dict(us=10.0, launches_per_step=1.0),
                             "memcpy32_post": dict(us=2.0, launches_per_step=2.0)})]
    roofline = dict(rows=[dict(kind="read", dtype="float32", gbps=g) for g in (100.0, 400.0)]
                    + [dict(kind="update", dtype="float32", gbps=200.0)])
    (tmp_path / "k.json").write_text(json.dumps(dict(rows=rows)))
    (tmp_path / "r.json").write_text(json.dumps(roofline))
    assert bounds.main([str(tmp_path / "k.json"), str(tmp_path / "r.json")]) == 0
    bench = bounds.kb.make_bench("gdn", 2, "float32", bounds.np.random.default_rng(0))
    read, written = bench.buffer_bytes(4)
    state = bench.state_bytes()
    replay_bound = (state + read + written + bench.io_bytes()) / 400.0 / 1e3  # the best read ceiling
    flush_bound = (2 * state / 4 + read / 4) / 200.0 / 1e3
    [row] = bounds.bound_rows(rows, bounds.ceilings(roofline["rows"]))
    assert row["other_us"] == pytest.approx(20.0)  # 80 - 50 - 10: the memcpys and gaps, as measured
    assert row["speedup"] == pytest.approx(1.25)
    assert row["bound"] == pytest.approx(100.0 / (replay_bound + flush_bound + 20.0))
    assert "| gdn | float32 | 2 | 4 | staggered | 50.0 (" in capsys.readouterr().out


def test_bounds_leaves_out_fused_flush_steps(tmp_path):
    """A replay kernel that also flushes (batch 1-4) is latency-bound: no bandwidth bound for it; nor for
    the direct route (the standard step's traffic)."""
    bounds = load("bounds")
    standard = dict(layer="gdn", state_dtype="float32", batch=1, L=None, cursors=None, seconds=4e-6, passed=True,
                    kernels_us={"gdn_step_bv4_w1_s1_t1": dict(us=3.0, launches_per_step=1.0)})
    fused = dict(standard, L=16, cursors="staggered", seconds=7e-6,
                 kernels_us={"gdn_replay_output_L16_bv16_w4_s1_t1_fused": dict(us=4.5, launches_per_step=1.0)})
    direct = dict(standard, L=16, cursors="empty", route="direct", seconds=3.5e-6,
                  kernels_us={"gdn_direct_bv4_w1_s1_t1": dict(us=3.3, launches_per_step=1.0)})
    assert bounds.bound_rows([standard, fused, direct], {("read", "float32"): 1.0, ("update", "float32"): 1.0}) == []


@pytest.mark.parametrize("files, message", [
    (("missing.json", "r.json"), "missing.json: cannot read it as JSON"),
    (("r.json", "k.json"), "r.json: not a bench/kernels.py JSON (rows with L, batch, layer, state_dtype)"),
    (("k.json", "k.json"), "k.json: not a bench/roofline.py JSON (rows with dtype, gbps, kind)"),
    (("list.json", "r.json"), "list.json: not a bench/kernels.py JSON"),
    (("k.json", "zero.json"), "the roofline JSON has no positive bandwidth for read float32"),
], ids=["missing", "swapped", "not roofline", "a list", "zero bandwidth"])
def test_bounds_rejects_other_files(files, message, tmp_path, capsys):
    bounds = load("bounds")
    (tmp_path / "k.json").write_text(json.dumps(dict(rows=[dict(layer="gdn", state_dtype="float32", batch=2, L=None)])))
    (tmp_path / "r.json").write_text(json.dumps(dict(rows=[dict(kind="read", dtype="float32", gbps=1.0)])))
    (tmp_path / "zero.json").write_text(json.dumps(dict(rows=[dict(kind="read", dtype="float32", gbps=0.0)])))
    (tmp_path / "list.json").write_text(json.dumps([1, 2]))
    with pytest.raises(SystemExit):
        bounds.main([str(tmp_path / f) for f in files])
    assert message in capsys.readouterr().err


def test_bounds_needs_profiles_and_ceilings(tmp_path, capsys):
    bounds = load("bounds")
    row = dict(layer="gdn", state_dtype="bfloat16", batch=2, L=None, cursors=None, seconds=1e-4, passed=True,
               kernels_us=None)
    (tmp_path / "k.json").write_text(json.dumps(dict(rows=[row])))
    (tmp_path / "r.json").write_text(json.dumps(dict(rows=[dict(kind="read", dtype="float32", gbps=1.0)])))
    with pytest.raises(SystemExit):
        bounds.main([str(tmp_path / "k.json"), str(tmp_path / "r.json")])
    assert "no two-launch replay variant with kernel times (run bench/kernels.py with --profile at a batch above 4)" \
        in capsys.readouterr().err
    replay = dict(row, L=4, cursors="staggered", kernels_us={"x_replay_output": dict(us=1.0, launches_per_step=1.0)})
    standard = dict(row, kernels_us={"x_step": dict(us=1.0, launches_per_step=1.0)})
    (tmp_path / "k.json").write_text(json.dumps(dict(rows=[standard, replay])))
    with pytest.raises(SystemExit):
        bounds.main([str(tmp_path / "k.json"), str(tmp_path / "r.json")])
    assert "the roofline JSON has no read row for bfloat16" in capsys.readouterr().err


def _heading_anchors(markdown: str) -> set[str]:
    """The #anchors GitHub gives the headings of a Markdown text (code blocks left out)."""
    anchors, seen = set(), {}
    for line in re.sub(r"```.*?```", "", markdown, flags=re.S).splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).replace("`", "").strip().lower()).replace(" ", "-")
            anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


@pytest.mark.parametrize("doc", ["README.md", "ARCHITECTURE.md", "bench/RESULTS.md"])
def test_doc_links_resolve(doc):
    """Every relative link of the docs names a file of this tree, and its #anchor a heading there."""
    path = BENCH.parent / doc
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://", t)]
    broken = []
    for link in links:
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _heading_anchors(file.read_text())):
            broken.append(link)
    assert not broken, f"{doc}: {len(broken)} of {len(links)} links do not resolve: {broken}"


@pytest.mark.slow
def test_spec_dry_run(tmp_path, capsys):
    """bench/spec.py --dry-run (`slow`: test_spec_replay_and_tree_dry_run runs the script's paths on the
    ReplaySSM state by default): the four modes on the tiny Qwen3.5 fixture (backend xla, float32), each
    speculative mode's oracle reference its own (it reproduces its reference at alpha 1 and equals the same
    state's AR output), greedy speculative tokens equal to that reference, the per-draft state slots counted
    in the standard state's memory per sequence (the speculative caches' conv windows also hold W - 1 more
    columns); the random MTP head's rows (`--drafters`) with the same tokens."""
    assert load("spec").main(["--dry-run", "--alphas", "0.8", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "spec.json").read_text())
    rows = {r["mode"]: r for r in report["rows"] if r["drafter"] != "mtp"}
    mtp = [r for r in report["rows"] if r["drafter"] == "mtp"]
    assert [r["mode"] for r in mtp] == ["spec-standard", "spec-replay"] and report["meta"]["drafters"] == ["oracle",
                                                                                                          "mtp"]
    assert all(r["identical_to_reference"] and r["alpha"] is None and r["accepted_per_round"] >= 1 for r in mtp)
    assert list(rows) == ["ar-standard", "ar-replay", "spec-standard", "spec-replay"]
    assert report["meta"]["backend"] == "xla" and report["meta"]["num_draft"] == 3
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert [r["identical_to_reference"] for r in rows.values()] == [None, None, True, True]
    prompt_new = report["meta"]["new_tokens"]
    for mode in ("spec-standard", "spec-replay"):
        assert 1.0 <= rows[mode]["accepted_per_round"] <= 4 and rows[mode]["alpha"] == 0.8
        r = rows[mode]
        assert r["reference_converged"] and r["reference_runs"] == 1 and r["ar_agreeing_tokens"] == prompt_new
        assert abs(r["ideal_accepted"] - (1 - 0.8**4) / 0.2) < 1e-12 and r["speedup_same_state"] > 0
        assert rows[mode]["max_sequences"] == int(100 * 2**30 // rows[mode]["round_bytes_per_seq"])
    standard, replay = rows["spec-standard"], rows["spec-replay"]
    # The per-draft layout holds its W + 1 state slots between rounds too: the same bytes with a window pending.
    assert standard["round_bytes_per_seq"] == standard["cache_bytes_per_seq"]
    assert standard["cache_bytes_per_seq"] > rows["ar-standard"]["cache_bytes_per_seq"]
    assert replay["round_bytes_per_seq"] < standard["round_bytes_per_seq"]
    assert "spec-replay" in capsys.readouterr().out


# `slow` (42 s on the 2-core CI machine): speculative chains and trees through the model run by default in
# tests/test_speculative_loop.py, test_tree_loop.py and test_tree_model.py; the script's arguments in
# test_bench_scripts_refuse_bad_arguments_in_one_line.
@pytest.mark.slow
def test_spec_replay_and_tree_dry_run(tmp_path, capsys):
    """bench/spec.py --dry-run --tree 2,2 on the ReplaySSM state (L 8; tree-standard is skipped without its
    AR run; test_spec_dry_run, `slow`, adds the standard state's modes): ar-replay, then spec-replay with the
    oracle at alpha 0.8 and 1 and with the random MTP head (`--drafters`), then tree-replay at both alphas;
    each speculative mode's oracle reference its own (it reproduces its reference at alpha 1 and equals the
    AR output), every speculative row's greedy tokens equal to its reference, the tree's 5 nodes verified a
    round, the full depth accepted at alpha 1."""
    # The alphas of a mode share its compiled round (Generator.with_speculative).
    args = ["--dry-run", "--alphas", "0.8,1", "--buffer-len", "8", "--tree", "2,2", "--modes", "ar-replay,spec-replay"]
    assert load("spec").main(args + ["--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "spec.json").read_text())
    rows = {(r["mode"], r["drafter"], r["alpha"]): r for r in report["rows"]}
    assert list(rows) == [("ar-replay", None, None), ("spec-replay", "oracle", 0.8), ("spec-replay", "oracle", 1.0),
                          ("spec-replay", "mtp", None), ("tree-replay", "oracle", 0.8), ("tree-replay", "oracle", 1.0)]
    assert report["meta"]["tree"] == [2, 2] and report["meta"]["drafters"] == ["oracle", "mtp"]
    assert report["meta"]["backend"] == "xla" and report["meta"]["num_draft"] == 3
    ar = rows[("ar-replay", None, None)]
    assert ar["tokens_per_s"] > 0 and ar["identical_to_reference"] is None
    speculative = [r for key, r in rows.items() if key[0] != "ar-replay"]
    assert all(r["identical_to_reference"] and r["tokens_per_s"] > 0 for r in speculative)
    mtp = rows[("spec-replay", "mtp", None)]
    assert mtp["alpha"] is None and mtp["accepted_per_round"] >= 1
    prompt_new = report["meta"]["new_tokens"]
    r = rows[("spec-replay", "oracle", 0.8)]
    assert 1.0 <= r["accepted_per_round"] <= 4
    assert r["reference_converged"] and r["reference_runs"] == 1 and r["ar_agreeing_tokens"] == prompt_new
    assert abs(r["ideal_accepted"] - (1 - 0.8**4) / 0.2) < 1e-12 and r["speedup_same_state"] > 0
    assert r["max_sequences"] == int(100 * 2**30 // r["round_bytes_per_seq"])
    r = rows[("tree-replay", "oracle", 1.0)]
    assert r["verified_per_round"] == 5
    assert r["accepted_per_round"] > 2 and r["ideal_accepted"] == 3.0  # the full depth but in the last rounds
    assert r["round_bytes_per_seq"] > ar["round_bytes_per_seq"]
    # The oracle's tree: a right draft goes deeper, a right other candidate ends the path.
    assert load("spec").ideal_acceptance(0.8, 3, 2) == pytest.approx(1 + sum(0.8**d * (0.8 + 0.2 * 0.8)
                                                                             for d in range(2)))
    assert "tree-replay" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--num-draft", "4", "--buffer-len", "4"], "--num-draft + 1 = 5 verified positions must be <= --buffer-len = 4"),
    (["--tree", "2,2"], "--tree: 1 + TOPK * DEPTH = 5 verified positions must be <= --buffer-len = 4"),
    (["--alphas", "0.6,1.5"], "--alphas: every alpha must be in [0, 1]; got 1.5"),
    (["--batches", "0"], "--batches: must be >= 1; got 0"),
    (["--drafters", "oracle,eagle"], "--drafters: choose from oracle,mtp; got 'oracle,eagle'"),
], ids=["window", "tree", "alpha", "batch", "drafter"])
def test_spec_rejects_bad_arguments(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        load("spec").main(["--dry-run", "--out", str(tmp_path / "out"), *args])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before anything ran


# `slow` (31 s): the engine's prefix caching, n-gram speculation and int8 checkpoints run by default in
# tests/test_engine.py; the script's arguments in test_bench_scripts_refuse_bad_arguments_in_one_line.
@pytest.mark.slow
def test_serve_dry_run(tmp_path):
    """bench/serve.py --dry-run (ReplaySSM only): a row per prefix-caching setting, an n-gram speculative row
    and an int8-checkpoint row, with every request served, the Generator's reference, the JSON and the plot.
    Prompts of 16 tokens, two whole chunks of 8: one prefill shape per configuration to compile (the
    engine's chunks with a rest: tests/test_engine.py)."""
    assert load("serve").main(["--dry-run", "--states", "replay", "--speculative", "ngram", "--num-draft", "2",
                               "--state-dtype", "int8", "--prompt-len", "16,16", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "serve.json").read_text())
    assert [(r["state"], r["prefix_caching"], r["speculative"], r["state_dtype"]) for r in result["rows"]] == [
        ("replay", False, None, None), ("replay", True, None, None), ("replay", False, "ngram K=2", None),
        ("replay", False, None, "int8")]
    assert result["rows"][2]["accepted_per_round"] >= 1
    # Every dry-run prompt starts with the 8-token system prompt (one prefix block): the later requests restore it.
    assert result["rows"][1]["prefix_hits"] > 0 and result["rows"][1]["cached_tokens"] >= 8
    assert result["rows"][0]["prefix_hits"] == 0
    assert all(r["requests"] == 4 and r["tokens_per_s"] > 0 and r["ttft_ms"]["p50"] > 0 for r in result["rows"])
    assert result["generator"][0]["generator_tokens_per_s"] > 0
    assert (tmp_path / "serve.png").stat().st_size > 0


def test_kernels_against_original_matches_variants():
    """`kernels.against_original` pairs the standard step with vLLM's best config and each replay row with the
    original's default config at the same L and cursors; other rows, and rows without a peer, get nothing."""
    kb = load("kernels")
    base = dict(layer="gdn", state_dtype="float32", batch=256)
    original = [dict(base, variant="standard", which="default", us=400.0, kernel_us=390.0),
                dict(base, variant="standard", which="best", us=300.0, kernel_us=290.0),
                dict(base, variant="replay", L=16, cursors="in-step", config="default", us=200.0, kernel_us=180.0),
                dict(base, variant="replay", L=16, cursors="staggered", config="default", us=210.0, kernel_us=190.0)]
    kernels = {"gdn_replay_output_L16": {"us": 150.0}, "gdn_replay_flush_L16": {"us": 30.0}, "fusion_1": {"us": 9.0}}
    std = kb.against_original(dict(base, variant="standard", seconds=310e-6, kernels_us={"gdn_step": {"us": 290.0}}),
                              original)
    assert std["wall_over_original"] == pytest.approx(310 / 300) and std["kernel_over_original"] == pytest.approx(1.0)
    in_step = kb.against_original(dict(base, variant="replay-L16-in-step", L=16, cursors="in-step", seconds=198e-6,
                                       kernels_us=kernels), original)
    assert in_step["kernel_us"] == pytest.approx(180.0) and in_step["kernel_over_original"] == pytest.approx(1.0)
    assert in_step["wall_over_kernel"] == pytest.approx(198 / 180)
    staggered = kb.against_original(dict(base, variant="replay-L16", L=16, cursors="staggered", seconds=2e-4,
                                         kernels_us=None), original)
    assert staggered == {"original_us": 210.0, "original_kernel_us": 190.0, "wall_over_original": pytest.approx(200 / 210)}
    mosaic = {"gdn_append_tma_L16_bv64_st2_p264_mosaic_gpu_kernel": {"us": 150.0}, "gdn_direct_bv32": {"us": 30.0},
              "input_reduce_fusion": {"us": 9.0}, "(idle)": {"us": 4.0}}
    for variant in ("replay-L16-lockstep-tma", "replay-L16-lockstep"):  # the Mosaic GPU kernel, named or default
        tma = kb.against_original(dict(base, variant=variant, L=16, cursors="lockstep", seconds=2e-4,
                                       kernels_us=mosaic), original)
        assert tma["kernel_us"] == pytest.approx(189.0)  # every kernel of the step (its prelude too), not the idle
    triton = kb.against_original(dict(base, variant="replay-L16-lockstep-triton", L=16, cursors="lockstep",
                                      seconds=2e-4, kernels_us={**kernels, "(idle)": {"us": 4.0}}), original)
    assert triton["kernel_us"] == pytest.approx(180.0)  # the SSM kernels only
    assert kb.against_original(dict(base, variant="replay-L16-direct", L=16, cursors="empty", seconds=1e-4), original) == {}
    assert kb.against_original(dict(base, variant="replay-L8", L=8, cursors="staggered", seconds=1e-4), original) == {}


def test_conv_update_dry_run(tmp_path, capsys):
    """bench/conv_update.py --dry-run: both model shapes checked (the kernel's step against the XLA form's),
    both forms timed, the table printed."""
    assert load("conv_update").main(["--dry-run", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "conv_update.json").read_text())["rows"]
    assert [(r["shape"], r["batch"]) for r in rows] == [("qwen3.5-4b-gdn", 2), ("nemotron3-nano-4b", 2)]
    assert all(r["check"]["ok"] and r["check"]["ring_equal"] and r["interpret"]["us"] > 0 for r in rows)
    assert "| qwen3.5-4b-gdn | 2 |" in out


def test_conv_step_dry_run(tmp_path, capsys):
    """bench/conv_step.py --dry-run: both forms checked against the references (rings equal) and timed, the
    table printed, the fused form's bytes those of the two launches less q, k and v's write and read."""
    cs = load("conv_step")
    assert cs.main(["--dry-run", "--state-dtypes", "bfloat16", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "conv_step.json").read_text())["rows"]
    assert [(r["state_dtype"], r["batch"]) for r in rows] == [("bfloat16", 2)]
    for r in rows:
        assert all(r["check"][f]["ok"] and r["check"][f]["ring_equal"] and r[f]["us"] > 0 for f in cs.FORMS)
        assert r["two launches"]["bytes"] - r["fused"]["bytes"] == 2 * 2 * 2 * (2 * 2 * 32 + 4 * 32)
    assert "| bfloat16 | 2 |" in out


def test_attention_dry_run(tmp_path, capsys):
    """bench/attention.py --dry-run: both model shapes checked (the kernel against XLA's products), both
    forms timed, the table printed, the kernel's bytes those of the live positions."""
    assert load("attention").main(["--dry-run", "--tilings", "16:2:2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "attention.json").read_text())["rows"]
    assert [(r["shape"], r["batch"]) for r in rows] == [("qwen3.5-4b", 2), ("nemotron3-nano-4b", 2)]
    swept = [[r[k]["us"] for k in r if k.startswith("interpret bt16_w2_s2_p")] for r in rows]  # the default's parts
    assert all(r["check"]["ok"] and r["interpret"]["us"] > 0 for r in rows) and all(len(t) == 1 and t[0] > 0
                                                                                      for t in swept)
    assert all(r["interpret"]["bytes"] < r["xla"]["bytes"] for r in rows)  # 33 of 40 positions
    assert "| qwen3.5-4b | 2 |" in out and "| qwen3.5-4b | 2 | bt16_w2_s2_p" in out
    with pytest.raises(SystemExit):
        load("attention").main(["--dry-run", "--tilings", "16:2"])


def test_step_roofline_counts_the_lockstep_flush():
    """bench/step_roofline.py: a Generator in lockstep moves each checkpoint 1 + 1/L times a step (read, and
    written by the direct step once a cycle) where the replay step's flush moves it 1 + 2/L times."""
    import jax
    import numpy as np

    from models import load_model
    from replayssm_jax.generation import Generator
    from replayssm_jax.layers.cache import ReplayLayerState

    roofline = load("step_roofline")
    model = load_model(pathlib.Path(__file__).parent / "data" / "nemotron_h_tiny")
    bounds = {}
    for lockstep in (False, True):
        gen = Generator(model, state="replay", buffer_len=4, backend="xla", route="output", lockstep=lockstep)
        bounds[lockstep] = roofline.decode_roofline(gen, 2, 8, 8, copy_gbps=1.0, matmul_tflops=1.0)
    ids = np.zeros((2, 8), np.int32)
    cache = jax.eval_shape(lambda: model.prefill(ids, 16, replay_buffer_len=4, backend="xla")[1])
    checkpoints = sum(np.prod(layer.replay.checkpoint.shape) * layer.replay.checkpoint.dtype.itemsize
                      for layer in cache.layers if isinstance(layer, ReplayLayerState))
    saved = (bounds[False]["state_gib"] - bounds[True]["state_gib"]) * 2**30
    assert checkpoints > 0 and saved == pytest.approx(checkpoints / 4, rel=1e-6)


def test_step_roofline_counts_the_attention_kernel():
    """bench/step_roofline.py: with the decode attention kernel (no dots), the attention term is the kernel's
    traffic, the KV caches at the live length: within a fifth of XLA's products' (which also write and read
    the scores), and the other terms unchanged."""
    from models import load_model
    from replayssm_jax.generation import Generator

    roofline = load("step_roofline")
    model = load_model(pathlib.Path(__file__).parent / "data" / "qwen3_5_tiny")
    bounds = {}
    for backend in ("xla", "interpret"):
        model.set_attention_decode_backend(backend)
        gen = Generator(model, state="replay", buffer_len=4, backend="xla", route="output")
        bounds[backend] = roofline.decode_roofline(gen, 2, 8, 8, copy_gbps=1.0, matmul_tflops=1.0)
    xla, kernel = bounds["xla"], bounds["interpret"]
    assert 0 < kernel["attention_ms"] == pytest.approx(xla["attention_ms"], rel=0.2)
    assert (kernel["gemm_ms"], kernel["state_ms"]) == (xla["gemm_ms"], xla["state_ms"])
    # the caches at the live length, the other operands whole: 13 live positions of 16 or of 17 (head_dim 16,
    # as max_len 16: only the caches' axis is cut), the same attention bytes
    same_live = [roofline.decode_roofline(gen, 2, prompt, new, copy_gbps=1.0, matmul_tflops=1.0)["attention_ms"]
                 for prompt, new in ((10, 6), (9, 8))]
    assert same_live[0] == pytest.approx(same_live[1], rel=1e-12)
