"""attention's tile kernels (`attention.SMALL_TILE`, and `SMALL_TILE_ROWS` with a row
table): a split whole in shared memory, scores, softmax and P.V by the block. Against the
float64 reference: random shapes whose plan gives splits that fit the tile (the kernel that
ran is checked), positions inside splits and past them, this step's tokens from qkv or from
partial sums of it and a bias, the cache written exactly; with a row table, each earlier position from its named row and NaN
for a row that does not exist; the device-side guard on pos; the geometry it refuses."""
import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from kernels import attention
from tests.helpers import assert_close, dev, per_signature, rand


def _fits(B, H, T, Tmax, hd, rows):
    """Whether attention's plan for this shape gives splits the tile holds whole."""
    _, _, span = attention._plan(B, H, T, Tmax, hd, attention.kernel_for(hd, rows))
    return span <= attention.SMALL_TILE.unit


def _gathered(kc, rows, pos):
    """The cache as the row table names it: position p < pos of sequence b from row
    rows[b, p] (a row outside the cache: any row, that sequence is checked for NaN)."""
    out = kc.copy()
    B = kc.shape[0]
    for b in range(B):
        for p in range(pos):
            out[b, :, p] = kc[min(max(rows[b, p], 0), B - 1), :, p]
    return out


@settings(max_examples=12, deadline=None)
@given(data=st.data(), seed=st.integers(0, 2 ** 16), with_rows=st.booleans())
def test_tile_matches_the_reference(data, seed, with_rows, attention_launches, scale):
    B = data.draw(st.integers(1, 5 if scale > 1 else 2), "B")
    H = data.draw(st.integers(1, 12 if scale > 1 else 2), "H")
    T = data.draw(st.integers(1, 2), "T")
    hd = 4 * data.draw(st.integers(1, attention.SMALL_TILE.max_hd // 4), "hd / 4")
    Tmax = data.draw(st.integers(T, 64 * scale), "Tmax")
    assume(_fits(B, H, T, Tmax, hd, with_rows))
    pos = data.draw(st.integers(0, Tmax - T), "pos")
    rng = np.random.default_rng(seed)
    qkv, kc, vc = rand(rng, B, T, 3 * H * hd), rand(rng, B, H, Tmax, hd), rand(rng, B, H, Tmax, hd)
    # qkv itself, or P partial sums of it and a bias (kernels.gemm.partials): q | k | v is
    # then their float32 sum in order, the bias last
    parts = data.draw(st.integers(0, attention.MAX_PARTS), "partial sums (0: qkv itself)")
    given_qkv, qkv_bias = dev(qkv), None
    if parts:
        split, bias = rand(rng, parts, B, T, 3 * H * hd), rand(rng, 3 * H * hd)
        qkv = np.zeros_like(qkv)
        for p in split:
            qkv = qkv + p
        qkv = qkv + bias
        given_qkv, qkv_bias = dev(split), dev(bias)
    rows, broken = None, None
    if with_rows:
        rows = rng.integers(0, B, (B, Tmax)).astype(np.int32)
        if pos > 0 and data.draw(st.booleans(), "a row outside the cache"):
            broken = int(rng.integers(0, B))
            rows[broken, int(rng.integers(0, pos))] = int(rng.choice([-1, B]))
    want, want_k, want_v = attention.attention_ref(
        qkv, _gathered(kc, rows, pos) if with_rows else kc,
        _gathered(vc, rows, pos) if with_rows else vc, pos, H)
    dk, dv = dev(kc), dev(vc)
    out = dev(np.full(want.shape, np.nan, np.float32))
    attention_launches.clear()
    attention.attention(given_qkv, dk, dv, dev(np.array([pos], np.int32)), out, n_head=H,
                        rows=None if rows is None else dev(rows), qkv_bias=qkv_bias)
    assert attention_launches[0] is (attention.SMALL_TILE_ROWS if with_rows else attention.SMALL_TILE).kernel
    got = out.copy_to_host()
    if broken is not None:
        assert np.isnan(got[broken]).all()
        keep = [b for b in range(B) if b != broken]
        got, want = got[keep], want[keep]
    assert_close(got, want, "reduction")
    # this step's k, v in row b at pos..pos+T-1; every other cache entry untouched
    new = slice(pos, pos + T)
    rest = np.ones(Tmax, bool)
    rest[new] = False
    for after, before, w in ((dk, kc, want_k), (dv, vc, want_v)):
        after = after.copy_to_host()
        np.testing.assert_array_equal(after[:, :, new], w[:, :, new])
        np.testing.assert_array_equal(after[:, :, rest], before[:, :, rest])


@pytest.mark.parametrize("with_rows", [False, True], ids=["plain", "row_table"])
@pytest.mark.parametrize("pos", [-3, 10 ** 6])
def test_a_pos_outside_the_cache_gives_nan_and_leaves_the_cache(pos, with_rows, attention_launches):
    """pos picks the rows copied before the wait: one outside the cache must copy nothing
    outside it, and the guard writes NaN and leaves the caches alone."""
    rng = np.random.default_rng(1)
    B, H, hd, Tmax = 2, 1, 8, 11   # (the last split's span reaches past the cache's end)
    assert _fits(B, H, 1, Tmax, hd, with_rows)
    qkv, kc, vc = rand(rng, B, 1, 3 * H * hd), rand(rng, B, H, Tmax, hd), rand(rng, B, H, Tmax, hd)
    rows = dev(np.zeros((B, Tmax), np.int32)) if with_rows else None
    dk, dv = dev(kc), dev(vc)
    out = dev(np.zeros((B, 1, H * hd), np.float32))
    attention.attention(dev(qkv), dk, dv, dev(np.array([pos], np.int32)), out, n_head=H,
                        rows=rows)
    assert attention_launches[0] is (attention.SMALL_TILE_ROWS if with_rows else attention.SMALL_TILE).kernel
    assert np.isnan(out.copy_to_host()).all()
    np.testing.assert_array_equal(dk.copy_to_host(), kc)
    np.testing.assert_array_equal(dv.copy_to_host(), vc)


def test_switched_off_or_too_long_a_split_takes_the_other_kernels(attention_launches, monkeypatch):
    rng = np.random.default_rng(2)
    B, H, hd = 1, 1, 8
    Tmax = 2 * attention.SMALL_TILE.unit
    monkeypatch.setattr(attention, "TARGET_BLOCKS", 1)   # one split: it outgrows the tile
    assert not _fits(B, H, 1, Tmax, hd, False)
    qkv, kc, vc = rand(rng, B, 1, 3 * H * hd), rand(rng, B, H, Tmax, hd), rand(rng, B, H, Tmax, hd)
    out = dev(np.zeros((B, 1, H * hd), np.float32))
    attention.attention(dev(qkv), dev(kc), dev(vc), dev(np.array([3], np.int32)), out, n_head=H)
    assert attention_launches[0] is attention.SMALL_PRELOAD.kernel
    attention_launches.clear()
    monkeypatch.setattr(attention, "TARGET_BLOCKS", 10 ** 6)   # short splits: each fits
    Tmax = 8
    assert _fits(B, H, 1, Tmax, hd, False)
    kc, vc = rand(rng, B, H, Tmax, hd), rand(rng, B, H, Tmax, hd)
    attention.attention(dev(qkv), dev(kc), dev(vc), dev(np.array([3], np.int32)), out, n_head=H,
                        tile=False)
    assert attention_launches[0] is attention.SMALL_PRELOAD.kernel


def test_partials_are_refused_where_the_tile_does_not_serve(monkeypatch):
    """Partial sums of qkv without a bias, a bias with qkv itself, too many partials, or a
    shape the tile does not take (switched off): ValueError naming qkv, before any launch."""
    rng = np.random.default_rng(3)
    B, H, hd, Tmax = 1, 1, 8, 8
    kc, vc = dev(rand(rng, B, H, Tmax, hd)), dev(rand(rng, B, H, Tmax, hd))
    split, bias = dev(rand(rng, 2, B, 1, 3 * H * hd)), dev(rand(rng, 3 * H * hd))
    qkv = dev(rand(rng, B, 1, 3 * H * hd))
    too_many = dev(rand(rng, attention.MAX_PARTS + 1, B, 1, 3 * H * hd))
    launched = []
    monkeypatch.setattr(attention, "launch", lambda *a, **k: launched.append(a))
    out = dev(np.zeros((B, 1, H * hd), np.float32))
    pos = dev(np.array([3], np.int32))
    assert attention.takes_partials(kc, vc, 1, parts=2)
    for given_qkv, given_bias in ((split, None), (qkv, bias), (too_many, bias)):
        with pytest.raises(ValueError, match="qkv"):
            attention.attention(given_qkv, kc, vc, pos, out, n_head=H, qkv_bias=given_bias)
    assert not attention.takes_partials(kc, vc, 1, parts=2, tile=False)
    with pytest.raises(ValueError, match="qkv"):
        attention.attention(split, kc, vc, pos, out, n_head=H, qkv_bias=bias, tile=False)
    assert launched == []


@pytest.mark.parametrize("capacity, warps, width", [(48, 8, 64), (64, 8, 48), (1, 2, 32)])
def test_geometry_that_does_not_divide_the_block_is_refused(capacity, warps, width):
    with pytest.raises(ValueError, match="make_attention_tile"):
        attention.make_attention_tile(capacity, warps, width)


@pytest.mark.gpu
@pytest.mark.parametrize("with_rows, blocks", [(False, 6), (True, 6)], ids=["plain", "row_table"])
def test_gpt2_decode_takes_the_tile_at_its_blocks_an_sm_without_spilling(with_rows, blocks):
    """GPT-2 small's beam decode (B 5, H 12, hd 64, 1024 positions): its plan's splits fit
    the tile, whose registers and 36 KB of shared memory give the blocks of 256 threads an
    SM that its launch bounds ask for (6, the row-table twin too), no local
    memory. Registers go 256 a warp at a time, 64K an SM; shared memory 228 KB an SM, 1 KB
    of it reserved a block."""
    assert _fits(5, 12, 1, 1024, 64, with_rows)
    k = (attention.SMALL_TILE_ROWS if with_rows else attention.SMALL_TILE).kernel

    regs = per_signature(k.get_regs_per_thread())
    assert 65536 // (-(-regs * 32 // 256) * 256 * 8) >= blocks
    assert per_signature(k.get_local_mem_per_thread()) == 0
    assert (per_signature(k.get_shared_mem_per_block()) + 1024) * blocks <= 228 * 1024
