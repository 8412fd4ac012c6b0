"""The tensor-core decode GEMM of the bench (dev/bench/mma_decode.py) against float64: its
K permutation and fragment layout are only right if every output equals the sum."""
import numpy as np
import pytest

from dev.bench.mma_decode import mma_decode
from proto.device.backend import cuda


def test_bad_shapes_are_refused_before_any_launch():
    x, w, out = np.zeros((8, 64), np.float16), np.zeros((32, 64), np.float16), \
        np.zeros((8, 32), np.float32)
    with pytest.raises(ValueError, match="x .*expected"):
        mma_decode(x[:5], w, out)
    with pytest.raises(ValueError, match="N a multiple of 16"):
        mma_decode(x, w[:24], out[:, :24])
    with pytest.raises(ValueError, match="out: expected a 2-D float32"):
        mma_decode(x, w, out.astype(np.float16))


@pytest.mark.gpu
@pytest.mark.parametrize("warps_k,unroll", [(1, 1), (4, 2), (2, 4)])
@pytest.mark.parametrize("k,n", [(256, 32), (512, 48), (4096, 64)])
def test_every_output_is_the_sum_of_its_products(warps_k, unroll, k, n):
    """5 rows of x (3 zero rows, as a beam of 5 pads to 8) against float64. Products of
    float16 are exact in float32; the bound allows each of the K + 2 additions an error of
    2^-23 of the terms' magnitudes (the tensor cores' float32 sums may truncate)."""
    rng = np.random.default_rng(k + n + warps_k)
    x = np.zeros((8, k), np.float16)
    x[:5] = rng.standard_normal((5, k))
    w = rng.standard_normal((n, k)).astype(np.float16)
    out = cuda.to_device(np.full((8, n), np.nan, np.float32))
    mma_decode(cuda.to_device(x), cuda.to_device(w), out, warps_k=warps_k, unroll=unroll)
    got = out.copy_to_host()
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    want = x64 @ w64.T
    bound = 2.0 ** -23 * (k + 2) * (np.abs(x64) @ np.abs(w64).T)
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / (bound + 1e-30))
    assert np.all(got[5:] == 0)
