import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import relu as rl
from proto.device.backend import cuda
from tests.helpers import assert_close, dev, rand


@given(shape=st.lists(st.integers(1, 7), min_size=1, max_size=4), seed=st.integers(0, 2**16),
       in_place=st.booleans())
def test_relu_forward_matches_reference(shape, seed, in_place, scale):
    x = rand(np.random.default_rng(seed), *shape[:-1], shape[-1] * scale)
    dx = dev(x)
    out = dx if in_place else cuda.device_array_like(x)
    rl.relu(dx, out)
    assert_close(out, rl.relu_ref(x), "elementwise")


@given(n=st.integers(1, 300), seed=st.integers(0, 2**16), in_place=st.booleans())
def test_relu_backward_masks_where_output_is_zero(n, seed, in_place, scale):
    rng = np.random.default_rng(seed)
    y = rl.relu_ref(rand(rng, 2, n * scale))        # a ReLU output: exact zeros included
    dy = rand(rng, 2, n * scale)
    ddy = dev(dy)
    dx = ddy if in_place else cuda.device_array_like(dy)
    rl.relu_bwd(dev(y), ddy, dx)
    assert_close(dx, rl.relu_bwd_ref(y, dy), "elementwise")


def test_rejects_bad_input_before_launch():
    x = dev(np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="x: expected a device array"):
        rl.relu(np.zeros((2, 3), np.float32), x)
    with pytest.raises(ValueError, match=r"out: expected the shape of x \(2, 3\)"):
        rl.relu(x, dev(np.zeros((3, 2), np.float32)))
    with pytest.raises(TypeError, match="dy: expected dtype float32"):
        rl.relu_bwd(x, dev(np.zeros((2, 3), np.float64)), x)


def test_nan_stays_nan_as_in_the_reference():
    """max(x, 0) would be fmaxf on the GPU, which turns NaN into 0; NumPy keeps NaN."""
    x = np.array([np.nan, -1.0, 2.0, -np.inf, np.inf, -0.0], np.float32)
    out = cuda.device_array_like(x)
    rl.relu(dev(x), out)
    np.testing.assert_array_equal(out.copy_to_host(), rl.relu_ref(x))
