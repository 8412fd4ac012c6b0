"""What the inline-PTX device functions share: `instruction(text)`, a device function that is
one PTX instruction of no operands (griddepcontrol.wait, cp.async.commit_group, ...), ordered
against the memory accesses around it by a "memory" clobber; `element_address`, the generic
address of an array's flat element, which an intrinsic passes to its PTX; `asm_tuple`, PTX
whose several outputs come back as a Numba tuple; and `warp_mma(text)`, the intrinsic of one
mma.sync form with four accumulators a lane. GPU only: the simulator has no PTX (its callers
define Python stand-ins there)."""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.cuda.extending import intrinsic


def instruction(text: str):
    """A device function of no arguments that runs the PTX `text`."""
    @intrinsic
    def run(typingctx):
        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), text, "~{memory}",
                               side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()
        return types.void(), codegen
    return run


def element_address(context, builder, array_type, array, index_type, index):
    """In an intrinsic's codegen: the generic address (a 64-bit integer) of flat element
    `index` of C-contiguous `array` (its data pointer + index)."""
    a = context.make_array(array_type)(context, builder, array)
    i = context.cast(builder, index, index_type, types.int64)
    return builder.ptrtoint(builder.gep(a.data, [i]), ir.IntType(64))


def asm_tuple(context, builder, sig, text: str, constraints: str, out_types, args):
    """In an intrinsic's codegen: PTX `text` (no side effects) on the LLVM values `args`,
    its outputs (LLVM types `out_types`) returned as sig.return_type's tuple."""
    fn = ir.FunctionType(ir.LiteralStructType(out_types), [a.type for a in args])
    out = builder.call(ir.InlineAsm(fn, text, constraints, side_effect=False), list(args))
    return context.make_tuple(builder, sig.return_type,
                              [builder.extract_value(out, i) for i in range(len(out_types))])


def tuple_asm(in_type, out_type, count: int, text: str, constraints: str):
    """An intrinsic (x) -> `count` values of `out_type`: PTX `text` (no side effects) on x of
    Numba type `in_type`, its outputs $0 .. $count-1, x $count."""
    @intrinsic
    def op(typingctx, x):
        if x != in_type:
            return None
        sig = types.UniTuple(out_type, count)(x)

        def codegen(context, builder, sig, args):
            return asm_tuple(context, builder, sig, text, constraints,
                             [context.get_value_type(out_type)] * count, args)
        return sig, codegen
    return op


def warp_mma(text: str):
    """An intrinsic (a0..a3, b0, b1, c0..c3) -> (d0..d3): D = A B + C for one warp by the
    mma.sync instruction `text` (its A fragment four uint32 a lane, B two, C and D four
    float32), e.g. "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32"."""
    f32 = ir.FloatType()

    @intrinsic
    def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        if not all(a == types.uint32 for a in (a0, a1, a2, a3, b0, b1)) or \
                not all(c == types.float32 for c in (c0, c1, c2, c3)):
            return None
        sig = types.UniTuple(types.float32, 4)(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

        def codegen(context, builder, sig, args):
            return asm_tuple(context, builder, sig,
                             f"{text} {{$0, $1, $2, $3}}, {{$4, $5, $6, $7}}, {{$8, $9}}, "
                             "{$10, $11, $12, $13};",
                             "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [f32] * 4, args)
        return sig, codegen
    return mma
