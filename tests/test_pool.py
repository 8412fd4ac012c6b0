import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import pool
from proto.device.backend import cuda
from tests.helpers import assert_close, dev, rand


@st.composite
def pool_inputs(draw, scale=1):
    N, C = draw(st.integers(1, 2)), draw(st.integers(1, 3)) * scale
    H, W = draw(st.integers(2, 9)), draw(st.integers(2, 9))   # odd sizes drop a row/column
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    x = rand(rng, N, C, H, W)
    if draw(st.booleans()):    # ties: few distinct values, so windows hold equal maxima
        x = np.round(x).astype(np.float32)
    return x, rng


@given(data=st.data())
def test_maxpool_forward_matches_reference(data, scale):
    x, _ = data.draw(pool_inputs(scale))
    N, C, H, W = x.shape
    out = cuda.device_array((N, C, H // 2, W // 2), np.float32)
    pool.maxpool2x2(dev(x), out)
    assert_close(out, pool.maxpool2x2_ref(x), "elementwise")


@given(data=st.data())
def test_maxpool_backward_routes_to_the_first_maximum(data, scale):
    x, rng = data.draw(pool_inputs(scale))
    N, C, H, W = x.shape
    dy = rand(rng, N, C, H // 2, W // 2)
    dx = dev(np.full(x.shape, np.nan, np.float32))    # every element must be written
    pool.maxpool2x2_bwd(dev(x), dev(dy), dx)
    ref = pool.maxpool2x2_bwd_ref(x, dy)
    assert_close(dx, ref, "elementwise")
    assert np.isclose(ref.sum(), dy.sum(), rtol=1e-4, atol=1e-4)   # each dy lands exactly once


@given(data=st.data(), in_place=st.booleans())
def test_maxpool_backward_through_a_relu_passes_only_positive_maxima(data, in_place, scale):
    x, rng = data.draw(pool_inputs(scale))
    y = np.maximum(x, 0).astype(np.float32)     # a ReLU output: windows of zeros tie
    N, C, H, W = y.shape
    dy = rand(rng, N, C, H // 2, W // 2)
    dx = dev(y) if in_place else dev(np.full(y.shape, np.nan, np.float32))
    pool.maxpool2x2_bwd(dx if in_place else dev(y), dev(dy), dx, relu_mask=True)
    # the window's first maximum gets dy if that maximum is > 0; everything else 0
    want = np.zeros_like(y)
    for n, c, p, q in np.ndindex(N, C, H // 2, W // 2):
        win = y[n, c, 2 * p:2 * p + 2, 2 * q:2 * q + 2].ravel()
        k = int(np.argmax(win))
        if win[k] > 0:
            want[n, c, 2 * p + k // 2, 2 * q + k % 2] = dy[n, c, p, q]
    np.testing.assert_array_equal(dx.copy_to_host(), want)


def test_reference_matches_a_hand_example():
    x = np.array([[[[1, 3, 0], [3, 2, 5], [9, 9, 9]]]], np.float32)   # tie in the window: 3, 3
    assert pool.maxpool2x2_ref(x).tolist() == [[[[3.0]]]]
    dx = pool.maxpool2x2_bwd_ref(x, np.array([[[[7.0]]]], np.float32))
    assert dx.tolist() == [[[[0, 7, 0], [0, 0, 0], [0, 0, 0]]]]   # first maximum in row order


def test_rejects_bad_input_before_launch():
    x = dev(np.zeros((1, 2, 5, 4), np.float32))
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 2, 2, 2\)"):
        pool.maxpool2x2(x, dev(np.zeros((1, 2, 3, 2), np.float32)))
    with pytest.raises(ValueError, match="x: 2x2 pooling needs H, W >= 2"):
        pool.maxpool2x2(dev(np.zeros((1, 1, 1, 4), np.float32)), x)
    with pytest.raises(ValueError, match=r"dx: expected shape \(1, 2, 5, 4\)"):
        pool.maxpool2x2_bwd(x, dev(np.zeros((1, 2, 2, 2), np.float32)),
                            dev(np.zeros((1, 2, 4, 4), np.float32)))


def test_nan_in_a_window_is_its_maximum_as_in_the_reference():
    """max() would drop a NaN (fmaxf on the GPU, Python's argument order on the simulator);
    the kernels keep it, forward, and route the gradient to the window's first NaN."""
    x = np.arange(1 * 2 * 4 * 4, dtype=np.float32).reshape(1, 2, 4, 4)
    # NaN at each window position k = 0..3; the last window holds three (the first is k = 1)
    for n, c, h, w in ((0, 0, 0, 0), (0, 0, 1, 3), (0, 1, 1, 0), (0, 1, 3, 0), (0, 1, 3, 1),
                       (0, 1, 2, 1)):
        x[n, c, h, w] = np.nan
    dy = np.arange(1, 9, dtype=np.float32).reshape(1, 2, 2, 2)
    out, dx = cuda.device_array((1, 2, 2, 2), np.float32), cuda.device_array(x.shape, np.float32)
    pool.maxpool2x2(dev(x), out)
    pool.maxpool2x2_bwd(dev(x), dev(dy), dx)
    want = pool.maxpool2x2_ref(x)
    assert np.isnan(want).sum() == 4
    np.testing.assert_array_equal(out.copy_to_host(), want)          # NaN where NaN, equal elsewhere
    np.testing.assert_array_equal(dx.copy_to_host(), pool.maxpool2x2_bwd_ref(x, dy))
