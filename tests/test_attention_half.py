"""attention, gather_batch and the row table in float16 (GPT-J's KV cache) against float64
on the same float16 values, within a bound derived from float32 arithmetic and one float16
rounding of the output.

The kernels convert each float16 element of qkv and the caches to float32 as they load it;
scores, the online softmax and the output are float32; the output is rounded to float16
once, as it is stored. The cache rows they write are this step's k and v copied from qkv
(exact). Against float64 on the same values:

- a score s = (q / sqrt(hd)) . k, a float32 sum of hd products (and the scaled q rounded),
  is off by at most d_s = (hd + 4) U32 sum_i |q_i k_i| / sqrt(hd);
- the softmax weight of a position, exp(s - m) computed in float32 (a few ulps) and rescaled
  by the online softmax's factors (one rounding each, at most one a position) and the
  splits' merge, is off relatively by at most e = 2 d_s + 16 U32 + 8 n U32 over n positions
  (exp(d) - 1 <= 2 d for the small d here);
- the output, a weighted mean of the values, moves by at most 4 e max|v| (the weights and
  their sum each relatively off by e), plus the float32 sums' n U32 max|v|;
- then the one float16 rounding: U16 |o|, or 2^-25 below float16's normal range.
"""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import attention
from tests.helpers import dev

U16, U32 = 2.0 ** -11, 2.0 ** -24
# head dims of both plain kernels (up to 64, and GPT-J's 256 on the wide one)
HEAD_DIMS = [4, 24, 64, 80, 256]


def _halves(rng, *shape):
    return rng.standard_normal(shape).astype(np.float16)


def _reference(qkv, kc, vc, pos, n_head):
    """float64 causal attention of this step's queries over the cache (after this step's
    k, v are written at pos..pos+T-1), and the bound above for each output element."""
    B, T, C3 = qkv.shape
    hd = C3 // 3 // n_head
    x = qkv.astype(np.float64).reshape(B, T, 3, n_head, hd).transpose(2, 0, 3, 1, 4)
    q, k_new, v_new = x
    k = kc.astype(np.float64).copy()
    v = vc.astype(np.float64).copy()
    k[:, :, pos:pos + T], v[:, :, pos:pos + T] = k_new, v_new
    n = pos + T
    k, v = k[:, :, :n], v[:, :, :n]
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(hd)             # (B, H, T, n)
    d_s = (hd + 4) * U32 * (np.abs(q) @ np.abs(np.swapaxes(k, -1, -2))) / math.sqrt(hd)
    causal = np.arange(n)[None, :] <= (pos + np.arange(T))[:, None]
    scores = np.where(causal, scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    o = (p / p.sum(-1, keepdims=True)) @ v                           # (B, H, T, hd)
    e = 2 * np.where(causal, d_s, 0).max(-1, keepdims=True) + 16 * U32 + 8 * n * U32
    vmax = np.abs(v).max(axis=(-2, -1), keepdims=True)
    bound = (4 * e + n * U32) * vmax + U16 * np.abs(o) + 2.0 ** -25
    flat = lambda a: a.transpose(0, 2, 1, 3).reshape(B, T, n_head * hd)   # noqa: E731
    return flat(o), flat(np.broadcast_to(bound, o.shape))


def _through_rows(cache, rows, pos):
    """The cache as the row table reads it: position p < pos of sequence b from row rows[b, p]
    (rows None: the cache itself)."""
    if rows is None:
        return cache
    gathered = cache.copy()
    for b in range(cache.shape[0]):
        gathered[b, :, :pos] = cache[rows[b, :pos], :, np.arange(pos)].transpose(1, 0, 2)
    return gathered


def _assert_within_bound(out, qkv, kc, vc, pos, n_head, rows=None):
    want, bound = _reference(qkv, _through_rows(kc, rows, pos), _through_rows(vc, rows, pos),
                             pos, n_head)
    err = np.abs(out.astype(np.float64) - want) - bound
    assert np.all(err <= 0), float(err.max())


def _run(qkv, kc, vc, pos, n_head, rows=None):
    dk, dv = dev(kc), dev(vc)
    out = dev(np.full((qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3), np.nan, np.float16))
    attention.attention(dev(qkv), dk, dv, dev(np.array([pos], np.int32)), out, n_head=n_head,
                        rows=None if rows is None else dev(rows))
    return out.copy_to_host(), dk.copy_to_host(), dv.copy_to_host()


@given(B=st.integers(1, 2), H=st.integers(1, 2), hd=st.sampled_from(HEAD_DIMS),
       Tmax=st.integers(1, 40), data=st.data(), seed=st.integers(0, 2**16))
def test_half_precision_attention_within_the_derived_bound(B, H, hd, Tmax, data, seed):
    T = data.draw(st.integers(1, min(Tmax, 3)), "T")
    pos = data.draw(st.integers(0, Tmax - T), "pos")
    rng = np.random.default_rng(seed)
    qkv, kc, vc = _halves(rng, B, T, 3 * H * hd), _halves(rng, B, H, Tmax, hd), \
        _halves(rng, B, H, Tmax, hd)
    out, k_after, v_after = _run(qkv, kc, vc, pos, H)
    assert out.dtype == np.float16 and k_after.dtype == np.float16
    _assert_within_bound(out, qkv, kc, vc, pos, H)
    # this step's k, v copied into the caches exactly; nothing else touched
    new = qkv.reshape(B, T, 3, H, hd).transpose(2, 0, 3, 1, 4)
    want_k, want_v = kc.copy(), vc.copy()
    want_k[:, :, pos:pos + T], want_v[:, :, pos:pos + T] = new[1], new[2]
    np.testing.assert_array_equal(k_after, want_k)
    np.testing.assert_array_equal(v_after, want_v)


@given(B=st.integers(1, 3), pos=st.integers(0, 20), hd=st.sampled_from([24, 256]),
       seed=st.integers(0, 2**16))
def test_half_precision_rows_read_each_position_from_its_row(B, pos, hd, seed):
    """The row-table kernels in float16: position p < pos of sequence b from row rows[b, p]."""
    H, T, Tmax = 2, 1, 24
    rng = np.random.default_rng(seed)
    qkv, kc, vc = _halves(rng, B, T, 3 * H * hd), _halves(rng, B, H, Tmax, hd), \
        _halves(rng, B, H, Tmax, hd)
    pos = min(pos, Tmax - T)
    rows = rng.integers(0, B, (B, Tmax)).astype(np.int32)
    out, _, _ = _run(qkv, kc, vc, pos, H, rows)
    _assert_within_bound(out, qkv, kc, vc, pos, H, rows)


@pytest.mark.parametrize("bad_pos", [-1, 7])
def test_half_precision_pos_outside_the_cache_writes_nan(bad_pos):
    rng = np.random.default_rng(0)
    qkv, kc, vc = _halves(rng, 1, 2, 3 * 8), _halves(rng, 1, 1, 8, 8), _halves(rng, 1, 1, 8, 8)
    out, k_after, v_after = _run(qkv, kc, vc, bad_pos, 1)
    assert np.isnan(out).all()
    np.testing.assert_array_equal(k_after, kc)
    np.testing.assert_array_equal(v_after, vc)


def test_half_precision_gather_batch_moves_the_live_prefix():
    rng = np.random.default_rng(1)
    src = _halves(rng, 2, 3, 2, 5, 4)   # two stacked caches of batch 3
    dst = _halves(rng, 2, 3, 2, 5, 4)
    index = np.array([2, 0, 2], np.int32)
    d = dev(dst)
    attention.gather_batch(dev(src), dev(index), d, length=dev(np.array([3], np.int32)))
    want = dst.copy()
    want[:, :, :, :3] = src[:, index][:, :, :, :3]
    np.testing.assert_array_equal(d.copy_to_host(), want)


def test_half_and_single_precision_do_not_mix():
    h = lambda *s: dev(np.zeros(s, np.float16))   # noqa: E731
    f = lambda *s: dev(np.zeros(s, np.float32))   # noqa: E731
    pos = dev(np.zeros(1, np.int32))
    with pytest.raises(TypeError, match="k_cache: expected dtype float16, got float32"):
        attention.attention(h(1, 1, 24), f(1, 1, 4, 8), h(1, 1, 4, 8), pos, h(1, 1, 8), n_head=1)
    with pytest.raises(TypeError, match="out: expected dtype float16, got float32"):
        attention.attention(h(1, 1, 24), h(1, 1, 4, 8), h(1, 1, 4, 8), pos, f(1, 1, 8), n_head=1)
    with pytest.raises(TypeError, match="dst: expected dtype float16, got float32"):
        attention.gather_batch(h(2, 3), dev(np.zeros(2, np.int32)), f(2, 3))


@pytest.mark.gpu
@pytest.mark.parametrize("use_rows", [False, True])
@pytest.mark.parametrize("H,hd,form", [(16, 256, "grouped"), (12, 64, "packed")])
def test_beam_decode_shapes_in_half_precision(use_rows, H, hd, form):
    """GPT-J-6B's decode attention (16 heads of 256) and GPT-2 small's (12 of 64): 5 beams, a
    1024-position cache at 512, with and without the row table."""
    B, Tmax, pos = 5, 1024, 512
    rng = np.random.default_rng(7)
    qkv, kc, vc = _halves(rng, B, 1, 3 * H * hd), _halves(rng, B, H, Tmax, hd), \
        _halves(rng, B, H, Tmax, hd)
    rows = rng.integers(0, B, (B, Tmax)).astype(np.int32) if use_rows else None
    assert form in attention._choose(B, H, 1, dev(kc), dev(vc), rows, qkv=dev(qkv))[0].config
    out, _, _ = _run(qkv, kc, vc, pos, H, rows)
    _assert_within_bound(out, qkv, kc, vc, pos, H, rows)


@pytest.mark.parametrize("hd,T,with_rows,pos", [(256, 1, False, 13), (256, 1, True, 13),
                                                (80, 2, False, 13), (256, 3, True, 13),
                                                (256, 3, False, 0), (64, 1, False, 13),
                                                (64, 1, True, 13), (24, 2, True, 13),
                                                (64, 3, False, 0), (8, 1, True, 6)])
def test_sixteen_byte_half_precision_kernels_within_the_derived_bound(hd, T, with_rows, pos):
    """float16 with aligned qkv and caches and hd a multiple of 8 reads a lane's 8 dims as one
    16-byte load: the packed group kernel up to head dim 64 (GPT-2's; 8 lanes a position),
    the grouped kernel past it (GPT-J's 256): within the bound, this step's k and v copied
    exactly, and a row outside the batch gives NaN where it is read."""
    B, H, Tmax = 3, 2, 21
    rng = np.random.default_rng(hd + T)
    qkv, kc, vc = _halves(rng, B, T, 3 * H * hd), _halves(rng, B, H, Tmax, hd), \
        _halves(rng, B, H, Tmax, hd)
    rows = rng.integers(0, B, (B, Tmax)).astype(np.int32) if with_rows else None
    variant = attention._choose(B, H, T, dev(kc), dev(vc), rows, qkv=dev(qkv))[0]
    assert ("packed" if hd <= 64 else "grouped") in variant.config
    assert variant.use_rows == with_rows and variant.dtype == np.float16
    out, k_after, _ = _run(qkv, kc, vc, pos, H, rows)
    _assert_within_bound(out, qkv, kc, vc, pos, H, rows)
    want_k = kc.copy()
    want_k[:, :, pos:pos + T] = qkv.reshape(B, T, 3, H, hd)[:, :, 1].transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(k_after, want_k)
    if with_rows and pos > 4:
        rows[1, 4] = B   # sequence 1 reads position 4 from a row that does not exist
        out, _, _ = _run(qkv, kc, vc, pos, H, rows)
        assert np.isnan(out[1].astype(np.float32)).all()
        assert not np.isnan(out[[0, 2]].astype(np.float32)).any()
