"""Layout kernels of a training step: batched transpose, zeroing padded frames, column sums.

    transpose_last2  out (B, N, M) = x (B, M, N) swapped in its last two axes: Wav2Vec2's
                     feature encoder works in (B, 512, T), the rest of the model in
                     (B, T, 512), and the gradient goes back the other way
    zero_frames      x[b, t, :] = 0 for t >= lengths[b], in place (padded frames of a batch
                     of unequal lengths); lengths are read on the device
    column_sum       out (N,) = x (M, N) summed over its rows (a bias gradient), for M up to
                     the feature encoder's ~100 000 frames: rows split across blocks into a
                     workspace of partial sums, then the partials added in order

float32. Deterministic: every sum has a fixed order for a given shape and device (no atomics),
so a graph's replay and an eager step give the same bits.
"""
from __future__ import annotations

import numpy as np

from kernels import _check
from proto.device import backend
from proto.device.backend import SIMULATOR, cuda, jit, launch, reshaped

# Transpose tiles: TILE x TILE elements a block, read and written by TILE x TILE_ROWS
# threads, TILE / TILE_ROWS elements each. Threads of a warp read one row of x's tile and
# write one row of out's tile, both consecutive addresses; the shared tile's rows are padded
# by one so that the column reads hit 32 different banks. The simulator, which pays per
# thread, gets small tiles (its tests still cover several tiles and partial ones).
TILE, TILE_ROWS = (4, 2) if SIMULATOR else (32, 8)
_PADDED = TILE + 1   # (a global constant: shared array shapes cannot be expressions)
MAX_BLOCKS = 2 if SIMULATOR else 65535   # a grid-stride loop over the tiles covers the rest

# Column sums: a block sums COLS consecutive columns over one split of the rows, COLS x
# SUM_ROWS threads (a warp reads COLS consecutive floats of one row: coalesced), the
# SUM_ROWS partials of a column then added in thread order.
COLS, SUM_ROWS = (4, 2) if SIMULATOR else (32, 8)
MAX_SPLITS = 65535   # the grid's y extent
ZERO_THREADS = 4 if SIMULATOR else 128


# ---------------------------------------------------------------------------- references
def transpose_last2_ref(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(x, -1, -2))


def zero_frames_ref(x: np.ndarray, lengths) -> np.ndarray:
    """x with frames t >= clip(lengths[b], 0, T) of each sample b zeroed (a copy)."""
    out = np.array(x)
    T = x.shape[1]
    for b, n in enumerate(np.asarray(lengths)):
        out[b, min(max(int(n), 0), T):] = 0
    return out


def column_sum_ref(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64).sum(axis=0).astype(np.float32)


# ---------------------------------------------------------------------------- kernels
@jit("void(float32[:,:,::1], float32[:,:,::1])", writes=("out",))
def transpose_kernel(x, out):
    """Block after block of TILE x TILE tiles, tile index = (b, tile row, tile column)."""
    tile = cuda.shared.array((TILE, _PADDED), np.float32)
    B, M, N = x.shape
    tiles_m, tiles_n = (M + TILE - 1) // TILE, (N + TILE - 1) // TILE
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    for k in range(cuda.blockIdx.x, B * tiles_m * tiles_n, cuda.gridDim.x):   # block-uniform
        b, r = k // (tiles_m * tiles_n), k % (tiles_m * tiles_n)
        m0, n0 = (r // tiles_n) * TILE, (r % tiles_n) * TILE
        for dy in range(0, TILE, TILE_ROWS):   # x's rows m0.., columns n0 + tx
            i, j = m0 + ty + dy, n0 + tx
            if i < M and j < N:
                tile[ty + dy, tx] = x[b, i, j]
        cuda.syncthreads()
        for dy in range(0, TILE, TILE_ROWS):   # out's rows n0.., columns m0 + tx
            j, i = n0 + ty + dy, m0 + tx
            if j < N and i < M:
                out[b, j, i] = tile[tx, ty + dy]
        cuda.syncthreads()                     # the tile is read before the next fill


@jit("void(float32[:,:,::1], int32[::1])", writes=("x",))
def zero_frames_kernel(x, lengths):
    """A block per frame (grid-stride over B * T frames); a frame at or past its sample's
    clipped length gets its D values zeroed by the block's threads, the others are left
    untouched (never read)."""
    B, T, D = x.shape
    for f in range(cuda.blockIdx.x, B * T, cuda.gridDim.x):   # block-uniform
        b, t = f // T, f % T
        if t >= min(max(lengths[b], 0), T):
            for d in range(cuda.threadIdx.x, D, cuda.blockDim.x):
                x[b, t, d] = np.float32(0.0)


@jit("void(float32[:,::1], float32[:,::1])", writes=("part",))
def column_partials_kernel(x, part):
    """part[s, n] = sum of x[r, n] over split s's rows, block (column tile, split): thread
    (tx, ty) adds rows ty, ty + SUM_ROWS, ... of its split in order, then thread ty = 0 adds
    the SUM_ROWS sums in order."""
    acc = cuda.shared.array((SUM_ROWS, COLS), np.float32)
    M, N = x.shape
    splits = part.shape[0]
    chunk = (M + splits - 1) // splits
    tx, ty = cuda.threadIdx.x, cuda.threadIdx.y
    n = cuda.blockIdx.x * COLS + tx
    s = cuda.blockIdx.y
    hi = min(M, (s + 1) * chunk)
    total = np.float32(0.0)
    if n < N:
        for r in range(s * chunk + ty, hi, SUM_ROWS):
            total += x[r, n]
    acc[ty, tx] = total
    cuda.syncthreads()
    if ty == 0 and n < N:
        for k in range(1, SUM_ROWS):
            total += acc[k, tx]
        part[s, n] = total


@jit("void(float32[:,::1], float32[::1])", writes=("out",))
def column_total_kernel(part, out):
    """out[n] = sum over s of part[s, n], s in order: a thread per column."""
    for n in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        total = part[0, n]
        for s in range(1, part.shape[0]):
            total += part[s, n]
        out[n] = total


# ---------------------------------------------------------------------------- launchers
def transpose_last2(x, out, *, stream=0):
    """out (B, N, M) = x (B, M, N) with its last two axes swapped (a copy, exact). float32;
    out must not overlap x."""
    _check.device_array("x", x, ndim=3)
    B, M, N = x.shape
    _check.device_array("out", out, shape=(B, N, M))
    tiles = B * -(-M // TILE) * -(-N // TILE)
    launch(transpose_kernel, min(tiles, MAX_BLOCKS), (TILE, TILE_ROWS), (x, out), stream)


def zero_frames(x, lengths, *, stream=0):
    """In place: x[b, t, :] = 0 for every frame t >= lengths[b] of x (B, T, D) float32.
    lengths: (B,) int32 device array, read on the device; a negative length counts as 0
    (the whole sample zeroed) and one above T as T (nothing zeroed), so no length reads or
    writes outside x."""
    _check.device_array("x", x, ndim=3)
    B, T, _ = x.shape
    _check.device_array("lengths", lengths, dtype=np.int32, shape=(B,))
    blocks = min(B * T, MAX_BLOCKS)
    launch(zero_frames_kernel, blocks, ZERO_THREADS, (x, lengths), stream)


def column_splits(M: int, N: int) -> int:
    """How many row splits column_sum cuts M rows of N columns into: enough blocks for about
    four waves of resident blocks (8 a SM), each split at least 4 * SUM_ROWS rows (on the
    simulator: splits of 3 rows, so that small tests see several). A function of the shape
    and the device only, so eager and graphed sums add in the same order."""
    if SIMULATOR:
        return min(-(-M // 3), MAX_SPLITS)
    col_blocks = -(-N // COLS)
    want = -(-4 * 8 * _check.sm_count() // col_blocks)
    return max(1, min(want, M // (4 * SUM_ROWS), MAX_SPLITS))


def column_sum(x, out, *, splits=None, stream=0):
    """out (N,) = x (M, N) summed over its rows, float32, deterministic. The rows are cut
    into `splits` consecutive runs (None: `column_splits`), each summed by its own blocks
    into a workspace; a second launch adds the runs' sums in order (one run: a single launch
    writes out). out must not overlap x."""
    _check.device_array("x", x, ndim=2)
    M, N = x.shape
    _check.device_array("out", out, shape=(N,))
    if splits is None:
        splits = column_splits(M, N)
    splits = _check.positive("splits", splits, at_most=min(M, MAX_SPLITS))
    splits = -(-M // -(-M // splits))   # no empty run: ceil(M / ceil(M / splits))
    _check.separate({"out": out}, {"x": x})
    grid = (-(-N // COLS), splits)
    if splits == 1:
        launch(column_partials_kernel, grid, (COLS, SUM_ROWS), (x, reshaped(out, (1, N))),
               stream)
        return
    part = backend.empty((splits, N), np.float32, "column_sum.partials")
    launch(column_partials_kernel, grid, (COLS, SUM_ROWS), (x, part), stream)
    blocks, threads = _check.grid_stride_launch(N)
    launch(column_total_kernel, blocks, threads, (part, out), stream)
