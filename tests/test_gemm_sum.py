"""gemm.gemm_sum: out = a @ b.T + a2 @ b2.T + bias (+ old), against float64 on the same
values, in float32 and float16; and its refusals, before any launch.

The bound is test_gemm's: a float32 sum of K = K1 + K2 products, then old and bias, is off
by at most (K + 4) u (sum |a||b| + |old| + |bias|), u = U32 an addition, 2 U32 where the
tensor-core kernel adds (float16 on a GPU: its additions truncate, tests/test_gemm_mma.py);
then the one rounding to the storage dtype (its unit roundoff of the result, plus 2^-25
under float16's normal range). On a GPU, the tensor-core pair kernel itself (one launch for
both products, its K splits across K1) is tested in tests/test_gemm_mma.py.
"""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import gemm as G
from kernels.layernorm import layernorm_ref
from proto.device import backend
from tests.helpers import dev
from tests.test_gemm import U16, U32, _assert_within, _half_result

ROUNDING = {np.float16: U16, np.float32: U32}


def _values(rng, dtype, *shape):
    return rng.standard_normal(shape).astype(dtype)


def _zeros16(*shape):
    return dev(np.zeros(shape, np.float16))


@pytest.fixture
def launched(monkeypatch):
    """The launches made from now on (none happen: each is recorded instead)."""
    calls = []
    monkeypatch.setattr(G, "launch", lambda *args, **kw: calls.append(args))
    return calls


def _want(a, b, a2, b2, bias, old, pair: bool):
    """(float64 a @ b.T + a2 @ b2.T + old + bias, its bound before the storage rounding).
    Not `pair` (two gemm calls), the first product (plus old) is stored, so rounded to the
    storage dtype, before the second adds to it: one more rounding of that partial result."""
    dtype = a.dtype.type
    f = [None if x is None else x.astype(np.float64) for x in (a, b, a2, b2, bias, old)]
    a64, b64, c64, d64, bias64, old64 = f
    first = a64 @ b64.T + (0 if old64 is None else old64)
    v = first + c64 @ d64.T + (0 if bias64 is None else bias64)
    mag = np.abs(a64) @ np.abs(b64).T + np.abs(c64) @ np.abs(d64).T
    for extra in (old64, bias64):
        if extra is not None:
            mag = mag + np.abs(extra)
    per_add = 2 * U32 if pair and dtype == np.float16 else U32
    e = (a64.shape[1] + c64.shape[1] + 4) * per_add * mag
    return v, e if pair else e + ROUNDING[dtype] * np.abs(first) + 2.0 ** -25


@given(m=st.integers(1, G.DECODE_MAX_M), n=st.integers(1, 40), k1=st.integers(1, 5),
       k2=st.integers(1, 5), whole_chunks=st.booleans(), half=st.booleans(),
       has_bias=st.booleans(), accumulate=st.booleans(), seed=st.integers(0, 2**16))
def test_sum_of_two_products_matches_float64(m, n, k1, k2, whole_chunks, half, has_bias,
                                              accumulate, seed):
    """Any M <= 8, K1 and K2 in whole chunks of 32 (the tensor-core pair on a GPU) or not
    (two gemm calls), every epilogue: within the bound above."""
    rng = np.random.default_rng(seed)
    dtype = np.float16 if half else np.float32
    if whole_chunks:
        k1, k2 = 32 * k1, 32 * k2
    a, a2 = _values(rng, dtype, m, k1), _values(rng, dtype, m, k2)
    b, b2 = _values(rng, dtype, n, k1), _values(rng, dtype, n, k2)
    old, bias = _values(rng, dtype, m, n), _values(rng, dtype, n) if has_bias else None
    out = dev(old if accumulate else np.full_like(old, np.nan))
    G.gemm_sum(dev(a), dev(b), dev(a2), dev(b2), out, accumulate=accumulate,
               bias=None if bias is None else dev(bias))
    pair = half and whole_chunks   # (one launch, one rounding)
    want, e = _want(a, b, a2, b2, bias, old if accumulate else None, pair)
    got = out.copy_to_host()
    assert got.dtype == dtype
    _assert_within(got, want, e + ROUNDING[dtype] * np.abs(want) + 2.0 ** -25)


def test_prefill_rows_and_the_layer_norm_after():
    """More than 8 rows (a prefill: two gemm calls, 8 rows a launch in float16) and ln_out:
    y = layernorm(out), the float32 case's rows against float64's."""
    rng = np.random.default_rng(4)
    m, n, k1, k2 = 11, 24, 64, 96
    a, a2 = _values(rng, np.float32, m, k1), _values(rng, np.float32, m, k2)
    b, b2 = _values(rng, np.float32, n, k1), _values(rng, np.float32, n, k2)
    old, bias = _values(rng, np.float32, m, n), _values(rng, np.float32, n)
    gamma, beta = _values(rng, np.float32, n), _values(rng, np.float32, n)
    out, y = dev(old), dev(np.full((m, n), np.nan, np.float32))
    G.gemm_sum(dev(a), dev(b), dev(a2), dev(b2), out, bias=dev(bias), accumulate=True,
               ln_out=(dev(gamma), dev(beta), 1e-5, y))
    want, e = _want(a, b, a2, b2, bias, old, False)
    _assert_within(out.copy_to_host(), want, e + U32 * np.abs(want))
    np.testing.assert_allclose(y.copy_to_host(), layernorm_ref(want, gamma, beta),
                               atol=2e-5, rtol=1e-4)


def test_refuses_bad_input_before_any_launch(launched):
    h = _zeros16
    a, b, a2, b2, out = h(5, 64), h(24, 64), h(5, 32), h(24, 32), h(5, 24)
    with pytest.raises(ValueError, match="b2: expected shape"):
        G.gemm_sum(a, b, a2, h(24, 64), out)
    with pytest.raises(ValueError, match="a2: expected shape"):
        G.gemm_sum(a, b, h(4, 32), b2, out)
    with pytest.raises(ValueError, match="out: expected shape"):
        G.gemm_sum(a, b, a2, b2, h(5, 23))
    with pytest.raises(TypeError, match="b2: expected dtype float16"):
        G.gemm_sum(a, b, a2, dev(np.zeros((24, 32), np.float32)), out)
    with pytest.raises(ValueError, match="bias: expected shape"):
        G.gemm_sum(a, b, a2, b2, out, bias=h(23))
    g = h(24)
    inside_a = backend.reshaped(backend.view_at(backend.reshaped(a, (a.size,)), 0, h(5 * 24)),
                                (5, 24))   # (a's first 120 values as a (5, 24) array)
    with pytest.raises(ValueError, match="y overlaps a"):
        G.gemm_sum(a, b, a2, b2, out, ln_out=(g, g, 1e-5, inside_a))
    assert launched == []


@given(m=st.integers(1, G.DECODE_MAX_M), n1=st.integers(1, 40), n2=st.integers(1, 40),
       k=st.integers(1, 4), whole_chunks=st.booleans(), half=st.booleans(),
       act=st.sampled_from([None, "gelu", "relu"]), has_bias=st.booleans(),
       seed=st.integers(0, 2**16))
def test_two_outputs_of_one_input_match_float64(m, n1, n2, k, whole_chunks, half, act,
                                                has_bias, seed):
    """gemm_two_outputs: out = a @ b.T plain, out2 = act(a @ b2.T + bias) (one tensor-core
    launch for float16 with K in whole chunks of 32, else two gemm calls): each within
    test_gemm's bound for its own product, its activation and its one rounding."""
    rng = np.random.default_rng(seed)
    dtype = np.float16 if half else np.float32
    k = 32 * k if whole_chunks else k
    a, b, b2 = (_values(rng, dtype, *shape) for shape in ((m, k), (n1, k), (n2, k)))
    bias = _values(rng, dtype, n2) if has_bias else None
    out = dev(np.full((m, n1), np.nan, dtype))
    out2 = dev(np.full((m, n2), np.nan, dtype))
    G.gemm_two_outputs(dev(a), dev(b), out, dev(b2), out2, act2=act,
                       bias2=None if bias is None else dev(bias))
    per_add = 2 * U32 if half else U32
    for got, w, extra, f in ((out, b, None, None), (out2, b2, bias, act)):
        v = a.astype(np.float64) @ w.astype(np.float64).T
        mag = np.abs(a.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
        if extra is not None:
            v, mag = v + extra.astype(np.float64), mag + np.abs(extra.astype(np.float64))
        want, e = _half_result(v, (k + 4) * per_add * mag, f)
        _assert_within(got.copy_to_host(), want, e + ROUNDING[dtype] * np.abs(want) + 2.0 ** -25)


def test_two_outputs_refuse_bad_input_before_any_launch(launched):
    h = _zeros16
    a, b, b2, out, out2 = h(5, 64), h(24, 64), h(16, 64), h(5, 24), h(5, 16)
    with pytest.raises(ValueError, match="b2: expected shape"):
        G.gemm_two_outputs(a, b, out, h(16, 32), out2)
    with pytest.raises(ValueError, match="out2: expected shape"):
        G.gemm_two_outputs(a, b, out, b2, h(5, 24))
    with pytest.raises(ValueError, match="act2: expected one of"):
        G.gemm_two_outputs(a, b, out, b2, out2, act2="tanh")
    with pytest.raises(ValueError, match="bias2: expected shape"):
        G.gemm_two_outputs(a, b, out, b2, out2, bias2=h(24))
    with pytest.raises(ValueError, match="out overlaps a"):
        G.gemm_two_outputs(a, b, backend.reshaped(backend.view_at(
            backend.reshaped(a, (a.size,)), 0, h(5 * 24)), (5, 24)), b2, out2)
    assert launched == []
