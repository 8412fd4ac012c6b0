"""A decoder layer's self-attention as GPT-2 runs it: qkv = x @ W + b, then attention over
the KV cache (`kernels.attention`), in as few launches as the shapes allow.

    self_attention(x, w, bias, k_cache, v_cache, pos, out, n_head=H, rows=None)

Where the attention tile serves the step (decode: splits of up to 64 positions of head dims
up to 64, `attention.takes_partials`), the projection writes its K-split partial sums
(`gemm.partials`: 64-column tiles, K split, 216 blocks at GPT-2 small's 768 x 2304) and the
tile adds them and the bias as it loads q, k and v: no reduction launch, where the whole-K
kernel that needs none took 8 us to read the 7 MB weight. Otherwise (prefill, longer
splits) `gemm.gemm` writes qkv and attention reads it. On the H200 the first way took 5% off
GPT-2 small's step and off a whole generation (results/h200/profiles/ab_qkv_partials_*.txt).

qkv (or its partials) is scratch of this call (`proto.device.backend.empty`): inside a recorded
graph, a buffer of the description that the memory planner places.
"""
from __future__ import annotations

import numpy as np

from kernels import _check, attention, gemm
from proto.device import backend


def self_attention(x, w, bias, k_cache, v_cache, pos, out, *, n_head, rows=None,
                   stream=0, tile: bool = True) -> None:
    """out (B, T, C) = attention(x (B, T, C) @ w (C, 3C) + bias (3C,)) over the caches
    (B, H, Tmax, hd), whose positions pos..pos+T-1 get this step's k and v; pos, rows, the
    guard and `tile` as `attention.attention`."""
    _check.device_array("x", x, ndim=3)
    B, T, C = x.shape
    _check.device_array("w", w, shape=(C, 3 * C))
    N = B * T
    x2 = backend.reshaped(x, (N, C))
    parts = gemm.partial_splits(3 * C, C)
    if N <= gemm.DECODE_MAX_M and attention.takes_partials(k_cache, v_cache, T, rows, parts,
                                                                 tile=tile):
        qkv = backend.empty((parts, B, T, 3 * C), np.float32, "self_attention.qkv_partials")
        gemm.partials(x2, w, backend.reshaped(qkv, (parts, N, 3 * C)), stream=stream)
        qkv_bias = bias
    else:
        qkv = backend.empty((B, T, 3 * C), np.float32, "self_attention.qkv")
        gemm.gemm(x2, w, backend.reshaped(qkv, (N, 3 * C)), bias=bias, stream=stream)
        qkv_bias = None
    attention.attention(qkv, k_cache, v_cache, pos, out, n_head=n_head, rows=rows,
                        qkv_bias=qkv_bias, stream=stream, tile=tile)
