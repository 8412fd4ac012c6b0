"""Layer normalization over the last axis: out = (x - mean) / sqrt(var + eps) * gamma + beta.

GPT-2's decode step normalizes every row in the launch that writes it (the embedding, the
attention projection's split-K reduction, the MLP's sum: their `ln_out`); this standalone
kernel serves the rest: rows those fused paths do not take, and `gemm(..., ln_out=...)`
outside the decode path.

Rows of up to 1024 run a warp a row, the row in the lanes' registers, reduced by shuffles
(kernels._reduce.WARP_ELEMS); wider rows a block a row. Two passes over the row: the mean,
then the mean of (x - mean)^2, which avoids the cancellation of E[x^2] - mean^2 on rows with
a large mean.

x, gamma, beta and out are float32 or float16 (one dtype a launch); the statistics and the
normalization are float32 either way, and a float16 result is rounded once, as it is stored.
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check
from kernels._reduce import (WARP_ELEMS, block_allreduce, warp_allreduce, warp_elems, warp_grid,
                             warp_row)
from proto.device import backend
from proto.device.backend import cuda, jit_per_dtype, launch

MAX_THREADS = 256 if not backend.SIMULATOR else 32  # simulated threads cost ~1 ms each
MIN_THREADS = 32 if not backend.SIMULATOR else 1    # a warp reads a row segment coalesced
ELEMS_PER_THREAD = 8  # elements per thread that amortise a block's reductions
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)


# ---------------------------------------------------------------------------- reference
def layernorm_ref(x, gamma, beta, eps: float = 1e-5) -> np.ndarray:
    x = np.asarray(x, np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return ((x - mean) / np.sqrt(var + eps) * gamma + beta).astype(np.float32)


# ---------------------------------------------------------------------------- kernels
_SIGNATURE = "void({t}[:, ::1], {t}[::1], {t}[::1], {t}[:, ::1], float32)"


@jit_per_dtype(_SIGNATURE, writes=("out",), in_place=(("out", "x"),))
def layernorm_kernels(x, gamma, beta, out, eps):
    # Warp butterflies then the warps in order (one barrier a reduction, not one a tree level);
    # the two sums use separate halves of red, so the second needs no barrier before it.
    red = cuda.shared.array(64, np.float32)
    row, t, step = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    n = x.shape[1]
    inv_n = _ONE / np.float32(n)
    s = _ZERO
    for j in range(t, n, step):
        s += x[row, j]
    mean = block_allreduce(s, False, red, 0) * inv_n
    s = _ZERO
    for j in range(t, n, step):
        d = x[row, j] - mean
        s += d * d
    rstd = _ONE / math.sqrt(block_allreduce(s, False, red, 32) * inv_n + eps)
    # Each element is read and written by the same thread after every reduction, so out may be x.
    for j in range(t, n, step):
        out[row, j] = (x[row, j] - mean) * rstd * gamma[j] + beta[j]


def _make_layernorm_warp_kernel(E: int):
    E2 = 2 * E   # (local array sizes must be plain constants)
    @jit_per_dtype(_SIGNATURE, writes=("out",), in_place=(("out", "x"),))
    def layernorm_warp_kernels(x, gamma, beta, out, eps):
        vals = cuda.local.array(E, np.float32)
        gb = cuda.local.array(E2, np.float32)   # gamma, beta: loaded before any store
        r, lane, here = warp_row(x.shape[0])
        n = x.shape[1]
        inv_n = _ONE / np.float32(n)
        s = _ZERO
        for i in range(E):
            j = lane + i * 32
            v = x[r, j] if here and j < n else _ZERO
            jj = min(j, n - 1)
            gb[i] = gamma[jj]
            gb[E + i] = beta[jj]
            vals[i] = v
            s += v
        mean = warp_allreduce(s, False) * inv_n
        s = _ZERO
        for i in range(E):
            if lane + i * 32 < n:
                d = vals[i] - mean
                s += d * d
        rstd = _ONE / math.sqrt(warp_allreduce(s, False) * inv_n + eps)
        if here:
            for i in range(E):   # each element written by the lane that read it: out may be x
                j = lane + i * 32
                if j < n:   # (a load here would wait for the store before it)
                    out[r, j] = (vals[i] - mean) * rstd * gb[i] + gb[E + i]
    return layernorm_warp_kernels


_LAYERNORM_WARP = {E: _make_layernorm_warp_kernel(E) for E in WARP_ELEMS}


# ---------------------------------------------------------------------------- launcher
def block_threads(n: int, at_most: int) -> int:
    """Threads per block for a row of n: a power of two (the tree reductions need one) giving
    each thread about ELEMS_PER_THREAD elements, at least a warp on a GPU, at most `at_most`.
    Fewer, busier threads matter: on the H200, softmax over 61440 rows of 1024 with a thread
    per element spent 1.4 ms in its 10-level reductions (PyTorch: 0.17 ms)."""
    want = -(-n // ELEMS_PER_THREAD)
    return min(at_most, max(MIN_THREADS, 1 << max(0, (want - 1).bit_length())))


def layernorm(x, gamma, beta, out, *, eps=1e-5, stream=0):
    """out = layernorm(x) over the last axis; x, out (R, C); gamma, beta (C,). out may be x
    (the very same array); any other overlap of out with x, gamma or beta is refused. All
    four of one dtype, float32 or float16."""
    dtype = _check.float_dtype("x", x)
    _check.device_array("x", x, dtype=dtype, ndim=2)
    rows, cols = x.shape
    _check.device_array("gamma", gamma, dtype=dtype, shape=(cols,))
    _check.device_array("beta", beta, dtype=dtype, shape=(cols,))
    _check.device_array("out", out, dtype=dtype, shape=(rows, cols))
    if not (isinstance(eps, (float, int)) and eps > 0):
        raise ValueError(f"eps: expected a positive number, got {eps!r}")
    if rows > 2**31 - 1:
        raise ValueError(f"x: {rows} rows exceed the grid limit")
    E = warp_elems(cols)
    if E is not None:   # a warp a row
        launch(_LAYERNORM_WARP[E][dtype], *warp_grid(rows), (x, gamma, beta, out, np.float32(eps)),
               stream)
        return
    launch(layernorm_kernels[dtype], rows, block_threads(cols, MAX_THREADS),
           (x, gamma, beta, out, np.float32(eps)), stream)
