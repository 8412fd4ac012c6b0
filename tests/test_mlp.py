"""kernels.mlp against a float64 NumPy MLP written out here: the fused kernel and its sum
(shapes `fuses` accepts) and the fallback through kernels.gemm (shapes it does not), GPT-2
small's shape on the GPU, and every refusal before a launch. `out` starts as a random
residual, so a dropped term or an unwritten element fails the comparison."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import mlp as K
from proto import backend
from tests.helpers import dev, rand


def reference(x, w1, b1, w2, b2, out):
    """out + GELU(x @ w1 + b1) @ w2 + b2 with GPT-2's tanh GELU, in float64."""
    f = lambda a: np.asarray(a, np.float64)   # noqa: E731
    v = f(x) @ f(w1) + f(b1)
    v = 0.5 * v * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (v + 0.044715 * v ** 3)))
    return f(out) + v @ f(w2) + f(b2)


def _operands(rng, m, d, h):
    return dict(x=rand(rng, m, d), w1=rand(rng, d, h) / np.float32(math.sqrt(d)),
                b1=rand(rng, h), w2=rand(rng, h, d) / np.float32(math.sqrt(h)),
                b2=rand(rng, d), out=rand(rng, m, d))


def _run(host):
    d = {k: dev(v) for k, v in host.items()}
    K.mlp(d["x"], d["w1"], d["b1"], d["w2"], d["b2"], d["out"])
    return d["out"].copy_to_host()


TOL = dict(atol=2e-5, rtol=1e-4)
W = K.THREADS   # the fused kernel takes widths that are multiples of its block


@given(m=st.integers(1, K.MAX_ROWS), d=st.sampled_from([W, 2 * W]),
       parts=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_fused_matches_float64(m, d, parts, seed):
    h = parts * K.C * K.SUM_GROUPS
    if backend.SIMULATOR:
        d = min(d, K.MAX_WIDTH)
    assert K.fuses(m, d, h)
    host = _operands(np.random.default_rng(seed), m, d, h)
    np.testing.assert_allclose(_run(host), reference(**host), **TOL)


def test_twice_the_columns_a_block(monkeypatch):
    """C is a compile-time parameter of the fused kernel (kernels.ab_mlp_step times C and
    2C): twice the hidden columns a block, half the partials, the same answer."""
    monkeypatch.setattr(K, "C", 2 * K.C)
    m, d, h = 5, W, 2 * K.C * K.SUM_GROUPS
    assert K.fuses(m, d, h)
    host = _operands(np.random.default_rng(5), m, d, h)
    np.testing.assert_allclose(_run(host), reference(**host), **TOL)


@given(m=st.integers(1, 12), d=st.integers(1, 40), h=st.integers(1, 40),
       seed=st.integers(0, 2**16))
def test_shapes_the_fused_kernel_does_not_take_run_through_gemm(m, d, h, seed):
    host = _operands(np.random.default_rng(seed), m, d, h)
    np.testing.assert_allclose(_run(host), reference(**host), **TOL)


def test_fuses_only_what_the_fused_kernel_can_address():
    """The fused kernel indexes its flattened weights with uint32 offsets, holds D / 8
    weights a thread in registers and multiplies at most 8 rows: anything else falls back."""
    step = K.C * K.SUM_GROUPS
    assert K.fuses(5, W, step)
    assert not K.fuses(K.MAX_ROWS + 1, W, step)
    assert not K.fuses(5, W + 1, step) and not K.fuses(5, K.MAX_WIDTH + W, step)
    assert not K.fuses(5, W, step + 1)
    assert not K.fuses(5, W, -(-2**32 // (W * step)) * step)   # D * H past 2**32


def test_a_wrong_mlp_is_caught():
    """The comparison above is sharp enough: the same MLP without its GELU is far off."""
    m, d, h = 5, W, K.C * K.SUM_GROUPS
    host = _operands(np.random.default_rng(0), m, d, h)
    got = _run(host)
    no_gelu = host["out"] + (host["x"] @ host["w1"] + host["b1"]) @ host["w2"] + host["b2"]
    assert np.abs(got - no_gelu).max() > 100 * TOL["atol"]


def test_repeated_runs_are_bit_identical():
    host = _operands(np.random.default_rng(1), 5, W, 2 * K.C * K.SUM_GROUPS)
    first = _run(host)
    for _ in range(3):
        np.testing.assert_array_equal(_run(host), first)


@pytest.mark.gpu
def test_gpt2_small_shape():
    """GPT-2 small's MLP (5 rows, 768 x 3072) on the GPU: the fused kernel, 192 blocks."""
    assert K.fuses(5, 768, 3072)
    host = _operands(np.random.default_rng(2), 5, 768, 3072)
    np.testing.assert_allclose(_run(host), reference(**host), **TOL)


@pytest.mark.parametrize("change,error,match", [
    (dict(x=np.zeros((5, 8, 2), np.float32)), ValueError, r"x: expected 2 dimensions"),
    (dict(w1=np.zeros((7, 16), np.float32)), ValueError, r"w1: expected \(8, H\)"),
    (dict(b1=np.zeros(15, np.float32)), ValueError, r"b1: expected shape \(16,\)"),
    (dict(w2=np.zeros((16, 7), np.float32)), ValueError, r"w2: expected shape \(16, 8\)"),
    (dict(b2=np.zeros(9, np.float32)), ValueError, r"b2: expected shape \(8,\)"),
    (dict(out=np.zeros((4, 8), np.float32)), ValueError, r"out: expected shape \(5, 8\)"),
    (dict(out=np.zeros((5, 8), np.float64)), TypeError, r"out: expected dtype float32"),
])
def test_bad_arguments_are_refused_by_name(change, error, match):
    host = {**_operands(np.random.default_rng(3), 5, 8, 16), **change}
    before = host["out"].copy()
    d = {k: dev(v) for k, v in host.items()}
    with pytest.raises(error, match=match):
        K.mlp(d["x"], d["w1"], d["b1"], d["w2"], d["b2"], d["out"])
    np.testing.assert_array_equal(d["out"].copy_to_host(), before)   # nothing launched


def test_out_overlapping_an_input_is_refused():
    host = _operands(np.random.default_rng(4), 5, 8, 16)
    d = {k: dev(v) for k, v in host.items()}
    with pytest.raises(ValueError, match=r"output 'out' .* overlaps 'x'"):
        K.mlp(d["x"], d["w1"], d["b1"], d["w2"], d["b2"], d["x"])
