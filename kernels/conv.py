"""2-D convolution for training, NCHW float32: forward, backward-data, backward-weight.

Each is an implicit GEMM (no im2col buffer), tiled and double-buffered, with deterministic
split reductions; how the kernels work is in kernels._conv_kernels.

    forward       out[n,k,p,q]  = sum_{c,r,s} x[n,c,p*st-pad+r,q*st-pad+s] * w[k,c,r,s] + b[k]
                  (then ReLU, optionally: fused so VGG never stores a pre-activation)
                  GEMM rows: output pixels (n,p,q); columns: output channels k
    backward-data dx[n,c,h,w]   = sum_{k,r,s} dy[n,k,(h+pad-r)/st,(w+pad-s)/st] * w[k,c,r,s]
                  (only taps where the division is exact and in range); rows: input pixels
    backward-wt   dw[k,c,r,s]   = sum_{n,p,q} dy[n,k,p,q] * x[n,c,p*st-pad+r,q*st-pad+s]
                  db[k]         = sum_{n,p,q} dy[n,k,p,q]
                  rows: k; columns: c, one filter tap (r,s) per block; the long reduction over
                  (n,p,q) is split across blocks, each storing its finished partial tile in a
                  workspace, then a second kernel sums the partials in split order. No atomics,
                  so the gradient is bit-for-bit the same every run (atomics would add the
                  partials in whatever order blocks finish: float32 sums that differ run to run,
                  and a memory policy could then never be shown to leave the math unchanged).

Tiles: by output channels (`_pick_conv_tiles`), or for a layer whose forward or
backward-data this GPU's measured table names (kernels.tuning, section "conv"), that one.

Forward and backward-data keep their reduction whole: split as the weight gradient's is where
their grid was under two waves (Wav2Vec2's short encoder layers), they ran slower on the H100
than with K whole (bench_conv1d's "K never split" rows, in dev/notes/wav2vec2.md).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from kernels import _check, tuning
from kernels._conv_kernels import (RELU, RELU_MASK, RELU_NONE, make_conv_kernel,
                                   make_conv_taps_kernel, make_wgrad_kernel,
                                   make_wgrad_taps_kernel, sum_splits_kernel)
from kernels._tile import Tiles
from proto.device import backend
from proto.device.backend import cuda, launch


# GPU tiles: 256 threads each (but one, below), wide (8x8 outputs a thread: 64 FMAs per 16
# shared loads) for wide layers, then narrower ones so layers with few channels waste little.
GPU_CONV_TILES = (Tiles(128, 128, 8, 8, 8), Tiles(128, 64, 8, 8, 4), Tiles(128, 16, 8, 8, 1))
# The first two on tensor cores (kernels._tf32: three TF32 products a float32 one), here and
# for the weight gradient below, for tests and dev/bench/bench_conv1d.py until a bench on
# the GPU routes a layer to them. Forward and backward-data split each operand once as they
# stage it, in fragment order (kernels._tf32.fragment_tile), a thread the four patch words
# of one lane (bm * bk = 4 x threads); the weight gradient, whose bias sums read the staged
# dy tile as float32, splits as it reads.
GPU_CONV_MMA_TILES = (Tiles(128, 128, 8, 8, 8, True), Tiles(128, 64, 8, 8, 4, True))
# The weight gradient's 64 x 64 tile has 128 threads of 8 x 4: per 512 multiply-adds a step
# takes ~1020 SASS instructions, where 256 threads of 4 x 4 took ~1190 (static count).
GPU_WGRAD_TILES = (Tiles(128, 128, 16, 8, 8), Tiles(64, 64, 16, 8, 4), Tiles(64, 16, 16, 4, 1))
GPU_WGRAD_MMA_TILES = (Tiles(128, 128, 16, 8, 8, True), Tiles(64, 64, 16, 4, 4, True))
# Simulator tiles: few threads; column count follows the channel count. As on the GPU, the
# thread count is a multiple of bm and bk (each thread stages one pixel's channels).
SIM_CONV_TILES = (Tiles(4, 4, 4, 1, 4), Tiles(8, 8, 4, 2, 4), Tiles(16, 16, 4, 4, 4))
SIM_CONV_MMA_TILES = (Tiles(32, 32, 8, 4, 4, True),)   # (2 warps, bm * bk = 4 x threads)
SIM_WGRAD_MMA_TILES = (Tiles(16, 16, 8, 2, 2, True),)
SIM_WGRAD_TILES = tuple(Tiles(bm, bn, bm * bn // 16, 4, 4) for bm in (4, 8, 16) for bn in (4, 8, 16))
# Backward-weight with all taps in a block (make_wgrad_taps_kernel): layers whose C*R*S fits
# the column tile, VGG's first conv (27 columns). 256 threads on the GPU, 8 on the simulator.
GPU_WGRAD_TAPS_TILES = (Tiles(64, 32, 32, 4, 2),)
SIM_WGRAD_TAPS_TILES = (Tiles(4, 32, 4, 2, 8),)
# The forward's all-taps kernel (make_conv_taps_kernel): the whole C*R*S <= 32 in one step.
GPU_CONV_TAPS_TILES = (Tiles(128, 64, 32, 8, 4),)
SIM_CONV_TAPS_TILES = (Tiles(4, 4, 32, 1, 4),)

_MAX_INDEX = 2**31 - 1  # shared tables and offsets are int32


# ---------------------------------------------------------------------------- references
def conv_out_size(size: int, kernel: int, stride: int, pad: int) -> int:
    return (size + 2 * pad - kernel) // stride + 1


def _patches(x: np.ndarray, R: int, S: int, stride: int, pad: int) -> np.ndarray:
    """(N, C, H, W) -> (N, C, R, S, P, Q) view of every input patch (float64)."""
    N, C, H, W = x.shape
    P, Q = conv_out_size(H, R, stride, pad), conv_out_size(W, S, stride, pad)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    out = np.empty((N, C, R, S, P, Q))
    for r in range(R):
        for s in range(S):
            out[:, :, r, s] = xp[:, :, r:r + stride * (P - 1) + 1:stride, s:s + stride * (Q - 1) + 1:stride]
    return out


def conv2d_ref(x, w, bias=None, *, stride=1, pad=0, relu=False) -> np.ndarray:
    out = np.einsum("ncrspq,kcrs->nkpq", _patches(x, w.shape[2], w.shape[3], stride, pad),
                    w.astype(np.float64))
    if bias is not None:
        out += bias.astype(np.float64)[None, :, None, None]
    return (np.maximum(out, 0) if relu else out).astype(np.float32)


def conv2d_bwd_data_ref(dy, w, x_shape, *, stride=1, pad=0) -> np.ndarray:
    N, C, H, W = x_shape
    _, _, R, S = w.shape
    P, Q = dy.shape[2:]
    cols = np.einsum("nkpq,kcrs->ncrspq", dy.astype(np.float64), w.astype(np.float64))
    dxp = np.zeros((N, C, H + 2 * pad, W + 2 * pad))
    for r in range(R):
        for s in range(S):
            dxp[:, :, r:r + stride * (P - 1) + 1:stride, s:s + stride * (Q - 1) + 1:stride] += cols[:, :, r, s]
    return dxp[:, :, pad:pad + H, pad:pad + W].astype(np.float32)


def conv2d_bwd_weight_ref(x, dy, w_shape, *, stride=1, pad=0):
    """-> (dw, db)."""
    _, _, R, S = w_shape
    dw = np.einsum("ncrspq,nkpq->kcrs", _patches(x, R, S, stride, pad), dy.astype(np.float64))
    return dw.astype(np.float32), dy.astype(np.float64).sum(axis=(0, 2, 3)).astype(np.float32)


def _build(tiles, make):
    return {t: make(t) for t in tiles}


_CONV_TILES = GPU_CONV_TILES + GPU_CONV_MMA_TILES + (
    SIM_CONV_TILES + SIM_CONV_MMA_TILES if backend.SIMULATOR else ())
_WGRAD_TILES = GPU_WGRAD_TILES + GPU_WGRAD_MMA_TILES + (
    SIM_WGRAD_TILES + SIM_WGRAD_MMA_TILES if backend.SIMULATOR else ())
_FWD = _build(_CONV_TILES, lambda t: make_conv_kernel(t, transposed=False))
# Backward-data is compiled per stride (its divisions by the stride become constants): the
# strides of VGG (1) and of Wav2Vec2's encoder past its first layer (2) at import, the rest
# (the first layer's 5, whose input is the waveform: a gradient only tests ask for) when
# first launched
_BWD_DATA = {(t, st): make_conv_kernel(t, transposed=True, stride=st)
             for t in _CONV_TILES for st in (1, 2)}


def _bwd_data_kernel(t: Tiles, stride: int):
    if (t, stride) not in _BWD_DATA:
        _BWD_DATA[t, stride] = make_conv_kernel(t, transposed=True, stride=stride)
    return _BWD_DATA[t, stride]
_WGRAD = _build(_WGRAD_TILES, make_wgrad_kernel)
_WGRAD_TAPS = _build(GPU_WGRAD_TAPS_TILES + (SIM_WGRAD_TAPS_TILES if backend.SIMULATOR else ()),
                     make_wgrad_taps_kernel)
_FWD_TAPS = _build(GPU_CONV_TAPS_TILES + (SIM_CONV_TAPS_TILES if backend.SIMULATOR else ()),
                   make_conv_taps_kernel)
# The all-taps tiles this device takes unless a test forces another
_FWD_TAPS_TILE = (SIM_CONV_TAPS_TILES if backend.SIMULATOR else GPU_CONV_TAPS_TILES)[0]
_WGRAD_TAPS_TILE = (SIM_WGRAD_TAPS_TILES if backend.SIMULATOR else GPU_WGRAD_TAPS_TILES)[0]


# ---------------------------------------------------------------------------- tile choice
# The layers' tiles measured on this kind of GPU (kernels.tuning: its "conv" section), each
# one of the tiles built above.
TUNED = () if backend.SIMULATOR or backend.PTX_ONLY else tuning.table(backend.device_name()).conv
for _, _t in TUNED:
    if _t not in _FWD:
        raise ValueError(f"kernels/tuned/{backend.device_name()}.json: conv tile {_t} is not "
                         f"built; choose from {sorted(_FWD)}")


def _pick_conv_tiles(columns: int) -> Tiles:
    """Tiles for a GEMM with `columns` output channels."""
    if backend.SIMULATOR:
        return next((t for t in SIM_CONV_TILES if t.bn >= columns), SIM_CONV_TILES[-1])
    wide, medium, narrow = GPU_CONV_TILES
    return narrow if columns <= 16 else medium if columns <= 64 else wide


def _pick_wgrad_tiles(K: int, C: int) -> Tiles:
    if backend.SIMULATOR:
        bm = next((b for b in (4, 8, 16) if b >= K), 16)
        bn = next((b for b in (4, 8, 16) if b >= C), 16)
        return next(t for t in SIM_WGRAD_TILES if (t.bm, t.bn) == (bm, bn))
    wide, medium, narrow = GPU_WGRAD_TILES
    return narrow if C <= 16 else wide if min(K, C) >= 128 else medium


# A last round of one block per SM, where more fit, takes about 5/8 of a full round (a block
# alone on an SM runs ~1.6x faster); one of two or more blocks per SM, a full round.
PARTIAL_ROUND = 0.625


def wgrad_splits(base_blocks: int, L: int, bk: int, wave: int, sms: int) -> int:
    """How many ways to split a weight gradient's reduction of L rows in steps of bk
    (conv2d_bwd_weight's N*P*Q; kernels.conv1d's grouped one, its B * ceil(T_out / depth)
    steps of depth rows). The grid is `base_blocks` x splits blocks of equal work; the
    busiest of the `sms` SMs gets ceil(blocks / sms) of them and runs wave // sms at a time,
    so it takes full rounds plus maybe a last one (PARTIAL_ROUND), of blocks 1/splits as
    long. Take the fewest splits within 1% of the least time, among at most two waves' worth
    of blocks and at least 8 steps a block.

    Measured on the H200 (kernel_speed): the plain rule (splits for two waves: 531 blocks of
    a 264-block wave) left a third round of a few blocks; VGG's 256-channel layer's weight
    gradient ran 18% faster at 7 splits (252 blocks) than at 15 (540), and the 512-channel
    one 3.5% slower at 3 splits (432) than at 4 (576, whose small third round costs 5/8)."""
    per_sm = max(1, wave // sms)
    most = max(1, min(L // (8 * bk), -(-2 * wave // base_blocks)))

    def time(splits):
        rounds, rest = divmod(-(-base_blocks * splits // sms), per_sm)
        last = 0 if rest == 0 else PARTIAL_ROUND if rest == 1 < per_sm else 1
        return (rounds + last) / splits
    best = min(time(k) for k in range(1, most + 1))
    return next(k for k in range(1, most + 1) if time(k) <= 1.01 * best)


# ---------------------------------------------------------------------------- launchers
def _check_geometry(x_shape, w, stride, pad, w_name="w"):
    stride = _check.positive("stride", stride)
    pad = _check.integer("pad", pad, at_least=0)
    _check.device_array(w_name, w, ndim=4)
    N, C, H, W = x_shape
    K, Cw, R, S = w.shape
    if Cw != C:
        raise ValueError(f"{w_name}: expected {C} input channels (shape (K, {C}, R, S)), "
                         f"got {tuple(w.shape)}")
    P, Q = conv_out_size(H, R, stride, pad), conv_out_size(W, S, stride, pad)
    if P <= 0 or Q <= 0:
        raise ValueError(f"{w_name}: a {R}x{S} kernel with pad {pad} does not fit a {H}x{W} input")
    if max(N * C * H * W, N * K * P * Q, w.size) > _MAX_INDEX:
        raise ValueError("conv: tensors beyond 2**31 elements are not supported (int32 offsets)")
    return int(stride), int(pad), (N, C, H, W, K, R, S, P, Q)


def _all_taps(tiles, table, default: Tiles, axis: str, columns: int) -> Tiles | None:
    """The all-taps tile for a layer of `columns` (C*R*S) reduction columns, which a tile
    holds `axis` ("bk" or "bn") of: `tiles` where it is one of `table`'s (refused if too
    narrow), `default` where none is forced and the columns fit it; else None, the tap-major
    kernels."""
    if tiles not in table and not (tiles is None and columns <= getattr(default, axis)):
        return None
    t = default if tiles is None else tiles
    if columns > getattr(t, axis):
        raise ValueError(f"tiles: {t} takes at most {getattr(t, axis)} columns (C*R*S), "
                         f"got {columns}")
    return t


def _tiles_or(tiles, table, pick):
    if tiles is None:
        return pick()
    if tiles not in table:
        raise ValueError(f"tiles: {tiles} is not built; choose from {sorted(table)}")
    return tiles


def conv2d(x, w, bias, out, *, stride=1, pad=0, relu=False, tiles=None, stream=0):
    """out = conv2d(x, w) + bias, then max(., 0) if `relu`.  x (N,C,H,W), w (K,C,R,S),
    bias (K,) or None, out (N,K,P,Q) with P = (H + 2*pad - R)//stride + 1.
    `tiles` forces a tile shape (tests)."""
    _check.device_array("x", x, ndim=4)
    stride, pad, (N, C, H, W, K, R, S, P, Q) = _check_geometry(x.shape, w, stride, pad)
    _check.device_array("out", out, shape=(N, K, P, Q))
    relu = _check.flag("relu", relu)
    if bias is not None:
        _check.device_array("bias", bias, shape=(K,))
    t = _all_taps(tiles, _FWD_TAPS, _FWD_TAPS_TILE, "bk", C * R * S)   # all in one step
    if t is not None:
        kernel = _FWD_TAPS[t]
    else:
        t = _tiles_or(tiles, _FWD, lambda: tuning.conv_choice("fwd", C, K, R, S, stride, TUNED)
                      or _pick_conv_tiles(K))
        kernel = _FWD[t]
    flat_w = w.reshape(w.size)
    grid = (math.ceil(N * P * Q / t.bm), math.ceil(K / t.bn))
    launch(kernel, grid, t.threads,
           (x.reshape(x.size), flat_w, flat_w if bias is None else bias, int(bias is not None),
            RELU if relu else RELU_NONE, out.reshape(out.size), N, C, H, W, K, P, Q, R, S, stride,
            pad), stream)


def conv2d_bwd_data(dy, w, dx, *, stride=1, pad=0, relu_mask=False, tiles=None, stream=0):
    """dx = gradient of conv2d's input. dy (N,K,P,Q), w (K,C,R,S), dx (N,C,H,W) (written).

    relu_mask: dx holds, on entry, the ReLU output y that was conv2d's input; it becomes the
    gradient through that ReLU, where(y > 0, gradient, 0) (relu_bwd fused, y written over,
    so the step never holds y and its gradient at once)."""
    _check.device_array("dx", dx, ndim=4)
    stride, pad, (N, C, H, W, K, R, S, P, Q) = _check_geometry(dx.shape, w, stride, pad)
    _check.device_array("dy", dy, shape=(N, K, P, Q))
    relu_mask = _check.flag("relu_mask", relu_mask)
    t = _tiles_or(tiles, _CONV_TILES, lambda: tuning.conv_choice("bwd_data", C, K, R, S,
                                                                 stride, TUNED)
                  or _pick_conv_tiles(C))
    flat_w = w.reshape(w.size)
    # Past stride 1 a block computes one phase (residues of h and w mod stride) of dx: the
    # largest phase's pixels along x, the stride^2 phases along z (kernels._conv_kernels)
    phase_pixels = N * math.ceil(H / stride) * math.ceil(W / stride)
    grid = (math.ceil(phase_pixels / t.bm), math.ceil(C / t.bn), stride * stride)
    launch(_bwd_data_kernel(t, stride), grid, t.threads,
           (dy.reshape(dy.size), flat_w, flat_w, 0, RELU_MASK if relu_mask else RELU_NONE,
            dx.reshape(dx.size), N, K, P, Q, C, H, W, R, S, stride, pad), stream)


class _WgradLaunch(NamedTuple):
    kernel: object
    tiles: Tiles
    grid: tuple      # (k tiles, column tiles, blocks a split) before splitting
    splits: int
    chunk: int       # reduction rows a split (a multiple of the tile's bk)


def _wgrad_launch(geometry, tiles, splits) -> _WgradLaunch:
    """How a backward-weight runs: the all-taps kernel where C*R*S fits its column tile, else
    a tap per block; the reduction over L = N*P*Q cut into `splits` chunks."""
    N, C, H, W, K, R, S, P, Q = geometry
    t = _all_taps(tiles, _WGRAD_TAPS, _WGRAD_TAPS_TILE, "bn", C * R * S)   # all in a block
    if t is not None:
        kernel, grid = _WGRAD_TAPS[t], (math.ceil(K / t.bm), 1, 1)
    else:
        t = _tiles_or(tiles, _WGRAD, lambda: _pick_wgrad_tiles(K, C))
        kernel, grid = _WGRAD[t], (math.ceil(K / t.bm), math.ceil(C / t.bn), R * S)
    L = N * P * Q
    if splits is not None:
        n_split = _check.positive("splits", splits)
    elif backend.SIMULATOR:   # one split: there blocks only cost time
        n_split = 1
    else:
        n_split = wgrad_splits(math.prod(grid), L, t.bk, _check.resident_blocks(kernel, t.threads),
                               _check.sm_count())
    chunk = math.ceil(math.ceil(L / n_split) / t.bk) * t.bk
    return _WgradLaunch(kernel, t, grid, math.ceil(L / chunk), chunk)


def wgrad_workspace_size(x_shape, dw_shape, *, stride=1, pad=0, tiles=None, splits=None) -> int:
    """float32 elements `conv2d_bwd_weight` needs as `workspace` for these shapes on this
    device (0: the reduction is not split, no workspace). It depends on the GPU's SM count."""
    K, C, R, S = dw_shape
    N, _, H, W = x_shape
    P, Q = conv_out_size(H, R, stride, pad), conv_out_size(W, S, stride, pad)
    plan = _wgrad_launch((N, C, H, W, K, R, S, P, Q), tiles, splits)
    return _partials_size(plan.splits, K * C * R * S, K)


def _partials_size(n_split: int, dw_size: int, K: int) -> int:
    """Workspace elements for `n_split` partial dw (dw_size each) and db (K each); 0 unsplit."""
    return 0 if n_split == 1 else n_split * (dw_size + K)


def conv2d_bwd_weight(x, dy, dw, db, *, stride=1, pad=0, tiles=None, splits=None, workspace=None,
                      stream=0):
    """dw (K,C,R,S) and db (K,) or None = gradients of conv2d's weight and bias (overwritten).
    x (N,C,H,W) is the forward input, dy (N,K,P,Q). `splits` forces the reduction split.
    workspace: a 1-D float32 device array of at least `wgrad_workspace_size(...)` elements,
    where the split partial sums go (not needed when that size is 0)."""
    _check.device_array("x", x, ndim=4)
    _check.device_array("dw", dw, ndim=4)
    stride, pad, geometry = _check_geometry(x.shape, dw, stride, pad, "dw")
    N, C, H, W, K, R, S, P, Q = geometry
    _check.device_array("dy", dy, shape=(N, K, P, Q))
    if db is not None:
        _check.device_array("db", db, shape=(K,))
    plan = _wgrad_launch(geometry, tiles, splits)
    n_split = plan.splits
    flat_dw = dw.reshape(dw.size)
    part_w, part_b = flat_dw, (flat_dw if db is None else db)
    if n_split > 1:
        need = _partials_size(n_split, dw.size, K)
        if workspace is not None:
            _check.device_array("workspace", workspace, ndim=1)
        if workspace is None or workspace.size < need:
            got = "none" if workspace is None else f"{workspace.size}"
            raise ValueError(f"workspace: the reduction is split {n_split} ways, so it needs a "
                             f"float32 device array of at least {need} elements "
                             f"(wgrad_workspace_size), got {got}")
        part_w, part_b = workspace[:n_split * dw.size], workspace[n_split * dw.size:need]
    # Split, the launches below write the workspace, then dw and db from it: check all at once.
    _check.separate({"dw": dw, "db": db, "workspace": workspace if n_split > 1 else None},
                    {"x": x, "dy": dy})
    gx, gy, gz = plan.grid
    launch(plan.kernel, (gx, gy, gz * n_split), plan.tiles.threads,
           (x.reshape(x.size), dy.reshape(dy.size), part_w, part_b,
            int(db is not None), N, C, H, W, K, P, Q, R, S, stride, pad, plan.chunk), stream)
    if n_split > 1:
        for part, out in ((part_w, flat_dw),) + (((part_b, db),) if db is not None else ()):
            blocks, threads = _check.grid_stride_launch(out.size)
            launch(sum_splits_kernel, blocks, threads, (part, out, n_split), stream)


def conv2d_flops(N, C, K, R, S, P, Q) -> float:
    """Multiply-adds x 2 of one conv2d pass (forward, backward-data and backward-weight alike)."""
    return 2.0 * N * K * P * Q * C * R * S


# ---------------------------------------------------------------------------- benchmark
def _main(argv=None):
    """Check every pass against the reference on one small shape, then time VGG-16's conv
    layers (batch and image size from the command line) and print TFLOPS, next to PyTorch
    (cuDNN, TF32 off) when it is installed:  python -m kernels.conv [batch] [image_size]"""
    import sys

    from proto.device import timing
    argv = sys.argv[1:] if argv is None else argv
    batch, size = (int(argv[0]) if argv else 32), (int(argv[1]) if len(argv) > 1 else 224)
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((2, 5, 9, 7), (6, 5, 3, 3), (6,)))
    dy = rng.standard_normal((2, 6, 9, 7)).astype(np.float32)
    out, dx = cuda.device_array(dy.shape, np.float32), cuda.device_array(x.shape, np.float32)
    dw, db = cuda.device_array(w.shape, np.float32), cuda.device_array(6, np.float32)
    conv2d(cuda.to_device(x), cuda.to_device(w), cuda.to_device(b), out, pad=1)
    conv2d_bwd_data(cuda.to_device(dy), cuda.to_device(w), dx, pad=1)
    conv2d_bwd_weight(cuda.to_device(x), cuda.to_device(dy), dw, db, pad=1)
    ref_w, ref_b = conv2d_bwd_weight_ref(x, dy, w.shape, pad=1)
    for got, want in ((out, conv2d_ref(x, w, b, pad=1)), (dx, conv2d_bwd_data_ref(dy, w, x.shape, pad=1)),
                      (dw, ref_w), (db, ref_b)):
        np.testing.assert_allclose(got.copy_to_host(), want, rtol=1e-4, atol=1e-4)
    print(f"All results match. VGG-16 conv layers, batch {batch}, {size}x{size}, {backend.describe()}")
    try:
        import torch
        torch.backends.cudnn.allow_tf32 = False
    except ImportError:
        torch = None
    shapes, c, s = [], 3, size
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            s //= 2
        else:
            if (c, v, s) not in shapes:
                shapes.append((c, v, s))
            c = v
    print(f"{'C':>4} {'K':>4} {'HxW':>7} | {'fwd':>14} {'bwd_data':>14} {'bwd_weight':>14}   TFLOPS (ms)"
          + ("   | cuDNN fwd, data, weight" if torch else ""))
    for C, K, S in shapes:
        xs = cuda.to_device(rng.standard_normal((batch, C, S, S), dtype=np.float32))
        ws = cuda.to_device(rng.standard_normal((K, C, 3, 3), dtype=np.float32) * 0.05)
        bs = cuda.to_device(np.zeros(K, np.float32))
        ys = cuda.device_array((batch, K, S, S), np.float32)
        dxs, dws = cuda.device_array_like(xs), cuda.device_array_like(ws)
        part = cuda.device_array(max(wgrad_workspace_size(xs.shape, ws.shape, pad=1), 1), np.float32)
        flops = conv2d_flops(batch, C, K, 3, 3, S, S)
        runs = [lambda: conv2d(xs, ws, bs, ys, pad=1, relu=True),
                lambda: conv2d_bwd_data(ys, ws, dxs, pad=1),
                lambda: conv2d_bwd_weight(xs, ys, dws, bs, pad=1, workspace=part)]
        cells = []
        for run in runs:
            t = timing.bench(run, warmup=2, reps=5)
            cells.append(f"{flops / t.median_ms / 1e9:6.1f} ({t.median_ms:6.2f})")
        line = f"{C:4d} {K:4d} {S:3d}x{S:<3d} | " + " ".join(cells)
        if torch is not None:
            tx = torch.randn(batch, C, S, S, device="cuda", requires_grad=True)
            tw = torch.randn(K, C, 3, 3, device="cuda", requires_grad=True)
            ty = torch.randn(batch, K, S, S, device="cuda")
            tg = [lambda: torch.nn.functional.conv2d(tx, tw, padding=1),
                  lambda: torch.nn.grad.conv2d_input(tx.shape, tw, ty, padding=1),
                  lambda: torch.nn.grad.conv2d_weight(tx, tw.shape, ty, padding=1)]
            line += "   | " + " ".join(f"{flops / timing.bench(f, warmup=2, reps=5).median_ms / 1e9:6.1f}" for f in tg)
        print(line, flush=True)


if __name__ == "__main__":
    _main()
