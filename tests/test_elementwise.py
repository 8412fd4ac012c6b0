import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import elementwise as ew
from proto.device.backend import cuda
from tests.helpers import assert_close, dev, rand


@given(n=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_gelu_matches_reference(n, seed, scale):
    x = rand(np.random.default_rng(seed), n * scale, scale=3.0)
    out = cuda.device_array_like(x)
    ew.gelu(dev(x), out)
    assert_close(out, ew.gelu_ref(x), "elementwise")


@given(rows=st.integers(1, 9), cols=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_add_in_place_matches_reference(rows, cols, seed, scale):
    rng = np.random.default_rng(seed)
    a, b = rand(rng, rows, cols * scale), rand(rng, rows, cols * scale)
    da = dev(a)
    ew.add(da, dev(b), da)  # residual add writes into its first input
    assert_close(da, ew.add_ref(a, b), "elementwise")


def test_rejects_bad_input_before_launch():
    x = dev(np.zeros(8, np.float32))
    with pytest.raises(TypeError, match="device array"):
        ew.gelu(np.zeros(8, np.float32), x)
    with pytest.raises(TypeError, match="dtype float32"):
        ew.gelu(dev(np.zeros(8, np.float64)), x)
    with pytest.raises(ValueError, match=r"shape of a \(8,\)"):
        ew.add(x, x, dev(np.zeros(9, np.float32)))
