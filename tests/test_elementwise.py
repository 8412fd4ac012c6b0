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


# ---------------------------------------------------------------------------- half precision
# The kernels compute in float32 and round a float16 result once, as it is stored. Against a
# float64 evaluation on the same (float16) inputs, the error is that one rounding, at most
# U16 = 2^-11 of the result (round to nearest, 11-bit significand) or half the smallest
# subnormal (2^-25) below the normal range, plus float32's own: 2^-24 relative for the add,
# and for GELU's tanh a few float32 ulps of the terms 0.5 * x * (1 + tanh) (16 allowed).
U16, U32 = 2.0 ** -11, 2.0 ** -24


def _gelu64(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (x + 0.044715 * x ** 3)))


def _halves(rng, n, bound):
    return rng.uniform(-bound, bound, n).astype(np.float16)


@given(n=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_gelu_in_half_precision_rounds_once(n, seed, scale):
    x = _halves(np.random.default_rng(seed), n * scale, 8.0)
    out = dev(np.zeros_like(x))
    ew.gelu(dev(x), out)
    got, want = out.copy_to_host().astype(np.float64), _gelu64(x)
    assert out.dtype == np.float16
    bound = U16 * np.abs(want) + 2.0 ** -25 + 16 * U32 * (1 + np.abs(x.astype(np.float64)))
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) - bound))


@given(n=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_add_in_half_precision_rounds_once(n, seed, scale):
    rng = np.random.default_rng(seed)
    a, b = _halves(rng, n * scale, 1000.0), _halves(rng, n * scale, 1000.0)
    da = dev(a)
    ew.add(da, dev(b), da)
    want = a.astype(np.float64) + b.astype(np.float64)
    got = da.copy_to_host().astype(np.float64)
    assert np.all(np.abs(got - want) <= (U16 + U32) * np.abs(want) + 2.0 ** -25)


def test_half_and_single_precision_do_not_mix():
    h, f = dev(np.zeros(8, np.float16)), dev(np.zeros(8, np.float32))
    with pytest.raises(TypeError, match="out: expected dtype float16, got float32"):
        ew.gelu(h, f)
    with pytest.raises(TypeError, match="b: expected dtype float32, got float16"):
        ew.add(f, h, f)
    with pytest.raises(TypeError, match="float32 or float16, got float64"):
        ew.add(dev(np.zeros(8, np.float64)), h, h)


def test_half_precision_kernels_run_in_graphs_and_under_predication():
    """A kernel per dtype keeps one signature each: a graph records the float16 one, and its
    predicated twin (Grape's predication) is built from it like any other."""
    from proto.device.backend import predicated
    from proto.graph import capture
    a = dev(np.arange(6, dtype=np.float16))
    b = dev(np.full(6, 0.5, np.float16))
    out = dev(np.zeros(6, np.float16))
    with capture(lambda a, b: ew.add(a, b, out), {"a": a, "b": b}, binding="alias") as g:
        g.replay(a=a, b=b)
        np.testing.assert_array_equal(out.copy_to_host(), np.arange(6) + 0.5)
    twin = predicated(ew.add_kernels[np.dtype(np.float16)])
    assert twin is not predicated(ew.add_kernels[np.dtype(np.float32)])
