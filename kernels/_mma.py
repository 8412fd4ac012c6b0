"""Tensor-core instructions Numba does not expose, as device functions of inline PTX: the
float16 operand loads and the warp-wide multiply of `kernels.gemm.make_decode_mma`.

    ldg16(src, j)  the 16 bytes of float16 elements j .. j+7 of C-contiguous `src` (j a
                   multiple of 8, the address 16-byte aligned) as four uint32, two halves
                   each with the lower element in the low bits, through the read-only
                   cache (ld.global.nc): for data no kernel writes while this one runs;
    ld16(src, j)   the same by a coherent load (ld.global): for an earlier kernel's output
                   read after the early-launch wait;
    mma16816(a0..a3, b0, b1, c0..c3)
                   D = A B + C for one warp, mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32:
                   A 16 x 16 and B 16 x 8 float16 in fragments of uint32 words, C and D
                   16 x 8 float32, four values a lane (PTX ISA, "Matrix fragments for
                   mma.m16n8k16 with floating point type").

    halves(w)      the two float16 of uint32 word w (as ld16 packs them) as float32, low
                   element first (two cvt.f32.f16).

On the simulator (no PTX there) each has a Python stand-in: the loads and halves pack and
unpack the same words by NumPy; mma16816 gathers its warp's fragments through shared memory
behind a barrier and multiplies them in float32 by the PTX ISA's fragment layout (rounding
each sum to nearest, where the tensor core truncates: within the tests' bound). The barrier
is the block's: on the simulator every thread of the block calls it together, so a kernel
that multiplies takes one warp a block there.
"""
from __future__ import annotations

from proto.device.backend import SIMULATOR

if SIMULATOR:
    import numpy as np

    from proto.device.backend import cuda

    def ld16(src, j):
        flat = [src[np.unravel_index(int(j) + e, src.shape)] for e in range(8)]
        return tuple(np.array(flat, np.float16).view(np.uint32))

    ldg16 = ld16   # (no caches to bypass on the simulator)

    def halves(w):
        lo, hi = np.array([w], np.uint32).view(np.float16).astype(np.float32)
        return lo, hi

    def _pair(word):
        """A fragment word's two float16 (low element first) as float32."""
        return np.array([word], np.uint32).view(np.float16).astype(np.float32)

    @cuda.jit(device=True)   # (so that the simulator gives it the kernel's cuda: shared, ...)
    def mma16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A B + C of the warp (m16n8k16, float16 in, float32 sums). Lane (g, t) = (lane
        / 4, lane % 4) holds A[g][2t, 2t+1] (a0), A[g+8][2t, 2t+1] (a1), A[g][2t+8, 2t+9]
        (a2), A[g+8][2t+8, 2t+9] (a3), B[2t, 2t+1][g] (b0), B[2t+8, 2t+9][g] (b1), and
        C and D at [g][2t], [g][2t+1], [g+8][2t], [g+8][2t+1]."""
        words = cuda.shared.array((32, 6), np.uint32)
        lane = cuda.threadIdx.x % 32
        for i, w in enumerate((a0, a1, a2, a3, b0, b1)):
            words[lane, i] = w
        cuda.syncthreads()
        A, B = np.zeros((16, 16), np.float32), np.zeros((16, 8), np.float32)
        for q in range(32):
            g, t = q >> 2, q & 3
            lo, hi = slice(2 * t, 2 * t + 2), slice(2 * t + 8, 2 * t + 10)
            A[g, lo], A[g + 8, lo] = _pair(words[q, 0]), _pair(words[q, 1])
            A[g, hi], A[g + 8, hi] = _pair(words[q, 2]), _pair(words[q, 3])
            B[lo, g], B[hi, g] = _pair(words[q, 4]), _pair(words[q, 5])
        cuda.syncthreads()   # (every lane has read the words before any writes the next)
        g, t = lane >> 2, lane & 3
        d = [np.float32(np.dot(A[r], B[:, c]) + c_in) for (r, c), c_in in zip(
            ((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1)), (c0, c1, c2, c3))]
        return d[0], d[1], d[2], d[3]

else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from kernels._ptx import asm_tuple, element_address, tuple_asm, warp_mma

    def _load16(instruction: str):
        """An intrinsic (src, j) -> four uint32 loading `src`'s float16 elements j .. j+7
        with `instruction` (ld.global.nc or ld.global: read-only or coherent)."""
        @intrinsic
        def load(typingctx, src, j):
            if not (isinstance(src, types.Array) and src.dtype == types.float16
                    and src.layout == "C" and isinstance(j, types.Integer)):
                return None
            sig = types.UniTuple(types.uint32, 4)(src, j)

            def codegen(context, builder, sig, args):
                addr = element_address(context, builder, sig.args[0], args[0], sig.args[1],
                                       args[1])
                # (a generic pointer: cvta.to.global makes it a global-window address)
                return asm_tuple(context, builder, sig,
                                 "{ .reg .u64 g; cvta.to.global.u64 g, $4; "
                                 f"{instruction}.v4.b32 {{$0, $1, $2, $3}}, [g]; }}",
                                 "=r,=r,=r,=r,l", [ir.IntType(32)] * 4, [addr])
            return sig, codegen
        return load

    ldg16 = _load16("ld.global.nc")
    ld16 = _load16("ld.global")

    mma16816 = warp_mma("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32")

    halves = tuple_asm(types.uint32, types.float32, 2,
                       "{ .reg .f16 lo, hi; mov.b32 {lo, hi}, $2; "
                       "cvt.f32.f16 $0, lo; cvt.f32.f16 $1, hi; }", "=f,=f,r")
