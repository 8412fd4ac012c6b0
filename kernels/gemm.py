"""Matrix multiply with a fused epilogue: out = act(op(a) @ op(b) + bias), op(x) = x or x.T.

Two kernel families, chosen by `gemm` from the shapes:

- `gemm_tiled_kernel`, for any shape: 64 x 64 output tiles, K consumed 16 at a time through
  shared memory, a 4 x 4 register block per thread (each staged value feeds 4 products).
- decode kernels, for M <= 8 rows (beam-search decoding: 5 beams against GPT-2's 768 x 50257
  output projection). Arithmetic intensity is at most 8 FLOP per weight read, so these are
  pure weight streaming: every weight is read once, coalesced, and multiplied with all 8
  (zero-padded) rows of x, which sit in shared memory. `gemm_decode_nt_kernel` serves
  trans_b (weight rows contiguous along K: a warp per 2 output columns, lanes along K, sums
  across lanes by warp shuffles, so warps never wait for each other);
  `gemm_decode_nn_kernel` the [K, N] layout (lanes along N, the K loop
  split across the block's warps, reduction through shared memory). Both are persistent:
  the grid is one wave of resident blocks looping over column tiles, so each SM streams the
  same share of the weight and x is staged once per block.

2-D calls are 3-D calls with a batch of 1, so every kernel has one argument layout.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from kernels import _check
from kernels._reduce import warp_allreduce
from kernels.elementwise import gelu_ref
from proto import backend
from proto.backend import cuda, jit, launch

ACTS = {None: 0, "gelu": 1, "relu": 2}
_GELU_C = np.float32(math.sqrt(2.0 / math.pi))
_GELU_A = np.float32(0.044715)
_HALF = np.float32(0.5)
_ONE = np.float32(1.0)
_ZERO = np.float32(0.0)

DECODE_MAX_M = 8  # rows of x multiplied with each weight load (the decode path's M limit)
if not backend.SIMULATOR:
    TPB, RB, BK = 16, 4, 16  # tiled: 16 x 16 threads, 4 x 4 outputs each, K slices of 16
    KC = 768                 # decode: K chunk staged in shared memory; covers GPT-2's d = 768
    NT_WARPS, NT_COLS, NT_UNROLL = 8, 2, 8  # trans_b: 8 warps x 2 columns = 16-column tiles
    NN_WARPS, NN_COLS, NN_UNROLL = 4, 2, 8  # [K,N]: 32 lanes x 2 columns = 64-column tiles
else:
    # Each simulated thread is a Python thread (~1 ms each): the same code with smaller
    # blocks keeps tests fast, and a small K chunk lets tiny shapes take the multi-chunk path.
    TPB, RB, BK = 4, 2, 8
    KC = 64
    NT_WARPS, NT_COLS, NT_UNROLL = 1, 2, 2
    NN_WARPS, NN_COLS, NN_UNROLL = 2, 2, 2
BM = BN = TPB * RB
NT_TILE = NT_WARPS * NT_COLS
NN_TILE = 32 * NN_COLS
# Shared/local array sizes must be literal constants in the kernel, hence precomputed here.
_TILE_A = (BK, BM + 1)  # +1 column: the transposed staging writes hit distinct banks
_TILE_B = (BK, BN + 1)
_XS = DECODE_MAX_M * KC
_NT_ACC, _NT_WV = DECODE_MAX_M * NT_COLS, NT_UNROLL * NT_COLS
_NN_ACC, _NN_WV = DECODE_MAX_M * NN_COLS, NN_UNROLL * NN_COLS
_NN_RED = NN_WARPS * DECODE_MAX_M * NN_TILE


# ---------------------------------------------------------------------------- reference
def gemm_ref(a, b, bias=None, act=None, trans_a=False, trans_b=False, *, old=None) -> np.ndarray:
    """float64-accumulated reference; `old` is out's previous value (accumulate=True)."""
    a64 = np.asarray(a, np.float64)
    b64 = np.asarray(b, np.float64)
    a64 = np.swapaxes(a64, -1, -2) if trans_a else a64
    b64 = np.swapaxes(b64, -1, -2) if trans_b else b64
    v = a64 @ b64
    if old is not None:
        v = v + old
    if bias is not None:
        v = v + np.asarray(bias, np.float64)
    if act == "gelu":
        return gelu_ref(v)
    if act == "relu":
        v = np.maximum(v, 0.0)
    return v.astype(np.float32)


# ---------------------------------------------------------------------------- device helpers
# Index arithmetic in the kernels is uint32 (`_u`): Numba guards every signed index against
# Python's negative indexing (3 extra instructions per access, and a fresh address register
# per access); unsigned indices compile to one base register plus immediate offsets.
_u = np.uint32


@cuda.jit(device=True)
def _finish(v, out, bz, m, n, bias, has_bias, act, accumulate):
    """The fused epilogue for one output element: (+ old) (+ bias), then act, then store."""
    if accumulate:
        v += out[bz, m, n]
    if has_bias:
        v += bias[n]
    if act == 1:
        v = _HALF * v * (_ONE + math.tanh(_GELU_C * (v + _GELU_A * v * v * v)))
    elif act == 2:
        v = max(v, _ZERO)
    out[bz, m, n] = v


@cuda.jit(device=True)
def _stage_rows(xs, a, bz, kc, length, m_rows, trans_a):
    """xs[m, k] = op(a)[bz, m, kc + k] for k < length, rows m >= m_rows zero (so the decode
    kernels always multiply 8 rows and need no per-row branches). Each thread loads all 8
    rows of a column before storing any, so 8 reads are in flight, not 1."""
    vals = cuda.local.array(DECODE_MAX_M, np.float32)
    for k in range(cuda.threadIdx.x, length, cuda.blockDim.x):
        for m in range(DECODE_MAX_M):
            vals[m] = _ZERO
            if m < m_rows:
                vals[m] = a[bz, _u(kc + k), _u(m)] if trans_a else a[bz, _u(m), _u(kc + k)]
        for m in range(DECODE_MAX_M):
            xs[_u(m * KC + k)] = vals[m]


# ---------------------------------------------------------------------------- kernels
_ARGS = ("float32[:,:,::1], float32[:,:,::1], float32[:,:,::1], float32[::1], "
         "int32, int32, int32")


# Launch bounds (threads, blocks per SM) cap registers so that many blocks fit on an SM (the
# decode kernels need that many loads in flight).
@jit(f"void({_ARGS}, int32, int32)", launch_bounds=(TPB * TPB, 2))
def gemm_tiled_kernel(a, b, out, bias, has_bias, act, accumulate, trans_a, trans_b):
    as_ = cuda.shared.array(_TILE_A, np.float32)  # op(a) tile, k-major
    bs = cuda.shared.array(_TILE_B, np.float32)  # op(b) tile
    acc = cuda.local.array((RB, RB), np.float32)
    ra = cuda.local.array(RB, np.float32)
    rb = cuda.local.array(RB, np.float32)
    tx, ty = _u(cuda.threadIdx.x), _u(cuda.threadIdx.y)
    tid = ty * _u(TPB) + tx
    bz = _u(cuda.blockIdx.z)
    m0, n0 = _u(cuda.blockIdx.y) * _u(BM), _u(cuda.blockIdx.x) * _u(BN)
    m_rows, n_cols = out.shape[1], out.shape[2]
    k_len = a.shape[1] if trans_a else a.shape[2]
    for i in range(RB):
        for j in range(RB):
            acc[i, j] = _ZERO
    for k0 in range(0, k_len, BK):
        # Each thread stages 4 elements of each tile; consecutive threads walk the
        # contiguous axis of the source, whichever it is, so global reads coalesce.
        for i in range(BM * BK // (TPB * TPB)):
            e = tid + _u(i * TPB * TPB)
            if trans_a:   # a (K, M)
                mm, kk = e % _u(BM), e // _u(BM)
            else:         # a (M, K)
                kk, mm = e % _u(BK), e // _u(BK)
            m, k = m0 + mm, _u(k0) + kk
            v = _ZERO
            if m < m_rows and k < k_len:
                v = a[bz, k, m] if trans_a else a[bz, m, k]
            as_[kk, mm] = v
            if trans_b:   # b (N, K)
                kk, nn = e % _u(BK), e // _u(BK)
            else:         # b (K, N)
                nn, kk = e % _u(BN), e // _u(BN)
            n, k = n0 + nn, _u(k0) + kk
            v = _ZERO
            if n < n_cols and k < k_len:
                v = b[bz, n, k] if trans_b else b[bz, k, n]
            bs[kk, nn] = v
        cuda.syncthreads()
        for kk in range(BK):
            for i in range(RB):
                ra[i] = as_[_u(kk), ty + _u(i * TPB)]
            for j in range(RB):
                rb[j] = bs[_u(kk), tx + _u(j * TPB)]
            for i in range(RB):
                for j in range(RB):
                    acc[i, j] += ra[i] * rb[j]
        cuda.syncthreads()
    for i in range(RB):
        m = m0 + ty + _u(i * TPB)
        for j in range(RB):
            n = n0 + tx + _u(j * TPB)
            if m < m_rows and n < n_cols:
                _finish(acc[i, j], out, bz, m, n, bias, has_bias, act, accumulate)


@jit(f"void({_ARGS}, int32)", launch_bounds=(32 * NT_WARPS, 3))
def gemm_decode_nt_kernel(a, w, out, bias, has_bias, act, accumulate, trans_a):
    """out (B, M<=8, N) = op(a) (B, M, K) @ w (B, N, K).T: a warp per NT_COLS output columns,
    its lanes along K (coalesced rows of w), then a reduction across the lanes."""
    xs = cuda.shared.array(_XS, np.float32)  # (8, KC) rows of op(a), zero-padded
    acc = cuda.local.array(_NT_ACC, np.float32)  # [m * NT_COLS + c]
    wv = cuda.local.array(_NT_WV, np.float32)    # [u * NT_COLS + c]
    rows = cuda.local.array(NT_COLS, np.uint32)
    lane, warp = _u(cuda.threadIdx.x % 32), _u(cuda.threadIdx.x // 32)
    bz = _u(cuda.blockIdx.y)
    m_rows, n_cols, k_len = out.shape[1], out.shape[2], w.shape[2]
    one_chunk = k_len <= KC
    if one_chunk:  # stage x once for every tile this block visits
        _stage_rows(xs, a, bz, 0, k_len, m_rows, trans_a)
        cuda.syncthreads()
    n_tiles = (n_cols + NT_TILE - 1) // NT_TILE
    for tile in range(cuda.blockIdx.x, n_tiles, cuda.gridDim.x):
        n0 = _u(tile) * _u(NT_TILE) + warp * _u(NT_COLS)
        for c in range(NT_COLS):  # past the last column, re-read the last row; never stored
            rows[c] = _u(min(n0 + _u(c), n_cols - 1))
        for i in range(_NT_ACC):
            acc[i] = _ZERO
        for kc in range(0, k_len, KC):
            length = _u(min(KC, k_len - kc))
            if not one_chunk:
                cuda.syncthreads()
                _stage_rows(xs, a, bz, kc, length, m_rows, trans_a)
                cuda.syncthreads()
            k = lane
            # Main loop: NT_UNROLL * NT_COLS independent coalesced loads in flight per lane.
            while k + _u(32 * (NT_UNROLL - 1)) < length:
                for u in range(NT_UNROLL):
                    for c in range(NT_COLS):
                        wv[u * NT_COLS + c] = w[bz, rows[c], _u(kc) + k + _u(32 * u)]
                for u in range(NT_UNROLL):
                    for m in range(DECODE_MAX_M):
                        xm = xs[_u(m * KC + 32 * u) + k]
                        for c in range(NT_COLS):
                            acc[m * NT_COLS + c] += xm * wv[u * NT_COLS + c]
                k += _u(32 * NT_UNROLL)
            while k < length:
                for c in range(NT_COLS):
                    wv[c] = w[bz, rows[c], _u(kc) + k]
                for m in range(DECODE_MAX_M):
                    xm = xs[_u(m * KC) + k]
                    for c in range(NT_COLS):
                        acc[m * NT_COLS + c] += xm * wv[c]
                k += _u(32)
        # Sum each (m, c) partial over the warp's 32 lanes with shuffles (no barrier: the
        # warps of a block stream independently); lane i then stores the i-th result. Rows
        # past m_rows are zero padding: skip their reductions.
        for i in range(_NT_ACC):
            if i // NT_COLS < m_rows:
                v = warp_allreduce(acc[i], False)
                n = n0 + _u(i % NT_COLS)
                if lane == _u(i) and n < n_cols:
                    _finish(v, out, bz, _u(i // NT_COLS), n, bias, has_bias, act, accumulate)


@jit(f"void({_ARGS}, int32)", launch_bounds=(32 * NN_WARPS, 6))
def gemm_decode_nn_kernel(a, w, out, bias, has_bias, act, accumulate, trans_a):
    """out (B, M<=8, N) = op(a) (B, M, K) @ w (B, K, N): lanes along N (coalesced rows of w),
    the K loop split across the block's warps, partial sums added through shared memory."""
    xs = cuda.shared.array(_XS, np.float32)  # (8, KC) rows of op(a), zero-padded
    red = cuda.shared.array(_NN_RED, np.float32)  # (NN_WARPS, 8, NN_TILE) partial sums
    acc = cuda.local.array(_NN_ACC, np.float32)  # [m * NN_COLS + c]
    wv = cuda.local.array(_NN_WV, np.float32)    # [u * NN_COLS + c]
    cols = cuda.local.array(NN_COLS, np.uint32)
    lane, warp = _u(cuda.threadIdx.x % 32), _u(cuda.threadIdx.x // 32)
    bz = _u(cuda.blockIdx.y)
    m_rows, n_cols, k_len = out.shape[1], out.shape[2], w.shape[1]
    one_chunk = k_len <= KC
    if one_chunk:
        _stage_rows(xs, a, bz, 0, k_len, m_rows, trans_a)
        cuda.syncthreads()
    n_tiles = (n_cols + NN_TILE - 1) // NN_TILE
    for tile in range(cuda.blockIdx.x, n_tiles, cuda.gridDim.x):
        n0 = _u(tile) * _u(NN_TILE)
        for c in range(NN_COLS):  # past the last column, re-read the last one; never stored
            cols[c] = _u(min(n0 + lane + _u(32 * c), n_cols - 1))
        for i in range(_NN_ACC):
            acc[i] = _ZERO
        for kc in range(0, k_len, KC):
            length = _u(min(KC, k_len - kc))
            if not one_chunk:
                cuda.syncthreads()
                _stage_rows(xs, a, bz, kc, length, m_rows, trans_a)
                cuda.syncthreads()
            k = warp
            # Main loop: warp `warp` takes k = warp, warp + NN_WARPS, ...; x reads broadcast.
            while k + _u(NN_WARPS * (NN_UNROLL - 1)) < length:
                for u in range(NN_UNROLL):
                    for c in range(NN_COLS):
                        wv[u * NN_COLS + c] = w[bz, _u(kc) + k + _u(NN_WARPS * u), cols[c]]
                for u in range(NN_UNROLL):
                    for m in range(DECODE_MAX_M):
                        xm = xs[_u(m * KC + NN_WARPS * u) + k]
                        for c in range(NN_COLS):
                            acc[m * NN_COLS + c] += xm * wv[u * NN_COLS + c]
                k += _u(NN_WARPS * NN_UNROLL)
            while k < length:
                for c in range(NN_COLS):
                    wv[c] = w[bz, _u(kc) + k, cols[c]]
                for m in range(DECODE_MAX_M):
                    xm = xs[_u(m * KC) + k]
                    for c in range(NN_COLS):
                        acc[m * NN_COLS + c] += xm * wv[c]
                k += _u(NN_WARPS)
        for m in range(DECODE_MAX_M):
            for c in range(NN_COLS):
                red[(warp * _u(DECODE_MAX_M) + _u(m)) * _u(NN_TILE) + lane + _u(32 * c)] = \
                    acc[m * NN_COLS + c]
        cuda.syncthreads()
        for idx in range(cuda.threadIdx.x, DECODE_MAX_M * NN_TILE, cuda.blockDim.x):
            m, j = _u(idx // NN_TILE), _u(idx % NN_TILE)
            n = n0 + j
            if m < m_rows and n < n_cols:
                v = _ZERO
                for wp in range(NN_WARPS):
                    v += red[_u(wp * DECODE_MAX_M * NN_TILE) + m * _u(NN_TILE) + j]
                _finish(v, out, bz, m, n, bias, has_bias, act, accumulate)
        cuda.syncthreads()  # `red` is rewritten by the next tile


# ---------------------------------------------------------------------------- launcher
@functools.cache
def _resident_blocks(kernel, threads: int) -> int:
    """How many blocks of `kernel` the whole device runs at once (one wave)."""
    if backend.SIMULATOR:  # one block at a time there; 2 still exercises the tile loop's stride
        return 2
    return next(iter(kernel.overloads.values())).max_cooperative_grid_blocks(threads)


def gemm(a, b, out, *, bias=None, act=None, trans_a=False, trans_b=False, accumulate=False,
         stream=0):
    """out = act(op(a) @ op(b) + bias), with out's old value added first when `accumulate`.

    2-D: op(a) (M, K), op(b) (K, N), out (M, N), bias (N,). 3-D: a leading batch dim on
    a, b and out. `out` must not overlap `a` or `b` (other blocks still read them while
    one writes); `bias` may be any array, even a view into `a` or `b`.
    """
    _check.device_array("a", a)
    _check.device_array("b", b)
    _check.device_array("out", out)
    if a.ndim not in (2, 3) or b.ndim != a.ndim or out.ndim != a.ndim:
        raise ValueError(f"a, b, out: expected all 2-D or all 3-D, got shapes "
                         f"{tuple(a.shape)}, {tuple(b.shape)}, {tuple(out.shape)}")
    if act not in ACTS:
        raise ValueError(f"act: expected one of {list(ACTS)}, got {act!r}")
    a_shape, b_shape = tuple(a.shape), tuple(b.shape)
    lead = a_shape[:-2]  # () or (B,)
    m_rows, k_len = a_shape[::-1][:2] if trans_a else a_shape[-2:]
    k_b, n_cols = b_shape[::-1][:2] if trans_b else b_shape[-2:]
    if b_shape[:-2] != lead or k_b != k_len:
        raise ValueError(f"b: expected op(b) of shape ({k_len}, *) matching op(a) "
                         f"({m_rows}, {k_len}) with batch {lead}, got b {b_shape} "
                         f"trans_b={trans_b}")
    if tuple(out.shape) != (*lead, m_rows, n_cols):
        raise ValueError(f"out: expected shape {(*lead, m_rows, n_cols)}, got {tuple(out.shape)}")
    batch = lead[0] if lead else 1
    if batch > 65535:
        raise ValueError(f"a: batch {batch} exceeds the grid limit 65535")
    _check.no_overlap({"out": out, "a": a, "b": b}, (("out", "a"), ("out", "b")))
    if bias is None:
        bias_arg, has_bias = out.reshape(out.size), 0  # never read
    else:
        bias_arg, has_bias = _check.device_array("bias", bias, shape=(n_cols,)), 1
    flags = (has_bias, ACTS[act], int(bool(accumulate)), int(bool(trans_a)))
    if not lead:  # every kernel takes (B, ., .) arrays
        a, b, out = a.reshape(1, *a.shape), b.reshape(1, *b.shape), out.reshape(1, *out.shape)
    if m_rows <= DECODE_MAX_M:
        kernel, tile, threads = ((gemm_decode_nt_kernel, NT_TILE, 32 * NT_WARPS) if trans_b
                                 else (gemm_decode_nn_kernel, NN_TILE, 32 * NN_WARPS))
        n_tiles = (n_cols + tile - 1) // tile
        blocks = max(1, min(n_tiles, _resident_blocks(kernel, threads) // batch))
        launch(kernel, (blocks, batch), threads, (a, b, out, bias_arg, *flags), stream)
        return
    grid = ((n_cols + BN - 1) // BN, (m_rows + BM - 1) // BM, batch)
    launch(gemm_tiled_kernel, grid, (TPB, TPB),
           (a, b, out, bias_arg, *flags, int(bool(trans_b))), stream)
