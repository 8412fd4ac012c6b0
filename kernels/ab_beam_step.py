"""A/B on the H200, one process: the WHILE graph's beam step with the choice made in beam
top-k's last block (`sampling.beam_step`, `beam_topk_choose_kernel`: three launches a token)
against beam_topk then beam_advance (`CHOOSE_IN_TOPK` off: four, the choice a one-thread
launch of its own, 4.0 us a token in end_to_end_kernels.csv at ea6d5f4), in GPT-2 small's
WHILE graph (kernels._ab_step; the step itself does not change, so its positions should
not move). Why: a WHILE token is 1.159x a step at ea6d5f4 (goal 1.15), about 76 us a token
of search beyond the step's kernels. AB_TOY=1 checks the script on the simulator.

    PYTHONUNBUFFERED=1 python3 -m kernels.ab_beam_step 2>&1 | tee $OUT/ab_beam_step.txt
"""
import sys

from kernels import _ab_step, sampling
from kernels._ab_step import describe, patched


def main() -> int:
    variants = {"choice_in_topk": lambda: patched(sampling, CHOOSE_IN_TOPK=[True]),
                "choice_launch": lambda: patched(sampling, CHOOSE_IN_TOPK=[False])}
    if not _ab_step.TOY:
        describe("beam_topk", sampling.beam_topk_kernel)
        describe("beam_topk_choose", sampling.beam_topk_choose_kernel)
    return _ab_step.run(variants)


if __name__ == "__main__":
    sys.exit(main())
