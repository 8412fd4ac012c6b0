"""1-D convolutions for Wav2Vec2, channels first (B, C, T), float32, weights (K, C/groups, k)
as torch.nn.Conv1d: forward, backward-data and backward-weight; and weight normalization.

The feature encoder's strided convolutions (groups 1, no padding) are kernels.conv's 2-D
implicit GEMMs over a one-pixel-high image: x (B, C, 1, T), w (K, C, 1, k), stride s, pad 0,
so the output is one pixel high as well (views, no copies; its split weight gradient gets its
workspace from backend.empty). They stay on kernels.conv's SIMT tiles: on its tensor-core
tiles (three TF32 products a float32 one) they ran slower (dev/notes/wav2vec2.md).

    conv1d            out[b,o,t] = bias[o] + sum_{c,r} w[o,c,r] * x[b,c,t*s+r],  t < (T-k)//s + 1

The positional convolution is grouped (16 groups of 48 channels at 768), padded on both sides
and has a long kernel (128 taps); Wav2Vec2 drops the last of the T+1 frames an even kernel
gives, so the output length is an argument:

    conv1d_grouped    out[b,g*Co+o,t] = bias[g*Co+o]
                                        + sum_{i<Cr, r<k} w[g*Co+o,i,r] * x[b,g*Cr+i,t+r-pad]
                      for t < out.shape[2], x read as zero outside [0, T)
                      (Cr = C/groups input channels a group, Co = K/groups outputs)
    backward-data     dx[b,g*Cr+i,s] = sum_{o,r} w[g*Co+o,i,r] * dy[b,g*Co+o,s+pad-r]: the same
                      kernel, the weight transposed and its taps reversed, pad k-1-pad
    backward-weight   dw[g*Co+o,i,r] = sum_{b,t} dy[b,g*Co+o,t] * x[b,g*Cr+i,t+r-pad]
                      db[o]          = sum_{b,t} dy[b,o,t]

Its kernels are tiled GEMMs whose patch operand is a Toeplitz matrix, A[p, q] = win[p + q]: a
block stages one channel's window of the input in shared memory (its output tile's span plus
the step's taps) and a tile of the other operand, and each thread keeps a TM x TN tile of
outputs in registers. A thread's rows p are DX apart (tx + DX*j), so for reduction index
q = rho + DX*m it reads win[tx + rho + DX*(j + m)]: for each rho it loads TM + M - 1 window
values once and reuses them over the M steps of m (the window slides by one register), not
TM * M loads. The forward's rows are time steps and its reduction the taps of one input
channel; the weight gradient's rows are taps and its reduction time steps, its other operand
the output gradient. The weight gradient's reduction over (batch, time) may be split across
blocks; each split stores its partial tile in a workspace and a second kernel adds the
partials in split order (no atomics: the same bits every run). The forward and backward-data
run on tensor cores (`GPU_GROUPED_MMA_TILES`): the same Toeplitz operand, read by
kernels._tf32's warp tile; the SIMT tiles (`GPU_GROUPED_TILES`) stay for tests and benches.

Weight norm (torch.nn.utils.weight_norm(conv, dim=2)): w = g * v / ||v||, the norm over
dims (0, 1) for each tap r; g (1, 1, k). A tap's norm (and in the backward its v.dw sum) is
summed in row chunks into a workspace, each chunk's rows in order, then the chunks in order.

References (`*_ref`) restate the math in float64 NumPy and return float64.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from kernels import _check, conv
from kernels._conv_kernels import sum_splits_kernel
from kernels._reduce import block_reduce
from kernels._tf32 import mma_tile
from kernels._tile import Tiles, grid_place
from proto.device import backend
from proto.device.backend import cuda, jit, launch

_u = np.uint32   # unsigned shared-memory indices in the hot loop (no negative-index fix-up)
_MAX_INDEX = 2**31 - 1   # offsets are 32-bit where the kernels take sizes as int32
_MAX_GRID_Z = 65535


# ---------------------------------------------------------------------------- references
def conv1d_out_size(T: int, k: int, stride: int = 1, pad: int = 0) -> int:
    """Frames of a convolution of `T` frames with a k-tap kernel (torch.nn.Conv1d's)."""
    return (T + 2 * pad - k) // stride + 1


def _windows(x, k: int, n: int, stride: int) -> np.ndarray:
    """(B, C, T) -> (B, C, k, n): [b, c, r, t] = x[b, c, t*stride + r] (float64)."""
    x = np.asarray(x, np.float64)
    return np.stack([x[:, :, r:r + stride * (n - 1) + 1:stride] for r in range(k)], axis=2)


def conv1d_ref(x, w, b=None, *, stride=1) -> np.ndarray:
    """out (B, K, (T-k)//stride + 1) = conv1d(x, w) + b; groups 1, no padding."""
    k = w.shape[2]
    cols = _windows(x, k, conv1d_out_size(x.shape[2], k, stride), stride)   # (B, C, k, n)
    out = np.tensordot(cols, np.asarray(w, np.float64), axes=([1, 2], [1, 2])).transpose(0, 2, 1)
    return out if b is None else out + np.asarray(b, np.float64)[None, :, None]


def conv1d_bwd_data_ref(dy, w, T: int, *, stride=1) -> np.ndarray:
    """dx (B, C, T), the adjoint of conv1d_ref in x."""
    k, n = w.shape[2], dy.shape[2]
    cols = np.tensordot(np.asarray(dy, np.float64), np.asarray(w, np.float64),
                        axes=([1], [0]))                                  # (B, n, C, k)
    dx = np.zeros((dy.shape[0], w.shape[1], T))
    for r in range(k):
        dx[:, :, r:r + stride * (n - 1) + 1:stride] += cols[:, :, :, r].transpose(0, 2, 1)
    return dx


def conv1d_bwd_weight_ref(x, dy, k: int, *, stride=1):
    """-> (dw (K, C, k), db (K,))."""
    dy = np.asarray(dy, np.float64)
    cols = _windows(x, k, dy.shape[2], stride)
    return np.tensordot(dy, cols, axes=([0, 2], [0, 3])), dy.sum(axis=(0, 2))


def _padded_windows(x, k: int, n: int, pad: int) -> np.ndarray:
    """(B, C, T) -> (B, C, k, n): [b, c, r, t] = x[b, c, t + r - pad], zero outside x."""
    x = np.asarray(x, np.float64)
    need = n + k - 1   # padded frames the windows reach
    xp = np.zeros(x.shape[:2] + (max(need, x.shape[2] + 2 * pad),))
    xp[:, :, pad:pad + x.shape[2]] = x
    return _windows(xp[:, :, :need], k, n, 1)


def conv1d_grouped_ref(x, w, b, T_out: int, *, groups: int, pad: int) -> np.ndarray:
    """out (B, K, T_out): out[b,g*Co+o,t] = b[g*Co+o] + sum_{i,r} w[g*Co+o,i,r] x[b,g*Cr+i,t+r-pad]."""
    K, Cr, k = w.shape
    Co = K // groups
    out = np.empty((x.shape[0], K, T_out))
    for g in range(groups):
        cols = _padded_windows(x[:, g * Cr:(g + 1) * Cr], k, T_out, pad)   # (B, Cr, k, T_out)
        out[:, g * Co:(g + 1) * Co] = np.tensordot(
            cols, np.asarray(w[g * Co:(g + 1) * Co], np.float64),
            axes=([1, 2], [1, 2])).transpose(0, 2, 1)
    return out if b is None else out + np.asarray(b, np.float64)[None, :, None]


def conv1d_grouped_bwd_data_ref(dy, w, T: int, *, groups: int, pad: int) -> np.ndarray:
    """dx (B, C, T), the adjoint of conv1d_grouped_ref in x."""
    K, Cr, k = w.shape
    B, _, T_out = dy.shape
    Co = K // groups
    dxp = np.zeros((B, groups * Cr, max(T_out + k - 1, T + 2 * pad)))
    for g in range(groups):
        cols = np.tensordot(np.asarray(dy[:, g * Co:(g + 1) * Co], np.float64),
                            np.asarray(w[g * Co:(g + 1) * Co], np.float64),
                            axes=([1], [0]))                              # (B, T_out, Cr, k)
        for r in range(k):
            dxp[:, g * Cr:(g + 1) * Cr, r:r + T_out] += cols[:, :, :, r].transpose(0, 2, 1)
    return dxp[:, :, pad:pad + T]


def conv1d_grouped_bwd_weight_ref(x, dy, k: int, *, groups: int, pad: int):
    """-> (dw (K, C/groups, k), db (K,))."""
    dy = np.asarray(dy, np.float64)
    K, T_out = dy.shape[1], dy.shape[2]
    Cr, Co = x.shape[1] // groups, K // groups
    dw = np.empty((K, Cr, k))
    for g in range(groups):
        cols = _padded_windows(x[:, g * Cr:(g + 1) * Cr], k, T_out, pad)
        dw[g * Co:(g + 1) * Co] = np.tensordot(dy[:, g * Co:(g + 1) * Co], cols,
                                               axes=([0, 2], [0, 3]))
    return dw, dy.sum(axis=(0, 2))


def weight_norm_ref(v, g) -> np.ndarray:
    """w = g * v / ||v||, the norm over dims (0, 1) for each tap: v (K, Cr, k), g (1, 1, k)."""
    v = np.asarray(v, np.float64)
    return np.asarray(g, np.float64) * v / np.sqrt((v * v).sum(axis=(0, 1), keepdims=True))


def weight_norm_bwd_ref(v, g, dw):
    """-> (dv, dg): dg = sum(dw * v) / n, dv = g / n * (dw - dg / n * v), n = ||v|| per tap."""
    v, g, dw = (np.asarray(a, np.float64) for a in (v, g, dw))
    n = np.sqrt((v * v).sum(axis=(0, 1), keepdims=True))
    dg = (dw * v).sum(axis=(0, 1), keepdims=True) / n
    return g / n * (dw - dg / n * v), dg


# ---------------------------------------------------------------------------- tiles
class GroupTiles(NamedTuple):
    """A Toeplitz GEMM tile: rows p = tx + dx*j (j < tm), the sliding axis; columns
    ty*tn + n (n < tn), channels; a step's reduction q = rho + dx*m (m < m)."""
    dx: int
    tm: int
    dy: int
    tn: int
    m: int

    @property
    def rows(self) -> int:
        return self.dx * self.tm

    @property
    def cols(self) -> int:
        return self.dy * self.tn

    @property
    def depth(self) -> int:
        return self.dx * self.m

    @property
    def threads(self) -> int:
        return self.dx * self.dy


# Forward and backward-data: 64 threads of 8 frames x 6 channels (a group's 48 channels a
# block), 64 taps a step: per rho, 15 window loads and 48 weight loads for 384 multiply-adds.
# The 32-frame tile wastes less of a short sequence (65 frames: 96 computed, not 128).
GPU_GROUPED_TILES = (GroupTiles(8, 8, 8, 6, 8), GroupTiles(8, 4, 8, 6, 8))
# Backward-weight: 128 threads of 8 taps x 6 channels (all 128 taps, 48 channels a block), 32
# frames a step (a sequence's last step wastes at most 31 frames).
GPU_GROUPED_WGRAD_TILES = (GroupTiles(16, 8, 8, 6, 2),)
# Forward and backward-data on tensor cores (kernels._tf32: three TF32 products a float32
# one), the A operand the window itself (A[p, q] = win[p + q]): 4 warps of 16 frames x 48
# channels, 64 taps a step. 1.5 to 1.6x the SIMT tiles' speed at 65 and 199 frames (H100,
# dev/bench/bench_conv1d.py; a 2-warp 32-frame tile was no faster than SIMT at either).
GPU_GROUPED_MMA_TILES = (Tiles(64, 48, 64, 2, 12, True),)
# The simulator: 4 threads, tiles small enough that tiny tests cross several of them.
SIM_GROUPED_TILES = (GroupTiles(2, 2, 2, 2, 2),)
SIM_GROUPED_MMA_TILES = (Tiles(16, 8, 16, 2, 2, True),)   # (one warp)
SIM_GROUPED_WGRAD_TILES = (GroupTiles(2, 2, 2, 2, 2),)
# What the forward and backward-data launch unless a test or bench forces another
GROUPED_TILE = (SIM_GROUPED_MMA_TILES if backend.SIMULATOR else GPU_GROUPED_MMA_TILES)[0]


def _toeplitz_multiply(t: GroupTiles):
    """multiply(acc, a_reg, b_reg, win, bt, a_start, b_start, tx, ty): acc[j, n] +=
    sum_{q < depth} win[tx + dx*j + q] * bt[(ty*tn + n) * QS + q], QS = depth + 1 (the B
    tile is staged column-major with its columns a row apart, padded so that the threads of
    a warp with different ty read distinct banks); a_start and b_start are 0 (they are
    kernels._tf32.mma_tile's interface)."""
    DX, TM, DY, TN, M = t
    A_REGS, QS = TM + M - 1, t.depth + 1

    @cuda.jit(device=True)
    def multiply(acc, a_reg, b_reg, win, bt, a_start, b_start, tx, ty):
        b_row = ty * _u(TN * QS)
        for rho in range(DX):
            a_at = tx + _u(rho)
            for u in range(A_REGS):
                a_reg[u] = win[a_at + _u(DX * u)]
            for m in range(M):
                q = b_row + _u(rho + DX * m)
                for n in range(TN):
                    b_reg[n] = bt[q + _u(n * QS)]
                for j in range(TM):
                    for n in range(TN):
                        acc[j, n] += a_reg[j + m] * b_reg[n]
    return multiply


_GROUPED_SIG = ("void(float32[::1], float32[::1], float32[::1], int32, float32[::1], "
                "int32, int32, int32, int32, int32, int32, int32, int32)")


def make_grouped_kernel(t: GroupTiles | Tiles, transposed: bool):
    """Forward (transposed=False) or backward-data (True) of the grouped convolution, on a
    Toeplitz register tile (GroupTiles) or on tensor cores (Tiles with mma: frames bm,
    channels bn, taps a step bk).

    Arguments: src (B, C_src, T_src), w (K, C/groups, k), bias, has_bias, dst (B, C_dst,
    T_dst), then B, C_src, T_src, C_dst, T_dst, groups, k, pad. Grid (T_dst tiles, output
    channel tiles, B * groups). Forward: src x, dst out. Backward-data: src dy, dst dx, the
    weight read transposed ((g*Cr + c) * Co + o, c the reduction channel) with its taps
    reversed (k-1-r), pad the forward's k-1-pad."""
    if isinstance(t, Tiles):   # tensor cores (kernels._tf32): A (p, q) = win[p + q]
        BT, BO, DEPTH, NT, TM, TN = t.bm, t.bn, t.bk, t.threads, t.tm, t.tn
        QS = DEPTH + 4   # B's columns 4 banks apart: a warp's B fragments hit 32 banks
        multiply, row, col, place = mma_tile(t, 1, 1, a_step=1, b_step=QS)
        A_REGS = 1
    else:
        BT, BO, DEPTH, NT, TM, TN = t.rows, t.cols, t.depth, t.threads, t.tm, t.tn
        QS, A_REGS = DEPTH + 1, TM + t.m - 1
        multiply, row, col, place = (_toeplitz_multiply(t), *_toeplitz_places(t))
    WIN, B_SIZE = BT + DEPTH - 1, BO * QS
    WIN_PER, B_PER = -(-WIN // NT), -(-(DEPTH * BO) // NT)   # staged elements a thread

    @jit(_GROUPED_SIG, writes=("dst",))
    def grouped_kernel(src, w, bias, has_bias, dst, B, C_src, T_src, C_dst, T_dst, groups, k,
                       pad):
        tid = cuda.threadIdx.x
        tx, ty = place(_u(tid))   # (what multiply, row and col take)
        t0 = cuda.blockIdx.x * BT
        o0 = cuda.blockIdx.y * BO
        b = cuda.blockIdx.z // groups
        g = cuda.blockIdx.z - b * groups
        Cr, Co = C_src // groups, C_dst // groups
        win = cuda.shared.array(WIN, np.float32)      # one channel's frames for the step
        bt = cuda.shared.array(B_SIZE, np.float32)    # [output channel][tap], QS apart
        acc = cuda.local.array((TM, TN), np.float32)
        a_reg = cuda.local.array(A_REGS, np.float32)
        b_reg = cuda.local.array(TN, np.float32)
        for j in range(TM):
            for n in range(TN):
                acc[j, n] = np.float32(0.0)
        src_base = (b * C_src + g * Cr) * T_src
        chunks = (k + DEPTH - 1) // DEPTH
        c = 0
        r0 = 0
        for _ in range(Cr * chunks):   # channel-major, DEPTH taps a step
            # The window: frames t0 - pad + r0 + [0, WIN) of channel c (zero off the
            # sequence), consecutive threads on consecutive frames.
            first = t0 - pad + r0
            src_row = src_base + c * T_src
            for e in range(WIN_PER):
                p = tid + NT * e
                if p < WIN:
                    at = first + p
                    v = np.float32(0.0)
                    if at >= 0 and at < T_src:
                        v = src[src_row + at]
                    win[p] = v
            # The weight tile bt[oo*QS + rr] = tap r0 + rr of output channel o0 + oo,
            # consecutive threads on consecutive taps (contiguous in w).
            for e in range(B_PER):
                q = tid + NT * e
                if q < DEPTH * BO:
                    oo = q // DEPTH
                    rr = q - oo * DEPTH
                    o, r = o0 + oo, r0 + rr
                    v = np.float32(0.0)
                    if o < Co and r < k:
                        if transposed:
                            v = w[((g * Cr + c) * Co + o) * k + (k - 1 - r)]
                        else:
                            v = w[((g * Co + o) * Cr + c) * k + r]
                    bt[oo * QS + rr] = v
            cuda.syncthreads()
            multiply(acc, a_reg, b_reg, win, bt, _u(0), _u(0), tx, ty)
            cuda.syncthreads()   # the next step overwrites both tiles
            r0 += DEPTH
            if r0 >= k:
                r0 = 0
                c += 1
        for n in range(TN):
            o = o0 + np.int32(col(ty, n))
            if o < Co:
                add = bias[g * Co + o] if has_bias != 0 else np.float32(0.0)
                at = (b * C_dst + g * Co + o) * T_dst
                for j in range(TM):
                    tt = t0 + np.int32(row(tx, j))
                    if tt < T_dst:
                        dst[at + tt] = acc[j, n] + add

    return grouped_kernel


def _toeplitz_places(t: GroupTiles):
    """(row, col, place) of the Toeplitz tile: acc[j, n] is frame tx + dx*j, channel
    ty*tn + n, for (tx, ty) = place(tid) = (tid % dx, tid // dx)."""
    DX, TN = t.dx, t.tn

    @cuda.jit(device=True)
    def row(tx, j):
        return tx + _u(DX * j)

    @cuda.jit(device=True)
    def col(ty, n):
        return ty * _u(TN) + _u(n)

    return row, col, grid_place(DX)


_GROUPED_WGRAD_SIG = ("void(float32[::1], float32[::1], float32[::1], int32, int32, int32, "
                      "int32, int32, int32, int32, int32, int32)")


def make_grouped_wgrad_kernel(t: GroupTiles):
    """Backward-weight of the grouped convolution, into split partials.

    Arguments: x (B, C, T_in), dy (B, K, T_out), part (splits, K, C/groups, k), then B, C,
    T_in, K, T_out, groups, k, pad, steps (reduction steps a split). Grid (tap tiles, output
    channel tiles, splits * C): a block owns one input channel c = g*Cr + i, a tile of taps
    (rows) and of output channels (columns), and walks its split's steps of (batch, DEPTH
    frames): the window x[b, c, t0 + r0 - pad + p] and the tile dy[b, g*Co + o, t0 + tt]."""
    DX, TM, DY, TN, M = t
    BR, BO, DEPTH, NT = t.rows, t.cols, t.depth, t.threads
    WIN, QS = BR + DEPTH - 1, DEPTH + 1
    B_SIZE, A_REGS = BO * QS, TM + M - 1
    WIN_PER, B_PER = -(-WIN // NT), -(-(DEPTH * BO) // NT)
    multiply = _toeplitz_multiply(t)

    @jit(_GROUPED_WGRAD_SIG, writes=("part",))
    def grouped_wgrad_kernel(x, dy, part, B, C, T_in, K, T_out, groups, k, pad, steps):
        tid = cuda.threadIdx.x
        tx, ty = _u(tid % DX), _u(tid // DX)
        r0 = cuda.blockIdx.x * BR
        o0 = cuda.blockIdx.y * BO
        split = cuda.blockIdx.z // C
        c = cuda.blockIdx.z - split * C
        Cr, Co = C // groups, K // groups
        g = c // Cr
        win = cuda.shared.array(WIN, np.float32)
        bt = cuda.shared.array(B_SIZE, np.float32)    # [output channel][frame], QS apart
        acc = cuda.local.array((TM, TN), np.float32)
        a_reg = cuda.local.array(A_REGS, np.float32)
        b_reg = cuda.local.array(TN, np.float32)
        for j in range(TM):
            for n in range(TN):
                acc[j, n] = np.float32(0.0)
        chunks = (T_out + DEPTH - 1) // DEPTH
        begin = split * steps
        end = min(B * chunks, begin + steps)
        b = begin // chunks
        t0 = (begin - b * chunks) * DEPTH
        for _ in range(begin, end):   # batch-major, DEPTH frames a step
            first = t0 + r0 - pad
            row = (b * C + c) * T_in
            for e in range(WIN_PER):
                p = tid + NT * e
                if p < WIN:
                    at = first + p
                    v = np.float32(0.0)
                    if at >= 0 and at < T_in:
                        v = x[row + at]
                    win[p] = v
            dy_base = (b * K + g * Co + o0) * T_out + t0
            for e in range(B_PER):
                q = tid + NT * e
                if q < DEPTH * BO:
                    oo = q // DEPTH
                    tt = q - oo * DEPTH
                    v = np.float32(0.0)
                    if o0 + oo < Co and t0 + tt < T_out:
                        v = dy[dy_base + oo * T_out + tt]
                    bt[oo * QS + tt] = v
            cuda.syncthreads()
            multiply(acc, a_reg, b_reg, win, bt, _u(0), _u(0), tx, ty)
            cuda.syncthreads()
            t0 += DEPTH
            if t0 >= T_out:
                t0 = 0
                b += 1
        i = c - g * Cr
        base = split * K * Cr * k
        for n in range(TN):
            o = o0 + np.int32(ty) * TN + n
            if o < Co:
                row = base + ((g * Co + o) * Cr + i) * k
                for j in range(TM):
                    r = r0 + np.int32(tx) + DX * j
                    if r < k:
                        part[row + r] = acc[j, n]

    return grouped_wgrad_kernel


# The bias gradient and the weight norm's tap sums: fixed-order sums, a block each.
_RED_THREADS = 4 if backend.SIMULATOR else 256    # (a power of two: block_reduce's tree)


@jit("void(float32[::1], float32[::1], int32, int32, int32)", writes=("db",))
def bias_grad_kernel(dy, db, B, K, T):
    """db[o] = sum_{b,t} dy[b, o, t]: block o; each thread sums its (b, t) in order, then a
    tree in shared memory (the same bits every run)."""
    red = cuda.shared.array(_RED_THREADS, np.float32)
    o = cuda.blockIdx.x
    s = np.float32(0.0)
    for e in range(cuda.threadIdx.x, B * T, cuda.blockDim.x):
        b = e // T
        s += dy[(b * K + o) * T + (e - b * T)]
    total = block_reduce(red, s, False)
    if cuda.threadIdx.x == 0:
        db[o] = total


# Tap sums: a block of LANES taps x WARPS row groups; lanes walk adjacent taps (coalesced).
_WN_LANES, _WN_WARPS = (4, 2) if backend.SIMULATOR else (32, 8)


@jit("void(float32[::1], float32[::1], float32[::1], int32, int32, int32, int32)",
     writes=("part",))
def tap_sums_kernel(v, dw, part, has_dw, rows, k, chunk):
    """part[s, 0, r] = sum of v[row, r]^2 and (has_dw) part[s, 1, r] = sum of dw[row, r] *
    v[row, r] over the rows of chunk s = blockIdx.y (`chunk` rows each; v and dw viewed as
    (rows, k)). Each thread sums every WARPS-th row in order, then the row groups are added in
    order."""
    red = cuda.shared.array((2, _WN_WARPS, _WN_LANES), np.float32)
    lane = cuda.threadIdx.x % _WN_LANES
    grp = cuda.threadIdx.x // _WN_LANES
    r = cuda.blockIdx.x * _WN_LANES + lane
    s = cuda.blockIdx.y
    s1 = np.float32(0.0)
    s2 = np.float32(0.0)
    if r < k:
        for row in range(s * chunk + grp, min(rows, (s + 1) * chunk), _WN_WARPS):
            a = v[row * k + r]
            s1 += a * a
            if has_dw != 0:
                s2 += dw[row * k + r] * a
    red[0, grp, lane] = s1
    red[1, grp, lane] = s2
    cuda.syncthreads()
    if grp == 0 and r < k:
        for q in range(1, _WN_WARPS):
            s1 += red[0, q, lane]
            s2 += red[1, q, lane]
        part[2 * s * k + r] = s1
        if has_dw != 0:
            part[(2 * s + 1) * k + r] = s2


@jit("void(float32[::1], float32[::1], float32[::1], int32)", writes=("scale",))
def norm_scale_kernel(part, g, scale, chunks):
    """scale[r] = g[r] / ||v[:, :, r]||, the chunks' sums of squares added in order."""
    k = g.size
    for r in range(cuda.grid(1), k, cuda.gridsize(1)):
        n2 = np.float32(0.0)
        for s in range(chunks):
            n2 += part[2 * s * k + r]
        scale[r] = g[r] / math.sqrt(n2)


@jit("void(float32[::1], float32[::1], float32[::1], float32[::1], int32)",
     writes=("coef", "dg"))
def norm_grad_scale_kernel(part, g, coef, dg, chunks):
    """For each tap r, with n = ||v[:, :, r]|| and s = sum(dw * v) over the tap:
    dg[r] = s / n, coef[r] = g / n and coef[k + r] = g / n * dg / n."""
    k = g.size
    for r in range(cuda.grid(1), k, cuda.gridsize(1)):
        n2 = np.float32(0.0)
        s = np.float32(0.0)
        for c in range(chunks):
            n2 += part[2 * c * k + r]
            s += part[(2 * c + 1) * k + r]
        n = math.sqrt(n2)
        d = s / n
        a = g[r] / n
        dg[r] = d
        coef[r] = a
        coef[k + r] = a * (d / n)


@jit("void(float32[::1], float32[::1], float32[::1])", writes=("w",))
def scale_taps_kernel(v, scale, w):
    """w[e] = scale[r] * v[e], r = e % k (the tap of flat element e)."""
    k = scale.size
    for e in range(cuda.grid(1), v.size, cuda.gridsize(1)):
        w[e] = scale[e % k] * v[e]


@jit("void(float32[::1], float32[::1], float32[::1], float32[::1])", writes=("dv",))
def weight_norm_bwd_kernel(v, dw, coef, dv):
    """dv[e] = coef[r] * dw[e] - coef[k + r] * v[e], r = e % k."""
    k = coef.size // 2
    for e in range(cuda.grid(1), v.size, cuda.gridsize(1)):
        r = e % k
        dv[e] = coef[r] * dw[e] - coef[k + r] * v[e]


_GROUPED_ALL = GPU_GROUPED_TILES + GPU_GROUPED_MMA_TILES + (
    SIM_GROUPED_TILES + SIM_GROUPED_MMA_TILES if backend.SIMULATOR else ())
_FWD = {t: make_grouped_kernel(t, False) for t in _GROUPED_ALL}
_BWD_DATA = {t: make_grouped_kernel(t, True) for t in _GROUPED_ALL}
_WGRAD = {t: make_grouped_wgrad_kernel(t)
          for t in GPU_GROUPED_WGRAD_TILES + (SIM_GROUPED_WGRAD_TILES if backend.SIMULATOR else ())}


# ---------------------------------------------------------------------------- feature encoder
def _check_encoder(x_shape, w, stride, w_name: str):
    """(stride, K, k, T_out) of a groups-1 unpadded conv1d of x_shape by w (checked)."""
    stride = _check.positive("stride", stride)
    _check.device_array(w_name, w, ndim=3)
    B, C, T = x_shape
    K, Cw, k = w.shape
    if Cw != C:
        raise ValueError(f"{w_name}: expected {C} input channels (shape (K, {C}, k)), "
                         f"got {tuple(w.shape)}")
    T_out = conv1d_out_size(T, k, stride)
    if T_out <= 0:
        raise ValueError(f"{w_name}: a {k}-tap kernel does not fit {T} frames")
    return stride, K, k, T_out


def conv1d(x, w, b, out, *, stride=1, stream=0):
    """out (B, K, (T - k)//stride + 1) = conv1d(x, w) + b: x (B, C, T), w (K, C, k), b (K,)
    or None; groups 1, no padding (kernels.conv.conv2d on one-pixel-high views)."""
    _check.device_array("x", x, ndim=3)
    stride, K, k, T_out = _check_encoder(x.shape, w, stride, "w")
    B, C, T = x.shape
    _check.device_array("out", out, shape=(B, K, T_out))
    if b is not None:
        _check.device_array("b", b, shape=(K,))
    _check.separate({"out": out}, {"x": x, "w": w, "b": b})
    conv.conv2d(backend.reshaped(x, (B, C, 1, T)), backend.reshaped(w, (K, C, 1, k)), b,
                backend.reshaped(out, (B, K, 1, T_out)), stride=stride, stream=stream)


def conv1d_bwd_data(dy, w, dx, *, stride=1, stream=0):
    """dx (B, C, T) = gradient of conv1d's input (overwritten). dy (B, K, T_out), w (K, C, k)."""
    _check.device_array("dx", dx, ndim=3)
    stride, K, k, T_out = _check_encoder(dx.shape, w, stride, "w")
    B, C, T = dx.shape
    _check.device_array("dy", dy, shape=(B, K, T_out))
    _check.separate({"dx": dx}, {"dy": dy, "w": w})
    conv.conv2d_bwd_data(backend.reshaped(dy, (B, K, 1, T_out)), backend.reshaped(w, (K, C, 1, k)),
                         backend.reshaped(dx, (B, C, 1, T)), stride=stride, stream=stream)


def conv1d_bwd_weight(x, dy, dw, db, *, stride=1, stream=0):
    """dw (K, C, k) and db (K,) or None = gradients of conv1d's weight and bias (overwritten).
    x (B, C, T) is the forward input, dy (B, K, T_out). Where kernels.conv splits the
    reduction, its partials go to scratch from backend.empty ("conv1d_wgrad_partials")."""
    _check.device_array("x", x, ndim=3)
    stride, K, k, T_out = _check_encoder(x.shape, dw, stride, "dw")
    B, C, T = x.shape
    _check.device_array("dy", dy, shape=(B, K, T_out))
    if db is not None:
        _check.device_array("db", db, shape=(K,))
    _check.separate({"dw": dw, "db": db}, {"x": x, "dy": dy})
    x4, w_shape = backend.reshaped(x, (B, C, 1, T)), (K, C, 1, k)
    size = conv.wgrad_workspace_size(x4.shape, w_shape, stride=stride)
    workspace = backend.empty((size,), np.float32, "conv1d_wgrad_partials") if size else None
    conv.conv2d_bwd_weight(x4, backend.reshaped(dy, (B, K, 1, T_out)),
                           backend.reshaped(dw, w_shape), db, stride=stride,
                           workspace=workspace, stream=stream)


# ---------------------------------------------------------------------------- grouped
def _check_grouped(x_shape, w, T_out: int, groups, pad, w_name: str):
    """Checks a grouped conv of x_shape (B, C, T) by w (K, C/groups, k) with T_out output
    frames; returns (groups, pad, K, Cr, k)."""
    groups = _check.positive("groups", groups)
    pad = _check.integer("pad", pad, at_least=0)
    _check.device_array(w_name, w, ndim=3)
    B, C, T = x_shape
    K, Cr, k = w.shape
    if C % groups or K % groups:
        raise ValueError(f"groups: {groups} does not divide the {C} input and {K} output "
                         "channels")
    if Cr * groups != C:
        raise ValueError(f"{w_name}: expected {C // groups} input channels a group (shape "
                         f"(K, {C // groups}, k) for {groups} groups of {C}), got {tuple(w.shape)}")
    most = conv1d_out_size(T, k, 1, pad)
    if not 1 <= T_out <= most:
        raise ValueError(f"T_out: {T} frames padded by {pad} on both sides give at most {most} "
                         f"frames of a {k}-tap kernel (and at least 1), got {T_out}")
    if max(B * C * T, B * K * T_out, w.size, k + pad + T_out, T + pad) > _MAX_INDEX:
        raise ValueError("conv1d_grouped: tensors beyond 2**31 elements are not supported")
    if B * groups > _MAX_GRID_Z:
        raise ValueError(f"conv1d_grouped: batch x groups ({B * groups}) beyond {_MAX_GRID_Z}")
    return groups, pad, K, Cr, k


def _launch_grouped(kernel_table, tiles, src, w, bias, dst, groups, k, pad, stream):
    B, C_src, T_src = src.shape
    _, C_dst, T_dst = dst.shape
    t = GROUPED_TILE if tiles is None else tiles
    if t not in kernel_table:
        raise ValueError(f"tiles: {t} is not built; choose from {sorted(kernel_table)}")
    flat_w = backend.reshaped(w, (w.size,))
    frames, channels = (t.bm, t.bn) if isinstance(t, Tiles) else (t.rows, t.cols)
    grid = (-(-T_dst // frames), -(-(C_dst // groups) // channels), B * groups)
    launch(kernel_table[t], grid, t.threads,
           (backend.reshaped(src, (src.size,)), flat_w, flat_w if bias is None else bias,
            int(bias is not None), backend.reshaped(dst, (dst.size,)), B, C_src, T_src, C_dst,
            T_dst, groups, k, pad), stream)


def conv1d_grouped(x, w, b, out, *, groups, pad, tiles=None, stream=0):
    """out (B, K, T_out) = grouped conv1d of x (B, C, T) by w (K, C/groups, k), padded by `pad`
    zero frames on both sides, + b (K,) (or None); the first T_out of its frames,
    1 <= T_out <= T + 2*pad - k + 1 (Wav2Vec2's positional conv: T_out = T, dropping the last
    of the T + 1 frames its even kernel gives). `tiles` forces a tile shape (tests)."""
    _check.device_array("x", x, ndim=3)
    _check.device_array("out", out, ndim=3)
    groups, pad, K, Cr, k = _check_grouped(x.shape, w, out.shape[2], groups, pad, "w")
    _check.device_array("out", out, shape=(x.shape[0], K, out.shape[2]))
    if b is not None:
        _check.device_array("b", b, shape=(K,))
    _check.separate({"out": out}, {"x": x, "w": w, "b": b})
    _launch_grouped(_FWD, tiles, x, w, b, out, groups, k, pad, stream)


def conv1d_grouped_bwd_data(dy, w, dx, *, groups, pad, tiles=None, stream=0):
    """dx (B, C, T) = gradient of conv1d_grouped's input (overwritten); dy (B, K, T_out)."""
    _check.device_array("dx", dx, ndim=3)
    _check.device_array("dy", dy, ndim=3)
    groups, pad, K, Cr, k = _check_grouped(dx.shape, w, dy.shape[2], groups, pad, "w")
    _check.device_array("dy", dy, shape=(dx.shape[0], K, dy.shape[2]))
    _check.separate({"dx": dx}, {"dy": dy, "w": w})
    _launch_grouped(_BWD_DATA, tiles, dy, w, None, dx, groups, k, k - 1 - pad, stream)


class _GroupedWgradPlan(NamedTuple):
    tiles: GroupTiles
    grid: tuple      # before splitting: (tap tiles, output channel tiles, C)
    splits: int
    steps: int       # (batch, frame chunk) steps a split


def _grouped_wgrad_plan(B, C, K, T_out, groups, k, tiles, splits) -> _GroupedWgradPlan:
    """The weight gradient's launch: a block per (tap tile, output channel tile, input
    channel), its B * ceil(T_out / depth) steps split `splits` ways (on a GPU, by
    kernels.conv.wgrad_splits: enough blocks for the device, at least 8 steps a block)."""
    t = (SIM_GROUPED_WGRAD_TILES if backend.SIMULATOR else GPU_GROUPED_WGRAD_TILES)[0] \
        if tiles is None else tiles
    if t not in _WGRAD:
        raise ValueError(f"tiles: {t} is not built; choose from {sorted(_WGRAD)}")
    grid = (-(-k // t.rows), -(-(K // groups) // t.cols), C)
    total = B * -(-T_out // t.depth)
    if splits is not None:
        n = _check.positive("splits", splits)
    elif backend.SIMULATOR:
        n = 1
    else:
        kernel = _WGRAD[t]
        n = conv.wgrad_splits(math.prod(grid), total * t.depth, t.depth,
                              _check.resident_blocks(kernel, t.threads), _check.sm_count())
    steps = -(-total // min(n, total))
    n = -(-total // steps)
    if n * C > _MAX_GRID_Z:
        raise ValueError(f"splits: {n} splits of {C} channels exceed the grid's {_MAX_GRID_Z}")
    return _GroupedWgradPlan(t, grid, n, steps)


def conv1d_grouped_bwd_weight(x, dy, dw, db, *, groups, pad, tiles=None, splits=None,
                              stream=0):
    """dw (K, C/groups, k) and db (K,) or None = gradients of conv1d_grouped's weight and bias
    (overwritten); x (B, C, T) the forward input, dy (B, K, T_out). `splits` forces the split
    of the reduction over (batch, frames) (tests); split, the partials go to scratch from
    backend.empty ("conv1d_grouped_wgrad_partials") and are added in split order."""
    _check.device_array("x", x, ndim=3)
    _check.device_array("dy", dy, ndim=3)
    groups, pad, K, Cr, k = _check_grouped(x.shape, dw, dy.shape[2], groups, pad, "dw")
    B, C, T = x.shape
    T_out = dy.shape[2]
    _check.device_array("dy", dy, shape=(B, K, T_out))
    if db is not None:
        _check.device_array("db", db, shape=(K,))
    _check.separate({"dw": dw, "db": db}, {"x": x, "dy": dy})
    plan = _grouped_wgrad_plan(B, C, K, T_out, groups, k, tiles, splits)
    flat_dw = backend.reshaped(dw, (dw.size,))
    part = flat_dw if plan.splits == 1 else \
        backend.empty((plan.splits * dw.size,), np.float32, "conv1d_grouped_wgrad_partials")
    gx, gy, gz = plan.grid
    flat_dy = backend.reshaped(dy, (dy.size,))
    launch(_WGRAD[plan.tiles], (gx, gy, gz * plan.splits), plan.tiles.threads,
           (backend.reshaped(x, (x.size,)), flat_dy, part, B, C, T, K, T_out, groups, k, pad,
            plan.steps), stream)
    if plan.splits > 1:
        launch(sum_splits_kernel, *_check.grid_stride_launch(dw.size), (part, flat_dw, plan.splits),
               stream)
    if db is not None:
        launch(bias_grad_kernel, K, _RED_THREADS, (flat_dy, db, B, K, T_out), stream)


def conv1d_grouped_flops(B: int, C: int, K: int, T_out: int, k: int, groups: int) -> float:
    """Multiply-adds x 2 of one pass (forward, backward-data and backward-weight alike)."""
    return 2.0 * B * K * T_out * (C // groups) * k


# ---------------------------------------------------------------------------- weight norm
def _check_weight_norm(v, g):
    _check.device_array("v", v, ndim=3)
    k = v.shape[2]
    _check.device_array("g", g, shape=(1, 1, k))
    if v.size > _MAX_INDEX:
        raise ValueError("weight_norm: v beyond 2**31 elements is not supported")
    return v.shape[0] * v.shape[1], k


def _tap_sums(v, dw, rows, k, stream):
    """Per-tap sums of v^2 (and v * dw, dw not None) over row chunks: (partials, chunks)."""
    chunks = min(2, rows) if backend.SIMULATOR else max(1, min(64, rows // (16 * _WN_WARPS)))
    chunk = -(-rows // chunks)
    chunks = -(-rows // chunk)
    part = backend.empty((chunks * 2 * k,), np.float32, "weight_norm_partials")
    flat_v = backend.reshaped(v, (v.size,))
    launch(tap_sums_kernel, (-(-k // _WN_LANES), chunks), _WN_LANES * _WN_WARPS,
           (flat_v, flat_v if dw is None else backend.reshaped(dw, (dw.size,)), part,
            int(dw is not None), rows, k, chunk), stream)
    return part, chunks


def weight_norm(v, g, w, *, stream=0):
    """w = g * v / ||v|| (torch.nn.utils.weight_norm(conv, dim=2)): v, w (K, C/groups, k),
    g (1, 1, k); the norm over dims (0, 1) for each tap. A tap whose v is all zero gives
    inf or NaN, as in PyTorch."""
    rows, k = _check_weight_norm(v, g)
    _check.device_array("w", w, shape=v.shape)
    _check.separate({"w": w}, {"v": v, "g": g})
    part, chunks = _tap_sums(v, None, rows, k, stream)
    scale = backend.empty((k,), np.float32, "weight_norm_scale")
    launch(norm_scale_kernel, *_check.grid_stride_launch(k),
           (part, backend.reshaped(g, (k,)), scale, chunks), stream)
    launch(scale_taps_kernel, *_check.grid_stride_launch(v.size),
           (backend.reshaped(v, (v.size,)), scale, backend.reshaped(w, (w.size,))), stream)


def weight_norm_bwd(v, g, dw, dv, dg, *, stream=0):
    """dv (like v) and dg (1, 1, k) = gradients of weight_norm's v and g from dw, the gradient
    of its w (overwritten): dg = sum(dw * v) / n, dv = g / n * (dw - dg / n * v) per tap."""
    rows, k = _check_weight_norm(v, g)
    _check.device_array("dw", dw, shape=v.shape)
    _check.device_array("dv", dv, shape=v.shape)
    _check.device_array("dg", dg, shape=(1, 1, k))
    _check.separate({"dv": dv, "dg": dg}, {"v": v, "g": g, "dw": dw})
    part, chunks = _tap_sums(v, dw, rows, k, stream)
    coef = backend.empty((2 * k,), np.float32, "weight_norm_coef")
    launch(norm_grad_scale_kernel, *_check.grid_stride_launch(k),
           (part, backend.reshaped(g, (k,)), coef, backend.reshaped(dg, (k,)), chunks), stream)
    launch(weight_norm_bwd_kernel, *_check.grid_stride_launch(v.size),
           (backend.reshaped(v, (v.size,)), backend.reshaped(dw, (dw.size,)), coef,
            backend.reshaped(dv, (dv.size,))), stream)
