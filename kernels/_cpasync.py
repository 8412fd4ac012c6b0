"""Asynchronous copies from global to shared memory (PTX cp.async, sm_80 and later).

A thread that loads a weight into a register holds that register until the load returns, so
the bytes one SM keeps in flight are bounded by its registers: a decode GEMM, which only
streams its weight, waits on memory latency with most of HBM idle. `copy16` issues a 16-byte
copy that lands in shared memory without passing through a register: a block can put its
whole weight tile in flight with a dozen instructions a thread, then compute from shared
memory once `wait_all()` and a block barrier say it has arrived.

    copy16(dst, i, src, j)   dst[i:i+4] = the 4 floats of src from flat element j on; dst a
                             1-D shared float32 array, src a C-contiguous float32 array in
                             global memory (any number of dimensions), both addresses
                             16-byte aligned (the caller checks);
    wait_all()               this thread's copies have landed (cp.async.wait_all); follow it
                             with cuda.syncthreads() before reading other threads' copies.

A pipeline of stages (the tiled GEMM's `stages`): each stage's copies are a group,
    copy4(dst, i, src, j, n)  dst[i] = src's flat element j where n = 4, zero where n = 0
                             (the element lies outside the operand: src is not read), a
                             4-byte copy, so a thread may scatter a tile into shared memory
                             transposed;
    commit()                 closes this thread's group of copies (cp.async.commit_group);
    wait_pending(n)          returns once at most n of this thread's groups are still in
                             flight (cp.async.wait_group n; n a compile-time constant:
                             `wait_pending` is a factory).

The simulator copies at once (its threads run one Python statement at a time).
"""
from __future__ import annotations

from proto.device.backend import SIMULATOR

if SIMULATOR:
    import numpy as np

    def copy16(dst, i, src, j):
        for q in range(4):
            dst[i + q] = src[np.unravel_index(int(j) + q, src.shape)]

    def wait_all():
        pass

    def copy4(dst, i, src, j, n):
        dst[i] = src[int(j)] if n else np.float32(0)

    def commit():
        pass

    def wait_pending(n: int):
        def wait():
            pass
        return wait
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from kernels._ptx import element_address, instruction

    @intrinsic
    def copy16(typingctx, dst, i, src, j):
        def codegen(context, builder, sig, args):
            dty, ity, sty, jty = sig.args
            i64 = ir.IntType(64)
            daddr = element_address(context, builder, dty, args[0], ity, args[1])
            saddr = element_address(context, builder, sty, args[2], jty, args[3])
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [i64, i64]),
                "{ .reg .u64 a; .reg .u32 b; cvta.to.shared.u64 a, $0; cvt.u32.u64 b, a; "
                "cp.async.cg.shared.global [b], [$1], 16; }",
                "l,l,~{memory}", side_effect=True)
            builder.call(asm, [daddr, saddr])
            return context.get_dummy_value()
        return types.void(dst, i, src, j), codegen

    wait_all = instruction("cp.async.wait_all;")

    @intrinsic
    def copy4(typingctx, dst, i, src, j, n):
        def codegen(context, builder, sig, args):
            dty, ity, sty, jty, nty = sig.args
            i64, i32 = ir.IntType(64), ir.IntType(32)
            daddr = element_address(context, builder, dty, args[0], ity, args[1])
            saddr = element_address(context, builder, sty, args[2], jty, args[3])
            nn = context.cast(builder, args[4], nty, types.uint32)
            asm = ir.InlineAsm(
                ir.FunctionType(ir.VoidType(), [i64, i64, i32]),
                "{ .reg .u64 a; .reg .u32 b; cvta.to.shared.u64 a, $0; cvt.u32.u64 b, a; "
                "cp.async.ca.shared.global [b], [$1], 4, $2; }",
                "l,l,r,~{memory}", side_effect=True)
            builder.call(asm, [daddr, saddr, nn])
            return context.get_dummy_value()
        return types.void(dst, i, src, j, n), codegen

    commit = instruction("cp.async.commit_group;")

    def wait_pending(n: int):
        return instruction(f"cp.async.wait_group {int(n)};")
