"""attention's preloading kernel (a split's K and V copied into shared memory by cp.async
before the early-launch wait) against the plain kernel it replaces: the same floats reach
the same arithmetic, so the outputs and caches must be bit-identical, at every position,
including splits partly and wholly past pos and head dims that leave lanes idle."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kernels import attention
from tests.helpers import dev, rand


def _run(qkv, kc, vc, pos, H, preload):
    dk, dv = dev(kc), dev(vc)
    out = dev(np.full((qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3), np.nan, np.float32))
    attention.attention(dev(qkv), dk, dv, dev(np.array([pos], np.int32)), out, n_head=H,
                        preload=preload, tile=False)   # (the tile: its own tests)
    return out.copy_to_host(), dk.copy_to_host(), dv.copy_to_host()


@settings(max_examples=6, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2 ** 16))
def test_preload_is_bit_identical_to_the_plain_kernel(data, seed, attention_launches, scale):
    B = data.draw(st.integers(1, 2), "B")
    H = data.draw(st.integers(1, 2), "H")
    hd = 4 * data.draw(st.integers(1, 8 if scale == 1 else 16), "hd / 4")
    Tmax = data.draw(st.integers(2, 40 * scale), "Tmax")
    pos = data.draw(st.integers(0, Tmax - 1), "pos")
    rng = np.random.default_rng(seed)
    qkv, kc, vc = rand(rng, B, 1, 3 * H * hd), rand(rng, B, H, Tmax, hd), rand(rng, B, H, Tmax, hd)
    attention_launches.clear()
    got = _run(qkv, kc, vc, pos, H, True)
    assert attention_launches[0] is attention.SMALL_PRELOAD.kernel
    attention_launches.clear()
    want = _run(qkv, kc, vc, pos, H, False)
    assert attention_launches[0] is attention.SMALL.kernel
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_head_dims_not_a_multiple_of_4_take_the_plain_kernel(attention_launches):
    rng = np.random.default_rng(0)
    H, hd, Tmax = 1, 6, 8
    qkv, kc, vc = rand(rng, 1, 1, 3 * H * hd), rand(rng, 1, H, Tmax, hd), rand(rng, 1, H, Tmax, hd)
    _run(qkv, kc, vc, 3, H, True)
    assert attention_launches[0] is attention.SMALL.kernel


def test_a_preload_with_a_row_table_is_refused():
    with pytest.raises(ValueError, match="row table"):
        attention.make_attention(2, 2, 1, use_rows=True, preload=4)


@pytest.mark.parametrize("pos", [-3, 10 ** 6])
def test_a_pos_outside_the_cache_copies_nothing_outside_it(pos, attention_launches):
    """pos chooses the rows copied before the wait: one past the cache must not send a copy
    past the last row (the guard then writes NaN, as the plain kernel does)."""
    rng = np.random.default_rng(1)
    H, hd, Tmax = 1, 8, 11   # (the last split's span reaches past the cache's end)
    qkv, kc, vc = rand(rng, 2, 1, 3 * H * hd), rand(rng, 2, H, Tmax, hd), rand(rng, 2, H, Tmax, hd)
    got = _run(qkv, kc, vc, pos, H, True)
    want = _run(qkv, kc, vc, pos, H, False)
    assert attention_launches[0] is attention.SMALL_PRELOAD.kernel
    assert np.isnan(got[0]).all()
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
