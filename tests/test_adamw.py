"""AdamW with the step count on the device (kernels.adamw).

Tolerances, with u = 2^-24. One update against the float64 reference on the same float32
inputs: m and v are two products and a sum, within 3 u of |beta m| + |(1 - beta) g| (the
scalars 1 - beta are float32 roundings of float64 values, u relative each: 1 u more). The
parameter is p (1 - lr wd) - s r, s = lr / bc1 and r = m / (sqrt(v) / sqrt(bc2) + eps):
the decay product is within 2 u of |p|, and s r within 32 u of |s r| (bc1 and bc2 ~6 u
each, test_bias_corrections_against_float64 below; m, v 4 u; about eight roundings of
sqrt, divisions and sums).
"""
import math

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import adamw
from proto.device.backend import cuda
from tests.helpers import FULL_SIZE, dev, rand

U = 2.0 ** -24


def _state(rng, n):
    """param, grad, m, v of a run in progress: v >= 0, of the size of m^2."""
    p, g, m = rand(rng, n), rand(rng, n), rand(rng, n, scale=0.1)
    v = (rand(rng, n, scale=0.1) ** 2).astype(np.float32)
    return p, g, m, v


def _step_array(t: int):
    return dev(np.int32([t]))


def _update_bound(p, g, m, v, t, kw):
    """Per element: the bound of the module docstring on |param - reference|."""
    b1, b2, lr, wd, eps = kw["beta1"], kw["beta2"], kw["lr"], kw["weight_decay"], kw["eps"]
    _, m1, v1 = adamw.adamw_ref(p, g, m, v, t, **kw)
    s = lr / (1 - b1 ** t)
    sr = s * np.abs(m1) / (np.sqrt(v1) / math.sqrt(1 - b2 ** t) + eps)
    return 2 * U * np.abs(p) * (1 - lr * wd) + 32 * U * sr


def _moment_bounds(g, m, v, b1, b2):
    g, m, v = (a.astype(np.float64) for a in (g, m, v))
    return (4 * U * (b1 * np.abs(m) + (1 - b1) * np.abs(g)),
            4 * U * (b2 * v + (1 - b2) * g * g))


@given(n=st.integers(1, 200), seed=st.integers(0, 2**16),
       t=st.sampled_from([1, 2, 3, 10, 1000, 123456]),
       lr=st.sampled_from([1e-3, 5e-5, 0.1]), wd=st.sampled_from([0.0, 0.01, 0.1]),
       betas=st.sampled_from([(0.9, 0.999), (0.9, 0.98), (0.0, 0.5)]),
       eps=st.sampled_from([1e-8, 1e-6]))
def test_adamw_step_matches_reference(n, seed, t, lr, wd, betas, eps, scale):
    rng = np.random.default_rng(seed)
    p, g, m, v = _state(rng, n * scale)
    kw = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=wd)
    dp, dm, dv = dev(p), dev(m), dev(v)
    adamw.adamw_step(dp, dev(g), dm, dv, _step_array(t), **kw)
    want_p, want_m, want_v = adamw.adamw_ref(p, g, m, v, t, **kw)
    bm, bv = _moment_bounds(g, m, v, betas[0], betas[1])
    assert np.all(np.abs(dm.copy_to_host() - want_m) <= bm)
    assert np.all(np.abs(dv.copy_to_host() - want_v) <= bv)
    bound = _update_bound(p, g, m, v, t, kw)
    err = np.abs(dp.copy_to_host() - want_p)
    assert np.all(err <= bound), float(np.max(err / bound))


def test_bias_corrections_against_float64():
    """Isolate the corrections: p = m = v = 0, g = 1, lr = 1, no decay, eps = 0 make the new
    parameter -(1 - beta1) / bc1 * sqrt(bc2) / sqrt(1 - beta2) (m = 1 - beta1 and v = 1 - beta2
    exactly, their float32 values). Against torch's float64 bc1, bc2 the float32 ones on the
    device are within 2^-20 relative (measured: a few u), for t from 1 to 10^7: what makes
    the update differ from torch's by the corrections alone."""
    ts = np.int32([1, 2, 3, 5, 10, 100, 1000, 10_000, 100_000, 1_000_000, 10_000_000])
    for b1, b2 in ((0.9, 0.999), (0.9, 0.98), (0.5, 0.9999), (0.0, 0.99)):
        omb1, omb2 = np.float32(1 - b1), np.float32(1 - b2)
        for t in ts:
            p = dev(np.zeros(1, np.float32))
            adamw.adamw_step(p, dev(np.ones(1, np.float32)), dev(np.zeros(1, np.float32)),
                             dev(np.zeros(1, np.float32)), _step_array(t),
                             lr=1.0, beta1=b1, beta2=b2, eps=0.0, weight_decay=0.0)
            t64 = float(t)
            want = -(float(omb1) / (1 - b1 ** t64)) * math.sqrt(1 - b2 ** t64) / math.sqrt(float(omb2))
            got = float(p.copy_to_host()[0])
            assert abs(got - want) <= 2.0 ** -20 * abs(want), (b1, b2, t, got, want)


def test_advance_counts_on_the_device_and_step_zero_gives_nan():
    step = _step_array(0)
    rng = np.random.default_rng(3)
    p, g, m, v = _state(rng, 9)
    dp, dm, dv = dev(p), dev(m), dev(v)
    adamw.adamw_step(dp, dev(g), dm, dv, step, lr=1e-3)     # never advanced: t = 0
    assert np.isnan(dp.copy_to_host()).all()
    _, want_m, want_v = adamw.adamw_ref(p, g, m, v, 0, lr=1e-3)
    bm, bv = _moment_bounds(g, m, v, 0.9, 0.999)   # the moments are updated as ever
    assert np.all(np.abs(dm.copy_to_host() - want_m) <= bm)
    assert np.all(np.abs(dv.copy_to_host() - want_v) <= bv)
    for k in (1, 2, 3):
        adamw.adamw_advance(step)
        assert step.copy_to_host()[0] == k
    dp = dev(p)
    adamw.adamw_step(dp, dev(g), dev(m), dev(v), _step_array(-5), lr=1e-3)
    assert np.isnan(dp.copy_to_host()).all()


def _run_eager(p, grads, m, v, kw):
    dp, dm, dv, step = dev(p), dev(m), dev(v), _step_array(0)
    for g in grads:
        adamw.adamw_advance(step)
        adamw.adamw_step(dp, dev(g), dm, dv, step, **kw)
    return dp.copy_to_host(), dm.copy_to_host(), dv.copy_to_host()


def test_graph_replays_match_eager_steps_bit_for_bit():
    """The point of the device step count: one captured (advance, update) replayed three
    times is three optimizer steps, t = 1, 2, 3, the same bits as eager steps."""
    from proto.graph import capture
    rng = np.random.default_rng(5)
    p, _, m, v = _state(rng, 50)
    grads = [rand(rng, 50) for _ in range(3)]
    kw = dict(lr=1e-2, weight_decay=0.01)
    want = _run_eager(p, grads, m, v, kw)
    dp, dm, dv, step = dev(p), dev(m), dev(v), _step_array(0)
    g_in = dev(grads[0])

    def opt_step(grad):
        adamw.adamw_advance(step)
        adamw.adamw_step(dp, grad, dm, dv, step, **kw)

    with capture(opt_step, {"grad": g_in}, binding="alias", warmup=0) as graph:
        for g in grads:
            g_in.copy_to_device(g)
            graph.replay(grad=g_in)
    assert step.copy_to_host()[0] == 3
    for got, ref in zip((dp, dm, dv), want):
        np.testing.assert_array_equal(got.copy_to_host(), ref)


def test_any_shape_updates_elementwise():
    rng = np.random.default_rng(2)
    p, g, m, v = (a.reshape(3, 4, 5) for a in _state(rng, 60))
    dp = dev(p)
    adamw.adamw_step(dp, dev(g), dev(m), dev(v), _step_array(2), lr=1e-3)
    want, _, _ = adamw.adamw_ref(p, g, m, v, 2, lr=1e-3)
    flat = _update_bound(p.ravel(), g.ravel(), m.ravel(), v.ravel(), 2,
                         dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01))
    assert np.all(np.abs(dp.copy_to_host() - want) <= flat.reshape(3, 4, 5))


def test_rejects_bad_input_before_launch():
    a, b, c, d = (dev(np.zeros(4, np.float32)) for _ in range(4))
    step = _step_array(1)
    with pytest.raises(TypeError, match="grad: expected a device array"):
        adamw.adamw_step(a, np.zeros(4, np.float32), c, d, step, lr=1e-3)
    with pytest.raises(ValueError, match=r"v: expected the shape of param \(4,\)"):
        adamw.adamw_step(a, b, c, dev(np.zeros(5, np.float32)), step, lr=1e-3)
    with pytest.raises(TypeError, match="step: expected dtype int32, got int64"):
        adamw.adamw_step(a, b, c, d, dev(np.ones(1, np.int64)), lr=1e-3)
    with pytest.raises(ValueError, match=r"step: expected shape \(1,\)"):
        adamw.adamw_step(a, b, c, d, dev(np.ones(2, np.int32)), lr=1e-3)
    with pytest.raises(TypeError, match="step: expected a device array"):
        adamw.adamw_advance(np.ones(1, np.int32))
    with pytest.raises(ValueError, match="beta2: expected a number in \\[0, 1\\), got 1.0"):
        adamw.adamw_step(a, b, c, d, step, lr=1e-3, beta2=1.0)
    with pytest.raises(ValueError, match="lr: expected a finite number"):
        adamw.adamw_step(a, b, c, d, step, lr=float("inf"))
    with pytest.raises(ValueError, match="eps: expected a number >= 0"):
        adamw.adamw_step(a, b, c, d, step, lr=1e-3, eps=-1e-8)
    with pytest.raises(ValueError, match="weight_decay: expected a finite number"):
        adamw.adamw_step(a, b, c, d, step, lr=1e-3, weight_decay="0.01")
    with pytest.raises(ValueError, match="output 'param'.*overlaps argument 'm'"):
        adamw.adamw_step(a, b, a, d, step, lr=1e-3)
    before = a.copy_to_host()
    with pytest.raises(ValueError, match="output 'v'.*overlaps argument 'grad'"):
        adamw.adamw_step(a, b, c, b, step, lr=1e-3)
    np.testing.assert_array_equal(a.copy_to_host(), before)   # nothing ran


def test_three_steps_match_torch_adamw():
    """torch.optim.AdamW (CPU, float32 tensors, float64 host bias corrections) against ours
    after each of 3 steps from zero moments. Each implementation is within the one-step
    bound of the float64 update of its own state; the states drift apart by those bounds
    step after step (and torch's m is a lerp, rounded differently), so after k steps
    |p - p_torch| <= k * 2 * (one-step bound), m and v likewise. Sizes: tiny on the simulator,
    all of Wav2Vec2-base's ~94.4 M parameters in one flat buffer on a GPU."""
    torch = pytest.importorskip("torch")
    n = 97 if not FULL_SIZE else 94_400_000
    rng = np.random.default_rng(11)
    p = rand(rng, n, scale=0.05)
    kw = dict(lr=5e-4, beta1=0.9, beta2=0.98, eps=1e-8, weight_decay=0.005)
    tp = torch.nn.Parameter(torch.tensor(p))
    opt = torch.optim.AdamW([tp], lr=kw["lr"], betas=(kw["beta1"], kw["beta2"]), eps=kw["eps"],
                            weight_decay=kw["weight_decay"], foreach=False)
    dp, dm, dv = dev(p), dev(np.zeros(n, np.float32)), dev(np.zeros(n, np.float32))
    step, dg = _step_array(0), cuda.device_array(n, np.float32)
    bp = bm = bv = 0.0
    for t in (1, 2, 3):
        g = rand(rng, n, scale=1e-2 * t)
        cur_p, cur_m, cur_v = dp.copy_to_host(), dm.copy_to_host(), dv.copy_to_host()
        bp = bp + 2 * _update_bound(cur_p, g, cur_m, cur_v, t, kw)
        mb, vb = _moment_bounds(g, cur_m, cur_v, kw["beta1"], kw["beta2"])
        bm, bv = bm + 2 * mb, bv + 2 * vb
        tp.grad = torch.tensor(g)
        opt.step()
        dg.copy_to_device(g)
        adamw.adamw_advance(step)
        adamw.adamw_step(dp, dg, dm, dv, step, **kw)
        state = opt.state[tp]
        for got, ref, bound, what in ((dp, tp.detach().numpy(), bp, "param"),
                                      (dm, state["exp_avg"].numpy(), bm, "m"),
                                      (dv, state["exp_avg_sq"].numpy(), bv, "v")):
            err = np.abs(got.copy_to_host().astype(np.float64) - ref)
            assert np.all(err <= bound), (t, what, float(np.max(err - bound)))
