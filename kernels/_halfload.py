"""Sixteen-byte loads of float16: eight elements in one instruction, widened to float32.

A decode GEMM streams its weight once, so its speed is the bytes each SM keeps in flight. A
float16 element loaded alone is 2 bytes an instruction (a warp's load is 64 bytes); `load8`
issues one 16-byte load (PTX ld.global.nc.v4.b32: the weight is read-only while the kernel
runs) and converts its eight halves to float32 in registers (cvt.f32.f16), so a lane keeps
eight times the bytes in flight for the same instructions.

    load8(dst, i, src, j)   dst[i:i+8] = float32(src's flat elements j..j+7); dst a local
                            float32 array, src a C-contiguous float16 array in global memory,
                            element j 16-byte aligned (the caller checks: j a multiple of 8,
                            src's data 16-byte aligned).

The simulator converts element by element.
"""
from __future__ import annotations

from proto.device.backend import SIMULATOR

if SIMULATOR:
    import numpy as np

    def load8(dst, i, src, j):
        flat = src.reshape(src.size)
        for e in range(8):
            dst[i + e] = np.float32(flat[int(j) + e])
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _PTX = ("{ .reg .u64 g; .reg .b32 r<4>; .reg .b16 h<8>; cvta.to.global.u64 g, $8; "
            "ld.global.nc.v4.b32 {r0, r1, r2, r3}, [g]; "
            "mov.b32 {h0, h1}, r0; mov.b32 {h2, h3}, r1; "
            "mov.b32 {h4, h5}, r2; mov.b32 {h6, h7}, r3; "
            + " ".join(f"cvt.f32.f16 ${e}, h{e};" for e in range(8)) + " }")

    @intrinsic
    def load8(typingctx, dst, i, src, j):
        def codegen(context, builder, sig, args):
            dty, ity, sty, jty = sig.args
            f32, i64 = ir.FloatType(), ir.IntType(64)
            d = context.make_array(dty)(context, builder, args[0])
            s = context.make_array(sty)(context, builder, args[2])
            di = context.cast(builder, args[1], ity, types.int64)
            sj = context.cast(builder, args[3], jty, types.int64)
            # a C-contiguous array's flat element j is data + j (a generic address)
            saddr = builder.ptrtoint(builder.gep(s.data, [sj]), i64)
            asm = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([f32] * 8), [i64]), _PTX,
                               ",".join(["=f"] * 8 + ["l"]), side_effect=False)
            out = builder.call(asm, [saddr])
            for e in range(8):
                ptr = builder.gep(d.data, [builder.add(di, ir.Constant(i64, e))])
                builder.store(builder.extract_value(out, e), ptr)
            return context.get_dummy_value()
        if not (isinstance(dst, types.Array) and dst.dtype == types.float32
                and isinstance(src, types.Array) and src.dtype == types.float16):
            return None
        return types.void(dst, i, src, j), codegen
