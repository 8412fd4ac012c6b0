"""2x2 max-pooling with stride 2 (VGG's only pooling), NCHW float32, forward and backward.

Odd heights/widths drop the last row/column (floor, as PyTorch). Backward recomputes each
window's argmax from the pooling *input* instead of saving indices: VGG keeps that input
anyway (it is the in-place ReLU output that ReLU backward reads), so saving indices would
only add a tensor. Ties go to the first maximum in row-major window order, as PyTorch; a NaN
in a window is its maximum (the first NaN, for the gradient), as NumPy and PyTorch.
"""
from __future__ import annotations

import numpy as np

from kernels import _check
from proto.device.backend import cuda, jit, launch


# ---------------------------------------------------------------------------- references
def maxpool2x2_ref(x: np.ndarray) -> np.ndarray:
    N, C, H, W = x.shape
    v = x[:, :, :H // 2 * 2, :W // 2 * 2].reshape(N, C, H // 2, 2, W // 2, 2)
    return v.max(axis=(3, 5)).astype(np.float32)


def maxpool2x2_bwd_ref(x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    N, C, H, W = x.shape
    P, Q = H // 2, W // 2
    win = x[:, :, :2 * P, :2 * Q].reshape(N, C, P, 2, Q, 2).transpose(0, 1, 2, 4, 3, 5)
    first = win.reshape(N, C, P, Q, 4).argmax(axis=-1)            # first max, row-major
    onehot = np.eye(4, dtype=np.float32)[first] * dy[..., None]   # (N, C, P, Q, 4)
    dx = np.zeros_like(x, dtype=np.float32)
    dx[:, :, :2 * P, :2 * Q] = onehot.reshape(N, C, P, Q, 2, 2).transpose(0, 1, 2, 4, 3, 5).reshape(N, C, 2 * P, 2 * Q)
    return dx


# ---------------------------------------------------------------------------- kernels
@cuda.jit(device=True)
def _beats(v, best):
    """v replaces the running maximum `best`: larger, or the first NaN (NaN wins, as in
    np.max and np.argmax; max() would drop it: fmaxf on the GPU, Python's order on the
    simulator)."""
    return v > best or (v != v and best == best)


@jit("void(float32[:,:,:,::1], float32[:,:,:,::1])", writes=("out",))
def maxpool_kernel(x, out):
    N, C, P, Q = out.shape
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, out.size, stride):
        q = i % Q
        p = (i // Q) % P
        nc = i // (P * Q)
        n, c = nc // C, nc % C
        h, w = 2 * p, 2 * q
        best = x[n, c, h, w]
        for k in range(1, 4):
            v = x[n, c, h + k // 2, w + k % 2]
            if _beats(v, best):
                best = v
        out[n, c, p, q] = best


@jit("void(float32[:,:,:,::1], float32[:,:,:,::1], int32, float32[:,:,:,::1])", writes=("dx",),
     in_place=(("dx", "x"),))
def maxpool_bwd_kernel(x, dy, relu_mask, dx):
    """One thread per window: it finds the window's first maximum once and writes all four
    of its dx elements (dy there, 0 elsewhere; with relu_mask, 0 also where that maximum is
    not > 0), two adjacent pairs, so a warp's loads and stores are contiguous rows. An odd
    last row or column, in no window, gets zeros from the threads of the windows beside it.
    A thread reads its whole window before it writes, and no other thread reads it: dx may
    be x."""
    N, C, H, W = x.shape
    P, Q = dy.shape[2], dy.shape[3]
    zero = np.float32(0.0)
    start, stride = cuda.grid(1), cuda.gridsize(1)
    for i in range(start, dy.size, stride):
        q = i % Q
        row = i // Q           # (n, c, p) flattened
        p = row % P
        nc = row // P
        n, c = nc // C, nc % C
        h0, w0 = 2 * p, 2 * q
        best_k = 0
        best = x[n, c, h0, w0]
        for k in range(1, 4):
            v = x[n, c, h0 + k // 2, w0 + k % 2]
            if _beats(v, best):
                best = v
                best_k = k
        g = dy[n, c, p, q]
        if relu_mask != 0 and not best > zero:
            g = zero
        for k in range(4):
            dx[n, c, h0 + k // 2, w0 + k % 2] = g if k == best_k else zero
        if q == Q - 1 and W % 2 == 1:   # the odd last column
            dx[n, c, h0, W - 1] = zero
            dx[n, c, h0 + 1, W - 1] = zero
        if p == P - 1 and H % 2 == 1:   # the odd last row (and its corner)
            dx[n, c, H - 1, w0] = zero
            dx[n, c, H - 1, w0 + 1] = zero
            if q == Q - 1 and W % 2 == 1:
                dx[n, c, H - 1, W - 1] = zero


# ---------------------------------------------------------------------------- launchers
def maxpool2x2(x, out, *, stream=0):
    """out (N, C, H//2, W//2) = max over each 2x2 window of x (N, C, H, W)."""
    _check.device_array("x", x, ndim=4)
    N, C, H, W = x.shape
    if H < 2 or W < 2:
        raise ValueError(f"x: 2x2 pooling needs H, W >= 2, got shape {tuple(x.shape)}")
    _check.device_array("out", out, shape=(N, C, H // 2, W // 2))
    blocks, threads = _check.grid_stride_launch(out.size)
    launch(maxpool_kernel, blocks, threads, (x, out), stream)


def maxpool2x2_bwd(x, dy, dx, *, relu_mask=False, stream=0):
    """dx (N, C, H, W) = gradient of maxpool2x2 given its input x and dy (N, C, H//2, W//2).
    Every element of dx is written (rows/columns outside any window get 0).

    relu_mask: x is a ReLU's output, and dx becomes the gradient through that ReLU too,
    where(x > 0, pooling's gradient, 0) (relu_bwd fused). dx may be x itself (in place), so
    that the step never holds x and its gradient at once."""
    _check.device_array("x", x, ndim=4)
    N, C, H, W = x.shape
    _check.device_array("dy", dy, shape=(N, C, H // 2, W // 2))
    _check.device_array("dx", dx, shape=(N, C, H, W))
    blocks, threads = _check.grid_stride_launch(dy.size)
    relu_mask = _check.flag("relu_mask", relu_mask)
    launch(maxpool_bwd_kernel, blocks, threads, (x, dy, int(relu_mask), dx), stream)


def maxpool_flops(n_in: int) -> float:
    return float(n_in)
