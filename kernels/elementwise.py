"""Elementwise ops: GELU (tanh approximation, as GPT-2) and residual add.

Grid-stride loops over the flattened arrays, so any launch size covers any length. Arrays
are float32 or float16 (one kernel source, a kernel per storage dtype: `jit_per_dtype`); the
arithmetic is float32 either way, and a float16 result is rounded once, as it is stored.
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check
from proto.device.backend import cuda, jit_per_dtype, launch

THREADS = 256
GELU_C = math.sqrt(2.0 / math.pi)
# The kernels' constants are float32: a Python float would make the arithmetic float64 (the
# H200 ran this GELU 3x slower than torch's, its tanh in double precision).
_HALF, _ONE = np.float32(0.5), np.float32(1.0)
_GELU_C, _GELU_A = np.float32(GELU_C), np.float32(0.044715)


# ---------------------------------------------------------------------------- references
def gelu_ref(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return (0.5 * x * (1.0 + np.tanh(GELU_C * (x + 0.044715 * x ** 3)))).astype(np.float32)


def add_ref(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a + b).astype(np.float32)


# ---------------------------------------------------------------------------- kernels
@cuda.jit(device=True)
def gelu_f32(v):
    """GPT-2's tanh GELU of a float32, in float32 (also the GEMM epilogue's)."""
    return _HALF * v * (_ONE + math.tanh(_GELU_C * (v + _GELU_A * v * v * v)))


# Each pass of a thread's grid-stride loop loads UNROLL elements (a grid apart, so each load
# is still coalesced across the warp) before it computes and stores any: UNROLL loads in
# flight per thread instead of one. A full grid is about one wave of the GPU, and one load
# a thread in flight is about a third of the bytes that hide HBM's latency at full bandwidth.
UNROLL = 4


@jit_per_dtype("void({t}[::1], {t}[::1])", writes=("out",), in_place=(("out", "x"),))
def gelu_kernels(x, out):
    start, stride, n = cuda.grid(1), cuda.gridsize(1), x.size
    v = cuda.local.array(UNROLL, np.float32)
    for base in range(start, n, stride * UNROLL):
        for k in range(UNROLL):
            i = base + k * stride
            v[k] = x[i] if i < n else _ONE
        for k in range(UNROLL):
            i = base + k * stride
            if i < n:
                out[i] = gelu_f32(v[k])


@jit_per_dtype("void({t}[::1], {t}[::1], {t}[::1])", writes=("out",),
               in_place=(("out", "a"), ("out", "b")))
def add_kernels(a, b, out):
    start, stride, n = cuda.grid(1), cuda.gridsize(1), a.size
    va = cuda.local.array(UNROLL, np.float32)
    vb = cuda.local.array(UNROLL, np.float32)
    for base in range(start, n, stride * UNROLL):
        for k in range(UNROLL):
            i = base + k * stride
            va[k] = a[i] if i < n else _ONE
            vb[k] = b[i] if i < n else _ONE
        for k in range(UNROLL):
            i = base + k * stride
            if i < n:
                out[i] = va[k] + vb[k]


# ---------------------------------------------------------------------------- launchers
def _blocks(n: int) -> int:
    return min((n + THREADS - 1) // THREADS, 1024)


def gelu(x, out, stream=0):
    """out = gelu(x), elementwise; `out` may be `x` (in place). x and out of one dtype,
    float32 or float16."""
    dtype = _check.float_dtype("x", x)
    _check.device_array("x", x, dtype=dtype)
    _check.device_array("out", out, dtype=dtype)
    _check.same_shape([("x", x), ("out", out)])
    launch(gelu_kernels[dtype], _blocks(x.size), THREADS, (x.reshape(x.size), out.reshape(out.size)), stream)


def add(a, b, out, stream=0):
    """out = a + b, elementwise; `out` may alias `a` or `b` (residual add in place). All
    three of one dtype, float32 or float16."""
    dtype = _check.float_dtype("a", a)
    for name, arr in (("a", a), ("b", b), ("out", out)):
        _check.device_array(name, arr, dtype=dtype)
    _check.same_shape([("a", a), ("b", b), ("out", out)])
    launch(add_kernels[dtype], _blocks(a.size), THREADS,
           (a.reshape(a.size), b.reshape(b.size), out.reshape(out.size)), stream)
