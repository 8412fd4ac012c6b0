import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import seq_attention as SA
from proto.device.backend import cuda
from tests.helpers import FULL_SIZE, assert_close, dev, rand


def _case(rng, B, T, H, hd, lengths=None):
    """q, k, v, dout (B, T, H*hd) float32 and lengths int32 in [1, T], one of them T."""
    q, k, v, dout = (rand(rng, B, T, H * hd) for _ in range(4))
    if lengths is None:
        lengths = rng.integers(1, T + 1, B)
        lengths[rng.integers(B)] = T
    return q, k, v, dout, np.asarray(lengths, np.int32)


def _forward(q, k, v, lengths, H, scale):
    """The kernels' out and probs, q, k and v passed side by side (B, T, 3C)."""
    B, T, C = q.shape
    out = cuda.device_array((B, T, C), np.float32)
    probs = cuda.device_array((B, H, T, T), np.float32)
    SA.seq_attention(dev(np.concatenate([q, k, v], -1)), dev(lengths), out, probs, heads=H,
                     scale=scale)
    return out.copy_to_host(), probs.copy_to_host()


def _backward(q, k, v, probs, dout, H, scale):
    """The kernels' dq, dk, dv (split from their side-by-side dqkv)."""
    B, T, C = q.shape
    dqkv = cuda.device_array((B, T, 3 * C), np.float32)
    SA.seq_attention_bwd(dev(np.concatenate([q, k, v], -1)), dev(probs), dev(dout), dqkv,
                         heads=H, scale=scale)
    return np.split(dqkv.copy_to_host(), 3, axis=-1)


shapes = dict(B=st.integers(1, 3), T=st.integers(1, 12), H=st.integers(1, 3),
              hd=st.integers(1, 8), seed=st.integers(0, 2**16))


@given(**shapes, scale_kind=st.sampled_from(["hf", "one"]))
def test_forward_matches_reference(B, T, H, hd, seed, scale_kind, scale):
    T = T * scale   # (the shape scale: longer sequences on a GPU)
    rng = np.random.default_rng(seed)
    q, k, v, _, lengths = _case(rng, B, T, H, hd)
    s = hd ** -0.5 if scale_kind == "hf" else 1.0
    out, probs = _forward(q, k, v, lengths, H, s)
    want_out, want_p = SA.seq_attention_ref(q, k, v, lengths, H, s)
    assert_close(probs, want_p, "softmax")
    assert_close(out, want_out, "gemm")


@given(**shapes)
def test_backward_matches_reference(B, T, H, hd, seed, scale):
    T = T * scale
    rng = np.random.default_rng(seed)
    q, k, v, dout, lengths = _case(rng, B, T, H, hd)
    s = hd ** -0.5
    probs = SA.seq_attention_ref(q, k, v, lengths, H, s)[1].astype(np.float32)
    got = _backward(q, k, v, probs, dout, H, s)
    for g, want in zip(got, SA.seq_attention_bwd_ref(q, k, v, probs, dout, H, s)):
        assert_close(g, want, "grad")


def test_backward_reference_matches_finite_differences():
    """The backward reference against central differences of the forward reference (all
    float64): d/dx sum(out * G) for every element of q, k and v, with a masked key."""
    rng = np.random.default_rng(0)
    B, T, H, hd, s = 2, 4, 2, 3, 0.7
    q, k, v, G, lengths = (x.astype(np.float64) for x in _case(rng, B, T, H, hd, [3, 4]))
    probs = SA.seq_attention_ref(q, k, v, lengths, H, s)[1]
    grads = SA.seq_attention_bwd_ref(q, k, v, probs, G, H, s)
    h = 1e-6
    for which, grad in enumerate(grads):
        fd = np.zeros_like(grad)
        for idx in np.ndindex(*grad.shape):
            args = [q, k, v]
            up, down = (a.copy() for a in (args[which], args[which]))
            up[idx] += h
            down[idx] -= h
            f = []
            for x in (up, down):
                args[which] = x
                f.append((SA.seq_attention_ref(*args, lengths, H, s)[0] * G).sum())
            fd[idx] = (f[0] - f[1]) / (2 * h)
        np.testing.assert_allclose(grad, fd, atol=1e-8, rtol=1e-6)
    assert np.all(grads[1][0, 3:] == 0) and np.all(grads[2][0, 3:] == 0)   # the masked key


def test_masked_keys_get_exactly_zero_probability_and_gradient(scale):
    """Keys past a sample's length: probability exactly 0, dk and dv exactly 0, and their
    values change nothing (any finite k, v there); padded query rows are still computed."""
    rng = np.random.default_rng(1)
    B, T, H, hd = 3, 7 * scale, 2, 4
    lengths = [2, T, 5 * scale]
    q, k, v, dout, lengths = _case(rng, B, T, H, hd, lengths)
    out, probs = _forward(q, k, v, lengths, H, 0.5)
    k2, v2 = k.copy(), v.copy()
    for b, L in enumerate(lengths):
        assert np.all(probs[b, :, :, L:] == 0)
        assert np.all(probs[b, :, :, :L] > 0)
        k2[b, L:] = 1e3 * rng.standard_normal(k2[b, L:].shape)
        v2[b, L:] = -7.0
    out2, probs2 = _forward(q, k2, v2, lengths, H, 0.5)
    np.testing.assert_array_equal(probs2, probs)
    np.testing.assert_array_equal(out2, out)
    assert np.isfinite(out).all()
    assert_close(out, SA.seq_attention_ref(q, k, v, lengths, H, 0.5)[0], "gemm")
    dq, dk, dv = _backward(q, k, v, probs, dout, H, 0.5)
    for b, L in enumerate(lengths):
        assert np.all(dk[b, L:] == 0) and np.all(dv[b, L:] == 0)
    assert np.isfinite(dq).all() and np.abs(dq[0, 2:]).min() > 0   # padded queries have grads


def test_a_length_outside_1_to_T_makes_only_its_sample_nan():
    rng = np.random.default_rng(2)
    B, T, H, hd = 7, 5, 2, 3
    q, k, v, dout, _ = _case(rng, B, T, H, hd)
    lengths = np.int32([3, 0, T, T + 1, -3, 2**31 - 1, 1])
    bad, good = [1, 3, 4, 5], [0, 2, 6]
    out, probs = _forward(q, k, v, lengths, H, 0.6)
    want_out, want_p = SA.seq_attention_ref(q, k, v, lengths, H, 0.6)
    for x in (out, probs, want_out, want_p):
        assert np.isnan(x[bad]).all()
    assert_close(out[good], want_out[good], "gemm")
    assert_close(probs[good], want_p[good], "softmax")
    for g in _backward(q, k, v, probs, dout, H, 0.6):
        assert np.isnan(g[bad]).all() and np.isfinite(g[good]).all()


def test_runs_are_bit_identical():
    """No atomics anywhere: two runs of forward and backward give the same bits."""
    rng = np.random.default_rng(3)
    q, k, v, dout, lengths = _case(rng, 2, 9, 2, 4)
    first = _forward(q, k, v, lengths, 2, 0.5)
    second = _forward(q, k, v, lengths, 2, 0.5)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))
    g1 = _backward(q, k, v, first[1], dout, 2, 0.5)
    g2 = _backward(q, k, v, first[1], dout, 2, 0.5)
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


def test_a_captured_forward_and_backward_replay_the_eager_bits():
    """In a graph the head-major copies and dP are planned temporaries: a replay on new
    inputs gives what eager calls give."""
    from proto import graph
    rng = np.random.default_rng(4)
    B, T, H, hd = 2, 6, 2, 3
    q, k, v, dout, lengths = _case(rng, B, T, H, hd, [4, 6])
    ins = {n: dev(x) for n, x in zip(("qkv", "dout", "lengths"),
                                     (np.concatenate([q, k, v], -1), dout, lengths))}
    out = cuda.device_array(q.shape, np.float32)
    probs = cuda.device_array((B, H, T, T), np.float32)
    dqkv = cuda.device_array((B, T, 3 * H * hd), np.float32)

    def step(qkv, dout, lengths):
        SA.seq_attention(qkv, lengths, out, probs, heads=H, scale=0.5)
        SA.seq_attention_bwd(qkv, probs, dout, dqkv, heads=H, scale=0.5)

    g = graph.capture(step, ins, binding="alias")
    q2, k2, v2, dout2, lengths2 = _case(rng, B, T, H, hd, [6, 1])
    for n, x in zip(("qkv", "dout", "lengths"),
                    (np.concatenate([q2, k2, v2], -1), dout2, lengths2)):
        ins[n].copy_to_device(x)
    g.replay(**ins)
    want_out, want_p = _forward(q2, k2, v2, lengths2, H, 0.5)
    want_g = np.concatenate(_backward(q2, k2, v2, want_p, dout2, H, 0.5), -1)
    for got, want in zip([out, probs, dqkv], [want_out, want_p, want_g]):
        np.testing.assert_array_equal(got.copy_to_host().view(np.uint32), want.view(np.uint32))
    g.close()


def test_rejects_bad_input_before_any_launch(monkeypatch):
    from kernels import gemm as gemm_module
    launched = []
    monkeypatch.setattr(SA, "launch", lambda *a, **kw: launched.append(a))
    monkeypatch.setattr(gemm_module, "launch", lambda *a, **kw: launched.append(a))
    B, T, H, hd = 2, 3, 2, 2
    x = lambda *shape: dev(np.zeros(shape, np.float32))   # noqa: E731
    qkv, dqkv = x(B, T, 3 * H * hd), x(B, T, 3 * H * hd)
    out, dout = x(B, T, H * hd), x(B, T, H * hd)
    probs, lengths = x(B, H, T, T), dev(np.full(B, T, np.int32))

    def fwd(**kw):
        a = dict(qkv=qkv, lengths=lengths, out=out, probs=probs)
        a.update(kw)
        heads, scale = a.pop("heads", H), a.pop("scale", 0.5)
        SA.seq_attention(*a.values(), heads=heads, scale=scale)

    def bwd(**kw):
        a = dict(qkv=qkv, probs=probs, dout=dout, dqkv=dqkv)
        a.update(kw)
        heads, scale = a.pop("heads", H), a.pop("scale", 0.5)
        SA.seq_attention_bwd(*a.values(), heads=heads, scale=scale)

    cases = [
        (fwd, dict(qkv=np.zeros((B, T, 3 * H * hd), np.float32)), TypeError,
         "qkv: expected a device array"),
        (fwd, dict(qkv=dev(np.zeros((B, T, 3 * H * hd), np.float64))), TypeError,
         "qkv: expected dtype float32"),
        (fwd, dict(qkv=x(B, T, H * hd)), ValueError,
         "qkv: features 4 are not 3 x a multiple of heads 2"),
        (fwd, dict(heads=5), ValueError, "qkv: features 12 are not 3 x a multiple of heads 5"),
        (fwd, dict(heads=0), ValueError, "heads: expected a positive integer"),
        (fwd, dict(heads=True), ValueError, "heads: expected a positive integer"),
        (fwd, dict(scale=float("nan")), ValueError, "scale: expected a finite number"),
        (fwd, dict(scale="0.5"), ValueError, "scale: expected a finite number"),
        (fwd, dict(lengths=dev(np.full(B, T, np.int64))), TypeError,
         "lengths: expected dtype int32"),
        (fwd, dict(lengths=dev(np.full(B + 1, T, np.int32))), ValueError,
         r"lengths: expected shape \(2,\)"),
        (fwd, dict(out=x(B, T, H * hd + 1)), ValueError, "out: expected shape"),
        (fwd, dict(probs=x(B, H, T, T + 1)), ValueError, r"probs: expected shape \(2, 2, 3, 3\)"),
        (fwd, dict(out=qkv.reshape(qkv.size)[:out.size].reshape(out.shape)), ValueError,
         "output 'out' .* overlaps 'qkv'"),
        (fwd, dict(probs=lengths.reshape(1, 1, 1, B)), TypeError, "probs: expected dtype"),
        (bwd, dict(dout=x(B, T, H * hd - 1)), ValueError, "dout: expected shape"),
        (bwd, dict(probs=x(B, H + 1, T, T)), ValueError, "probs: expected shape"),
        (bwd, dict(dqkv=x(B, T, H * hd)), ValueError, r"dqkv: expected shape \(2, 3, 12\)"),
        (bwd, dict(dqkv=qkv), ValueError, "output 'dqkv' .* overlaps 'qkv'"),
        (bwd, dict(heads=-1), ValueError, "heads: expected a positive integer"),
        (bwd, dict(scale=float("inf")), ValueError, "scale: expected a finite number"),
    ]
    for call, kw, error, message in cases:
        with pytest.raises(error, match=message):
            call(**kw)
    assert launched == []
    fwd()   # (the spies see a good call's launches)
    assert len(launched) >= 3


def _torch_attention(torch, q, k, v, lengths, H, scale):
    """Hugging Face's eager attention (Wav2Vec2Attention), in float64: scores scaled, the
    padding mask added as float32's finfo.min, softmax, times v."""
    B, T, C = q.shape
    heads = [t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v)]
    keep = torch.arange(T)[None, :] < torch.as_tensor(lengths, dtype=torch.int64)[:, None]
    mask = torch.where(keep, 0.0, float(np.finfo(np.float32).min)).to(q.dtype)
    w = torch.matmul(heads[0], heads[1].transpose(2, 3)) * scale + mask[:, None, None, :]
    p = torch.softmax(w, dim=-1)
    return torch.matmul(p, heads[2]).transpose(1, 2).reshape(B, T, C), p


def _error_bounds(q, k, v, dout, p, H, scale):
    """First-order bounds on the float32 kernels' error against exact arithmetic, propagated
    through each step in the standard model (u = 2^-24; a sum of n products is within
    gamma_n = n u of its value times the sum of the products' magnitudes, whatever the
    order; an error dx in an operand adds |dx| |y|), computed in float64 from the data:

      S  = scale Q K^T          eS  = (hd + 2) u scale |Q||K|^T   (+ the scale product)
      P  = softmax(S)           eP  = P (eS + P eS + (T + 6) u)   (the shift by the max,
                                      exp (2 ulp), the sum of T, the division: T + 6 u
                                      relative; a score error dS moves P_j by P_j (dS_j -
                                      sum_k P_k dS_k))
      O  = P V                  eO  = T u |P||V| + eP |V|
      dP = dO V^T               edP = hd u |dO||V|^T
      r  = rowsum(dP P)         er  = T u |dP||P| + edP P + |dP| eP
      dS = scale P (dP - r)     edS = scale (eP |dP - r| + P (edP + er)) + 3 u |dS|
      dQ, dK, dV                T u |dS||K| + edS |K|, ... and T u |P|^T|dO| + eP^T |dO|

    -> (eO, eP, edQ, edK, edV) in the layouts of out, probs, dq, dk, dv."""
    u = 2.0 ** -24
    qh, kh, vh, doh = (SA._heads64(x, H) for x in (q, k, v, dout))
    T, hd = qh.shape[2], qh.shape[3]
    aq, ak, av, ado, ap = (np.abs(x) for x in (qh, kh, vh, doh, p))
    tr = lambda x: x.swapaxes(-1, -2)   # noqa: E731
    eS = (hd + 2) * u * abs(scale) * (aq @ tr(ak))
    eP = p * (eS + (p * eS).sum(-1, keepdims=True) + (T + 6) * u)
    eO = T * u * ap @ av + eP @ av
    dp = doh @ tr(vh)
    edp = hd * u * ado @ tr(av)
    r = (dp * p).sum(-1, keepdims=True)
    er = (T * u * np.abs(dp) * ap + edp * ap + np.abs(dp) * eP).sum(-1, keepdims=True)
    ds = scale * p * (dp - r)
    eds = abs(scale) * (eP * np.abs(dp - r) + ap * (edp + er)) + 3 * u * np.abs(ds)
    ads = np.abs(ds)
    edq = abs(scale) * (T * u * ads @ ak + eds @ ak)
    edk = abs(scale) * (T * u * tr(ads) @ aq + tr(eds) @ aq)
    edv = T * u * tr(ap) @ ado + tr(eP) @ ado
    m = SA._merge64
    return m(eO), eP, m(edq), m(edk), m(edv)


def test_forward_and_backward_match_torch_autograd(scale):
    """Against Hugging Face's attention formulation under torch.autograd in float64: out,
    probs, and dq, dk, dv for a random dout. Tiny on the simulator; Wav2Vec2-base's layer
    (B 8, H 12, hd 64, lengths 65..199) on a GPU. Each value must lie within twice its
    first-order float32 error bound (`_error_bounds`), plus 1e-30 for exact zeros."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)
    if not FULL_SIZE:
        B, T, H, hd, lengths = 2, 7, 2, 4, [5, 7]
    else:
        B, T, H, hd = 8, 199, 12, 64
        lengths = np.linspace(65, 199, B).astype(np.int32)
    s = hd ** -0.5
    q, k, v, dout, lengths = _case(rng, B, T, H, hd, lengths)
    out, probs = _forward(q, k, v, lengths, H, s)
    dq, dk, dv = _backward(q, k, v, probs, dout, H, s)

    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    t_out, t_p = _torch_attention(torch, tq, tk, tv, lengths, H, s)
    t_out.backward(torch.tensor(dout, dtype=torch.float64))
    want_p = t_p.detach().numpy()
    bounds = _error_bounds(q, k, v, dout, want_p, H, s)
    got = (out, probs, dq, dk, dv)
    want = (t_out.detach().numpy(), want_p, tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy())
    for name, g, w, e in zip(("out", "probs", "dq", "dk", "dv"), got, want, bounds):
        err = np.abs(g - w)
        assert np.all(err <= 2 * e + 1e-30), \
            f"{name}: worst error / bound {np.max(err / (2 * e + 1e-30)):.3g}"
