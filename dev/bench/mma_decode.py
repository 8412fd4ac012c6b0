"""A tensor-core float16 decode GEMM, for the bench only: can a Numba kernel reach the copy
rate on GPT-J's decode shapes where the SIMT kernels stop at about half of it?

    out[m, n] = sum over k of x[m, k] * w[n, k]     x (8, K), w (N, K) float16, out (8, N) float32

The SIMT trans_b kernel (kernels.gemm.make_decode_nt) spends about 400 warp instructions on
3 KB of float16 weight (loads, conversions, 5 FMAs an element), too many to keep pace with
HBM. Here one warp instruction, mma.sync.m16n8k16 (float16 in, float32 accumulate),
multiplies a 16 x 16 tile of w by a 16 x 8 tile of x^T: 16 weight rows (output columns) by
x's 8 rows (5 beams and 3 zero rows). K is permuted inside each chunk of 32 so that every
operand comes from one 16-byte load a lane (a dot product does not care about K's order, as
long as x is read in the same order): lane (g, t) = (lane / 4, lane % 4) loads w's rows
n0 + g and n0 + g + 8 and x's row g at elements kc + 8t .. kc + 8t + 7, and its four 32-bit
words feed the A and B fragments of two k-steps (PTX ISA, "Matrix fragments for
mma.m16n8k16"). A block is `warps_k` warps over one 16-column tile, each warp a share of
K's chunks, `unroll` chunks' loads in flight before their multiplies; the warps' sums meet
in shared memory, in warp order.

No bias, activation, residual or row count (x has exactly 8 rows, zero-padded): what it
measures is the ceiling. `dev/bench/bench_half_decode.py` times it beside cuBLAS; if it
reaches the copy rate, the library's trans_b kernel takes this inner loop. GPU only (inline
PTX; the simulator has no tensor cores).
"""
from __future__ import annotations

import functools

import numpy as np

from proto.device.backend import SIMULATOR, cuda, jit, launch

CHUNK = 32   # K elements a lane's 16-byte loads cover across the warp's two k-steps

if not SIMULATOR:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _I32, _I64 = ir.IntType(32), ir.IntType(64)

    @intrinsic
    def ldg16(typingctx, src, j):
        """The 16 bytes of float16 array `src`'s flat elements j .. j+7 (j a multiple of 8)
        as four uint32, two halves each with the lower element in the low bits
        (ld.global.nc.v4.b32: read-only while the kernel runs)."""
        if not (isinstance(src, types.Array) and src.dtype == types.float16
                and isinstance(j, types.Integer)):
            return None
        sig = types.UniTuple(types.uint32, 4)(src, j)

        def codegen(context, builder, sig, args):
            s = context.make_array(sig.args[0])(context, builder, args[0])
            jj = context.cast(builder, args[1], sig.args[1], types.int64)
            addr = builder.ptrtoint(builder.gep(s.data, [jj]), _I64)
            fn = ir.FunctionType(ir.LiteralStructType([_I32] * 4), [_I64])
            asm = ir.InlineAsm(fn, "{ .reg .u64 g; cvta.to.global.u64 g, $4; "
                                   "ld.global.nc.v4.b32 {$0, $1, $2, $3}, [g]; }",
                               "=r,=r,=r,=r,l", side_effect=False)
            out = builder.call(asm, [addr])
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(out, i) for i in range(4)])
        return sig, codegen

    @intrinsic
    def mma16816(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """D = A B + C on a warp's fragments: mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32
        (a0..a3, b0, b1 uint32 words of two halves; c and the result four float32)."""
        if not all(a == types.uint32 for a in (a0, a1, a2, a3, b0, b1)) or \
                not all(c == types.float32 for c in (c0, c1, c2, c3)):
            return None
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            fn = ir.FunctionType(ir.LiteralStructType([f32] * 4), [_I32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(fn, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                                   "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
                                   "{$10, $11, $12, $13};",
                               "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", side_effect=False)
            out = builder.call(asm, list(args))
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(out, i) for i in range(4)])
        return sig, codegen


@functools.cache
def make_mma_decode(warps_k: int, unroll: int):
    """The kernel for (warps_k, unroll): grid N / 16 blocks of 32 * warps_k threads, K a
    multiple of CHUNK * unroll."""
    if SIMULATOR:
        raise RuntimeError("mma_decode: inline PTX, GPU only")
    step, words = CHUNK * unroll * warps_k, 4 * unroll

    @jit("void(float16[:,::1], float16[:,::1], float32[:,::1])", writes=("out",))
    def mma_decode_kernel(x, w, out):
        red = cuda.shared.array((warps_k, 32, 4), np.float32)
        pa = cuda.local.array(words, np.uint32)   # row g's words, chunk by chunk
        qa = cuda.local.array(words, np.uint32)   # row g + 8's
        xa = cuda.local.array(words, np.uint32)   # x's row g
        lane = cuda.threadIdx.x % 32
        wk = cuda.threadIdx.x // 32
        g, t = lane >> 2, lane & 3
        n0 = cuda.blockIdx.x * 16
        K = w.shape[1]
        row0 = (n0 + g) * K + 8 * t
        row1 = row0 + 8 * K
        xrow = g * K + 8 * t
        c0 = c1 = c2 = c3 = np.float32(0)
        kc = wk * CHUNK * unroll
        while kc < K:
            for u in range(unroll):   # every chunk's loads in flight first
                k = kc + CHUNK * u
                p, q, v = ldg16(w, row0 + k), ldg16(w, row1 + k), ldg16(x, xrow + k)
                for e in range(4):
                    pa[4 * u + e], qa[4 * u + e], xa[4 * u + e] = p[e], q[e], v[e]
            for u in range(unroll):
                for s in range(2):   # k-step s: this lane's elements 4s .. 4s+3
                    i = 4 * u + 2 * s
                    c0, c1, c2, c3 = mma16816(pa[i], qa[i], pa[i + 1], qa[i + 1],
                                              xa[i], xa[i + 1], c0, c1, c2, c3)
            kc += step
        red[wk, lane, 0], red[wk, lane, 1], red[wk, lane, 2], red[wk, lane, 3] = c0, c1, c2, c3
        cuda.syncthreads()
        if wk == 0:
            for j in range(1, warps_k):
                c0 += red[j, lane, 0]
                c1 += red[j, lane, 1]
                c2 += red[j, lane, 2]
                c3 += red[j, lane, 3]
            # D[r][c]: r the tile's column of out (n0 + g, n0 + g + 8), c x's row (2t, 2t+1)
            out[2 * t, n0 + g] = c0
            out[2 * t + 1, n0 + g] = c1
            out[2 * t, n0 + g + 8] = c2
            out[2 * t + 1, n0 + g + 8] = c3

    return mma_decode_kernel


def mma_decode(x, w, out, warps_k: int = 4, unroll: int = 2, stream=0) -> None:
    """out (8, N) float32 = x (8, K) @ w (N, K)^T, float16 in, on tensor cores."""
    for name, a, dtype in (("x", x, np.float16), ("w", w, np.float16), ("out", out, np.float32)):
        if a.dtype != dtype or a.ndim != 2:
            raise ValueError(f"{name}: expected a 2-D {np.dtype(dtype)} array, got {a.dtype} "
                             f"{a.shape}")
    N, K = w.shape
    if x.shape != (8, K) or out.shape != (8, N):
        raise ValueError(f"x {x.shape}, out {out.shape}: expected (8, {K}) and (8, {N})")
    if N % 16 or K % (CHUNK * unroll):
        raise ValueError(f"w {w.shape}: N a multiple of 16 and K of {CHUNK * unroll}")
    launch(make_mma_decode(warps_k, unroll), N // 16, 32 * warps_k, (x, w, out), stream)


if not SIMULATOR:   # compiled at import under PROTO_BACKEND=ptx (python -m dev.compile_check)
    DEFAULT = make_mma_decode(4, 2)
