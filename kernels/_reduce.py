"""Warp-wide reductions shared by kernels: a shuffle butterfly on the GPU, a shared-memory
stand-in on the simulator (which has no shuffles); and a block barrier that reconverges the
warp first."""
from __future__ import annotations

import math
import threading

import numpy as np

from proto.device.backend import SIMULATOR, cuda

FULL_MASK = 0xFFFFFFFF
MAX_THREADS = 1024  # threads per block, at most

# Rows of up to 32 * E elements can run a warp a row: E values in each lane's registers,
# reduced by shuffles alone (no shared memory, no barrier), as PyTorch's softmax and layer
# norm do up to 1024 columns. The simulator takes one short width, so that its short test
# rows reach the block-a-row kernels too.
WARP_ELEMS = (2,) if SIMULATOR else (8, 16, 24, 32)   # 24: GPT-2 small's 768
WARP_ROWS = 4   # rows (warps) a block


def warp_elems(cols: int) -> int | None:
    """Values a lane holds for a warp-a-row kernel over `cols` columns (None: too wide)."""
    return next((e for e in WARP_ELEMS if cols <= 32 * e), None)


def warp_grid(rows: int) -> tuple[int, int]:
    """(blocks, threads) of a warp-a-row launch over `rows` rows."""
    return -(-rows // WARP_ROWS), 32 * WARP_ROWS


@cuda.jit(device=True)
def warp_row(rows):
    """(row, lane, here) of this thread in a warp-a-row kernel. A warp past the last row gets
    row 0 and here False: it must read nothing, yet take part in the warp's reductions (the
    simulator's stand-in for the shuffles holds a block barrier)."""
    row = cuda.blockIdx.x * WARP_ROWS + cuda.threadIdx.x // 32
    here = row < rows
    return (row if here else 0), cuda.threadIdx.x % 32, here

if SIMULATOR:   # the simulator's threads are never a warp: the barrier alone
    @cuda.jit(device=True)
    def converged_syncthreads():
        cuda.syncthreads()
else:
    @cuda.jit(device=True)
    def converged_syncthreads():
        """syncthreads() after data-dependent branches. Numba's barrier is bar.sync, the
        .aligned form, which needs every thread of a warp to arrive at it together, and the
        compiler need not reconverge a warp that branched per thread (compute-sanitizer's
        synccheck: "divergent thread(s) in warp"). syncwarp reconverges it first."""
        cuda.syncwarp(FULL_MASK)
        cuda.syncthreads()


if SIMULATOR:
    @cuda.jit(device=True)
    def warp_lanes(v, i):
        """The simulator's stand-in for a warp's shuffles: every thread publishes (v, i) and
        gets back the (values, indices) of its warp's lanes, read at once by the caller. It
        holds a barrier, so every thread of the block must call it together. Two buffers
        alternate, so one barrier per call suffices: a thread rewrites a buffer only after
        everyone passed the next barrier, that is, after everyone read it."""
        buf_v = cuda.shared.array((2, MAX_THREADS), np.float64)
        buf_i = cuda.shared.array((2, MAX_THREADS), np.int64)
        me = threading.current_thread()
        phase = getattr(me, "warp_phase", 0)
        me.warp_phase = phase ^ 1
        buf_v[phase, cuda.threadIdx.x], buf_i[phase, cuda.threadIdx.x] = v, i
        cuda.syncthreads()
        lo = cuda.threadIdx.x & ~31   # the warp's lanes that exist (a block may be smaller)
        hi = min(lo + 32, cuda.blockDim.x)
        return buf_v[phase, lo:hi], buf_i[phase, lo:hi]

    @cuda.jit(device=True)
    def shfl_xor(v, off):
        """Stand-in for cuda.shfl_xor_sync over the full warp, through `warp_lanes`."""
        lanes, _ = warp_lanes(v, 0)
        return type(v)(lanes[(cuda.threadIdx.x % 32) ^ off])

    @cuda.jit(device=True)
    def warp_allreduce(v, use_max):
        """Stand-in for the shuffle butterfly below, through `warp_lanes`."""
        lanes, _ = warp_lanes(v, 0)
        return type(v)(lanes.max() if use_max else lanes.sum())
else:
    @cuda.jit(device=True)
    def shfl_xor(v, off):
        """v of lane (this lane xor off); every lane of the warp must call it."""
        return cuda.shfl_xor_sync(FULL_MASK, v, off)

    @cuda.jit(device=True)
    def warp_allreduce(v, use_max):
        """Max (use_max) or sum of v over the warp, returned to every lane: xor butterfly."""
        off = 16
        while off > 0:
            w = cuda.shfl_xor_sync(FULL_MASK, v, off)
            v = max(v, w) if use_max else v + w
            off >>= 1
        return v


@cuda.jit(device=True)
def block_reduce(buf, v, use_max):
    """Max (use_max) or sum of `v` over the block (blockDim.x a power of two <= len(buf)),
    returned to every thread: a tree in shared memory. Ends with a barrier so `buf` can be
    reused at once. Every thread of the block must call it."""
    t = cuda.threadIdx.x
    buf[t] = v
    converged_syncthreads()   # callers reach here from per-thread loops
    step = cuda.blockDim.x // 2
    while step > 0:
        if t < step:
            buf[t] = max(buf[t], buf[t + step]) if use_max else buf[t] + buf[t + step]
        converged_syncthreads()
        step //= 2
    total = buf[0]
    cuda.syncthreads()
    return total


@cuda.jit(device=True)
def block_allreduce(v, use_max, red, at):
    """Max (use_max) or sum of v over the block (at most 1024 threads; on a GPU a multiple of
    32, as every lane takes part in the shuffles), returned to every thread: warp butterflies,
    then the warps' results combined in warp order (the same bits every run). Uses
    red[at:at + 32]; every thread of the block must call it, and a second call right after
    needs another `at` (no barrier follows the reads)."""
    v = warp_allreduce(v, use_max)
    if cuda.threadIdx.x % 32 == 0:
        red[at + cuda.threadIdx.x // 32] = v
    converged_syncthreads()
    total = red[at]
    for w in range(1, (cuda.blockDim.x + 31) // 32):
        total = max(total, red[at + w]) if use_max else total + red[at + w]
    return total


@cuda.jit(device=True)
def load_ln_params(gamma, beta, gb, count, n):
    """gb[c] = gamma[j], gb[count + c] = beta[j] for this thread's columns j = tid + c *
    blockDim, c < count (past n: the last column, never used). A caller issues these loads
    before its first global store: a load after a store to memory the compiler cannot prove
    apart waits for it, and a loop of them pays one memory round trip per column (on the
    H200, loading first took a 5 x 768 layer norm from 12-14 us to 4)."""
    tid, nt, last = np.uint32(cuda.threadIdx.x), np.uint32(cuda.blockDim.x), np.uint32(n - 1)
    for c in range(count):
        j = min(tid + nt * np.uint32(c), last)
        gb[c] = gamma[j]
        gb[count + c] = beta[j]


@cuda.jit(device=True)
def block_layernorm_row(vals, count, n, gb, eps, y):
    """y[j] = (x[j] - mean) * rstd * gamma[j] + beta[j] for a row x of n values spread over
    the block, thread t holding x[t + c * blockDim] in vals[c] and gamma, beta in gb
    (`load_ln_params`), c < count: two passes over the values in registers (no E[x^2] -
    mean^2 cancellation), each a block_allreduce; no global load, so the stores never wait.
    Every thread of the block must call it (its own row's values in hand); uses red of 64."""
    red = cuda.shared.array(64, np.float32)   # two rounds of per-warp sums
    tid, nt, n = np.uint32(cuda.threadIdx.x), np.uint32(cuda.blockDim.x), np.uint32(n)
    inv_n = np.float32(1.0) / np.float32(n)
    s1 = np.float32(0.0)
    for c in range(count):
        if tid + nt * np.uint32(c) < n:
            s1 += vals[c]
    mean = block_allreduce(s1, False, red, 0) * inv_n
    s2 = np.float32(0.0)
    for c in range(count):
        if tid + nt * np.uint32(c) < n:
            d = vals[c] - mean
            s2 += d * d
    rstd = np.float32(1.0) / math.sqrt(block_allreduce(s2, False, red, 32) * inv_n + eps)
    for c in range(count):
        j = tid + nt * np.uint32(c)
        if j < n:
            y[j] = (vals[c] - mean) * rstd * gb[c] + gb[count + c]
