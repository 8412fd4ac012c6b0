"""What the inline-PTX device functions share: `instruction(text)`, a device function that is
one PTX instruction of no operands (griddepcontrol.wait, cp.async.commit_group, ...), ordered
against the memory accesses around it by a "memory" clobber; and `element_address`, the
generic address of an array's flat element, which an intrinsic passes to its PTX. GPU only:
the simulator has no PTX (its callers define Python stand-ins there)."""
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
