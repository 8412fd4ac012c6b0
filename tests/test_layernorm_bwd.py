"""layernorm_bwd against its float64 reference (itself checked by finite differences of the
forward reference) and torch.autograd: the warp-a-row kernel and the block-a-row one, chunks
of rows cut anywhere, rows with a large mean, dgamma / dbeta left out, validation before any
launch, and the same bits on every run and in a graph."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import layernorm as L
from kernels._reduce import WARP_ELEMS
from proto.device.backend import cuda
from tests.helpers import FULL_SIZE, central_differences, dev, rand

U = 2.0 ** -24    # float32's unit roundoff
TINY = 1e-12


def bounds(x, gamma, dy):
    """First-order float32 error bounds of (dx, dgamma, dbeta), float64 arrays. A float32 sum
    of k terms, in any order, errs by at most k U times the sum of their magnitudes. Over a
    row of n: the mean and variance leave xh = (x - mean) rstd within E (1 + |xh|), with
    E = 4 n U (max|x| rstd + 1) (as tests/test_layernorm's half-precision bound). dx =
    rstd (g - m1 - xh m2), g = dy gamma: m1, m2, xh and rstd each err by at most E times
    |g| + (1 + |xh|) A, A = mean(|g| (1 + |xh|)) over the row (which bounds |m1|, |m2|);
    four such terms, hence 4. dgamma, dbeta: sums over the R rows, R U of their terms plus
    each term's own error (dy times xh's), doubled for the product roundings."""
    x, gamma, dy = (np.asarray(a, np.float64) for a in (x, gamma, dy))
    n, R = x.shape[-1], x.shape[0]
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + 1e-5)
    xh = (x - mean) * rstd
    E = 4 * n * U * (np.abs(x).max(axis=-1, keepdims=True) * rstd + 1)
    g = np.abs(dy * gamma)
    A = (g * (1 + np.abs(xh))).mean(axis=-1, keepdims=True)
    dx = 4 * rstd * E * (g + (1 + np.abs(xh)) * A) + TINY
    ady = np.abs(dy)
    dgamma = 2 * (R * U * (ady * np.abs(xh)).sum(axis=0) + (ady * E * (1 + np.abs(xh))).sum(axis=0))
    return dx, dgamma + TINY, 2 * R * U * ady.sum(axis=0) + TINY


def assert_within(got, want, bound, name):
    got = got.copy_to_host() if hasattr(got, "copy_to_host") else got
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), f"{name}: error exceeds its bound by {float(np.max(err - bound))}"


def run(x, gamma, dy, params=True):
    """dx, dgamma, dbeta (NaN-filled first: overwritten, not accumulated into)."""
    R, C = x.shape
    dx = dev(np.full((R, C), np.nan, np.float32))
    dg, db = (dev(np.full(C, np.nan, np.float32)) if params else None for _ in range(2))
    L.layernorm_bwd(dev(x), dev(gamma), dev(dy), dx, dg, db)
    return dx, dg, db


@given(rows=st.integers(1, 20), cols=st.integers(1, 80), params=st.booleans(),
       seed=st.integers(0, 2**16))
def test_matches_reference(rows, cols, params, seed, scale):
    """Widths up to 32 * max(WARP_ELEMS) take a warp a row, wider ones a block; rows cut
    into chunks of CHUNK_ROWS with a ragged last one."""
    rng = np.random.default_rng(seed)
    rows, cols = rows * scale, cols * scale
    x, dy, gamma = rand(rng, rows, cols), rand(rng, rows, cols), rand(rng, cols)
    dx, dg, db = run(x, gamma, dy, params)
    want, bound = L.layernorm_bwd_ref(x, gamma, dy), bounds(x, gamma, dy)
    assert_within(dx, want[0], bound[0], "dx")
    if params:
        assert_within(dg, want[1], bound[1], "dgamma")
        assert_within(db, want[2], bound[2], "dbeta")


EDGES = sorted({c for e in WARP_ELEMS for c in (32 * e - 1, 32 * e, 32 * e + 1)})


@pytest.mark.parametrize("cols", EDGES)
def test_each_warp_width_and_past_it_with_a_large_mean(cols):
    """Rows up to 32 * E take a warp each, wider ones a block; 11 rows leave warps of the
    second chunk without a row. A mean of 1000: float32 x keeps its unit spread to ulp 6e-5,
    and the mean's sum adds a few ulp: xh is off by ~1e-4 (the worst-case bounds above,
    linear in n and |x|, allow far more), hence atol 2e-3 on dx, and 1e-2 on dgamma (a sum
    of 11 such terms). A one-pass E[x^2] - mean^2 variance is off by ~30% here."""
    rng = np.random.default_rng(cols)
    x = rand(rng, 11, cols) + np.float32(1000.0)
    dy, gamma = rand(rng, 11, cols), rand(rng, cols)
    dx, dg, db = run(x, gamma, dy)
    want = L.layernorm_bwd_ref(x, gamma, dy)
    np.testing.assert_allclose(dx.copy_to_host(), want[0], rtol=1e-4, atol=2e-3)
    np.testing.assert_allclose(dg.copy_to_host(), want[1], rtol=1e-4, atol=1e-2)
    assert_within(db, want[2], bounds(x, gamma, dy)[2], "dbeta")   # (no xh in it)


def test_reference_matches_finite_differences():
    """L = sum(w * layernorm_ref(x, gamma, beta)), central differences of step h = 3e-3 in
    float64 inputs. layernorm_ref rounds its 12 outputs to float32: L carries at most
    12 * 2^-24 * max|w y| (< 5e-6 here) of rounding, < 8e-4 once divided by 2h; the
    truncation, h^2 / 6 times a third derivative of order rstd^3 |gamma w| (< 100), adds
    < 2e-4. Hence atol 1e-3 (seen: 4e-5); a wrong formula is off by O(1). One row is
    constant (variance 0: eps alone sets rstd)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 4))
    x[1] = 0.25
    gamma, beta, w = rng.standard_normal(4), rng.standard_normal(4), rng.standard_normal((3, 4))
    h, eps = 3e-3, 1e-1   # (a larger eps keeps the constant row's rstd, and its derivatives, small)

    def loss(x_, g_, b_):
        return float((w * L.layernorm_ref(x_, g_, b_, eps=eps).astype(np.float64)).sum())

    def numeric(which):
        return central_differences(loss, [x, gamma, beta], which, h)

    dx, dgamma, dbeta = L.layernorm_bwd_ref(x, gamma, w, eps=eps)
    for got, which in ((dx, 0), (dgamma, 1), (dbeta, 2)):
        np.testing.assert_allclose(got, numeric(which), atol=1e-3, rtol=0)


def test_matches_torch_autograd():
    """torch's float64 layer norm and autograd as the truth (its own error ~1e-16); ours
    within the float32 bounds above. Tiny rows on the simulator (a warp a row, and a block a
    row), Wav2Vec2-base's on a GPU: the feature projection's 512 and the encoder's 768, over
    8 clips of up to 199 frames."""
    torch = pytest.importorskip("torch")
    shapes = [(9, 40), (5, 70)] if not FULL_SIZE else [(1592, 512), (1592, 768)]
    rng = np.random.default_rng(11)
    for R, C in shapes:
        x, dy = rand(rng, R, C), rand(rng, R, C)
        gamma, beta = rand(rng, C), rand(rng, C)
        tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        tg = torch.tensor(gamma, dtype=torch.float64, requires_grad=True)
        tb = torch.tensor(beta, dtype=torch.float64, requires_grad=True)
        torch.nn.functional.layer_norm(tx, (C,), tg, tb, eps=1e-5).backward(
            torch.tensor(dy, dtype=torch.float64))
        got = run(x, gamma, dy)
        for g, t, b, name in zip(got, (tx.grad, tg.grad, tb.grad), bounds(x, gamma, dy),
                                 ("dx", "dgamma", "dbeta")):
            assert_within(g, t.numpy(), b, f"{name} at {R} x {C}")


def _ones(*shape, dtype=np.float32):
    return dev(np.ones(shape, dtype))


def test_rejects_bad_input_before_launch():
    x, dy, g = _ones(2, 5), _ones(2, 5), _ones(5)
    dx, dg, db = (dev(np.zeros(s, np.float32)) for s in ((2, 5), 5, 5))
    ok = dict(x=x, gamma=g, dy=dy, dx=dx, dgamma=dg, dbeta=db)
    cases = [
        (TypeError, "x: expected a device array", dict(x=np.ones((2, 5), np.float32))),
        (ValueError, "x: expected 2 dimensions", dict(x=_ones(5))),
        (TypeError, "x: expected dtype float32, got float16",
         dict(x=_ones(2, 5, dtype=np.float16))),
        (ValueError, r"gamma: expected shape \(5,\)", dict(gamma=_ones(4))),
        (ValueError, r"dy: expected shape \(2, 5\)", dict(dy=_ones(5, 2))),
        (ValueError, r"dx: expected shape \(2, 5\)", dict(dx=_ones(2, 4))),
        (ValueError, r"dgamma: expected shape \(5,\)", dict(dgamma=_ones(6))),
        (TypeError, "dbeta: expected dtype float32", dict(dbeta=_ones(5, dtype=np.float64))),
        (ValueError, "eps: expected a positive number", dict(eps=0.0)),
        (ValueError, "output 'dx' .* overlaps 'dy'", dict(dx=dy)),
        (ValueError, "output 'dgamma' .* overlaps 'gamma'", dict(dgamma=g)),
        (ValueError, "output 'dgamma' .* overlaps 'dbeta'", dict(dbeta=dg)),
    ]
    for error, message, change in cases:
        kw = {**ok, **change}
        args = [kw.pop(k) for k in ("x", "gamma", "dy", "dx", "dgamma", "dbeta")]
        with pytest.raises(error, match=message):
            L.layernorm_bwd(*args, **kw)
    for out in (dx, dg, db):
        np.testing.assert_array_equal(out.copy_to_host(), 0.0)   # nothing ran
    np.testing.assert_array_equal(dy.copy_to_host(), 1.0)


def test_same_bits_on_every_run_and_in_a_graph():
    """dgamma and dbeta add fixed partials in a fixed order (no atomics): a rerun, after a
    launch of another shape has written the same workspace, and a graph's replay (the
    workspace then in the graph's arena) give the same bits as the first run."""
    from proto.graph import capture
    R, C = (20, 48) if not FULL_SIZE else (1592, 768)
    rng = np.random.default_rng(2)
    x, dy, gamma = dev(rand(rng, R, C)), dev(rand(rng, R, C)), dev(rand(rng, C))
    dx, dg, db = (cuda.device_array(s, np.float32) for s in ((R, C), C, C))

    def step(x, dy):
        L.layernorm_bwd(x, gamma, dy, dx, dg, db)

    step(x, dy)
    first = [a.copy_to_host() for a in (dx, dg, db)]
    assert all(np.isfinite(a).all() for a in first)
    run(rand(rng, R + 7, C), rand(rng, C), rand(rng, R + 7, C))
    step(x, dy)
    assert all(np.array_equal(a.copy_to_host(), f) for a, f in zip((dx, dg, db), first))
    for a in (dx, dg, db):
        a.copy_to_device(np.zeros(a.shape, np.float32))
    with capture(step, {"x": x, "dy": dy}, binding="alias") as graph:
        graph.replay(x=x, dy=dy)
        assert all(np.array_equal(a.copy_to_host(), f) for a, f in zip((dx, dg, db), first))
