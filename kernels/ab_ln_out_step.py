"""A/B on the H200, one process: GPT-2's ln_2 fused into the attention projection's split-K
reduction (gemm's ln_out: `gemm_splitk_reduce_ln_kernel`, a block per row, so 5 blocks at a
beam of 5) against the plain reduction (grid-stride over every output) and a layernorm launch
after it (gemm's unfused ln_out path), in GPT-2 small's graphed step (kernels._ab_step:
positions 100, 512 and 1000, rounds interleaved, each one's planned arena, then a beam search
under each, whose tokens must be equal). The input layer norm went the same way at 8b3630b: a
launch beat normalizing inside the GEMM by 6 us a step (results/h200/profiles/
ab_step_8b3630b.txt). AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m kernels.ab_ln_out_step 2>&1 | tee $OUT/ab_ln_out_step.txt
"""
import contextlib
import sys

from kernels import _ab_step, gemm


@contextlib.contextmanager
def ln_out_launched(on: bool):
    """While on, no row fits the fused reduction (gemm() reads LN_THREADS for that choice
    alone once the kernels are compiled), so ln_out takes its unfused path."""
    threads = gemm.LN_THREADS
    if on:
        gemm.LN_THREADS = 0
    try:
        yield
    finally:
        gemm.LN_THREADS = threads


def main() -> int:
    return _ab_step.run({"fused": lambda: ln_out_launched(False),
                         "launch": lambda: ln_out_launched(True)})


if __name__ == "__main__":
    sys.exit(main())
