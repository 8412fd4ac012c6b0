"""Winograd F(4x4, 3x3) convolution against the direct float64 NumPy references of kernels.conv."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import conv, winograd
from proto.device.backend import cuda
from tests.helpers import dev, rand, relu_output

EPS32 = float(np.finfo(np.float32).eps)


def assert_winograd_close(actual, expected, length):
    """An output is a float32 sum of `length` unit-scale products: the direct kernels' error
    is about length * eps32 (tests/test_conv.py allows 4x). Winograd's transforms round too
    (on the simulator its errors were a few times the direct ones'), so allow 4x the direct
    tolerance again; a wrong transform is off by O(1)."""
    actual = actual.copy_to_host() if hasattr(actual, "copy_to_host") else actual
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=max(1e-5, 16 * length * EPS32))


@st.composite
def cases(draw, scale=1):
    pad = draw(st.sampled_from([0, 1, 2]))
    low = max(1, 3 - 2 * pad)   # the output has at least one pixel
    N = draw(st.integers(1, 3))
    return dict(N=N, C=draw(st.integers(1, 5)) * scale, K=draw(st.integers(1, 6)) * scale,
                H=draw(st.integers(low, 9)), W=draw(st.integers(low, 9)), pad=pad,
                bias=draw(st.booleans()), relu=draw(st.booleans()),
                images=draw(st.integers(1, N)), seed=draw(st.integers(0, 2**16)))


def _workspace(c):
    size = winograd.workspace_size((c["N"], c["C"], c["H"], c["W"]), (c["K"], c["C"], 3, 3),
                                   pad=c["pad"], images=c["images"])
    return cuda.device_array(size, np.float32)


@given(data=st.data())
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_forward_matches_the_direct_reference_in_chunks_of_any_size(data, scale):
    c = data.draw(cases(scale))
    rng = np.random.default_rng(c["seed"])
    x, w, b = rand(rng, c["N"], c["C"], c["H"], c["W"]), rand(rng, c["K"], c["C"], 3, 3), rand(rng, c["K"])
    P, Q = c["H"] + 2 * c["pad"] - 2, c["W"] + 2 * c["pad"] - 2
    out = dev(np.full((c["N"], c["K"], P, Q), np.nan, np.float32))   # every element written
    bias = b if c["bias"] else None
    winograd.conv2d(dev(x), dev(w), None if bias is None else dev(bias), out, pad=c["pad"],
                    relu=c["relu"], workspace=_workspace(c))
    ref = conv.conv2d_ref(x, w, bias, pad=c["pad"], relu=c["relu"])
    assert_winograd_close(out, ref, 9 * c["C"])


def _bwd_data_case(c):
    """(rng, x's shape, w, dy) of a backward-data case."""
    rng = np.random.default_rng(c["seed"])
    w = rand(rng, c["K"], c["C"], 3, 3)
    dy = rand(rng, c["N"], c["K"], c["H"] + 2 * c["pad"] - 2, c["W"] + 2 * c["pad"] - 2)
    return rng, (c["N"], c["C"], c["H"], c["W"]), w, dy


@given(data=st.data())
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_backward_data_matches_the_direct_reference(data, scale):
    c = data.draw(cases(scale))
    _, x_shape, w, dy = _bwd_data_case(c)
    dx = dev(np.full(x_shape, np.nan, np.float32))
    winograd.conv2d_bwd_data(dev(dy), dev(w), dx, pad=c["pad"], workspace=_workspace(c))
    assert_winograd_close(dx, conv.conv2d_bwd_data_ref(dy, w, x_shape, pad=c["pad"]), 9 * c["K"])


@given(data=st.data())
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_backward_data_through_a_relu_goes_over_its_output(data, scale):
    c = data.draw(cases(scale))
    rng, x_shape, w, dy = _bwd_data_case(c)
    y = relu_output(rng, x_shape)
    dx = dev(y)
    winograd.conv2d_bwd_data(dev(dy), dev(w), dx, pad=c["pad"], relu_mask=True,
                             workspace=_workspace(c))
    got, passes = dx.copy_to_host(), y > 0
    assert (got[~passes] == 0).all()
    full = conv.conv2d_bwd_data_ref(dy, w, x_shape, pad=c["pad"])
    assert_winograd_close(got[passes], full[passes], 9 * c["K"])


def test_a_run_repeats_bit_for_bit():
    rng = np.random.default_rng(5)
    x, w = dev(rand(rng, 3, 6, 10, 7)), dev(rand(rng, 5, 6, 3, 3))
    ws = cuda.device_array(winograd.workspace_size(x.shape, w.shape, images=2), np.float32)
    outs = [cuda.device_array((3, 5, 10, 7), np.float32) for _ in range(2)]
    for out in outs:
        winograd.conv2d(x, w, None, out, workspace=ws)
    np.testing.assert_array_equal(outs[0].copy_to_host().view(np.uint32),
                                  outs[1].copy_to_host().view(np.uint32))


def test_a_nan_spoils_its_window_and_at_most_the_tiles_whose_patch_holds_it():
    """As documented: every output whose 3x3 window holds the NaN, and possibly other
    outputs of the 2x2 tiles whose 4x4 patch holds it; the rest stay finite."""
    x = np.ones((1, 1, 8, 8), np.float32)
    x[0, 0, 5, 5] = np.nan
    w = np.ones((1, 1, 3, 3), np.float32)
    out = cuda.device_array((1, 1, 8, 8), np.float32)
    ws = cuda.device_array(winograd.workspace_size(x.shape, w.shape), np.float32)
    winograd.conv2d(dev(x), dev(w), None, out, pad=1, workspace=ws)
    got = np.isnan(out.copy_to_host()[0, 0])
    window = np.zeros((8, 8), bool)
    window[4:7, 4:7] = True                 # outputs whose 3x3 window holds (5, 5)
    tiles = np.zeros((8, 8), bool)
    for ty in range(4):                     # tiles whose 4x4 patch (origin 2t - 1) holds it
        for tx in range(4):
            if 2 * ty - 1 <= 5 < 2 * ty + 3 and 2 * tx - 1 <= 5 < 2 * tx + 3:
                tiles[2 * ty:2 * ty + 2, 2 * tx:2 * tx + 2] = True
    assert got[window].all()
    assert not got[~(window | tiles)].any()


def test_bad_input_is_refused_before_any_launch():
    rng = np.random.default_rng(0)
    x, w = dev(rand(rng, 2, 3, 6, 6)), dev(rand(rng, 4, 3, 3, 3))
    out = cuda.device_array((2, 4, 6, 6), np.float32)
    ws = cuda.device_array(winograd.workspace_size(x.shape, w.shape, images=1), np.float32)
    with pytest.raises(ValueError, match="w: .*3x3"):
        winograd.conv2d(x, dev(rand(rng, 4, 3, 5, 5)), None, out, pad=2, workspace=ws)
    with pytest.raises(ValueError, match="pad"):
        winograd.conv2d(x, w, None, out, pad=3, workspace=ws)
    with pytest.raises(ValueError, match="out: expected shape"):
        winograd.conv2d(x, w, None, cuda.device_array((2, 4, 4, 4), np.float32), pad=1, workspace=ws)
    with pytest.raises(ValueError, match="dy: expected 4 channels"):
        winograd.conv2d_bwd_data(x, w, cuda.device_array((2, 3, 6, 6), np.float32), pad=1,
                                 workspace=ws)
    small = cuda.device_array(ws.size - 1, np.float32)
    with pytest.raises(ValueError, match="workspace: .*less than one image"):
        winograd.conv2d(x, w, None, out, pad=1, workspace=small)
    shared = cuda.device_array(out.size + ws.size, np.float32)   # out inside the workspace
    with pytest.raises(ValueError, match="overlaps"):
        winograd.conv2d(x, w, None, shared[:out.size].reshape(out.shape), pad=1, workspace=shared)
    with pytest.raises(ValueError, match="bias: expected shape"):
        winograd.conv2d(x, w, dev(np.zeros(3, np.float32)), out, pad=1, workspace=ws)


@given(data=st.data())
@pytest.mark.slow   # (make test-all and CI run it; make test does not)
def test_backward_weight_matches_the_direct_reference_summed_over_chunks(data, scale):
    c = data.draw(cases(scale))
    rng = np.random.default_rng(c["seed"])
    x = rand(rng, c["N"], c["C"], c["H"], c["W"])
    P, Q = c["H"] + 2 * c["pad"] - 2, c["W"] + 2 * c["pad"] - 2
    dy = rand(rng, c["N"], c["K"], P, Q)
    w_shape = (c["K"], c["C"], 3, 3)
    dw = dev(np.full(w_shape, np.nan, np.float32))
    db = dev(np.full(c["K"], np.nan, np.float32)) if c["bias"] else None
    winograd.conv2d_bwd_weight(dev(x), dev(dy), dw, db, pad=c["pad"], workspace=_workspace(c))
    want_dw, want_db = conv.conv2d_bwd_weight_ref(x, dy, w_shape, pad=c["pad"])
    assert_winograd_close(dw, want_dw, c["N"] * P * Q)
    if db is not None:
        np.testing.assert_allclose(db.copy_to_host(), want_db, rtol=1e-4,
                                   atol=max(1e-5, 4 * c["N"] * P * Q * EPS32))


def test_backward_weight_refuses_bad_input_before_any_launch():
    rng = np.random.default_rng(1)
    x, dy = dev(rand(rng, 2, 3, 6, 6)), dev(rand(rng, 2, 4, 6, 6))
    dw, db = cuda.device_array((4, 3, 3, 3), np.float32), cuda.device_array(4, np.float32)
    ws = cuda.device_array(winograd.workspace_size(x.shape, dw.shape, images=1), np.float32)
    with pytest.raises(ValueError, match="dw: expected shape"):
        winograd.conv2d_bwd_weight(x, dy, cuda.device_array((4, 3, 5, 5), np.float32), db,
                                   workspace=ws)
    with pytest.raises(ValueError, match="dy: expected shape"):
        winograd.conv2d_bwd_weight(x, dev(rand(rng, 2, 4, 4, 4)), dw, db, workspace=ws)
    with pytest.raises(ValueError, match="workspace: .*less than one image"):
        winograd.conv2d_bwd_weight(x, dy, dw, db, workspace=cuda.device_array(ws.size - 1, np.float32))
    with pytest.raises(ValueError, match="overlaps"):
        winograd.conv2d_bwd_weight(x, dy, dw, ws[:4], workspace=ws)


@pytest.mark.gpu
def test_a_vgg_conv3_layer_matches_the_reference_in_all_three_passes():
    """At VGG's conv3 shape (256 -> 256 channels, 56x56; two images, one a chunk): the wide
    GEMM tiles, the weight gradient's long reduction over tiles, and offsets far past the
    simulator's sizes."""
    rng = np.random.default_rng(3)
    N, C, K, S = 2, 256, 256, 56
    x, w = rand(rng, N, C, S, S), rand(rng, K, C, 3, 3, scale=0.05)
    b, dy = rand(rng, K), rand(rng, N, K, S, S)
    ws = cuda.device_array(winograd.workspace_size(x.shape, w.shape, images=1), np.float32)
    out, dx = cuda.device_array((N, K, S, S), np.float32), cuda.device_array(x.shape, np.float32)
    dw, db = cuda.device_array(w.shape, np.float32), cuda.device_array(K, np.float32)
    winograd.conv2d(dev(x), dev(w), dev(b), out, relu=True, workspace=ws)
    winograd.conv2d_bwd_data(dev(dy), dev(w), dx, workspace=ws)
    winograd.conv2d_bwd_weight(dev(x), dev(dy), dw, db, workspace=ws)
    # unit-scale sums of 9 * 256 products, weights at 0.05: the forward's scale is 0.05
    assert_winograd_close(out.copy_to_host() / 0.05, conv.conv2d_ref(x, w, b, pad=1, relu=True) / 0.05,
                          9 * C)
    want_dx = conv.conv2d_bwd_data_ref(dy, w, x.shape, pad=1)
    assert_winograd_close(dx.copy_to_host() / 0.05, want_dx / 0.05, 9 * K)
    y = out.copy_to_host()             # a ReLU output: its gradient goes over it
    winograd.conv2d_bwd_data(dev(dy), dev(w), out, relu_mask=True, workspace=ws)
    assert_winograd_close(out.copy_to_host() / 0.05, np.where(y > 0, want_dx, 0) / 0.05, 9 * K)
    want_dw, want_db = conv.conv2d_bwd_weight_ref(x, dy, w.shape, pad=1)
    assert_winograd_close(dw, want_dw, N * S * S)
    np.testing.assert_allclose(db.copy_to_host(), want_db, rtol=1e-4, atol=16 * N * S * S * EPS32)
