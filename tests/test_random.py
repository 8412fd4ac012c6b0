"""kernels.random.normal against its NumPy restatement (normal_ref), its moments, its
independence from the launch grid, and argument checks."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import random
from proto.device.backend import cuda
from tests.helpers import dev

U16, U32 = 2.0 ** -11, 2.0 ** -24
# float32 against float64: u1 and u2 are exact (24-bit integers times 2^-24); ln, sqrt and
# the products a few float32 ulps of |z| <= 5.8; the fast cosine 2^-21.4 absolute, times r.
ATOL = 6 * 2.0 ** -21.4 + 16 * U32 * 6


@given(n=st.integers(1, 700), seed=st.integers(0, 2**64 - 1),
       std=st.sampled_from([1.0, 0.02]), mean=st.sampled_from([0.0, 1.0]))
def test_normal_is_its_reference(n, seed, std, mean):
    out = cuda.device_array(n, np.float32)
    random.normal(out, seed=seed, std=std, mean=mean)
    want = mean + std * random.normal_ref(n, seed)
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=4 * U32, atol=std * ATOL)


def test_half_precision_rounds_its_value_once():
    out = cuda.device_array((30, 41), np.float16)
    random.normal(out, seed=7, std=0.02)
    want = 0.02 * random.normal_ref(out.size, 7).reshape(out.shape)
    err = np.abs(out.copy_to_host().astype(np.float64) - want)
    assert np.all(err <= U16 * np.abs(want) + 2.0 ** -25 + 0.02 * ATOL)


def test_moments_of_a_large_draw(scale):
    """Mean and variance of N(0, 1) within five standard errors."""
    n = 4096 * scale * scale
    out = cuda.device_array(n, np.float32)
    random.normal(out, seed=3)
    z = out.copy_to_host().astype(np.float64)
    assert abs(z.mean()) < 5 / np.sqrt(n)
    assert abs(z.var() - 1) < 5 * np.sqrt(2 / n)
    assert np.abs(z).max() <= np.sqrt(-2 * np.log(2.0 ** -24)) + 1e-5


def test_the_grid_does_not_change_the_values(monkeypatch):
    out = cuda.device_array(1000, np.float32)
    random.normal(out, seed=11)
    monkeypatch.setattr(random, "THREADS", 32)
    other = dev(np.zeros(1000, np.float32))
    random.normal(other, seed=11)
    np.testing.assert_array_equal(out.copy_to_host(), other.copy_to_host())
    random.normal(other, seed=12)
    assert not np.array_equal(out.copy_to_host(), other.copy_to_host())


def test_rejects_bad_arguments():
    out = cuda.device_array(4, np.float32)
    with pytest.raises(ValueError, match="seed: expected an integer"):
        random.normal(out, seed=-1)
    with pytest.raises(ValueError, match="std: expected a finite number"):
        random.normal(out, std=float("nan"))
    with pytest.raises(TypeError, match="out: expected dtype float32 or float16, got float64"):
        random.normal(cuda.device_array(4, np.float64))
    with pytest.raises(TypeError, match="out: expected a device array"):
        random.normal(np.zeros(4, np.float32))
