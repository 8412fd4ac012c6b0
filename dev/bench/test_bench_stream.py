"""dev.bench.bench_stream's kernels against NumPy: the cp.async copy (kernels._cpasync) puts each
16-byte piece of the weight tile where the product reads it, and both products (weights
from shared memory, weights from registers) are the float64 product summed over the splits."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from proto.device.backend import cuda
from dev.bench import bench_stream as S


def data(seed, K, N):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((S.M, K), dtype=np.float32),
            rng.standard_normal((K, N), dtype=np.float32))


def fitting_tiles(K, N):
    tiles = [(bn, ks) for bn, ks in S.TILES if S.tile_ok(bn, ks, K, N)]
    assert tiles, "no tile of the bench divides the test shape"
    return tiles


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2 ** 16), mode=st.sampled_from(["cp", "reg"]))
def test_products_match_numpy(seed, mode):
    _, K, N = S.SHAPES[0]
    x, w = data(seed, K, N)
    want = x.astype(np.float64) @ w.astype(np.float64)
    for bn, ks in fitting_tiles(K, N):
        got = S.product(bn, ks, mode, x, w)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(K))


def test_stream_copies_each_tile_to_its_place():
    """The stream kernel writes w[first row, first column] + w[last row, last column] of
    each tile, read back from shared memory after the asynchronous copy."""
    _, K, N = S.SHAPES[0]
    _, w = data(1, K, N)
    for bn, ks in fitting_tiles(K, N):
        splits = K // ks
        out = cuda.device_array((splits * S.M * N,), np.float32)
        out[:] = np.float32(0.0)
        S.launch(bn, ks, "stream", cuda.to_device(np.zeros((S.M, K), np.float32)),
                 cuda.to_device(w), out)
        got = out.copy_to_host().reshape(splits, S.M, N)[:, 0, ::bn]
        k0 = np.arange(splits)[:, None] * ks
        n0 = np.arange(N // bn)[None, :] * bn
        np.testing.assert_array_equal(got, w[k0, n0] + w[k0 + ks - 1, n0 + bn - 1])


def test_a_misplaced_tile_would_fail():
    """The check above can fail: a transposed weight gives other sums."""
    _, K, N = S.SHAPES[0]
    x, w = data(2, K, N)
    bn, ks = fitting_tiles(K, N)[0]
    got = S.product(bn, ks, "cp", x, np.ascontiguousarray(w[::-1]))
    assert not np.allclose(got, x.astype(np.float64) @ w, rtol=1e-3)


def test_bad_tile_is_refused_before_launch():
    _, K, N = S.SHAPES[0]
    x, w = data(3, K, N)
    with pytest.raises(ValueError, match="tile"):
        S.launch(S.TILES[0][0], K + 1, "cp", cuda.to_device(x), cuda.to_device(w),
                 cuda.device_array((S.M * N,), np.float32))
