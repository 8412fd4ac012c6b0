"""CTC loss over raw logits, forward and gradient in one kernel (Hugging Face Wav2Vec2ForCTC's):

    log_probs = log_softmax(logits, -1)
    losses[b] = -log sum over the alignments of targets[b, :L_b] in T_b frames of prod_t p_t
    loss      = mean_b losses[b] / max(L_b, 1)      ("mean", torch's)   or   sum_b losses[b]
    dlogits   = d loss / d logits = scale_b * (softmax - occupancy)

torch.nn.functional.ctc_loss(log_probs.transpose(0, 1), targets, input_lengths,
target_lengths, blank, reduction, zero_infinity) with padded (B, S) targets. An alignment walks
the 2 L + 1 extended states (blank, l_1, blank, l_2, ..., blank): each frame it stays, steps
one state on, or skips a blank between two different labels. occupancy[t, c] is the share of
the likelihood whose alignments sit on a state of class c at frame t (it sums to 1 over c);
scale_b is 1 / (max(L_b, 1) B) for "mean", 1 for "sum". Frames t >= T_b get zero gradient.

One block a sample, one thread an extended state (so S <= MAX_LABELS), time sequential: the
log-space alpha recursion forward, then beta backward, each frame's row in shared memory
(two rows, one barrier a frame). Alpha goes to a workspace (B, T, 2 S + 1), where the
backward pass turns it, entry by entry, into the state occupancy exp(alpha + beta - lp + nll).
The gradient then sums each class's states along a chain that links a class's states in
state order (fixed order, no atomics: deterministic), for all frames at once. A second
one-thread launch reduces the losses in batch order.

Values read on the device cannot be refused before the launch: an input length outside
[1, T], a target length outside [0, S], or a label (within the target length) outside [0, C)
or equal to blank makes that sample's loss and its whole dlogits[b] NaN (so the reduced loss
too), and nothing is read out of bounds. An impossible alignment (too few frames for the
labels) gives loss inf and a NaN gradient over t < T_b, as torch; zero_infinity gives loss 0
and zero gradient instead.
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check
from kernels._reduce import converged_syncthreads
from proto.device.backend import SIMULATOR, cuda, empty, jit, launch

MAX_STATES = 1024                 # a thread a state, at most a block's threads
MAX_LABELS = (MAX_STATES - 1) // 2
REDUCTIONS = ("mean", "sum")
_NEG_INF = np.float32(-np.inf)
_INF = np.float32(np.inf)
_NAN = np.float32(np.nan)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


# ---------------------------------------------------------------------------- reference
def _ctc_nll64(lp: np.ndarray, labels: np.ndarray, blank: int):
    """-> (nll, occupancy (T_b, C)) of one valid sample: lp (T_b, C) float64 log-probs,
    labels (L,). Plain alpha/beta over the extended states in float64."""
    Tb, C = lp.shape
    ext = np.full(2 * len(labels) + 1, blank, np.int64)
    ext[1::2] = labels
    n = len(ext)
    skip = np.zeros(n, bool)
    skip[2:] = (ext[2:] != blank) & (ext[2:] != ext[:-2])
    e = lp[:, ext]                                     # (T_b, n): lp of each state's class
    alpha = np.full((Tb, n), -np.inf)
    beta = np.full((Tb, n), -np.inf)
    alpha[0, :2] = e[0, :2]
    beta[-1, -2:] = e[-1, -2:]
    pad = np.full(2, -np.inf)
    with np.errstate(invalid="ignore"):                    # (NaN logits)
        for t in range(1, Tb):
            a = np.concatenate([pad, alpha[t - 1]])        # a[s + 2] = alpha[t - 1, s]
            alpha[t] = e[t] + np.logaddexp(np.logaddexp(a[2:], a[1:-1]),
                                           np.where(skip, a[:-2], -np.inf))
        for t in range(Tb - 2, -1, -1):
            z = np.concatenate([beta[t + 1], pad])         # z[s] = beta[t + 1, s]
            from_skip = np.where(np.concatenate([skip, [False, False]])[2:], z[2:], -np.inf)
            beta[t] = e[t] + np.logaddexp(np.logaddexp(z[:-2], z[1:-1]), from_skip)
        nll = -np.logaddexp(alpha[-1, -1], alpha[-1, -2] if n > 1 else -np.inf)
    occ = np.zeros((Tb, C))
    if nll != np.inf:                                      # (a NaN logit: NaN throughout)
        state = np.exp(alpha + beta - e + nll)             # (T_b, n), sums to 1 a frame
        for s in range(n):
            occ[:, ext[s]] += state[:, s]
    return nll, occ


def ctc_loss_ref(logits, input_lengths, targets, target_lengths, blank=0, reduction="mean",
                 zero_infinity=False):
    """-> (losses (B,), loss (scalar), dlogits (B, T, C)), float64, by the module's contract
    (NaN for bad lengths or labels, inf or 0 for an impossible alignment)."""
    x = np.asarray(logits, np.float64)
    B, T, C = x.shape
    S = np.asarray(targets).shape[1]
    losses, dlogits = np.zeros(B), np.zeros((B, T, C))
    Ls = np.asarray(target_lengths, np.int64)
    for b in range(B):
        Tb, L = int(input_lengths[b]), int(Ls[b])
        labels = np.asarray(targets[b, :max(0, min(L, S))], np.int64)
        if not (1 <= Tb <= T and 0 <= L <= S) or ((labels < 0) | (labels >= C)
                                                  | (labels == blank)).any():
            losses[b], dlogits[b] = np.nan, np.nan
            continue
        z = x[b, :Tb]
        with np.errstate(invalid="ignore"):
            lp = z - z.max(1, keepdims=True)
            lp -= np.log(np.exp(lp).sum(1, keepdims=True))
        nll, occ = _ctc_nll64(lp, labels, blank)
        if nll == np.inf:
            losses[b] = 0.0 if zero_infinity else np.inf
            dlogits[b, :Tb] = 0.0 if zero_infinity else np.nan
            continue
        scale = 1.0 / (max(L, 1) * B) if reduction == "mean" else 1.0
        losses[b] = nll
        dlogits[b, :Tb] = scale * (np.exp(lp) - occ)
    loss = (losses / np.maximum(Ls, 1)).mean() if reduction == "mean" else losses.sum()
    return losses, loss, dlogits


# ---------------------------------------------------------------------------- kernels
@cuda.jit(device=True)
def _logaddexp3(a, b, c):
    """log(e^a + e^b + e^c) in float32, shifted by the largest: -inf when all three are,
    NaN when any is (comparisons, never fmaxf, so a NaN is not dropped)."""
    m = a
    if b > m:
        m = b
    if c > m:
        m = c
    if m == _NEG_INF:
        return a + b + c             # -inf, or NaN if one is NaN
    return m + math.log(math.exp(a - m) + math.exp(b - m) + math.exp(c - m))


@cuda.jit(device=True)
def _fill(dlogits, b, Tb, inside, outside):
    """dlogits[b, t, :] = inside for t < Tb, outside after; the block's threads in turn."""
    T, C = dlogits.shape[1], dlogits.shape[2]
    for i in range(cuda.threadIdx.x, T * C, cuda.blockDim.x):
        t = i // C
        dlogits[b, t, i - t * C] = inside if t < Tb else outside


@jit("void(float32[:, :, ::1], int32[::1], int32[:, ::1], int32[::1], int32, int32, int32, "
     "float32[:, ::1], float32[:, :, ::1], float32[::1], float32[:, :, ::1])",
     writes=("lse", "occ", "losses", "dlogits"))
def ctc_kernel(logits, input_lengths, targets, target_lengths, blank, mean, zero_infinity,
               lse, occ, losses, dlogits):
    """Block b: sample b; thread s: extended state s. lse (B, T) and occ (B, T, 2 S + 1) are
    scratch (log-sum-exp of each frame's logits; alpha, then the occupancy)."""
    rows = cuda.shared.array((2, MAX_STATES), np.float32)   # the last frame's row, this one
    # links[0, s]: the next state of s's class (-1: none); links[1, s]: s's class if s is
    # its class's first state, else -1
    links = cuda.shared.array((2, MAX_STATES), np.int32)
    b, s, nt = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    B, T, C = logits.shape
    S = targets.shape[1]
    Tb, L = input_lengths[b], target_lengths[b]
    bad = not (1 <= Tb <= T and 0 <= L <= S)
    if not bad and s < L:            # (s < S: threads cover 2 S + 1 states)
        label = targets[b, s]
        bad = label < 0 or label >= C or label == blank
    if cuda.syncthreads_or(1 if bad else 0) != 0:    # (the whole block leaves)
        if s == 0:
            losses[b] = _NAN
        _fill(dlogits, b, T, _NAN, _NAN)
        return

    # Each frame's log-sum-exp, a thread a frame (the frame's C logits from L1 after the first)
    for t in range(s, Tb, nt):
        m = logits[b, t, 0]
        for c in range(1, C):
            v = logits[b, t, c]
            if v > m:
                m = v
        z = _ZERO
        for c in range(C):
            z += math.exp(logits[b, t, c] - m)
        lse[b, t] = m + math.log(z)

    # This thread's state: its class, whether it may skip from s - 2 (and s + 2 from s),
    # and its place in its class's chain
    n = 2 * L + 1
    here = s < n
    label = blank
    skip_in = False
    skip_out = False
    if here:
        nxt, head = -1, -1
        if s % 2 == 0:
            if s + 2 < n:
                nxt = s + 2
            if s == 0:
                head = blank
        else:
            k = (s - 1) // 2
            label = targets[b, k]
            skip_in = k >= 1 and targets[b, k - 1] != label
            skip_out = k + 1 < L and targets[b, k + 1] != label
            for j in range(k + 1, L):
                if targets[b, j] == label:
                    nxt = 2 * j + 1
                    break
            head = label
            for j in range(k):
                if targets[b, j] == label:
                    head = -1
                    break
        links[0, s], links[1, s] = nxt, head
    converged_syncthreads()               # (lse written)

    # Alpha, forward. The next frame's log-prob is loaded before the barrier.
    prev, cur = 0, 1
    lp = logits[b, 0, label] - lse[b, 0] if here else _NEG_INF
    for t in range(Tb):
        a = _NEG_INF
        if here:
            if t == 0:
                if s < 2:
                    a = lp
            else:
                a1 = rows[prev, s - 1] if s >= 1 else _NEG_INF
                a2 = rows[prev, s - 2] if skip_in else _NEG_INF
                a = lp + _logaddexp3(rows[prev, s], a1, a2)
            occ[b, t, s] = a
        rows[cur, s] = a
        if here and t + 1 < Tb:
            lp = logits[b, t + 1, label] - lse[b, t + 1]
        converged_syncthreads()
        prev, cur = cur, prev
    nll = -_logaddexp3(rows[prev, n - 1], rows[prev, n - 2] if n > 1 else _NEG_INF, _NEG_INF)

    if nll == _INF:                  # impossible: torch's inf and NaN, or zero_infinity's 0
        if s == 0:
            losses[b] = _ZERO if zero_infinity != 0 else _INF
        _fill(dlogits, b, Tb, _ZERO if zero_infinity != 0 else _NAN, _ZERO)
        return
    if s == 0:
        losses[b] = nll

    # Beta, backward; alpha + beta - lp + nll is the log-occupancy of (t, s)
    lp = logits[b, Tb - 1, label] - lse[b, Tb - 1] if here else _NEG_INF
    for i in range(Tb):
        t = Tb - 1 - i
        be = _NEG_INF
        if here:
            if i == 0:
                if s >= n - 2:
                    be = lp
            else:
                b1 = rows[prev, s + 1] if s + 1 < n else _NEG_INF
                b2 = rows[prev, s + 2] if skip_out else _NEG_INF
                be = lp + _logaddexp3(rows[prev, s], b1, b2)
            occ[b, t, s] = math.exp(occ[b, t, s] + be - lp + nll)
        rows[cur, s] = be
        if here and t >= 1:
            lp = logits[b, t - 1, label] - lse[b, t - 1]
        converged_syncthreads()           # (also: every occupancy written before the sums below)
        prev, cur = cur, prev

    # dlogits = scale (softmax - occupancy): the softmax everywhere, then each class in the
    # targets (at its first state) subtracts the sum along its chain, frame by frame
    scale = _ONE
    if mean != 0:
        scale = _ONE / (np.float32(max(L, 1)) * np.float32(B))
    for i in range(s, T * C, nt):
        t = i // C
        c = i - t * C
        g = _ZERO
        if t < Tb:
            g = scale * math.exp(logits[b, t, c] - lse[b, t])
        dlogits[b, t, c] = g
    converged_syncthreads()
    for i in range(s, n * Tb, nt):
        h = i // Tb
        t = i - h * Tb
        c = links[1, h]
        if c >= 0:
            total = _ZERO
            j = h
            while j >= 0:
                total += occ[b, t, j]
                j = links[0, j]
            dlogits[b, t, c] = scale * (math.exp(logits[b, t, c] - lse[b, t]) - total)


@jit("void(float32[::1], int32[::1], int32, float32[::1])", writes=("loss",))
def ctc_reduce_kernel(losses, target_lengths, mean, loss):
    """loss[0] = sum_b losses[b] (/ max(L_b, 1), then / B for mean), in batch order."""
    if cuda.threadIdx.x == 0 and cuda.blockIdx.x == 0:
        B = losses.shape[0]
        total = _ZERO
        for b in range(B):
            v = losses[b]
            if mean != 0:
                v = v / np.float32(max(target_lengths[b], 1))
            total += v
        if mean != 0:
            total = total / np.float32(B)
        loss[0] = total


# ---------------------------------------------------------------------------- launcher
def ctc_threads(S: int) -> int:
    """Threads a block for S labels: one a state of 2 S + 1, whole warps on a GPU."""
    return 2 * S + 1 if SIMULATOR else _check.warp_threads(2 * S + 1)


def ctc_loss(logits, input_lengths, targets, target_lengths, losses, loss, dlogits, *, blank=0,
             reduction="mean", zero_infinity=False, stream=0):
    """CTC loss of log_softmax(logits) and its gradient wrt logits (torch's ctc_loss).

    logits (B, T, C) float32, raw; input_lengths (B,), targets (B, S) (padded: entries at or
    past target_lengths[b] are not read), target_lengths (B,), all int32. Writes losses (B,)
    (each sample's negative log-likelihood, unreduced), loss (1,) (reduced: "mean" divides
    each loss by max(target_length, 1), then averages over the batch; "sum" adds them in
    batch order) and dlogits (B, T, C) = d loss / d logits (zero for t >= input_lengths[b]).
    S <= MAX_LABELS; blank in [0, C). Bad lengths or labels on the device give NaN for that
    sample (module docstring); an impossible alignment gives inf (NaN gradient over its
    frames) or, with zero_infinity, 0 and zero gradient.
    """
    _check.device_array("logits", logits, ndim=3)
    B, T, C = logits.shape
    _check.device_array("input_lengths", input_lengths, dtype=np.int32, shape=(B,))
    _check.device_array("targets", targets, dtype=np.int32, shape=(B, None))
    S = targets.shape[1]
    if S > MAX_LABELS:
        raise ValueError(f"targets: at most {MAX_LABELS} labels a sample (a thread a CTC "
                         f"state), got {S}")
    _check.device_array("target_lengths", target_lengths, dtype=np.int32, shape=(B,))
    _check.device_array("losses", losses, shape=(B,))
    _check.device_array("loss", loss, shape=(1,))
    _check.device_array("dlogits", dlogits, shape=(B, T, C))
    blank = _check.integer("blank", blank, at_least=0, at_most=C - 1)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    zero_infinity = _check.flag("zero_infinity", zero_infinity)
    _check.separate({"losses": losses, "loss": loss, "dlogits": dlogits},
                    {"logits": logits, "input_lengths": input_lengths, "targets": targets,
                     "target_lengths": target_lengths})
    lse = empty((B, T), np.float32, "ctc lse")
    occ = empty((B, T, 2 * S + 1), np.float32, "ctc occupancy")
    mean = np.int32(reduction == "mean")
    launch(ctc_kernel, B, ctc_threads(S),
           (logits, input_lengths, targets, target_lengths, np.int32(blank), mean,
            np.int32(zero_infinity), lse, occ, losses, dlogits), stream)
    launch(ctc_reduce_kernel, 1, 1 if SIMULATOR else 32, (losses, target_lengths, mean, loss),
           stream)
