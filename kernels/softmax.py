"""Row softmax with a device-side length, and log-softmax.

One block per row. A row of at most ELEMS_PER_THREAD elements a thread (GPT-2's attention
rows, 1024 long, on 128 threads) is read once into registers: its max and then its sum of
exp(x - max) are each one warp butterfly and one pass over the warps' results. Longer rows
keep a running (max, sum of exp(x - max)) per thread, so the row is read twice in all
(online softmax) instead of three times, the pairs combined through a shared-memory tree.
Subtracting the row max keeps exp() finite for any input.

`masked_softmax` reads the number of valid columns from a device int32 (1,) array, so one
launch configuration (and one captured CUDA graph) serves every length.
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check
from kernels._reduce import (WARP_ELEMS, block_allreduce, converged_syncthreads, warp_allreduce,
                             warp_elems, warp_grid, warp_row)
from kernels.layernorm import ELEMS_PER_THREAD, block_threads
from proto.device import backend
from proto.device.backend import cuda, jit, jit_per_dtype, launch

MAX_THREADS = 1024 if not backend.SIMULATOR else 32  # vocab-wide rows want the full block
_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)
_ONE = np.float32(1.0)
PREFETCH = 8   # elements a thread loads before using the first (a span's share, at most)


# ---------------------------------------------------------------------------- references
def masked_softmax_ref(x, length: int) -> np.ndarray:
    x = np.asarray(x, np.float64)
    length = min(max(int(length), 0), x.shape[-1])
    out = np.zeros_like(x)
    if length:
        v = x[..., :length]
        e = np.exp(v - v.max(axis=-1, keepdims=True))
        out[..., :length] = e / e.sum(axis=-1, keepdims=True)
    return out.astype(np.float32)


def log_softmax_ref(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return (shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))).astype(np.float32)


# ---------------------------------------------------------------------------- kernels
@cuda.jit(device=True)
def load_ahead(x, row, first, step, end, vals):
    """vals[q] = x[row, first + q * step] for q < PREFETCH, -inf from `end` on: all the loads
    issued before any is used (vals: a local array of PREFETCH, kept in registers since the
    constant trips unroll), so a thread waits one memory round trip for them, not one each.
    The caller then uses them in the order a plain strided loop would have read them."""
    for q in range(PREFETCH):
        j = first + q * step
        vals[q] = x[row, j] if j < end else _NEG_INF


@cuda.jit(device=True)
def _row_max_sumexp(x, row, lo, hi, buf_m, buf_s):
    """(max, sum of exp(x - max)) over x[row, lo:hi], returned to every thread of the block.
    -inf entries add nothing; a span with nothing finite gives (-inf, 0)."""
    t, step = cuda.threadIdx.x, cuda.blockDim.x
    m, s = _NEG_INF, _ZERO
    vals = cuda.local.array(PREFETCH, np.float32)
    for base in range(lo + t, hi, step * PREFETCH):   # (past `hi`, -inf adds nothing)
        load_ahead(x, row, base, step, hi, vals)
        for q in range(PREFETCH):
            v = vals[q]
            if v > m:
                s = s * math.exp(m - v) + _ONE
                m = v
            elif v != _NEG_INF:
                s += math.exp(v - m)
    buf_m[t], buf_s[t] = m, s
    # The barriers follow per-thread branches (the scan above, `t < half` below): synccheck
    # found warps arriving divergent at a plain syncthreads here.
    converged_syncthreads()
    half = step // 2
    while half > 0:
        if t < half:
            m1, s1, m2, s2 = buf_m[t], buf_s[t], buf_m[t + half], buf_s[t + half]
            mx = max(m1, m2)
            if mx != _NEG_INF:
                buf_m[t], buf_s[t] = mx, s1 * math.exp(m1 - mx) + s2 * math.exp(m2 - mx)
        converged_syncthreads()
        half //= 2
    m, s = buf_m[0], buf_s[0]
    return m, s


@cuda.jit(device=True)
def _log_shift(m, s):
    """log(sum exp(x)) from (max, sum of exp(x - max)): -inf for an empty or all -inf row
    (log(0), which the simulator's math.log would raise on), NaN for a NaN sum."""
    return m + (_NEG_INF if s == _ZERO else math.log(s))


@jit("void(float32[:, ::1], int32[::1], float32[:, ::1])", writes=("out",), in_place=(("out", "x"),))
def masked_softmax_kernel(x, length, out):
    buf_m = cuda.shared.array(MAX_THREADS, np.float32)
    buf_s = cuda.shared.array(MAX_THREADS, np.float32)
    row, t, step = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    n = x.shape[1]
    valid = min(max(length[0], 0), n)
    m, s = _row_max_sumexp(x, row, 0, valid, buf_m, buf_s)
    # s == 0 only when nothing is valid; a NaN s (a NaN in the row) makes the row NaN, as in
    # NumPy (`s > 0 and 1/s or 0` would turn it into probabilities of 0).
    inv = _ZERO if s == _ZERO else _ONE / s
    # Each element is read and written by the same thread after the reduction: out may be x.
    for j in range(t, n, step):
        out[row, j] = math.exp(x[row, j] - m) * inv if j < valid else _ZERO


@jit("void(float32[:, ::1], int32[::1], float32[:, ::1])", writes=("out",), in_place=(("out", "x"),))
def masked_softmax_in_registers_kernel(x, length, out):
    """masked_softmax_kernel for rows of at most ELEMS_PER_THREAD * blockDim.x elements."""
    red = cuda.shared.array(64, np.float32)   # [0, 32): the warps' maxima; [32, 64): sums
    vals = cuda.local.array(ELEMS_PER_THREAD, np.float32)
    row, t, step = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    n = x.shape[1]
    valid = min(max(length[0], 0), n)
    m = _NEG_INF
    for i in range(ELEMS_PER_THREAD):
        j = t + i * step
        v = x[row, j] if j < valid else _NEG_INF
        vals[i] = v
        if v > m:            # (not max(): a NaN must reach the sum, and make the row NaN)
            m = v
    m = block_allreduce(m, True, red, 0)
    s = _ZERO
    for i in range(ELEMS_PER_THREAD):
        if t + i * step < valid:
            s += math.exp(vals[i] - m)
    s = block_allreduce(s, False, red, 32)
    inv = _ZERO if s == _ZERO else _ONE / s   # as in masked_softmax_kernel
    for i in range(ELEMS_PER_THREAD):   # each element written by the thread that read it
        j = t + i * step
        if j < n:
            out[row, j] = math.exp(vals[i] - m) * inv if j < valid else _ZERO


# Rows of up to 32 * E elements run a warp a row (kernels._reduce.WARP_ELEMS). A block a row
# spent two block-wide reductions on every 4 KB row: 270 us for 61440 rows of 1024 on the
# H200, where torch took 126.
def _make_masked_softmax_warp_kernel(E: int):
    @jit("void(float32[:, ::1], int32[::1], float32[:, ::1])", writes=("out",),
         in_place=(("out", "x"),))
    def masked_softmax_warp_kernel(x, length, out):
        vals = cuda.local.array(E, np.float32)
        r, lane, here = warp_row(x.shape[0])
        n = x.shape[1]
        valid = min(max(length[0], 0), n) if here else 0   # (a warp past the end reads nothing)
        m = _NEG_INF
        for i in range(E):
            j = lane + i * 32
            v = x[r, j] if j < valid else _NEG_INF
            vals[i] = v
            if v > m:            # (not max(): a NaN must reach the sum, and make the row NaN)
                m = v
        m = warp_allreduce(m, True)
        s = _ZERO
        for i in range(E):
            if lane + i * 32 < valid:
                s += math.exp(vals[i] - m)
        s = warp_allreduce(s, False)
        inv = _ZERO if s == _ZERO else _ONE / s   # as in masked_softmax_kernel
        if here:
            for i in range(E):   # each element written by the lane that read it
                j = lane + i * 32
                if j < n:
                    out[r, j] = math.exp(vals[i] - m) * inv if j < valid else _ZERO
    return masked_softmax_warp_kernel


_MASKED_SOFTMAX_WARP = {E: _make_masked_softmax_warp_kernel(E) for E in WARP_ELEMS}


@jit("void(float32[:, ::1], float32[:, ::1])", writes=("out",), in_place=(("out", "x"),))
def log_softmax_kernel(x, out):
    buf_m = cuda.shared.array(MAX_THREADS, np.float32)
    buf_s = cuda.shared.array(MAX_THREADS, np.float32)
    row, t, step = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    n = x.shape[1]
    m, s = _row_max_sumexp(x, row, 0, n, buf_m, buf_s)
    shift = _log_shift(m, s)
    for j in range(t, n, step):
        out[row, j] = x[row, j] - shift


# Long rows (a beam's logits: 5 rows of 50257) split over blocks: one block a row left 127 of
# the H200's 132 SMs idle (57 us against torch's 31). Each block scans a span of its row into
# a partial (max, sum of exp); a second launch combines a row's partials, in span order (so
# every run gives the same bits), and writes the span.
SPLIT_THREADS = 256 if not backend.SIMULATOR else 32
SPAN = SPLIT_THREADS * ELEMS_PER_THREAD       # columns a block scans
SPLIT_MIN_COLS = 2 * SPAN                      # shorter rows keep one block each


@cuda.jit(device=True)
def span_bounds(n, spans, i):
    """[lo, hi) of span i of `spans` over n columns (the last may be short)."""
    width = (n + spans - 1) // spans
    return min(i * width, n), min((i + 1) * width, n)


@jit_per_dtype("void({t}[:, ::1], float32[:, ::1], float32[:, ::1])",
               writes=("part_m", "part_s"))
def log_softmax_partials_kernels(x, part_m, part_s):
    """Block (i, row): part_m[row, i], part_s[row, i] = (max, sum of exp(x - max)) of span i
    (x float32, or float16 logits for sampling.beam_topk: each loaded into float32)."""
    buf_m = cuda.shared.array(SPLIT_THREADS, np.float32)
    buf_s = cuda.shared.array(SPLIT_THREADS, np.float32)
    i, row = cuda.blockIdx.x, cuda.blockIdx.y
    lo, hi = span_bounds(x.shape[1], part_m.shape[1], i)
    m, s = _row_max_sumexp(x, row, lo, hi, buf_m, buf_s)
    if cuda.threadIdx.x == 0:
        part_m[row, i] = m
        part_s[row, i] = s


@cuda.jit(device=True)
def row_shift(part_m, part_s, row):
    """log(sum exp(x[row])) from the row's span partials (max, sum of exp(x - max)), to every
    thread of the block, each warp computing it alike: lane l takes spans l, l + 32, ...,
    then a shuffle butterfly (max, then sum) combines the lanes. A butterfly gives every
    lane, every warp and every block the same bits (each step adds the same two values in
    every lane), so every span of a row shifts alike, every run. (A serial combine of 25
    spans in every thread was a chain of about a thousand dependent instructions, a fifth of
    beam_topk_kernels' time.) Every thread of the block must call it (the simulator's
    stand-in for the shuffles holds a barrier)."""
    spans, lane = part_m.shape[1], cuda.threadIdx.x % 32
    m = _NEG_INF
    for k in range(lane, spans, 32):
        m = max(m, part_m[row, k])
    m = warp_allreduce(m, True)
    s = _ZERO
    for k in range(lane, spans, 32):
        mk, sk = part_m[row, k], part_s[row, k]
        if sk != sk:          # a NaN in the span: the row is NaN, as in NumPy
            s += sk
        elif mk != _NEG_INF:  # an empty or all -inf span adds nothing
            s += sk * math.exp(mk - m)
    s = warp_allreduce(s, False)
    return _log_shift(m, s)


@jit("void(float32[:, ::1], float32[:, ::1], float32[:, ::1], float32[:, ::1])",
     writes=("out",), in_place=(("out", "x"),))
def log_softmax_apply_kernel(x, part_m, part_s, out):
    """Block (i, row): the row's shift from all its partials (every thread, in span order),
    then out = x - shift over span i (each element read and written by one thread)."""
    i, row = cuda.blockIdx.x, cuda.blockIdx.y
    spans = part_m.shape[1]
    shift = row_shift(part_m, part_s, row)
    lo, hi = span_bounds(x.shape[1], spans, i)
    for j in range(lo + cuda.threadIdx.x, hi, cuda.blockDim.x):
        out[row, j] = x[row, j] - shift


# ---------------------------------------------------------------------------- launchers
def _check_rows(x, out):
    _check.device_array("x", x, ndim=2)
    _check.device_array("out", out, shape=tuple(x.shape))
    if x.shape[0] > 2**31 - 1:
        raise ValueError(f"x: {x.shape[0]} rows exceed the grid limit")


def masked_softmax(x, length, out, *, stream=0):
    """out[r, :L] = softmax(x[r, :L]), out[r, L:] = 0, with L = length[0] read on the device
    (clamped to [0, C]). x, out (R, C); length a device int32 (1,). out may be x.
    A row whose first L entries are all -inf gives NaN there, as NumPy would."""
    _check_rows(x, out)
    _check.device_array("length", length, dtype=np.int32, shape=(1,))
    E = warp_elems(x.shape[1])
    if E is not None:   # a warp a row
        launch(_MASKED_SOFTMAX_WARP[E], *warp_grid(x.shape[0]), (x, length, out), stream)
        return
    threads = block_threads(x.shape[1], MAX_THREADS)
    kernel = (masked_softmax_in_registers_kernel if x.shape[1] <= ELEMS_PER_THREAD * threads
              else masked_softmax_kernel)
    launch(kernel, x.shape[0], threads, (x, length, out), stream)


def log_softmax(x, out, *, stream=0):
    """out = log(softmax(x)) over the last axis, computed as x - max - log(sum exp(x - max)).
    x, out (R, C); out may be x."""
    _check_rows(x, out)
    rows, cols = x.shape
    if cols < SPLIT_MIN_COLS or rows > 65535:   # (65535: the grid's y limit)
        launch(log_softmax_kernel, rows, block_threads(cols, MAX_THREADS), (x, out), stream)
        return
    spans = -(-cols // SPAN)
    # Scratch of this call only (the second launch reads it, nothing later).
    part_m = backend.empty((rows, spans), np.float32, "log_softmax.max")
    part_s = backend.empty((rows, spans), np.float32, "log_softmax.sumexp")
    launch(log_softmax_partials_kernels[np.dtype(np.float32)], (spans, rows), SPLIT_THREADS,
           (x, part_m, part_s), stream)
    launch(log_softmax_apply_kernel, (spans, rows), SPLIT_THREADS, (x, part_m, part_s, out), stream)
