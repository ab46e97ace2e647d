"""Shared fixtures. Random inputs are drawn fresh on every run; the seed is
printed (pytest shows it for a failing test) and REPLAYSSM_TEST_SEED replays it."""

from __future__ import annotations

import os
import secrets

import numpy as np
import pytest


@pytest.fixture
def rng(request):
    seed = int(os.environ.get("REPLAYSSM_TEST_SEED", secrets.randbits(63)))
    print(f"{request.node.nodeid}: REPLAYSSM_TEST_SEED={seed}")
    return np.random.default_rng(seed)
