"""Softmax cross-entropy, mean over the batch: loss on the device and dlogits in one launch.

    loss     = mean_b [ logsumexp(logits[b]) - logits[b, label[b]] ]
    dlogits  = (softmax(logits) - onehot(label)) / B

One block walks the rows in order; per row its threads reduce the max, then the sum of
exp, through a shared-memory tree. Thread 0 adds the row losses in row order, so the loss is
deterministic and needs no zeroed accumulator. Logits of a training batch (B x classes, a
few hundred thousand values at most) are far too small to need more than one block.

Labels live on the device, so one outside [0, V) cannot be rejected before the launch: its
row's gradient is NaN and so is the loss (visible, and never an out-of-bounds read).
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check
from kernels._reduce import block_reduce
from proto.device.backend import SIMULATOR, cuda, jit, launch

MAX_THREADS = 256
MIN_THREADS = 4 if SIMULATOR else 32
_NEG_INF = np.float32(-np.inf)
_NAN = np.float32(np.nan)


def softmax_xent_ref(logits: np.ndarray, labels: np.ndarray):
    """-> (loss float32 scalar, dlogits (B, V) float32). A label outside [0, V) makes its
    row of dlogits NaN, and the loss."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    B, V = z.shape
    labels = np.asarray(labels)
    ok = (labels >= 0) & (labels < V)
    rows, safe = np.arange(B), np.where(ok, labels, 0)
    loss = -np.where(ok, logp[rows, safe], np.nan).mean()
    d = np.exp(logp)
    d[rows[ok], labels[ok]] -= 1.0
    d[~ok] = np.nan
    return np.float32(loss), (d / B).astype(np.float32)


@jit("void(float32[:,::1], int32[::1], float32[::1], float32[:,::1])", writes=("loss", "dlogits"))
def softmax_xent_kernel(logits, labels, loss, dlogits):
    B, V = logits.shape
    t = cuda.threadIdx.x
    T = cuda.blockDim.x                    # a power of two
    red = cuda.shared.array(MAX_THREADS, np.float32)
    inv_b = np.float32(1.0) / np.float32(B)
    total = np.float32(0.0)
    for b in range(B):
        m = _NEG_INF
        for v in range(t, V, T):
            m = max(m, logits[b, v])
        m = block_reduce(red, m, True)
        s = np.float32(0.0)
        for v in range(t, V, T):
            s += math.exp(logits[b, v] - m)
        s = block_reduce(red, s, False)
        label = labels[b]
        ok = 0 <= label < V                # else: NaN, and logits[b, label] is never read
        for v in range(t, V, T):
            g = math.exp(logits[b, v] - m) / s
            if v == label:
                g -= np.float32(1.0)
            dlogits[b, v] = g * inv_b if ok else _NAN
        if t == 0:
            if ok:
                total += (m + math.log(s) - logits[b, label]) * inv_b
            else:
                total = _NAN
    if t == 0:
        loss[0] = total


def softmax_xent(logits, labels, loss, dlogits, *, stream=0):
    """logits (B, V), labels int32 (B,) with values in [0, V), loss (1,), dlogits (B, V).
    Writes the batch-mean loss into loss[0] and its gradient into dlogits; a label outside
    [0, V) gives a NaN loss and a NaN row of dlogits."""
    _check.device_array("logits", logits, ndim=2)
    B, V = logits.shape
    _check.device_array("labels", labels, dtype=np.int32, shape=(B,))
    _check.device_array("loss", loss, shape=(1,))
    _check.device_array("dlogits", dlogits, shape=(B, V))
    # About 16 classes per thread: each row costs 2 log2(threads) barriers, so fewer threads
    # are faster for small class counts (and far faster in the simulator). On a GPU at least a
    # warp: block_reduce's barrier reconverges the whole warp first (syncwarp, full mask).
    threads = MIN_THREADS
    while threads < MAX_THREADS and threads * 16 < V:
        threads *= 2
    launch(softmax_xent_kernel, 1, threads, (logits, labels, loss, dlogits), stream)


def softmax_xent_flops(B: int, V: int) -> float:
    return 6.0 * B * V
