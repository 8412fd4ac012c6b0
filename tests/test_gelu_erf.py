"""Exact (erf) GELU, forward and backward (kernels.elementwise.gelu_erf, gelu_erf_bwd).

Tolerances, with u = 2^-24 (float32's unit roundoff). The forward computes 0.5 x erfc(-x/√2):
erfcf is within a few ulps (CUDA documents 4); the argument -x * float32(1/√2) is off by
up to 1.3 u relative (0.3 u from rounding 1/√2, u from the product), which moves erfc by
|z erfc'(z) / erfc(z)| 1.3 u, at most ~2 z^2 1.3 u = 1.3 x^2 u in the negative tail; two
products round: |error| <= (8 + 2 x^2) u |gelu(x)|. The backward adds v phi(v), phi
through expf of -x^2/2 (relative error ~x^2/2 u from its argument, a few ulps of its own),
and a sum that cancels near the derivative's zero (x ~ -0.75): an absolute bound on the
terms' size, 16 (1 + x^2) u |dy| (Phi(x) + |x| phi(x)). A float32 subnormal result is off by its spacing
at most: 2^-149, covered by atol 1e-40.
"""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import elementwise as ew
from proto.device.backend import cuda
from tests.helpers import FULL_SIZE, dev, rand

U = 2.0 ** -24
TINY = 1e-40


def _xs(rng, n):
    """Normal values of spread 3, with the edges mixed in: zero, the derivative's zero,
    the far negative tail (gelu ~ 1e-23 at -10), large positives."""
    x = rand(rng, n, scale=3.0)
    edges = np.float32([0.0, -0.0, -0.7517916, -5.0, -10.0, -13.0, 8.0, 30.0, 1e-30, -1e-30])
    k = min(n, edges.size)
    x[rng.choice(n, k, replace=False)] = edges[:k]
    return x


def _phi_terms(x):
    x = x.astype(np.float64)
    cdf = 0.5 * np.vectorize(math.erfc)(-x / math.sqrt(2.0))
    return cdf + np.abs(x) * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _assert_forward(got, x):
    want = ew.gelu_erf_ref(x, np.float64)
    x64 = x.astype(np.float64)
    bound = (8 + 2 * x64 * x64) * U * np.abs(want) + TINY
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), (x[np.argmax(err - bound)], float(np.max(err - bound)))


def _assert_backward(got, x, dy):
    want = ew.gelu_erf_bwd_ref(x, dy, np.float64)
    x64 = x.astype(np.float64)
    bound = 16 * (1 + x64 * x64) * U * np.abs(dy.astype(np.float64)) * _phi_terms(x) + TINY
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), (x[np.argmax(err - bound)], float(np.max(err - bound)))


@given(n=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_gelu_erf_matches_reference(n, seed, scale):
    x = _xs(np.random.default_rng(seed), n * scale)
    out = cuda.device_array_like(x)
    ew.gelu_erf(dev(x), out)
    _assert_forward(out.copy_to_host(), x)


@given(rows=st.integers(1, 7), cols=st.integers(1, 50), seed=st.integers(0, 2**16))
def test_gelu_erf_bwd_matches_reference(rows, cols, seed, scale):
    rng = np.random.default_rng(seed)
    x = _xs(rng, rows * cols * scale).reshape(rows, cols * scale)
    dy = rand(rng, rows, cols * scale)
    dx = cuda.device_array_like(x)
    ew.gelu_erf_bwd(dev(x), dev(dy), dx)
    _assert_backward(dx.copy_to_host(), x, dy)


def test_in_place_forward_and_backward():
    """out over x; dx over dy, and dx over x: each element is read before it is written."""
    rng = np.random.default_rng(1)
    x, dy = _xs(rng, 37).reshape(37, 1), rand(rng, 37, 1)
    dxx = dev(x)
    ew.gelu_erf(dxx, dxx)
    _assert_forward(dxx.copy_to_host(), x)
    ddy = dev(dy)
    ew.gelu_erf_bwd(dev(x), ddy, ddy)
    _assert_backward(ddy.copy_to_host(), x, dy)
    dxx = dev(x)
    ew.gelu_erf_bwd(dxx, dev(dy), dxx)
    _assert_backward(dxx.copy_to_host(), x, dy)


@given(seed=st.integers(0, 2**16))
def test_backward_reference_is_the_forward_references_derivative(seed):
    """Central differences of the float64 forward: truncation h^2 |f'''| / 6 (|f'''| < 1)
    plus rounding ~ 1e-16 / h; h = 1e-5 keeps both below 1e-10."""
    x = _xs(np.random.default_rng(seed), 64).astype(np.float64)
    h = 1e-5
    fd = (ew.gelu_erf_ref(x + h, np.float64) - ew.gelu_erf_ref(x - h, np.float64)) / (2 * h)
    np.testing.assert_allclose(ew.gelu_erf_bwd_ref(x, np.ones_like(x), np.float64), fd,
                               rtol=0, atol=1e-9)


def test_known_values():
    """gelu(0) = 0, gelu(1) = Phi(1), gelu(-1) = -Phi(-1), gelu'(0) = 1/2, gelu'(-inf side) -> 0."""
    x = np.float32([0.0, 1.0, -1.0, -30.0])
    out, dx = cuda.device_array(4, np.float32), cuda.device_array(4, np.float32)
    ew.gelu_erf(dev(x), out)
    ew.gelu_erf_bwd(dev(x), dev(np.ones(4, np.float32)), dx)
    np.testing.assert_allclose(out.copy_to_host(), [0.0, 0.8413447460685429, -0.15865525393145707, 0.0],
                               rtol=2e-7, atol=1e-30)
    np.testing.assert_allclose(dx.copy_to_host()[[0, 3]], [0.5, 0.0], atol=1e-30)


def test_rejects_bad_input_before_launch():
    x = dev(np.zeros(8, np.float32))
    with pytest.raises(TypeError, match="x: expected a device array"):
        ew.gelu_erf(np.zeros(8, np.float32), x)
    with pytest.raises(TypeError, match="out: expected dtype float32, got float16"):
        ew.gelu_erf(x, dev(np.zeros(8, np.float16)))
    with pytest.raises(ValueError, match=r"out: expected the shape of x \(8,\)"):
        ew.gelu_erf(x, dev(np.zeros(9, np.float32)))
    with pytest.raises(ValueError, match=r"dx: expected the shape of x \(8,\)"):
        ew.gelu_erf_bwd(x, x, dev(np.zeros((2, 4), np.float32)))
    with pytest.raises(TypeError, match="dy: expected dtype float32"):
        ew.gelu_erf_bwd(x, dev(np.zeros(8, np.float64)), x)
    # dx overlapping dy one element off: not elementwise in place, refused
    buf = dev(np.zeros(9, np.float32))
    with pytest.raises(ValueError, match="output 'dx'.*overlaps argument 'dy'"):
        ew.gelu_erf_bwd(x, buf[:8], buf[1:])


def test_matches_torch_autograd():
    """torch's GELU and its autograd in float64 as the truth: ours within the bounds the
    tests above derive for our float32 arithmetic (torch's own float32 GELU is not the truth:
    its vectorized erf on the CPU differs from the exact value by more than ours, measured on
    the GPU lane at this size). Shapes: tiny on the simulator, Wav2Vec2-base's FFN activation
    (8 x 199 x 3072) on a GPU."""
    torch = pytest.importorskip("torch")
    shape = (2, 3, 5) if not FULL_SIZE else (8, 199, 3072)
    rng = np.random.default_rng(7)
    x = _xs(rng, math.prod(shape)).reshape(shape)
    dy = rand(rng, *shape)
    tx = torch.tensor(x.astype(np.float64), requires_grad=True)
    ty = torch.nn.functional.gelu(tx)
    ty.backward(torch.tensor(dy.astype(np.float64)))
    out, dx = cuda.device_array(shape, np.float32), cuda.device_array(shape, np.float32)
    ew.gelu_erf(dev(x), out)
    ew.gelu_erf_bwd(dev(x), dev(dy), dx)
    x64, dy64 = x.astype(np.float64), np.abs(dy.astype(np.float64))
    want = ty.detach().numpy()
    # (+ torch's own float64 error: 1 + erf cancels to ulp(1) = 2^-52 in the negative tail)
    fwd_bound = 2 * (8 + 2 * x64 * x64) * U * np.abs(want) + 2.0 ** -50 * np.abs(x64) + TINY
    err = np.abs(out.copy_to_host().astype(np.float64) - want)
    assert np.all(err <= fwd_bound), float(np.max(err - fwd_bound))
    bwd_bound = (2 * 16 * (1 + x64 * x64) * U * dy64 * _phi_terms(x)
                 + 2.0 ** -50 * dy64 * (1 + np.abs(x64)) + TINY)
    err = np.abs(dx.copy_to_host().astype(np.float64) - tx.grad.numpy())
    assert np.all(err <= bwd_bound), float(np.max(err - bwd_bound))
