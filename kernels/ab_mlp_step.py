"""A/B on the H200, one process: the MLP by kernels.mlp's fused kernel and sum (2 launches)
against kernels.gemm's fc and projection (3 launches: `mlp.fuses` forced False while that
model's graphs record), and the fused kernel at twice the hidden columns a block (`mlp.C`
doubled: half the partials), in GPT-2 small's graphed step (kernels._ab_step: positions 100,
512 and 1000, rounds interleaved, each one's planned arena, then a beam search under each,
whose tokens must be equal). AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m kernels.ab_mlp_step 2>&1 | tee $OUT/ab_mlp_step.txt
"""
import contextlib
import sys

from kernels import _ab_step, mlp


@contextlib.contextmanager
def variant(fused: bool, c: int):
    fuses, C = mlp.fuses, mlp.C
    mlp.fuses = fuses if fused else (lambda *shape: False)
    mlp.C = c
    try:
        yield
    finally:
        mlp.fuses, mlp.C = fuses, C


def main() -> int:
    return _ab_step.run({"gemm": lambda: variant(False, mlp.C),
                         "fused": lambda: variant(True, mlp.C),
                         "fused_2c": lambda: variant(True, 2 * mlp.C)})


if __name__ == "__main__":
    sys.exit(main())
