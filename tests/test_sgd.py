import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import sgd
from tests.helpers import assert_close, dev, rand


@given(n=st.integers(1, 300), seed=st.integers(0, 2**16), lr=st.floats(0.0, 0.5),
       momentum=st.floats(0.0, 0.99), wd=st.sampled_from([0.0, 1e-4, 5e-4]))
def test_sgd_step_matches_pytorch_semantics(n, seed, lr, momentum, wd, scale):
    rng = np.random.default_rng(seed)
    p, g, v = rand(rng, n * scale), rand(rng, n * scale), rand(rng, n * scale)
    dp, dv = dev(p), dev(v)
    sgd.sgd_step(dp, dev(g), dv, lr=lr, momentum=momentum, weight_decay=wd)
    ref_p, ref_v = sgd.sgd_ref(p, g, v, lr=lr, momentum=momentum, weight_decay=wd)
    assert_close(dv, ref_v, "elementwise")
    assert_close(dp, ref_p, "elementwise")


def test_two_steps_from_zero_velocity_match_torch_sgd_by_hand():
    """torch.optim.SGD(lr=.1, momentum=.9): v1 = g1, p1 = p0 - .1 g1; v2 = .9 g1 + g2."""
    p0, g1, g2 = np.float32([1.0, -2.0]), np.float32([0.5, 1.0]), np.float32([1.0, 0.0])
    p, v = dev(p0), dev(np.zeros(2, np.float32))
    sgd.sgd_step(p, dev(g1), v, lr=0.1, momentum=0.9)
    sgd.sgd_step(p, dev(g2), v, lr=0.1, momentum=0.9)
    v2 = 0.9 * g1 + g2
    assert_close(v, v2, "elementwise")
    assert_close(p, p0 - 0.1 * g1 - 0.1 * v2, "elementwise")


def test_rejects_bad_input_before_launch():
    a = dev(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"grad: expected the shape of param \(4,\)"):
        sgd.sgd_step(a, dev(np.zeros(5, np.float32)), a, lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="lr: expected a finite number"):
        sgd.sgd_step(a, a, a, lr=float("nan"), momentum=0.9)
    with pytest.raises(ValueError, match="momentum: expected a number >= 0"):
        sgd.sgd_step(a, a, a, lr=0.1, momentum=-0.5)
    with pytest.raises(ValueError, match=r"lr: expected a finite number, got '0.1' \(str\)"):
        sgd.sgd_step(a, a, a, lr="0.1", momentum=0.9)


def test_numpy_scalars_are_numbers():
    p, g, v = (dev(np.ones(3, np.float32)) for _ in range(3))
    sgd.sgd_step(p, g, v, lr=np.float32(0.5), momentum=np.int64(0))
    assert_close(p, np.full(3, 0.5, np.float32), "elementwise")
