"""Multi-head softmax attention over whole sequences with a key padding mask, forward and
backward, for training: Wav2Vec2's encoder self-attention (not causal).

qkv: (B, T, 3 H*hd), q, k and v side by side in each row, as one projection by the three
weights stacked writes them (Wav2Vec2's q, k and v projections are one GEMM); out: (B, T,
H*hd), the layout the out projection reads. Per sample b and head h, with L = lengths[b]
(int32 on the device):

    S  = scale * Q K^T                          (T, T)
    P  = softmax(S) over keys j < L, P[:, j] = 0 for j >= L   (every query row, padded too)
    O  = P V
    backward, from the saved P:
    dP = dO V^T;  dS = P * (dP - rowsum(dP * P))
    dQ = scale dS K;  dK = scale dS^T Q;  dV = P^T dO

Hugging Face adds finfo.min to the masked scores, so exp gives exactly 0 there in any row with
a valid key; here masked keys are skipped, which gives the same exact zeros. A masked key
then gets exactly zero dk and dv (its column of P and of dS is 0), provided dout and the
values are finite (0 * inf is NaN here as in PyTorch).

Composition, one stream, everything deterministic (no atomics; kernels.gemm sums split-K
partials in order, the row kernels reduce by a fixed warp butterfly):

  forward   split qkv into head-major (B*H, T, hd) q, k, v scratch  split_qkv_kernel
            probs = Q K^T  (raw scores, into probs itself)          gemm, batch B*H, trans_b
            probs = masked softmax of scale * probs, in place       softmax_rows_kernel
            O = P V, merged back into out (B, T, H*hd)              gemm; merge_heads_kernel
  backward  split qkv and dout                                      split_qkv/split_heads
            dS = dO V^T (dP), then in place
                 scale * P * (dP - rowsum(dP * P))                  gemm; softmax_bwd_rows_kernel
            dQ = dS K, dK = dS^T Q, dV = P^T dO, merged into dqkv   3 gemm; merge_qkv_kernel

At Wav2Vec2-base's sizes (B 8, H 12, hd 64, T up to ~250) each product is 96 batches of at
most 250 x 250 x 64: the tiled GEMM fills the GPU with 64 x 64 tiles, and the softmax rows
(1 KB each, a warp a row) are read twice from L1. probs (B, H, T, T) is the one large
tensor (24 MB at T 250), saved by the forward for the backward as the training step needs.

Lengths live on the device, so a bad one cannot be refused before the launch: a sample whose
length is < 1 or > T gets NaN in all of its probs, hence in its output and (through probs)
in its gradients; no access depends on it. Other samples are untouched by it.

Scratch (the head-major copies, dP) comes from `proto.device.backend.empty`: inside a recorded
graph, buffers the memory planner places.
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check
from kernels._reduce import warp_allreduce
from kernels.gemm import gemm
from proto.device import backend
from proto.device.backend import cuda, jit, launch

if not backend.SIMULATOR:
    LANES, ROWS = 32, 4            # row kernels: a warp a row, 4 rows (128 threads) a block
    SPLIT_THREADS = 256            # split/merge: threads along a (b, t) row of H*hd features
else:
    # Simulated threads cost ~0.1 ms each: a "warp" of 4 lanes, one row a block (the
    # simulator's stand-in for the shuffles groups a block's threads by 32), and small
    # row-strided grids for the split and merge.
    LANES, ROWS = 4, 1
    SPLIT_THREADS = 8
_NEG_INF = np.float32(-np.inf)
_NAN = np.float32(np.nan)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)


# ---------------------------------------------------------------------------- references
def _heads64(x, heads: int) -> np.ndarray:
    """(B, T, H*hd) -> (B, H, T, hd), float64."""
    B, T, C = x.shape
    return np.asarray(x, np.float64).reshape(B, T, heads, C // heads).transpose(0, 2, 1, 3)


def _merge64(x) -> np.ndarray:
    """(B, H, T, hd) -> (B, T, H*hd)."""
    B, H, T, hd = x.shape
    return x.transpose(0, 2, 1, 3).reshape(B, T, H * hd)


def seq_attention_ref(q, k, v, lengths, heads: int, scale: float):
    """float64 reference -> (out (B, T, H*hd), probs (B, H, T, T)), both float64. Keys
    j >= lengths[b] get probability 0; a sample whose length is < 1 or > T is all NaN."""
    qh, kh, vh = (_heads64(x, heads) for x in (q, k, v))
    B, H, T, _ = qh.shape
    lengths = np.asarray(lengths).astype(np.int64)
    s = scale * (qh @ kh.swapaxes(-1, -2))
    keep = np.arange(T)[None, :] < lengths[:, None]                     # (B, T) keys
    s = np.where(keep[:, None, None, :], s, -np.inf)
    bad = (lengths < 1) | (lengths > T)
    s[bad] = 0.0                                                        # (NaN below)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    p[bad] = np.nan
    return _merge64(p @ vh), p


def seq_attention_bwd_ref(q, k, v, probs, dout, heads: int, scale: float):
    """float64 reference of the backward from the saved probs -> (dq, dk, dv) (B, T, H*hd)."""
    qh, kh, vh, doh = (_heads64(x, heads) for x in (q, k, v, dout))
    p = np.asarray(probs, np.float64)
    dp = doh @ vh.swapaxes(-1, -2)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    return (_merge64(scale * (ds @ kh)), _merge64(scale * (ds.swapaxes(-1, -2) @ qh)),
            _merge64(p.swapaxes(-1, -2) @ doh))


# ---------------------------------------------------------------------------- kernels
# Split and merge: grid (row blocks, B), block (x, b) taking rows t = x, x + gridDim.x, ...
# of sample b; threads along the H*hd features, so the (B, T, H*hd) side is read or written
# coalesced and the head-major side in runs of hd contiguous floats. A thread's features are
# the same in every row: it finds their head and offset (integer divisions) once, outside the
# loop over rows.
@jit("void(float32[:, :, ::1], float32[:, :, ::1])", writes=("xh",))
def split_heads_kernel(x, xh):
    """xh[b*H + h, t, d] = x[b, t, h*hd + d], xh (B*H, T, hd)."""
    b, T, C, hd = cuda.blockIdx.y, x.shape[1], x.shape[2], xh.shape[2]
    for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
        n, d = b * (C // hd) + c // hd, c % hd
        for t in range(cuda.blockIdx.x, T, cuda.gridDim.x):
            xh[n, t, d] = x[b, t, c]


@jit("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1])",
     writes=("qh", "kh", "vh"))
def split_qkv_kernel(qkv, qh, kh, vh):
    """split_heads_kernel of q, k and v, side by side in qkv (B, T, 3 H*hd), in one launch
    (three loads in flight a thread): qh[b*H + h, t, d] = qkv[b, t, h*hd + d], kh from the
    next H*hd features, vh from the last."""
    b, T, C, hd = cuda.blockIdx.y, qkv.shape[1], qkv.shape[2] // 3, qh.shape[2]
    for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
        n, d = b * (C // hd) + c // hd, c % hd
        for t in range(cuda.blockIdx.x, T, cuda.gridDim.x):
            v0, v1, v2 = qkv[b, t, c], qkv[b, t, C + c], qkv[b, t, 2 * C + c]
            qh[n, t, d] = v0
            kh[n, t, d] = v1
            vh[n, t, d] = v2


@jit("void(float32[:, :, ::1], float32[:, :, ::1])", writes=("x",))
def merge_heads_kernel(xh, x):
    """x[b, t, h*hd + d] = xh[b*H + h, t, d]: split_heads_kernel's inverse."""
    b, T, C, hd = cuda.blockIdx.y, x.shape[1], x.shape[2], xh.shape[2]
    for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
        n, d = b * (C // hd) + c // hd, c % hd
        for t in range(cuda.blockIdx.x, T, cuda.gridDim.x):
            x[b, t, c] = xh[n, t, d]


@jit("void(float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1], float32[:, :, ::1])",
     writes=("qkv",))
def merge_qkv_kernel(qh, kh, vh, qkv):
    """split_qkv_kernel's inverse: qkv (B, T, 3 H*hd) from qh, kh and vh, one launch."""
    b, T, C, hd = cuda.blockIdx.y, qkv.shape[1], qkv.shape[2] // 3, qh.shape[2]
    for c in range(cuda.threadIdx.x, C, cuda.blockDim.x):
        n, d = b * (C // hd) + c // hd, c % hd
        for t in range(cuda.blockIdx.x, T, cuda.gridDim.x):
            v0, v1, v2 = qh[n, t, d], kh[n, t, d], vh[n, t, d]
            qkv[b, t, c] = v0
            qkv[b, t, C + c] = v1
            qkv[b, t, 2 * C + c] = v2


@cuda.jit(device=True)
def _lane_row(rows):
    """(row, lane, here) of this thread in a kernel of LANES lanes a row, ROWS rows a block.
    A lane past the last row gets row 0 and here False: it reads and writes nothing, yet
    takes part in its warp's reductions (the simulator's stand-in holds a block barrier)."""
    row = cuda.blockIdx.x * ROWS + cuda.threadIdx.x // LANES
    here = row < rows
    return (row if here else 0), cuda.threadIdx.x % LANES, here


@jit("void(float32[:, :, ::1], int32[::1], float32)", writes=("p",))
def softmax_rows_kernel(p, lengths, scale):
    """In place over p (B, H*T, T), a warp a row: row (b, i) becomes softmax(scale * p[b, i,
    :L]) with L = lengths[b], zeros from L on; NaN across the row when L is outside [1, T].
    Each lane keeps a running (max, sum of exp(x - max)) over its columns (online softmax),
    the lanes are combined by a max butterfly, then a sum butterfly of the rescaled sums;
    a second pass writes the row (each element written by the lane that read it)."""
    B, R, T = p.shape
    row, lane, here = _lane_row(B * R)
    b, i = row // R, row % R
    L = lengths[b]
    bad = L < 1 or L > T
    valid = L if here and not bad else 0
    m, s = _NEG_INF, _ZERO
    for j in range(lane, valid, LANES):
        x = p[b, i, j] * scale
        if x > m:                       # (not max(): a NaN must reach the sum)
            s = s * math.exp(m - x) + _ONE
            m = x
        elif x != _NEG_INF:
            s += math.exp(x - m)
    mx = warp_allreduce(m, True)
    if m != _NEG_INF:                   # (a lane with no finite score adds 0, or its NaN)
        s *= math.exp(m - mx)
    s = warp_allreduce(s, False)
    # s is 0 only where no valid score is finite: a bad length (NaN written), or scores all
    # -inf (then exp(-inf + inf) makes the row NaN, as in NumPy)
    inv = _ZERO if s == _ZERO else _ONE / s
    if here:
        for j in range(lane, T, LANES):
            if bad:
                p[b, i, j] = _NAN
            elif j < L:
                p[b, i, j] = math.exp(p[b, i, j] * scale - mx) * inv
            else:
                p[b, i, j] = _ZERO


@jit("void(float32[:, ::1], float32[:, ::1], float32)", writes=("ds",))
def softmax_bwd_rows_kernel(p, ds, scale):
    """In place over ds (rows, T), which holds dP on entry, a warp a row: ds = scale * P *
    (dP - sum_j dP_j P_j). A masked key (P exactly 0) gets exactly 0 for finite dP."""
    rows, T = p.shape
    row, lane, here = _lane_row(rows)
    acc = _ZERO
    if here:
        for j in range(lane, T, LANES):
            acc += ds[row, j] * p[row, j]
    r = warp_allreduce(acc, False)
    if here:
        for j in range(lane, T, LANES):
            pj = p[row, j]
            ds[row, j] = scale * pj * (ds[row, j] - r)


# ---------------------------------------------------------------------------- launchers
def _check_heads(qkv, heads):
    """(B, T, C, H, hd) of qkv (B, T, 3 C), C = H*hd, and `heads`."""
    _check.device_array("qkv", qkv, ndim=3)
    B, T, C3 = qkv.shape
    H = _check.positive("heads", heads)
    if C3 % (3 * H):
        raise ValueError(f"qkv: features {C3} are not 3 x a multiple of heads {H}")
    if B * H > 65535:
        raise ValueError(f"qkv: B * heads = {B * H} exceeds the batched GEMM's grid limit 65535")
    return B, T, C3 // 3, H, C3 // (3 * H)


def _row_launch(B: int, T: int) -> tuple[tuple[int, int], int]:
    """(grid, threads) of the split and merge kernels over (B, T, H*hd): on a GPU a block a
    row (Wav2Vec2-base: 8 x 250 blocks of 256 threads, 3 features a thread)."""
    return ((min(T, 2), B) if backend.SIMULATOR else (min(T, 65535), B)), SPLIT_THREADS


def _head_scratch(prefix: str, names, B: int, H: int, T: int, hd: int):
    return [backend.empty((B * H, T, hd), np.float32, f"{prefix}.{n}") for n in names]


def seq_attention(qkv, lengths, out, probs, *, heads, scale, stream=0):
    """out (B, T, H*hd) = attention of q over k, v (side by side in qkv (B, T, 3 H*hd),
    `heads` heads of hd), scores scaled by `scale`, keys j >= lengths[b] masked (lengths
    int32 (B,) on the device); probs (B, H, T, T) gets the softmax probabilities (masked keys
    exactly 0), which seq_attention_bwd takes. Every query row is computed, padded ones too.
    A length < 1 or > T makes that sample's probs and out NaN. out and probs overlap
    nothing."""
    B, T, C, H, hd = _check_heads(qkv, heads)
    _check.device_array("lengths", lengths, dtype=np.int32, shape=(B,))
    _check.device_array("out", out, shape=(B, T, C))
    _check.device_array("probs", probs, shape=(B, H, T, T))
    scale = _check.number("scale", scale)
    _check.separate({"out": out, "probs": probs}, {"qkv": qkv, "lengths": lengths})
    qh, kh, vh, oh = _head_scratch("seq_attention", "qkvo", B, H, T, hd)
    p3 = backend.reshaped(probs, (B * H, T, T))
    grid, threads = _row_launch(B, T)
    launch(split_qkv_kernel, grid, threads, (qkv, qh, kh, vh), stream)
    gemm(qh, kh, p3, trans_b=True, stream=stream)
    launch(softmax_rows_kernel, -(-B * H * T // ROWS), ROWS * LANES,
           (backend.reshaped(probs, (B, H * T, T)), lengths, np.float32(scale)), stream)
    gemm(p3, vh, oh, stream=stream)
    launch(merge_heads_kernel, grid, threads, (oh, out), stream)


def seq_attention_bwd(qkv, probs, dout, dqkv, *, heads, scale, stream=0):
    """dqkv (B, T, 3 H*hd), overwritten: the gradients of seq_attention's out with respect
    to q, k and v, side by side as in qkv, given dout (B, T, H*hd), from the forward's qkv,
    probs, heads and scale. A masked key gets exactly zero dk and dv (for finite dout and
    v); a sample with NaN probs (a bad length) gets NaN gradients. dqkv overlaps nothing."""
    B, T, C, H, hd = _check_heads(qkv, heads)
    _check.device_array("dout", dout, shape=(B, T, C))
    _check.device_array("dqkv", dqkv, shape=(B, T, 3 * C))
    _check.device_array("probs", probs, shape=(B, H, T, T))
    scale = _check.number("scale", scale)
    _check.separate({"dqkv": dqkv}, {"qkv": qkv, "probs": probs, "dout": dout})
    qh, kh, vh, doh, dqh, dkh, dvh = _head_scratch(
        "seq_attention_bwd", ("q", "k", "v", "dout", "dq", "dk", "dv"), B, H, T, hd)
    ds = backend.empty((B * H, T, T), np.float32, "seq_attention_bwd.ds")
    p3 = backend.reshaped(probs, (B * H, T, T))
    grid, threads = _row_launch(B, T)
    launch(split_qkv_kernel, grid, threads, (qkv, qh, kh, vh), stream)
    launch(split_heads_kernel, grid, threads, (dout, doh), stream)
    gemm(doh, vh, ds, trans_b=True, stream=stream)                      # dP
    launch(softmax_bwd_rows_kernel, -(-B * H * T // ROWS), ROWS * LANES,
           (backend.reshaped(probs, (B * H * T, T)), backend.reshaped(ds, (B * H * T, T)),
            np.float32(scale)), stream)                                 # dS, scaled
    gemm(ds, kh, dqh, stream=stream)
    gemm(ds, qh, dkh, trans_a=True, stream=stream)
    gemm(p3, doh, dvh, trans_a=True, stream=stream)
    launch(merge_qkv_kernel, grid, threads, (dqh, dkh, dvh, dqkv), stream)


def seq_attention_flops(B: int, T: int, heads: int, hd: int) -> float:
    """The forward's two products (the backward's four: twice this)."""
    return 4.0 * B * heads * T * T * hd
