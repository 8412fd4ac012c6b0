"""conv2d forward, backward-data and backward-weight against float64 NumPy references."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import conv
from proto.device import backend
from proto.device.backend import cuda
from tests.helpers import dev, rand, relu_output

EPS32 = float(np.finfo(np.float32).eps)


def assert_sum_close(actual, expected, length):
    """Each output is a float32 sum of `length` products of unit-scale values. Partial sums grow
    like sqrt(length), each addition rounds by eps32 of that, and the errors random-walk:
    about length * eps32 in all. atol = 4x that (at least 1e-5), rtol 1e-4 for large outputs."""
    actual = actual.copy_to_host() if hasattr(actual, "copy_to_host") else actual
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=max(1e-5, 4 * length * EPS32))


@st.composite
def conv_cases(draw, scale=1):
    R = draw(st.sampled_from([1, 3]))
    stride, pad = draw(st.sampled_from([1, 2, 3])), draw(st.sampled_from([0, 1]))
    H, W = draw(st.integers(R, 9)), draw(st.integers(R, 9))
    return dict(N=draw(st.integers(1, 2)), C=draw(st.integers(1, 5)) * scale, H=H, W=W,
                K=draw(st.integers(1, 6)) * scale, R=R, stride=stride, pad=pad,
                bias=draw(st.booleans()), relu=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def _arrays(c):
    rng = np.random.default_rng(c["seed"])
    P = conv.conv_out_size(c["H"], c["R"], c["stride"], c["pad"])
    Q = conv.conv_out_size(c["W"], c["R"], c["stride"], c["pad"])
    x = rand(rng, c["N"], c["C"], c["H"], c["W"])
    w = rand(rng, c["K"], c["C"], c["R"], c["R"])
    b = rand(rng, c["K"])
    dy = rand(rng, c["N"], c["K"], P, Q)
    return x, w, b, dy


@given(data=st.data())
def test_conv2d_forward_matches_reference(data, scale):
    c = data.draw(conv_cases(scale))
    x, w, b, dy = _arrays(c)
    out = cuda.device_array(dy.shape, np.float32)
    bias = b if c["bias"] else None
    conv.conv2d(dev(x), dev(w), None if bias is None else dev(bias), out,
                stride=c["stride"], pad=c["pad"], relu=c["relu"])
    ref = conv.conv2d_ref(x, w, bias, stride=c["stride"], pad=c["pad"], relu=c["relu"])
    assert_sum_close(out, ref, c["C"] * c["R"] ** 2)


@given(data=st.data())
def test_conv2d_backward_data_matches_reference(data, scale):
    c = data.draw(conv_cases(scale))
    x, w, _, dy = _arrays(c)
    dx = dev(np.full(x.shape, np.nan, np.float32))   # every element must be written
    conv.conv2d_bwd_data(dev(dy), dev(w), dx, stride=c["stride"], pad=c["pad"])
    ref = conv.conv2d_bwd_data_ref(dy, w, x.shape, stride=c["stride"], pad=c["pad"])
    assert_sum_close(dx, ref, c["K"] * c["R"] ** 2)


@given(data=st.data())
def test_conv2d_backward_data_through_a_relu_goes_over_its_output(data, scale):
    c = data.draw(conv_cases(scale))
    x, w, _, dy = _arrays(c)
    y = relu_output(np.random.default_rng(c["seed"] + 1), x.shape)
    dx = dev(y)                       # in place: the ReLU output becomes its gradient
    conv.conv2d_bwd_data(dev(dy), dev(w), dx, stride=c["stride"], pad=c["pad"], relu_mask=True)
    got = dx.copy_to_host()
    full = conv.conv2d_bwd_data_ref(dy, w, x.shape, stride=c["stride"], pad=c["pad"])
    passes = y > 0                    # NaN compares False
    assert (got[~passes] == 0).all()
    assert_sum_close(got[passes], full[passes], c["K"] * c["R"] ** 2)


@given(data=st.data(), splits=st.sampled_from([None, 1, 3]))
def test_conv2d_backward_weight_matches_reference(data, splits, scale):
    c = data.draw(conv_cases(scale))
    x, w, _, dy = _arrays(c)
    dw = dev(np.full(w.shape, np.nan, np.float32))    # overwritten, not accumulated into
    db = dev(np.full(c["K"], np.nan, np.float32)) if c["bias"] else None
    geometry = dict(stride=c["stride"], pad=c["pad"], splits=splits)
    part = _workspace(x.shape, w.shape, **geometry)
    dx_, dy_ = dev(x), dev(dy)
    conv.conv2d_bwd_weight(dx_, dy_, dw, db, workspace=part, **geometry)
    ref_w, ref_b = conv.conv2d_bwd_weight_ref(x, dy, w.shape, stride=c["stride"], pad=c["pad"])
    length = dy.size // c["K"]
    assert_sum_close(dw, ref_w, length)
    if db is not None:
        assert_sum_close(db, ref_b, length)
    # The split partials are summed in a fixed order (no atomics): a rerun is bit-identical.
    first = dw.copy_to_host()
    conv.conv2d_bwd_weight(dx_, dy_, dw, db, workspace=part, **geometry)
    assert np.array_equal(dw.copy_to_host(), first)


WGRAD_MMA_TILES = conv.SIM_WGRAD_MMA_TILES if backend.SIMULATOR else conv.GPU_WGRAD_MMA_TILES


@pytest.mark.parametrize("tiles", WGRAD_MMA_TILES)
@pytest.mark.parametrize("splits", [1, 3])
def test_tensor_core_wgrad_over_many_steps(tiles, splits):
    """The weight gradient on a tensor-core tile (kernels._tf32) over a 3x3 layer of 10 by 6
    channels: 40 pixels of reduction, several steps a split, the bias from the dy tile; the
    products' split error (12 units of roundoff) and truncating sums sit inside
    assert_sum_close's 8 units a product."""
    rng = np.random.default_rng(6)
    x, dy = rand(rng, 2, 10, 5, 4), rand(rng, 2, 6, 5, 4)
    dw = dev(np.full((6, 10, 3, 3), np.nan, np.float32))
    db = dev(np.full(6, np.nan, np.float32))
    geometry = dict(stride=1, pad=1, splits=splits)
    part = _workspace(x.shape, (6, 10, 3, 3), **geometry, tiles=tiles)
    conv.conv2d_bwd_weight(dev(x), dev(dy), dw, db, workspace=part, tiles=tiles, **geometry)
    ref_w, ref_b = conv.conv2d_bwd_weight_ref(x, dy, (6, 10, 3, 3), stride=1, pad=1)
    assert_sum_close(dw, ref_w, 40)
    assert_sum_close(db, ref_b, 40)


def _workspace(x_shape, w_shape, **geometry):
    size = conv.wgrad_workspace_size(x_shape, w_shape, **geometry)
    return cuda.device_array(size, np.float32) if size else None


@pytest.mark.gpu
def test_split_wgrad_at_vgg_size_is_deterministic():
    # VGG-16's first conv at batch 48, 128x128: 786k pixels reduced, split across many blocks.
    rng = np.random.default_rng(3)
    x, dy = rand(rng, 48, 64, 128, 128), rand(rng, 48, 64, 128, 128)
    size = conv.wgrad_workspace_size(x.shape, (64, 64, 3, 3), pad=1)
    assert size > 0, "expected the reduction to be split on a GPU"
    dw, db, part = (cuda.device_array(n, np.float32) for n in ((64, 64, 3, 3), 64, size))
    with pytest.raises(ValueError, match=f"at least {size} elements"):
        conv.conv2d_bwd_weight(dev(x), dev(dy), dw, db, pad=1)
    runs = []
    for _ in range(3):
        conv.conv2d_bwd_weight(dev(x), dev(dy), dw, db, pad=1, workspace=part)
        runs.append((dw.copy_to_host(), db.copy_to_host()))
    assert np.isfinite(runs[0][0]).all()
    assert all(np.array_equal(a, runs[0][0]) and np.array_equal(b, runs[0][1]) for a, b in runs)


@pytest.mark.parametrize("tiles", conv.GPU_CONV_TILES + conv.GPU_CONV_MMA_TILES)
def test_gpu_conv_tiles_on_a_small_problem(tiles):
    """The GPU's 256-thread tiles run here too (one block each, one reduction step: a 1x1
    conv with few channels), so the simulator covers the code the GPU runs."""
    rng = np.random.default_rng(1)
    x, w, b = rand(rng, 1, 3, 5, 4), rand(rng, 5, 3, 1, 1), rand(rng, 5)
    out = cuda.device_array((1, 5, 3, 2), np.float32)
    conv.conv2d(dev(x), dev(w), dev(b), out, stride=2, pad=0, relu=True, tiles=tiles)
    assert_sum_close(out, conv.conv2d_ref(x, w, b, stride=2, relu=True), 3)
    dy = rand(rng, 1, 5, 3, 2)
    dx = cuda.device_array(x.shape, np.float32)
    conv.conv2d_bwd_data(dev(dy), dev(w), dx, stride=2, tiles=tiles)
    assert_sum_close(dx, conv.conv2d_bwd_data_ref(dy, w, x.shape, stride=2), 5)


# (on the simulator the tensor-core tile is its own: the GPU's 8 warps would take minutes)
MMA_TILES = conv.SIM_CONV_MMA_TILES if backend.SIMULATOR else conv.GPU_CONV_MMA_TILES


@pytest.mark.parametrize("tiles", conv.GPU_CONV_TILES + MMA_TILES)
@pytest.mark.parametrize("stride", [1, 2])
def test_gpu_conv_tiles_over_many_steps(tiles, stride):
    """A 3x3 conv over 10 channels: two channel chunks of the GPU tiles' 8 for each of the
    nine taps, so the steps' tap and chunk counters wrap, and padding and stride put some
    taps off the image. The tensor-core tiles' products are each within 12 units of
    roundoff and their sums may truncate (kernels._tf32): inside assert_sum_close's 8
    units a product for these sums of 54 and 90."""
    rng = np.random.default_rng(4)
    x, w, b = rand(rng, 1, 10, 5, 4), rand(rng, 6, 10, 3, 3), rand(rng, 6)
    P, Q = conv.conv_out_size(5, 3, stride, 1), conv.conv_out_size(4, 3, stride, 1)
    out = cuda.device_array((1, 6, P, Q), np.float32)
    conv.conv2d(dev(x), dev(w), dev(b), out, stride=stride, pad=1, tiles=tiles)
    assert_sum_close(out, conv.conv2d_ref(x, w, b, stride=stride, pad=1), 90)
    dy = rand(rng, 1, 6, P, Q)
    dx = dev(np.full(x.shape, np.nan, np.float32))
    conv.conv2d_bwd_data(dev(dy), dev(w), dx, stride=stride, pad=1, tiles=tiles)
    want = conv.conv2d_bwd_data_ref(dy, w, x.shape, stride=stride, pad=1)
    assert_sum_close(dx, want, 54)
    y = relu_output(rng, x.shape)
    masked = dev(y)
    conv.conv2d_bwd_data(dev(dy), dev(w), masked, stride=stride, pad=1, relu_mask=True, tiles=tiles)
    assert_sum_close(masked, np.where(y > 0, want, 0), 54)


@pytest.mark.parametrize("splits", [None, 1, 4])
def test_all_taps_wgrad_matches_reference_at_vggs_first_layer_shape(splits):
    # 3 channels x 9 taps = 27 columns: every tap of a block's rows in one kernel, the
    # image's border taps reading zeros, the reduction split or not.
    rng = np.random.default_rng(5)
    x, dy = rand(rng, 2, 3, 7, 6), rand(rng, 2, 5, 7, 6)
    dw = dev(np.full((5, 3, 3, 3), np.nan, np.float32))
    db = dev(np.full(5, np.nan, np.float32))
    part = _workspace(x.shape, (5, 3, 3, 3), pad=1, splits=splits)
    conv.conv2d_bwd_weight(dev(x), dev(dy), dw, db, pad=1, splits=splits, workspace=part)
    ref_w, ref_b = conv.conv2d_bwd_weight_ref(x, dy, (5, 3, 3, 3), pad=1)
    assert_sum_close(dw, ref_w, 84)
    assert_sum_close(db, ref_b, 84)


@pytest.mark.parametrize("stride", [1, 2])
def test_all_taps_forward_matches_reference_at_vggs_first_layer_shape(stride):
    # 27 reduction columns in one step; 70 output channels: two column tiles of the GPU's
    # 64, the second mostly past the end; pixels past the image's edge read zeros.
    rng = np.random.default_rng(6)
    x, w, b = rand(rng, 2, 3, 9, 7), rand(rng, 70, 3, 3, 3), rand(rng, 70)
    P, Q = conv.conv_out_size(9, 3, stride, 1), conv.conv_out_size(7, 3, stride, 1)
    out = dev(np.full((2, 70, P, Q), np.nan, np.float32))
    conv.conv2d(dev(x), dev(w), dev(b), out, stride=stride, pad=1, relu=True)
    assert_sum_close(out, conv.conv2d_ref(x, w, b, stride=stride, pad=1, relu=True), 27)


@pytest.mark.parametrize("tiles", conv.GPU_CONV_TAPS_TILES)
def test_gpu_all_taps_forward_tile_on_a_small_problem(tiles):
    rng = np.random.default_rng(7)
    x, w = rand(rng, 1, 2, 5, 4), rand(rng, 3, 2, 3, 3)
    out = cuda.device_array((1, 3, 5, 4), np.float32)
    conv.conv2d(dev(x), dev(w), None, out, pad=1, tiles=tiles)
    assert_sum_close(out, conv.conv2d_ref(x, w, None, pad=1), 18)
    with pytest.raises(ValueError, match="tiles: .* at most 32"):
        conv.conv2d(dev(rand(rng, 1, 4, 5, 4)), dev(rand(rng, 3, 4, 3, 3)), None, out, pad=1,
                    tiles=tiles)   # 36 reduction columns


@given(base=st.integers(1, 600), L=st.integers(1, 10**7), sms=st.integers(1, 200),
       per_sm=st.integers(1, 8))
def test_wgrad_splits_stay_within_their_bounds(base, L, sms, per_sm):
    wave = sms * per_sm
    s = conv.wgrad_splits(base, L, 16, wave, sms)
    assert 1 <= s <= max(1, L // 128)                  # at least 8 steps of 16 a block
    assert base * s <= max(base, 2 * wave + base)      # at most about two waves of blocks


def test_wgrad_splits_of_vggs_layers_are_the_ones_measured_fastest():
    # H200 (132 SMs), kernel_speed's layers (about 50,000 pixels): the 128-channel layer's
    # 9 blocks a split, 2 an SM: 29 splits (261 blocks, one round) beat 59 (531, a third round
    # of 3 blocks); the 256-channel layer's 36: 7 (252) ran 18% faster than 15 (540); the
    # 512-channel layer's 144: 4 (576) ran 3.5% faster than 3 (432).
    assert conv.wgrad_splits(9, 4 * 12544, 16, 264, 132) == 29
    assert conv.wgrad_splits(36, 16 * 3136, 16, 264, 132) == 7
    assert conv.wgrad_splits(144, 64 * 784, 16, 264, 132) == 4


def test_all_taps_wgrad_refuses_a_layer_wider_than_its_tile():
    t = conv.GPU_WGRAD_TAPS_TILES[0]
    x, dy = dev(np.zeros((1, 4, 3, 3), np.float32)), dev(np.zeros((1, 2, 3, 3), np.float32))
    dw = cuda.device_array((2, 4, 3, 3), np.float32)   # 36 columns > 32
    with pytest.raises(ValueError, match="tiles: .* at most 32 columns"):
        conv.conv2d_bwd_weight(x, dy, dw, None, pad=1, tiles=t)


@pytest.mark.parametrize("tiles", conv.GPU_WGRAD_TILES + conv.GPU_WGRAD_TAPS_TILES
                         + conv.GPU_WGRAD_MMA_TILES)
def test_gpu_wgrad_tiles_on_a_small_problem(tiles):
    rng = np.random.default_rng(2)
    x, dy = rand(rng, 2, 3, 3, 3), rand(rng, 2, 5, 3, 3)
    dw, db = cuda.device_array((5, 3, 1, 1), np.float32), cuda.device_array(5, np.float32)
    conv.conv2d_bwd_weight(dev(x), dev(dy), dw, db, tiles=tiles)   # 18 pixels: two steps
    ref_w, ref_b = conv.conv2d_bwd_weight_ref(x, dy, (5, 3, 1, 1))
    assert_sum_close(dw, ref_w, 18)
    assert_sum_close(db, ref_b, 18)


def test_rejects_bad_input_before_launch():
    x, w = dev(np.zeros((1, 3, 5, 5), np.float32)), dev(np.zeros((4, 3, 3, 3), np.float32))
    out = dev(np.zeros((1, 4, 5, 5), np.float32))
    with pytest.raises(TypeError, match="x: expected a device array"):
        conv.conv2d(np.zeros((1, 3, 5, 5), np.float32), w, None, out, pad=1)
    with pytest.raises(ValueError, match=r"w: expected 3 input channels"):
        conv.conv2d(x, dev(np.zeros((4, 2, 3, 3), np.float32)), None, out, pad=1)
    with pytest.raises(ValueError, match=r"out: expected shape \(1, 4, 3, 3\)"):
        conv.conv2d(x, w, None, out, pad=0)            # no padding: 3x3 output
    with pytest.raises(ValueError, match=r"bias: expected shape \(4,\)"):
        conv.conv2d(x, w, dev(np.zeros(3, np.float32)), out, pad=1)
    with pytest.raises(ValueError, match=r"relu: expected True or False, got 'no' \(str\)"):
        conv.conv2d(x, w, None, dev(np.zeros((1, 4, 3, 3), np.float32)), relu="no")
    with pytest.raises(ValueError, match=r"pad: expected an integer, got True"):
        conv.conv2d(x, w, None, dev(np.zeros((1, 4, 3, 3), np.float32)), pad=True)
    with pytest.raises(ValueError, match="stride: expected a positive integer"):
        conv.conv2d(x, w, None, out, stride=0, pad=1)
    with pytest.raises(ValueError, match="does not fit"):
        conv.conv2d(dev(np.zeros((1, 3, 2, 2), np.float32)), w, None, out)
    with pytest.raises(ValueError, match=r"dy: expected shape \(1, 4, 5, 5\)"):
        conv.conv2d_bwd_data(dev(np.zeros((1, 4, 4, 4), np.float32)), w, x, pad=1)
    with pytest.raises(ValueError, match=r"dw: expected 3 input channels"):
        conv.conv2d_bwd_weight(x, out, dev(np.zeros((4, 1, 3, 3), np.float32)), None, pad=1)
    x9, dy9 = dev(np.zeros((1, 3, 9, 9), np.float32)), dev(np.zeros((1, 4, 9, 9), np.float32))
    with pytest.raises(ValueError, match=r"workspace: the reduction is split 2 ways.*at least 224 elements"):
        conv.conv2d_bwd_weight(x9, dy9, dev(np.zeros((4, 3, 3, 3), np.float32)), None, pad=1,
                               splits=2)   # 81 rows: two splits of a 32-row step or less
    with pytest.raises(ValueError, match="tiles: .* is not built"):
        conv.conv2d(x, w, None, out, pad=1, tiles=conv.Tiles(7, 7, 7, 7, 7))


def test_fused_relu_keeps_nan():
    """The fused ReLU must not be max(v, 0): on the GPU that is fmaxf, which turns NaN into 0."""
    x = np.ones((1, 1, 3, 3), np.float32)
    x[0, 0, 0, 0] = np.nan                                # reaches output pixel (0, 0) only
    w = np.array([[[[1.0]]], [[[-1.0]]]], np.float32)     # 1x1, K=2: one positive, one negative
    out = cuda.device_array((1, 2, 3, 3), np.float32)
    conv.conv2d(dev(x), dev(w), None, out, relu=True)
    np.testing.assert_array_equal(out.copy_to_host(), conv.conv2d_ref(x, w, relu=True))
    assert np.isnan(out.copy_to_host()[0, :, 0, 0]).all()


def test_register_tile_refuses_a_pass_that_does_not_split_the_step():
    from kernels._tile import Tiles, register_tile
    for bad in (3, 8, 0):   # not a power of two, more rows than the step, none
        with pytest.raises(ValueError, match="rows_per_pass"):
            register_tile(Tiles(8, 8, 4, 2, 2), 8, 8, rows_per_pass=bad)


def test_backward_data_is_compiled_for_a_stride():
    from kernels._conv_kernels import make_conv_kernel
    t = conv.SIM_CONV_TILES[0] if backend.SIMULATOR else conv.GPU_CONV_TILES[0]
    for bad in (None, 0, 2.0):
        with pytest.raises(ValueError, match="stride"):
            make_conv_kernel(t, transposed=True, stride=bad)
