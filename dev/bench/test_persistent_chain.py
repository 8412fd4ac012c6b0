"""The persistent GEMM chain of dev.bench.bench_persistent (one launch per layer or per step, grid
barriers between its phases) against a float64 NumPy chain, and against itself launched one
phase at a time: the same sums in the same order, so the bits must match."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kernels import _check
from dev.bench import bench_persistent as P

D_TEST = 2 * P.SPAN   # the smallest width whose four GEMMs all split K


def gelu(v):
    return 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v ** 3)))


def numpy_chain(chain) -> np.ndarray:
    x = chain.x0.astype(np.float64)
    wq, wp, wf, wm = (w.astype(np.float64) for w in chain.w_host)
    for layer in range(chain.L):
        q = x @ wq[layer]
        p = q[:, :chain.d] @ wp[layer]
        x = gelu(p @ wf[layer]) @ wm[layer]
    return x


@settings(max_examples=3)
@given(n_layer=st.integers(1, 2), seed=st.integers(0, 2 ** 16))
def test_one_phase_a_launch_matches_numpy(n_layer, seed):
    chain = P.Chain(n_layer=n_layer, d=D_TEST, seed=seed)
    got = chain.run(1, 2)
    want = numpy_chain(chain)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5


def test_a_phase_without_its_barrier_would_read_stale_input():
    """The check can fail: the chain run backwards (mlp_proj before qkv) differs."""
    chain = P.Chain(n_layer=1, d=D_TEST, seed=3)
    want = numpy_chain(chain)
    chain.reset()
    for fn in reversed(chain.launches(1, 2)):
        fn(0)
    assert not np.allclose(chain.result(), want, rtol=1e-3)


@pytest.mark.gpu
@settings(max_examples=6)
@given(n_layer=st.integers(1, 3), seed=st.integers(0, 2 ** 16),
       per_launch=st.sampled_from([2, P.KINDS, 3 * P.KINDS]), grid_per_sm=st.integers(1, 4),
       ahead=st.booleans())
def test_barriers_give_the_bits_of_one_phase_a_launch(n_layer, seed, per_launch, grid_per_sm,
                                                      ahead):
    chain = P.Chain(n_layer=n_layer, d=D_TEST, seed=seed)
    grid = min(grid_per_sm * _check.sm_count(),
               _check.resident_blocks(chain.kernel, P.THREADS))
    one = chain.run(1, grid)
    fused = chain.run(per_launch, grid, ahead)
    assert chain.timeouts() == 0
    assert np.array_equal(one, fused)
    assert np.linalg.norm(fused - numpy_chain(chain)) / np.linalg.norm(fused) < 1e-5
    assert not chain.counters.copy_to_host()[:P.TIMEOUTS].any()   # left at zero
