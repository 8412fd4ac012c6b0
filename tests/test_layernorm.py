"""layernorm against its float64 reference: irregular widths, rows with a large mean (the
case a one-pass E[x^2] - mean^2 variance gets wrong), in place, validation before launch."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import layernorm as L
from kernels._reduce import WARP_ELEMS
from proto.device.backend import cuda
from tests.helpers import assert_close, dev, rand


@given(rows=st.integers(1, 6), cols=st.integers(1, 70), offset=st.sampled_from([0.0, 1e3]),
       seed=st.integers(0, 2**16))
def test_matches_reference(rows, cols, offset, seed, scale):
    rng = np.random.default_rng(seed)
    x = rand(rng, rows, cols * scale) + np.float32(offset)
    gamma, beta = rand(rng, cols * scale), rand(rng, cols * scale)
    out = cuda.device_array_like(x)
    L.layernorm(dev(x), dev(gamma), dev(beta), out)
    # A row offset of 1e3 costs float32 x about 3 digits of its spread: 6e-5 absolute
    # error in x - mean, amplified by rstd ~ 1, hence atol 1e-3 there.
    atol = 1e-3 if offset else 1e-5
    np.testing.assert_allclose(out.copy_to_host(), L.layernorm_ref(x, gamma, beta),
                               atol=atol, rtol=1e-4)


@pytest.mark.parametrize("cols", sorted({c for e in WARP_ELEMS for c in (32 * e - 1, 32 * e, 32 * e + 1)}))
def test_each_warp_width_and_past_it_in_place(cols):
    """Rows up to 32 * E take a warp each, wider ones a block; 5 rows leave the second block
    of 4 warps three without a row. In place, with a large row mean."""
    rng = np.random.default_rng(cols)
    x = rand(rng, 5, cols) + np.float32(100.0)
    gamma, beta = rand(rng, cols), rand(rng, cols)
    dx = dev(x)
    L.layernorm(dx, dev(gamma), dev(beta), dx)
    np.testing.assert_allclose(dx.copy_to_host(), L.layernorm_ref(x, gamma, beta), atol=2e-4, rtol=1e-4)


# Past the warp kernels: the narrowest row the block kernels take, each row kernel's widest
# (8 and 16 values a thread at the most threads a block) and one past it, the last read
# from memory for each pass
ROW_COLS = [32 * max(WARP_ELEMS) + 1] + [c for e in L.ROW_ELEMS
                                         for c in (e * L.MAX_THREADS, e * L.MAX_THREADS + 1)]


@pytest.mark.parametrize("cols", ROW_COLS)
def test_block_rows_in_registers_and_past_them_in_place(cols):
    rng = np.random.default_rng(cols)
    x = rand(rng, 3, cols) + np.float32(100.0)
    gamma, beta = rand(rng, cols), rand(rng, cols)
    dx = dev(x)
    L.layernorm(dx, dev(gamma), dev(beta), dx)
    np.testing.assert_allclose(dx.copy_to_host(), L.layernorm_ref(x, gamma, beta), atol=2e-4,
                               rtol=1e-4)
    h = (rng.standard_normal((3, cols)) + 10.0).astype(np.float16)
    gh, bh = (rng.standard_normal(cols).astype(np.float16) for _ in range(2))
    out = dev(np.full(h.shape, np.nan, np.float16))
    L.layernorm(dev(h), dev(gh), dev(bh), out)
    want, xh, sigma = _layernorm64(h, gh, bh, 1e-5)
    err = np.abs(out.copy_to_host().astype(np.float64) - want) - _half_bound(h, gh, bh, want,
                                                                              xh, sigma)
    assert np.all(err <= 0), float(err.max())


def test_in_place_and_eps():
    rng = np.random.default_rng(3)
    x = rand(rng, 3, 37)
    x[1] = 2.0  # a constant row: var 0, so eps alone sets the scale
    gamma, beta = rand(rng, 37), rand(rng, 37)
    dx = dev(x)
    L.layernorm(dx, dev(gamma), dev(beta), dx, eps=1e-2)
    assert_close(dx, L.layernorm_ref(x, gamma, beta, eps=1e-2))


def test_rejects_bad_input_before_launch():
    x = dev(np.ones((2, 5), np.float32))
    g = dev(np.ones(5, np.float32))
    with pytest.raises(TypeError, match="x: expected a device array"):
        L.layernorm(np.ones((2, 5), np.float32), g, g, x)
    with pytest.raises(ValueError, match=r"gamma: expected shape \(5,\)"):
        L.layernorm(x, dev(np.ones(4, np.float32)), g, x)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 5\)"):
        L.layernorm(x, g, g, dev(np.ones((5, 2), np.float32)))
    with pytest.raises(TypeError, match="beta: expected dtype float32"):
        L.layernorm(x, g, dev(np.ones(5, np.float64)), x)
    with pytest.raises(ValueError, match="x: expected 2 dimensions"):
        L.layernorm(dev(np.ones(5, np.float32)), g, g, x)
    with pytest.raises(ValueError, match="eps: expected a positive number"):
        L.layernorm(x, g, g, x, eps=0.0)
    np.testing.assert_array_equal(x.copy_to_host(), 1.0)  # nothing ran


# ---------------------------------------------------------------------------- half precision
# The kernel reads float16, computes the row's mean and variance and the normalization in
# float32, and rounds the float16 result once as it stores it. Against float64 on the same
# float16 values, by the usual bound for a float32 sum of n terms (n 2^-24 of their
# magnitude): the mean is off by at most n U32 max|x|, the variance correspondingly, so the
# normalized value xh = (x - mean) / sigma by at most e = 4 n U32 (max|x| / sigma + 1)(1 + |xh|);
# then gamma * xh + beta in float32 (2 U32 of its terms) and the one float16 rounding
# (2^-11 of the result, 2^-25 below the normal range).
U16, U32 = 2.0 ** -11, 2.0 ** -24


def _layernorm64(x, gamma, beta, eps):
    x = x.astype(np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    sigma = np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    xh = (x - mean) / sigma
    return xh * gamma.astype(np.float64) + beta.astype(np.float64), xh, sigma


def _half_bound(x, gamma, beta, want, xh, sigma):
    n = x.shape[-1]
    x, g, b = (np.abs(a.astype(np.float64)) for a in (x, gamma, beta))
    e = 4 * n * U32 * (x.max(axis=-1, keepdims=True) / sigma + 1) * (1 + np.abs(xh))
    return g * e + 2 * U32 * (g * np.abs(xh) + b) + U16 * np.abs(want) + 2.0 ** -25


@given(rows=st.integers(1, 6), cols=st.integers(1, 70), offset=st.sampled_from([0.0, 100.0]),
       seed=st.integers(0, 2**16))
def test_half_precision_rounds_once(rows, cols, offset, seed, scale):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols * scale)) + offset).astype(np.float16)
    gamma, beta = (rng.standard_normal(cols * scale).astype(np.float16) for _ in range(2))
    dx = dev(x)
    L.layernorm(dx, dev(gamma), dev(beta), dx)   # in place, as the fused paths use it
    want, xh, sigma = _layernorm64(x, gamma, beta, 1e-5)
    got = dx.copy_to_host()
    assert got.dtype == np.float16
    err = np.abs(got.astype(np.float64) - want) - _half_bound(x, gamma, beta, want, xh, sigma)
    assert np.all(err <= 0), float(err.max())


def test_half_and_single_precision_do_not_mix():
    h, f = dev(np.ones((2, 5), np.float16)), dev(np.ones((2, 5), np.float32))
    g16, g32 = dev(np.ones(5, np.float16)), dev(np.ones(5, np.float32))
    with pytest.raises(TypeError, match="gamma: expected dtype float16, got float32"):
        L.layernorm(h, g32, g16, h)
    with pytest.raises(TypeError, match="out: expected dtype float32, got float16"):
        L.layernorm(f, g32, g32, h)
