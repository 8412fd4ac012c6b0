"""groupnorm and groupnorm_bwd against their float64 references (the backward's checked by
finite differences of the forward's) and torch.autograd: groups of one channel (Wav2Vec2's)
and of several, in place, groups with a large mean, dgamma / dbeta left out, validation
before any launch, and the same bits on every run and in a graph."""
import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import groupnorm as GN
from proto.device.backend import cuda
from tests.helpers import FULL_SIZE, central_differences, dev, rand

U = 2.0 ** -24    # float32's unit roundoff
TINY = 1e-12


def bounds(x, gamma, beta, dy, groups):
    """First-order float32 error bounds of (out, dx, dgamma, dbeta), float64 arrays, as
    tests/test_layernorm_bwd's over each group's n = C/G * T values. A float32 sum of k
    terms, in any order, errs by at most k U times the sum of their magnitudes, so the
    statistics leave xh within E (1 + |xh|), E = 4 n U (max|x| rstd + 1) over the group.
    out = (x - mean) (gamma rstd) + beta: |gamma| times that, and a few roundings of its
    terms. dx = rstd (g - m1 - xh m2), g = dy gamma: m1, m2 (sums over the group of the
    channels' sums), xh and rstd each err by at most E (|g| + (1 + |xh|) A), A = the
    group's mean of |g| (1 + |xh|). dgamma, dbeta: sums of B T terms, B T U of their
    magnitudes plus each term's own error, doubled for the product roundings."""
    x, gamma, beta, dy = (np.asarray(a, np.float64) for a in (x, gamma, beta, dy))
    B, C, T = x.shape

    gcol = gamma[:, None]
    xg = x.reshape(B, groups, -1)
    mean = xg.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((xg - mean) ** 2).mean(axis=-1, keepdims=True) + 1e-5)
    xh = ((xg - mean) * rstd).reshape(B, C, T)
    n = xg.shape[-1]
    E = _bcast(4 * n * U * (np.abs(xg).max(axis=-1, keepdims=True) * rstd + 1), B, C, T, groups)
    rstd = _bcast(rstd, B, C, T, groups)
    axh = np.abs(xh)
    out = np.abs(gcol) * E * (1 + axh) + 3 * U * (np.abs(gcol * xh) + np.abs(beta[:, None]))
    g = np.abs(dy * gcol)
    A = _bcast((g * (1 + axh)).reshape(B, groups, -1).mean(axis=-1, keepdims=True), B, C, T, groups)
    dx = 4 * rstd * E * (g + (1 + axh) * A)
    ady = np.abs(dy)
    m = B * T
    dgamma = 2 * (m * U * (ady * axh).sum(axis=(0, 2)) + (ady * E * (1 + axh)).sum(axis=(0, 2)))
    dbeta = 2 * m * U * ady.sum(axis=(0, 2))
    return out + TINY, dx + TINY, dgamma + TINY, dbeta + TINY


def _bcast(per_group, B, C, T, groups):
    """A (B, groups, 1) array spread over each group's channels and steps: (B, C, T)."""
    return np.broadcast_to(per_group, (B, groups, C // groups * T)).reshape(B, C, T)


def assert_within(got, want, bound, name):
    got = got.copy_to_host() if hasattr(got, "copy_to_host") else got
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), f"{name}: error exceeds its bound by {float(np.max(err - bound))}"


def forward(x, gamma, beta, groups, in_place=False):
    out = dev(x) if in_place else dev(np.full(x.shape, np.nan, np.float32))
    GN.groupnorm(out if in_place else dev(x), dev(gamma), dev(beta), out, groups=groups)
    return out


def backward(x, gamma, dy, groups, params=True):
    """dx, dgamma, dbeta (NaN-filled first: overwritten, not accumulated into)."""
    dx = dev(np.full(x.shape, np.nan, np.float32))
    dg, db = (dev(np.full(x.shape[1], np.nan, np.float32)) if params else None for _ in range(2))
    GN.groupnorm_bwd(dev(x), dev(gamma), dev(dy), dx, dg, db, groups=groups)
    return dx, dg, db


def arrays(rng, B, C, T, offset=0.0):
    x = rand(rng, B, C, T) + np.float32(offset)
    return x, rand(rng, C), rand(rng, C), rand(rng, B, C, T)


@given(B=st.integers(1, 3), groups=st.integers(1, 4), per_group=st.integers(1, 3),
       T=st.integers(1, 40), in_place=st.booleans(), params=st.booleans(),
       seed=st.integers(0, 2**16))
def test_matches_reference(B, groups, per_group, T, in_place, params, seed, scale):
    rng = np.random.default_rng(seed)
    C, T = groups * per_group, T * scale
    x, gamma, beta, dy = arrays(rng, B, C, T)
    bound = bounds(x, gamma, beta, dy, groups)
    assert_within(forward(x, gamma, beta, groups, in_place),
                  GN.groupnorm_ref(x, gamma, beta, groups=groups), bound[0], "out")
    got = backward(x, gamma, dy, groups, params)
    want = GN.groupnorm_bwd_ref(x, gamma, dy, groups=groups)
    checked = zip(got, want, bound[1:], ("dx", "dgamma", "dbeta"))
    for g, w, b, name in list(checked)[:3 if params else 1]:
        assert_within(g, w, b, name)


@pytest.mark.parametrize("groups", [1, 3, 6])
def test_groups_with_a_large_mean(groups):
    """Groups with a mean of 1000, steps past a block's threads. float32 x keeps about 3
    digits of its unit spread there (ulp 6e-5), and the mean's sum of up to 222 such values
    adds a few ulp more: xh is off by ~1e-4 (the worst-case bounds above, linear in n and
    |x|, allow 0.05), hence atol 2e-3 on out and dx, and 1e-2 on dgamma, a sum of B T = 74
    such terms. A one-pass E[x^2] - mean^2 variance is off by O(1) here."""
    rng = np.random.default_rng(groups)
    x, gamma, beta, dy = arrays(rng, 2, 6, 37, offset=1000.0)
    tol = dict(rtol=1e-4, atol=2e-3)
    np.testing.assert_allclose(forward(x, gamma, beta, groups).copy_to_host(),
                               GN.groupnorm_ref(x, gamma, beta, groups=groups), **tol)
    dx, dg, db = backward(x, gamma, dy, groups)
    want = GN.groupnorm_bwd_ref(x, gamma, dy, groups=groups)
    np.testing.assert_allclose(dx.copy_to_host(), want[0], **tol)
    np.testing.assert_allclose(dg.copy_to_host(), want[1], rtol=1e-4, atol=1e-2)
    assert_within(db, want[2], bounds(x, gamma, beta, dy, groups)[3], "dbeta")   # (no xh in it)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_reference_matches_finite_differences(groups):
    """L = sum(w * groupnorm_ref(x, gamma, beta)), all float64: central differences of step
    h = 1e-5 err by h^2 / 6 times a third derivative (< 1e-9 here) plus 1e-16 |L| / h of
    rounding (< 1e-10). Hence atol 1e-7; a wrong formula is off by O(1). One channel is
    constant (with groups of one channel, eps alone sets its rstd)."""
    rng = np.random.default_rng(groups)
    x = rng.standard_normal((2, 4, 3))
    x[1, 2] = 0.5
    gamma, beta, w = rng.standard_normal(4), rng.standard_normal(4), rng.standard_normal(x.shape)
    h, eps = 1e-5, 1e-1   # (a larger eps keeps the constant channel's rstd small)

    def loss(x_, g_, b_):
        return float((w * GN.groupnorm_ref(x_, g_, b_, groups=groups, eps=eps)).sum())

    def numeric(which):
        return central_differences(loss, [x, gamma, beta], which, h)

    dx, dgamma, dbeta = GN.groupnorm_bwd_ref(x, gamma, w, groups=groups, eps=eps)
    for got, which in ((dx, 0), (dgamma, 1), (dbeta, 2)):
        np.testing.assert_allclose(got, numeric(which), atol=1e-7, rtol=0)


def test_matches_torch():
    """torch.nn.GroupNorm in float64 and its autograd as the truth (its own error ~1e-16);
    ours within the float32 bounds above. Tiny on the simulator; on a GPU Wav2Vec2-base's
    feature encoder: 8 clips' first convolution output, 512 channels of 12735 steps, a
    group a channel, and 32 groups of 16 channels."""
    torch = pytest.importorskip("torch")
    cases = [((2, 6, 9), 3), ((2, 4, 7), 4)] if not FULL_SIZE else \
        [((8, 512, 12735), 512), ((8, 512, 400), 32)]
    rng = np.random.default_rng(13)
    for (B, C, T), groups in cases:
        x, gamma, beta, dy = arrays(rng, B, C, T)
        module = torch.nn.GroupNorm(groups, C, eps=1e-5).double()
        with torch.no_grad():
            module.weight.copy_(torch.tensor(gamma))
            module.bias.copy_(torch.tensor(beta))
        tx = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        ty = module(tx)
        ty.backward(torch.tensor(dy, dtype=torch.float64))
        bound = bounds(x, gamma, beta, dy, groups)
        where = f"at {(B, C, T)}, {groups} groups"
        assert_within(forward(x, gamma, beta, groups), ty.detach().numpy(), bound[0],
                      f"out {where}")
        want = (tx.grad, module.weight.grad, module.bias.grad)
        for g, w, b, name in zip(backward(x, gamma, dy, groups), want, bound[1:],
                                 ("dx", "dgamma", "dbeta")):
            assert_within(g, w.numpy(), b, f"{name} {where}")


def _ones(*shape, dtype=np.float32):
    return dev(np.ones(shape, dtype))


def _call(fn, names, ok, change):
    kw = {**ok, **change}
    fn(*[kw.pop(k) for k in names], **kw)


def test_rejects_bad_input_before_launch():
    x, dy, g = _ones(2, 4, 3), _ones(2, 4, 3), _ones(4)
    out, dx, dg, db = (dev(np.zeros(s, np.float32)) for s in ((2, 4, 3), (2, 4, 3), 4, 4))
    shared = dev(np.zeros(25, np.float32))
    fwd = dict(x=x, gamma=g, beta=g, out=out, groups=2)
    for error, message, change in [
        (TypeError, "x: expected a device array", dict(x=np.ones((2, 4, 3), np.float32))),
        (ValueError, "x: expected 3 dimensions", dict(x=_ones(2, 4))),
        (ValueError, "groups: expected a divisor of x's 4 channels, got 3", dict(groups=3)),
        (ValueError, "groups: expected a positive integer", dict(groups=0)),
        (ValueError, "groups: expected a positive integer", dict(groups=True)),
        (ValueError, r"gamma: expected shape \(4,\)", dict(gamma=_ones(3))),
        (TypeError, "beta: expected dtype float32", dict(beta=_ones(4, dtype=np.float64))),
        (ValueError, r"out: expected shape \(2, 4, 3\)", dict(out=_ones(2, 3, 4))),
        (ValueError, "eps: expected a positive number", dict(eps=-1e-5)),
        (ValueError, "output 'out' .* overlaps argument 'x'",   # one element apart
         dict(x=shared[:24].reshape(2, 4, 3), out=shared[1:].reshape(2, 4, 3))),
    ]:
        with pytest.raises(error, match=message):
            _call(GN.groupnorm, ("x", "gamma", "beta", "out"), fwd, change)
    bwd = dict(x=x, gamma=g, dy=dy, dx=dx, dgamma=dg, dbeta=db, groups=2)
    for error, message, change in [
        (ValueError, r"dy: expected shape \(2, 4, 3\)", dict(dy=_ones(2, 4, 2))),
        (ValueError, r"dx: expected shape \(2, 4, 3\)", dict(dx=_ones(1, 4, 3))),
        (ValueError, r"dgamma: expected shape \(4,\)", dict(dgamma=_ones(2))),
        (TypeError, "dbeta: expected a device array", dict(dbeta=np.zeros(4, np.float32))),
        (ValueError, "groups: expected a divisor", dict(groups=8)),
        (ValueError, "output 'dx' .* overlaps 'x'", dict(dx=x)),
        (ValueError, "output 'dbeta' .* overlaps 'gamma'", dict(dbeta=g)),
        (ValueError, "output 'dgamma' .* overlaps 'dbeta'", dict(dgamma=db)),
    ]:
        with pytest.raises(error, match=message):
            _call(GN.groupnorm_bwd, ("x", "gamma", "dy", "dx", "dgamma", "dbeta"), bwd, change)
    for arr in (out, dx, dg, db, shared):
        np.testing.assert_array_equal(arr.copy_to_host(), 0.0)   # nothing ran


def test_same_bits_on_every_run_and_in_a_graph():
    """dgamma and dbeta add fixed partials in a fixed order (no atomics): a rerun, after a
    launch of another shape has written the same workspace, and a graph's replay (the
    workspace then in the graph's arena) give the same bits as the first run."""
    from proto.graph import capture
    (B, C, T), groups = ((3, 4, 10), 4) if not FULL_SIZE else ((8, 512, 12735), 512)
    rng = np.random.default_rng(4)
    x, gamma, beta, dy = (dev(a) for a in arrays(rng, B, C, T))
    out, dx = cuda.device_array((B, C, T), np.float32), cuda.device_array((B, C, T), np.float32)
    dg, db = cuda.device_array(C, np.float32), cuda.device_array(C, np.float32)

    def step(x, dy):
        GN.groupnorm(x, gamma, beta, out, groups=groups)
        GN.groupnorm_bwd(x, gamma, dy, dx, dg, db, groups=groups)

    step(x, dy)
    first = [a.copy_to_host() for a in (out, dx, dg, db)]
    assert all(np.isfinite(a).all() for a in first)
    x2, gamma2, _, dy2 = arrays(rng, B + 1, C, T)
    backward(x2, gamma2, dy2, groups)
    step(x, dy)
    assert all(np.array_equal(a.copy_to_host(), f) for a, f in zip((out, dx, dg, db), first))
    for a in (out, dx, dg, db):
        a.copy_to_device(np.zeros(a.shape, np.float32))
    with capture(step, {"x": x, "dy": dy}, binding="alias") as graph:
        graph.replay(x=x, dy=dy)
        assert all(np.array_equal(a.copy_to_host(), f) for a, f in zip((out, dx, dg, db), first))
