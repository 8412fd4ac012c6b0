import itertools

import numpy as np
import pytest
from hypothesis import given, strategies as st

from kernels import ctc
from proto.device.backend import cuda
from tests.helpers import FULL_SIZE, dev, rand

U32 = 2.0 ** -24   # float32's unit roundoff


# ---------------------------------------------------------------------------- helpers
def _brute_nll(lp, labels, blank):
    """-log of the summed probability of every path of len(lp) frames over the classes that
    collapses (merge repeats, then drop blanks) to `labels`: inf if none does."""
    Tb, C = lp.shape
    total = 0.0
    for path in itertools.product(range(C), repeat=Tb):
        merged = [k for k, _ in itertools.groupby(path)]
        if [k for k in merged if k != blank] == list(labels):
            total += np.exp(sum(lp[t, k] for t, k in enumerate(path)))
    return -np.log(total) if total > 0 else np.inf


def _log_softmax(x):
    z = x - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def _labels(rng, n, C, blank, alphabet):
    """n labels of at most `alphabet` non-blank classes of C (few classes: many repeats)."""
    classes = [c for c in range(C) if c != blank][:alphabet]
    return rng.choice(classes, n).astype(np.int32)


def _batch(rng, B, T, C, S, blank, spread=1.0, alphabet=3):
    logits = rand(rng, B, T, C, scale=spread)
    input_lengths = rng.integers(1, T + 1, B).astype(np.int32)
    target_lengths = rng.integers(0, S + 1, B).astype(np.int32)
    targets = np.stack([_labels(rng, S, C, blank, alphabet) for _ in range(B)])
    return logits, input_lengths, targets, target_lengths


def _run(logits, input_lengths, targets, target_lengths, **kw):
    B, T, C = logits.shape
    losses, loss = cuda.device_array(B, np.float32), cuda.device_array(1, np.float32)
    dlogits = cuda.device_array((B, T, C), np.float32)
    ctc.ctc_loss(dev(logits), dev(input_lengths), dev(targets), dev(target_lengths), losses,
                 loss, dlogits, **kw)
    return losses.copy_to_host(), loss.copy_to_host()[0], dlogits.copy_to_host()


def _nll_error_bound(logits, input_lengths, losses64):
    """Per sample: a bound on the float32 kernel's error in the log domain. Each frame of the
    alpha (and beta) recursion adds a log-prob to a log-sum-exp, each rounded to within a few
    units of roundoff of the running magnitude, which is at most |nll| + the frame's largest
    |log-prob|; over T_b frames 4 u T_b (|nll| + max |lp| + 1). The backward pass and the
    occupancy exponent alpha + beta - lp + nll stay within 3 of those (the occupancy's
    relative error, so the gradient's absolute one, since occupancies are at most 1)."""
    lp = _log_softmax(logits.astype(np.float64))
    out = []
    for b, Tb in enumerate(np.clip(input_lengths, 1, lp.shape[1])):   # (bad ones: NaN)
        m = np.abs(lp[b, :Tb]).max() + 1.0
        nll = losses64[b] if np.isfinite(losses64[b]) else 0.0
        out.append(4 * U32 * Tb * (abs(nll) + m))
    return np.array(out)


def _assert_matches(got, want, logits, input_lengths, target_lengths, reduction):
    """The kernel's (losses, loss, dlogits) against the float64 reference's, within
    _nll_error_bound for the losses and three times it (scaled as the loss) for the gradient,
    plus float32 rounding of the softmax."""
    (losses, loss, d), (losses64, loss64, d64) = got, want
    delta = _nll_error_bound(logits, input_lengths, losses64)
    np.testing.assert_array_equal(np.isnan(losses), np.isnan(losses64))
    np.testing.assert_array_equal(np.isinf(losses), np.isinf(losses64))
    fin = np.isfinite(losses64)
    err = np.abs(losses[fin] - losses64[fin])
    assert np.all(err <= delta[fin] + 4 * U32 * np.abs(losses64[fin]))
    B = len(losses)
    scale = 1.0 / (np.maximum(target_lengths, 1) * B) if reduction == "mean" else np.ones(B)
    if np.isfinite(loss64):
        total = np.sum(scale * B * (delta + 4 * U32 * np.abs(losses64))) if reduction == "mean" \
            else np.sum(delta + 4 * U32 * np.abs(losses64))
        assert abs(loss - loss64) <= total + 4 * U32 * abs(loss64) * B
    else:
        assert np.isnan(loss64) and np.isnan(loss) or loss == loss64
    np.testing.assert_array_equal(np.isnan(d), np.isnan(d64))
    tol = (scale * (3 * delta + 8 * U32))[:, None, None] * np.ones_like(d64)
    ok = ~np.isnan(d64)
    assert np.all(np.abs(d[ok] - d64[ok]) <= tol[ok]), np.max(np.abs(d[ok] - d64[ok]) - tol[ok])


# ---------------------------------------------------------------------------- the reference
@given(Tb=st.integers(1, 5), C=st.integers(2, 3), L=st.integers(0, 3), seed=st.integers(0, 2**16),
       blank=st.integers(0, 2))
def test_reference_matches_brute_force_over_all_alignments(Tb, C, L, seed, blank):
    """Every path of C^T_b is enumerated and collapsed: the alpha/beta reference's likelihood
    is their sum (inf where no path fits, as when repeats need blanks between them)."""
    rng = np.random.default_rng(seed)
    blank = blank % C
    logits = rand(rng, 1, Tb, C, scale=2.0)
    targets = _labels(rng, max(L, 1), C, blank, C)[None]
    losses, _, _ = ctc.ctc_loss_ref(logits, np.int32([Tb]), targets, np.int32([L]), blank=blank,
                                    reduction="sum")
    want = _brute_nll(_log_softmax(logits[0].astype(np.float64)), targets[0, :L], blank)
    if np.isinf(want):
        assert losses[0] == np.inf
    else:
        np.testing.assert_allclose(losses[0], want, rtol=1e-12)


def test_reference_brute_force_on_a_repeat_that_needs_a_blank():
    """Labels (1, 1) fit 3 frames only as 1, blank, 1; 2 frames cannot hold them."""
    lp = _log_softmax(np.random.default_rng(1).standard_normal((3, 2)))
    logits = lp[None].astype(np.float32)
    want = -(lp[0, 1] + lp[1, 0] + lp[2, 1])
    for Tb, expect in ((3, want), (2, np.inf)):
        losses, _, _ = ctc.ctc_loss_ref(logits, np.int32([Tb]), np.int32([[1, 1]]), np.int32([2]))
        np.testing.assert_allclose(losses[0], expect, rtol=1e-6)
        np.testing.assert_allclose(_brute_nll(_log_softmax(logits[0, :Tb].astype(np.float64)),
                                              [1, 1], 0), expect, rtol=1e-6)


@pytest.mark.parametrize("reduction", ctc.REDUCTIONS)
def test_reference_gradient_matches_central_differences(reduction):
    """d loss / d logits of the reference against (f(x + h) - f(x - h)) / 2h in float64,
    including the frames past a sample's input length (zero gradient) and repeated labels."""
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((3, 5, 4))
    input_lengths, target_lengths = np.int32([5, 4, 5]), np.int32([2, 2, 0])
    targets = np.int32([[1, 1], [2, 3], [1, 2]])
    _, _, d = ctc.ctc_loss_ref(logits, input_lengths, targets, target_lengths, reduction=reduction)

    def f(x):
        return ctc.ctc_loss_ref(x, input_lengths, targets, target_lengths, reduction=reduction)[1]

    h, fd = 1e-6, np.zeros_like(logits)
    for i in np.ndindex(logits.shape):
        e = np.zeros_like(logits)
        e[i] = h
        fd[i] = (f(logits + e) - f(logits - e)) / (2 * h)
    np.testing.assert_allclose(d, fd, atol=1e-8)
    assert np.all(d[1, 4] == 0)


# ---------------------------------------------------------------------------- the kernel
@given(B=st.integers(1, 3), T=st.integers(1, 7), C=st.integers(2, 5), S=st.integers(1, 4),
       seed=st.integers(0, 2**16), blank=st.integers(0, 4),
       reduction=st.sampled_from(ctc.REDUCTIONS), zero_infinity=st.booleans(),
       spread=st.sampled_from([1.0, 8.0]))
def test_ctc_loss_matches_reference(B, T, C, S, seed, blank, reduction, zero_infinity, spread,
                                    scale):
    """Random lengths (target length 0 included; an input too short for its labels is
    impossible: inf, or 0 with zero_infinity), repeated labels, any blank class."""
    rng = np.random.default_rng(seed)
    T, S, C = T * scale, S * scale, C * scale
    args = _batch(rng, B, T, C, S, blank % C, spread, alphabet=2 + seed % 3)
    kw = dict(blank=blank % C, reduction=reduction, zero_infinity=zero_infinity)
    _assert_matches(_run(*args, **kw), ctc.ctc_loss_ref(*args, **kw), args[0], args[1], args[3],
                    reduction)


def test_ctc_loss_is_deterministic():
    rng = np.random.default_rng(5)
    args = _batch(rng, 3, 6, 4, 3, 0)
    first, second = _run(*args), _run(*args)
    for a, b in zip(first, second):
        assert np.array_equal(a, b, equal_nan=True)


def test_target_length_zero_is_all_blank():
    """No labels: the only alignment is blank at every frame."""
    logits = rand(np.random.default_rng(2), 1, 4, 3)
    losses, loss, d = _run(logits, np.int32([3]), np.int32([[2]]), np.int32([0]), blank=1)
    lp = _log_softmax(logits[0].astype(np.float64))
    np.testing.assert_allclose(losses[0], -lp[:3, 1].sum(), rtol=1e-6)
    np.testing.assert_allclose(loss, -lp[:3, 1].sum(), rtol=1e-6)   # mean: / max(0, 1) / 1
    want = np.exp(lp)
    want[:, 1] -= 1
    want[3] = 0
    np.testing.assert_allclose(d[0], want, atol=1e-6)


@pytest.mark.parametrize("zero_infinity", [False, True])
def test_impossible_alignment_follows_zero_infinity(zero_infinity):
    """Labels (1, 1, 2) need 4 frames (a blank between the 1s): in 3, torch's loss is inf and
    its gradient NaN over the sample's frames (0 past them); zero_infinity makes both 0. The
    other sample is untouched, and the mean is inf or finite accordingly."""
    rng = np.random.default_rng(4)
    logits = rand(rng, 2, 5, 3)
    args = (logits, np.int32([3, 5]), np.int32([[1, 1, 2], [1, 2, 1]]), np.int32([3, 2]))
    losses, loss, d = _run(*args, zero_infinity=zero_infinity)
    want = ctc.ctc_loss_ref(*args, zero_infinity=zero_infinity)
    if zero_infinity:
        assert losses[0] == 0 and np.all(d[0] == 0) and np.isfinite(loss)
    else:
        assert losses[0] == np.inf and loss == np.inf
        assert np.isnan(d[0, :3]).all() and np.all(d[0, 3:] == 0)
    _assert_matches((losses, loss, d), want, logits, args[1], args[3], "mean")


@pytest.mark.parametrize("what, value", [
    ("input_lengths", 0), ("input_lengths", -1), ("input_lengths", 7),
    ("target_lengths", -1), ("target_lengths", 4),
    ("label", -1), ("label", 5), ("label", 2**31 - 1), ("label", "blank")])
def test_bad_device_values_give_nan_for_their_sample(what, value):
    """Lengths and labels live on the device: out of range, the sample's loss and its whole
    gradient are NaN (and so the reduced loss), never an out-of-bounds read; the others are
    unharmed. A label past the target length is padding and never read."""
    rng = np.random.default_rng(6)
    B, T, C, S, blank = 3, 6, 5, 3, 2
    logits = rand(rng, B, T, C)
    input_lengths, target_lengths = np.int32([6, 5, 4]), np.int32([2, 3, 1])
    targets = np.int32([[1, 3, -7], [4, 4, 0], [3, 99, 2]])   # padding: -7, 99, 2
    if what == "input_lengths":
        input_lengths[1] = value
    elif what == "target_lengths":
        target_lengths[1] = value
    else:
        targets[1, 2] = blank if value == "blank" else value
    args = (logits, input_lengths, targets, target_lengths)
    got = _run(*args, blank=blank)
    losses, loss, d = got
    assert np.isnan(losses[1]) and np.isnan(loss) and np.isnan(d[1]).all()
    assert np.isfinite(losses[[0, 2]]).all() and not np.isnan(d[[0, 2]]).any()
    _assert_matches(got, ctc.ctc_loss_ref(*args, blank=blank), logits, input_lengths,
                    target_lengths, "mean")


def test_a_nan_logit_makes_its_sample_nan():
    logits = np.zeros((2, 4, 3), np.float32)
    logits[0, 2, 1] = np.nan
    args = (logits, np.int32([4, 4]), np.int32([[1, 2], [1, 2]]), np.int32([2, 2]))
    losses, loss, d = _run(*args)
    _, _, d64 = ctc.ctc_loss_ref(*args)
    assert np.isnan(losses[0]) and np.isnan(loss) and np.isfinite(losses[1])
    np.testing.assert_array_equal(np.isnan(d), np.isnan(d64))


def test_rejects_bad_input_before_launch(monkeypatch):
    launched = []
    monkeypatch.setattr(ctc, "launch", lambda *a, **k: launched.append(a))
    B, T, C, S = 2, 4, 3, 2
    logits, il = dev(np.zeros((B, T, C), np.float32)), dev(np.ones(B, np.int32))
    tg, tl = dev(np.ones((B, S), np.int32)), dev(np.ones(B, np.int32))
    losses, loss = dev(np.zeros(B, np.float32)), dev(np.zeros(1, np.float32))
    d = dev(np.zeros((B, T, C), np.float32))
    good = dict(logits=logits, input_lengths=il, targets=tg, target_lengths=tl, losses=losses,
                loss=loss, dlogits=d)

    def call(**change):
        kw = {**good, **{k: v for k, v in change.items() if k in good}}
        opts = {k: v for k, v in change.items() if k not in good}
        ctc.ctc_loss(*kw.values(), **opts)

    f32, i32 = (lambda *shape: dev(np.zeros(shape, np.float32))), \
        (lambda *shape: dev(np.ones(shape, np.int32)))
    cases = [
        (TypeError, "logits: expected a device array", dict(logits=np.zeros((B, T, C)))),
        (ValueError, "logits: expected 3 dimensions", dict(logits=f32(B, T))),
        (TypeError, "input_lengths: expected dtype int32",
         dict(input_lengths=dev(np.ones(B, np.int64)))),
        (ValueError, r"targets: expected shape \(2, .*got \(3, 2\)", dict(targets=i32(3, S))),
        (ValueError, "targets: at most 511 labels", dict(targets=i32(B, 512))),
        (ValueError, r"target_lengths: expected shape \(2,\)", dict(target_lengths=i32(3))),
        (ValueError, r"losses: expected shape \(2,\)", dict(losses=f32(3))),
        (ValueError, r"loss: expected shape \(1,\)", dict(loss=f32(2))),
        (ValueError, r"dlogits: expected shape \(2, 4, 3\)", dict(dlogits=f32(B, T, 4))),
        (ValueError, "blank: expected at most 2", dict(blank=3)),
        (ValueError, "blank: expected an integer", dict(blank=0.0)),
        (ValueError, "reduction: expected one of", dict(reduction="none")),
        (ValueError, "zero_infinity: expected True or False", dict(zero_infinity="no")),
        (ValueError, "output 'dlogits'.*overlaps 'logits'", dict(dlogits=logits)),
        (ValueError, r"output '(loss|losses)'.*overlaps", dict(loss=losses[:1])),
    ]
    for error, message, change in cases:
        with pytest.raises(error, match=message):
            call(**change)
    assert not launched
    call()
    assert len(launched) == 2


# ---------------------------------------------------------------------------- torch
def test_ctc_loss_matches_torch_autograd():
    """Hugging Face's Wav2Vec2ForCTC loss: log_softmax, transpose, torch's ctc_loss (mean,
    zero_infinity as its config's default False and True), against autograd's gradient wrt
    the logits, computed by torch in float64 on the same float32 logits. Tiny on the
    simulator; on a GPU wav2vec2-base's batch: 8 samples of 65..199 frames, 32 classes,
    up to 100 labels. Tolerances: _nll_error_bound (float32 log-space rounding)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    if not FULL_SIZE:
        B, T, C, S, lo = 3, 6, 4, 3, 1
    else:
        B, T, C, S, lo = 8, 199, 32, 100, 65
    logits = rand(rng, B, T, C, scale=2.0)
    input_lengths = rng.integers(lo, T + 1, B).astype(np.int32)
    input_lengths[0] = T
    target_lengths = np.minimum(rng.integers(0, S + 1, B), np.maximum(input_lengths // 2, 1))
    target_lengths = target_lengths.astype(np.int32)
    target_lengths[-1] = min(S, T)                # possibly impossible: zero_infinity decides
    input_lengths[-1] = max(1, min(input_lengths[-1], target_lengths[-1]))
    targets = np.stack([_labels(rng, S, C, 0, C) for _ in range(B)])
    for zero_infinity in (False, True):
        x = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
        lp = torch.nn.functional.log_softmax(x, -1).transpose(0, 1)
        ints = [torch.tensor(a, dtype=torch.long) for a in (targets, input_lengths, target_lengths)]
        want = torch.nn.functional.ctc_loss(lp, *ints, blank=0, reduction="mean",
                                            zero_infinity=zero_infinity)
        want.backward()
        per_sample = torch.nn.functional.ctc_loss(lp.detach(), *ints, blank=0, reduction="none",
                                                  zero_infinity=zero_infinity).numpy()
        got = _run(logits, input_lengths, targets, target_lengths, zero_infinity=zero_infinity)
        _assert_matches(got, (per_sample, want.item(), x.grad.numpy()), logits, input_lengths,
                        target_lengths, "mean")
