"""kernels.self_attention: the projection and attention of a decoder layer, against the
float64 references of each (x @ w + b, then attention_ref), on the way that sums qkv's
partials in the attention tile (decode) and the way that writes qkv (switched off, and a
prefill of several tokens); misuse refused before any launch."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from kernels import attention, gemm, self_attention
from tests.helpers import assert_close, dev, rand


@settings(max_examples=6, deadline=None)
@given(B=st.integers(1, 3), T=st.sampled_from([1, 1, 3]), H=st.integers(1, 2),   # B*T = 9: gemm
       sums=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_matches_projection_then_attention(B, T, H, sums, seed, monkeypatch):
    given_qkv = []
    real = attention.attention
    monkeypatch.setattr(attention, "attention",
                        lambda qkv, *a, **k: given_qkv.append(qkv.ndim) or real(qkv, *a, **k))
    rng = np.random.default_rng(seed)
    hd, Tmax = 8, 8
    C = H * hd
    pos = int(rng.integers(0, Tmax - T + 1))
    x, w, b = rand(rng, B, T, C), rand(rng, C, 3 * C, scale=C ** -0.5), rand(rng, 3 * C)
    kc, vc = rand(rng, B, H, Tmax, hd), rand(rng, B, H, Tmax, hd)
    qkv = (x.astype(np.float64) @ w + b).astype(np.float32)
    want, want_k, want_v = attention.attention_ref(qkv, kc, vc, pos, H)
    dk, dv = dev(kc), dev(vc)
    out = dev(np.full((B, T, C), np.nan, np.float32))
    self_attention.self_attention(dev(x), dev(w), dev(b), dk, dv, dev(np.array([pos], np.int32)),
                                  out, n_head=H, tile=sums)
    assert_close(out, want, "gemm")
    assert_close(dk, want_k, "gemm")
    assert_close(dv, want_v, "gemm")
    # partials (P, B, T, 3C) exactly where switched on and the tile serves a decode step
    decode = B * T <= gemm.DECODE_MAX_M and attention.takes_partials(
        dk, dv, T, parts=gemm.partial_splits(3 * C, C), tile=sums)
    assert given_qkv == [4 if decode else 3]
    assert decode or not sums or B * T > gemm.DECODE_MAX_M   # (every split here fits the tile)


def test_rejects_a_weight_of_the_wrong_shape_before_launch(monkeypatch):
    rng = np.random.default_rng(0)
    launched = []
    monkeypatch.setattr(attention, "launch", lambda *a, **k: launched.append(a))
    monkeypatch.setattr(gemm, "launch", lambda *a, **k: launched.append(a))
    x, kc = dev(rand(rng, 1, 1, 8)), dev(rand(rng, 1, 1, 8, 8))
    out, pos = dev(np.zeros((1, 1, 8), np.float32)), dev(np.array([0], np.int32))
    for name, w, xx in (("w", dev(rand(rng, 8, 16)), x), ("x", dev(rand(rng, 8, 24)),
                                                          dev(rand(rng, 8, 8)))):
        with pytest.raises(ValueError, match=name):
            self_attention.self_attention(xx, w, dev(rand(rng, 24)), kc, kc, pos, out, n_head=1)
    assert launched == []
