import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import linear as fc
from proto.device.backend import cuda
from tests.helpers import dev, rand

EPS32 = float(np.finfo(np.float32).eps)


def assert_sum_close(actual, expected, length):
    """float32 sums of `length` unit-scale products: error ~ length * eps32 (see test_conv)."""
    np.testing.assert_allclose(actual.copy_to_host(), expected, rtol=1e-4,
                               atol=max(1e-5, 4 * length * EPS32))


@given(B=st.integers(1, 12), I=st.integers(1, 40), O=st.integers(1, 40),
       bias=st.booleans(), relu=st.booleans(), seed=st.integers(0, 2**16))
def test_linear_forward_and_backward_match_reference(B, I, O, bias, relu, seed, scale):
    rng = np.random.default_rng(seed)
    I, O = I * scale, O * scale
    x, w, b, dy = rand(rng, B, I), rand(rng, O, I), rand(rng, O), rand(rng, B, O)
    y = cuda.device_array((B, O), np.float32)
    fc.linear(dev(x), dev(w), dev(b) if bias else None, y, relu=relu)
    assert_sum_close(y, fc.linear_ref(x, w, b if bias else None, relu=relu), I)
    ref_dx, ref_dw, ref_db = fc.linear_bwd_ref(x, w, dy)
    dx = cuda.device_array((B, I), np.float32)
    fc.linear_bwd_data(dev(dy), dev(w), dx)
    assert_sum_close(dx, ref_dx, O)
    dw, db = dev(np.full((O, I), np.nan, np.float32)), dev(np.full(O, np.nan, np.float32))
    fc.linear_bwd_weight(dev(x), dev(dy), dw, db)
    assert_sum_close(dw, ref_dw, B)
    assert_sum_close(db, ref_db, B)


def test_rejects_bad_input_before_launch():
    x, w = dev(np.zeros((2, 3), np.float32)), dev(np.zeros((4, 3), np.float32))
    with pytest.raises(ValueError, match=r"w: expected \(O, 5\) to match x"):
        fc.linear(dev(np.zeros((2, 5), np.float32)), w, None, dev(np.zeros((2, 4), np.float32)))
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 4\)"):
        fc.linear(x, w, None, dev(np.zeros((2, 3), np.float32)))
    with pytest.raises(ValueError, match=r"db: expected shape \(4,\)"):
        fc.linear_bwd_weight(x, dev(np.zeros((2, 4), np.float32)), w, dev(np.zeros(3, np.float32)))
