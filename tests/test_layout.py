"""Layout kernels (kernels.layout): batched transpose, zeroing padded frames, column sums."""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import layout
from proto.device import backend
from proto.device.backend import cuda
from tests.helpers import FULL_SIZE, dev, rand

U = 2.0 ** -24


# ---------------------------------------------------------------------------- transpose
@given(B=st.integers(1, 3), M=st.integers(1, 11), N=st.integers(1, 11),
       seed=st.integers(0, 2**16))
def test_transpose_last2_is_exact(B, M, N, seed, scale):
    """Any M, N: whole and partial tiles, more tiles than blocks (a grid-stride over tiles)."""
    x = rand(np.random.default_rng(seed), B, M * scale, N)
    out = cuda.device_array((B, N, M * scale), np.float32)
    layout.transpose_last2(dev(x), out)
    np.testing.assert_array_equal(out.copy_to_host(), layout.transpose_last2_ref(x))


def test_transpose_there_and_back():
    x = rand(np.random.default_rng(0), 2, 9, 6)
    y, z = cuda.device_array((2, 6, 9), np.float32), cuda.device_array((2, 9, 6), np.float32)
    layout.transpose_last2(dev(x), y)
    layout.transpose_last2(y, z)
    np.testing.assert_array_equal(z.copy_to_host(), x)


# ---------------------------------------------------------------------------- zero_frames
@given(B=st.integers(1, 4), T=st.integers(1, 9), D=st.integers(1, 7),
       seed=st.integers(0, 2**16))
def test_zero_frames_matches_reference(B, T, D, seed, scale):
    """Lengths anywhere in [-3, T + 3]: below 0 zeroes the whole sample, above T nothing."""
    rng = np.random.default_rng(seed)
    x = rand(rng, B, T, D * scale)
    lengths = rng.integers(-3, T + 4, B).astype(np.int32)
    dx = dev(x)
    layout.zero_frames(dx, dev(lengths))
    np.testing.assert_array_equal(dx.copy_to_host(), layout.zero_frames_ref(x, lengths))


def test_zero_frames_clips_extreme_lengths():
    x = rand(np.random.default_rng(1), 4, 5, 3)
    lengths = np.int32([-2**31, 2**31 - 1, 0, 5])
    dx = dev(x)
    layout.zero_frames(dx, dev(lengths))
    got = dx.copy_to_host()
    assert (got[0] == 0).all() and (got[2] == 0).all()
    np.testing.assert_array_equal(got[[1, 3]], x[[1, 3]])


# ---------------------------------------------------------------------------- column_sum
def _sum_bound(x, splits):
    """Each term passes through at most ceil(chunk / SUM_ROWS) additions in its thread,
    SUM_ROWS - 1 across the block's threads and splits - 1 across the runs: a float32 sum
    is within k u sum |x| (first order; 1.01 covers the rest) of the exact one, k their
    total."""
    M = x.shape[0]
    chunk = -(-M // splits)
    k = -(-chunk // layout.SUM_ROWS) + layout.SUM_ROWS + splits
    return 1.01 * k * U * np.abs(x.astype(np.float64)).sum(axis=0)


def _emulate(x, splits):
    """The kernels' order of additions, in float32 on the host: bit for bit."""
    M, N = x.shape
    R = layout.SUM_ROWS
    chunk = -(-M // splits)
    part = np.zeros((splits, N), np.float32)
    for s in range(splits):
        rows = np.arange(s * chunk, min(M, (s + 1) * chunk))
        acc = np.zeros((R, N), np.float32)
        for ty in range(R):
            for r in rows[ty::R]:
                acc[ty] += x[r]
        total = acc[0].copy()
        for ty in range(1, R):
            total += acc[ty]
        part[s] = total
    out = part[0].copy()
    for s in range(1, splits):
        out += part[s]
    return out


def _effective_splits(M, splits):
    return -(-M // -(-M // splits))


@given(M=st.integers(1, 40), N=st.integers(1, 13), seed=st.integers(0, 2**16),
       splits=st.one_of(st.none(), st.integers(1, 40)))
def test_column_sum_matches_reference_and_its_order(M, N, seed, splits, scale):
    M *= scale
    splits = None if splits is None else min(splits, M)
    x = rand(np.random.default_rng(seed), M, N)
    out = cuda.device_array(N, np.float32)
    layout.column_sum(dev(x), out, splits=splits)
    s = _effective_splits(M, layout.column_splits(M, N) if splits is None else splits)
    got = out.copy_to_host()
    err = np.abs(got.astype(np.float64) - x.astype(np.float64).sum(axis=0))
    assert np.all(err <= _sum_bound(x, s))
    np.testing.assert_array_equal(got, _emulate(x, s))


def test_column_sum_of_many_rows():
    """A feature encoder's frames: 100 000 rows on a GPU (a few hundred on the simulator)."""
    M, N = (300, 5) if not FULL_SIZE else (100_000, 512)
    x = rand(np.random.default_rng(2), M, N)
    out = cuda.device_array(N, np.float32)
    layout.column_sum(dev(x), out)
    s = _effective_splits(M, layout.column_splits(M, N))
    assert s > 1
    err = np.abs(out.copy_to_host().astype(np.float64) - x.astype(np.float64).sum(axis=0))
    assert np.all(err <= _sum_bound(x, s))


def test_graphed_column_sum_matches_eager_bit_for_bit():
    """The workspace comes from backend.empty: planned into the graph's arena when recorded."""
    from proto.graph import capture
    x = rand(np.random.default_rng(4), 23, 6)
    want = cuda.device_array(6, np.float32)
    layout.column_sum(dev(x), want)
    dx, out = dev(x), cuda.device_array(6, np.float32)
    with capture(lambda x: layout.column_sum(x, out), {"x": dx}, binding="alias",
                 warmup=0) as graph:
        graph.replay(x=dx)
        np.testing.assert_array_equal(out.copy_to_host(), want.copy_to_host())


# ---------------------------------------------------------------------------- bad input
def test_rejects_bad_input_before_launch():
    x = dev(np.zeros((2, 3, 4), np.float32))
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 4, 3\), got \(2, 3, 4\)"):
        layout.transpose_last2(x, dev(np.zeros((2, 3, 4), np.float32)))
    with pytest.raises(ValueError, match=r"x: expected 3 dimensions"):
        layout.transpose_last2(dev(np.zeros((3, 4), np.float32)), x)
    with pytest.raises(ValueError, match="output 'out'.*overlaps argument 'x'"):
        layout.transpose_last2(x, x.reshape(2, 4, 3))
    with pytest.raises(TypeError, match="lengths: expected dtype int32, got int64"):
        layout.zero_frames(x, dev(np.zeros(2, np.int64)))
    with pytest.raises(ValueError, match=r"lengths: expected shape \(2,\), got \(3,\)"):
        layout.zero_frames(x, dev(np.zeros(3, np.int32)))
    with pytest.raises(TypeError, match="x: expected dtype float32, got float16"):
        layout.zero_frames(dev(np.zeros((2, 3, 4), np.float16)), dev(np.zeros(2, np.int32)))
    m = dev(np.zeros((5, 4), np.float32))
    with pytest.raises(ValueError, match=r"out: expected shape \(4,\), got \(5,\)"):
        layout.column_sum(m, dev(np.zeros(5, np.float32)))
    with pytest.raises(ValueError, match="splits: expected at most 5, got 6"):
        layout.column_sum(m, dev(np.zeros(4, np.float32)), splits=6)
    with pytest.raises(ValueError, match="splits: expected a positive integer"):
        layout.column_sum(m, dev(np.zeros(4, np.float32)), splits=0)
    with pytest.raises(ValueError, match="output 'out'.*overlaps 'x'"):
        layout.column_sum(m, m.reshape(20)[:4])


# ---------------------------------------------------------------------------- torch
def test_matches_torch():
    """transpose(1, 2).contiguous() and masked_fill exactly; a linear layer's bias gradient
    (dy summed over rows) within the float32 summation bounds of both (torch's own order,
    pairwise, is within the same k u sum |dy|). Sizes: tiny on the simulator, the feature
    encoder's (8, 512, 199 x 5) frames on a GPU."""
    torch = pytest.importorskip("torch")
    B, C, T = (2, 5, 7) if not FULL_SIZE else (8, 512, 995)
    rng = np.random.default_rng(9)
    x = rand(rng, B, C, T)
    y = cuda.device_array((B, T, C), np.float32)
    layout.transpose_last2(dev(x), y)
    np.testing.assert_array_equal(y.copy_to_host(), torch.tensor(x).transpose(1, 2).contiguous().numpy())

    lengths = rng.integers(1, T + 1, B).astype(np.int32)
    dy = dev(y.copy_to_host())
    layout.zero_frames(dy, dev(lengths))
    mask = torch.arange(T)[None, :] >= torch.tensor(lengths)[:, None]
    want = torch.tensor(y.copy_to_host()).masked_fill(mask[:, :, None], 0.0).numpy()
    np.testing.assert_array_equal(dy.copy_to_host(), want)

    g = rand(rng, B * T, C)
    bias = torch.zeros(C, requires_grad=True)
    out = torch.nn.functional.linear(torch.tensor(rand(rng, B * T, 3)), torch.zeros(C, 3), bias)
    out.backward(torch.tensor(g))
    db = cuda.device_array(C, np.float32)
    layout.column_sum(dev(g), db)
    s = _effective_splits(B * T, layout.column_splits(B * T, C))
    bound = _sum_bound(g, s) + math.ceil(math.log2(B * T) + 8) * U * np.abs(g).astype(np.float64).sum(0)
    assert np.all(np.abs(db.copy_to_host().astype(np.float64) - bias.grad.numpy()) <= bound)
