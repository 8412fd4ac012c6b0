"""gemm against its float64 NumPy reference: every decode kernel (K split, whole-K column
tiles, wide persistent tiles, trans_b) and the tiled one, every flag combination, batched
calls, the fused layer norm of the result, determinism, the aliasing rules, and validation
before any launch. Outputs start as NaN unless accumulated into, so an unwritten element
fails the comparison."""
import itertools

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from kernels import _check, gemm as G
from kernels.layernorm import layernorm_ref
from proto.device import backend
from proto.device.backend import cuda
from tests.helpers import assert_close, dev, launches_of, rand, split_counts, split_span

FLAGS = list(itertools.product([False, True], [False, True], [None, "gelu", "relu"],
                               [False, True], [False, True]))  # trans_a, trans_b, act, bias, acc
DECODE = {"split": G.NN, "columns": G.NN_COLS, "wide": G.NN_WIDE_K, "trans_b": G.NT}


def _tol(k):
    # A float32 sum of k unit-variance products accumulated in sequence has rounding error
    # of std ~ 3e-8 * k / sqrt(2) (eps/2 times the partial sums' size, sqrt(i) at step i);
    # 2e-7 * k is ~9 of those, and at k = 1600 (the GPU lane) still well under the sum's
    # own size ~ 40.
    return dict(atol=1e-5 + 2e-7 * k, rtol=1e-4)


def _operands(rng, lead, m, n, k, trans_a, trans_b):
    a = rand(rng, *lead, *((k, m) if trans_a else (m, k)))
    b = rand(rng, *lead, *((n, k) if trans_b else (k, n)))
    return a, b, rand(rng, *lead, m, n)


def _check_gemm(rng, batch, m, n, k, trans_a, trans_b, act, has_bias, accumulate):
    """Run gemm on random inputs of the given shape and flags; compare with gemm_ref."""
    lead = () if batch is None else (batch,)
    a, b, old = _operands(rng, lead, m, n, k, trans_a, trans_b)
    bias = rand(rng, n) if has_bias else None
    out = dev(old if accumulate else np.full_like(old, np.nan))
    G.gemm(dev(a), dev(b), out, bias=None if bias is None else dev(bias), act=act,
           trans_a=trans_a, trans_b=trans_b, accumulate=accumulate, skinny=True)
    np.testing.assert_allclose(
        out.copy_to_host(),
        G.gemm_ref(a, b, bias, act, trans_a, trans_b, old=old if accumulate else None),
        **_tol(k))


@pytest.mark.parametrize("trans_a,trans_b,act,has_bias,accumulate", FLAGS)
def test_every_flag_combination_on_both_kernel_families(trans_a, trans_b, act, has_bias,
                                                        accumulate, scale):
    rng = np.random.default_rng(FLAGS.index((trans_a, trans_b, act, has_bias, accumulate)))
    for m in (3, 9 * scale):  # 3 rows take a decode kernel, more than 8 the tiled one
        _check_gemm(rng, None, m, 5 * scale, 7 * scale, trans_a, trans_b, act, has_bias,
                    accumulate)


@given(m=st.integers(1, 12), n=st.integers(1, 12), k=st.integers(1, 100),
       batch=st.sampled_from([None, 1, 3]), flags=st.sampled_from(FLAGS),
       seed=st.integers(0, 2**16))
def test_matches_reference_on_irregular_shapes(m, n, k, batch, flags, seed, scale):
    # k up to 100 crosses the simulator's 64-row K span (the split path and a partial last
    # batch); m stays <= 8 where drawn so to keep the decode path.
    m = m if m <= G.DECODE_MAX_M else m * scale
    _check_gemm(np.random.default_rng(seed), batch, m, n * scale, k * scale, *flags)


def _run_decode(dk, rng, batch, m, n, k, trans_a, act, has_bias, accumulate, ln=False,
                **plan):
    """decode kernel `dk` straight through `G.decode` (bypassing the launcher's choice of
    kernel): returns (out, y or None) on the host and the float64 expectations."""
    a, b, old = _operands(rng, (batch,), m, n, k, trans_a, dk.trans_b)
    bias = rand(rng, n)
    gamma, beta = rand(rng, n), rand(rng, n)
    out = dev(old if accumulate else np.full_like(old, np.nan))
    y = dev(np.full_like(old, np.nan))
    db = dev(b)
    G.decode(dk, dev(a), db, out, dev(bias) if has_bias else db.reshape(db.size),
             int(has_bias), G.ACTS[act], int(accumulate), int(trans_a), 0,
             (dev(gamma), dev(beta), 1e-5, y) if ln else None, **plan)
    want = G.gemm_ref(a, b, bias if has_bias else None, act, trans_a, dk.trans_b,
                      old=old if accumulate else None)
    want_y = layernorm_ref(want, gamma, beta) if ln else None
    return out.copy_to_host(), (y.copy_to_host() if ln else None), want, want_y


@pytest.mark.parametrize("kernel", list(DECODE))
@pytest.mark.parametrize("case", [
    # batch, m, n, k, trans_a, act, bias, accumulate, plan
    (1, 5, 37, 100, False, "gelu", True, True, {}),                  # K split, partial batch
    (2, 3, 20, 67, True, None, False, False, {"target_blocks": 1 << 20}),  # most splits
    (1, 8, 70, 5, False, "relu", True, False, {"grid_cap": 1}),      # one block loops tiles
])
def test_each_decode_kernel_matches_reference(kernel, case):
    batch, m, n, k, trans_a, act, bias, accumulate, plan = case
    out, _, want, _ = _run_decode(DECODE[kernel], np.random.default_rng(3), batch, m, n, k,
                                  trans_a, act, bias, accumulate, **plan)
    np.testing.assert_allclose(out, want, **_tol(k))


@pytest.mark.parametrize("kernel", list(DECODE))
def test_a_decode_launch_multiplies_exactly_its_rows(kernel, monkeypatch):
    """decode() launches the geometry compiled for M rows of x, not DECODE_MAX_M (compiled
    once per geometry and M), and its result is the reference's."""
    launched = []
    real_launch = G.launch
    monkeypatch.setattr(G, "launch", lambda k, *a, **kw: (launched.append(k),
                                                            real_launch(k, *a, **kw)))
    out, _, want, _ = _run_decode(DECODE[kernel], np.random.default_rng(4), 1, 3, 20, 40,
                                  False, None, True, False)
    np.testing.assert_allclose(out, want, **_tol(40))
    three = G.rows_variant(DECODE[kernel], 3)
    assert three.rows == 3 and G.rows_variant(DECODE[kernel], 3) is three
    assert G.rows_variant(DECODE[kernel], G.DECODE_MAX_M) is DECODE[kernel]
    assert launched[0] is three.kernel
    make = G.make_decode_nt if DECODE[kernel].trans_b else G.make_decode_nn
    with pytest.raises(ValueError, match="rows 9"):
        make(*DECODE[kernel].config[1:], rows=9)


@pytest.mark.parametrize("kernel", ["split", "trans_b"])
@pytest.mark.parametrize("offset", [0.0, 1e3])
def test_ln_out_normalizes_the_rows_of_the_result(kernel, offset):
    """The residual GEMM's reduction also writes layernorm(out): one split (trans_b here)
    and several; rows with a large mean (the case a one-pass variance gets wrong)."""
    rng = np.random.default_rng(int(offset) + len(kernel))
    dk = DECODE[kernel]
    a, b, old = _operands(rng, (1,), 5, 21, 70, False, dk.trans_b)
    old += np.float32(offset)
    gamma, beta, bias = rand(rng, 21), rand(rng, 21), rand(rng, 21)
    out, y = dev(old), dev(np.full_like(old, np.nan))
    G.gemm(dev(a[0]), dev(b[0]), out[0], bias=dev(bias), accumulate=True, trans_b=dk.trans_b,
           ln_out=(dev(gamma), dev(beta), 1e-5, y[0]))
    want = G.gemm_ref(a, b, bias, trans_b=dk.trans_b, old=old)
    np.testing.assert_allclose(out.copy_to_host(), want, **_tol(70))
    # An offset of 1e3 costs float32 out about 3 digits of its spread (see test_layernorm).
    np.testing.assert_allclose(y.copy_to_host(), layernorm_ref(want, gamma, beta),
                               atol=1e-3 if offset else 2e-5, rtol=1e-4)


@pytest.mark.parametrize("wider", [0, 1])
@pytest.mark.parametrize("limit", ["narrow", "wide"])
def test_ln_out_rows_up_to_the_wide_limit_are_normalized_in_the_reduction(limit, wider,
                                                                        monkeypatch):
    """Rows up to LN_COLS * LN_THREADS take the narrow reduction with its layer norm, wider
    ones up to LN_MAX_COLS (GPT-J's 4096 on a GPU) the wide one, wider still a reduction and
    `layernorm` after: each launches what it says, and each gives the reference's out and y."""
    n = (G.LN_COLS * G.LN_THREADS if limit == "narrow" else G.LN_MAX_COLS) + wider
    rng = np.random.default_rng(n)
    a, b, old = _operands(rng, (1,), 5, n, 70, False, True)   # K 70: split on the simulator
    gamma, beta, bias = rand(rng, n), rand(rng, n), rand(rng, n)
    out, y = dev(old), dev(np.full_like(old, np.nan))
    seen = launches_of(monkeypatch, G)
    G.gemm(dev(a[0]), dev(b[0]), out[0], bias=dev(bias), accumulate=True, trans_b=True,
           ln_out=(dev(gamma), dev(beta), 1e-5, y[0]))
    narrow = G.gemm_splitk_reduce_ln_kernels[np.dtype(np.float32)]
    wide = G.gemm_splitk_reduce_ln_wide_kernels[np.dtype(np.float32)]
    expect = {("narrow", 0): narrow, ("narrow", 1): wide, ("wide", 0): wide}.get((limit, wider))
    assert (narrow in seen, wide in seen) == (expect is narrow, expect is wide)
    want = G.gemm_ref(a, b, bias, trans_b=True, old=old)
    np.testing.assert_allclose(out.copy_to_host(), want, **_tol(70))
    np.testing.assert_allclose(y.copy_to_host(), layernorm_ref(want, gamma, beta),
                               atol=2e-5, rtol=1e-4)


def test_ln_out_beyond_the_decode_path_runs_layernorm_after(scale):
    rng = np.random.default_rng(5)
    m, n, k = 9 * scale, 6 * scale, 7 * scale  # more than 8 rows: the tiled kernel
    a, b = rand(rng, m, k), rand(rng, k, n)
    gamma, beta = rand(rng, n), rand(rng, n)
    out, y = dev(np.full((m, n), np.nan, np.float32)), dev(np.full((m, n), np.nan, np.float32))
    G.gemm(dev(a), dev(b), out, act="gelu", ln_out=(dev(gamma), dev(beta), 1e-5, y))
    want = G.gemm_ref(a, b, act="gelu")
    np.testing.assert_allclose(out.copy_to_host(), want, **_tol(k))
    np.testing.assert_allclose(y.copy_to_host(), layernorm_ref(want, gamma, beta),
                               atol=2e-5, rtol=1e-4)


def test_split_k_is_deterministic():
    """Partials are added in split order by one thread, never by atomics: bit-identical
    results run after run."""
    rng = np.random.default_rng(11)
    a, b = dev(rand(rng, 5, 3 * G.SPAN_MAX + 7)), dev(rand(rng, 3 * G.SPAN_MAX + 7, 9))
    runs = []
    for _ in range(2):
        out = dev(np.full((5, 9), np.nan, np.float32))
        G.gemm(a, b, out)
        runs.append(out.copy_to_host())
    np.testing.assert_array_equal(runs[0], runs[1])


@given(k=st.integers(1, 40), flags=st.sampled_from(FLAGS), seed=st.integers(0, 2**16))
def test_the_wide_tile_matches_reference(k, flags, seed):
    """A product big enough for the 8 x 8-a-thread tile (two blocks an SM of it), with
    partial tiles on both edges and K not a whole number of steps."""
    trans_a, trans_b, act, has_bias, accumulate = flags
    side = math.ceil(math.sqrt(2 * _check.sm_count()))
    m, n = side * G.WIDE_TILE.bm - 5, side * G.WIDE_TILE.bn + 3
    assert G.tiled_tile(1, m, n) == G.WIDE_TILE   # (and one wide tile alone would not be:)
    assert G.tiled_tile(1, G.WIDE_TILE.bm, G.WIDE_TILE.bn) == G.TILE
    rng = np.random.default_rng(seed)
    a, b, old = _operands(rng, (), m, n, k, trans_a, trans_b)
    bias = rand(rng, n)
    out = dev(old if accumulate else np.full_like(old, np.nan))
    G.gemm(dev(a), dev(b), out, bias=dev(bias) if has_bias else None, act=act,
           trans_a=trans_a, trans_b=trans_b, accumulate=accumulate)
    want = G.gemm_ref(a, b, bias if has_bias else None, act, trans_a, trans_b,
                      old=old if accumulate else None)
    np.testing.assert_allclose(out.copy_to_host(), want, **_tol(k))


@given(m=st.integers(9, 40), n=st.integers(1, 40), k=st.integers(1, 200),
       batch=st.sampled_from([1, 2]), flags=st.sampled_from(FLAGS),
       target=st.sampled_from([1, 8, 1 << 20]), seed=st.integers(0, 2**16))
def test_the_tiled_kernel_with_k_split_matches_reference(m, n, k, batch, flags, target, seed):
    """The tiled kernel with K split into as many spans as `target` blocks ask for (1: none):
    the partial tiles summed in order and the epilogue applied once."""
    _check_tiled(seed, batch, m, n, k, flags, target_blocks=target)


def _check_tiled(seed, batch, m, n, k, flags, bound=None, **launch):
    """`G.tiled` (its keyword arguments `launch`) on random operands of the given shape and
    flags, against gemm_ref: within _tol(k), or where `bound` is given, within
    bound(sizes), sizes being |op(a)| |op(b)| + |old| + |bias| (what the sum's rounding
    scales with) for each output."""
    trans_a, trans_b, act, has_bias, accumulate = flags
    rng = np.random.default_rng(seed)
    a, b, old = _operands(rng, (batch,), m, n, k, trans_a, trans_b)
    bias = rand(rng, n)
    out = dev(old if accumulate else np.full_like(old, np.nan))
    db = dev(b)
    G.tiled(dev(a), db, out, dev(bias) if has_bias else db.reshape(db.size), int(has_bias),
            G.ACTS[act], int(accumulate), int(trans_a), int(trans_b), 0, **launch)
    want = G.gemm_ref(a, b, bias if has_bias else None, act, trans_a, trans_b,
                      old=old if accumulate else None)
    if bound is None:
        np.testing.assert_allclose(out.copy_to_host(), want, **_tol(k))
        return
    sizes = G.gemm_ref(np.abs(a), np.abs(b), np.abs(bias) if has_bias else None, None,
                       trans_a, trans_b, old=np.abs(old) if accumulate else None)
    err = np.abs(out.copy_to_host().astype(np.float64) - want)
    limit = bound(sizes.astype(np.float64))
    assert np.all(err <= limit), f"worst error / bound {np.max(err / limit):.3g}"


@given(m=st.integers(1, 40), n=st.integers(1, 40), k=st.integers(1, 120),
       batch=st.sampled_from([1, 2]), flags=st.sampled_from(FLAGS),
       stages=st.sampled_from([2, 4]), target=st.sampled_from([1, 8]),
       wide=st.booleans(), seed=st.integers(0, 2**16))
def test_the_tiled_kernel_through_cp_async_stages_matches_reference(m, n, k, batch, flags,
                                                                    stages, target, wide, seed):
    """The tiled kernel whose operands reach shared memory by cp.async in a ring of
    `stages` buffers: every layout and epilogue, edges zero-filled, K split or whole."""
    _check_tiled(seed, batch, m, n, k, flags, target_blocks=target,
                 tile=G.WIDE_TILE if wide else G.TILE, stages=stages)


def test_stages_are_zero_or_at_least_two():
    with pytest.raises(ValueError, match="stages: expected 0"):
        G.tiled_kernel(False, False, G.TILE, 1)


@pytest.fixture
def tiled_launches(monkeypatch):
    """(kernel, grid, threads, args) of every launch gemm makes, in order; the launches run."""
    seen = []
    real = G.launch

    def spy(kernel, grid, threads, args, *rest, **kw):
        seen.append((kernel, grid, threads, args))
        return real(kernel, grid, threads, args, *rest, **kw)
    monkeypatch.setattr(G, "launch", spy)
    return seen


def _most_columns(m, batch):
    """The most columns a product of m rows (batch of them) has while WIDE_TILE's tiles make
    fewer than two blocks an SM (its rule restated): wider ones take WIDE_TILE, switch or not."""
    rows = -(-m // G.WIDE_TILE.bm) * batch
    return (2 * _check.sm_count() - 1) // rows * G.WIDE_TILE.bn


def _widths(m, batch):
    """A few widths of m-row products that WIDE_TILE does not take (none where it takes all,
    as the simulator's two SMs do past 16 rows in batches of 2)."""
    most = _most_columns(m, batch)
    return sorted(n for n in {1, G.SKINNY[0].bn + 1, most} if 1 <= n <= most)


def _skinny_want(m):
    """The tile a non-wide product of m > 8 rows takes with the switch on: 16 x 256 up to 16
    rows, 32 x 128 up to 32 (the simulator's stand-ins have the same rows), TILE above."""
    return G.SKINNY[0] if m <= 16 else G.SKINNY[1] if m <= 32 else G.TILE


def test_skinny_tiles_are_the_specified_shapes():
    """16 and 32 rows (the thresholds); on the GPU TILE's 256 threads and 4 x 4 a thread,
    16 x 256 and 32 x 128; every one compiled for all four layouts."""
    assert [t.bm for t in G.SKINNY] == [16, 32]
    if not backend.SIMULATOR:
        assert G.SKINNY == (G.Tiles(16, 256, 16, 4, 4), G.Tiles(32, 128, 16, 4, 4))
        assert all(t.threads == G.TILE.threads == 256 for t in G.SKINNY)
    for t in G.SKINNY:
        assert all((ta, tb, t) in G.TILED_KERNELS for ta in (False, True) for tb in (False, True))


def test_skinny_tiles_are_off_by_default():
    """Off until dev.ab.ab_lstm_tiles wins on the GPU (then the defaults and this test flip):
    every function that takes the choice defaults to TILE."""
    import inspect
    from proto.models.lstm import LSTMLM
    for fn, name in ((G.gemm, "skinny"), (G.tiled_tile, "skinny"), (G.split_count, "skinny"),
                     (G.split_products, "skinny"), (LSTMLM, "skinny_tiles")):
        assert inspect.signature(fn).parameters[name].default is False, fn
    assert G.tiled_tile(1, 12, 7) == G.TILE != G.tiled_tile(1, 12, 7, skinny=True)


@pytest.mark.parametrize("batch", [1, 2])
def test_the_switch_chooses_skinny_tiles_up_to_32_rows(batch):
    """Switch on: 9..16 rows take the 16-row tile, 17..32 the 32-row one, 33 and more TILE,
    at every width below WIDE_TILE's; WIDE_TILE keeps its products."""
    for m in range(G.DECODE_MAX_M + 1, 2 * G.TILE.bm + 40):
        for n in _widths(m, batch):
            assert G.tiled_tile(batch, m, n, skinny=True) == _skinny_want(m), (m, n)
    side = math.ceil(math.sqrt(2 * _check.sm_count()))   # (as the wide tile's test)
    m = min(32, side * G.WIDE_TILE.bm - 5)
    assert G.tiled_tile(1, m, _most_columns(m, 1) + 1, skinny=True) == G.WIDE_TILE


@pytest.mark.parametrize("batch", [1, 2])
def test_with_the_switch_off_every_product_takes_tile_as_before(batch, tiled_launches):
    """Switch off (its default): products of 9 rows and more below WIDE_TILE's widths take
    TILE, as before skinny tiles, and the launch is TILE's kernel with TILE's plan."""
    for m in range(G.DECODE_MAX_M + 1, 2 * G.TILE.bm + 40):
        for n in _widths(m, batch):
            assert G.tiled_tile(batch, m, n) == G.TILE, (m, n)
    m, n, k = 12, 7, 100
    rng = np.random.default_rng(8)
    a, b, _ = _operands(rng, (batch,), m, n, k, False, True)
    out = dev(np.full((batch, m, n), np.nan, np.float32))
    G.gemm(dev(a), dev(b), out, trans_b=True)
    np.testing.assert_allclose(out.copy_to_host(), G.gemm_ref(a, b, trans_b=True), **_tol(k))
    kernel, grid, _, args = tiled_launches[0]
    assert kernel is G.TILED_KERNELS[(False, True, G.TILE)]
    assert (grid[2] // batch, int(args[9])) == G.tiled_plan(G.TILE, batch, m, n, k)


def _run_skinny(rng, launches, batch, m, n, k, trans_a, trans_b, act, has_bias, accumulate):
    """gemm on one product with skinny tiles asked for; checks the result
    against the reference, and that the launch was the skinny tile's kernel with a plan in
    whole K steps of that tile. Returns the K splits launched."""
    t = _skinny_want(m)
    assert t != G.TILE and n <= _most_columns(m, batch or 1)   # (the case is a skinny one)
    lead = () if batch is None else (batch,)
    a, b, old = _operands(rng, lead, m, n, k, trans_a, trans_b)
    bias = rand(rng, n) if has_bias else None
    out = dev(old if accumulate else np.full_like(old, np.nan))
    launches.clear()
    G.gemm(dev(a), dev(b), out, bias=None if bias is None else dev(bias), act=act,
           trans_a=trans_a, trans_b=trans_b, accumulate=accumulate, skinny=True)
    np.testing.assert_allclose(
        out.copy_to_host(),
        G.gemm_ref(a, b, bias, act, trans_a, trans_b, old=old if accumulate else None),
        **_tol(k))
    kernel, grid, threads, args = launches[0]
    assert kernel is G.TILED_KERNELS[(trans_a, trans_b, t)] and threads == t.threads
    assert grid[:2] == (-(-n // t.bn), 1)   # one row tile: m <= t.bm
    splits, span = grid[2] // (batch or 1), int(args[9])
    assert span % t.bk == 0 and (splits - 1) * span < k <= splits * span
    assert len(launches) == (1 if splits == 1 else 2)   # the split partials' reduction
    return splits


@pytest.mark.parametrize("trans_a,trans_b", list(itertools.product([False, True], repeat=2)))
@pytest.mark.parametrize("which", [0, 1])
def test_skinny_tiles_match_reference_in_every_layout(trans_a, trans_b, which, scale,
                                                      tiled_launches):
    """Each skinny tile in each layout of a and b, at the bottom and top of its rows, K split
    (epilogue in the reduction) and whole (in the kernel), partial column tiles."""
    t = G.SKINNY[which]
    rng = np.random.default_rng(20 + 4 * which + 2 * trans_a + trans_b)
    low, high = (G.DECODE_MAX_M + 1, 16) if which == 0 else (17, 32)
    n = min(t.bn + 3, _most_columns(high, 1) - 3)
    # three of the device's shortest splits (8 K steps on the GPU, 2 on the simulator), so K
    # splits whatever the scale; 20: fewer rows than a split takes (GPU and sim)
    k_split, k_whole = max(100 * scale, 3 * _MIN_STEPS * t.bk), 20
    assert _run_skinny(rng, tiled_launches, None, low, n, k_split, trans_a, trans_b,
                       "gelu", True, True) > 1
    assert _run_skinny(rng, tiled_launches, None, high, n, k_whole, trans_a, trans_b,
                       "relu", True, False) == 1


@given(m=st.integers(9, 32), batch=st.sampled_from([None, 1, 2]), k=st.integers(1, 150),
       flags=st.sampled_from(FLAGS), data=st.data(), seed=st.integers(0, 2**16))
def test_skinny_tiles_match_reference_on_irregular_shapes(m, batch, k, flags, data, seed,
                                                          scale, tiled_launches):
    """9..32-row products of any width below WIDE_TILE's, batched or not, K split or not."""
    assume(_most_columns(m, batch or 1) >= 1)   # (not every product WIDE_TILE's)
    n = data.draw(st.integers(1, min(_most_columns(m, batch or 1), 60 * scale)), "n")
    _run_skinny(np.random.default_rng(seed), tiled_launches, batch, m, n, k * scale, *flags)


TILES = {"tile": G.TILE, "wide": G.WIDE_TILE, "skinny16": G.SKINNY[0], "skinny32": G.SKINNY[1]}
_MIN_STEPS = 2 if backend.SIMULATOR else 8   # K steps a split takes at least
# plan shapes: any, or an LSTM step's (9..64 rows, a few thousand columns: the split ones)
_PLAN_M = st.one_of(st.integers(9, 64), st.integers(9, 5000))
_PLAN_N = st.one_of(st.integers(1, 12000), st.integers(1, 60000))
_PLAN_BATCH = st.one_of(st.integers(1, 4), st.integers(1, 70000))


@pytest.mark.parametrize("tile", list(TILES))
@settings(max_examples=60)   # (host arithmetic only)
@given(m=_PLAN_M, n=_PLAN_N, k=st.integers(1, 20000), batch=_PLAN_BATCH,
       target=st.sampled_from([None, 1, 1 << 20]))
def test_tiled_plan_covers_k_in_whole_slices_within_the_grid(tile, m, n, k, batch, target):
    """The plan of the tile launched: spans of whole K steps of that tile (the simulator's
    skinny tiles step 16 rows, TILE 8), covering K exactly, split only while that tile's grid
    is short of its target, every split but the last at least 8 of its steps (2 on the
    simulator; the last takes what is left of K)."""
    t = TILES[tile]
    splits, span = G.tiled_plan(t, batch, m, n, k, target)
    assert (splits - 1) * span < k <= splits * span and span % t.bk == 0
    assert batch * splits <= max(batch, 65535)   # the grid's z dimension
    tiles = -(-n // t.bn) * -(-m // t.bm) * batch
    if splits > 1:   # split only while the grid is short of its target, in long spans
        assert tiles < (target or 2 * _check.sm_count()) and span >= _MIN_STEPS * t.bk
    else:
        assert span >= k


@pytest.mark.parametrize("tile", list(TILES))
@settings(max_examples=60)   # (host arithmetic only)
@given(m=_PLAN_M, n=_PLAN_N, k=st.integers(1, 20000), batch=_PLAN_BATCH,
       target=st.sampled_from([None, 1, 1 << 20]))
def test_tiled_plan_is_the_plan_before_skinny_tiles_in_the_tiles_geometry(tile, m, n, k,
                                                                          batch, target):
    """Every tile's plan is the one from before the plan took a tile (which used TILE's
    BM, BN, BK and TILED_MIN_SPAN = 8 K steps, 2 on the simulator), in that tile's geometry:
    TILE's is unchanged, so nothing changes without skinny tiles; as many splits as the
    target asks for, no more than K has minimum spans."""
    t = TILES[tile]
    want_target = 2 * _check.sm_count() if target is None else target
    tiles = -(-n // t.bn) * -(-m // t.bm) * batch
    splits = min(-(-want_target // tiles), k // (_MIN_STEPS * t.bk), 65535 // batch)
    if splits < 2:
        want = (1, -(-k // t.bk) * t.bk)
    else:
        span = -(-(-(-k // splits)) // t.bk) * t.bk
        want = (-(-k // span), span)
    assert G.tiled_plan(t, batch, m, n, k, target) == want
    assert G.tiled_min_span(t) == _MIN_STEPS * t.bk
    assert G.TILED_MIN_SPAN == _MIN_STEPS * G.TILE.bk and (G.BM, G.BN, G.BK) == G.TILE[:3]


@given(n=st.integers(1, 60000), k=st.integers(1, 5000), batch=st.integers(1, 4),
       kernel=st.sampled_from(list(DECODE)), target=st.sampled_from([None, 1, 1 << 20]),
       rows=st.integers(1, G.DECODE_MAX_M))
def test_decode_plan_covers_k_in_spans_that_fit(n, k, batch, kernel, target, rows):
    dk = G.rows_variant(DECODE[kernel], rows)   # (the rows x multiplies change no geometry)
    blocks, splits, span = G.decode_plan(dk, batch, n, k, target)
    assert 1 <= blocks <= -(-n // dk.tile)
    assert span <= G.SPAN_MAX and (splits - 1) * span < k <= splits * span
    assert span % min(dk.k_step, G.SPAN_MAX) == 0 or splits == 1
    if kernel in ("columns", "wide") and target is None:   # whole K: one launch, no reduction
        assert splits == -(-k // G.SPAN_MAX)
    # the K plan is the 8-row kernel's (the column blocks follow each one's occupancy)
    assert (splits, span) == G.decode_plan(DECODE[kernel], batch, n, k, target)[1:]


@pytest.mark.parametrize("kernel", ["columns", "wide"])
@pytest.mark.parametrize("rows", range(1, G.DECODE_MAX_M + 1))
def test_whole_k_kernels_never_split_k_that_fits_whatever_their_rows(kernel, rows):
    """One column tile of K = SPAN_MAX rows: the grid is far below any block target, and
    still the whole-K kernels take K in one launch, compiled for any rows of x."""
    dk = G.rows_variant(DECODE[kernel], rows)
    assert G.decode_plan(dk, 1, dk.tile, G.SPAN_MAX)[1:] == (1, G.SPAN_MAX)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,trans_b,act,accumulate", [
    (768, 2304, False, None, False), (768, 768, False, None, True),
    (768, 3072, False, "gelu", False), (3072, 768, False, None, True),
    (768, 50257, True, None, False), (768, 50257, False, None, False)])
def test_decode_gpt2_shapes(k, n, trans_b, act, accumulate):
    """GPT-2 small's decode GEMMs: 5 beams against each layer's weights and the head."""
    rng = np.random.default_rng(n + k)
    x, old = rand(rng, 5, k), rand(rng, 5, n)
    w = rand(rng, n, k) if trans_b else rand(rng, k, n)
    bias = rand(rng, n)
    out = dev(old if accumulate else np.full_like(old, np.nan))
    G.gemm(dev(x), dev(w), out, bias=dev(bias), act=act, trans_b=trans_b,
           accumulate=accumulate)
    np.testing.assert_allclose(
        out.copy_to_host(),
        G.gemm_ref(x, w, bias, act, trans_b=trans_b, old=old if accumulate else None),
        **_tol(k))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [768, 3072])
def test_residual_shapes_split_k_then_reduce_and_normalize(k):
    """GPT-2 small's residual GEMMs (attention and MLP projections into the 768-wide residual
    stream, then ln_out) on the GPU: K split over blocks, then one launch that sums the
    splits in order and normalizes the rows; repeated 20 times, every run bit-identical, and
    right."""
    rng = np.random.default_rng(k)
    x, old, w = rand(rng, 5, k), rand(rng, 5, 768), rand(rng, k, 768)
    bias, gamma, beta = rand(rng, 768), rand(rng, 768), rand(rng, 768)
    assert G.pick_decode(False, 1, 768) is G.NN and G.decode_plan(G.NN, 1, 768, k)[1] > 1
    dx, dw, db, dg, dbeta = dev(x), dev(w), dev(bias), dev(gamma), dev(beta)
    want = G.gemm_ref(x, w, bias, old=old)
    runs = []
    for _ in range(20):
        out, y = dev(old), dev(np.full_like(old, np.nan))
        G.gemm(dx, dw, out, bias=db, accumulate=True, ln_out=(dg, dbeta, 1e-5, y))
        runs.append((out.copy_to_host(), y.copy_to_host()))
    np.testing.assert_allclose(runs[0][0], want, **_tol(k))
    np.testing.assert_allclose(runs[0][1], layernorm_ref(want, gamma, beta), atol=2e-5, rtol=1e-4)
    for out, y in runs[1:]:
        np.testing.assert_array_equal(out, runs[0][0])
        np.testing.assert_array_equal(y, runs[0][1])


def test_bias_may_alias_an_input():
    rng = np.random.default_rng(1)
    a, b = rand(rng, 4, 6), rand(rng, 6, 5)
    db = dev(b)
    out = cuda.device_array((4, 5), np.float32)
    G.gemm(dev(a), db, out, bias=db[0], act="relu")  # bias is b's first row, read-only
    assert_close(out, G.gemm_ref(a, b, b[0], "relu"), "gemm")


class _LaunchRecorder:
    """Stands in for the device (backend's recorder hook): records launches, runs nothing."""

    def __init__(self):
        self.launches = []

    def record_launch(self, *args):
        self.launches.append(args)

    def record_alloc(self, shape, dtype, name, owner):
        return cuda.device_array(shape, dtype)


def _raises_before_launch(monkeypatch, exc, match, **kwargs):
    """gemm(**kwargs) raises `exc` matching `match`, and nothing reached the GPU first."""
    recorder = _LaunchRecorder()
    monkeypatch.setattr(backend, "_recorder", recorder)
    with pytest.raises(exc, match=match):
        G.gemm(**kwargs)
    assert recorder.launches == []


def test_out_must_not_overlap_an_input(monkeypatch):
    sq = dev(np.ones((4, 4), np.float32))
    other = dev(np.ones((4, 4), np.float32))
    def raises(match, **kw):
        _raises_before_launch(monkeypatch, ValueError, match, **kw)
    raises("output 'out'.* overlaps argument 'a'", a=sq, b=other, out=sq)
    raises("output 'out'.* overlaps argument 'b'", a=other, b=sq, out=sq)
    buf = dev(np.ones((8, 4), np.float32))  # out a view into the rows of b
    raises("output 'out'.* overlaps argument 'b'", a=dev(np.ones((4, 8), np.float32)),
           b=buf, out=buf[4:])
    fresh = dev(np.ones((4, 4), np.float32))
    raises("output 'out'.* overlaps argument 'bias'", a=other, b=fresh, out=sq, bias=sq[1])
    y, ones = dev(np.ones((4, 4), np.float32)), dev(np.ones(4, np.float32))
    raises("y overlaps out", a=other, b=fresh, out=y, accumulate=True,  # y must not be out
           ln_out=(ones, ones, 1e-5, y))


def test_rejects_bad_input_before_launch(monkeypatch):
    a, b = dev(np.ones((3, 4), np.float32)), dev(np.ones((4, 5), np.float32))
    out = cuda.device_array((3, 5), np.float32)
    ok = dict(a=a, b=b, out=out)
    def raises(exc, match, **kw):
        _raises_before_launch(monkeypatch, exc, match, **kw)
    raises(TypeError, "a: expected a device array", **{**ok, "a": np.ones((3, 4), np.float32)})
    raises(TypeError, "b: expected dtype float32", **{**ok, "b": dev(np.ones((4, 5), np.float64))})
    raises(ValueError, r"b: expected op\(b\) of shape \(4, \*\)",
           **{**ok, "b": dev(np.ones((6, 5), np.float32))})
    raises(ValueError, r"out: expected shape \(3, 5\)",
           **{**ok, "out": cuda.device_array((3, 6), np.float32)})
    raises(ValueError, "C-contiguous", **{**ok, "a": dev(np.ones((3, 8), np.float32))[:, ::2]})
    raises(ValueError, "act: expected one of", **ok, act="tanh")
    raises(ValueError, r"bias: expected shape \(5,\)", **ok, bias=dev(np.ones(4, np.float32)))
    raises(ValueError, "all 2-D or all 3-D", **{**ok, "a": dev(np.ones((1, 3, 4), np.float32))})
    raises(ValueError, r"b: expected op\(b\).* with batch \(2,\)",
           a=dev(np.ones((2, 3, 4), np.float32)), b=dev(np.ones((1, 4, 5), np.float32)),
           out=cuda.device_array((2, 3, 5), np.float32))
    g, y = dev(np.ones(5, np.float32)), cuda.device_array((3, 5), np.float32)
    raises(ValueError, r"ln_out: expected \(gamma, beta, eps, y\)", **ok, ln_out=(g, g, 1e-5))
    raises(ValueError, r"ln_out gamma: expected shape \(5,\)", **ok,
           ln_out=(dev(np.ones(4, np.float32)), g, 1e-5, y))
    raises(ValueError, r"ln_out y: expected shape \(3, 5\)", **ok,
           ln_out=(g, g, 1e-5, cuda.device_array((5, 3), np.float32)))
    raises(ValueError, "ln_out eps: expected a positive number", **ok, ln_out=(g, g, 0.0, y))


def test_tiled_refuses_operands_past_its_32_bit_offsets(monkeypatch):
    """The tiled kernel addresses its flattened operands with uint32 offsets; an operand of
    2**32 elements (16 GiB, more than the simulator can hold) is refused before any launch.
    Only shapes are read before the check, so stand-ins carry them."""
    from types import SimpleNamespace
    recorder = _LaunchRecorder()
    monkeypatch.setattr(backend, "_recorder", recorder)
    big = SimpleNamespace(shape=(1, 2**16, 2**16), size=2**32)
    b, out = dev(np.ones((1, 2**16, 4), np.float32)), SimpleNamespace(shape=(1, 2**16, 4))
    with pytest.raises(ValueError, match=r"a: 4294967296 elements exceed the tiled GEMM's 2\*\*32"):
        G.tiled(big, b, out, b, 0, 0, 0, 0, 0, 0)
    assert recorder.launches == []


def test_the_split_k_reduction_refuses_partials_past_its_32_bit_offsets(monkeypatch):
    """The reduction addresses the flattened partials with uint32 offsets: 2**32 of them are
    refused before its launch (stand-ins carry the shapes)."""
    from types import SimpleNamespace
    recorder = _LaunchRecorder()
    monkeypatch.setattr(backend, "_recorder", recorder)
    part = SimpleNamespace(shape=(1, 2**12, 2**10, 2**10), size=2**32)
    out = SimpleNamespace(shape=(1, 2**10, 2**10), dtype=np.float32)
    with pytest.raises(ValueError, match=r"part: 4294967296 partials exceed"):
        G._sum_partials(part, out, None, 0, 0, 0, 0)
    assert recorder.launches == []


def _valid_splits(k):
    return split_counts(k, G.NN.k_step, G.SPAN_MAX)


@given(m=st.integers(1, G.DECODE_MAX_M), n=st.integers(1, 80), k=st.integers(1, 150),
       data=st.data(), seed=st.integers(0, 2**16))
def test_partials_are_each_splits_product(m, n, k, data, seed):
    """part[s] = a[:, span_s] @ b[span_s] with span_s = [s*span, (s+1)*span): each split's
    own product, no bias and nothing summed (the consumer sums them)."""
    splits = data.draw(st.sampled_from(_valid_splits(k)), "splits")
    span = split_span(k, splits, G.NN.k_step)
    rng = np.random.default_rng(seed)
    a, b = rand(rng, m, k), rand(rng, k, n)
    part = dev(np.full((splits, m, n), np.nan, np.float32))
    G.partials(dev(a), dev(b), part)
    want = np.stack([a[:, s * span:(s + 1) * span].astype(np.float64)
                     @ b[s * span:(s + 1) * span] for s in range(splits)])
    assert_close(part, want, "gemm")


@given(n=st.integers(1, 60000), k=st.integers(1, 5000))
def test_partial_splits_is_a_count_partials_takes(n, k):
    assert G.partial_splits(n, k) in _valid_splits(k)


@settings(max_examples=12)
@given(m=st.integers(1, 20), n=st.integers(1, 40), k=st.integers(1, 150), trans_b=st.booleans(),
       skinny=st.booleans(), seed=st.integers(0, 2**16))
def test_split_products_sum_to_the_product(m, n, k, trans_b, skinny, seed):
    """The partials of the launch gemm makes (decode kernels up to DECODE_MAX_M rows, the
    tiled kernel of either tile above): split_count of them, every one written, their sum in
    order the product."""
    rng = np.random.default_rng(seed)
    a, b = rand(rng, m, k), rand(rng, *((n, k) if trans_b else (k, n)))
    splits = G.split_count(m, n, k, trans_b=trans_b, skinny=skinny)
    part = dev(np.full((splits, m, n), np.nan, np.float32))
    G.split_products(dev(a), dev(b), part, trans_b=trans_b, skinny=skinny)
    got = part.copy_to_host()
    assert not np.isnan(got).any()
    want = a.astype(np.float64) @ (b.T if trans_b else b)
    np.testing.assert_allclose(got.astype(np.float64).sum(axis=0), want, **_tol(k))


@pytest.mark.parametrize("m", [3, G.DECODE_MAX_M + 4])
def test_split_products_split_k_as_gemm_does(m, monkeypatch):
    """A K long enough is split on both paths (so the sum above sums several partials), as
    many ways as gemm's own launch: its scratch holds split_count partials. (Skinny tiles:
    the simulator's grid target splits only a product of one tile.)"""
    k, n = 8 * max(G.SPAN_MAX, G.TILED_MIN_SPAN), 16
    splits = G.split_count(m, n, k, trans_b=True, skinny=True)
    assert splits > 1
    rng = np.random.default_rng(1)
    a, b, out = dev(rand(rng, m, k)), dev(rand(rng, n, k)), dev(np.zeros((m, n), np.float32))
    recorder = _LaunchRecorder()
    monkeypatch.setattr(backend, "_recorder", recorder)
    G.gemm(a, b, out, trans_b=True, skinny=True)
    scratch = [x for launch in recorder.launches for x in launch[3]
               if getattr(x, "ndim", 0) == 4 and tuple(x.shape[-2:]) == (m, n)]
    assert scratch and all(x.shape[1] == splits for x in scratch)


def test_split_products_refuse_bad_input_before_launch(monkeypatch):
    """A split count other than split_count's, a part of the wrong shape, a K mismatch or a
    trans_b that is no bool: an error naming the argument, nothing launched."""
    rng = np.random.default_rng(0)
    m, n, k = 3, 5, 8 * G.SPAN_MAX
    a, b = dev(rand(rng, m, k)), dev(rand(rng, n, k))
    s = G.split_count(m, n, k, trans_b=True)
    recorder = _LaunchRecorder()
    monkeypatch.setattr(backend, "_recorder", recorder)
    zeros = lambda *shape: dev(np.zeros(shape, np.float32))  # noqa: E731
    with pytest.raises(ValueError, match=rf"part: expected {s} splits .* got {s + 1}"):
        G.split_products(a, b, zeros(s + 1, m, n), trans_b=True)
    with pytest.raises(ValueError, match=r"part: expected shape \('\*', 3, 5\)"):
        G.split_products(a, b, zeros(s, m, n + 1), trans_b=True)
    with pytest.raises(ValueError, match="b: expected shape"):
        G.split_products(a, dev(rand(rng, n, k + 1)), zeros(s, m, n), trans_b=True)
    with pytest.raises(ValueError, match="trans_b: expected True or False"):
        G.split_products(a, b, zeros(s, m, n), trans_b="yes")
    assert recorder.launches == []


def test_partials_refuse_bad_input_before_launch(monkeypatch):
    """A split count that does not cover K evenly, a part of the wrong shape, too many rows
    for the decode kernel, or mismatched K: ValueError naming the argument, nothing launched."""
    rng = np.random.default_rng(0)
    k = 3 * G.NN.k_step
    bad = [s for s in range(1, k + 1) if s not in _valid_splits(k)][0]
    m8 = G.DECODE_MAX_M + 1
    cases = [("part", (2, k), (k, 5), (bad, 2, 5)), ("part", (2, k), (k, 5), (1, 2, 6)),
             ("a", (m8, k), (k, 5), (1, m8, 5)), ("b", (2, k), (k + 1, 5), (1, 2, 5))]
    recorder = _LaunchRecorder()
    monkeypatch.setattr(backend, "_recorder", recorder)
    for name, a, b, part in cases:
        with pytest.raises(ValueError, match=name):
            G.partials(dev(rand(rng, *a)), dev(rand(rng, *b)), dev(np.zeros(part, np.float32)))
    assert recorder.launches == []


# ---------------------------------------------------------------------------- half precision
# The decode kernels load float16 a, b, old and bias into float32 (a product of two float16
# values is exact in float32), sum in float32 and round the float16 result once, as they
# store it. Against float64 on the same float16 values: a float32 sum of K products (split
# or not: the splits' sums add S - 1 <= K more additions), then old and bias added, is off by
# at most (K + 4) U32 (sum |a||b| + |old| + |bias|); ReLU passes that on, GELU at most 1.13
# times it (the largest slope of its tanh form) plus its own float32 error (16 U32 of
# 1 + |v|, as in test_elementwise); then the one float16 rounding (U16 of the result, 2^-25
# below the normal range). The fused layer norm normalizes the float32 row before that
# rounding: a row off by at most e moves its mean by e, its deviation by 2e, so the
# normalized value by 2 e (1 + |xh|) / sigma, on top of test_layernorm's own bound.
U16, U32 = 2.0 ** -11, 2.0 ** -24


def _halves(rng, *shape):
    return rng.standard_normal(shape).astype(np.float16)


def _half_sum_bound(a, b, bias, old, trans_a, trans_b):
    """(the float64 result before the activation, the bound on its float32 error)."""
    f = [None if x is None else x.astype(np.float64) for x in (a, b, bias, old)]
    a64, b64, bias64, old64 = f
    a64 = np.swapaxes(a64, -1, -2) if trans_a else a64
    b64 = np.swapaxes(b64, -1, -2) if trans_b else b64
    v, mag = a64 @ b64, np.abs(a64) @ np.abs(b64)
    for extra in (old64, bias64):
        if extra is not None:
            v, mag = v + extra, mag + np.abs(extra)
    # float16 trans_b may take the tensor-core kernel, whose additions truncate on a GPU:
    # 2 U32 an addition (tests/test_gemm_mma.py)
    per_add = 2 * U32 if trans_b else U32
    return v, (a64.shape[-1] + 4) * per_add * mag


def _half_result(v, e, act):
    """(the float64 result after the activation, its bound before the float16 rounding)."""
    if act == "relu":
        return np.maximum(v, 0.0), e
    if act == "gelu":
        want = 0.5 * v * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (v + 0.044715 * v ** 3)))
        return want, 1.13 * e + 16 * U32 * (1 + np.abs(v))
    return v, e


def _assert_within(got, want, bound):
    err = np.abs(got.astype(np.float64) - want) - bound
    assert np.all(err <= 0), float(err.max())


@given(m=st.integers(1, G.DECODE_MAX_M), batch=st.sampled_from([None, 1, 2]),
       k=st.integers(1, 150), flags=st.sampled_from(FLAGS), data=st.data(),
       seed=st.integers(0, 2**16))
def test_half_precision_decode_rounds_once(m, batch, k, flags, data, seed, scale):
    """Every decode kernel (both layouts of b, K split or whole) in float16 against float64
    on the same float16 values, within the bound derived above."""
    trans_a, trans_b, act, has_bias, accumulate = flags
    n = data.draw(st.integers(1, 80 * scale), "n")
    rng = np.random.default_rng(seed)
    lead = () if batch is None else (batch,)
    k *= scale
    a = _halves(rng, *lead, *((k, m) if trans_a else (m, k)))
    b = _halves(rng, *lead, *((n, k) if trans_b else (k, n)))
    old, bias = _halves(rng, *lead, m, n), _halves(rng, n) if has_bias else None
    out = dev(old if accumulate else np.full_like(old, np.nan))
    G.gemm(dev(a), dev(b), out, bias=None if bias is None else dev(bias), act=act,
           trans_a=trans_a, trans_b=trans_b, accumulate=accumulate)
    v, e = _half_sum_bound(a, b, bias, old if accumulate else None, trans_a, trans_b)
    want, e = _half_result(v, e, act)
    got = out.copy_to_host()
    assert got.dtype == np.float16
    _assert_within(got, want, e + U16 * np.abs(want) + 2.0 ** -25)


@pytest.mark.parametrize("trans_b", [False, True])
def test_half_precision_ln_out_normalizes_the_float32_row(trans_b, scale):
    """The residual GEMM with its fused layer norm in float16, K split so that the
    reduction launch normalizes: out and y each rounded once."""
    rng = np.random.default_rng(3 + trans_b)
    m, n, k = 5, min(24 * scale, G.LN_COLS * G.LN_THREADS), 3 * G.SPAN_MAX + 7
    a, old, bias = _halves(rng, m, k), _halves(rng, m, n), _halves(rng, n)
    b = _halves(rng, *((n, k) if trans_b else (k, n)))
    gamma, beta = _halves(rng, n), _halves(rng, n)
    out, y = dev(old), dev(np.full((m, n), np.nan, np.float16))
    G.gemm(dev(a), dev(b), out, bias=dev(bias), accumulate=True, trans_b=trans_b,
           ln_out=(dev(gamma), dev(beta), 1e-5, y))
    v, e = _half_sum_bound(a, b, bias, old, False, trans_b)
    _assert_within(out.copy_to_host(), v, e + U16 * np.abs(v) + 2.0 ** -25)
    mean = v.mean(axis=-1, keepdims=True)
    sigma = np.sqrt(((v - mean) ** 2).mean(axis=-1, keepdims=True) + 1e-5)
    xh = (v - mean) / sigma
    g64, b64 = gamma.astype(np.float64), beta.astype(np.float64)
    want_y = xh * g64 + b64
    e_max = e.max(axis=-1, keepdims=True)
    ln = (4 * n * U32 * (np.abs(v).max(axis=-1, keepdims=True) / sigma + 1) * (1 + np.abs(xh))
          + 2 * e_max * (1 + np.abs(xh)) / sigma)
    bound = (np.abs(g64) * ln + 2 * U32 * (np.abs(g64 * xh) + np.abs(b64))
             + U16 * np.abs(want_y) + 2.0 ** -25)
    _assert_within(y.copy_to_host(), want_y, bound)


def test_half_precision_is_refused_where_no_kernel_takes_it():
    h = lambda *s: dev(np.ones(s, np.float16))   # noqa: E731
    f = lambda *s: dev(np.ones(s, np.float32))   # noqa: E731
    with pytest.raises(TypeError, match="b: expected dtype float16, got float32"):
        G.gemm(h(3, 4), f(4, 5), h(3, 5))
    with pytest.raises(TypeError, match="bias: expected dtype float16, got float32"):
        G.gemm(h(3, 4), h(4, 5), h(3, 5), bias=f(5))
    with pytest.raises(TypeError, match=r"a: batched or transposed float16 products take at "
                                        r"most 8 rows .* got 9"):
        G.gemm(h(1, 9, 4), h(1, 4, 5), h(1, 9, 5))
    with pytest.raises(TypeError, match=r"a: batched or transposed float16 .* got 9"):
        G.gemm(h(4, 9), h(4, 5), h(9, 5), trans_a=True)
    with pytest.raises(TypeError, match="a: expected dtype float32 or float16, got float64"):
        G.gemm(dev(np.ones((3, 4))), h(4, 5), h(3, 5))
    with pytest.raises(TypeError, match="a: expected dtype float32, got float16"):
        G.partials(h(3, 4), h(4, 5), dev(np.ones((1, 3, 5), np.float32)))


@pytest.mark.parametrize("trans_b", [False, True])
def test_half_precision_rows_beyond_eight_run_eight_at_a_time(trans_b):
    """A 2-D float16 product of 13 rows (a prefill's) with its bias, accumulation and fused
    layer norm: bit for bit what launches of rows 0-7 and 8-12 give (the same kernels on the
    same rows), and within the decode bound of float64."""
    rng = np.random.default_rng(11 + trans_b)
    m, k, n = 13, 24, 10
    a, old, bias = _halves(rng, m, k), _halves(rng, m, n), _halves(rng, n)
    b = _halves(rng, *((n, k) if trans_b else (k, n)))
    gamma, beta = dev(_halves(rng, n)), dev(_halves(rng, n))

    def run(rows):
        out, y = dev(old[rows]), dev(np.zeros((len(range(m)[rows]), n), np.float16))
        G.gemm(dev(a[rows]), dev(b), out, bias=dev(bias), accumulate=True, trans_b=trans_b,
               ln_out=(gamma, beta, 1e-5, y))
        return out.copy_to_host(), y.copy_to_host()
    whole = run(slice(None))
    parts = [run(slice(0, 8)), run(slice(8, None))]
    for i in range(2):
        np.testing.assert_array_equal(whole[i], np.concatenate([p[i] for p in parts]))
    v, e = _half_sum_bound(a, b, bias, old, False, trans_b)
    _assert_within(whole[0], v, e + U16 * np.abs(v) + 2.0 ** -25)


@pytest.mark.gpu
@pytest.mark.parametrize("k,n,trans_b", [(4096, 12288, True), (4096, 4096, True),
                                         (4096, 16384, True), (16384, 4096, True),
                                         (4096, 50400, True), (4096, 16384, False)])
def test_decode_gptj_shapes_in_half_precision(k, n, trans_b):
    """GPT-J-6B's decode GEMMs in float16 (Hugging Face's Linear weights are (N, K): trans_b),
    5 beams, with bias and accumulation, against float64 within the derived bound."""
    rng = np.random.default_rng(n + k)
    a, old, bias = _halves(rng, 5, k), _halves(rng, 5, n), _halves(rng, n)
    b = (_halves(rng, n, k) if trans_b else _halves(rng, k, n)) * np.float16(0.02)
    out = dev(old)
    G.gemm(dev(a), dev(b), out, bias=dev(bias), trans_b=trans_b, accumulate=True)
    v, e = _half_sum_bound(a, b, bias, old, False, trans_b)
    _assert_within(out.copy_to_host(), v, e + U16 * np.abs(v) + 2.0 ** -25)
