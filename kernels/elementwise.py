"""Elementwise ops: GELU (tanh approximation, as GPT-2), exact (erf) GELU forward and backward
(torch's default, as Wav2Vec2), and residual add.

Grid-stride loops over the flattened arrays, so any launch size covers any length. The tanh
GELU and the add take float32 or float16 (one kernel source, a kernel per storage dtype:
`jit_per_dtype`); the arithmetic is float32 either way, and a float16 result is rounded once,
as it is stored. The exact GELU is float32 only.
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check
from proto.device.backend import cuda, jit, jit_per_dtype, launch, reshaped

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


# ---------------------------------------------------------------------------- exact GELU
# torch's default GELU (nn.functional.gelu, approximate="none"): x Phi(x), Phi the standard
# normal CDF, and its derivative Phi(x) + x phi(x). Phi(x) = erfc(-x / sqrt 2) / 2 is torch's
# (1 + erf(x / sqrt 2)) / 2 in exact arithmetic; in float32 erfc keeps its relative accuracy
# in the negative tail, where 1 + erf cancels (gelu(-5) ~ -1.4e-6 in the one, an absolute
# error of ~1e-7 in the other). float32 only.
_SQRT_HALF = np.float32(math.sqrt(0.5))
_INV_SQRT_2PI = np.float32(1.0 / math.sqrt(2.0 * math.pi))


def _gelu_erf64(x):
    x = np.asarray(x, np.float64)
    cdf = 0.5 * np.vectorize(math.erfc, otypes=[np.float64])(-x / math.sqrt(2.0))
    return x, cdf


def gelu_erf_ref(x: np.ndarray, dtype=np.float32) -> np.ndarray:
    """x Phi(x), computed in float64, returned as `dtype` (float64 for finite differences)."""
    x, cdf = _gelu_erf64(x)
    return (x * cdf).astype(dtype)


def gelu_erf_bwd_ref(x: np.ndarray, dy: np.ndarray, dtype=np.float32) -> np.ndarray:
    """dy (Phi(x) + x phi(x)), computed in float64, returned as `dtype`."""
    x, cdf = _gelu_erf64(x)
    pdf = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return (np.asarray(dy, np.float64) * (cdf + x * pdf)).astype(dtype)


@cuda.jit(device=True)
def gelu_erf_f32(v):
    """Exact GELU of a float32, in float32."""
    return _HALF * v * math.erfc(-v * _SQRT_HALF)


@cuda.jit(device=True)
def gelu_erf_grad_f32(v):
    """d gelu_erf / dx at a float32, in float32: Phi(v) + v phi(v)."""
    return _HALF * math.erfc(-v * _SQRT_HALF) + v * _INV_SQRT_2PI * math.exp(-_HALF * v * v)


@jit("void(float32[::1], float32[::1])", writes=("out",), in_place=(("out", "x"),))
def gelu_erf_kernel(x, out):
    start, stride, n = cuda.grid(1), cuda.gridsize(1), x.size
    v = cuda.local.array(UNROLL, np.float32)
    for base in range(start, n, stride * UNROLL):
        for k in range(UNROLL):
            i = base + k * stride
            v[k] = x[i] if i < n else _ONE
        for k in range(UNROLL):
            i = base + k * stride
            if i < n:
                out[i] = gelu_erf_f32(v[k])


@jit("void(float32[::1], float32[::1], float32[::1])", writes=("dx",),
     in_place=(("dx", "dy"), ("dx", "x")))
def gelu_erf_bwd_kernel(x, dy, dx):
    start, stride, n = cuda.grid(1), cuda.gridsize(1), x.size
    vx = cuda.local.array(UNROLL, np.float32)
    vg = cuda.local.array(UNROLL, np.float32)
    for base in range(start, n, stride * UNROLL):
        for k in range(UNROLL):
            i = base + k * stride
            vx[k] = x[i] if i < n else _ONE
            vg[k] = dy[i] if i < n else _ONE
        for k in range(UNROLL):
            i = base + k * stride
            if i < n:
                dx[i] = vg[k] * gelu_erf_grad_f32(vx[k])


def gelu_erf(x, out, stream=0):
    """out = x Phi(x) (torch's exact GELU), elementwise over any shape; `out` may be `x` (in
    place). float32."""
    _check.device_array("x", x)
    _check.device_array("out", out)
    _check.same_shape([("x", x), ("out", out)])
    launch(gelu_erf_kernel, _blocks(x.size), THREADS,
           (reshaped(x, (x.size,)), reshaped(out, (out.size,))), stream)


def gelu_erf_bwd(x, dy, dx, stream=0):
    """dx = dy (Phi(x) + x phi(x)): the gradient through `gelu_erf` at its input x. `dx` may
    be `dy` or `x` (in place: each element is read before it is written). float32, one shape."""
    for name, arr in (("x", x), ("dy", dy), ("dx", dx)):
        _check.device_array(name, arr)
    _check.same_shape([("x", x), ("dy", dy), ("dx", dx)])
    launch(gelu_erf_bwd_kernel, _blocks(x.size), THREADS,
           (reshaped(x, (x.size,)), reshaped(dy, (dy.size,)), reshaped(dx, (dx.size,))), stream)
