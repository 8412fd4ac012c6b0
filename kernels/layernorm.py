"""Layer normalization over the last axis: out = (x - mean) / sqrt(var + eps) * gamma + beta.

GPT-2's decode step normalizes every row in the launch that writes it (the embedding, the
attention projection's split-K reduction, the MLP's sum: their `ln_out`); this standalone
kernel serves the rest: rows those fused paths do not take, and `gemm(..., ln_out=...)`
outside the decode path.

Rows of up to 1024 run a warp a row, the row in the lanes' registers, reduced by shuffles
(kernels._reduce.WARP_ELEMS); wider rows a block a row, the row in the threads' registers up
to 16 values a thread (ROW_ELEMS: GPT-J's 4096 at 256 threads), read from memory once;
wider still, read again for each pass. Two passes over the row: the mean, then the mean of
(x - mean)^2, which avoids the cancellation of E[x^2] - mean^2 on rows with a large mean.

x, gamma, beta and out are float32 or float16 (one dtype a launch); the statistics and the
normalization are float32 either way, and a float16 result is rounded once, as it is stored.

The backward (`layernorm_bwd`, float32) recomputes each row's mean and rstd from x. With
xh = (x - mean) * rstd and g = dy * gamma:

    dx     = rstd * (g - mean_row(g) - xh * mean_row(g * xh))
    dgamma = sum over rows of dy * xh,   dbeta = sum over rows of dy

One launch gives dx and, per chunk of CHUNK_ROWS rows, the chunk's column sums (partials in
a workspace); a second adds the chunks' partials in chunk order. No atomics: the same bits
every run.
"""
from __future__ import annotations

import math

import numpy as np

from kernels import _check
from kernels._reduce import (WARP_ELEMS, WARP_ROWS, block_allreduce, converged_syncthreads,
                             warp_allreduce, warp_elems, warp_grid, warp_row)
from proto.device import backend
from proto.device.backend import cuda, jit, jit_per_dtype, launch

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


def layernorm_bwd_ref(x, gamma, dy, eps: float = 1e-5):
    """-> (dx, dgamma, dbeta) of out = layernorm_ref(x, gamma, beta, eps) over the last axis
    of (R, C) rows, given dy = dL/dout; float64 (finite differences check it)."""
    x, gamma, dy = (np.asarray(a, np.float64) for a in (x, gamma, dy))
    mean = x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    xh = (x - mean) * rstd
    g = dy * gamma
    dx = rstd * (g - g.mean(axis=-1, keepdims=True) - xh * (g * xh).mean(axis=-1, keepdims=True))
    return dx, (dy * xh).sum(axis=0), dy.sum(axis=0)


# ---------------------------------------------------------------------------- kernels
_SIGNATURE = "void({t}[:, ::1], {t}[::1], {t}[::1], {t}[:, ::1], float32)"


@cuda.jit(device=True)
def row_stats(x, row, n, red, eps):
    """(mean, rstd) of x[row, :n] over the block's threads, float32: two passes (the mean,
    then the mean of squared deviations), reduced at red[0:32] then red[32:64]."""
    t, step = cuda.threadIdx.x, cuda.blockDim.x
    inv_n = _ONE / np.float32(n)
    s = _ZERO
    for j in range(t, n, step):
        s += x[row, j]
    mean = block_allreduce(s, False, red, 0) * inv_n
    s = _ZERO
    for j in range(t, n, step):
        d = x[row, j] - mean
        s += d * d
    return mean, _ONE / math.sqrt(block_allreduce(s, False, red, 32) * inv_n + eps)


@jit_per_dtype(_SIGNATURE, writes=("out",), in_place=(("out", "x"),))
def layernorm_kernels(x, gamma, beta, out, eps):
    # Warp butterflies then the warps in order (one barrier a reduction, not one a tree level);
    # the two sums use separate halves of red, so the second needs no barrier before it.
    red = cuda.shared.array(64, np.float32)
    row, t, step = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    n = x.shape[1]
    mean, rstd = row_stats(x, row, n, red, eps)
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


def _make_layernorm_row_kernel(E: int):
    """A block a row, E values a thread (column t + i * blockDim) held in registers: every
    load of the row, gamma and beta issued before the first reduction, one memory round
    trip. (The kernel that re-reads the row for each pass took 11.6 us a launch on GPT-J's
    5 rows of 4096 on the H100, each pass waiting on its loads.)"""
    E2 = 2 * E   # (local array sizes must be plain constants)

    @jit_per_dtype(_SIGNATURE, writes=("out",), in_place=(("out", "x"),))
    def layernorm_row_kernels(x, gamma, beta, out, eps):
        red = cuda.shared.array(64, np.float32)
        vals = cuda.local.array(E, np.float32)
        gb = cuda.local.array(E2, np.float32)
        row, t, step = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
        n = x.shape[1]
        inv_n = _ONE / np.float32(n)
        for i in range(E):   # past n, column n-1 is re-read (never counted or stored)
            jj = min(t + i * step, n - 1)
            vals[i] = x[row, jj]
            gb[i] = gamma[jj]
            gb[E + i] = beta[jj]
        s = _ZERO
        for i in range(E):
            if t + i * step < n:
                s += vals[i]
        mean = block_allreduce(s, False, red, 0) * inv_n
        s = _ZERO
        for i in range(E):
            if t + i * step < n:
                d = vals[i] - mean
                s += d * d
        rstd = _ONE / math.sqrt(block_allreduce(s, False, red, 32) * inv_n + eps)
        for i in range(E):   # each element written by the thread that read it: out may be x
            j = t + i * step
            if j < n:
                out[row, j] = (vals[i] - mean) * rstd * gb[i] + gb[E + i]
    return layernorm_row_kernels


ROW_ELEMS = (8, 16)   # values a thread of the row kernel holds
_LAYERNORM_ROW = {E: _make_layernorm_row_kernel(E) for E in ROW_ELEMS}


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
    threads = block_threads(cols, MAX_THREADS)
    E = next((e for e in ROW_ELEMS if cols <= threads * e), None)
    kernel = layernorm_kernels if E is None else _LAYERNORM_ROW[E]   # (None: too wide)
    launch(kernel[dtype], rows, threads, (x, gamma, beta, out, np.float32(eps)), stream)


# ---------------------------------------------------------------------------- backward
# Rows a block of the backward takes (a chunk): each of its WARP_ROWS warps takes
# ROWS_PER_WARP of them, so a chunk's partial column sums cover CHUNK_ROWS rows. Fixed, not
# sized to the GPU's SMs: the partials, hence dgamma's and dbeta's bits, depend on the shape
# alone. Wav2Vec2's 1600 rows give 100 chunks.
ROWS_PER_WARP = 4 if not backend.SIMULATOR else 2
CHUNK_ROWS = WARP_ROWS * ROWS_PER_WARP
SUM_UNROLL = 4   # partials a thread of sum_partials_kernel loads before it adds them
_BWD_SIGNATURE = ("void(float32[:, ::1], float32[::1], float32[:, ::1], float32[:, ::1], "
                  "float32[:, ::1], float32[:, ::1], float32)")


@jit("void(float32[:, ::1], float32[::1])", writes=("out",))
def sum_partials_kernel(part, out):
    """out[j] = part[0, j] + part[1, j] + ... in row order: a thread a column (coalesced
    across the warp), so the bits do not depend on the launch geometry. Each pass loads
    SUM_UNROLL rows before it adds them, to keep several loads in flight."""
    start, stride = cuda.grid(1), cuda.gridsize(1)
    rows, cols = part.shape
    v = cuda.local.array(SUM_UNROLL, np.float32)
    for j in range(start, cols, stride):
        s = _ZERO
        for i0 in range(0, rows, SUM_UNROLL):
            for k in range(SUM_UNROLL):
                v[k] = part[min(i0 + k, rows - 1), j]
            for k in range(SUM_UNROLL):
                if i0 + k < rows:
                    s += v[k]
        out[j] = s


@jit(_BWD_SIGNATURE, writes=("dx", "part_g", "part_b"))
def layernorm_bwd_kernel(x, gamma, dy, dx, part_g, part_b, eps):
    """Rows wider than a warp takes: a block a chunk of CHUNK_ROWS rows, one row at a time
    across the block (four block reductions a row, at alternating halves of red, so each
    reuse of a half comes after a barrier that follows its last read). Thread t owns columns
    t, t + blockDim, ... of the chunk's partials in part_g, part_b and accumulates its rows
    into them in row order."""
    red = cuda.shared.array(64, np.float32)
    chunk, t, step = cuda.blockIdx.x, cuda.threadIdx.x, cuda.blockDim.x
    rows, n = x.shape
    inv_n = _ONE / np.float32(n)
    for j in range(t, n, step):
        part_g[chunk, j] = _ZERO
        part_b[chunk, j] = _ZERO
    for k in range(CHUNK_ROWS):
        r = chunk * CHUNK_ROWS + k
        if r < rows:   # the same for the whole block: its barriers stay matched
            mean, rstd = row_stats(x, r, n, red, eps)
            s1 = _ZERO
            s2 = _ZERO
            for j in range(t, n, step):
                g = dy[r, j] * gamma[j]
                s1 += g
                s2 += g * ((x[r, j] - mean) * rstd)
            m1 = block_allreduce(s1, False, red, 0) * inv_n
            m2 = block_allreduce(s2, False, red, 32) * inv_n
            for j in range(t, n, step):
                d = dy[r, j]
                xh = (x[r, j] - mean) * rstd
                dx[r, j] = rstd * (d * gamma[j] - m1 - xh * m2)
                part_g[chunk, j] += d * xh
                part_b[chunk, j] += d


def _make_layernorm_bwd_warp_kernel(E: int):
    W32E = 32 * E   # (shared and local array sizes must be plain constants)

    @jit(_BWD_SIGNATURE, writes=("dx", "part_g", "part_b"))
    def layernorm_bwd_warp_kernel(x, gamma, dy, dx, part_g, part_b, eps):
        """Rows of up to 32 E: a block a chunk of CHUNK_ROWS rows, a warp a row at a time
        (rows w, w + WARP_ROWS, ... of the chunk for warp w), the row's x, dy in its lanes'
        registers and its four sums by shuffles. Each warp adds its rows' dy * xh and dy into
        its own row of shared partials; at the end the block adds the warps' in warp order."""
        acc = cuda.shared.array((WARP_ROWS, 2, W32E), np.float32)
        xv = cuda.local.array(E, np.float32)
        dv = cuda.local.array(E, np.float32)
        gv = cuda.local.array(E, np.float32)
        w, lane = cuda.threadIdx.x // 32, cuda.threadIdx.x % 32
        rows, n = x.shape
        inv_n = _ONE / np.float32(n)
        for i in range(E):
            j = lane + i * 32
            gv[i] = gamma[min(j, n - 1)]
            acc[w, 0, j] = _ZERO   # (only this lane touches it before the barrier)
            acc[w, 1, j] = _ZERO
        for k in range(ROWS_PER_WARP):
            # Every warp runs every pass, a row or not: the simulator's stand-in for the
            # shuffles holds a block barrier.
            r = cuda.blockIdx.x * CHUNK_ROWS + k * WARP_ROWS + w
            here = r < rows
            rr = r if here else 0
            s = _ZERO
            for i in range(E):
                j = lane + i * 32
                ok = here and j < n
                v = x[rr, j] if ok else _ZERO
                xv[i] = v
                dv[i] = dy[rr, j] if ok else _ZERO
                s += v
            mean = warp_allreduce(s, False) * inv_n
            s = _ZERO
            for i in range(E):
                if lane + i * 32 < n:
                    d = xv[i] - mean
                    s += d * d
            rstd = _ONE / math.sqrt(warp_allreduce(s, False) * inv_n + eps)
            s1 = _ZERO
            s2 = _ZERO
            for i in range(E):
                xh = (xv[i] - mean) * rstd
                xv[i] = xh
                if lane + i * 32 < n:
                    g = dv[i] * gv[i]
                    s1 += g
                    s2 += g * xh
            m1 = warp_allreduce(s1, False) * inv_n
            m2 = warp_allreduce(s2, False) * inv_n
            if here:
                for i in range(E):
                    j = lane + i * 32
                    if j < n:
                        d = dv[i]
                        dx[r, j] = rstd * (d * gv[i] - m1 - xv[i] * m2)
                        acc[w, 0, j] += d * xv[i]
                        acc[w, 1, j] += d
        converged_syncthreads()   # (lanes branched on their columns above)
        for j in range(cuda.threadIdx.x, n, cuda.blockDim.x):
            sg = acc[0, 0, j]
            sb = acc[0, 1, j]
            for u in range(1, WARP_ROWS):
                sg += acc[u, 0, j]
                sb += acc[u, 1, j]
            part_g[cuda.blockIdx.x, j] = sg
            part_b[cuda.blockIdx.x, j] = sb
    return layernorm_bwd_warp_kernel


_LAYERNORM_BWD_WARP = {E: _make_layernorm_bwd_warp_kernel(E) for E in WARP_ELEMS}


def sum_partials(part, out, stream=0) -> None:
    """out (C,) = part (P, C) summed over its rows in row order (`sum_partials_kernel`): the
    second step of a deterministic reduction. Unchecked: for launchers that made `part`."""
    cols = part.shape[1]
    threads = 32 if backend.SIMULATOR else 128
    blocks = 1 if backend.SIMULATOR else -(-cols // threads)
    launch(sum_partials_kernel, blocks, threads, (part, out), stream)


def layernorm_bwd(x, gamma, dy, dx, dgamma, dbeta, *, eps=1e-5, stream=0):
    """Gradients of out = layernorm(x) * gamma + beta over the last axis, given dy = dL/dout:
    dx (R, C), and dgamma, dbeta (C,) summed over the rows (either may be None: not
    computed). x, dy, dx (R, C) and gamma (C,), all float32; mean and rstd are recomputed
    from x with the forward's eps. Outputs are overwritten, and none may overlap an input or
    another output. Deterministic: the same bits every run."""
    _check.device_array("x", x, ndim=2)
    rows, cols = x.shape
    _check.device_array("gamma", gamma, shape=(cols,))
    _check.device_array("dy", dy, shape=(rows, cols))
    _check.device_array("dx", dx, shape=(rows, cols))
    for name, arr in (("dgamma", dgamma), ("dbeta", dbeta)):
        if arr is not None:
            _check.device_array(name, arr, shape=(cols,))
    eps = _check.number("eps", eps, positive=True)
    if rows > 2**31 - 1:
        raise ValueError(f"x: {rows} rows exceed the grid limit")
    _check.separate({"dx": dx, "dgamma": dgamma, "dbeta": dbeta},
                    {"x": x, "gamma": gamma, "dy": dy})
    chunks = -(-rows // CHUNK_ROWS)
    part_g = backend.empty((chunks, cols), np.float32, "layernorm_bwd.dgamma")
    part_b = backend.empty((chunks, cols), np.float32, "layernorm_bwd.dbeta")
    args = (x, gamma, dy, dx, part_g, part_b, np.float32(eps))
    E = warp_elems(cols)
    if E is not None:
        launch(_LAYERNORM_BWD_WARP[E], chunks, 32 * WARP_ROWS, args, stream)
    else:
        launch(layernorm_bwd_kernel, chunks, block_threads(cols, MAX_THREADS), args, stream)
    if dgamma is not None:
        sum_partials(part_g, dgamma, stream)
    if dbeta is not None:
        sum_partials(part_b, dbeta, stream)
