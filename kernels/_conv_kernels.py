"""The convolution kernels of kernels.conv (which picks the tiles and launches them).

All three are implicit GEMMs (no im2col buffer) tiled the same way: a block owns a tile of
(output rows) x (output columns) of the GEMM, loops over the reduction in steps of BK, stages
both operand tiles in double-buffered shared memory (one barrier per step), and each thread
accumulates a TM x TN micro-tile in registers. Forward and backward-data also load the next
step's tiles into registers before the current step's multiply-adds (stored to shared memory
at the next step), so the global memory latency overlaps arithmetic instead of stalling
every warp at the barrier; this also took the wide tile from 154 registers a thread (one
256-thread block per SM) to 108 (two). Their inner loop reads each thread's operands as
16-byte shared-memory loads (its rows and columns in groups of 4 adjacent, tiles 16-byte
aligned): 4 loads per 64 multiply-adds instead of 16, two reduction rows a loop pass. Every
element a thread stages in a step lies on one output pixel and one weight channel, so the
bounds and addresses are worked out once a step, and the step's tap and channel chunk are
counted forward, not divided out of the step number: in the wide forward tile's SASS a step
(512 multiply-adds) went from 1346 instructions to 845. Backward-weight reads the same way
and prefetches too (at 128 registers without spilling, since its reduction indices are
counted forward instead of divided out every step).

The reduction of forward/backward-data runs tap-major ((r,s) outer, channels inner), so the
tap is uniform across a step and a patch element costs adds and compares, no divisions: each
block decodes its pixels once into a shared table.

Layers whose C*R*S is at most 32 (VGG's first: 3 channels x 9 taps = 27) have all-taps
variants of the forward and the weight gradient: the whole reduction in one step (forward),
every tap in one block (weight gradient), with (c, r, s) decoded into a shared table, where
the tap-major kernels would use 3 of their 8 or 16 channel rows a step.

Tile shapes are compile-time constants, so each `Tiles` is its own kernel. The GPU tiles have
128 or 256 threads; the simulator, which pays about a millisecond per thread and per barrier, gets
its own small tiles sized to the problem (tests also run every GPU tile on small problems).
"""
from __future__ import annotations

import numpy as np

from kernels._tf32 import (first_place, k_major_place, lane_stage, mma_tile, split_staging,
                           staged_store)
from kernels._tile import TILE_ALIGN, Stage, Tiles, grid_place, register_tile, stager
from proto.device.backend import cuda, jit

# Hot-loop indices are unsigned (`_u`): Numba guards every signed index against Python's
# negative indexing (extra instructions and an address register per access); unsigned
# shared-memory indices compile to one base register plus immediate offsets.
_u = np.uint32
_u64 = np.uint64


def _gather(count: int, step: int):
    """A device function gather(regs, src, at, gap, left): regs[i] = src[at + i * gap] for
    the i with i * step < left, zero for the rest. A thread's staged elements: `count` of
    them, `step` tile rows (or channels) apart, of which `left` are in bounds."""
    @cuda.jit(device=True)
    def gather(regs, src, at, gap, left):
        left = np.int32(left)   # at most a tile's rows: 32-bit compares, not 64-bit pairs
        for i in range(count):
            v = np.float32(0.0)
            if i * step < left:
                v = src[at + _u64(i) * gap]
            regs[i] = v
    return gather

@cuda.jit(device=True)
def _decode_pixels(pix_src, pix_h, pix_w, pix_dst, m0, M, CI, HWI, CO, HWO, WO, stride, pad,
                   transposed, ph, pw, apart, WP, HWP):
    """A block's output pixels m0 + mm, once, into shared tables: where the pixel's image
    starts in src (-1 past the end), its patch's top-left input pixel (forward: p*st - pad;
    backward-data: h + pad) and where it goes in dst. The pixels are (ho, wo) = (ph + apart*jh,
    pw + apart*jw), HWP = HP * WP of them an image, numbered (n, jh, jw): every pixel with
    (0, 0, 1, WO, HWO), one phase of backward-data's with (ph, pw, stride, ...)."""
    for mm in range(cuda.threadIdx.x, pix_src.shape[0], cuda.blockDim.x):
        m = m0 + mm
        if m < M:
            n = m // HWP
            pix = m - n * HWP
            jh = pix // WP
            ho = ph + apart * jh
            wo = pw + apart * (pix - jh * WP)
            pix_src[mm] = n * CI * HWI
            pix_dst[mm] = n * CO * HWO + ho * WO + wo
            if transposed:
                pix_h[mm] = ho + pad
                pix_w[mm] = wo + pad
            else:
                pix_h[mm] = ho * stride - pad
                pix_w[mm] = wo * stride - pad
        else:   # past the end: never read (pix_src < 0), but defined
            pix_src[mm] = -1
            pix_h[mm] = 0
            pix_w[mm] = 0
            pix_dst[mm] = 0


@cuda.jit(device=True)
def _decode_columns(col_c, col_r, col_s, CRS, RS, S, HW):
    """Reduction columns j = (c, r, s) of the all-taps kernels, once, into shared tables: the
    offset c * H * W of channel c (-1 past C*R*S) and the tap r, s."""
    for j in range(cuda.threadIdx.x, col_c.shape[0], cuda.blockDim.x):
        c = j // RS
        rs = j - c * RS
        col_c[j] = c * HW if j < CRS else -1
        col_r[j] = rs // S
        col_s[j] = rs - (rs // S) * S


@cuda.jit(device=True)
def _patch_value(src, image, c_off, h, w, H, W):
    """The all-taps kernels' patch element: src at channel offset c_off, pixel (h, w), of the
    image starting at `image`; 0 off the image, past the end (image < 0) or past C*R*S
    (c_off < 0)."""
    if image >= 0 and c_off >= 0 and 0 <= h < H and 0 <= w < W:
        return src[_u(image + c_off + h * W + w)]
    return np.float32(0.0)


# The `relu` argument of the forward and backward-data kernels: what their epilogue does.
RELU_NONE = 0
RELU = 1        # forward: max(v, 0), keeping NaN
RELU_MASK = 2   # backward-data: dst holds the ReLU output y that fed the convolution; each
                # element becomes v where y > 0, else 0 (ReLU's backward, fused, written over
                # y: the thread that writes an element is the only one that reads it)


def _tile_store(TM: int, TN: int, row, col):
    """A device function store(acc, dst, bias, has_bias, relu, pix_dst, m0, M, n0, CO, HWO,
    tx, ty): a forward (or backward-data) thread's TM x TN outputs, + bias, then the `relu`
    epilogue (RELU_NONE, RELU or RELU_MASK)."""
    @cuda.jit(device=True)
    def store(acc, dst, bias, has_bias, relu, pix_dst, m0, M, n0, CO, HWO, tx, ty):
        for i in range(TM):
            mm = row(tx, i)
            if m0 + mm < M:
                out_base = pix_dst[mm]
                for j in range(TN):
                    co = n0 + col(ty, j)
                    if co < CO:
                        at = _u(out_base + co * HWO)
                        v = acc[i, j]
                        if has_bias != 0:
                            v += bias[_u(co)]
                        if relu == RELU and v < np.float32(0.0):   # not max(): keeps NaN
                            v = np.float32(0.0)
                        if relu == RELU_MASK and not dst[at] > np.float32(0.0):
                            v = np.float32(0.0)
                        dst[at] = v
    return store


_CONV_SIG = ("void(float32[::1], float32[::1], float32[::1], int32, int32, float32[::1], "
             "int32, int32, int32, int32, int32, int32, int32, int32, int32, int32, int32)")


def make_conv_kernel(t: Tiles, transposed: bool, stride: int | None = None):
    """Forward (transposed=False) or backward-data (True) implicit GEMM for tile shape `t`.

    Arguments: src (N, CI, HI, WI), w, bias, has_bias, relu, dst (N, CO, HO, WO), then
    N, CI, HI, WI, CO, HO, WO, R, S, stride, pad. Forward: w is (CO, CI, R, S); backward-data
    reads dy as src and w (CI, CO, R, S), i.e. the forward weight with its roles swapped.
    `stride` (backward-data, which is compiled for one stride, launched with that one):
    at 1 every tap feeds every output pixel (VGG's layers). Past 1 backward-data runs by
    phase: at stride st a pixel (h, w) takes only the taps r = h + pad (mod st),
    s = w + pad (mod st), so the pixels of one residue (h % st, w % st) share their taps;
    block z computes phase z (st * st of them, grid x over that phase's pixels) over its own
    taps alone. (Testing each tap of each pixel instead multiplied zeros for 1 - 1/st^2 of
    the steps: at stride 2 the feature encoder's backward-data ran at a third of its
    forward's speed.) The stride is a constant of the kernel, so the step loop's divisions by
    it are shifts at stride 2: by a runtime stride each took about twenty instructions, four
    a step on tensor cores, and their registers made every tile but the wide SIMT one spill
    at its cap (ptxas, sm_90: 96 and 164 bytes of spill stores and loads on the 128 x 128
    tensor tile, 160 and 264 on the 128 x 64 one, 68 and 92 on the SIMT 128 x 64; none now).
    """
    if transposed and (not isinstance(stride, int) or stride < 1):
        raise ValueError(f"stride: backward-data is compiled for a stride >= 1, got {stride!r}")
    ST = stride if transposed else 1
    PHASED = transposed and ST > 1
    BM, BN, BK, TM, TN = t[:5]
    NT = t.threads
    # Staging (stager): the patch tile walks pixels (contiguous in src), so all the elements
    # a thread stages lie on one pixel, channels KS apart; the weight tile walks channels, so
    # they lie on one weight channel, columns NS apart. The pixel's bounds and address are
    # worked out once a step, and each element costs a compare and a load.
    A_PER, B_PER = -(-BK * BM // NT), -(-BK * BN // NT)   # staged elements per thread
    a_place, _, KS = stager(False, BM, BK, NT)
    b_place, NS, _ = stager(True, BN, BK, NT)
    PAIR = t.mma
    if t.mma:   # on tensor cores, split once as staged, in fragment order (kernels._tf32)
        # A thread stages one lane's fragment words of the patch tile (lane_stage: pixels
        # mm and mm + 8, channels kk and kk + 4, one 16-byte store a part), where the
        # stager's 32 pixels of one channel would conflict 8-way.
        a_stage = lane_stage("a", BM, BK, NT)
        if a_stage is None or len(a_stage.drs) != 4:   # (one lane's words: LANE_WORDS)
            raise ValueError(f"{t}: a tensor-core convolution tile stages one lane's four "
                             f"patch words a thread: bm * bk must be 4 x its {NT} threads")
        a_place = a_stage.place
        st = split_staging(t, 2, a_stage, Stage.of(b_place, B_PER, NS, 0))
        multiply, row, col, place = st.multiply, st.row, st.col, st.place
        A_BUF, B_BUF, store_a, store_b = st.a_buf, st.b_buf, st.store_a, st.store_b
        A_DELTA, B_DELTA, a_first, b_first = st.a_delta, st.b_delta, st.a_first, st.b_first
        stores_a = st.stores_a
        TILE_T, PARTS = st.dtype, 2
    else:
        BMP = BM
        BNP = BN + 4                   # +4 columns: the k-fastest staging hits distinct banks,
                                       # and rows stay 16-byte aligned
        # The forward writes a whole step's reduction rows out (one pass, 7% fewer
        # instructions a step than pairs); so does backward-data at stride 1 with the wide
        # tile (767 SASS instructions a step of 512 multiply-adds, ~870 in pairs); with its
        # stride test it would need 149 registers, and the medium tile would spill at its 80,
        # so those take pairs.
        whole = BK <= 8 and (not transposed or (ST == 1 and t.tm * t.tn >= 64))
        per_pass = BK if whole else (2 if BK % 2 == 0 else 1)
        multiply, row, col = register_tile(t, BM, BNP, rows_per_pass=per_pass)
        place = grid_place(BM // TM)
        A_BUF, B_BUF = BK * BMP, BK * BNP
        A_DELTA = tuple(i * KS * BMP for i in range(A_PER))
        B_DELTA = tuple(i * NS for i in range(B_PER))
        a_first, b_first = first_place(k_major_place, BMP), first_place(k_major_place, BNP)
        store_a = store_b = staged_store(None)
        stores_a = None   # (the tensor-core tiles' only)
        TILE_T, PARTS = np.float32, 1
    A_SIZE, B_SIZE = PARTS * 2 * A_BUF, PARTS * 2 * B_BUF
    store = _tile_store(TM, TN, row, col)
    # The wide tile (64 accumulators a thread) must stay within 128 registers, so that two
    # 256-thread blocks share an SM; the medium one (32) within 80, so that three do (the
    # compiler takes 93 on its own; at 80 the step's SASS is the same, with no spills); the
    # narrow one takes what the compiler gives it.
    regs = {"max_registers": {64: 128, 32: 80}[t.tm * t.tn]} if t.tm * t.tn in (64, 32) else {}

    gather_a, gather_b = _gather(A_PER, KS), _gather(B_PER, NS)
    gather_pair = _gather(2, 4)

    @cuda.jit(device=True)
    def patch(p_base, p_h, p_w, kk, c0, r, s, CI, HI, WI, HWI):
        """Where a pixel's patch element for channel c0 + kk and tap (r, s) lies in src, and
        how many of the channels from there on lie in this step's chunk (none if the pixel
        is off the image)."""
        if transposed:                # the output pixel that tap (r, s) of input (h, w) feeds
            hh = p_h - r
            ww = p_w - s
            ok = p_base >= 0 and hh >= 0 and ww >= 0
            if PHASED:   # (a multiple of the stride: the phase's taps)
                hh //= ST
                ww //= ST
        else:
            hh = p_h + r
            ww = p_w + s
            ok = p_base >= 0 and hh >= 0 and ww >= 0
        ok = ok and hh < HI and ww < WI
        kk = np.int64(kk)             # signed: the simulator's NumPy wraps unsigned math
        c = c0 + kk
        # Elements left in this chunk for this thread's channels (none if the pixel is off
        # the image). Offsets are unsigned 64-bit: no negative-index fix-up, no truncation.
        left = min(CI - c, BK - kk) if ok else 0
        at = _u64(p_base + c * HWI + hh * WI + ww) if ok else _u64(0)
        return at, left

    if PAIR:
        @cuda.jit(device=True)
        def load_a(regs, src, pix, kk, c0, r, s, CI, HI, WI, HWI):
            """This thread's lane of step (c0, r, s)'s patch tile: its two pixels' channels
            kk and kk + 4, in fragment order (pixel, then channel). `pix`: the block's pixel
            tables and the first pixel, read each step (held in registers across the steps,
            two pixels' patch starts pushed the tiles past their register caps)."""
            pair = cuda.local.array(2, np.float32)
            for h in range(2):
                m = pix[3] + _u(8 * h)
                at, left = patch(pix[0][m], pix[1][m], pix[2][m], kk, c0, r, s,
                                 CI, HI, WI, HWI)
                gather_pair(pair, src, at, _u64(4 * HWI), left)
                regs[h], regs[2 + h] = pair[0], pair[1]
    else:
        @cuda.jit(device=True)
        def load_a(regs, src, pix, kk, c0, r, s, CI, HI, WI, HWI):
            """This thread's elements of step (c0, r, s)'s patch tile, into registers: one
            pixel's channels KS apart."""
            at, left = patch(pix[0], pix[1], pix[2], kk, c0, r, s, CI, HI, WI, HWI)
            gather_a(regs, src, at, _u64(KS * HWI), left)

    @cuda.jit(device=True)
    def load_b(regs, w, kk, nn, c0, n0, rs, CI, CO, RS):
        """This thread's elements of step (c0, rs)'s weight tile, into registers."""
        kk, nn = np.int64(kk), np.int64(nn)
        c, co = c0 + kk, n0 + nn
        if transposed:
            first, gap = (c * CO + co) * RS + rs, _u64(NS * RS)
        else:
            first, gap = (co * CI + c) * RS + rs, _u64(NS * CI * RS)
        left = min(CO - co, BN - nn) if c < CI else 0   # columns left for this thread
        gather_b(regs, w, _u64(first) if left > 0 else _u64(0), gap, left)

    @jit(_CONV_SIG, writes=("dst",), **regs)
    def conv_kernel(src, w, bias, has_bias, relu, dst, N, CI, HI, WI, CO, HO, WO, R, S, stride, pad):
        tid = _u(cuda.threadIdx.x)
        tx, ty = place(tid)   # (what multiply, row and col take)
        m0, n0 = cuda.blockIdx.x * BM, cuda.blockIdx.y * BN
        HWI, HWO, RS = HI * WI, HO * WO, R * S
        ph, pw, apart, WP, HWP = 0, 0, 1, WO, HWO   # (every pixel)
        if PHASED:   # this block's phase: its pixels' residues, their first taps
            ph = cuda.blockIdx.z // ST
            pw = cuda.blockIdx.z - ph * ST
            apart = ST
            WP = (WO - pw + ST - 1) // ST
            HWP = ((HO - ph + ST - 1) // ST) * WP
            r0 = (ph + pad) % ST
            s0 = (pw + pad) % ST
        M = N * HWP

        # Decode this block's output pixels once: where their patches start in src.
        pix_src = cuda.shared.array(BM, np.int32)
        pix_h = cuda.shared.array(BM, np.int32)
        pix_w = cuda.shared.array(BM, np.int32)
        pix_dst = cuda.shared.array(BM, np.int32)
        _decode_pixels(pix_src, pix_h, pix_w, pix_dst, m0, M, CI, HWI, CO, HWO, WO, stride, pad,
                       transposed, ph, pw, apart, WP, HWP)
        a_tile = cuda.shared.array(A_SIZE, TILE_T, alignment=TILE_ALIGN)
        b_tile = cuda.shared.array(B_SIZE, TILE_T, alignment=TILE_ALIGN)
        acc = cuda.local.array((TM, TN), np.float32)
        a_reg = cuda.local.array(TM, np.float32)
        b_reg = cuda.local.array(TN, np.float32)
        a_next = cuda.local.array(A_PER, np.float32)   # the next step's tiles, in flight
        b_next = cuda.local.array(B_PER, np.float32)
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        cuda.syncthreads()
        a_mm, a_kk = a_place(tid)                      # this thread's staging coordinates
        b_nn, b_kk = b_place(tid)
        if PAIR:   # (pixels a_mm and a_mm + 8)
            pix = (pix_src, pix_h, pix_w, a_mm)
        else:
            pix = (pix_src[a_mm], pix_h[a_mm], pix_w[a_mm])
        a_at = a_first(a_mm, a_kk)                     # where its patch elements go
        b_at = b_first(b_nn, b_kk)                     # ... and its weight elements

        # Steps run tap-major ((r, s) outer, channel chunks of BK inner), counted forward
        # instead of divided out of the step number. Step 0's loads, then each step stores
        # the loads made during the step before and issues its successor's before it
        # computes: the global memory latency overlaps the multiply-adds instead of stalling
        # every warp at the barrier.
        c0 = r = s = 0
        if PHASED:   # the phase's taps, stride apart; none where r0 or s0 is past the kernel
            r, s = r0, s0
            taps = ((R - r0 + ST - 1) // ST) * ((S - s0 + ST - 1) // ST)
            steps = taps * ((CI + BK - 1) // BK) if m0 < M else 0
            if steps > 0:
                load_a(a_next, src, pix, a_kk, 0, r, s, CI, HI, WI, HWI)
                load_b(b_next, w, b_kk, b_nn, 0, n0, r * S + s, CI, CO, RS)
        else:
            steps = RS * ((CI + BK - 1) // BK)
            load_a(a_next, src, pix, a_kk, 0, 0, 0, CI, HI, WI, HWI)
            load_b(b_next, w, b_kk, b_nn, 0, n0, 0, CI, CO, RS)
        for step in range(steps):
            buf = _u(step) & _u(1)   # step >= 0: no signed-remainder fix-up
            if PAIR:
                stores_a(a_tile, buf * _u(A_BUF) + a_at, a_next)
            else:
                for i in range(A_PER):
                    if a_kk + _u(i * KS) < _u(BK):
                        store_a(a_tile, buf * _u(A_BUF) + a_at + _u(A_DELTA[i]), a_next[i])
            for i in range(B_PER):
                if b_nn + _u(i * NS) < _u(BN):
                    store_b(b_tile, buf * _u(B_BUF) + b_at + _u(B_DELTA[i]), b_next[i])
            # One barrier per step: the next step fills the other buffer, and no thread can
            # refill this one before every thread has passed the next step's barrier.
            cuda.syncthreads()
            c0 += BK
            if c0 >= CI:
                c0 = 0
                if PHASED:
                    s += ST
                    if s >= S:
                        s = s0
                        r += ST
                else:
                    s += 1
                    if s == S:
                        s = 0
                        r += 1
            if step + 1 < steps:
                load_a(a_next, src, pix, a_kk, c0, r, s, CI, HI, WI, HWI)
                load_b(b_next, w, b_kk, b_nn, c0, n0, r * S + s, CI, CO, RS)
            multiply(acc, a_reg, b_reg, a_tile, b_tile, buf * _u(A_BUF), buf * _u(B_BUF),
                     tx, ty)
        store(acc, dst, bias, has_bias, relu, pix_dst, m0, M, n0, CO, HWO, tx, ty)

    return conv_kernel


_WGRAD_SIG = ("void(float32[::1], float32[::1], float32[::1], float32[::1], int32, "
              "int32, int32, int32, int32, int32, int32, int32, int32, int32, int32, int32, int32)")


def make_wgrad_kernel(t: Tiles):
    """Backward-weight for tile shape `t`: rows k, columns c, one tap per block.

    Grid: (ceil(K/BM), ceil(C/BN), R*S*splits); block z covers tap z % (R*S) and the slice
    [split*chunk, split*chunk + chunk) of the N*P*Q reduction. Stores its partial sums at
    part_w[split][k, c, r, s] (and, blocks of column tile 0 and tap 0, the bias partial from
    the dy tile at part_b[split][k]); every element is written by exactly one block. With one
    split, part_w and part_b are dw and db themselves.
    """
    BM, BN, BK, TM, TN = t[:5]
    NT = t.threads
    BIAS_ROWS = (BM + NT - 1) // NT
    place, NS, _ = stager(True, BM, BK, NT)   # both tiles walk the reduction (contiguous)
    A_PER, B_PER = -(-BM // NS), -(-BN // NS)
    # Whether every staged element lands inside its tile (a thread's first row is below NS):
    # then the stores need no bounds check, which also keeps their addresses in registers.
    A_FULL, B_FULL = BM % NS == 0, BN % NS == 0
    if t.mma:   # on tensor cores (kernels._tf32): +8, conflict-free fragment reads
        BMP, BNP = BM + 8, BN + 8
        multiply, row, col, tile_place = mma_tile(t, BMP, BNP)
    else:
        BMP, BNP = BM + 4, BN + 4      # +4: the l-fastest staging spreads over the banks,
                                       # rows 16-byte aligned
        # Reduction rows a loop pass: two for the wide tile (128 registers, no spills; four
        # spill), four for the others (the 64 x 64 tile's step: 966 SASS instructions, 1022
        # in pairs, still no spills).
        per_pass = 2 if t.tm * t.tn >= 64 else 4
        multiply, row, col = register_tile(t, BMP, BNP,
                                           rows_per_pass=per_pass if BK % per_pass == 0 else 1)
        tile_place = grid_place(BM // TM)
    A_SIZE, B_SIZE = 2 * BK * BMP, 2 * BK * BNP   # [buf][l][k | c]
    L_SIZE = 2 * BK

    @cuda.jit(device=True)
    def fill_table(l_dy, l_x, step, l, l_end, n, p, q, K, C, H, W, P, Q, r, s, stride, pad):
        """Table entry tid of step `step` (buffer step % 2): where reduction index l =
        (n, p, q) sits in dy and (for this tap) in x, -1 for zero. Threads tid < BK."""
        tid = cuda.threadIdx.x
        if tid < BK:
            at = (_u(step) & _u(1)) * _u(BK) + tid
            l_dy[at] = -1
            l_x[at] = -1
            if l < l_end:
                l_dy[at] = (n * K * P + p) * Q + q
                h = p * stride - pad + r
                ww = q * stride - pad + s
                if h >= 0 and h < H and ww >= 0 and ww < W:
                    l_x[at] = n * C * H * W + h * W + ww

    def rows_loader(PER, ROWS):
        gather = _gather(PER, NS)

        @cuda.jit(device=True)
        def load(regs, src, off, first, count, s_row, row_gap):
            """This thread's elements of a staged tile: rows first + s_row + i * NS (of
            `count`), at reduction offset `off` (-1: zeros), into registers."""
            left = min(count - first - s_row, ROWS - s_row) if off >= 0 else 0
            at = _u64(off + (first + s_row) * row_gap) if left > 0 else _u64(0)
            gather(regs, src, at, _u64(NS * row_gap), left)
        return load

    load_dy, load_x = rows_loader(A_PER, BM), rows_loader(B_PER, BN)

    # 128 registers a thread lets two 256-thread blocks share an SM. The wide tile's 64
    # accumulators sit right at that line (the compiler picks 130 on its own, which leaves
    # one block per SM and costs 40% of its speed on the H200), so hold it there.
    # part_b is part_w itself when there is no bias (has_bias 0: never written).
    @jit(_WGRAD_SIG, writes=("part_w", "part_b"), in_place=(("part_b", "part_w"),),
         max_registers=128)
    def wgrad_kernel(x, dy, part_w, part_b, has_bias, N, C, H, W, K, P, Q, R, S, stride, pad, chunk):
        tid = _u(cuda.threadIdx.x)
        tx, ty = tile_place(tid)   # (what multiply, row and col take)
        k0, c0 = cuda.blockIdx.x * BM, cuda.blockIdx.y * BN
        RS = R * S
        rs = cuda.blockIdx.z % RS
        split = cuda.blockIdx.z // RS
        r = rs // S
        s = rs - r * S
        HW, PQ = H * W, P * Q
        l_begin = split * chunk
        l_end = min(N * PQ, l_begin + chunk)
        sums_bias = has_bias != 0 and cuda.blockIdx.y == 0 and rs == 0

        # Where reduction index l = (n, p, q) sits in dy and (for this tap) in x; -1 = zero.
        # Double-buffered like the tiles: step i+1's entries are written during step i.
        l_dy = cuda.shared.array(L_SIZE, np.int32)
        l_x = cuda.shared.array(L_SIZE, np.int32)
        a_tile = cuda.shared.array(A_SIZE, np.float32, alignment=TILE_ALIGN)
        b_tile = cuda.shared.array(B_SIZE, np.float32, alignment=TILE_ALIGN)
        acc = cuda.local.array((TM, TN), np.float32)
        bias_acc = cuda.local.array(BIAS_ROWS, np.float32)
        a_reg = cuda.local.array(TM, np.float32)
        b_reg = cuda.local.array(TN, np.float32)
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        for i in range(BIAS_ROWS):
            bias_acc[i] = 0.0

        first_row, s_kk = place(tid)                   # this thread's staging place
        s_row = np.int64(first_row)   # signed: the simulator's NumPy wraps unsigned math
        a_at = s_kk * _u(BMP) + first_row              # where its elements go in the tiles
        b_at = s_kk * _u(BNP) + first_row
        a_next = cuda.local.array(A_PER, np.float32)   # the next step's tiles, in flight
        b_next = cuda.local.array(B_PER, np.float32)

        steps = (l_end - l_begin + BK - 1) // BK
        # Step 0's table and loads; then each step stores the loads made during the step
        # before, writes the table of the step after, and (past the barrier, which makes
        # that table visible) issues that step's loads before its own multiply-adds.
        # A table thread (tid < BK) follows its reduction index l = (n, p, q) by counting
        # forward BK a step instead of dividing it out.
        l = l_begin + np.int64(tid)
        n = l // PQ
        pq = l - n * PQ
        p = pq // Q
        q = pq - p * Q
        fill_table(l_dy, l_x, 0, l, l_end, n, p, q, K, C, H, W, P, Q, r, s, stride, pad)
        cuda.syncthreads()
        load_dy(a_next, dy, l_dy[s_kk], k0, K, s_row, PQ)
        load_x(b_next, x, l_x[s_kk], c0, C, s_row, HW)
        for step in range(steps):
            buf = _u(step) & _u(1)   # step >= 0: no signed-remainder fix-up
            for i in range(A_PER):
                if A_FULL or first_row + _u(i * NS) < _u(BM):
                    a_tile[buf * _u(BK * BMP) + a_at + _u(i * NS)] = a_next[i]
            for i in range(B_PER):
                if B_FULL or first_row + _u(i * NS) < _u(BN):
                    b_tile[buf * _u(BK * BNP) + b_at + _u(i * NS)] = b_next[i]
            if tid < _u(BK):
                l += BK
                q += BK
                while q >= Q:
                    q -= Q
                    p += 1
                    if p == P:
                        p = 0
                        n += 1
                fill_table(l_dy, l_x, step + 1, l, l_end, n, p, q, K, C, H, W, P, Q, r, s,
                           stride, pad)
            cuda.syncthreads()   # one barrier per step, as in the conv kernel
            if step + 1 < steps:
                nbuf = (_u(step + 1) & _u(1)) * _u(BK) + s_kk
                load_dy(a_next, dy, l_dy[nbuf], k0, K, s_row, PQ)
                load_x(b_next, x, l_x[nbuf], c0, C, s_row, HW)
            multiply(acc, a_reg, b_reg, a_tile, b_tile, buf * _u(BK * BMP), buf * _u(BK * BNP),
                     tx, ty)
            if sums_bias:
                for i in range(BIAS_ROWS):
                    mm = tid + _u(NT * i)
                    if mm < _u(BM):
                        for kk in range(BK):
                            bias_acc[i] += a_tile[buf * _u(BK * BMP) + _u(kk * BMP) + mm]

        w_base = split * K * C * RS
        for i in range(TM):
            k = k0 + row(tx, i)
            if k < K:
                for j in range(TN):
                    c = c0 + col(ty, j)
                    if c < C:
                        part_w[_u(w_base + (k * C + c) * RS + rs)] = acc[i, j]
        if sums_bias:
            for i in range(BIAS_ROWS):
                mm = tid + _u(NT * i)
                if mm < _u(BM) and k0 + mm < K:
                    part_b[_u(split * K + k0 + mm)] = bias_acc[i]

    return wgrad_kernel


def make_conv_taps_kernel(t: Tiles):
    """Forward for layers whose whole reduction C*R*S fits one step of bk (VGG's first conv:
    3 channels x 9 taps = 27 of 32), where the tap-major kernel above would take 9 steps each
    using 3 of its 8 channel rows. One step: the block decodes its output pixels (as the
    kernel above) and the reduction columns j = (c, r, s) into shared tables, stages the
    patch tile (bk x bm, pixels fastest so loads coalesce, zero off the image) and the
    weight tile (bk x bn: w is (K, C, R, S), so j is its fastest index), multiplies once with
    the register tile, and stores bias and ReLU as the kernel above does."""
    BM, BN, BK, TM, TN = t[:5]
    DX, DY = BM // TM, BN // TN
    NT = DX * DY
    BNP = BN + 4
    A_SIZE, B_SIZE = BK * BM, BK * BNP
    A_PER, B_PER = -(-BK * BM // NT), -(-BK * BN // NT)
    multiply, row, col = register_tile(t, BM, BNP, rows_per_pass=4 if BK % 4 == 0 else 1)
    store = _tile_store(TM, TN, row, col)

    @jit(_CONV_SIG, writes=("dst",))
    def conv_taps_kernel(src, w, bias, has_bias, relu, dst, N, CI, HI, WI, CO, HO, WO, R, S,
                         stride, pad):
        tid = _u(cuda.threadIdx.x)
        tx, ty = tid % _u(DX), tid // _u(DX)
        m0, n0 = cuda.blockIdx.x * BM, cuda.blockIdx.y * BN
        HWI, HWO, RS = HI * WI, HO * WO, R * S
        CRS = CI * RS
        M = N * HWO
        pix_src = cuda.shared.array(BM, np.int32)   # n * CI * HI * WI, or -1 past the end
        pix_h = cuda.shared.array(BM, np.int32)     # top-left input pixel of its patch
        pix_w = cuda.shared.array(BM, np.int32)
        pix_dst = cuda.shared.array(BM, np.int32)   # n * CO * HO * WO + pixel
        col_c = cuda.shared.array(BK, np.int32)     # c * HI * WI of column j, -1 past C*R*S
        col_r = cuda.shared.array(BK, np.int32)
        col_s = cuda.shared.array(BK, np.int32)
        a_tile = cuda.shared.array(A_SIZE, np.float32, alignment=TILE_ALIGN)   # [j][pixel]
        b_tile = cuda.shared.array(B_SIZE, np.float32, alignment=TILE_ALIGN)   # [j][channel]
        acc = cuda.local.array((TM, TN), np.float32)
        a_reg = cuda.local.array(TM, np.float32)
        b_reg = cuda.local.array(TN, np.float32)
        _decode_pixels(pix_src, pix_h, pix_w, pix_dst, m0, M, CI, HWI, CO, HWO, WO, stride, pad,
                       False, 0, 0, 1, WO, HWO)
        _decode_columns(col_c, col_r, col_s, CRS, RS, S, HWI)
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = 0.0
        cuda.syncthreads()
        for i in range(A_PER):
            e = tid + _u(NT * i)
            if BK * BM % NT == 0 or e < _u(BK * BM):
                mm, jj = e % _u(BM), e // _u(BM)
                a_tile[e] = _patch_value(src, pix_src[mm], col_c[jj], pix_h[mm] + col_r[jj],
                                         pix_w[mm] + col_s[jj], HI, WI)
        for i in range(B_PER):
            e = tid + _u(NT * i)
            if BK * BN % NT == 0 or e < _u(BK * BN):
                jj, nn = e % _u(BK), e // _u(BK)
                v = np.float32(0.0)
                if np.int32(jj) < CRS and n0 + np.int32(nn) < CO:
                    v = w[_u((n0 + np.int32(nn)) * CRS + np.int32(jj))]
                b_tile[jj * _u(BNP) + nn] = v
        cuda.syncthreads()
        multiply(acc, a_reg, b_reg, a_tile, b_tile, _u(0), _u(0), tx, ty)
        store(acc, dst, bias, has_bias, relu, pix_dst, m0, M, n0, CO, HWO, tx, ty)

    return conv_taps_kernel


def make_wgrad_taps_kernel(t: Tiles):
    """Backward-weight with every tap of a block's channels at once, for layers whose C*R*S
    fits one column tile (VGG's first conv: 3 channels x 9 taps = 27 columns). The per-tap
    kernel above would give each block 3 useful columns of 16 and do one tap per block.

    GEMM rows: k (bm a block); columns: j = (c, r, s), all C*R*S <= bn of them; the reduction
    over l = (n, p, q) steps bk rows at a time, cut into splits along grid z exactly as the
    per-tap kernel's (same partial layout, same second kernel). A step: threads tid < bk
    decode their row l into a shared table (dy offset, x offset, top-left input pixel) with
    the step's only divisions, then the block stages dy (bk x bm) and the patch columns
    (bk x bn, zero outside the image) and the register tile adds each thread's tm x tn outer
    products. For the bias, each thread also sums its tm rows of dy over every DY-th row of
    the step (the work spread evenly: a barrier waits for the slowest warp), and the block
    adds those DY partial sums in a fixed order at the end."""
    BM, BN, BK, TM, TN = t[:5]
    DX, DY = BM // TM, BN // TN
    NT = DX * DY
    A_PER, B_PER = -(-BK * BM // NT), -(-BK * BN // NT)
    if NT < BK or BK % DY:   # a thread decodes each step's row; bias rows split evenly
        raise ValueError(f"all-taps wgrad tiles {t}: need at least {BK} threads and {BK} "
                         f"a multiple of {DY}")
    BMP, BNP = BM + 4, BN + 4   # rows stay 16-byte aligned for the register tile's loads
    A_SIZE, B_SIZE = BK * BMP, BK * BNP   # (shared sizes must be constants, not expressions)
    RED_SIZE = DY * BM
    multiply, row, col = register_tile(t, BMP, BNP, rows_per_pass=4 if BK % 4 == 0 else 1)

    # 80 registers: three 256-thread blocks an SM, with no spills.
    @jit(_WGRAD_SIG, writes=("part_w", "part_b"), in_place=(("part_b", "part_w"),),
         max_registers=80)
    def wgrad_taps_kernel(x, dy, part_w, part_b, has_bias, N, C, H, W, K, P, Q, R, S, stride,
                          pad, chunk):
        tid = _u(cuda.threadIdx.x)
        tx, ty = tid % _u(DX), tid // _u(DX)
        k0 = cuda.blockIdx.x * BM
        split = cuda.blockIdx.z
        RS, PQ = R * S, P * Q
        CRS = C * RS
        l_begin = split * chunk
        l_end = min(N * PQ, l_begin + chunk)
        t_dy = cuda.shared.array(BK, np.int32)    # dy offset of row l (k = 0); -1: past the end
        t_x = cuda.shared.array(BK, np.int32)     # x offset of image n (c = 0); -1: past the end
        t_h = cuda.shared.array(BK, np.int32)     # top-left input pixel of row l's patch
        t_w = cuda.shared.array(BK, np.int32)
        a_tile = cuda.shared.array(A_SIZE, np.float32, alignment=TILE_ALIGN)   # [l][k]
        b_tile = cuda.shared.array(B_SIZE, np.float32, alignment=TILE_ALIGN)   # [l][j]
        acc = cuda.local.array((TM, TN), np.float32)
        bias_acc = cuda.local.array(TM, np.float32)
        a_reg = cuda.local.array(TM, np.float32)
        b_reg = cuda.local.array(TN, np.float32)
        # A patch column j = (c, r, s): x offset of channel c (-1: past C*R*S), tap r, s;
        # worked out once a block (the first barrier of the loop publishes it).
        col_c = cuda.shared.array(BN, np.int32)
        col_r = cuda.shared.array(BN, np.int32)
        col_s = cuda.shared.array(BN, np.int32)
        _decode_columns(col_c, col_r, col_s, CRS, RS, S, H * W)
        for i in range(TM):
            bias_acc[i] = 0.0
            for j in range(TN):
                acc[i, j] = 0.0
        HW = H * W
        for l0 in range(l_begin, l_end, BK):
            if tid < _u(BK):
                l = l0 + np.int32(tid)
                t_dy[tid] = -1
                t_x[tid] = -1
                if l < l_end:
                    n = l // PQ
                    pq = l - n * PQ
                    p = pq // Q
                    t_dy[tid] = n * K * PQ + pq
                    t_x[tid] = n * C * HW
                    t_h[tid] = p * stride - pad
                    t_w[tid] = (pq - p * Q) * stride - pad
            cuda.syncthreads()
            for i in range(A_PER):
                e = tid + _u(NT * i)
                if BK * BM % NT == 0 or e < _u(BK * BM):
                    ll, kk = e % _u(BK), e // _u(BK)
                    v = np.float32(0.0)
                    at = t_dy[ll]
                    if at >= 0 and k0 + np.int32(kk) < K:
                        v = dy[_u(at + (k0 + np.int32(kk)) * PQ)]
                    a_tile[ll * _u(BMP) + kk] = v
            for i in range(B_PER):
                e = tid + _u(NT * i)
                if BK * BN % NT == 0 or e < _u(BK * BN):
                    ll, jj = e % _u(BK), e // _u(BK)
                    b_tile[ll * _u(BNP) + jj] = _patch_value(x, t_x[ll], col_c[jj],
                                                             t_h[ll] + col_r[jj],
                                                             t_w[ll] + col_s[jj], H, W)
            cuda.syncthreads()
            multiply(acc, a_reg, b_reg, a_tile, b_tile, _u(0), _u(0), tx, ty)
            if has_bias != 0:
                for u in range(BK // DY):
                    for i in range(TM):
                        bias_acc[i] += a_tile[(ty + _u(DY * u)) * _u(BMP) + row(tx, i)]
            cuda.syncthreads()   # the next step's table and tiles overwrite these

        w_base = split * K * CRS
        for i in range(TM):
            k = k0 + np.int32(row(tx, i))
            if k < K:
                for j in range(TN):
                    jj = np.int32(col(ty, j))
                    if jj < CRS:
                        part_w[_u(w_base + k * CRS + jj)] = acc[i, j]
        if has_bias != 0:   # the DY partial sums of each row k, added in order
            red = cuda.shared.array(RED_SIZE, np.float32)   # [column group][k]
            for i in range(TM):
                red[ty * _u(BM) + row(tx, i)] = bias_acc[i]
            cuda.syncthreads()
            for kk in range(cuda.threadIdx.x, BM, NT):
                v = np.float32(0.0)
                for y in range(DY):
                    v += red[y * BM + kk]
                if k0 + kk < K:
                    part_b[_u(split * K + k0 + kk)] = v

    return wgrad_taps_kernel


@jit("void(float32[::1], float32[::1], int32)", writes=("out",))
def sum_splits_kernel(part, out, splits):
    """out[i] = part[0*n + i] + part[1*n + i] + ..., always in that order (n = out.size)."""
    start, stride = cuda.grid(1), cuda.gridsize(1)
    n = out.size
    for i in range(start, n, stride):
        acc = np.float32(0.0)
        for s in range(splits):
            acc += part[s * n + i]
        out[i] = acc
