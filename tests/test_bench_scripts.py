"""The benchmark scripts run end to end on the CPU in their check modes
(tiny shapes, interpret mode): their numbers mean nothing here, but a script
that no longer runs is caught before a GPU session finds out."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).parent.parent / "bench"

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated:DeprecationWarning")


def load(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_e2e_smoke(tmp_path, capsys):
    out = tmp_path / "e2e.json"
    assert load("e2e").main(["--smoke", "--models", "nemotron_h_tiny", "--batches", "2", "--modes", "standard,2",
                             "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["standard", "2"]
    assert all(r["tokens_per_s"] > 0 and r["identical_to_standard"] for r in rows)
    assert "nemotron_h_tiny" in capsys.readouterr().out


def test_buffer_length_dry_run(tmp_path, capsys):
    assert load("buffer_length").main(["--dry-run", "--layers", "mamba2", "--state-dtypes", "float32",
                                       "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "buffer_length.json").read_text())["rows"]
    assert {r["L"] for r in rows} == {1, 2} and all(r["passed"] for r in rows)
    assert (tmp_path / "buffer_length_vs_L.png").stat().st_size > 0
    assert "best L per shape" in capsys.readouterr().out
