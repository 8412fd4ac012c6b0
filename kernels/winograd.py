"""Winograd F(4x4, 3x3) convolution (Lavin and Gray, 2016): 3x3, stride 1, NCHW float32.

A direct 3x3 convolution spends 9 multiply-adds an output and input channel. Winograd's
minimal filtering computes a 4x4 tile of outputs from a 6x6 tile of input with 36
multiplications instead of 144, once both are carried into a transformed space:

    U = G g G^T     the 3x3 filter g of each (output, input) channel pair, as a 6x6
    V = B^T d B     each 6x6 input patch d (origin 4*ty - pad, 4*tx - pad; zero outside)
    M = U . V       elementwise in the 6x6, summed over input channels: for each of the 36
                    positions xi, one GEMM (K x C) @ (C x tiles) (kernels.gemm, batched)
    Y = A^T M A     the tile's 4x4 outputs, then + bias and ReLU

    B^T = [4  0 -5  0  1  0]    G = [ 1/4     0     0]    A^T = [1  1  1  1  1  0]
          [0 -4 -4  1  1  0]        [-1/6  -1/6  -1/6]          [0  1 -1  2 -2  0]
          [0  4 -4 -1  1  0]        [-1/6   1/6  -1/6]          [0  1  1  4  4  0]
          [0 -2 -1  2  1  0]        [1/24  1/12   1/6]          [0  1 -1  8 -8  1]
          [0  2 -1 -2  1  0]        [1/24 -1/12   1/6]
          [0  4  0 -5  0  1]        [   0     0     1]

So 4x fewer multiply-adds than direct convolution where the output is a multiple of 4 on a
side (VGG's 224..28; at 14x14 the 4x4 tiles cover 16x16 and 3.1x), for three memory-bound
transform launches and a workspace (U, then V and M for a chunk of images) that the caller
provides: `workspace_size` says how much, and a smaller workspace runs the batch in chunks of
fewer images (at least one must fit). F(2x2, 3x3), this module's first algorithm, saves
2.25x and transforms each input value into 4 (against 2.25 here); on the H200 its GEMMs took
90% of each convolution, so the larger tile wins the multiply-adds back at no cost in bytes.
The price is rounding: the transforms' larger constants make float32 errors several times
those of F(2x2, 3x3) (Lavin and Gray's error analysis; the tests bound them).

Backward-data is the same convolution of dy with each filter rotated by 180 degrees and its
channel axes swapped, padded by 2 - pad (`conv2d_bwd_data`). Backward-weight is F(3x3, 4x4),
the same algorithm transposed: a 3x3 filter gradient from each 4x4 tile of dy against the
6x6 input patch under it, summed over every tile of every image by the GEMMs
(`conv2d_bwd_weight`):

    dw[k, c] = G^T [ sum over tiles of (A g A^T) . (B^T d B) ] G,   g a 4x4 tile of dy[:, k]

with A = (A^T)^T (6 x 4), and the bias gradient a plain sum of dy.

Results are deterministic (fixed order everywhere), though not the bits of the direct kernels
(kernels.conv): the sums run in another order, and the transforms add rounding. A NaN or
infinity in an input spoils every output whose window holds it, as in the direct
convolution, and may spoil other outputs of the 4x4 tiles whose 6x6 patch holds it.
"""
from __future__ import annotations

import numpy as np

from kernels import _check, gemm
from kernels._conv_kernels import RELU, RELU_MASK, RELU_NONE
from kernels._reduce import block_allreduce
from kernels.conv import conv_out_size
from proto.device import backend
from proto.device.backend import cuda, jit, launch

M = 4            # outputs a tile has on a side: F(4x4, 3x3)
ALPHA = M + 2    # ... and input (and transformed) values on a side
XI = ALPHA * ALPHA   # positions of the 6x6 transformed tile
_TILE = M * M        # a 4x4 tile's values (local arrays need their sizes as plain globals)
_AG = ALPHA * M      # A g: 6 x 4
_ZERO = np.float32(0.0)
_2, _4, _5, _8 = (np.float32(v) for v in (2, 4, 5, 8))
_QUARTER, _SIXTH, _12TH, _24TH = (np.float32(1 / v) for v in (4, 6, 12, 24))
_MINUS_SIXTH = np.float32(-1 / 6)
_MAX_INDEX = 2**31 - 1
_GRID_YZ = 65535   # a grid's y and z limits: the transforms' channels and images


# ---------------------------------------------------------------------------- the matrices
# One row or column of six (or four, or three) values at a time, written out so that no
# multiplication by a zero of the matrices is made (and no NaN spreads through one).
@cuda.jit(device=True)
def _bt(d0, d1, d2, d3, d4, d5):
    """B^T d for a column d of 6."""
    return (_4 * d0 - _5 * d2 + d4,
            d3 + d4 - _4 * (d1 + d2),
            _4 * (d1 - d2) - d3 + d4,
            _2 * (d3 - d1) - d2 + d4,
            _2 * (d1 - d3) - d2 + d4,
            _4 * d1 - _5 * d3 + d5)


@cuda.jit(device=True)
def _g(g0, g1, g2):
    """G g for a column g of 3."""
    s, t = g0 + g2, g1
    return (_QUARTER * g0,
            _MINUS_SIXTH * (s + t),
            _MINUS_SIXTH * (s - t),
            _24TH * g0 + _12TH * g1 + _SIXTH * g2,
            _24TH * g0 - _12TH * g1 + _SIXTH * g2,
            g2)


@cuda.jit(device=True)
def _at(a0, a1, a2, a3, a4, a5):
    """A^T a for a column a of 6."""
    p, q = a1 + a2, a1 - a2
    r, t = a3 + a4, a3 - a4
    return a0 + p + r, q + _2 * t, p + _4 * r, q + _8 * t + a5


@cuda.jit(device=True)
def _a(g0, g1, g2, g3):
    """A g for a column g of 4 (A = (A^T)^T, 6 x 4)."""
    return (g0,
            g0 + g1 + g2 + g3,
            g0 - g1 + g2 - g3,
            g0 + _2 * g1 + _4 * g2 + _8 * g3,
            g0 - _2 * g1 + _4 * g2 - _8 * g3,
            g3)


@cuda.jit(device=True)
def _gt(m0, m1, m2, m3, m4, m5):
    """G^T m for a column m of 6."""
    return (_QUARTER * m0 - _SIXTH * (m1 + m2) + _24TH * (m3 + m4),
            _SIXTH * (m2 - m1) + _12TH * (m3 - m4),
            _SIXTH * (m3 + m4 - m1 - m2) + m5)


# ---------------------------------------------------------------------------- kernels
@cuda.jit(device=True)
def _tile_here(P, Q, n0):
    """(image, channel, tile of the chunk, tile row, tile column, inside) of this thread in a
    transform's grid (an image's tiles, channels, images of the chunk starting at image n0)
    over P x Q outputs: the image and channel come from the block, so finding the tile takes
    one division, not one per index. `inside`: the thread has a tile."""
    TW = (Q + M - 1) // M
    per_image = (P + M - 1) // M * TW
    r = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    return (n0 + cuda.blockIdx.z, cuda.blockIdx.y, cuda.blockIdx.z * per_image + r,
            r // TW, r % TW, r < per_image)


@jit("void(float32[:, :, :, ::1], int32, float32[:, :, ::1])", writes=("u",))
def filter_transform_kernel(w, transposed, u):
    """u[xi, k, c] = (G g G^T)[xi] for g = w[k, c] (K, C, 3, 3); with `transposed`,
    u[xi, c, k] = (G g' G^T)[xi] for g' = w[k, c] rotated by 180 degrees (backward-data).
    Grid-stride over the K * C filters."""
    g = cuda.local.array(9, np.float32)
    gg = cuda.local.array(18, np.float32)   # G g, 6 x 3
    K, C = w.shape[0], w.shape[1]
    for e in range(cuda.grid(1), K * C, cuda.gridsize(1)):
        k, c = e // C, e % C
        for r in range(3):
            for s in range(3):
                g[r * 3 + s] = w[k, c, 2 - r, 2 - s] if transposed else w[k, c, r, s]
        for s in range(3):
            col = _g(g[s], g[3 + s], g[6 + s])
            for i in range(ALPHA):
                gg[i * 3 + s] = col[i]
        for i in range(ALPHA):
            row = _g(gg[i * 3], gg[i * 3 + 1], gg[i * 3 + 2])
            for j in range(ALPHA):
                if transposed:
                    u[i * ALPHA + j, c, k] = row[j]
                else:
                    u[i * ALPHA + j, k, c] = row[j]


@jit("void(float32[:, :, :, ::1], int32, int32, float32[:, :, ::1])", writes=("v",))
def input_transform_kernel(x, pad, n0, v):
    """v[xi, c, t] = (B^T d B)[xi] for the 6x6 patch d of image n0 + z, channel c = blockIdx.y,
    tile (ty, tx): origin (4 ty - pad, 4 tx - pad), zero outside the image; t = z * TH * TW +
    ty * TW + tx. Grid (tiles of an image / threads, C, images of the chunk)."""
    d = cuda.local.array(XI, np.float32)
    H, W = x.shape[2], x.shape[3]
    n, c, t, ty, tx, inside = _tile_here(H + 2 * pad - 2, W + 2 * pad - 2, n0)
    if not inside:
        return
    y0, x0 = M * ty - pad, M * tx - pad
    for i in range(ALPHA):
        for j in range(ALPHA):
            yy, xx = y0 + i, x0 + j
            d[i * ALPHA + j] = x[n, c, min(max(yy, 0), H - 1), min(max(xx, 0), W - 1)] \
                if 0 <= yy < H and 0 <= xx < W else _ZERO
    for j in range(ALPHA):   # B^T d, column by column, in place
        col = _bt(d[j], d[6 + j], d[12 + j], d[18 + j], d[24 + j], d[30 + j])
        for i in range(ALPHA):
            d[i * ALPHA + j] = col[i]
    for i in range(ALPHA):   # then (B^T d) B, row by row
        row = _bt(d[i * 6], d[i * 6 + 1], d[i * 6 + 2], d[i * 6 + 3], d[i * 6 + 4],
                  d[i * 6 + 5])
        for j in range(ALPHA):
            v[i * ALPHA + j, c, t] = row[j]


@jit("void(float32[:, :, ::1], float32[::1], int32, int32, int32, float32[:, :, :, ::1])",
     writes=("out",))
def output_transform_kernel(m, bias, has_bias, relu, n0, out):
    """out[n0 + z, k, 4 ty + i, 4 tx + j] = (A^T m A)[i, j] (+ bias[k], then the `relu`
    epilogue of kernels._conv_kernels: RELU_NONE, RELU or RELU_MASK) for the 36 values
    m[:, k, t] of tile (ty, tx) of image z, k = blockIdx.y, the outputs that lie inside out.
    Grid (tiles of an image / threads, K, images of the chunk)."""
    a = cuda.local.array(XI, np.float32)
    P, Q = out.shape[2], out.shape[3]
    n, k, t, ty, tx, inside = _tile_here(P, Q, n0)
    if not inside:
        return
    for q in range(XI):
        a[q] = m[q, k, t]
    b = bias[k] if has_bias else _ZERO
    for j in range(ALPHA):   # A^T a: rows 0..3, column by column
        col = _at(a[j], a[6 + j], a[12 + j], a[18 + j], a[24 + j], a[30 + j])
        for i in range(M):
            a[i * ALPHA + j] = col[i]
    for i in range(M):
        y = _at(a[i * 6], a[i * 6 + 1], a[i * 6 + 2], a[i * 6 + 3], a[i * 6 + 4], a[i * 6 + 5])
        p = M * ty + i
        for j in range(M):
            qq = M * tx + j
            if p < P and qq < Q:
                val = y[j] + b
                if relu == RELU:
                    val = max(val, _ZERO)
                elif relu == RELU_MASK and not out[n, k, p, qq] > _ZERO:   # (kernels.conv)
                    val = _ZERO
                out[n, k, p, qq] = val


@jit("void(float32[:, :, :, ::1], int32, float32[:, :, ::1])", writes=("ud",))
def grad_transform_kernel(dy, n0, ud):
    """ud[xi, k, t] = (A g A^T)[xi] for the 4x4 tile g (ty, tx) of dy[n0 + z, k] (zero past
    dy's edge), k = blockIdx.y. Grid (tiles of an image / threads, K, images of the chunk)."""
    g = cuda.local.array(_TILE, np.float32)
    ag = cuda.local.array(_AG, np.float32)   # A g, 6 x 4
    P, Q = dy.shape[2], dy.shape[3]
    n, k, t, ty, tx, inside = _tile_here(P, Q, n0)
    if not inside:
        return
    for i in range(M):
        for j in range(M):
            p, q = M * ty + i, M * tx + j
            g[i * M + j] = dy[n, k, min(p, P - 1), min(q, Q - 1)] if p < P and q < Q else _ZERO
    for j in range(M):   # the columns of A g
        col = _a(g[j], g[4 + j], g[8 + j], g[12 + j])
        for i in range(ALPHA):
            ag[i * M + j] = col[i]
    for i in range(ALPHA):   # then (A g) A^T: A on each row
        row = _a(ag[i * 4], ag[i * 4 + 1], ag[i * 4 + 2], ag[i * 4 + 3])
        for j in range(ALPHA):
            ud[i * ALPHA + j, k, t] = row[j]


@jit("void(float32[:, :, ::1], float32[:, :, :, ::1])", writes=("dw",))
def weight_transform_kernel(m, dw):
    """dw[k, c] = G^T m G for the 6x6 m[:, k, c]. Grid-stride over the K * C filters."""
    a = cuda.local.array(XI, np.float32)
    K, C = dw.shape[0], dw.shape[1]
    for e in range(cuda.grid(1), K * C, cuda.gridsize(1)):
        k, c = e // C, e % C
        for q in range(XI):
            a[q] = m[q, k, c]
        for j in range(ALPHA):   # G^T a, column by column: rows 0..2
            col = _gt(a[j], a[6 + j], a[12 + j], a[18 + j], a[24 + j], a[30 + j])
            for i in range(3):
                a[i * ALPHA + j] = col[i]
        for i in range(3):
            row = _gt(a[i * 6], a[i * 6 + 1], a[i * 6 + 2], a[i * 6 + 3], a[i * 6 + 4],
                      a[i * 6 + 5])
            for j in range(3):
                dw[k, c, i, j] = row[j]


@jit("void(float32[:, :, :, ::1], float32[::1])", writes=("db",))
def bias_grad_kernel(dy, db):
    """db[k] = sum of dy[:, k]: a block per channel, its threads striding over the N * P * Q
    values, then the block's sum in a fixed order (the same bits every run)."""
    red = cuda.shared.array(32, np.float32)
    k = cuda.blockIdx.x
    N, P, Q = dy.shape[0], dy.shape[2], dy.shape[3]
    s = _ZERO
    for e in range(cuda.threadIdx.x, N * P * Q, cuda.blockDim.x):
        n, pq = e // (P * Q), e % (P * Q)
        s += dy[n, k, pq // Q, pq % Q]
    s = block_allreduce(s, False, red, 0)
    if cuda.threadIdx.x == 0:
        db[k] = s


# ---------------------------------------------------------------------------- launchers
TILE_THREADS = 256 if not backend.SIMULATOR else 32   # a tile transform's block, at most


def _tile_grid(tiles: int, channels: int, images: int) -> tuple[tuple[int, int, int], int]:
    """A tile transform's (grid, threads): (an image's tiles / threads, channels, images), a
    block no wider than an image's tiles rounded up to warps (conv5's 14x14 has 49: a block
    of 256 would leave four fifths of its threads idle and the SMs few loads in flight)."""
    threads = min(TILE_THREADS, _check.warp_threads(tiles))
    return (-(-tiles // threads), channels, images), threads


def _tiles(P: int, Q: int) -> int:
    """Output tiles (4x4) of one image with P x Q outputs."""
    return ((P + M - 1) // M) * ((Q + M - 1) // M)


def _geometry(src_shape, w_shape, pad: int, transposed: bool):
    """(N, channels in, channels out, H, W, P, Q, source pad) of the forward convolution
    that runs: of x with w, or (transposed) of dy with w rotated, padded by 2 - pad."""
    N, Cin, H, W = src_shape
    K, C = w_shape[0], w_shape[1]
    src_pad = 2 - pad if transposed else pad
    out_ch = C if transposed else K
    return N, Cin, out_ch, H, W, conv_out_size(H, 3, 1, src_pad), conv_out_size(W, 3, 1, src_pad), src_pad


def _need(cin: int, cout: int, tiles: int, images: int) -> int:
    """Workspace floats: U (36, cout, cin), then V (36, cin, T) and M (36, cout, T) for
    T = tiles * images."""
    return XI * cin * cout + XI * (cin + cout) * tiles * images


def workspace_size(x_shape, w_shape, *, pad: int = 1, images: int | None = None) -> int:
    """float32 elements each of `conv2d`, `conv2d_bwd_data` and `conv2d_bwd_weight` needs as
    `workspace` for the forward convolution of x (N, C, H, W) with w (K, C, 3, 3) and its
    gradients (dx has x's shape), running `images` images a chunk (default: the whole batch
    at once)."""
    N, C, H, W = (int(s) for s in x_shape)
    K = int(w_shape[0])
    images = N if images is None else _check.positive("images", images, at_most=N)
    P, Q = conv_out_size(H, 3, 1, pad), conv_out_size(W, 3, 1, pad)
    # the forward's tiles cover its output, backward-data's cover dx: the larger of the two
    return _need(C, K, _tiles(max(P, H), max(Q, W)), images)


def _fit(cin: int, cout: int, tiles: int, N: int, floats: int) -> int:
    """Images a chunk takes in `floats` of workspace: as many as fit, at most the batch and
    the grid's z limit (0: not even one)."""
    return max(0, min(N, _GRID_YZ, (floats - XI * cin * cout) // (XI * (cin + cout) * tiles)))


def chunk_images(x_shape, w_shape, *, pad: int = 1, floats: int) -> int:
    """The most images a chunk can take (at least 1, at most the batch) with a workspace of
    `floats` float32 elements, for the shapes of `workspace_size`."""
    N, C, H, W = (int(s) for s in x_shape)
    P, Q = conv_out_size(H, 3, 1, pad), conv_out_size(W, 3, 1, pad)
    return max(1, _fit(C, int(w_shape[0]), _tiles(max(P, H), max(Q, W)), N, floats))


def _check_call(src, w, dst, pad, transposed, names):
    src_name, dst_name = names
    _check.device_array(src_name, src, ndim=4)
    _check.device_array("w", w, ndim=4)
    _check.device_array(dst_name, dst, ndim=4)
    pad = _check.integer("pad", pad, at_least=0, at_most=2)
    K, C, R, S = w.shape
    if (R, S) != (3, 3):
        raise ValueError(f"w: Winograd F(4x4, 3x3) takes 3x3 filters, got {R}x{S} "
                         f"(shape {tuple(w.shape)}); kernels.conv takes any")
    N, cin, cout, H, W, P, Q, src_pad = _geometry(src.shape, w.shape, pad, transposed)
    want_cin = K if transposed else C
    if cin != want_cin:
        raise ValueError(f"{src_name}: expected {want_cin} channels to match w "
                         f"{tuple(w.shape)}, got shape {tuple(src.shape)}")
    if P <= 0 or Q <= 0:
        raise ValueError(f"{src_name}: a 3x3 filter with pad {pad} does not fit {H}x{W}")
    _check.device_array(dst_name, dst, shape=(N, cout, P, Q))
    _check_sizes(src.size, dst.size, XI * max(cin, cout) * N * _tiles(P, Q), max(cin, cout))
    return N, cin, cout, P, Q, src_pad


def _check_sizes(src_size: int, dst_size: int, transformed: int, channels: int) -> None:
    if max(src_size, dst_size, transformed) > _MAX_INDEX:
        raise ValueError("winograd: tensors beyond 2**31 elements are not supported (int32 offsets)")
    if channels > _GRID_YZ:   # the transforms' grid has a channel a block row
        raise ValueError(f"winograd: {channels} channels exceed the grid limit {_GRID_YZ}")


def _images_that_fit(workspace, cin: int, cout: int, tiles: int, N: int) -> int:
    _check.device_array("workspace", workspace, ndim=1)
    images = _fit(cin, cout, tiles, N, workspace.size)
    if images == 0:
        raise ValueError(f"workspace: {workspace.size} float32 elements hold less than one "
                         f"image's transforms ({_need(cin, cout, tiles, 1)}: "
                         "workspace_size(..., images=1))")
    return images


def _run(src, w, bias, relu, dst, pad, workspace, transposed, names, stream):
    N, cin, cout, P, Q, src_pad = _check_call(src, w, dst, pad, transposed, names)
    if bias is not None:
        _check.device_array("bias", bias, shape=(cout,))
    tiles = _tiles(P, Q)
    chunk = _images_that_fit(workspace, cin, cout, tiles, N)
    # The launches write the workspace and dst while they read src, w and bias: none may
    # overlap (checked before the first launch).
    _check.separate({names[1]: dst, "workspace": workspace},
                    {names[0]: src, "w": w, "bias": bias})
    u_size = XI * cin * cout
    u = workspace[:u_size].reshape(XI, cout, cin)
    blocks, threads = _check.grid_stride_launch(w.shape[0] * w.shape[1])
    launch(filter_transform_kernel, blocks, threads, (w, int(transposed), u), stream)
    bias_arg = bias if bias is not None else u.reshape(u.size)   # a placeholder never read
    for n0 in range(0, N, chunk):
        images = min(chunk, N - n0)
        t = tiles * images
        v = workspace[u_size:u_size + XI * cin * t].reshape(XI, cin, t)
        m = workspace[u_size + XI * cin * t:u_size + XI * (cin + cout) * t].reshape(XI, cout, t)
        launch(input_transform_kernel, *_tile_grid(tiles, cin, images), (src, src_pad, n0, v),
               stream)
        gemm.gemm(u, v, m, stream=stream)
        launch(output_transform_kernel, *_tile_grid(tiles, cout, images),
               (m, bias_arg, int(bias is not None), relu, n0, dst), stream)


def conv2d(x, w, bias, out, *, pad: int = 1, relu: bool = False, workspace, stream=0) -> None:
    """out = conv2d(x, w) + bias, then max(., 0) if `relu`, as kernels.conv.conv2d with
    stride 1 and a 3x3 filter. x (N, C, H, W), w (K, C, 3, 3), bias (K,) or None, out
    (N, K, H + 2 pad - 2, W + 2 pad - 2), pad 0..2. workspace: a 1-D float32 device array of
    at least workspace_size(x.shape, w.shape, pad=pad, images=1) elements (more: more images
    a chunk, up to the batch)."""
    relu = _check.flag("relu", relu)
    _run(x, w, bias, RELU if relu else RELU_NONE, out, pad, workspace, False, ("x", "out"), stream)


def conv2d_bwd_data(dy, w, dx, *, pad: int = 1, relu_mask: bool = False, workspace,
                    stream=0) -> None:
    """dx = the gradient of conv2d's input, as kernels.conv.conv2d_bwd_data with stride 1 and
    a 3x3 filter: dy (N, K, P, Q), w (K, C, 3, 3), dx (N, C, H, W) (written), pad 0..2.
    relu_mask: as kernels.conv.conv2d_bwd_data's (dx holds the ReLU output on entry; each
    output tile's thread reads its elements before it writes them).
    workspace: at least workspace_size(dx.shape, w.shape, pad=pad, images=1) elements."""
    relu_mask = _check.flag("relu_mask", relu_mask)
    _run(dy, w, None, RELU_MASK if relu_mask else RELU_NONE, dx, pad, workspace, True,
         ("dy", "dx"), stream)


def conv2d_bwd_weight(x, dy, dw, db, *, pad: int = 1, workspace, stream=0) -> None:
    """dw (K, C, 3, 3) and db (K,) or None = the gradients of conv2d's weight and bias
    (overwritten), as kernels.conv.conv2d_bwd_weight with stride 1 and a 3x3 filter: x
    (N, C, H, W) the forward input, dy (N, K, H + 2 pad - 2, W + 2 pad - 2), pad 0..2.
    workspace: at least workspace_size(x.shape, dw.shape, pad=pad, images=1) elements; the
    transformed filter gradients add up over the chunks of images in order."""
    _check.device_array("x", x, ndim=4)
    _check.device_array("dw", dw, ndim=4)
    pad = _check.integer("pad", pad, at_least=0, at_most=2)
    N, C, H, W = x.shape
    K = dw.shape[0]
    if tuple(dw.shape) != (K, C, 3, 3):
        raise ValueError(f"dw: expected shape ({K}, {C}, 3, 3) (3x3 filters over x's {C} "
                         f"channels), got {tuple(dw.shape)}")
    P, Q = H + 2 * pad - 2, W + 2 * pad - 2
    if P <= 0 or Q <= 0:
        raise ValueError(f"x: a 3x3 filter with pad {pad} does not fit {H}x{W}")
    _check.device_array("dy", dy, shape=(N, K, P, Q))
    if db is not None:
        _check.device_array("db", db, shape=(K,))
    _check_sizes(x.size, dy.size, XI * max(C, K) * N * _tiles(P, Q), max(C, K))
    tiles = _tiles(P, Q)
    chunk = _images_that_fit(workspace, C, K, tiles, N)
    _check.separate({"dw": dw, "db": db, "workspace": workspace}, {"x": x, "dy": dy})
    m_size = XI * K * C
    m = workspace[:m_size].reshape(XI, K, C)
    for n0 in range(0, N, chunk):
        images = min(chunk, N - n0)
        t = tiles * images
        ud = workspace[m_size:m_size + XI * K * t].reshape(XI, K, t)
        v = workspace[m_size + XI * K * t:m_size + XI * (K + C) * t].reshape(XI, C, t)
        launch(grad_transform_kernel, *_tile_grid(tiles, K, images), (dy, n0, ud), stream)
        launch(input_transform_kernel, *_tile_grid(tiles, C, images), (x, pad, n0, v), stream)
        gemm.gemm(ud, v, m, trans_b=True, accumulate=n0 > 0, stream=stream)
    blocks, threads = _check.grid_stride_launch(K * C)
    launch(weight_transform_kernel, blocks, threads, (m, dw), stream)
    if db is not None:
        launch(bias_grad_kernel, K, 256 if not backend.SIMULATOR else 32, (dy, db), stream)
