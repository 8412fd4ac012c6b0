"""1-D convolutions (Wav2Vec2's feature encoder and positional conv) and weight norm against
float64 NumPy references; the references against each other (adjoints, finite differences)
and against torch.autograd."""

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import conv, conv1d
from proto.device import backend
from proto.device.backend import cuda
from tests.helpers import FULL_SIZE, dev, rand

EPS32 = float(np.finfo(np.float32).eps)


def assert_sum_close(actual, expected, length):
    """Each output is a float32 sum of `length` products of unit-scale values: partial sums
    grow like sqrt(length), each addition rounds by eps32 of one, and the errors random-walk,
    about length * eps32 in all (as in tests/test_conv.py). atol = 4x that (at least 1e-5),
    rtol 1e-4 for large outputs."""
    actual = actual.copy_to_host() if hasattr(actual, "copy_to_host") else actual
    np.testing.assert_allclose(actual, expected, rtol=1e-4, atol=max(1e-5, 4 * length * EPS32))


def nans(shape):
    """An output that every element of must be written."""
    return dev(np.full(shape, np.nan, np.float32))


# ---------------------------------------------------------------------------- feature encoder
@st.composite
def encoder_cases(draw, scale=1):
    k, stride = draw(st.sampled_from([1, 2, 3, 10])), draw(st.sampled_from([1, 2, 5]))
    T_out = draw(st.integers(1, 6))
    T = (T_out - 1) * stride + k + draw(st.integers(0, stride - 1))   # a frame left over, maybe
    return dict(B=draw(st.integers(1, 2)), C=draw(st.integers(1, 4)) * scale,
                K=draw(st.integers(1, 5)) * scale, T=T * scale, k=k, stride=stride,
                bias=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def _encoder_arrays(c):
    rng = np.random.default_rng(c["seed"])
    T_out = conv1d.conv1d_out_size(c["T"], c["k"], c["stride"])
    return (rand(rng, c["B"], c["C"], c["T"]), rand(rng, c["K"], c["C"], c["k"]),
            rand(rng, c["K"]), rand(rng, c["B"], c["K"], T_out))


@given(data=st.data())
def test_conv1d_forward_matches_reference(data, scale):
    c = data.draw(encoder_cases(scale))
    x, w, b, dy = _encoder_arrays(c)
    out = nans(dy.shape)
    bias = b if c["bias"] else None
    conv1d.conv1d(dev(x), dev(w), None if bias is None else dev(bias), out, stride=c["stride"])
    assert_sum_close(out, conv1d.conv1d_ref(x, w, bias, stride=c["stride"]), c["C"] * c["k"])


@given(data=st.data())
def test_conv1d_backward_data_matches_reference(data, scale):
    c = data.draw(encoder_cases(scale))
    x, w, _, dy = _encoder_arrays(c)
    dx = nans(x.shape)   # frames no output reads (the leftover) get 0
    conv1d.conv1d_bwd_data(dev(dy), dev(w), dx, stride=c["stride"])
    want = conv1d.conv1d_bwd_data_ref(dy, w, c["T"], stride=c["stride"])
    assert_sum_close(dx, want, c["K"] * c["k"])


@given(data=st.data(), split=st.booleans())
def test_conv1d_backward_weight_matches_reference(data, split, scale, monkeypatch):
    """split: kernels.conv splits the reduction 3 ways (the simulator never does on its own),
    so the partials go through the workspace conv1d takes from backend.empty."""
    c = data.draw(encoder_cases(scale))
    x, w, _, dy = _encoder_arrays(c)
    if split:
        plan = conv._wgrad_launch
        monkeypatch.setattr(conv, "_wgrad_launch", lambda g, t, s: plan(g, t, 3 if s is None else s))
    dw, db = nans(w.shape), (nans(c["K"]) if c["bias"] else None)
    dx_, dy_ = dev(x), dev(dy)
    conv1d.conv1d_bwd_weight(dx_, dy_, dw, db, stride=c["stride"])
    ref_w, ref_b = conv1d.conv1d_bwd_weight_ref(x, dy, c["k"], stride=c["stride"])
    length = dy.size // c["K"]
    assert_sum_close(dw, ref_w, length)
    if db is not None:
        assert_sum_close(db, ref_b, length)
    first = dw.copy_to_host()
    conv1d.conv1d_bwd_weight(dx_, dy_, dw, db, stride=c["stride"])
    assert np.array_equal(dw.copy_to_host(), first)


@pytest.mark.gpu
@pytest.mark.parametrize("C, K, k, stride, T", [(1, 512, 10, 5, 64000), (512, 512, 3, 2, 12799),
                                                (512, 512, 2, 2, 399)])
def test_conv1d_at_wav2vec2_feature_encoder_sizes(C, K, k, stride, T):
    """Batch 8 of 4 s at 16 kHz: the first conv, the widest 3-tap one, the last 2-tap one."""
    rng = np.random.default_rng(8)
    x, w = rand(rng, 8, C, T), rand(rng, K, C, k, scale=0.1)
    T_out = conv1d.conv1d_out_size(T, k, stride)
    dy = rand(rng, 8, K, T_out)
    out, dx, dw, db = nans((8, K, T_out)), nans(x.shape), nans(w.shape), nans(K)
    conv1d.conv1d(dev(x), dev(w), None, out, stride=stride)
    conv1d.conv1d_bwd_data(dev(dy), dev(w), dx, stride=stride)
    conv1d.conv1d_bwd_weight(dev(x), dev(dy), dw, db, stride=stride)
    assert_sum_close(out, conv1d.conv1d_ref(x, w, stride=stride), C * k)
    assert_sum_close(dx, conv1d.conv1d_bwd_data_ref(dy, w, T, stride=stride), K * k)
    ref_w, ref_b = conv1d.conv1d_bwd_weight_ref(x, dy, k, stride=stride)
    assert_sum_close(dw, ref_w, 8 * T_out)
    assert_sum_close(db, ref_b, 8 * T_out)


# ---------------------------------------------------------------------------- grouped
@st.composite
def grouped_cases(draw, scale=1):
    k = draw(st.integers(1, 6))
    pad = draw(st.integers(0, k))
    T = draw(st.integers(max(1, k - 2 * pad), 9))
    most = conv1d.conv1d_out_size(T, k, 1, pad)
    return dict(B=draw(st.integers(1, 2)), groups=draw(st.integers(1, 3)),
                Cr=draw(st.integers(1, 3)) * scale, Co=draw(st.integers(1, 5)) * scale, T=T, k=k,
                pad=pad, T_out=draw(st.integers(max(1, most - 2), most)),
                bias=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def _grouped_arrays(c):
    rng = np.random.default_rng(c["seed"])
    C, K = c["groups"] * c["Cr"], c["groups"] * c["Co"]
    return (rand(rng, c["B"], C, c["T"]), rand(rng, K, c["Cr"], c["k"]), rand(rng, K),
            rand(rng, c["B"], K, c["T_out"]))


def _geometry(c):
    return dict(groups=c["groups"], pad=c["pad"])


@given(data=st.data())
def test_grouped_forward_matches_reference(data, scale):
    c = data.draw(grouped_cases(scale))
    x, w, b, dy = _grouped_arrays(c)
    out = nans(dy.shape)
    bias = b if c["bias"] else None
    conv1d.conv1d_grouped(dev(x), dev(w), None if bias is None else dev(bias), out, **_geometry(c))
    want = conv1d.conv1d_grouped_ref(x, w, bias, c["T_out"], **_geometry(c))
    assert_sum_close(out, want, c["Cr"] * c["k"])


@given(data=st.data())
def test_grouped_backward_data_matches_reference(data, scale):
    c = data.draw(grouped_cases(scale))
    x, w, _, dy = _grouped_arrays(c)
    dx = nans(x.shape)
    conv1d.conv1d_grouped_bwd_data(dev(dy), dev(w), dx, **_geometry(c))
    want = conv1d.conv1d_grouped_bwd_data_ref(dy, w, c["T"], **_geometry(c))
    assert_sum_close(dx, want, c["Co"] * c["k"])


@given(data=st.data(), splits=st.sampled_from([None, 1, 2, 3]))
def test_grouped_backward_weight_matches_reference(data, splits, scale):
    c = data.draw(grouped_cases(scale))
    x, w, _, dy = _grouped_arrays(c)
    dw, db = nans(w.shape), (nans(w.shape[0]) if c["bias"] else None)
    x_, dy_ = dev(x), dev(dy)
    conv1d.conv1d_grouped_bwd_weight(x_, dy_, dw, db, splits=splits, **_geometry(c))
    ref_w, ref_b = conv1d.conv1d_grouped_bwd_weight_ref(x, dy, c["k"], **_geometry(c))
    length = c["B"] * c["T_out"]
    assert_sum_close(dw, ref_w, length)
    if db is not None:
        assert_sum_close(db, ref_b, length)
    # Split partials are added in split order (no atomics): a rerun is bit-identical.
    first = dw.copy_to_host(), (None if db is None else db.copy_to_host())
    conv1d.conv1d_grouped_bwd_weight(x_, dy_, dw, db, splits=splits, **_geometry(c))
    assert np.array_equal(dw.copy_to_host(), first[0])
    assert db is None or np.array_equal(db.copy_to_host(), first[1])


GROUPED_MMA = conv1d.SIM_GROUPED_MMA_TILES if backend.SIMULATOR else conv1d.GPU_GROUPED_MMA_TILES


@given(data=st.data(), tiles=st.sampled_from(GROUPED_MMA))
def test_grouped_on_tensor_cores_matches_reference(data, tiles, scale):
    """Forward and backward-data on a tensor-core tile, whose A operand is the staged window
    itself (A[p, q] = win[p + q]): within assert_sum_close's 8 units of roundoff a product
    (the split's 12 and truncating sums fit it for these short sums; kernels._tf32)."""
    c = data.draw(grouped_cases(scale))
    x, w, b, dy = _grouped_arrays(c)
    out, dx = nans(dy.shape), nans(x.shape)
    conv1d.conv1d_grouped(dev(x), dev(w), dev(b), out, tiles=tiles, **_geometry(c))
    assert_sum_close(out, conv1d.conv1d_grouped_ref(x, w, b, c["T_out"], **_geometry(c)),
                     c["Cr"] * c["k"])
    conv1d.conv1d_grouped_bwd_data(dev(dy), dev(w), dx, tiles=tiles, **_geometry(c))
    assert_sum_close(dx, conv1d.conv1d_grouped_bwd_data_ref(dy, w, c["T"], **_geometry(c)),
                     c["Co"] * c["k"])


def test_grouped_forward_and_backward_data_launch_the_tensor_core_tile(monkeypatch):
    """Unforced, the positional convolution's forward and backward-data run the device's
    tensor-core tile (its kernels, its threads), not a SIMT one."""
    seen = []
    real = conv1d.launch
    monkeypatch.setattr(conv1d, "launch", lambda kernel, grid, threads, *rest: (
        seen.append((kernel, threads)), real(kernel, grid, threads, *rest)))
    rng = np.random.default_rng(3)
    c = _positional(False)
    g = dict(groups=c["groups"], pad=c["pad"])
    x, w = rand(rng, c["B"], c["C"], c["T"]), rand(rng, c["C"], c["C"] // c["groups"], c["k"])
    conv1d.conv1d_grouped(dev(x), dev(w), None, nans(x.shape), **g)
    conv1d.conv1d_grouped_bwd_data(dev(x), dev(w), nans(x.shape), **g)
    t = conv1d.GROUPED_TILE
    assert t.mma and t in GROUPED_MMA
    assert seen == [(conv1d._FWD[t], t.threads), (conv1d._BWD_DATA[t], t.threads)]


# (the tensor-core tiles only on the GPU: the simulator takes over a minute each, and its
# own mma tile runs the same fragment code above)
@pytest.mark.slow   # (5 to 10 s each on the simulator; make test-all and CI run them)
@pytest.mark.parametrize("tiles", conv1d.GPU_GROUPED_TILES
                         + (() if backend.SIMULATOR else conv1d.GPU_GROUPED_MMA_TILES))
def test_gpu_grouped_tiles_on_a_small_problem(tiles):
    """The GPU's tiles run here too: 3 output channels of a group (of the tile's 48), 40
    frames (the 64-frame tile part full, the 32-frame one's second tile mostly past the end),
    66 taps (two tap steps of 64, the second with 2 taps), padding on both sides."""
    rng = np.random.default_rng(1)
    g = dict(groups=2, pad=33)
    x, w, b = rand(rng, 1, 4, 40), rand(rng, 6, 2, 66), rand(rng, 6)
    out = nans((1, 6, 40))
    conv1d.conv1d_grouped(dev(x), dev(w), dev(b), out, tiles=tiles, **g)
    assert_sum_close(out, conv1d.conv1d_grouped_ref(x, w, b, 40, **g), 2 * 66)
    dy, dx = rand(rng, 1, 6, 40), nans(x.shape)
    conv1d.conv1d_grouped_bwd_data(dev(dy), dev(w), dx, tiles=tiles, **g)
    assert_sum_close(dx, conv1d.conv1d_grouped_bwd_data_ref(dy, w, 40, **g), 3 * 66)


@pytest.mark.slow   # (5 to 10 s each on the simulator; make test-all and CI run them)
@pytest.mark.parametrize("tiles", conv1d.GPU_GROUPED_WGRAD_TILES)
def test_gpu_grouped_wgrad_tiles_on_a_small_problem(tiles):
    """130 taps: a second tap tile of the 128; 50 output channels of a group: a second
    channel tile of the 48; 40 frames: a second frame step of the 32; split in 3."""
    rng = np.random.default_rng(2)
    g = dict(groups=1, pad=65)
    x, dy = rand(rng, 2, 1, 39), rand(rng, 2, 50, 40)
    dw, db = nans((50, 1, 130)), nans(50)
    conv1d.conv1d_grouped_bwd_weight(dev(x), dev(dy), dw, db, tiles=tiles, splits=3, **g)
    ref_w, ref_b = conv1d.conv1d_grouped_bwd_weight_ref(x, dy, 130, **g)
    assert_sum_close(dw, ref_w, 80)
    assert_sum_close(db, ref_b, 80)


def _positional(scale_to_model: bool):
    """Wav2Vec2-base's positional conv on a GPU (768 channels, 16 groups, 128 taps, pad 64,
    batch 8 of 199 frames); a small one of the same form (even kernel, pad k/2) here."""
    if scale_to_model:
        return dict(B=8, C=768, groups=16, k=128, pad=64, T=199)
    return dict(B=2, C=6, groups=3, k=4, pad=2, T=5)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [65, 199])
@pytest.mark.parametrize("tiles", [None, *conv1d.GPU_GROUPED_MMA_TILES])
def test_grouped_at_wav2vec2_positional_conv_size(T, tiles):
    rng = np.random.default_rng(9)
    s = _positional(True)
    g = dict(groups=s["groups"], pad=s["pad"])
    x, w, b = rand(rng, 8, 768, T), rand(rng, 768, 48, 128, scale=0.1), rand(rng, 768)
    dy = rand(rng, 8, 768, T)
    out, dx, dw, db = nans((8, 768, T)), nans(x.shape), nans(w.shape), nans(768)
    conv1d.conv1d_grouped(dev(x), dev(w), dev(b), out, tiles=tiles, **g)
    conv1d.conv1d_grouped_bwd_data(dev(dy), dev(w), dx, tiles=tiles, **g)
    conv1d.conv1d_grouped_bwd_weight(dev(x), dev(dy), dw, db, **g)
    assert_sum_close(out, conv1d.conv1d_grouped_ref(x, w, b, T, **g), 48 * 128)
    assert_sum_close(dx, conv1d.conv1d_grouped_bwd_data_ref(dy, w, T, **g), 48 * 128)
    ref_w, ref_b = conv1d.conv1d_grouped_bwd_weight_ref(x, dy, 128, **g)
    assert_sum_close(dw, ref_w, 8 * T)
    assert_sum_close(db, ref_b, 8 * T)


# ---------------------------------------------------------------------------- weight norm
def _assert_weight_norm_close(actual, expected, scale_terms, rows):
    """Each result is a product of a few float32 roundings and a tap's sum of `rows` squares
    (or products) taken in chunks, within rows * eps32 of the sum's magnitude; so within
    (rows + 8) * eps32 of `scale_terms`, the magnitude of the terms it is computed from."""
    actual = actual.copy_to_host() if hasattr(actual, "copy_to_host") else actual
    err = np.abs(actual.astype(np.float64) - expected)
    bound = (rows + 8) * EPS32 * scale_terms + 1e-30
    assert np.all(err <= bound), float(np.max(err / bound))


@given(K=st.integers(1, 5), Cr=st.integers(1, 4), k=st.integers(1, 6),
       seed=st.integers(0, 2**16))
def test_weight_norm_matches_reference(K, Cr, k, seed, scale):
    rng = np.random.default_rng(seed)
    K = K * scale
    v, g, dw = rand(rng, K, Cr, k), rand(rng, 1, 1, k), rand(rng, K, Cr, k)
    w = nans(v.shape)
    conv1d.weight_norm(dev(v), dev(g), w)
    want = conv1d.weight_norm_ref(v, g)
    _assert_weight_norm_close(w, want, np.abs(want), K * Cr)
    dv, dg = nans(v.shape), nans(g.shape)
    conv1d.weight_norm_bwd(dev(v), dev(g), dev(dw), dv, dg)
    _assert_weight_norm_grads_close(dv, dg, *conv1d.weight_norm_bwd_ref(v, g, dw), v, g, dw)


def _assert_weight_norm_grads_close(dv, dg, want_dv, want_dg, v, g, dw):
    """dg = sum(dw * v) / n, from terms |dw * v| / n; dv = g/n * dw - g/n * dg/n * v, from
    terms |g/n| (|dw| + sum(|dw * v|) / n^2 * |v|)."""
    v, dw = v.astype(np.float64), dw.astype(np.float64)
    n = np.sqrt((v * v).sum(axis=(0, 1), keepdims=True))
    dv_v = (np.abs(dw) * np.abs(v)).sum(axis=(0, 1), keepdims=True)
    rows = v.shape[0] * v.shape[1]
    _assert_weight_norm_close(dg, want_dg, dv_v / n, rows)
    _assert_weight_norm_close(dv, want_dv, np.abs(g / n) * (np.abs(dw) + dv_v / n ** 2 * np.abs(v)),
                              rows)


# ---------------------------------------------------------------------------- the references
def _dot(a, b):
    return float(np.sum(np.asarray(a, np.float64) * np.asarray(b, np.float64)))


@given(data=st.data())
def test_encoder_references_are_adjoint(data):
    """<conv(x, w), dy> = <x, bwd_data(dy)> = <w, bwd_weight(x, dy)>, and the bias term's
    <b, db>: the three references restate one bilinear map."""
    c = data.draw(encoder_cases())
    x, w, b, dy = _encoder_arrays(c)
    s = c["stride"]
    y = conv1d.conv1d_ref(x, w, stride=s)
    dw, db = conv1d.conv1d_bwd_weight_ref(x, dy, c["k"], stride=s)
    assert np.isclose(_dot(y, dy), _dot(x, conv1d.conv1d_bwd_data_ref(dy, w, c["T"], stride=s)))
    assert np.isclose(_dot(y, dy), _dot(w, dw))
    assert np.isclose(_dot(conv1d.conv1d_ref(x, w, b, stride=s) - y, dy), _dot(b, db))


@given(data=st.data())
def test_grouped_references_are_adjoint(data):
    c = data.draw(grouped_cases())
    x, w, b, dy = _grouped_arrays(c)
    g = _geometry(c)
    y = conv1d.conv1d_grouped_ref(x, w, None, c["T_out"], **g)
    dw, db = conv1d.conv1d_grouped_bwd_weight_ref(x, dy, c["k"], **g)
    assert np.isclose(_dot(y, dy), _dot(x, conv1d.conv1d_grouped_bwd_data_ref(dy, w, c["T"], **g)))
    assert np.isclose(_dot(y, dy), _dot(w, dw))
    yb = conv1d.conv1d_grouped_ref(x, w, b, c["T_out"], **g)
    assert np.isclose(_dot(yb - y, dy), _dot(b, db))


def test_grouped_reference_is_a_brute_force_sum():
    """The definition, term by term: zero outside x, groups kept apart."""
    rng = np.random.default_rng(3)
    groups, pad, k, T, T_out = 2, 2, 4, 5, 5
    x, w, b = rand(rng, 2, 4, T), rand(rng, 6, 2, k), rand(rng, 6)
    want = np.zeros((2, 6, T_out))
    for bb in range(2):
        for o in range(6):
            g = o // 3
            for t in range(T_out):
                want[bb, o, t] = float(b[o]) + sum(float(w[o, i, r]) * float(x[bb, g * 2 + i, t + r - pad])
                                            for i in range(2) for r in range(k)
                                            if 0 <= t + r - pad < T)
    got = conv1d.conv1d_grouped_ref(x, w, b, T_out, groups=groups, pad=pad)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_weight_norm_backward_reference_is_the_derivative():
    """Central differences of weight_norm_ref (float64) against weight_norm_bwd_ref."""
    rng = np.random.default_rng(4)
    v, g, dw = rng.standard_normal((3, 2, 4)), rng.standard_normal((1, 1, 4)), rng.standard_normal((3, 2, 4))
    dv, dg = conv1d.weight_norm_bwd_ref(v, g, dw)
    h = 1e-6

    def loss(v_, g_):
        return _dot(conv1d.weight_norm_ref(v_, g_), dw)
    for arr, grad in ((v, dv), (g, dg)):
        for idx in np.ndindex(arr.shape):
            up, down = arr.copy(), arr.copy()
            up[idx] += h
            down[idx] -= h
            args = (up, g) if arr is v else (v, up)
            args_down = (down, g) if arr is v else (v, down)
            assert np.isclose((loss(*args) - loss(*args_down)) / (2 * h), grad[idx], rtol=1e-6,
                              atol=1e-8)


# ---------------------------------------------------------------------------- torch
def test_matches_torch_autograd():
    """Wav2Vec2's pieces in torch (float64, on the CPU), gradients by autograd, against the
    kernels (float32) on the same float32 inputs: a strided feature-encoder conv; the
    positional conv (weight norm over dim 2, grouped, padded, bias, last frame dropped).
    Tiny on the simulator; wav2vec2-base's sizes on a GPU. The kernels' sums are float32
    sums of unit-scale products of the reference's inputs, so the tolerance is that of the
    reference tests (assert_sum_close over the sum's length); weight norm's as above."""
    torch = pytest.importorskip("torch")
    big = FULL_SIZE
    rng = np.random.default_rng(5)
    t64 = lambda a: torch.from_numpy(a.astype(np.float64)).requires_grad_()   # noqa: E731

    # the feature encoder's second conv (512 -> 512, k 3, stride 2, no bias)
    B, C, K, k, s, T = (8, 512, 512, 3, 2, 3199) if big else (2, 3, 4, 3, 2, 11)
    x, w = rand(rng, B, C, T), rand(rng, K, C, k)
    tx, tw = t64(x), t64(w)
    ty = torch.nn.functional.conv1d(tx, tw, stride=s)
    dy = rand(rng, *ty.shape)
    ty.backward(torch.from_numpy(dy.astype(np.float64)))
    out, dx, dw = nans(ty.shape), nans(x.shape), nans(w.shape)
    conv1d.conv1d(dev(x), dev(w), None, out, stride=s)
    conv1d.conv1d_bwd_data(dev(dy), dev(w), dx, stride=s)
    conv1d.conv1d_bwd_weight(dev(x), dev(dy), dw, None, stride=s)
    assert_sum_close(out, ty.detach().numpy(), C * k)
    assert_sum_close(dx, tx.grad.numpy(), K * k)
    assert_sum_close(dw, tw.grad.numpy(), B * ty.shape[2])

    # the positional conv: y = conv(x, weight_norm(v, g), b)[..., :T]
    p = _positional(big)
    B, C, G, k, pad, T = p["B"], p["C"], p["groups"], p["k"], p["pad"], p["T"]
    x, v, g, b = rand(rng, B, C, T), rand(rng, C, C // G, k), rand(rng, 1, 1, k), rand(rng, C)
    tx, tv, tg, tb = t64(x), t64(v), t64(g), t64(b)
    tw = torch._weight_norm(tv, tg, 2)   # what torch.nn.utils.weight_norm(conv, dim=2) computes
    tw.retain_grad()
    ty = torch.nn.functional.conv1d(tx, tw, tb, padding=pad, groups=G)[:, :, :-1]
    assert ty.shape[2] == T
    dy = rand(rng, *ty.shape)
    ty.backward(torch.from_numpy(dy.astype(np.float64)))
    geo = dict(groups=G, pad=pad)
    w_ = nans(v.shape)
    conv1d.weight_norm(dev(v), dev(g), w_)
    _assert_weight_norm_close(w_, tw.detach().numpy(), np.abs(tw.detach().numpy()), C * C // G)
    # the convolutions take our float32 weight, as in training; torch's, the float64 one
    w32 = w_.copy_to_host()
    out, dx, dw, db = nans(ty.shape), nans(x.shape), nans(v.shape), nans(C)
    conv1d.conv1d_grouped(dev(x), w_, dev(b), out, **geo)
    conv1d.conv1d_grouped_bwd_data(dev(dy), w_, dx, **geo)
    conv1d.conv1d_grouped_bwd_weight(dev(x), dev(dy), dw, db, **geo)
    length = C // G * k
    assert_sum_close(out, conv1d.conv1d_grouped_ref(x, w32, b, T, **geo), length)
    # torch's float64 weight is w32 before its rounding (a few eps32 of each weight)
    assert_sum_close(out, ty.detach().numpy(), length)
    assert_sum_close(dx, tx.grad.numpy(), length)
    assert_sum_close(dw, tw.grad.numpy(), B * T)
    assert_sum_close(db, tb.grad.numpy(), B * T)
    dv, dg = nans(v.shape), nans(g.shape)
    dw32 = tw.grad.numpy().astype(np.float32)
    conv1d.weight_norm_bwd(dev(v), dev(g), dev(dw32), dv, dg)
    _assert_weight_norm_grads_close(dv, dg, tv.grad.numpy(), tg.grad.numpy(), v, g, dw32)


# ---------------------------------------------------------------------------- bad input
@pytest.fixture
def no_launch(monkeypatch):
    """Fails the test if any kernel is launched."""
    def refuse(*args, **kw):
        raise AssertionError("a kernel was launched")
    for module in (conv1d, conv):
        monkeypatch.setattr(module, "launch", refuse)


def test_rejects_bad_input_before_launch(no_launch):
    z = lambda *s: dev(np.zeros(s, np.float32))   # noqa: E731
    x, w, out = z(2, 3, 12), z(4, 3, 3), z(2, 4, 5)
    with pytest.raises(TypeError, match="x: expected a device array"):
        conv1d.conv1d(np.zeros((2, 3, 12), np.float32), w, None, out, stride=2)
    with pytest.raises(ValueError, match=r"w: expected 3 input channels"):
        conv1d.conv1d(x, z(4, 2, 3), None, out, stride=2)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 4, 10\)"):
        conv1d.conv1d(x, w, None, out)
    with pytest.raises(ValueError, match="stride: expected a positive integer"):
        conv1d.conv1d(x, w, None, out, stride=0)
    with pytest.raises(ValueError, match="w: a 3-tap kernel does not fit 2 frames"):
        conv1d.conv1d(z(2, 3, 2), w, None, out)
    with pytest.raises(ValueError, match=r"b: expected shape \(4,\)"):
        conv1d.conv1d(x, w, z(3), out, stride=2)
    with pytest.raises(ValueError, match="output 'out' .* overlaps 'x'"):
        conv1d.conv1d(x, w, None, x.reshape(72)[:40].reshape(2, 4, 5), stride=2)
    with pytest.raises(ValueError, match=r"dy: expected shape \(2, 4, 5\)"):
        conv1d.conv1d_bwd_data(z(2, 4, 6), w, x, stride=2)
    with pytest.raises(ValueError, match=r"dw: expected 3 input channels"):
        conv1d.conv1d_bwd_weight(x, out, z(4, 1, 3), None, stride=2)
    with pytest.raises(TypeError, match="db: expected dtype float32"):
        conv1d.conv1d_bwd_weight(x, out, w, dev(np.zeros(4)), stride=2)

    g = dict(groups=2, pad=2)
    x, w, out = z(2, 4, 6), z(6, 2, 4), z(2, 6, 6)
    with pytest.raises(ValueError, match="groups: 4 does not divide the 4 input and 6 output"):
        conv1d.conv1d_grouped(x, w, None, out, groups=4, pad=2)
    with pytest.raises(ValueError, match=r"w: expected 2 input channels a group"):
        conv1d.conv1d_grouped(x, z(6, 4, 4), None, out, **g)
    with pytest.raises(ValueError, match="T_out: 6 frames padded by 2 .* at most 7 .* got 8"):
        conv1d.conv1d_grouped(x, w, None, z(2, 6, 8), **g)
    with pytest.raises(ValueError, match=r"pad: expected an integer >= 0, got -1"):
        conv1d.conv1d_grouped(x, w, None, out, groups=2, pad=-1)
    with pytest.raises(ValueError, match=r"groups: expected a positive integer, got 2.0"):
        conv1d.conv1d_grouped(x, w, None, out, groups=2.0, pad=2)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 6, 6\), got \(1, 6, 6\)"):
        conv1d.conv1d_grouped(x, w, None, z(1, 6, 6), **g)
    with pytest.raises(ValueError, match=r"b: expected shape \(6,\)"):
        conv1d.conv1d_grouped(x, w, z(4), out, **g)
    with pytest.raises(ValueError, match=r"dy: expected shape \(2, 6, 6\), got \(2, 4, 6\)"):
        conv1d.conv1d_grouped_bwd_data(z(2, 4, 6), w, x, **g)
    with pytest.raises(ValueError, match="output 'dx' .* overlaps 'dy'"):
        conv1d.conv1d_grouped_bwd_data(out, w, out.reshape(72)[:48].reshape(2, 4, 6), **g)
    with pytest.raises(ValueError, match="output 'dw' .* overlaps 'x'"):
        conv1d.conv1d_grouped_bwd_weight(x, out, x.reshape(48).reshape(6, 2, 4), None, **g)
    with pytest.raises(ValueError, match="splits: expected a positive integer"):
        conv1d.conv1d_grouped_bwd_weight(x, out, w, None, splits=0, **g)

    v, gg = z(6, 2, 4), z(1, 1, 4)
    with pytest.raises(ValueError, match=r"g: expected shape \(1, 1, 4\)"):
        conv1d.weight_norm(v, z(4), z(6, 2, 4))
    with pytest.raises(ValueError, match=r"w: expected shape \(6, 2, 4\)"):
        conv1d.weight_norm(v, gg, z(6, 2, 3))
    with pytest.raises(ValueError, match="output 'dv' .* overlaps 'dw'"):
        dw = z(6, 2, 4)
        conv1d.weight_norm_bwd(v, gg, dw, dw, z(1, 1, 4))
    with pytest.raises(ValueError, match=r"dg: expected shape \(1, 1, 4\)"):
        conv1d.weight_norm_bwd(v, gg, z(6, 2, 4), z(6, 2, 4), z(4))
