"""A/B on the H200, one process: the MLP by kernels.mlp's fused kernel and sum (2 launches)
against kernels.gemm's fc and projection (3 launches: `mlp.fuses` forced False while that
model's graphs record), and the fused kernel at twice the hidden columns a block (`mlp.C`
doubled: half the partials), in GPT-2 small's graphed step (dev.ab._ab_step: positions 100,
512 and 1000, rounds interleaved, each one's planned arena, then a beam search under each,
whose tokens must be equal). AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m dev.ab.ab_mlp_step 2>&1 | tee $OUT/ab_mlp_step.txt
"""
import sys

from dev.ab import _ab_step
from kernels import mlp


def main() -> int:
    gemm_only = lambda *shape: False   # noqa: E731 (the fused kernel fits no shape)
    return _ab_step.run({"gemm": lambda: _ab_step.patched(mlp, fuses=gemm_only),
                         "fused": lambda: _ab_step.patched(mlp),
                         "fused_2c": lambda: _ab_step.patched(mlp, C=2 * mlp.C)})


if __name__ == "__main__":
    sys.exit(main())
