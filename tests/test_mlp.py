"""kernels.mlp against a float64 NumPy MLP written out here: the fused kernel and its sum
(shapes `fuses` accepts) and the fallback through kernels.gemm (shapes it does not), GPT-2
small's shape on the GPU, and every refusal before a launch. `out` starts as a random
residual, so a dropped term or an unwritten element fails the comparison."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import mlp as K
from proto.device import backend
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
    """C is a compile-time parameter of the fused kernel (dev.ab.ab_mlp_step times C and
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


# ------------------------------------------------------------------ ln_out: the next layer norm
def layer_norm(v, gamma, beta, eps):
    """(v - mean) / sqrt(var + eps) * gamma + beta over each row, in float64."""
    v = np.asarray(v, np.float64)
    mean = v.mean(axis=1, keepdims=True)
    var = ((v - mean) ** 2).mean(axis=1, keepdims=True)
    return (v - mean) / np.sqrt(var + eps) * gamma + beta


def _run_ln(host, gamma, beta, eps=1e-5):
    d = {k: dev(v) for k, v in host.items()}
    y = dev(np.full(host["out"].shape, np.nan, np.float32))
    K.mlp(d["x"], d["w1"], d["b1"], d["w2"], d["b2"], d["out"],
          ln_out=(dev(gamma), dev(beta), eps, y))
    return d["out"].copy_to_host(), y.copy_to_host()


@given(m=st.integers(1, K.MAX_ROWS), fused=st.booleans(), offset=st.sampled_from([0.0, 30.0]),
       seed=st.integers(0, 2**16))
def test_ln_out_normalizes_the_updated_rows(m, fused, offset, seed):
    """y = layernorm(out after the update), in the sum's launch (its rows' last blocks) where
    the MLP fuses, through kernels.gemm's projection where it does not. An offset on the
    residual checks the variance is taken about the mean."""
    rng = np.random.default_rng(seed)
    d, h = (3 * W, 2 * K.C * K.SUM_GROUPS) if fused else (24, 20)   # 3W: several blocks a row
    assert K.fuses(m, d, h) == fused
    host = _operands(rng, m, d, h)
    host["out"] += np.float32(offset)
    gamma, beta = rand(rng, d), rand(rng, d)
    out, y = _run_ln(host, gamma, beta)
    want = reference(**host)
    np.testing.assert_allclose(out, want, **TOL)
    np.testing.assert_allclose(y, layer_norm(want, gamma, beta, 1e-5), atol=1e-4, rtol=1e-4)


def test_ln_out_leaves_the_counters_at_zero():
    """The rows' last blocks reset their counters, so the next launch counts from zero: three
    runs in a row give the same bits, and the counters read zero after them."""
    from kernels._lastblock import launch_counters
    rng = np.random.default_rng(6)
    m, d, h = 5, 3 * W, K.C * K.SUM_GROUPS
    host, gamma, beta = _operands(rng, m, d, h), rand(rng, d), rand(rng, d)
    first = _run_ln(host, gamma, beta)
    for _ in range(2):
        again = _run_ln(host, gamma, beta)
        for a, b in zip(again, first):
            np.testing.assert_array_equal(a, b)
    assert not launch_counters(m).copy_to_host()[:m].any()


def test_ln_out_without_the_layer_norm_is_caught():
    """The comparison is sharp: y is not out itself, nor out normalized without gamma, beta."""
    rng = np.random.default_rng(7)
    m, d, h = 5, W, K.C * K.SUM_GROUPS
    host, gamma, beta = _operands(rng, m, d, h), rand(rng, d), rand(rng, d) + 1
    out, y = _run_ln(host, gamma, beta)
    assert np.abs(y - out).max() > 1e-2
    assert np.abs(y - layer_norm(out, 1.0, 0.0, 1e-5)).max() > 1e-2


@pytest.mark.gpu
def test_gpt2_small_shape_with_ln_out():
    rng = np.random.default_rng(8)
    host, gamma, beta = _operands(rng, 5, 768, 3072), rand(rng, 768), rand(rng, 768)
    out, y = _run_ln(host, gamma, beta)
    want = reference(**host)
    np.testing.assert_allclose(out, want, **TOL)
    np.testing.assert_allclose(y, layer_norm(want, gamma, beta, 1e-5), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bad,match", [
    ("y_shape", r"ln_out y: expected shape \(5, 8\)"),
    ("gamma", r"gamma"),
    ("y_over_out", r"output 'y' .* overlaps 'out'|output 'out' .* overlaps 'y'"),
    ("y_over_x", r"output 'y' .* overlaps 'x'"),
    ("tuple", r"ln_out: expected \(gamma, beta, eps, y\)"),
])
def test_bad_ln_out_is_refused_before_a_launch(bad, match):
    host = _operands(np.random.default_rng(9), 5, 8, 16)
    d = {k: dev(v) for k, v in host.items()}
    gamma, beta = dev(np.ones(8, np.float32)), dev(np.zeros(8, np.float32))
    y = dev(np.zeros((5, 8), np.float32))
    ln = {"y_shape": (gamma, beta, 1e-5, dev(np.zeros((5, 7), np.float32))),
          "gamma": (dev(np.ones(7, np.float32)), beta, 1e-5, y),
          "y_over_out": (gamma, beta, 1e-5, d["out"]),
          "y_over_x": (gamma, beta, 1e-5, d["x"]),
          "tuple": (gamma, beta, y)}[bad]
    before = host["out"].copy()
    with pytest.raises(ValueError, match=match):
        K.mlp(d["x"], d["w1"], d["b1"], d["w2"], d["b2"], d["out"], ln_out=ln)
    np.testing.assert_array_equal(d["out"].copy_to_host(), before)   # nothing launched
