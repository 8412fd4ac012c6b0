"""A device function that is one PTX instruction of no operands (griddepcontrol.wait,
cp.async.commit_group, ...), ordered against the memory accesses around it by a "memory"
clobber. GPU only: the simulator has no PTX (its callers define Python stand-ins there)."""
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
