"""GPT-J's rotary position embedding, applied in place to the q and k of a fused projection.

    rotary(qkv, pos, n_head=H, rotary_dim=R)

qkv (B, T, 3C) holds q | k | v per token, head h at [h*hd:(h+1)*hd] of each; the token at
step t sits at position pos[0] + t, read on the device (one launch configuration, and one
graph, serves every position). In the first R dimensions of every head of q and of k, the
pair of neighbours (2i, 2i+1) turns by the angle p * 10000^(-2i/R), as complex
multiplication by e^(i angle) ("rotate every two"); v and the dimensions from R on are not
touched. The angle is float32, as transformers computes GPT-J's table of sines and cosines:
at position p it is off by up to a few float32 units of p radians (1e-4 at 2048), the same
in both. It is reduced to [-pi, pi] (Cody-Waite: 2 pi in a short leading part, exact in
k * 2 pi for k < 2^16, and the rest) and turned into a cosine and a sine by the hardware's
approximations (within 2^-21.4 there): libdevice's cosf and sinf carry a float64 path for
huge arguments, and no kernel here computes in float64.

A block a row's head of q or of k (grid B*T x 2H), a thread a pair: a decode step's few rows
spread over many SMs, where a block a row left GPT-J's beam of 5 on 5 SMs, each thread's
turns waiting on one another's loads (6.5 us a launch on the H100). float32 or float16
(computed in float32, rounded once as it is stored).
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check
from proto.device.backend import cuda, fast_cosf, fast_sinf, jit_per_dtype, launch, rintf

BASE = 10000.0
_BASE = np.float32(BASE)   # (a Python float would make the arithmetic float64)
_TWO_PI_HI = np.float32(6.28125)                    # 8 significant bits
_TWO_PI_LO = np.float32(2 * math.pi - 6.28125)
_INV_TWO_PI = np.float32(1 / (2 * math.pi))


@jit_per_dtype("void({t}[:, :, ::1], int32[::1], int32, int32)", writes=("qkv",))
def rotary_kernels(qkv, pos, n_head, rotary_dim):
    T = qkv.shape[1]
    row, which_head = cuda.blockIdx.x, cuda.blockIdx.y   # (q | k) * n_head + head
    b, t = row // T, row % T
    half = rotary_dim // 2
    hd = qkv.shape[2] // (3 * n_head)
    p = np.float32(np.int32(pos[0] + t))   # (int32 first: an int64 converts through float64)
    for i in range(cuda.threadIdx.x, half, cuda.blockDim.x):
        angle = p * math.pow(_BASE, np.float32(np.int32(-2 * i)) / np.float32(rotary_dim))
        k = rintf(angle * _INV_TWO_PI)
        r = (angle - k * _TWO_PI_HI) - k * _TWO_PI_LO
        c, s = fast_cosf(r), fast_sinf(r)
        j = which_head * hd + 2 * i   # (q's heads, then k's: k starts at n_head * hd)
        x, y = np.float32(qkv[b, t, j]), np.float32(qkv[b, t, j + 1])
        qkv[b, t, j] = x * c - y * s
        qkv[b, t, j + 1] = x * s + y * c


def rotary(qkv, pos, *, n_head, rotary_dim, stream=0) -> None:
    """Rotate q and k of qkv (B, T, 3C) in place at positions pos[0] + t (see the module
    doc). pos: device int32 (1,). rotary_dim even, at most the head dim."""
    dtype = _check.float_dtype("qkv", qkv)
    _check.device_array("qkv", qkv, dtype=dtype, ndim=3)
    _check.device_array("pos", pos, dtype=np.int32, shape=(1,))
    B, T, C3 = qkv.shape
    n_head = _check.positive("n_head", n_head)
    if C3 % (3 * n_head):
        raise ValueError(f"qkv: last dim {C3} must be 3 * C with C a multiple of n_head={n_head}")
    hd = C3 // (3 * n_head)
    rotary_dim = _check.positive("rotary_dim", rotary_dim, at_most=hd)
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected an even number, got {rotary_dim}")
    launch(rotary_kernels[dtype], (B * T, 2 * n_head),
           _check.warp_threads(min(rotary_dim // 2, 256)),
           (qkv, pos, np.int32(n_head), np.int32(rotary_dim)), stream)
