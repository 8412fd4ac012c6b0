"""The tiled GEMM on tensor cores (a tile with mma=True: kernels._tf32, three TF32 products a
float32 one): the operand split against its definition, and the product against float64
over every layout, epilogue, staging and K split. On the simulator the warp's multiply is
a stand-in that gathers the fragments by the PTX ISA's layout, so these tests check every
fragment index there; on the GPU they check the instruction itself."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import gemm as G
from kernels._tf32 import (a_fragment_place, b_fragment_place, k_run_stage, lane_stage, mma1688,
                           mma_tile, split)
from kernels._tile import Tiles
from proto.device import backend
from proto.device.backend import cuda
from tests.helpers import dev, rand
from tests.test_gemm import FLAGS, _check_tiled

U = 2.0 ** -24   # float32's unit roundoff
if backend.SIMULATOR:   # (each simulated thread is a Python thread: one or two warps; the
    # third has more mma tiles down than across, so its warps hold B's fragments: _tf32)
    TILES = (Tiles(16, 32, 8, 2, 4, True), Tiles(32, 32, 16, 4, 4, True),
             Tiles(64, 32, 8, 8, 4, True))
else:   # warp tiles of 64 x 32 (8 warps) and 32 x 32 (4 warps)
    TILES = (Tiles(128, 128, 8, 8, 8, True), Tiles(64, 64, 16, 4, 4, True))


def tf32_ref(x: np.ndarray) -> np.ndarray:
    """x (float32) rounded to 10 fraction bits, ties away from zero: the significand of
    frexp (in [0.5, 1)) times 2**11, rounded half away, scaled back."""
    m, e = np.frexp(x.astype(np.float64))
    r = np.sign(m) * np.floor(np.abs(m) * 2.0 ** 11 + 0.5)
    return np.ldexp(r / 2.0 ** 11, e).astype(np.float32)


@cuda.jit
def _split_kernel(x, big, small):
    i = cuda.grid(1)
    if i < x.size:
        big[i], small[i] = split(x[i])


@given(seed=st.integers(0, 2**16), scale=st.sampled_from([1e-30, 1e-3, 1.0, 3e4, 1e30]))
def test_split_gives_the_rounded_value_and_the_rounded_rest(seed, scale):
    """big = tf32(x) and small = tf32(x - big), bit for bit, so x - big - small is within
    2**-22 |x|: the three products the kernel takes miss only 2**-22-sized terms."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(256) * scale).astype(np.float32)
    x[:4] = [0.0, -0.0, 1.0 + 2.0 ** -11, -(1.0 + 3 * 2.0 ** -12)]   # a tie, away from zero
    big, small = dev(np.zeros(x.size, np.uint32)), dev(np.zeros(x.size, np.uint32))
    _split_kernel[4, 64](dev(x), big, small)
    big, small = big.copy_to_host().view(np.float32), small.copy_to_host().view(np.float32)
    want_big = tf32_ref(x)
    np.testing.assert_array_equal(big, want_big)
    np.testing.assert_array_equal(small, tf32_ref(x - want_big))   # (x - big: exact)
    assert big[2] == np.float32(1.0 + 2.0 ** -10) and big[3] == np.float32(-(1.0 + 2.0 ** -10))
    rest = x.astype(np.float64) - big - small
    assert np.all(np.abs(rest) <= 2.0 ** -22 * np.abs(x.astype(np.float64)))


SIM = backend.SIMULATOR


def test_split_keeps_infinities_and_nan_in_the_big_part():
    x = np.array([np.inf, -np.inf, np.nan, 0.0], np.float32)
    x[3] = np.uint32(0x7FFFFFFF).view(np.float32)   # the GPU's own NaN: all fraction bits
    big, small = dev(np.zeros(x.size, np.uint32)), dev(np.zeros(x.size, np.uint32))
    _split_kernel[1, 32](dev(x), big, small)
    big = big.copy_to_host().view(np.float32)
    assert big[0] == np.inf and big[1] == -np.inf and np.isnan(big[2]) and np.isnan(big[3])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_operand_gives_a_non_finite_row(bad):
    """NaN propagates; an infinity gives an infinity or NaN (3xTF32 multiplies it by the other
    operand's small part, often 0: NaN where float32 would give an infinity), never a finite
    number; the other rows are untouched."""
    rng = np.random.default_rng(3)
    m, n, k = (20, 12, 24) if SIM else (300, 260, 600)
    a, b = rand(rng, m, k), rand(rng, k, n)
    a[5, 7] = bad
    out = dev(np.full((1, m, n), np.nan, np.float32))
    db = dev(b[None])
    G.tiled(dev(a[None]), db, out, db.reshape(db.size), 0, 0, 0, 0, 0, 0, tile=TILES[0],
            stages=2)
    got = out.copy_to_host()[0]
    assert not np.any(np.isfinite(got[5]))
    rows = np.arange(m) != 5
    np.testing.assert_allclose(got[rows], (a.astype(np.float64) @ b)[rows], rtol=1e-4,
                               atol=1e-4)


@given(m=st.integers(1, 33 if SIM else 300), n=st.integers(1, 33 if SIM else 300),
       k=st.integers(1, 40 if SIM else 600),
       batch=st.sampled_from([1, 2]), flags=st.sampled_from(FLAGS),
       stages=st.sampled_from([0, 2, 3]), target=st.sampled_from([1, 8]),
       tile=st.sampled_from(TILES), seed=st.integers(0, 2**16))
def test_the_tensor_core_tile_matches_reference(m, n, k, batch, flags, stages, target, tile,
                                                seed):
    """Every layout and epilogue, partial tiles on both edges, K not a whole number of mma
    steps, staged through registers or by cp.async, K split or whole: within the bound
    derived below (float32's statistical tolerance, which the SIMT tiles meet, does not
    hold for sums that truncate: the H100 exceeded it by 1.4x at K = 463)."""
    splits = G.tiled_plan(tile, batch, m, n, k, target)[0]
    _check_tiled(seed, batch, m, n, k, flags, bound=_derived_bound(k, splits, flags[2]),
                 target_blocks=target, tile=tile, stages=stages)


def _derived_bound(k, splits, act):
    """The product's bound (test below) with two more float32 additions (old, bias), carried
    through the activation's slope (GELU's is at most 1.13), plus the activation's own
    float32 evaluation and the reference's rounding to float32 (8u): a multiple of the
    output's size |op(a)| |op(b)| + |old| + |bias|."""
    slope = 1.13 if act == "gelu" else 1.0
    return lambda sizes: (slope * (2 * k + 14 + splits) + 8) * U * sizes


@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (False, False), (True, False)])
def test_the_tensor_core_product_is_within_its_derived_bound(trans_a, trans_b):
    """|op(a) op(b) - exact| <= (2K + 12 + splits) u sum |a||b|, u = 2**-24: the split's
    dropped terms (small*small and the two rests, each <= 2**-22 |a||b|: 12u) and K
    additions that may truncate rather than round (2u each; Fasi et al. 2021 measured
    truncating tensor-core sums), then the splits' float32 sum. The SIMT kernel's bound
    is (K + splits) u."""
    rng = np.random.default_rng(7)
    m, n, k = (24, 16, 64) if SIM else (300, 260, 3000)
    tile = TILES[0]
    a = rand(rng, *((k, m) if trans_a else (m, k)))
    b = rand(rng, *((n, k) if trans_b else (k, n)))
    for target, stages in ((1, 3), (None, 3), (1, 0), (None, 0)):
        out = dev(np.full((1, m, n), np.nan, np.float32))
        db = dev(b[None])
        G.tiled(dev(a[None]), db, out, db.reshape(db.size), 0, 0, 0, int(trans_a),
                int(trans_b), 0, target_blocks=target, tile=tile, stages=stages)
        splits = G.tiled_plan(tile, 1, m, n, k, target)[0]
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        a64, b64 = (a64.T if trans_a else a64), (b64.T if trans_b else b64)
        err = np.abs(out.copy_to_host()[0] - a64 @ b64)
        bound = (2 * k + 12 + splits) * U * (np.abs(a64) @ np.abs(b64))
        assert np.all(err <= bound), float(np.max(err / bound))


@cuda.jit
def _mma_kernel(a, b, c, d):
    """D = A B + C (16 x 8 x 8, A and B as TF32 bits) by one mma1688, one warp, lanes holding
    the fragments the PTX ISA names (kernels._tf32's docstring)."""
    lane = cuda.threadIdx.x
    g, t = lane // 4, lane % 4
    d[g, 2 * t], d[g, 2 * t + 1], d[g + 8, 2 * t], d[g + 8, 2 * t + 1] = mma1688(
        a[g, t], a[g + 8, t], a[g, t + 4], a[g + 8, t + 4], b[t, g], b[t + 4, g],
        c[g, 2 * t], c[g, 2 * t + 1], c[g + 8, 2 * t], c[g + 8, 2 * t + 1])


def test_the_instruction_rounds_its_sum_toward_zero():
    """The premise of _mma3's fresh accumulator, on the instruction itself (on the simulator,
    on its model): terms are truncated below the largest one's 25th fraction bit, and the
    sum is rounded toward zero. Column 0 of B is ones, so row r of D is C[r, 0] + sum A[r].
    Each row's float32 sum rounded to nearest would differ."""
    e = 2.0 ** -24
    a = np.zeros((16, 8), np.float32)
    c = np.zeros((16, 8), np.float32)
    cases = [   # (C, A's row, D by truncated terms and a sum toward zero, D to nearest)
        (1.0, [1.5 * e], 1.0, 1.0 + 2 * e),          # 0.75 of a unit: to nearest rounds up
        (-1.0, [-1.5 * e], -1.0, -1.0 - 2 * e),
        (1.0, [e / 4] * 8, 1.0, 1.0 + 2 * e),        # each term below 2**-25 of 1: dropped
        (0.0, [e / 4] * 8, 2 * e, 2 * e),            # the same terms alone are exact
        (3.0, [-e, 4 * e], 3.0, 3.0 + 4 * e),        # 3 + 3 u, where a unit of 3 is 4 u
    ]
    for r, (cr, row, _, _) in enumerate(cases):
        c[r, 0] = cr
        a[r, :len(row)] = row
    b = np.zeros((8, 8), np.float32)
    b[:, 0] = 1.0
    d = dev(np.full((16, 8), np.nan, np.float32))
    _mma_kernel[1, 32](dev(a.view(np.uint32)), dev(b.view(np.uint32)), dev(c), d)
    got = d.copy_to_host()
    nearest = [np.float32(cr + sum(row)) for cr, row, _, _ in cases]
    assert [float(x) for x in nearest] == [want for *_, want in cases]   # (the cases' premise)
    assert [float(x) for x in got[:len(cases), 0]] == [want for _, _, want, _ in cases]
    np.testing.assert_array_equal(got[:, 1:], 0.0)
    np.testing.assert_array_equal(got[len(cases):, 0], 0.0)


@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (False, False)])
def test_the_tensor_core_sum_does_not_drift_toward_zero(trans_a, trans_b):
    """Positive operands, so every partial sum grows: the mean error, signed toward zero, in
    units u |op(a)| |op(b)|, stays within 2 units. The instruction rounds its sum toward zero;
    a running sum carried through it would lose about half a unit per mma, three mma per 8
    of K (-18 units at K = 128 on the simulator, -570 at K = 3072 by dev/probe/mma_drift),
    where float32's own additions round to nearest and do not drift."""
    rng = np.random.default_rng(11)
    m, n, k = (16, 32, 128) if SIM else (256, 256, 3072)
    a = rng.uniform(0.5, 1.0, (k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.uniform(0.5, 1.0, (n, k) if trans_b else (k, n)).astype(np.float32)
    out = dev(np.full((1, m, n), np.nan, np.float32))
    db = dev(b[None])
    G.tiled(dev(a[None]), db, out, db.reshape(db.size), 0, 0, 0, int(trans_a), int(trans_b),
            0, target_blocks=1, tile=TILES[0], stages=0)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    exact = (a64.T if trans_a else a64) @ (b64.T if trans_b else b64)   # (positive: = sizes)
    drift = float(np.mean((out.copy_to_host()[0] - exact) / exact)) / U
    assert -2.0 <= drift <= 2.0, f"mean error {drift:.2f} u"


@pytest.mark.parametrize("bm,bk", [(16, 8), (64, 16), (128, 8)])
def test_fragment_order_puts_each_lanes_fragments_in_16_contiguous_bytes(bm, bk):
    """The PTX ISA's m16n8k8 fragments (lane 4g + t: a0..a3 = A[g, t], A[g+8, t], A[g, t+4],
    A[g+8, t+4]; b0, b1 = B[t, g], B[t+4, g]) lie at 4 lane + 0..3 of their 128-word group,
    A's one mma tile (16 rows, 8 of K) a group, B's two 8-column groups a group, groups
    k-chunk-major; and the places of a bm x bk tile are each word of it once."""
    for kc in range(bk // 8):
        for mt in range(bm // 16):
            for lane in range(32):
                g, t = divmod(lane, 4)
                m, k = 16 * mt + g, 8 * kc + t
                got = [a_fragment_place(m, k, bm), a_fragment_place(m + 8, k, bm),
                       a_fragment_place(m, k + 4, bm), a_fragment_place(m + 8, k + 4, bm)]
                base = 8 * bm * kc + 128 * mt + 4 * lane
                assert got == [base, base + 1, base + 2, base + 3]
        for pair in range(bm // 16):   # (bm as B's width here)
            for lane in range(32):
                g, t = divmod(lane, 4)
                n, k = 16 * pair + g, 8 * kc + t
                got = [b_fragment_place(n, k, bm), b_fragment_place(n, k + 4, bm),
                       b_fragment_place(n + 8, k, bm), b_fragment_place(n + 8, k + 4, bm)]
                base = 8 * bm * kc + 128 * pair + 4 * lane
                assert got == [base, base + 1, base + 2, base + 3]
    for place in (a_fragment_place, b_fragment_place):
        words = sorted(place(r, k, bm) for r in range(bm) for k in range(bk))
        assert words == list(range(bm * bk))


@pytest.mark.parametrize("operand", ["a", "b"])
@pytest.mark.parametrize("rows,bk,nt", [(128, 8, 256), (64, 16, 256), (128, 16, 256),
                                        (64, 8, 256), (32, 16, 64), (32, 8, 64)])
def test_a_lane_stage_stores_whole_lanes_and_reads_whole_sectors(operand, rows, bk, nt):
    """An operand contiguous along its rows, staged a lane's fragment words a thread: every
    element of the tile staged by one thread once; each four of a thread one 16-byte group,
    its first word a multiple of 4; a warp's stores of one four fill 128 contiguous words
    (512 bytes: no two lanes in one bank within a quarter warp's 16-byte stores); and a
    warp's load of one element reads runs of 8 consecutive rows starting at a multiple of 8
    (whole 32-byte sectors of a row-contiguous float32 operand). Tiles whose threads cannot
    take whole fours get None (the kernel keeps the stager's staging)."""
    stage = lane_stage(operand, rows, bk, nt)
    if (rows * bk) % (4 * nt):
        assert stage is None
        return
    place = a_fragment_place if operand == "a" else b_fragment_place
    per = len(stage.drs)
    assert per == rows * bk // nt and stage.quads
    seen = {}
    firsts = [tuple(int(v) for v in stage.place.py_func(np.uint32(tid))) for tid in range(nt)]
    for tid, (row, k) in enumerate(firsts):
        for i in range(per):
            cell = (row + stage.drs[i], k + stage.dks[i])
            assert 0 <= cell[0] < rows and 0 <= cell[1] < bk
            assert cell not in seen, (tid, i, seen.get(cell))
            seen[cell] = (tid, i)
    assert len(seen) == rows * bk
    for warp in range(nt // 32):
        lanes = firsts[32 * warp:32 * warp + 32]
        for j in range(per // 4):
            words = [[place(r + stage.drs[4 * j + v], k + stage.dks[4 * j + v], rows)
                      for v in range(4)] for r, k in lanes]
            assert all(w == list(range(w[0], w[0] + 4)) and w[0] % 4 == 0 for w in words)
            starts = sorted(w[0] for w in words)
            assert starts == list(range(starts[0], starts[0] + 128, 4))
        for i in range(per):
            by_k = {}
            for r, k in lanes:
                by_k.setdefault(k + stage.dks[i], []).append(r + stage.drs[i])
            for run in by_k.values():
                assert sorted(run) == list(range(min(run), min(run) + 8)) and min(run) % 8 == 0


@pytest.mark.parametrize("operand", ["a", "b"])
@pytest.mark.parametrize("rows,bk,nt", [(128, 8, 256), (64, 16, 256), (128, 16, 256),
                                        (64, 8, 256), (32, 16, 64), (16, 8, 64)])
def test_a_k_run_stage_stores_a_warp_to_32_banks_and_reads_whole_sectors(operand, rows, bk, nt):
    """An operand contiguous along k: every element of the tile staged by one thread once;
    a warp's store of any one of its elements to 32 distinct banks (fragment order's word
    modulo 32); its load of one element runs of 8 consecutive k starting at a multiple of 8
    (whole 32-byte sectors)."""
    stage = k_run_stage(rows, bk, nt)
    place = a_fragment_place if operand == "a" else b_fragment_place
    per = len(stage.drs)
    assert per == rows * bk // nt and not stage.quads
    firsts = [tuple(int(v) for v in stage.place.py_func(np.uint32(tid))) for tid in range(nt)]
    cells = {(r + stage.drs[i], k + stage.dks[i]) for r, k in firsts for i in range(per)}
    assert len(cells) == nt * per == rows * bk
    assert all(0 <= r < rows and 0 <= k < bk for r, k in cells)
    for warp in range(nt // 32):
        lanes = firsts[32 * warp:32 * warp + 32]
        for i in range(per):
            elems = [(r + stage.drs[i], k + stage.dks[i]) for r, k in lanes]
            assert len({place(r, k, rows) % 32 for r, k in elems}) == 32
            by_row = {}
            for r, k in elems:
                by_row.setdefault(r, []).append(k)
            for run in by_row.values():
                assert sorted(run) == list(range(min(run), min(run) + 8)) and min(run) % 8 == 0


@pytest.mark.parametrize("trans_a,trans_b", [(False, True), (False, False), (True, False),
                                             (True, True)])
def test_staging_by_lanes_and_by_runs_of_k_gives_the_stagers_bits(monkeypatch, trans_a,
                                                                   trans_b):
    """Which thread stores which element is all the lane and k-run stages change: every
    fragment a warp multiplies holds the same words, so the product is the one the stager's
    staging gives, bit for bit (an edge tile and K past a whole step included)."""
    rng = np.random.default_rng(11)
    tile = TILES[-1]
    m, n, k = (40, 36, 37) if SIM else (300, 260, 301)
    a = rand(rng, *((k, m) if trans_a else (m, k)))[None]
    b = rand(rng, *((n, k) if trans_b else (k, n)))[None]

    def product():
        out = dev(np.full((1, m, n), np.nan, np.float32))
        db = dev(b)
        G.tiled(dev(a), db, out, db.reshape(db.size), 0, 0, 0, int(trans_a), int(trans_b),
                0, target_blocks=1, tile=tile, stages=0)
        return out.copy_to_host()
    staged = product()
    monkeypatch.setattr(G, "lane_stage", lambda *args: None)
    monkeypatch.setattr(G, "k_run_stage", lambda *args: None)
    built = []   # (past tiled_kernel's cache: a kernel of the stager's staging)
    monkeypatch.setattr(G, "tiled_kernel", lambda *key: built.append(G._make_tiled(*key))
                        or built[-1])
    assert np.array_equal(product().view(np.uint32), staged.view(np.uint32)) and built


def test_a_tile_whose_split_operands_pass_a_blocks_static_shared_memory_is_refused():
    """Through registers the operands are staged split, two words each, in fragment order
    (no padding): two buffers of a 128 x 128 tile 16 deep take 4 * 2 * 2 * 16 * (128 + 128)
    bytes."""
    with pytest.raises(ValueError, match=f"take {4 * 2 * 2 * 16 * (128 + 128)} bytes"):
        G.tiled_kernel(False, False, Tiles(128, 128, 16, 8, 8, True), 0)
    G.tiled_kernel(False, False, Tiles(128, 128, 16, 8, 8, True), 2)   # (cp.async: one word)


def test_a_tensor_core_tile_needs_whole_mma_tiles():
    with pytest.raises(ValueError, match="even tm and tn"):
        mma_tile(Tiles(64, 64, 16, 3, 4, True), 72, 72)
    with pytest.raises(ValueError, match="bk a multiple of 8"):
        mma_tile(Tiles(64, 64, 12, 4, 4, True), 72, 72)
    with pytest.raises(ValueError, match="warp tiles of 32 x 16"):
        mma_tile(Tiles(48, 64, 16, 4, 4, True), 56, 72)
