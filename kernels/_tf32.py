"""Float32 products on tensor cores, three TF32 multiplies each (3xTF32): the warp tile that
the tiled GEMM multiplies with when its tile asks for tensor cores (`Tiles(..., mma=True)`).

Why: a float32 multiply-add runs at 128 a clock on an SM, a TF32 mma.sync m16n8k8 (1024 of
them) at about one. TF32 keeps 10 of float32's 23 fraction bits, too few for a float32
result, so each operand is split into two TF32 numbers, x = big + small + r with
big = tf32(x), small = tf32(x - big) and |r| <= 2**-22 |x|, and the product takes the three
terms that matter, small*big + big*small + big*big (the smallest first), dropping
small*small (<= 2**-22 |ab|). A product is then off by at most about 2**-20 |a||b| before
summation, against float32's 2**-24; over a reduction of K terms the sum's rounding
(K * 2**-24) dominates once K passes a few dozen (CUTLASS's "fast accurate" float32 GEMM,
OpMultiplyAddFastF32, does the same). The instruction's own sum rounds toward zero (Fasi et
al. 2021; MMA-Sim, Xie et al. 2025), so each k step's three products go to a fresh
accumulator that float32 adds to the running sum (_mma3): carried through the instruction,
the sum would drift toward zero, by up to about K/6 units of 2**-24 (terms of one sign).

    split(x)      (big, small) of float32 x as TF32 bit patterns (uint32), each rounded to
                  nearest, ties away from zero (as CUTLASS rounds): big by cvt.rna.tf32.f32,
                  which keeps infinities and NaN, small by adding 2**12 to the bits and
                  clearing the 13 low ones (the rest is finite wherever x is). A NaN operand
                  gives NaN; an infinite one gives NaN too where float32 would give an
                  infinity (inf times the other operand's small part, often 0): either way
                  the result is not finite;
    mma1688(a0..a3, b0, b1, c0..c3)
                  D = A B + C for one warp, mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32:
                  A 16 x 8 and B 8 x 8 in TF32, C and D 16 x 8 float32. Lane l holds, with
                  g = l // 4 and t = l % 4 (PTX ISA, "Matrix fragments for mma.m16n8k8"):
                  a0 A[g, t], a1 A[g+8, t], a2 A[g, t+4], a3 A[g+8, t+4];
                  b0 B[t, g], b1 B[t+4, g];
                  c0 C[g, 2t], c1 C[g, 2t+1], c2 C[g+8, 2t], c3 C[g+8, 2t+1];
    mma_tile(t, a_stride, b_stride)
                  (multiply, row, col, place) for a block tile: the interface of
                  kernels._tile.register_tile, with a warp's share of the tile in mma tiles,
                  over float32 staged tiles, each fragment split as it is read;
    fragment_tile(t, a_small, b_small)
                  the same over tiles staged already split and in fragment order
                  (a_fragment_place, b_fragment_place): a lane's fragments are 16-byte
                  loads, and nothing is split where it is read.

The simulator runs the same kernel: `split` rounds the bits as the GPU's does, and
`mma1688` gathers the warp's fragments through shared memory (a barrier: every thread of the
block must call it together, as every lane of a warp must call mma.sync) and sums each output
as the H100's instruction does (_fused_dot_add: exact products, truncated terms, a sum
rounded toward zero), so a test there checks every fragment's index and the rounding's
drift; the GPU's tests check the instruction.
"""
from __future__ import annotations

import math
import threading
from typing import NamedTuple

import numpy as np

from kernels._tile import Stage, Tiles
from proto.device.backend import SIMULATOR, cuda

_u = np.uint32
MAX_THREADS = 1024

if SIMULATOR:
    def converge():
        pass   # (the stand-in's barrier holds every thread of the block)

    def _tf32_bits(x) -> np.uint32:
        """The GPU's rounding of the rest, on the bits: 2**12 added (in 32 bits), the 13 low
        bits cleared."""
        bits = int(np.float32(x).view(np.uint32))
        return np.uint32((bits + 0x1000) & 0xFFFFE000)

    def split(x):
        x = np.float32(x)
        big = np.float32(x).view(np.uint32) if not np.isfinite(x) else _tf32_bits(x)
        rest = np.float32(x - big.view(np.float32)) if np.isfinite(x) else np.float32(0)
        return big, _tf32_bits(rest)

    def _value(bits) -> float:
        return float(np.uint32(bits).view(np.float32))

    @cuda.jit(device=True)
    def store4(tile, i, v0, v1, v2, v3):
        tile[i], tile[i + 1], tile[i + 2], tile[i + 3] = v0, v1, v2, v3

    @cuda.jit(device=True)
    def mma1688(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        buf = cuda.shared.array((2, MAX_THREADS, 6), np.float64)
        me = threading.current_thread()
        phase = getattr(me, "mma_phase", 0)   # (two buffers: one barrier a call)
        me.mma_phase = phase ^ 1
        tid = cuda.threadIdx.x
        for i, v in enumerate((a0, a1, a2, a3, b0, b1)):
            buf[phase, tid, i] = _value(v)
        cuda.syncthreads()   # (C's elements are this lane's own: c0 C[g, 2t] and so on)
        lanes = buf[phase, tid & ~31:(tid & ~31) + 32]
        g, t = (tid % 32) // 4, tid % 4
        # Row g of A is a0 (k 0..3) then a2 (k 4..7) of lanes 4g .. 4g+3, row g+8 a1 then
        # a3; column n of B is b0 (k 0..3) then b1 (k 4..7) of lanes 4n .. 4n+3.
        quad = lanes[4 * g:4 * g + 4]
        a_lo, a_hi = np.r_[quad[:, 0], quad[:, 2]], np.r_[quad[:, 1], quad[:, 3]]
        b_0 = np.r_[lanes[8 * t:8 * t + 4, 4], lanes[8 * t:8 * t + 4, 5]]        # column 2t
        b_1 = np.r_[lanes[8 * t + 4:8 * t + 8, 4], lanes[8 * t + 4:8 * t + 8, 5]]  # 2t + 1
        a_lo, a_hi, b_0, b_1 = a_lo.tolist(), a_hi.tolist(), b_0.tolist(), b_1.tolist()
        return (_fused_dot_add(a_lo, b_0, c0), _fused_dot_add(a_lo, b_1, c1),
                _fused_dot_add(a_hi, b_0, c2), _fused_dot_add(a_hi, b_1, c3))

    def _fused_dot_add(a: list, b: list, c) -> np.float32:
        """c + a . b as Hopper's mma.m16n8k8 (TF32 in, float32 out) forms it, by the model
        that MMA-Sim (Xie et al., 2025) matched bit for bit: every product exact, every term
        (c among them) truncated toward zero to 25 fraction bits below the largest term's
        exponent, the terms summed, the sum rounded toward zero to float32. (Python floats:
        a TF32 product is exact in them, and math on 9 numbers beats NumPy's calls.)"""
        terms = [x * y for x, y in zip(a, b)] + [float(c)]   # (inf * 0 is NaN, as on the GPU)
        if not all(map(math.isfinite, terms)):
            return np.float32(sum(terms))
        top = max((math.frexp(x)[1] for x in terms if x), default=None)
        if top is None:
            return np.float32(0)
        quantum = math.ldexp(1.0, top - 1 - 25)
        exact = sum(math.trunc(x / quantum) for x in terms) * quantum   # (< 2**30 quanta: exact)
        with np.errstate(over="ignore"):
            out = np.float32(exact)
        if np.isfinite(out) and abs(float(out)) > abs(exact):
            out = np.nextafter(out, np.float32(0))   # toward zero, not to nearest
        return out
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from kernels._ptx import tuple_asm, warp_mma

    @cuda.jit(device=True)
    def converge():
        """Reconverge the warp: the staging before a multiply branches per thread (a conv's
        gather loops a thread's own count), and mma.sync.aligned needs all 32 lanes."""
        cuda.syncwarp(0xFFFFFFFF)

    # big by cvt.rna.tf32.f32 (4 SASS instructions: it keeps NaN, which the integer add would
    # carry into the sign: 0x7FFFFFFF, the GPU's NaN, became -0.0); small by the integer add
    # on the bits (2): the rest is finite unless x is not, and then big carries the infinity
    # or NaN. x - big is exact (big is x rounded).
    split = tuple_asm(types.float32, types.uint32, 2,
                      "{ .reg .b32 t; .reg .f32 f; cvt.rna.tf32.f32 $0, $2; "
                      "mov.b32 f, $0; sub.f32 f, $2, f; mov.b32 t, f; "
                      "add.u32 t, t, 0x1000; and.b32 $1, t, 0xFFFFE000; }", "=r,=r,f")

    mma1688 = warp_mma("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32")

    @intrinsic
    def store4(typingctx, tile, i, v0, v1, v2, v3):
        """tile[i .. i + 3] = v0 .. v3 (uint32) as one 16-byte store (i a multiple of 4, the
        tile 16-byte aligned): a vector store in LLVM's IR, which NVVM emits as
        st.shared.v4.u32 on a shared tile, with no asm to fence the compiler's scheduling."""
        if not (isinstance(tile, types.Array) and tile.dtype == types.uint32
                and all(v == types.uint32 for v in (v0, v1, v2, v3))):
            return None
        sig = types.void(tile, i, v0, v1, v2, v3)

        def codegen(context, builder, sig, args):
            a = context.make_array(sig.args[0])(context, builder, args[0])
            at = context.cast(builder, args[1], sig.args[1], types.int64)
            ptr = builder.gep(a.data, [at])
            vector = ir.VectorType(ir.IntType(32), 4)
            value = ir.Constant(vector, ir.Undefined)
            for lane, v in enumerate(args[2:]):
                value = builder.insert_element(value, v, ir.Constant(ir.IntType(32), lane))
            builder.store(value, builder.bitcast(ptr, vector.as_pointer(ptr.type.addrspace)),
                          align=16)
            return context.get_dummy_value()
        return sig, codegen

def _warp_grid(t: Tiles):
    """(MI, NI, place, row, col) of block tile `t` (t.mma): see mma_tile."""
    BM, BN, BK, TM, TN = t[:5]
    if TM % 2 or TN % 2 or BK % 8:
        raise ValueError(f"{t}: a tensor-core tile needs even tm and tn and bk a multiple of 8")
    MI, NI = TM // 2, TN // 2
    ROWS, COLS = 16 * MI, 8 * NI   # a warp's share
    if BM % ROWS or BN % COLS:
        raise ValueError(f"{t}: warp tiles of {ROWS} x {COLS} must tile {BM} x {BN}")
    WARPS_M = BM // ROWS

    @cuda.jit(device=True)
    def place(tid):
        warp, lane = tid // _u(32), tid % _u(32)
        return ((warp % _u(WARPS_M)) * _u(ROWS) + lane // _u(4),
                (warp // _u(WARPS_M)) * _u(COLS) + _u(2) * (lane % _u(4)))

    @cuda.jit(device=True)
    def row(p, i):
        return p + _u(16 * (i // 2) + 8 * (i % 2))

    @cuda.jit(device=True)
    def col(q, j):
        return q + _u(8 * (j // 2) + j % 2)

    return MI, NI, place, row, col


_ZERO = np.float32(0)


@cuda.jit(device=True)
def _mma3(acc, i, j, a0, a1, a2, a3, s0, s1, s2, s3, b0, b1, t0, t1):
    """acc's mma tile (i, j) += A B in three TF32 products, the smallest first: A's small
    parts (s) by B's big, A's big (a) by B's small (t), big by big.

    The three sum into a fresh accumulator, which is then added to acc in float32: the
    instruction rounds its sum toward zero, so a running sum carried through it would
    shrink by about half a unit at every mma, 3 K / 8 times in all (K = 768: about 135
    units of 2**-24 below the exact sum of positive terms, where float32's own additions
    stay within one unit of it on average). Here each mma truncates only this step's few
    terms, and the running sum rounds to nearest. DeepSeek-V3 promotes its FP8 tensor-core
    sums to float32 registers at intervals for the same reason."""
    d0, d1, d2, d3 = mma1688(s0, s1, s2, s3, b0, b1, _ZERO, _ZERO, _ZERO, _ZERO)
    d0, d1, d2, d3 = mma1688(a0, a1, a2, a3, t0, t1, d0, d1, d2, d3)
    d0, d1, d2, d3 = mma1688(a0, a1, a2, a3, b0, b1, d0, d1, d2, d3)
    acc[i, j] += d0
    acc[i, j + 1] += d1
    acc[i + 1, j] += d2
    acc[i + 1, j + 1] += d3


def mma_tile(t: Tiles, a_stride: int, b_stride: int, *, a_step: int = 1, b_step: int = 1):
    """The warp tile of block tile `t` (t.mma): (multiply, row, col, place), as
    kernels._tile.register_tile's (multiply, row, col) with place(tid) -> (p, q), the
    arguments a thread passes to the other three.

    The block's t.bm x t.bn outputs are a grid of warp tiles of 16 MI x 8 NI (MI = t.tm / 2
    mma tiles down, NI = t.tn / 2 across), warps numbered down the rows first; a lane holds
    its 4 accumulators of each of its warp's MI x NI mma tiles, acc[2 mi + h, 2 ni + c] at
    row p + 16 mi + 8 h and column q + 8 ni + c, where p = (warp's first row) + g and q =
    (warp's first column) + 2 t. `multiply` adds one t.bk step of the staged tiles, A's
    element (m, k) at a_start + k * a_stride + m * a_step, B's (k, n) at b_start +
    k * b_stride + n * b_step (k-major tiles: steps 1; a Toeplitz window, A (m, k) =
    win[m + k]: a_stride = a_step = 1): per 8 rows of K it runs three mma per pair of mma
    tiles. It loads and splits all of the lane's fragments of one operand first, then
    those of the other a tile at a time: A's (8 a mma tile down) unless the warp has fewer
    tiles across than down. ptxas (sm_90) decides how many of the fresh accumulators of
    _mma3 it keeps in flight, so this is by what it did: holding B takes a 128 x 64 tile's
    spills to none (from 32 bytes; A's 32 words against B's 8), while a 128 x 128
    convolution tile spills 196 bytes holding B and 4 holding A. Fragment reads are free
    of bank conflicts when the lanes' addresses,
    t * stride + g * step apart, fall in distinct banks or coincide (k-major: strides 8 or
    24 modulo 32). Every warp that reads a fragment splits it (a 128 x 128 tile's A by its
    4 warps across, about 7 instructions a split): fragment_tile splits once instead."""
    BK = t.bk
    MI, NI, place, row, col = _warp_grid(t)
    frag = np.uint32

    @cuda.jit(device=True)
    def a_fragments(a_tile, a_base, k8, mi):
        """(big a0..a3, small a0..a3) of mma tile mi down at k step k8: a0..a3 are rows
        + 8 (a1, a3) and k + 4 (a2, a3)."""
        at = a_base + _u(8 * k8 * a_stride + 16 * mi * a_step)
        a0, s0 = split(a_tile[at])
        a1, s1 = split(a_tile[at + _u(8 * a_step)])
        a2, s2 = split(a_tile[at + _u(4 * a_stride)])
        a3, s3 = split(a_tile[at + _u(4 * a_stride + 8 * a_step)])
        return a0, a1, a2, a3, s0, s1, s2, s3

    @cuda.jit(device=True)
    def b_fragments(b_tile, b_base, k8, ni):
        """(big b0, b1, small b0, b1) of mma tile ni across at k step k8 (b1: k + 4)."""
        bt = b_base + _u(8 * k8 * b_stride + 8 * ni * b_step)
        b0, t0 = split(b_tile[bt])
        b1, t1 = split(b_tile[bt + _u(4 * b_stride)])
        return b0, b1, t0, t1

    @cuda.jit(device=True)
    def bases(a_start, b_start, p, q):
        g, t = p % _u(8), (q // _u(2)) % _u(4)
        return (a_start + t * _u(a_stride) + p * _u(a_step),                  # A[p, t] of tile 0
                b_start + t * _u(b_stride) + (q - _u(2) * t + g) * _u(b_step))  # B[t, g]

    if NI < MI:   # hold B's fragments
        @cuda.jit(device=True)
        def multiply(acc, a_reg, b_reg, a_tile, b_tile, a_start, b_start, p, q):
            converge()   # (mma.sync.aligned: every lane of the warp at the same instruction)
            a_base, b_base = bases(a_start, b_start, p, q)
            b = cuda.local.array((NI, 4), frag)
            for k8 in range(BK // 8):
                for ni in range(NI):
                    b[ni, 0], b[ni, 1], b[ni, 2], b[ni, 3] = b_fragments(b_tile, b_base, k8, ni)
                for mi in range(MI):
                    a0, a1, a2, a3, s0, s1, s2, s3 = a_fragments(a_tile, a_base, k8, mi)
                    for ni in range(NI):
                        _mma3(acc, 2 * mi, 2 * ni, a0, a1, a2, a3, s0, s1, s2, s3,
                              b[ni, 0], b[ni, 1], b[ni, 2], b[ni, 3])
    else:                 # hold A's
        @cuda.jit(device=True)
        def multiply(acc, a_reg, b_reg, a_tile, b_tile, a_start, b_start, p, q):
            converge()
            a_base, b_base = bases(a_start, b_start, p, q)
            a = cuda.local.array((MI, 8), frag)
            for k8 in range(BK // 8):
                for mi in range(MI):
                    (a[mi, 0], a[mi, 1], a[mi, 2], a[mi, 3],
                     a[mi, 4], a[mi, 5], a[mi, 6], a[mi, 7]) = a_fragments(a_tile, a_base, k8, mi)
                for ni in range(NI):
                    b0, b1, t0, t1 = b_fragments(b_tile, b_base, k8, ni)
                    for mi in range(MI):
                        _mma3(acc, 2 * mi, 2 * ni, a[mi, 0], a[mi, 1], a[mi, 2], a[mi, 3],
                              a[mi, 4], a[mi, 5], a[mi, 6], a[mi, 7], b0, b1, t0, t1)

    return multiply, row, col, place


# Fragment order: where operand element (m, k) of A, (k, n) of B (by its row n and k, as
# the staging numbers it) lies in a staged tile whose
# lanes read their fragments as 16 contiguous bytes. A: per 8 rows of K (kc) and 16 rows of
# M (mt), 32 lanes x (a0, a1, a2, a3); B: per kc and pair of 8-column groups, 32 lanes x (b0,
# b1 of the even group, b0, b1 of the odd one). Lane 4g + t holds a0 = A[g, t], a1 =
# A[g+8, t], a2 = A[g, t+4], a3 = A[g+8, t+4], b0 = B[t, g], b1 = B[t+4, g] (mma1688). Each
# place is a sum of terms of disjoint bits of m (n) and k, so the place of (m0 + dm, k0 + dk)
# is place(m0, k0) + place(dm, dk) whenever m0, dm (and k0, dk) share no bit.
def a_fragment_place(m, k, bm):
    return (128 * (m >> 4) + 16 * (m & 7) + ((m >> 3) & 1)
            + 4 * (k & 3) + 2 * ((k >> 2) & 1) + 8 * bm * (k >> 3))


def b_fragment_place(n, k, bn):
    return (128 * (n >> 4) + 16 * (n & 7) + 2 * ((n >> 3) & 1)
            + 4 * (k & 3) + ((k >> 2) & 1) + 8 * bn * (k >> 3))


def fragment_tile(t: Tiles, a_small: int, b_small: int):
    """mma_tile's warp tile (multiply, row, col, place) over tiles staged already split and
    in fragment order: A's element (m, k) at a_start + a_fragment_place(m, k, t.bm) (big,
    a uint32 TF32 pattern) and a_small words on (small), B's (k, n) at b_start +
    b_fragment_place(n, k, t.bn) likewise. A lane reads each
    mma tile's four A words and two mma tiles' B words as one 16-byte load, each part, and
    splits nothing: per 8 rows of K, a 128 x 128 tile's lane does 12 shared loads and 48 mma
    where mma_tile's does 24 loads and 24 splits. The reads are conflict-free (a warp's 512
    contiguous bytes). t.tn / 2 (mma tiles across) must be even. It holds one operand's
    fragments and reads the other's a tile at a time, by mma_tile's rule."""
    BM, BN, BK = t[:3]
    MI, NI, place, row, col = _warp_grid(t)
    if NI % 2:
        raise ValueError(f"{t}: fragment order pairs the B fragments: tn a multiple of 4")
    NJ = NI // 2   # pairs of mma tiles across
    frag = np.uint32

    @cuda.jit(device=True)
    def bases(a_start, b_start, p, q):
        lane = _u(4) * (p % _u(8)) + (q // _u(2)) % _u(4)
        return (a_start + _u(128) * (p // _u(16)) + _u(4) * lane,   # mma tile (p, 0) of kc 0
                b_start + _u(128) * (q // _u(16)) + _u(4) * lane)   # its columns' pair

    if NI < MI:   # hold B's fragments (as mma_tile)
        @cuda.jit(device=True)
        def multiply(acc, a_reg, b_reg, a_tile, b_tile, a_start, b_start, p, q):
            converge()   # (mma.sync.aligned: every lane of the warp at the same instruction)
            a_base, b_base = bases(a_start, b_start, p, q)
            a = cuda.local.array(8, frag)             # a0..a3, then their small parts
            b = cuda.local.array((NJ, 8), frag)  # a pair's b0, b1, b0, b1, then small
            for kc in range(BK // 8):
                for nj in range(NI // 2):
                    bt = b_base + _u(8 * BN * kc + 128 * nj)
                    for v in range(4):
                        b[nj, v] = b_tile[bt + _u(v)]
                        b[nj, 4 + v] = b_tile[bt + _u(b_small + v)]
                for mi in range(MI):
                    at = a_base + _u(8 * BM * kc + 128 * mi)
                    for v in range(4):
                        a[v] = a_tile[at + _u(v)]
                        a[4 + v] = a_tile[at + _u(a_small + v)]
                    for nj in range(NI // 2):
                        for h in range(2):
                            _mma3(acc, 2 * mi, 2 * (2 * nj + h), a[0], a[1], a[2], a[3],
                                  a[4], a[5], a[6], a[7], b[nj, 2 * h], b[nj, 2 * h + 1],
                                  b[nj, 4 + 2 * h], b[nj, 5 + 2 * h])
    else:                 # hold A's
        @cuda.jit(device=True)
        def multiply(acc, a_reg, b_reg, a_tile, b_tile, a_start, b_start, p, q):
            converge()
            a_base, b_base = bases(a_start, b_start, p, q)
            a = cuda.local.array((MI, 4), frag)
            s = cuda.local.array((MI, 4), frag)
            b = cuda.local.array(4, frag)
            bs = cuda.local.array(4, frag)
            for kc in range(BK // 8):
                for mi in range(MI):
                    at = a_base + _u(8 * BM * kc + 128 * mi)
                    for v in range(4):
                        a[mi, v] = a_tile[at + _u(v)]
                        s[mi, v] = a_tile[at + _u(a_small + v)]
                for nj in range(NI // 2):
                    bt = b_base + _u(8 * BN * kc + 128 * nj)
                    for v in range(4):
                        b[v] = b_tile[bt + _u(v)]
                        bs[v] = b_tile[bt + _u(b_small + v)]
                    for h in range(2):
                        for mi in range(MI):
                            _mma3(acc, 2 * mi, 2 * (2 * nj + h), a[mi, 0], a[mi, 1], a[mi, 2],
                                  a[mi, 3], s[mi, 0], s[mi, 1], s[mi, 2], s[mi, 3],
                                  b[2 * h], b[2 * h + 1], bs[2 * h], bs[2 * h + 1])

    return multiply, row, col, place


# ------------------------------------------------------------------ staging, split once
STATIC_SHARED = 48 * 1024   # static shared memory a block (more needs dynamic)


def staged_store(small_at: int | None):
    """A device function (tile, i, v) storing float32 v at tile[i]: as it is (`small_at`
    None), or split into its TF32 parts, big at i and small `small_at` words on (the tile
    then uint32)."""
    if small_at is None:
        @cuda.jit(device=True)
        def store(tile, i, v):
            tile[i] = v
    else:
        @cuda.jit(device=True)
        def store(tile, i, v):
            big, small = split(v)
            tile[i] = big
            tile[i + _u(small_at)] = small
    return store


def k_major_place(row, k, width):
    """A k-major staged tile's place: a row of K every `width` words."""
    return k * width + row


def first_place(place, width: int):
    """A device function (row, k) -> place(row, k, width) as uint32: where a thread's first
    staged element of an operand goes (place: k_major_place or a fragment place)."""
    on_device = cuda.jit(device=True)(place)

    @cuda.jit(device=True)
    def first(row, k):
        return _u(on_device(row, k, _u(width)))
    return first


# A lane's four words in fragment order, as (row, k) offsets from its first: mma1688's a0..a3
# (A: rows g, g + 8 at k t, then at t + 4), and b0, b1 of the even and then of the odd column
# group (B: k t, t + 4 at column g, then at g + 8)
LANE_WORDS = {"a": ((0, 0), (8, 0), (0, 4), (8, 4)), "b": ((0, 0), (0, 4), (8, 0), (8, 4))}


def _later_steps(first_at, count: int, warps: int) -> list | None:
    """(dr, dk) of each of a thread's `count` shares from its first (share 0: (0, 0)), where
    warp w's share j is the one first_at(w + j * warps) places (its lane 0's row and k);
    None unless each is the same step for every warp (the kernel adds one constant offset a
    share)."""
    steps = []
    for j in range(count):
        step = {tuple(np.subtract(first_at(w + j * warps), first_at(w))) for w in range(warps)}
        if len(step) != 1:
            return None
        steps.append(step.pop())
    return steps


def lane_stage(operand: str, rows: int, bk: int, nt: int) -> Stage | None:
    """How `nt` threads stage a rows x bk tile of `operand` ("a" or "b") that is contiguous
    along its rows in global memory (a transposed, K x M; b not, K x N): each thread takes
    whole lanes' fragments, four elements that fragment order puts in 16 contiguous bytes,
    so that it stores each part of them with one 16-byte store. kernels._tile.stager gives
    a warp 32 consecutive rows of one k instead, which fragment order puts 16 words apart:
    every store 8-way bank conflicted, twice (both parts).

    Warp w's lanes take the 32 lanes' words of 16 x 8 block w (rows 16 (w % B), k
    8 (w // B), B = rows / 16), then those of block w + warps, and so on; one load of a
    warp reads 4 rows of k of 8 contiguous elements, whole 32-byte sectors. None where a
    thread's share is not whole fours, or its later blocks do not lie at the same offsets
    from its first for every warp."""
    if rows % 16 or bk % 8 or nt % 32 or (rows * bk) % (4 * nt):
        return None
    quads, warps, blocks = rows * bk // (4 * nt), nt // 32, rows // 16

    def block_at(b):
        return 16 * (b % blocks), 8 * (b // blocks)
    steps = _later_steps(block_at, quads, warps)
    if steps is None:
        return None
    words = [(dr + wr, dk + wk) for dr, dk in steps for wr, wk in LANE_WORDS[operand]]
    drs, dks = (tuple(x) for x in zip(*words))

    @cuda.jit(device=True)
    def place(tid):
        warp, lane = tid // _u(32), tid % _u(32)
        return (_u(16) * (warp % _u(blocks)) + lane // _u(4),
                _u(8) * (warp // _u(blocks)) + lane % _u(4))
    return Stage(place, drs, dks, quads=True)


def k_run_stage(rows: int, bk: int, nt: int) -> Stage | None:
    """How `nt` threads stage a rows x bk tile of an operand contiguous along k (a not
    transposed, b transposed) so that a warp's store of one element hits 32 distinct banks.
    kernels._tile.stager gives a warp 4 consecutive rows (or 2 rows of 16 k), which fragment
    order puts 16 words apart: 2-way conflicts. Here a warp reads runs of 8 k (whole 32-byte
    sectors, as before) from rows 2q, 2q + 1, 2q + 8 and 2q + 9 of a 16 x 8 block, whose
    words fragment order spreads over 0, 16, 1, 17 (A) or 0, 16, 2, 18 (B) modulo 32, beside
    the k's 8 distinct even (A) or 0, 1, 4, 5, .. (B) offsets: all 32 banks.

    Warp w takes quarter w % 4 of 16 x 8 block w // 4 (blocks down the rows, then along k),
    then quarter (w + warps) % 4 of block (w + warps) // 4, and so on. None where the tile is
    not whole blocks or a thread's later elements do not lie at the same offsets from its
    first for every warp."""
    if rows % 16 or bk % 8 or nt % 32 or (rows * bk) % nt:
        return None
    per, warps, blocks = rows * bk // nt, nt // 32, rows // 16

    def slot_at(s):   # the (row, k) of lane 0's element in slot s (a quarter of a block)
        b, q = divmod(s, 4)
        return 16 * (b % blocks) + 2 * q, 8 * (b // blocks)
    steps = _later_steps(slot_at, per, warps)
    if steps is None:
        return None
    drs, dks = (tuple(x) for x in zip(*steps))

    @cuda.jit(device=True)
    def place(tid):
        warp, lane = tid // _u(32), tid % _u(32)
        b = warp // _u(4)
        return (_u(16) * (b % _u(blocks)) + _u(2) * (warp % _u(4)) + (lane // _u(8)) % _u(2)
                + _u(8) * (lane // _u(16)), _u(8) * (b // _u(blocks)) + lane % _u(8))
    return Stage(place, drs, dks)


def staged_stores(deltas: tuple, small_at: int | None, quads: bool = False):
    """A device function (tile, at, regs) storing a thread's staged elements, regs[i] at
    tile[at + deltas[i]] as staged_store(small_at) stores one; `quads` (split tiles only):
    each four, deltas[4 j] + 0..3 with `at` a multiple of 4, as one 16-byte store a part."""
    n = len(deltas)
    if not quads:
        store = staged_store(small_at)

        @cuda.jit(device=True)
        def stores(tile, at, regs):
            for i in range(n):
                store(tile, at + _u(deltas[i]), regs[i])
        return stores
    if small_at is None or small_at % 4 or n % 4 or any(
            deltas[i] != deltas[i - i % 4] + i % 4 or deltas[i - i % 4] % 4 for i in range(n)):
        raise ValueError(f"quads: deltas {deltas} (small part at {small_at}) are not 16-byte "
                         "groups of a split tile")
    firsts = deltas[::4]

    @cuda.jit(device=True)
    def stores(tile, at, regs):
        for j in range(n // 4):
            i = at + _u(firsts[j])
            b0, s0 = split(regs[4 * j])
            b1, s1 = split(regs[4 * j + 1])
            b2, s2 = split(regs[4 * j + 2])
            b3, s3 = split(regs[4 * j + 3])
            store4(tile, i, b0, b1, b2, b3)
            store4(tile, i + _u(small_at), s0, s1, s2, s3)
    return stores


def fragment_deltas(place, width: int, bk: int, stage: Stage, nt: int, t: Tiles) -> tuple:
    """place(drs[i], dks[i], width) for a thread's i-th staged element of `stage`, having
    checked for every thread and every element inside the width x bk tile that it lies that
    many words after the thread's first (fragment order's places add where rows and ks
    share no bit), and for a stage in quads that every thread's first lies on a 16-byte
    boundary."""
    deltas = tuple(place(dr, dk, width) for dr, dk in zip(stage.drs, stage.dks))
    for tid in range(nt):
        row, k = (int(v) for v in stage.place.py_func(np.uint32(tid)))
        first = place(row, k, width)
        if stage.quads and first % 4:
            raise ValueError(f"{t}: thread {tid}'s fragment words do not start a 16-byte group")
        for i, (dr, dk) in enumerate(zip(stage.drs, stage.dks)):
            r, kk = row + dr, k + dk
            if r < width and kk < bk and place(r, kk, width) != first + deltas[i]:
                raise ValueError(f"{t}: in fragment order thread {tid}'s staged elements do "
                                 f"not lie at constant steps from its first")
    return deltas


class Staging(NamedTuple):
    """How a tile's operands reach shared memory and are multiplied there (split_staging)."""
    multiply: object   # kernels._tile.register_tile's interface, with place:
    row: object
    col: object
    place: object
    a_buf: int         # words of one buffer of one part, A's and B's
    b_buf: int
    store_a: object    # device functions (tile, i, v): store float32 v as staged
    store_b: object
    stores_a: object   # device functions (tile, at, regs): a thread's staged elements
    stores_b: object   # (staged_stores: 16 bytes a store where its stage is in quads)
    a_delta: tuple     # a thread's i-th staged element lies a_delta[i] words after its first
    b_delta: tuple
    a_first: object    # device functions (row, k) -> the place of a thread's first element
    b_first: object
    dtype: type        # of the shared tiles, each 2 * buffers * a_buf (b_buf) words


def split_staging(t: Tiles, buffers: int, a_stage: Stage, b_stage: Stage) -> Staging:
    """For a tensor-core tile staged through registers, split once and in fragment order;
    a_stage and b_stage say where each thread's elements of each operand lie (A's rows are
    M, B's N): kernels._tile.stager's (Stage.of) or lane_stage's. Refuses by name a tile
    whose two parts pass a block's static shared memory."""
    A_BUF, B_BUF = t.bk * t.bm, t.bk * t.bn
    words = 2 * buffers * (A_BUF + B_BUF)
    if 4 * words > STATIC_SHARED:
        raise ValueError(f"{t}: its operands split into two parts take {4 * words} bytes "
                         f"of shared memory, more than a block's static {STATIC_SHARED}: "
                         f"a smaller bk or tile")
    multiply, row, col, place = fragment_tile(t, buffers * A_BUF, buffers * B_BUF)
    a_delta = fragment_deltas(a_fragment_place, t.bm, t.bk, a_stage, t.threads, t)
    b_delta = fragment_deltas(b_fragment_place, t.bn, t.bk, b_stage, t.threads, t)
    return Staging(multiply, row, col, place, A_BUF, B_BUF, staged_store(buffers * A_BUF),
                   staged_store(buffers * B_BUF),
                   staged_stores(a_delta, buffers * A_BUF, a_stage.quads),
                   staged_stores(b_delta, buffers * B_BUF, b_stage.quads), a_delta, b_delta,
                   first_place(a_fragment_place, t.bm), first_place(b_fragment_place, t.bn),
                   np.uint32)
