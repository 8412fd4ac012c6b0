"""kernels.rotary against GPT-J's rotary embedding restated with complex numbers: every
pair (2i, 2i+1) of the first rotary_dim dimensions of each head of q and k, at position
p = pos + t, times e^(i p 10000^(-2i/R)); v and the other dimensions untouched. float32 and
float16.

Tolerance: the angle is float32, as transformers computes it (the frequency's power a few
units, the product with p one: 8 float32 units of the angle, in radians, moved through the
rotation onto |x| + |y|); then x cos - y sin in float32 (cosine and sine of the reduced angle
within 2^-21.4, 6 units; a product and a sum rounded each): 10 units of |x| + |y|; a float16
result is rounded once more (2^-11 of it, 2^-25 below the normal range)."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels.rotary import rotary
from tests.helpers import dev

U16, U32 = 2.0 ** -11, 2.0 ** -24


def rotated(qkv, pos0, n_head, R):
    """The definition, in complex float64."""
    B, T, C3 = qkv.shape
    C, hd = C3 // 3, C3 // 3 // n_head
    out = qkv.astype(np.float64)
    i = np.arange(R // 2)
    for t in range(T):
        turn = np.exp(1j * (pos0 + t) * 10000.0 ** (-2.0 * i / R))
        for part in (0, 1):                       # q, k
            for h in range(n_head):
                at = part * C + h * hd
                z = out[:, t, at:at + R:2] + 1j * out[:, t, at + 1:at + R:2]
                z = z * turn
                out[:, t, at:at + R:2], out[:, t, at + 1:at + R:2] = z.real, z.imag
    return out


@given(batch=st.integers(1, 3), steps=st.integers(1, 4), n_head=st.integers(1, 3),
       hd=st.sampled_from([2, 4, 8, 16]), data=st.data(),
       pos0=st.integers(0, 3000), half=st.booleans(), seed=st.integers(0, 2**16))
def test_matches_the_definition(batch, steps, n_head, hd, data, pos0, half, seed):
    R = 2 * data.draw(st.integers(1, hd // 2), label="rotary_dim / 2")
    dtype = np.float16 if half else np.float32
    qkv = np.random.default_rng(seed).standard_normal((batch, steps, 3 * n_head * hd)).astype(dtype)
    d = dev(qkv)
    rotary(d, dev(np.array([pos0], np.int32)), n_head=n_head, rotary_dim=R)
    got, want = d.copy_to_host().astype(np.float64), rotated(qkv, pos0, n_head, R)
    # |x| + |y| of each element's pair bounds the float32 arithmetic's error
    x = np.abs(qkv.astype(np.float64))
    pair = x + np.where(np.arange(x.shape[-1]) % 2 == 0, np.roll(x, -1, -1), np.roll(x, 1, -1))
    angle = (pos0 + np.arange(steps))[None, :, None]      # the largest angle at step t: pair 0's
    bound = (10 + 8 * angle) * U32 * pair + ((U16 * np.abs(want) + 2.0 ** -25) if half else 0.0)
    assert np.all(np.abs(got - want) <= bound), float(np.max(np.abs(got - want) - bound))
    C = n_head * hd
    np.testing.assert_array_equal(got[..., 2 * C:], qkv[..., 2 * C:])   # v untouched


def test_rejects_bad_input_before_launch():
    qkv = dev(np.ones((1, 2, 24), np.float32))
    pos = dev(np.zeros(1, np.int32))
    with pytest.raises(ValueError, match="rotary_dim: expected an even number"):
        rotary(qkv, pos, n_head=2, rotary_dim=3)
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary(qkv, pos, n_head=2, rotary_dim=6)          # the head dim is 4
    with pytest.raises(ValueError, match="n_head"):
        rotary(qkv, pos, n_head=5, rotary_dim=2)
    with pytest.raises(TypeError, match="pos: expected dtype int32"):
        rotary(qkv, dev(np.zeros(1, np.float32)), n_head=2, rotary_dim=2)
    with pytest.raises(TypeError, match="float32 or float16"):
        rotary(dev(np.ones((1, 2, 24), np.float64)), pos, n_head=2, rotary_dim=2)
    np.testing.assert_array_equal(qkv.copy_to_host(), 1.0)   # nothing ran
