"""The comparison helpers of replayssm_jax.testing: the on-device form gives the host form's verdict."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from replayssm_jax import testing


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_closeness_on_device_matches_the_float64_form(dtype, rng):
    expected = rng.standard_normal((3, 5, 40)).astype(np.float32)
    atol, rtol = testing.TOLERANCES[jnp.dtype(dtype)]
    allowed = atol + rtol * np.abs(expected).max()
    for error in (0.3 * allowed, 3.0 * allowed):  # one within the tolerance, one outside
        actual = expected.copy()
        actual[rng.integers(3), rng.integers(5), rng.integers(40)] += error * rng.choice([-1.0, 1.0])
        host = testing.closeness(actual, expected, dtype)
        device = testing.closeness_on_device(jnp.asarray(actual).astype(dtype), jnp.asarray(expected), dtype)
        want = testing.closeness(np.asarray(jnp.asarray(actual).astype(dtype), np.float32), expected, dtype)
        assert device.ok == want.ok and device.finite and host.ok == (error < allowed)
        np.testing.assert_allclose([device.max_abs, device.allowed, device.rel],
                                   [want.max_abs, want.allowed, want.rel], rtol=1e-5)


def test_closeness_on_device_refuses_nan_and_other_shapes(rng):
    expected = rng.standard_normal(64).astype(np.float32)
    actual = expected.copy()
    actual[rng.integers(64)] = np.nan
    assert not testing.closeness_on_device(actual, expected).ok
    assert not testing.closeness_on_device(actual, expected).finite
    with pytest.raises(ValueError, match=r"shape \(63,\) != expected \(64,\)"):
        testing.closeness_on_device(actual[:63], expected)
